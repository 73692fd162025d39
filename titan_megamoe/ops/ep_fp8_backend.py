"""Host steps of blockwise FP8 ("fp8", "fp8_bwd") with expert parallelism (EP = R ranks), forward and
backward, v1: the communication of the bf16 EP path (``ops/ep_backend.py``; the forward of "fp8" with
an FP8 x payload, below) around the local expert compute of the FP8 path at EP = 1
(``ops/fp8_backend.fp8_experts_fwd`` / ``fp8_experts_bwd``).

Shape legend: T tokens of this rank (<= T_cap), K top_k, D model dim, F expert hidden dim, E_l local
experts, j = src * T_cap + t a slab row of the receive side (see ``comm/workspace.py``), T' = R * T_cap
slab rows, N_cap' rows of the receive layout.

Forward, on every rank (same barriers as ``ep_backend.ep_forward_steps``, no host sync):
    barrier -> dispatch (ids / scores of all T_cap rows to every rank; the x rows once per (token,
    rank)) -> barrier -> receive layout from the slab's ids, BM = 128 (also in the interpreter),
    capped at ``max_rows`` -> "fp8": FP8 GEMM1 (+ SwiGLU, h quantized in its epilogue) -> FP8 GEMM2
    (+ score) by layout row; "fp8_bwd": the bf16 GEMM1 / GEMM2 at BM = 128 -> combine_push (fp32
    pre-sum of a slab row's slots into the source's comb[rank, t]) -> barrier -> combine_sum (rank
    order, fp32 -> bf16).

The x payload of "fp8" (``FP8_DISPATCH``, or the ``payload`` argument):
    "fp8" (default): x quantized 1x128 on the source, once per token, inside the push kernel
        (``ep_comm.dispatch_push_fp8``: bf16 row read, quantized in registers, e4m3 row + fp32 scales
        stored into each destination's xq / xs slab); GEMM1 reads the received xq / xs directly.
        ``D + 4 D / 128`` bytes per (token, destination) row: 2112 at D = 2048.
    "bf16" (v1): bf16 rows pushed into the x slab (``2 D`` bytes per row: 4096), then the x slab
        quantized 1x128 on the receiving rank (only the rows with a placed slot; the others may hold
        another call's data or the 0xFF poison).
    Both quantize each row with the same math (``fp8_quant``'s helpers) and feed the same GEMMs:
    bitwise the same outputs and gradients (tests/test_ep_fp8_dispatch.py). "fp8_bwd" always
    dispatches bf16 (its forward is bf16).
Backward (both precisions, the FP8 backward): barrier -> dispatch_push of x and dy (bf16) ->
barrier -> dy slab quantized 1x128 (placed rows only) -> FP8 GEMM2 dgrad + SwiGLU bwd + d score
partials (+ s*h 128x1) -> dgate_up 1x128 | 128x1 -> FP8 wgrads of the local experts -> FP8 GEMM1
dgrad -> dscore_push, combine_push of the dx rows -> barrier -> combine_sum.

Not done yet: the backward still dispatches bf16 x and dy. dy's 1x128 quantization is per row and
could move to the source as x's did, but the wgrads' 128x1 groups of x and dy (transposed) span 128
*received* rows of an expert, so they need the bf16 rows on the receiving rank anyway (an FP8 payload
there would change the wgrad's numbers, not only its bytes). No overlap (``ep_forward_steps_v2``).

The forward of "fp8_bwd" runs the bf16 kernels of the bf16 EP forward, at BM = 128 (the FP8 backward's
128-row scale groups must not straddle two experts, so its layout is the one the backward reads).

Generators yielding the barrier's site name at each barrier, as ``ep_backend``: ``run_with_barriers``
on GPUs, ``run_lockstep`` with emulated peers in the CPU tests.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Generator

import torch
from torch import Tensor

from titan_megamoe.kernels import ep_comm
from titan_megamoe.kernels.routing import RoutingLayout, build_routing_layout
from titan_megamoe.ops.ep_backend import EPRank, backward_combine, backward_dispatch, forward_combine, forward_dispatch
from titan_megamoe.ops.fp8_backend import (
    FP8_BLOCK_M,
    NONFINITE,
    fp8_experts_bwd,
    fp8_experts_fwd,
    placed_token_rows,
)

__all__ = ["FP8_DISPATCH", "FP8_DISPATCH_CHOICES", "ep_fp8_forward_steps", "ep_fp8_backward_steps"]

Steps = Generator[str, None, tuple]  # yields the barrier's site name (comm/signals.py SITES)

#: x payload of the forward dispatch of precision "fp8" (module docstring): "fp8" (default; e4m3 rows +
#: fp32 scales, quantized on the source) or "bf16" (v1: bf16 rows, quantized on the receiving rank).
#: Same results bit for bit; kept so benchmarks can time both in one process (set it directly, as
#: tests/ep_triton_worker.py does) or a run can go back to v1 (TITAN_MEGAMOE_FP8_DISPATCH=bf16, read at
#: import). Read at every forward call; ``ep_fp8_forward_steps(payload=...)`` overrides it per call.
FP8_DISPATCH = os.environ.get("TITAN_MEGAMOE_FP8_DISPATCH", "fp8")
FP8_DISPATCH_CHOICES = ("fp8", "bf16")


def _no_mark(label: str) -> None:
    pass


def _check_ctx(ctx: EPRank) -> None:
    if ctx.block_m != FP8_BLOCK_M:
        raise ValueError(f"the FP8 EP steps need EPRank.block_m = {FP8_BLOCK_M} (one 128-row scale group per "
                         f"layout block), got {ctx.block_m}")


def ep_fp8_forward_steps(ctx: EPRank, x_TD: Tensor, topk_ids_TK: Tensor, topk_scores_TK: Tensor, w1: Tensor,
                         w2: Tensor, w3: Tensor, wq: list[Tensor], fp8_forward: bool, layer_name: str = "moe",
                         mark: Callable[[str], None] = _no_mark, payload: str | None = None) -> Steps:
    """Forward of one layer on this rank, precision "fp8" (``fp8_forward``) or "fp8_bwd"; yields at each
    barrier (module docstring).

    Args:
        ctx: this rank's peers, workspace layout, E_l, receive capacity ``max_rows`` and
            ``block_m == FP8_BLOCK_M`` (128).
        x_TD: (T, D) bf16, T <= T_cap; topk_ids_TK: (T, K) global expert ids; topk_scores_TK: (T, K) fp32.
        w1, w3: (E_l, F, D), w2: (E_l, D, F) this rank's experts (bf16 or fp32; read by the bf16
            forward of "fp8_bwd" only).
        wq: ``fp8_backend.prepare_weights`` of the local weights (12 tensors for "fp8", 6 for "fp8_bwd").
        fp8_forward: True: FP8 GEMMs; False: the bf16 GEMMs.
        layer_name: named in non-finite reports.
        mark: called on the host after each phase with ``barrier0, dispatch, barrier1, layout``, the
            labels of ``fp8_experts_fwd`` (``gemm1, gemm2``, after ``quant_x`` with the bf16 payload),
            then ``combine_push, barrier2, combine_sum`` (``compare/ep_overlap.py`` style; default nothing).
            With the FP8 payload the x quantization is part of ``dispatch``.
        payload: x payload of "fp8", "fp8" or "bf16" (module docstring); None: :data:`FP8_DISPATCH`.
            Ignored by "fp8_bwd" (bf16 rows).

    Returns (via StopIteration.value):
        (out (T, D) bf16, gate_up (N_cap', 2F) bf16, receive layout (BM = 128)).

    Raises:
        ValueError: ``ctx.block_m`` is not 128; ``payload`` / ``FP8_DISPATCH`` not one of
            :data:`FP8_DISPATCH_CHOICES`; the kernels' launchers (shapes, dtypes, D not a multiple of 128).
    """
    _check_ctx(ctx)
    payload = FP8_DISPATCH if payload is None else payload
    if payload not in FP8_DISPATCH_CHOICES:
        raise ValueError(f"{layer_name}: FP8 dispatch payload {payload!r} (TITAN_MEGAMOE_FP8_DISPATCH / "
                         f"ep_fp8_backend.FP8_DISPATCH / payload=); choose one of {FP8_DISPATCH_CHOICES}")
    fp8_payload = fp8_forward and payload == "fp8"
    count = torch.zeros(1, dtype=torch.int32, device=x_TD.device) if fp8_payload else None
    yield from forward_dispatch(ctx, x_TD, topk_ids_TK, topk_scores_TK, mark, fp8_payload=fp8_payload,
                                nonfinite_count=count, name=f"{layer_name} x")
    if fp8_payload:  # x's groups counted on the source, once per token (the slab is not quantized again)
        NONFINITE.record(f"{layer_name} forward x (dispatch)", count)
    layout = build_routing_layout(ctx.received("ids"), ctx.experts_per_rank, FP8_BLOCK_M, max_rows=ctx.max_rows)
    if fp8_payload:  # GEMM1 gathers the placed rows of the received e4m3 slab (the others: stale / poison)
        x_rows, x_index, x_q = None, None, (ctx.received("xq"), ctx.received("xs"))
    else:  # bf16 slab; "fp8": quantized here, placed rows only (the bf16 GEMM1 gathers placed rows only)
        x_rows, x_q = ctx.received("x"), None
        x_index = placed_token_rows(layout) if fp8_forward else None
    mark("layout")
    y_rows, gate_up = fp8_experts_fwd(x_rows, ctx.received("scores"), layout, w1, w2, w3, wq, fp8_forward,
                                      layer_name, by_row=True, x_rows_index=x_index, x_quantized=x_q, mark=mark)
    out = yield from forward_combine(ctx, y_rows, layout, topk_ids_TK, mark)
    return out, gate_up, layout


def ep_fp8_backward_steps(ctx: EPRank, dout_TD: Tensor, x_TD: Tensor, topk_ids_TK: Tensor, topk_scores_TK: Tensor,
                          wq_bwd: list[Tensor], gate_up: Tensor, layout: RoutingLayout, w_dtype: torch.dtype,
                          layer_name: str = "moe", mark: Callable[[str], None] = _no_mark) -> Steps:
    """FP8 backward of one layer on this rank (both precisions); yields at each barrier.

    Args:
        ctx: as the forward's. dout_TD: (T, D) bf16; x_TD, topk_ids_TK, topk_scores_TK: the forward's.
        wq_bwd: the transposed FP8 local weights [w1t_q, w1t_s, w3t_q, w3t_s, w2t_q, w2t_s].
        gate_up, layout: saved by :func:`ep_fp8_forward_steps`.
        w_dtype: dtype of dw1..dw3 (bf16, or fp32 for fp32 master weights).
        layer_name: named in non-finite reports.
        mark: labels ``barrier0, dispatch, barrier1, placed_rows`` (the gather index of dy's
            quantization), the labels of ``fp8_experts_bwd`` (``quant_dout, gemm2_dgrad, quant_dgate_up,
            quant_dout_T, wgrad_w2, quant_x_T, wgrad_w13, gemm1_dgrad``), then ``dscore_push, combine_push,
            barrier2, combine_sum``.

    Returns:
        (dx (T, D) bf16, dscores (T, K) fp32, dw1 (E_l, F, D), dw2 (E_l, D, F), dw3 (E_l, F, D) in
        ``w_dtype``; exact zeros for local experts that received no row).

    Raises:
        ValueError: ``ctx.block_m`` is not 128; the kernels' launchers.
    """
    _check_ctx(ctx)
    p, ws = ctx.peers, ctx.ws
    yield from backward_dispatch(ctx, x_TD, dout_TD, topk_ids_TK, topk_scores_TK, mark)
    dout_index = placed_token_rows(layout)
    mark("placed_rows")
    dx_rows, part, dw1, dw2, dw3 = fp8_experts_bwd(
        ctx.received("dy"), ctx.received("x"), ctx.received("scores"), wq_bwd, gate_up, layout, w_dtype, layer_name,
        dout_rows_index=dout_index, mark=mark)
    ep_comm.dscore_push(part, layout, ws, p.ptr_table())
    mark("dscore_push")
    ep_comm.combine_push(dx_rows, layout, ws, p.ptr_table(), p.rank)
    mark("combine_push")
    dx, dscores = yield from backward_combine(ctx, x_TD.shape[0], topk_ids_TK, mark)
    return dx, dscores, dw1, dw2, dw3
