"""Inputs, routings and tolerances shared by tests/ and compare/ (never retyped elsewhere).

Shape legend: T tokens, D model dim, F expert hidden dim, E routed experts, K top_k, R EP ranks.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "ROUTINGS",
    "TOLERANCES",
    "FP8_REL_BOUNDS",
    "BENCH_SHAPES",
    "bench_layer_inputs",
    "make_routing",
    "rel_err",
    "assert_close_rel",
    "stock_histc_on_cpu",
    "build_moe_pair",
]

#: Relative-error bounds ||a - b|| / ||b|| per dtype. fp32: same math, different summation order
#: (the reference pre-sums per rank, stock sums all K at once) -> a few ulps of fp32 over sums of
#: <= K*F terms; bf16: operands rounded to 8 mantissa bits (2^-8 = 3.9e-3 per rounding) with several
#: roundings in a chain (x, h, y, output), as METHOD.md's 1e-3..1e-2 band for bf16 operands.
TOLERANCES: dict[torch.dtype, float] = {
    torch.float64: 1e-10,
    torch.float32: 2e-5,
    torch.bfloat16: 2e-2,
}

#: Blockwise FP8 (e4m3, 1x128 / 128x128 / 128x1 scales) vs the unquantized reference, norm-wise
#: relative error per precision, for the layer output and for every gradient (dx, dscores, dw1-3).
#: Derivation: one e4m3-rounded operand is 2.5 % off (3 mantissa bits, tests/test_kernels_fp8.py);
#: a GEMM of two quantized operands 3.5 % (errors in quadrature). Output ("fp8"): two chained GEMMs
#: with h requantized, sqrt(5.3^2 + 2.5^2 + 2.5^2) = 6.4 % (measured 5.8-6.7 %): bound 8 %. Gradients:
#: dgate_up comes from dout_q w2_q (3.5 %) and the forward's gate / up (3.5 % in "fp8", bf16 in
#: "fp8_bwd"), then is quantized again (2.5 %) for dx = dgate_up_q w1_q and dw1 = dgate_up_q^T x_q:
#: ~5-6.5 % (measured 6.2-6.8 % fp8, 2.9-5.5 % fp8_bwd on the CPU cases): bounds 10 % and 8 %.
#: "fp8_bwd"'s output is the bf16 kernels': the bf16 tolerance.
FP8_REL_BOUNDS: dict[str, dict[str, float]] = {
    "fp8": {"out": 0.08, "grad": 0.10},
    "fp8_bwd": {"out": 2e-2, "grad": 0.08},
}

#: Named routings: what each one stresses.
ROUTINGS = {
    "uniform": "random distinct experts per token (near-uniform load)",
    "skewed": "Zipf-like expert popularity (hot experts, long tail)",
    "zero_expert": "some experts get no token at all",
    "one_expert": "every token picks expert 0 (plus K-1 others): one expert gets all T rows",
    "one_rank": "every token's experts live on rank 0: other ranks compute nothing",
    "empty_rank": "no token routes to the last rank",
}



#: The layer shapes the kernel benches and sweeps time: (T, E, K, D, F) with 16384 tokens.
BENCH_SHAPES = {"30b": (16384, 128, 8, 2048, 768), "235b": (16384, 128, 8, 4096, 1536)}


def bench_layer_inputs(shape: str, device="cuda", seed: int = 0):
    """Random inputs of one MoE layer at a bench shape ("30b" / "235b", ``BENCH_SHAPES``), drawn in a
    fixed order after ``torch.manual_seed(seed)``: x (T, D) bf16, w1 / w3 (E, F, D) and w2 (E, D, F)
    bf16 scaled by 1/sqrt(fan-in), ids (T, K) distinct experts per token (near-uniform), scores (T, K)
    fp32 softmax, dout (T, D) bf16 (last, so callers' later draws follow it).

    Returns:
        SimpleNamespace(T, E, K, D, F, x, w1, w2, w3, ids, scores, dout).
    """
    from types import SimpleNamespace

    T, E, K, D, F = BENCH_SHAPES[shape]
    torch.manual_seed(seed)
    x = torch.randn(T, D, device=device).bfloat16()
    w1 = (torch.randn(E, F, D, device=device) / D**0.5).bfloat16()
    w3 = (torch.randn(E, F, D, device=device) / D**0.5).bfloat16()
    w2 = (torch.randn(E, D, F, device=device) / F**0.5).bfloat16()
    ids = torch.rand(T, E, device=device).topk(K, dim=1).indices
    scores = torch.softmax(torch.randn(T, K, device=device), -1).float()
    dout = torch.randn(T, D, device=device).bfloat16()
    return SimpleNamespace(T=T, E=E, K=K, D=D, F=F, x=x, w1=w1, w2=w2, w3=w3, ids=ids, scores=scores, dout=dout)

def _distinct_topk(weights_TE: Tensor, K: int, gen: torch.Generator) -> Tensor:
    # multinomial without replacement gives K distinct experts per token
    return torch.multinomial(weights_TE, K, replacement=False, generator=gen)


def make_routing(
    kind: str,
    T: int,
    E: int,
    K: int,
    *,
    ep: int = 1,
    seed: int = 0,
    zipf_s: float = 1.2,
) -> Tensor:
    """Top-k expert ids (T, K) int64, distinct per token, for a named routing (see ``ROUTINGS``).

    Raises:
        ValueError: unknown kind, or a kind that cannot hold K distinct experts (e.g. "one_rank"
            with fewer than K experts per rank).
    """
    if kind not in ROUTINGS:
        raise ValueError(f"unknown routing {kind!r}; choose one of {sorted(ROUTINGS)}")
    if K > E:
        raise ValueError(f"top_k={K} > num_experts={E}")
    gen = torch.Generator().manual_seed(seed)
    e = E // ep
    w = torch.ones(T, E)
    if kind == "skewed":
        ranks = torch.randperm(E, generator=gen).to(torch.float32) + 1.0
        w = (ranks ** (-zipf_s)).expand(T, E).clone()
    elif kind == "zero_expert":
        starved = torch.randperm(E, generator=gen)[: max(1, E // 4)]
        if E - starved.numel() < K:
            raise ValueError("zero_expert routing needs E - E//4 >= K")
        w[:, starved] = 0.0
    elif kind == "one_expert":
        rest = _distinct_topk(torch.ones(T, E - 1), K - 1, gen) + 1 if K > 1 else torch.empty(T, 0, dtype=torch.int64)
        return torch.cat([torch.zeros(T, 1, dtype=torch.int64), rest], 1)
    elif kind == "one_rank":
        if e < K:
            raise ValueError(f"one_rank routing needs experts per rank ({e}) >= top_k ({K})")
        w[:, e:] = 0.0
    elif kind == "empty_rank":
        if E - e < K:
            raise ValueError(f"empty_rank routing needs E - e ({E - e}) >= top_k ({K})")
        if ep > 1:
            w[:, E - e:] = 0.0
    return _distinct_topk(w, K, gen)


def rel_err(a: Tensor, b: Tensor) -> float:
    """||a - b|| / ||b|| in float64 (inf if b is all zeros and a is not; NaN never passes)."""
    a64, b64 = a.detach().to(torch.float64), b.detach().to(torch.float64)
    num = torch.linalg.vector_norm(a64 - b64).item()
    den = torch.linalg.vector_norm(b64).item()
    if den == 0.0:
        return 0.0 if num == 0.0 else float("inf")
    return num / den


def assert_close_rel(actual: Tensor, expected: Tensor, dtype: torch.dtype | None = None, name: str = "") -> None:
    """Assert the relative error is within ``TOLERANCES[dtype]``; message carries the numbers."""
    if actual.shape != expected.shape:
        raise AssertionError(f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}")
    if not torch.isfinite(actual).all():
        raise AssertionError(f"{name}: non-finite values in result")
    tol = TOLERANCES[dtype or expected.dtype]
    err = rel_err(actual, expected)
    if not err <= tol:
        diff = (actual.detach().double() - expected.detach().double()).abs()
        idx = int(diff.argmax())
        raise AssertionError(
            f"{name}: relative error {err:.3e} > {tol:.1e} (max abs diff {diff.max().item():.3e} at "
            f"flat index {idx}; |expected| max {expected.detach().abs().max().item():.3e})"
        )


@contextlib.contextmanager
def stock_histc_on_cpu():
    """Let stock TorchTitan's MoE run on CPU: it calls ``torch.histc`` on int64 expert ids, which
    only CUDA implements. Inside the context, int inputs are counted in float and the counts
    returned in the input's integer dtype, as CUDA does."""
    orig = torch.histc

    def histc(input, bins=100, min=0, max=0, **kw):  # noqa: A002 - torch's own names
        if not input.dtype.is_floating_point:
            return orig(input.to(torch.float32), bins=bins, min=min, max=max, **kw).to(input.dtype)
        return orig(input, bins=bins, min=min, max=max, **kw)

    torch.histc = histc
    try:
        yield
    finally:
        torch.histc = orig


@dataclass
class MoEPair:
    stock: torch.nn.Module
    mega: torch.nn.Module


def build_moe_pair(moe_args, dim: int, hidden_dim: int, *, dtype=torch.float32, seed: int = 0, config=None) -> MoEPair:
    """A stock TorchTitan ``MoE`` and a ``MegaMoE`` holding equal (cloned) weights, on CPU.

    The stock layer runs TorchTitan's own code; the MegaMoE is built by the converter path
    (``MegaMoE.from_moe`` on a deep copy), so both start from TorchTitan's init. ``config`` defaults to the
    reference backend (the oracle; pass a config for the fused kernels).
    """
    import copy

    from torchtitan.models.moe.moe import MoE

    from titan_megamoe.config import MegaMoEConfig
    from titan_megamoe.layer import MegaMoE

    config = config if config is not None else MegaMoEConfig(backend="reference")

    torch.manual_seed(seed)
    stock = MoE(moe_args, dim=dim, hidden_dim=hidden_dim)
    with torch.no_grad():
        stock.init_weights(0.02, torch.device("cpu"))
        # Non-trivial expert_bias so selection differs from pure scores (still equal in both layers).
        if stock.expert_bias is not None:
            stock.expert_bias.copy_(torch.randn(moe_args.num_experts) * 1e-3)
    stock = stock.to(dtype)
    if stock.expert_bias is not None:
        stock.expert_bias = stock.expert_bias.float()
    stock.tokens_per_expert = stock.tokens_per_expert.float()
    mega = MegaMoE.from_moe(copy.deepcopy(stock), config=config)
    return MoEPair(stock, mega)


@contextlib.contextmanager
def single_rank_group(tmp_dir):
    """A one-rank gloo default process group (file store under ``tmp_dir``) for the duration, unless one
    exists already (then that one is used and left alone). Yields the WORLD group's name, which the EP
    custom ops take (their fakes look the group up by name)."""
    import torch.distributed as dist

    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", init_method=f"file://{tmp_dir}/pg", rank=0, world_size=1)
    try:
        yield dist.group.WORLD.group_name
    finally:
        if owned:
            dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gloo_worker(rank: int, world_size: int, port: int, fn, args, timeout_s: float) -> None:
    import datetime
    import os
    import traceback

    import torch.distributed as dist

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group(
        "gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s)
    )
    torch.set_num_threads(1)
    try:
        fn(rank, world_size, *args)
        failure = ""
    except Exception:  # gathered and raised once by rank 0, so no rank hangs on a collective
        failure = f"rank {rank}:\n{traceback.format_exc()}"
    failures = [None] * world_size
    dist.all_gather_object(failures, failure)
    dist.destroy_process_group()
    bad = [f for f in failures if f]
    if bad and rank == 0:
        raise AssertionError("\n".join(bad))
    # Every rank's result is in: leave without the interpreter's C++ teardown, where rank 0 (the
    # TCPStore host) sometimes aborts with "terminate called without an active exception" under load
    # (seen in 2 of 3 CPU suite runs on 2026-11-30, in different tests, after correct results).
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_gloo(fn, world_size: int, *args, timeout_s: float = 120.0) -> None:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` CPU processes joined by a gloo group.

    ``fn`` must be importable (module level). Failures of all ranks are gathered and re-raised
    here as one AssertionError; the process group has a timeout, so a missing rank cannot hang.
    """
    import torch.multiprocessing as mp

    mp.spawn(_gloo_worker, args=(world_size, _free_port(), fn, args, timeout_s), nprocs=world_size, join=True)
