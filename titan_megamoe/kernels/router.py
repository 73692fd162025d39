"""Fused token-choice top-k routing: scores, bias, top-k, gather, route_norm, route_scale and the
per-expert counts in one Triton launch (plus one ``torch.zeros`` for the counts).

Semantics: TorchTitan 0.2.2 ``torchtitan.models.moe.moe.TokenChoiceTopKRouter.forward`` after the
gate linear, without node-limited groups and without ``_debug_force_load_balance`` (the layer keeps
the torch code for those, ``titan_megamoe/layer.py``):

    scores = softmax(logits.float(), dim=1)  or  sigmoid(logits.float())       # fp32
    choice = scores + expert_bias  (or scores)                                  # selection only
    selected = topk(choice, top_k)
    top = scores.gather(1, selected)                                            # not choice
    top = top / (top.sum(-1, keepdim=True) + 1e-20)  if route_norm
    top = top * route_scale
    counts = histogram of selected over E experts (fp32)

Why: the layer's eager forward is host-bound until GEMM1 starts, and the router's ~12 eager torch
ops each cost host time (docs/NOTES.md, "Where the forward's host time goes"). Under ``torch.compile``
Inductor fuses the torch code itself, so the layer uses this only in eager mode.

Kernel: one program per BLOCK_T tokens holds the (BLOCK_T, E_PAD) fp32 tiles of scores and of the
choice values in registers (E_PAD = next power of two >= E, padded columns masked to -inf, never
selected) and runs K rounds of a row argmax. BLOCK_T = min(64, 4096 // E_PAD) with 4 warps keeps each
tile at <= 32 fp32 per thread (E <= 64 -> 64 tokens, E=128 -> 32, E=256 -> 16, E=1024 -> 4; half that
for odd E), so the two tiles plus the round's temporaries fit without spills (sm_90a, Triton 3.6:
E=128, K=8 bf16 takes 165-168 registers, E=256 K=8 187 bf16 / 241 fp32 logits; compile check in
tests/test_router_kernel.py). E is a constexpr: one build per model width.

Numerics: everything in fp32. Compiled, ``tl.exp`` is ``ex2.approx`` of x * log2(e) and fp32 ``/``
is ``div.full``: the scores can differ from torch's by a few ulps (the interpreter uses numpy),
which only matters for selections within a few ulps of a tie.

Counts: each program sums its (token, expert) selection mask over its tokens and ``tl.atomic_add`` s
the (E,) histogram into the zeroed fp32 counts. Every added value is an integer, so every partial
sum is exact (below 2**24 pairs per expert, as for the torch path's fp32 scatter_add) and the
result does not depend on the order of the atomics (deterministic).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from titan_megamoe.kernels import jit
from titan_megamoe.kernels.launch import launch

try:  # triton is a Linux-only dependency: elsewhere the layer keeps its torch router
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only on machines without triton
    triton = None

__all__ = ["MAX_EXPERTS", "SCORE_FUNCS", "block_t_for", "gate_block_t", "gate_topk_route", "launch_gate_topk_route",
           "topk_route", "topk_route_backward", "topk_route_backward_torch", "topk_route_differentiable",
           "TopKRouteFunction"]

#: Largest E the kernel takes (the (BLOCK_T, E_PAD) tiles live in registers).
MAX_EXPERTS = 1024
SCORE_FUNCS = ("softmax", "sigmoid")
#: Elements of one (BLOCK_T, E_PAD) fp32 tile per program: 32 per thread at 4 warps.
_TILE_ELEMS = 4096
_MAX_BLOCK_T = 64
_NUM_WARPS = 4
#: Top-k rounds unrolled up to this K (kernel comment).
UNROLL_K = 16
#: The router's backward (``topk_route_backward``) in one Triton launch; False: its torch form (~20 launches).
BWD_KERNEL = jit.env_flag("TITAN_MEGAMOE_ROUTER_BWD_KERNEL", True)

if triton is not None:
    # tl.max / tl.sum / tl.argmax are @jit library functions that the interpreter re-patches on every
    # call (~3 ms each); tl.reduce with these combine functions is what they expand to when compiled,
    # and the interpreter maps each straight to numpy (np.nanmax / np.sum / np.argmax).
    _max_combine = tl.standard._elementwise_max
    _sum_combine = tl.standard._sum_combine
    _argmax_combine = tl.standard._argmax_combine_tie_break_left

    @triton.jit
    def _route_round(c, s, col2, slot, top, sel, k):
        """One top-k round: slot k takes each row's largest choice value c, its expert is marked -inf."""
        _, j = tl.reduce((c, col2), 1, _argmax_combine)  # ties: lowest expert index
        hit = col2 == j[:, None]
        v = tl.reduce(tl.where(hit, s, 0.0), 1, _sum_combine)  # one nonzero term: exact
        c = tl.where(hit, float("-inf"), c)
        top = tl.where(slot == k, v[:, None], top)
        sel = tl.where(slot == k, j[:, None], sel)
        return c, top, sel

    @triton.jit
    def _topk_route_kernel(
        logits_ptr,  # (T, E) bf16 / fp16 / fp32, contiguous
        bias_ptr,  # (E,) float, read only when HAS_BIAS
        scores_ptr,  # (T, K) fp32 out
        ids_ptr,  # (T, K) int64 out
        counts_ptr,  # (E,) fp32, zeroed; += selections per expert
        T,  # i32, tokens
        route_scale,  # fp32
        E: tl.constexpr,  # experts (constexpr: see below)
        K: tl.constexpr,  # top_k
        K_PAD: tl.constexpr,  # next power of two >= K
        E_PAD: tl.constexpr,  # next power of two >= E
        BLOCK_T: tl.constexpr,  # tokens per program
        SOFTMAX: tl.constexpr,  # softmax (True) or sigmoid (False) scores
        HAS_BIAS: tl.constexpr,
        ROUTE_NORM: tl.constexpr,
        UNROLL_K: tl.constexpr,  # unroll the K rounds when K <= UNROLL_K
    ):
        """Grid (cdiv(T, BLOCK_T),): program p routes tokens [p * BLOCK_T, (p + 1) * BLOCK_T).

        E is a constexpr (one build per model width): the compiler then knows the divisibility of the
        column mask and of the row stride, vectorizes the logits load and lays whole rows inside one
        warp, so the row reductions stay in registers and shuffles. With a runtime E that is not a
        multiple of 16 it spread rows over the 4 warps and spilled (E=100: 255 registers + 312 bytes).
        """
        rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        cols = tl.arange(0, E_PAD)
        rmask = rows < T
        cmask = cols < E
        rows64 = rows.to(tl.int64)  # T * E may pass 2**31
        x = tl.load(logits_ptr + rows64[:, None] * E + cols[None, :], mask=rmask[:, None] & cmask[None, :],
                    other=0.0).to(tl.float32)
        _route_tile(x, rows64, cols, rmask, cmask, bias_ptr, scores_ptr, ids_ptr, counts_ptr, route_scale, E, K,
                    K_PAD, BLOCK_T, SOFTMAX, HAS_BIAS, ROUTE_NORM, UNROLL_K)

    @triton.jit
    def _scores_tile(x, cmask, SOFTMAX: tl.constexpr):
        """fp32 scores of a (BLOCK_T, E_PAD) fp32 logits tile: softmax over the real columns (padded ones get
        exp(-inf) = 0) or sigmoid; the forward's selection and the backward's recomputation share it."""
        if SOFTMAX:
            x = tl.where(cmask[None, :], x, float("-inf"))
            p = tl.exp(x - tl.reduce(x, 1, _max_combine)[:, None])
            s = p / tl.reduce(p, 1, _sum_combine)[:, None]
        else:
            s = 1.0 / (1.0 + tl.exp(-x))
        return s

    @triton.jit
    def _route_tile(x, rows64, cols, rmask, cmask, bias_ptr, scores_ptr, ids_ptr, counts_ptr, route_scale,
                    E: tl.constexpr, K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
                    SOFTMAX: tl.constexpr, HAS_BIAS: tl.constexpr, ROUTE_NORM: tl.constexpr, UNROLL_K: tl.constexpr):
        """Scores, selection, route_norm / route_scale, stores and counts of one (BLOCK_T, E_PAD) fp32 logits
        tile (rows64: token ids; padded rows / columns masked by rmask / cmask)."""
        m2 = rmask[:, None] & cmask[None, :]
        E_PAD: tl.constexpr = x.shape[1]
        s = _scores_tile(x, cmask, SOFTMAX)
        c = s
        if HAS_BIAS:
            c = s + tl.load(bias_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        # Real columns stay strictly above -inf, the mark of padded and already taken columns, so every
        # round picks a new real expert; NaN ranks first, as in torch.topk.
        c = tl.where(c != c, float("inf"), c)
        c = tl.maximum(c, -3.4028234663852886e38)
        c = tl.where(cmask[None, :], c, float("-inf"))
        col2 = tl.broadcast_to(cols[None, :], (BLOCK_T, E_PAD))
        slot = tl.arange(0, K_PAD)[None, :]
        top = tl.zeros([BLOCK_T, K_PAD], dtype=tl.float32)
        sel = tl.zeros([BLOCK_T, K_PAD], dtype=tl.int32)
        # Unrolled up to UNROLL_K rounds (the slot compares fold: E=128, K=8 takes 165 registers
        # unrolled, 211 as a loop); a loop beyond, so the code does not grow with K.
        if K <= UNROLL_K:
            for k in tl.static_range(K):
                c, top, sel = _route_round(c, s, col2, slot, top, sel, k)
        else:
            for k in range(K):
                c, top, sel = _route_round(c, s, col2, slot, top, sel, k)
        if ROUTE_NORM:
            top = top / (tl.reduce(top, 1, _sum_combine)[:, None] + 1e-20)
        top = top * route_scale
        out = rows64[:, None] * K + slot
        omask = rmask[:, None] & (slot < K)
        tl.store(scores_ptr + out, top, mask=omask)
        tl.store(ids_ptr + out, sel.to(tl.int64), mask=omask)
        taken = (c == float("-inf")) & m2
        hist = tl.reduce(taken.to(tl.float32), 0, _sum_combine)
        tl.atomic_add(counts_ptr + cols, hist, mask=cmask & (hist > 0))

    @triton.jit
    def _gate_topk_route_kernel(
        x_ptr,  # (T, D) bf16 / fp16 / fp32 token rows, contiguous
        w_ptr,  # (E, D) gate weight, x's dtype, contiguous
        logits_ptr,  # (T, E) out, x's dtype: x @ w.T, fp32 accumulation rounded once
        bias_ptr,  # (E,) float, read only when HAS_BIAS
        scores_ptr,  # (T, K) fp32 out
        ids_ptr,  # (T, K) int64 out
        counts_ptr,  # (E,) fp32; += selections per expert
        T,  # i32, tokens
        route_scale,  # fp32
        D: tl.constexpr,  # model dim (one build per model, as E)
        E: tl.constexpr,
        K: tl.constexpr,
        K_PAD: tl.constexpr,
        E_PAD: tl.constexpr,  # next power of two >= max(E, 16) (tl.dot's smallest N)
        BLOCK_T: tl.constexpr,  # >= 16 (tl.dot's smallest M)
        BLOCK_D: tl.constexpr,
        SOFTMAX: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        ROUTE_NORM: tl.constexpr,
        UNROLL_K: tl.constexpr,
        UPCAST_FP32: tl.constexpr,  # interpreter: fp32 operands for tl.dot (DESIGN 7)
    ):
        """Grid (cdiv(T, BLOCK_T),): the gate linear of BLOCK_T tokens (a (BLOCK_T, E_PAD) fp32 tile, the
        gate weight read from L2 by every program), rounded to x's dtype as F.linear's output is, stored
        for the backward, then routed by ``_route_tile`` exactly as ``_topk_route_kernel`` routes the
        logits it loads."""
        rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        cols = tl.arange(0, E_PAD)
        ks = tl.arange(0, BLOCK_D)
        rmask = rows < T
        cmask = cols < E
        rows64 = rows.to(tl.int64)
        acc = tl.zeros([BLOCK_T, E_PAD], dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):
            kmask = (d0 + ks) < D
            a = tl.load(x_ptr + rows64[:, None] * D + (d0 + ks)[None, :], mask=rmask[:, None] & kmask[None, :],
                        other=0.0)
            b = tl.load(w_ptr + cols[None, :].to(tl.int64) * D + (d0 + ks)[:, None],
                        mask=cmask[None, :] & kmask[:, None], other=0.0)
            if UPCAST_FP32:
                acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
        if UPCAST_FP32 and logits_ptr.dtype.element_ty == tl.bfloat16:
            # the interpreter truncates fp32 -> bf16; round to nearest even first, as cvt.rn does compiled
            bits = acc.to(tl.int32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
            acc = bits.to(tl.float32, bitcast=True)
        logits = acc.to(logits_ptr.dtype.element_ty)
        tl.store(logits_ptr + rows64[:, None] * E + cols[None, :], logits, mask=rmask[:, None] & cmask[None, :])
        _route_tile(logits.to(tl.float32), rows64, cols, rmask, cmask, bias_ptr, scores_ptr, ids_ptr, counts_ptr,
                    route_scale, E, K, K_PAD, BLOCK_T, SOFTMAX, HAS_BIAS, ROUTE_NORM, UNROLL_K)


    @triton.jit
    def _route_bwd_slot(ids_ptr, g_ptr, rows64, rmask, k, K: tl.constexpr, route_scale):
        """Slot k of BLOCK_T tokens: (expert ids (BLOCK_T,) int32, d top_scores * route_scale (BLOCK_T,) fp32)."""
        j = tl.load(ids_ptr + rows64 * K + k, mask=rmask, other=0).to(tl.int32)
        g = tl.load(g_ptr + rows64 * K + k, mask=rmask, other=0.0).to(tl.float32) * route_scale
        return j, g

    @triton.jit
    def _topk_route_bwd_kernel(
        logits_ptr,  # (T, E) bf16 / fp16 / fp32, contiguous (the forward's logits)
        ids_ptr,  # (T, K) int64 selected experts
        g_ptr,  # (T, K) d top_scores, fp32 / bf16, contiguous
        dlogits_ptr,  # (T, E) out, logits' dtype
        T,  # i32, tokens
        route_scale,  # fp32
        E: tl.constexpr,
        K: tl.constexpr,
        E_PAD: tl.constexpr,
        BLOCK_T: tl.constexpr,
        SOFTMAX: tl.constexpr,
        ROUTE_NORM: tl.constexpr,
    ):
        """Grid (cdiv(T, BLOCK_T),): d logits of BLOCK_T tokens from d top_scores, recomputing the fp32 scores
        as ``_route_tile`` does; the K slots' gradients land in the (BLOCK_T, E_PAD) tile through a
        compare with each slot's expert id (the scatter-add of the torch form, no atomics)."""
        rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        cols = tl.arange(0, E_PAD)
        rmask = rows < T
        cmask = cols < E
        rows64 = rows.to(tl.int64)
        m2 = rmask[:, None] & cmask[None, :]
        x = tl.load(logits_ptr + rows64[:, None] * E + cols[None, :], mask=m2, other=0.0).to(tl.float32)
        s = tl.where(m2, _scores_tile(x, cmask, SOFTMAX), 0.0)
        col2 = tl.broadcast_to(cols[None, :], (BLOCK_T, E_PAD))
        denom = tl.full([BLOCK_T], 1.0, dtype=tl.float32)
        gy = tl.zeros([BLOCK_T], dtype=tl.float32)
        if ROUTE_NORM:  # y = v / (sum v + eps): dv = (g - sum(g * v) / (sum v + eps)) / (sum v + eps)
            vsum = tl.zeros([BLOCK_T], dtype=tl.float32)
            for k in range(K):
                j, g = _route_bwd_slot(ids_ptr, g_ptr, rows64, rmask, k, K, route_scale)
                v = tl.reduce(tl.where(col2 == j[:, None], s, 0.0), 1, _sum_combine)  # one nonzero term: exact
                vsum += v
                gy += g * v
            denom = vsum + 1e-20
            gy = gy / denom
        ds = tl.zeros([BLOCK_T, E_PAD], dtype=tl.float32)
        for k in range(K):
            j, g = _route_bwd_slot(ids_ptr, g_ptr, rows64, rmask, k, K, route_scale)
            if ROUTE_NORM:
                g = (g - gy) / denom
            ds += tl.where(col2 == j[:, None], g[:, None], 0.0)
        if SOFTMAX:
            dl = s * (ds - tl.reduce(ds * s, 1, _sum_combine)[:, None])
        else:
            dl = ds * s * (1.0 - s)
        tl.store(dlogits_ptr + rows64[:, None] * E + cols[None, :], dl.to(dlogits_ptr.dtype.element_ty), mask=m2)


def block_t_for(num_experts: int) -> int:
    """Tokens per program for E experts: min(64, 4096 // E_PAD), so one (BLOCK_T, E_PAD) fp32 tile is
    at most 32 values per thread at 4 warps (module docstring); half that for odd E, whose logits
    load cannot be vectorized and whose tile layout then holds more rows per thread (E=127 at 32
    tokens spilled)."""
    budget = _TILE_ELEMS // 2 if num_experts % 2 else _TILE_ELEMS
    return max(1, min(_MAX_BLOCK_T, budget // jit.next_pow2(num_experts)))


def _check(logits_TE: Tensor, top_k: int, score_func: str, expert_bias: Tensor | None) -> None:
    if logits_TE.dim() != 2:
        raise ValueError(f"logits must be 2-D (T, E), got shape {tuple(logits_TE.shape)}")
    E = logits_TE.shape[1]
    if logits_TE.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"logits dtype {logits_TE.dtype}: expected bfloat16, float16 or float32")
    if not 1 <= E <= MAX_EXPERTS:
        raise ValueError(f"E={E} experts: the fused router takes 1..{MAX_EXPERTS}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= E:
        raise ValueError(f"top_k={top_k!r}: must be an int in [1, E={E}]")
    if score_func not in SCORE_FUNCS:
        raise ValueError(f"score_func={score_func!r}: expected one of {SCORE_FUNCS}")
    if expert_bias is not None:
        if tuple(expert_bias.shape) != (E,):
            raise ValueError(f"expert_bias shape {tuple(expert_bias.shape)}: expected ({E},)")
        if not expert_bias.dtype.is_floating_point:
            raise ValueError(f"expert_bias dtype {expert_bias.dtype}: expected a floating dtype")
        if expert_bias.device != logits_TE.device:
            raise ValueError(f"expert_bias on {expert_bias.device}, logits on {logits_TE.device}")


def _route_outputs(T: int, E: int, top_k: int, dev, counts_into: Tensor | None):
    """(top (T, K) fp32, ids (T, K) int64, counts (E,) fp32: a zeroed new buffer or the checked counts_into)."""
    top = _empty((T, top_k), torch.float32, dev)
    ids = _empty((T, top_k), torch.int64, dev)
    if counts_into is None:
        return top, ids, torch.zeros(E, dtype=torch.float32, device=dev)
    if (tuple(counts_into.shape) != (E,) or counts_into.dtype != torch.float32 or counts_into.device != dev
            or not counts_into.is_contiguous()):
        raise ValueError(f"counts_into: expected a contiguous float32 ({E},) tensor on {dev}, got "
                         f"{counts_into.dtype} {tuple(counts_into.shape)} on {counts_into.device}")
    return top, ids, counts_into


def _empty(shape, dtype, device) -> Tensor:
    """torch.empty; a separate function so tests can poison the outputs (the kernel writes every
    element)."""
    return torch.empty(shape, dtype=dtype, device=device)


def topk_route(logits_TE: Tensor, top_k: int, *, score_func: str, expert_bias: Tensor | None = None,
               route_norm: bool, route_scale: float,
               counts_into: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor | None]:
    """Token-choice top-k routing of gate logits in one Triton launch (no autograd; see
    :func:`topk_route_differentiable`).

    Semantics of TorchTitan 0.2.2 ``TokenChoiceTopKRouter.forward`` after ``self.gate`` (module
    docstring), with these choices where TorchTitan leaves the result unspecified:

    * ties in the choice value go to the LOWEST expert index;
    * slot k of a token holds its (k+1)-th largest choice value: slots come in descending choice order
      (``torch.topk(sorted=False)``'s order is unspecified; the expert layout ignores slot order);
    * NaN choice values rank above everything (as ``torch.topk``); selected ids are always distinct
      and in [0, E).

    Runs on CUDA tensors, or on CPU tensors under ``TRITON_INTERPRET=1`` (read at call time).

    Args:
        logits_TE: (T, E) bf16, fp16 or fp32 gate output; T >= 0, 1 <= E <= ``MAX_EXPERTS`` (any E:
            padded to a power of two in the kernel; one kernel build per E). Non-contiguous logits are
            copied first.
        top_k: K, 1 <= K <= E.
        score_func: "softmax" (over the E experts) or "sigmoid", computed in fp32.
        expert_bias: optional (E,) float tensor added to the scores for selection only.
        route_norm: divide the K selected scores by (their sum + 1e-20).
        route_scale: factor applied to the selected scores last.
        counts_into: optional (E,) fp32 contiguous tensor on logits' device (the layer's
            ``tokens_per_expert``): the counts are added into it by the kernel, saving the separate
            ``torch.zeros`` and ``add_`` (two host-side ops per layer call), and None is returned in
            their place.

    Returns:
        (top_scores (T, K) fp32, selected (T, K) int64, counts (E,) fp32 or None): the selected scores
        (not the biased choice values), the expert ids, and the exact number of (token, slot) pairs
        routed to each expert (None with ``counts_into``).

    Raises:
        ValueError: logits not 2-D or of another dtype, E outside [1, MAX_EXPERTS], top_k outside
            [1, E], an unknown score_func, expert_bias not a float (E,) tensor on logits' device, or
            counts_into not a contiguous fp32 (E,) tensor on logits' device.
        RuntimeError: triton is not installed.
    """
    if triton is None:
        raise RuntimeError("triton is not installed: the fused router cannot run")
    _check(logits_TE, top_k, score_func, expert_bias)
    T, E = logits_TE.shape
    dev = logits_TE.device
    top, ids, counts = _route_outputs(T, E, top_k, dev, counts_into)
    if T == 0:
        return top, ids, (counts if counts_into is None else None)
    logits_TE = logits_TE.contiguous()  # no copy for the gate output
    bias = logits_TE if expert_bias is None else expert_bias.contiguous()  # unread without a bias
    block_t = block_t_for(E)
    opts = {} if jit.interpreting() else dict(num_warps=_NUM_WARPS)
    launch(_topk_route_kernel, (jit.cdiv(T, block_t),),
           logits_TE, bias, top, ids, counts, T, float(route_scale),
           E=E, K=top_k, K_PAD=jit.next_pow2(top_k), E_PAD=jit.next_pow2(E), BLOCK_T=block_t,
           SOFTMAX=score_func == "softmax", HAS_BIAS=expert_bias is not None, ROUTE_NORM=bool(route_norm),
           UNROLL_K=UNROLL_K, **opts)
    return top, ids, (counts if counts_into is None else None)


#: Gate dim step of ``_gate_topk_route_kernel``.
_GATE_BLOCK_D = 64


@functools.lru_cache(maxsize=None)
def gate_block_t(num_experts: int) -> int | None:
    """Tokens per program of the fused gate + router kernel for E experts: :func:`block_t_for` of the
    tile padded to >= 16 columns; None where that is below 16 rows (tl.dot's smallest M: E > 256, or odd
    E > 128), where the gate linear stays a separate GEMM."""
    e_pad = max(16, jit.next_pow2(num_experts))
    budget = _TILE_ELEMS // 2 if num_experts % 2 else _TILE_ELEMS
    bt = max(1, min(_MAX_BLOCK_T, budget // e_pad))
    return bt if bt >= 16 else None


def gate_topk_route(x_TD: Tensor, gate_w_ED: Tensor, top_k: int, *, score_func: str,
                    expert_bias: Tensor | None = None, route_norm: bool, route_scale: float,
                    counts_into: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """The router's gate linear and :func:`topk_route` in one launch: logits = x @ gate_w.T (fp32
    accumulation, rounded once to x's dtype, as ``F.linear``'s output is), then the same routing code
    as :func:`topk_route` on those rounded logits.

    Why: from an idle device the layer's forward waits on the host until GEMM1 is enqueued, and the
    gate's cuBLAS call costs 70-300 us of host time on the H200 hosts (docs/NOTES.md, sessions 11-12)
    for ~20 us of device work. The logits may differ from cuBLAS's in the last bit (another
    summation order), so a near-tie can select differently than the separate GEMM would: the output
    is the reference routing of the logits it returns (tests compare on those).

    Args:
        x_TD: (T, D) bf16, fp16 or fp32 contiguous token rows.
        gate_w_ED: (E, D) gate weight of x's dtype, contiguous (``router.gate.weight``, no bias).
        top_k, score_func, expert_bias, route_norm, route_scale, counts_into: as :func:`topk_route`.

    Returns:
        (logits (T, E) in x's dtype, top_scores (T, K) fp32, selected (T, K) int64, counts (E,) fp32 or
        None with ``counts_into``).

    Raises:
        ValueError: x / gate_w not 2-D contiguous of one floating dtype and device with matching D, E
            beyond :func:`gate_block_t`'s reach, and :func:`topk_route`'s errors.
        RuntimeError: triton is not installed.
    """
    if triton is None:
        raise RuntimeError("triton is not installed: the fused router cannot run")
    if x_TD.dim() != 2 or gate_w_ED.dim() != 2 or x_TD.shape[1] != gate_w_ED.shape[1]:
        raise ValueError(f"gate_topk_route: x must be (T, D) and gate_w (E, D); got {tuple(x_TD.shape)}, "
                         f"{tuple(gate_w_ED.shape)}")
    if (x_TD.dtype != gate_w_ED.dtype or x_TD.device != gate_w_ED.device or not x_TD.is_contiguous()
            or not gate_w_ED.is_contiguous()):
        raise ValueError(f"gate_topk_route: x ({x_TD.dtype}, {x_TD.device}) and gate_w ({gate_w_ED.dtype}, "
                         f"{gate_w_ED.device}) must share dtype and device and be contiguous")
    T, D = x_TD.shape
    E = gate_w_ED.shape[0]
    if gate_block_t(E) is None:
        raise ValueError(f"gate_topk_route: E={E} experts leave fewer than 16 tokens per program; use torch.mm "
                         "and topk_route")
    _check(x_TD.new_empty((0, E)), top_k, score_func, expert_bias)
    dev = x_TD.device
    if counts_into is None:
        counts = torch.zeros(E, dtype=torch.float32, device=dev)
    else:
        counts = _route_outputs(0, E, top_k, dev, counts_into)[2]  # checks it
    logits, top, ids = launch_gate_topk_route(x_TD, gate_w_ED, top_k, score_func, expert_bias, route_norm,
                                              route_scale, counts)
    return logits, top, ids, (counts if counts_into is None else None)


def launch_gate_topk_route(x_TD: Tensor, gate_w_ED: Tensor, top_k: int, score_func: str, expert_bias: Tensor | None,
                           route_norm: bool, route_scale: float, counts: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`gate_topk_route` without its checks, for a caller that has made them (the fused eager layer,
    ``layer.MegaMoE._fused_layer_ok``): the forward is host-bound until GEMM1 is enqueued. ``counts``: the
    (E,) fp32 tensor the counts are added into. Returns (logits, top_scores, selected)."""
    T, D = x_TD.shape
    E = gate_w_ED.shape[0]
    dev = x_TD.device
    logits = _empty((T, E), x_TD.dtype, dev)
    top = _empty((T, top_k), torch.float32, dev)
    ids = _empty((T, top_k), torch.int64, dev)
    if T == 0:
        return logits, top, ids
    block_t = gate_block_t(E)
    bias = x_TD if expert_bias is None else expert_bias.contiguous()  # unread without a bias
    interp = jit.interpreting()
    opts = _GATE_OPTS_INTERP if interp else _GATE_OPTS
    launch(_gate_topk_route_kernel, (-(-T // block_t),),
           x_TD, gate_w_ED, logits, bias, top, ids, counts, T, float(route_scale),
           D=D, E=E, K=top_k, K_PAD=jit.next_pow2(top_k), E_PAD=max(16, jit.next_pow2(E)), BLOCK_T=block_t,
           BLOCK_D=_GATE_BLOCK_D, SOFTMAX=score_func == "softmax", HAS_BIAS=expert_bias is not None,
           ROUTE_NORM=bool(route_norm), UNROLL_K=UNROLL_K, UPCAST_FP32=interp, **opts)
    return logits, top, ids


_GATE_OPTS = dict(num_warps=_NUM_WARPS, num_stages=3)
_GATE_OPTS_INTERP: dict = {}


def _scores_fp32(logits_TE: Tensor, score_func: str) -> Tensor:
    x = logits_TE.to(torch.float32)
    return torch.softmax(x, dim=1) if score_func == "softmax" else torch.sigmoid(x)


class TopKRouteFunction(torch.autograd.Function):
    """Autograd of :func:`topk_route`: gradient to the logits only (TorchTitan's expert_bias is a
    buffer; the ids and counts are integer-valued)."""

    @staticmethod
    def forward(ctx, logits_TE, expert_bias, top_k, score_func, route_norm, route_scale, counts_into=None):
        top, ids, counts = topk_route(logits_TE, top_k, score_func=score_func, expert_bias=expert_bias,
                                      route_norm=route_norm, route_scale=route_scale, counts_into=counts_into)
        ctx.save_for_backward(logits_TE, ids)
        ctx.cfg = (score_func, bool(route_norm), float(route_scale))
        ctx.mark_non_differentiable(*(t for t in (ids, counts) if t is not None))
        return top, ids, counts

    @staticmethod
    def backward(ctx, g_top, _g_ids, _g_counts):
        logits_TE, ids = ctx.saved_tensors
        dl = topk_route_backward(logits_TE, ids, g_top, *ctx.cfg)
        return dl, None, None, None, None, None, None


def topk_route_backward(logits_TE: Tensor, ids_TK: Tensor, g_top_TK: Tensor, score_func: str, route_norm: bool,
                        route_scale: float) -> Tensor:
    """d logits (T, E) in logits' dtype from d top_scores (T, K): the closed form of :func:`topk_route`'s
    gradient, recomputing the fp32 scores from the logits (no host sync).

    One Triton launch (``_topk_route_bwd_kernel``) on CUDA tensors, or on CPU tensors under
    ``TRITON_INTERPRET=1``; elsewhere, or with ``TITAN_MEGAMOE_ROUTER_BWD_KERNEL=0``,
    :func:`topk_route_backward_torch`, its reference (~20 torch launches: ~95 us of device time per layer at
    the 30B shape on an H200, docs/NOTES.md session 17). The kernel sums
    in another order than the torch form: results agree to fp32 rounding before the final cast.

    Args:
        logits_TE: (T, E) bf16, fp16 or fp32 logits of the forward (1 <= E <= ``MAX_EXPERTS``).
        ids_TK: (T, K) integer expert ids in [0, E), distinct per row (as :func:`topk_route` selects).
        g_top_TK: (T, K) floating gradient of the top scores.
        score_func, route_norm, route_scale: as the forward.

    Returns:
        (T, E) gradient of the logits, in logits' dtype.
    """
    if (triton is None or not BWD_KERNEL
            or not (logits_TE.is_cuda or (logits_TE.device.type == "cpu" and jit.interpreting()))):
        return topk_route_backward_torch(logits_TE, ids_TK, g_top_TK, score_func, route_norm, route_scale)
    T, E = logits_TE.shape
    K = ids_TK.shape[1]
    dl = _empty((T, E), logits_TE.dtype, logits_TE.device)
    if T == 0:
        return dl
    block_t = block_t_for(E)
    opts = {} if jit.interpreting() else dict(num_warps=_NUM_WARPS)
    launch(_topk_route_bwd_kernel, (jit.cdiv(T, block_t),),
           logits_TE.contiguous(), ids_TK.contiguous(), g_top_TK.contiguous(), dl, T, float(route_scale),
           E=E, K=K, E_PAD=jit.next_pow2(E), BLOCK_T=block_t, SOFTMAX=score_func == "softmax",
           ROUTE_NORM=bool(route_norm), **opts)
    return dl


def topk_route_backward_torch(logits_TE: Tensor, ids_TK: Tensor, g_top_TK: Tensor, score_func: str,
                              route_norm: bool, route_scale: float) -> Tensor:
    """The reference of :func:`topk_route_backward` in torch ops (same arguments and result)."""
    s = _scores_fp32(logits_TE, score_func)
    g = g_top_TK.to(torch.float32) * route_scale
    if route_norm:  # y = v / (sum v + eps): dv = (g - sum(g * y)) / (sum v + eps)
        v = s.gather(1, ids_TK)
        denom = v.sum(dim=-1, keepdim=True) + 1e-20
        g = (g - (g * (v / denom)).sum(dim=-1, keepdim=True)) / denom
    ds = torch.zeros_like(s).scatter_add_(1, ids_TK, g)
    if score_func == "softmax":
        dl = s * (ds - (ds * s).sum(dim=1, keepdim=True))
    else:
        dl = ds * s * (1.0 - s)
    return dl.to(logits_TE.dtype)


def topk_route_differentiable(logits_TE: Tensor, top_k: int, *, score_func: str,
                              expert_bias: Tensor | None = None, route_norm: bool,
                              route_scale: float, counts_into: Tensor | None = None
                              ) -> tuple[Tensor, Tensor, Tensor | None]:
    """:func:`topk_route` with a backward to ``logits_TE`` (same arguments, returns and errors).

    d top_scores (T, K) -> d logits (T, E) in logits' dtype, the gradient of TorchTitan's torch code
    for the same selection; no gradient to ``expert_bias``. Without grad mode or a logits that needs
    a gradient this is ``topk_route`` itself (no autograd node).
    """
    if torch.is_grad_enabled() and logits_TE.requires_grad:
        return TopKRouteFunction.apply(logits_TE, expert_bias, top_k, score_func, route_norm, route_scale,
                                       counts_into)
    return topk_route(logits_TE, top_k, score_func=score_func, expert_bias=expert_bias,
                      route_norm=route_norm, route_scale=route_scale, counts_into=counts_into)
