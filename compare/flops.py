"""FLOP model of one MoE layer (the numbers behind every TFLOP/s and compute-floor figure).

Shape legend: T tokens on one rank, D model dim, F expert hidden dim, K top_k.

Counted: the routed expert GEMMs only. Each of the T * K routed (token, expert) rows goes through
three GEMMs of D x F multiply-adds each (gate ``W1 x``, up ``W3 x``, down ``W2 h``)::

    forward  = 2 * T * K * D * F * 3                       (2 FLOP per multiply-add)
    backward = 2 * forward                                  (dgrad + wgrad of each GEMM)
    fwd+bwd  = 3 * forward

Not counted: the router GEMM (2 * T * D * E, under 1 % of the layer at the presets), SwiGLU, the
weighted combine, permutes and communication. Rates are per rank (T is tokens per rank), so the
TFLOP/s figures are per GPU. Padding rows that stock TorchTitan adds for grouped-GEMM alignment are
not counted: they are overhead of that implementation, not useful work.

The compute floor of a phase is its FLOPs divided by the dense GEMM rate measured in the same run
(``compare.timing.measure_gemm_tflops``): the time the layer would take if every routed FLOP ran at
the speed of one large dense GEMM of the same precision.
"""

from __future__ import annotations

__all__ = ["routed_gemm_flops", "phase_flops", "floor_ms", "tflops"]


def routed_gemm_flops(tokens: int, top_k: int, dim: int, hidden: int) -> int:
    """Forward FLOPs of the routed expert GEMMs: 2 * T * K * D * F * 3 (Python int, no overflow)."""
    return 2 * int(tokens) * int(top_k) * int(dim) * int(hidden) * 3


def phase_flops(tokens: int, top_k: int, dim: int, hidden: int) -> dict[str, int]:
    """FLOPs per phase: {"fwd": f, "bwd": 2 f, "fwdbwd": 3 f}."""
    f = routed_gemm_flops(tokens, top_k, dim, hidden)
    return {"fwd": f, "bwd": 2 * f, "fwdbwd": 3 * f}


def floor_ms(flops_fwd: int, flops_bwd: int, rate_fwd_tflops: float | None,
             rate_bwd_tflops: float | None) -> dict[str, float | None]:
    """Compute floor per phase in ms, given the GEMM rate (TFLOP/s) of the forward and of the
    backward arithmetic (they differ for ``fp8_bwd``: bf16 forward, fp8 backward). None where a
    rate is unknown."""
    def ms(flops, rate):
        return None if not rate else flops / (rate * 1e12) * 1e3

    fwd, bwd = ms(flops_fwd, rate_fwd_tflops), ms(flops_bwd, rate_bwd_tflops)
    return {"fwd": fwd, "bwd": bwd, "fwdbwd": None if fwd is None or bwd is None else fwd + bwd}


def tflops(flops: int, ms: float | None) -> float | None:
    """Effective TFLOP/s of ``flops`` done in ``ms`` milliseconds (None if ms is missing or <= 0)."""
    if ms is None or ms <= 0:
        return None
    return flops / (ms * 1e-3) / 1e12
