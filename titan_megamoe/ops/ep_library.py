"""torch.library custom ops of the expert-parallel Triton backend (``megamoe::bf16_mega_moe_ep_*``),
with fake implementations and autograd, over PyTorch symmetric memory (NCCL group, GPUs) or
shared-memory files (gloo group, CPU: the Triton interpreter, tests).

Ops:
  megamoe::bf16_mega_moe_ep_fwd(x (T,D) bf16, topk_ids (T,K), topk_scores (T,K) fp32, w1 (E_l,F,D),
      w2 (E_l,D,F), w3 (E_l,F,D) bf16, group_name, t_cap, max_rows, layer_name, overlap ("v1" | "v2" | "v3"))
      -> out (T,D) bf16, gate_up (N_cap',2F) bf16, receive layout (5 int32 tensors)
  megamoe::bf16_mega_moe_ep_bwd(dout, x, topk_ids, topk_scores, w1, w2, w3, gate_up, layout...,
      group_name, t_cap, max_rows, layer_name, overlap) -> dx, dscores, dw1, dw2, dw3
  megamoe::fp8_mega_moe_ep_fwd(x (T,D) bf16, topk_ids, topk_scores (T,K) fp32, w1 (E_l,F,D), w2 (E_l,D,F),
      w3 (E_l,F,D) (bf16 or fp32), wq (12 or 6 tensors of ``fp8_backend.prepare_weights``), fp8_forward
      (True: "fp8", False: "fp8_bwd"), group_name, t_cap, max_rows, layer_name)
      -> out (T,D) bf16, gate_up (N_cap',2F) bf16, receive layout (5 int32 tensors; BM = 128)
  megamoe::fp8_mega_moe_ep_bwd(dout, x, topk_ids, topk_scores, w1, wq_bwd (6), gate_up, layout...,
      group_name, t_cap, max_rows, layer_name) -> dx, dscores, dw1, dw2, dw3 (w1's dtype if fp32, else bf16)
N_cap' = layout_caps(R * t_cap, K, E_l, BM, max_rows), BM = 128 (bf16: 16 in the interpreter; FP8: 128
always, see ops/ep_fp8_backend.py): static, so the fakes need no data.

One workspace per (process group, t_cap, D, K), created on first use (a collective: every rank's
layers run in the same order), logged with its size, shared by all layers, bf16 and FP8 alike (the
forward of "fp8" pushes x as e4m3 rows + scales into the xq / xs slab, which shares the dy region's bytes). See ops/ep_backend.py and ops/ep_fp8_backend.py for the steps and
comm/workspace.py for the buffer.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

from titan_megamoe.comm.capacity import CapacityMonitor
from titan_megamoe.comm.peers import DEFAULT_TIMEOUT_MS
from titan_megamoe.comm.signals import WaitMonitor
from titan_megamoe.comm.workspace import WorkspaceLayout
from titan_megamoe.kernels.routing import RoutingLayout, layout_caps
from titan_megamoe.ops import eager
from titan_megamoe.ops.ep_backend import BACKWARD_STEPS, FORWARD_STEPS, EPRank, run_with_barriers
from titan_megamoe.ops.triton_backend import _block_m

__all__ = ["mega_moe_ep_triton", "mega_moe_ep_triton_fp8", "CAPACITY"]

logger = logging.getLogger(__name__)

#: Pending receive-capacity checks of this process (see comm/capacity.py).
CAPACITY = CapacityMonitor()
#: Pending checks of the bounded cross-rank waits (see comm/signals.py).
WAITS = WaitMonitor()
_PEERS: dict[tuple, object] = {}
#: (group, T_cap, D, K, E_l, max_rows, BM) -> the EPRank of those layers (``_ep_rank``), over ``_PEERS``.
_RANKS: dict[tuple, EPRank] = {}
#: Bound of every cross-rank wait of workspaces created from now on (``set_timeout_ms``).
_TIMEOUT_MS = [DEFAULT_TIMEOUT_MS]


def set_timeout_ms(timeout_ms: int) -> None:
    """Bound (ms, > 0) of every cross-rank wait of the EP workspaces created after this call; a peer
    that does not arrive in time raises ``PeerTimeoutError`` (at the next EP call, no host sync)."""
    if timeout_ms <= 0:
        raise ValueError(f"timeout_ms must be > 0, got {timeout_ms}")
    _TIMEOUT_MS[0] = int(timeout_ms)


def _group(group_name: str):
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)


def _ep_rank(group_name: str, t_cap: int, D: int, K: int, e_l: int, max_rows: int) -> EPRank:
    # one EPRank per layer configuration, kept: building the layout and resolving the group cost host
    # time on every call, and the EPRank keeps the workspace's region views
    rkey = (group_name, t_cap, D, K, e_l, max_rows, _block_m())
    ctx = _RANKS.get(rkey)
    if ctx is not None:
        return ctx
    from titan_megamoe.comm.peers import make_peers

    key = (group_name, t_cap, D, K)
    group = _group(group_name)
    ws = WorkspaceLayout.build(group.size(), t_cap, D, K)
    if key not in _PEERS:
        _PEERS[key] = make_peers(group, ws.nbytes, tag=f"{t_cap}_{D}_{K}", timeout_ms=_TIMEOUT_MS[0])
        if _PEERS[key].rank == 0:
            logger.info(ws.describe())
    ctx = _RANKS[rkey] = EPRank(_PEERS[key], ws, e_l, max_rows, _block_m())
    return ctx


def _layout(L: tuple, e_l: int, K: int, max_rows: int) -> RoutingLayout:
    counts, offsets, row_pair, pair_row, tile_expert = L
    return RoutingLayout(counts=counts, offsets=offsets, row_pair=row_pair, pair_row=pair_row,
                         tile_expert=tile_expert, block_m=_block_m(), num_experts=e_l, top_k=K, max_rows=max_rows)


def _bf16_fwd(x, topk_ids, topk_scores, w1, w2, w3, group_name, t_cap, max_rows, layer_name, overlap):
    K = topk_ids.shape[1]
    e_l, _, D = w1.shape
    ctx = _ep_rank(group_name, t_cap, D, K, e_l, max_rows)
    CAPACITY.check()
    WAITS.check()
    steps = FORWARD_STEPS[overlap](ctx, x, topk_ids, topk_scores, w1, w2, w3)
    out, gate_up, L = run_with_barriers(steps, ctx.peers)
    CAPACITY.record(layer_name, L.counts, max_rows)
    WAITS.record(layer_name, ctx.peers.sync)
    return out, gate_up, L.counts, L.offsets, L.row_pair, L.pair_row, L.tile_expert


@torch.library.custom_op("megamoe::bf16_mega_moe_ep_fwd", mutates_args=())
def bf16_mega_moe_ep_fwd(
    x: Tensor, topk_ids: Tensor, topk_scores: Tensor, w1: Tensor, w2: Tensor, w3: Tensor,
    group_name: str, t_cap: int, max_rows: int, layer_name: str, overlap: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    return _bf16_fwd(x, topk_ids, topk_scores, w1, w2, w3, group_name, t_cap, max_rows, layer_name, overlap)


@bf16_mega_moe_ep_fwd.register_fake
def _fwd_fake(x, topk_ids, topk_scores, w1, w2, w3, group_name, t_cap, max_rows, layer_name, overlap):
    T, K = topk_ids.shape
    e_l, F, D = w1.shape
    R = _group(group_name).size()
    n_cap, n_tiles = layout_caps(R * t_cap, K, e_l, _block_m(), max_rows)
    i32 = dict(dtype=torch.int32, device=x.device)
    return (x.new_empty((T, D)), x.new_empty((n_cap, 2 * F)), torch.empty((e_l,), **i32),
            torch.empty((e_l + 1,), **i32), torch.empty((n_cap,), **i32), torch.empty((R * t_cap * K,), **i32),
            torch.empty((n_tiles,), **i32))


def _bf16_bwd(dout, x, topk_ids, topk_scores, w1, w2, w3, gate_up, counts, offsets, row_pair, pair_row, tile_expert,
              group_name, t_cap, max_rows, layer_name, overlap):
    K = topk_ids.shape[1]
    e_l, _, D = w1.shape
    ctx = _ep_rank(group_name, t_cap, D, K, e_l, max_rows)
    L = _layout((counts, offsets, row_pair, pair_row, tile_expert), e_l, K, max_rows)
    WAITS.check()
    steps = BACKWARD_STEPS[overlap](ctx, dout.contiguous(), x, topk_ids, topk_scores, w1, w2, w3, gate_up, L)
    res = run_with_barriers(steps, ctx.peers)
    WAITS.record(f"{layer_name} (backward)", ctx.peers.sync)
    return res


@torch.library.custom_op("megamoe::bf16_mega_moe_ep_bwd", mutates_args=())
def bf16_mega_moe_ep_bwd(
    dout: Tensor, x: Tensor, topk_ids: Tensor, topk_scores: Tensor, w1: Tensor, w2: Tensor, w3: Tensor,
    gate_up: Tensor, counts: Tensor, offsets: Tensor, row_pair: Tensor, pair_row: Tensor, tile_expert: Tensor,
    group_name: str, t_cap: int, max_rows: int, layer_name: str, overlap: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    return _bf16_bwd(dout, x, topk_ids, topk_scores, w1, w2, w3, gate_up, counts, offsets, row_pair, pair_row,
                     tile_expert, group_name, t_cap, max_rows, layer_name, overlap)


@bf16_mega_moe_ep_bwd.register_fake
def _bwd_fake(dout, x, topk_ids, topk_scores, w1, w2, w3, gate_up, counts, offsets, row_pair, pair_row,
              tile_expert, group_name, t_cap, max_rows, layer_name, overlap):
    return (x.new_empty(x.shape), torch.empty_like(topk_scores), w1.new_empty(w1.shape),
            w2.new_empty(w2.shape), w3.new_empty(w3.shape))


def _setup_context(ctx, inputs, output):
    x, topk_ids, topk_scores, w1, w2, w3, group_name, t_cap, max_rows, layer_name, overlap = inputs
    _, gate_up, *layout = output
    ctx.meta = (group_name, t_cap, max_rows, layer_name, overlap)
    ctx.set_materialize_grads(False)  # gate_up / layout are saved state, never differentiated
    ctx.save_for_backward(x, topk_ids, topk_scores, w1, w2, w3, gate_up, *layout)


def _backward(ctx, dout, *unused):
    x, topk_ids, topk_scores, w1, w2, w3, gate_up, *layout = ctx.saved_tensors
    if dout is None:
        # every rank must still run the backward's barriers in step: a zero gradient, not a skip
        dout = torch.zeros_like(x)
    bwd = _bf16_bwd if getattr(ctx, "eager", False) else bf16_mega_moe_ep_bwd  # ops/eager.py
    dx, dscores, dw1, dw2, dw3 = bwd(dout, x, topk_ids, topk_scores, w1, w2, w3, gate_up, *layout, *ctx.meta)
    return dx, None, dscores, dw1, dw2, dw3, None, None, None, None, None


bf16_mega_moe_ep_fwd.register_autograd(_backward, setup_context=_setup_context)
_BF16 = eager.OpFunctions(_bf16_fwd, _setup_context, _backward)


def mega_moe_ep_triton(x_TD: Tensor, topk_ids_TK: Tensor, topk_scores_TK: Tensor, w1: Tensor, w2: Tensor,
                       w3: Tensor, *, ep_group, max_tokens_per_rank: int, recv_capacity: int,
                       layer_name: str = "moe", overlap: str = "v1") -> Tensor:
    """Fused bf16 MoE experts with expert parallelism over ``ep_group`` (NVLink, symmetric memory).

    Args:
        x_TD: (T, D) bf16, T <= max_tokens_per_rank; topk_ids_TK (T, K) global ids; topk_scores_TK
            (T, K) fp32; w1 / w3 (E_l, F, D), w2 (E_l, D, F) bf16: this rank's experts
            [rank * E_l, (rank + 1) * E_l).
        ep_group: the expert-parallel process group (every rank calls in the same order).
        max_tokens_per_rank: T_cap, the workspace's rows per source rank.
        recv_capacity: (token, expert) pairs one rank may receive per call.
        layer_name: used in errors.
        overlap: "v1" (default: barrier-separated dispatch, GEMMs, combine) or "v2" (forward: the x
            rows stream in on a side stream while GEMM1 waits per 128-token block, see
            ``ops/ep_backend.ep_forward_steps_v2``; backward as v1) or "v3" (forward as v1; backward:
            the d score and dx pushes on a side stream under the weight gradients,
            ``ep_backward_steps_v3``). Same results bit for bit.

    Returns:
        (T, D) bf16.

    Raises:
        CapacityError: T > max_tokens_per_rank now, or (a few calls later, see comm/capacity.py) an
            earlier call received more pairs than ``recv_capacity``.
        PeerTimeoutError: (at a later call, without a host sync, see comm/signals.py) a peer rank did
            not reach one of an earlier call's cross-rank waits within the timeout
            (``set_timeout_ms``, default 120 s); names the layer, the phase and the ranks.
    """
    from titan_megamoe.errors import CapacityError

    if overlap not in FORWARD_STEPS:
        raise ValueError(f"{layer_name}: overlap={overlap!r}; allowed: {', '.join(FORWARD_STEPS)}")
    if x_TD.shape[0] > max_tokens_per_rank:
        raise CapacityError(f"{layer_name}: {x_TD.shape[0]} tokens in one call on this rank, more than "
                            f"max_tokens_per_rank={max_tokens_per_rank}. Raise [megamoe] max_tokens_per_rank.")
    return eager.call(torch.ops.megamoe.bf16_mega_moe_ep_fwd, _BF16,
                      x_TD, topk_ids_TK, topk_scores_TK, w1, w2, w3, ep_group.group_name, max_tokens_per_rank,
                      recv_capacity, layer_name, overlap)


# --------------------------------------------------------------------------------------------------
# Blockwise FP8 (precision "fp8" and "fp8_bwd") with expert parallelism, ops/ep_fp8_backend.py
# --------------------------------------------------------------------------------------------------
# One op pair for both precisions (a bool), as megamoe::fp8_mega_moe_fwd / bwd at EP = 1. The FP8
# weights (this rank's experts) come from the layer's Fp8WeightCache through the wq list argument.


def _fp8_ep_rank(group_name: str, t_cap: int, D: int, K: int, e_l: int, max_rows: int) -> EPRank:
    import dataclasses

    from titan_megamoe.ops.fp8_backend import FP8_BLOCK_M

    return dataclasses.replace(_ep_rank(group_name, t_cap, D, K, e_l, max_rows), block_m=FP8_BLOCK_M)


def _fp8_w_dtype(w1: Tensor) -> torch.dtype:
    return w1.dtype if w1.dtype == torch.float32 else torch.bfloat16


def _fp8_fwd(x, topk_ids, topk_scores, w1, w2, w3, wq, fp8_forward, group_name, t_cap, max_rows, layer_name):
    from titan_megamoe.ops.ep_fp8_backend import ep_fp8_forward_steps
    from titan_megamoe.ops.fp8_backend import NONFINITE

    K = topk_ids.shape[1]
    e_l, _, D = w1.shape
    ctx = _fp8_ep_rank(group_name, t_cap, D, K, e_l, max_rows)
    CAPACITY.check()
    WAITS.check()
    NONFINITE.check()  # records of earlier calls that have landed (no wait)
    steps = ep_fp8_forward_steps(ctx, x, topk_ids, topk_scores, w1, w2, w3, wq, fp8_forward, layer_name)
    out, gate_up, L = run_with_barriers(steps, ctx.peers)
    CAPACITY.record(layer_name, L.counts, max_rows)
    WAITS.record(layer_name, ctx.peers.sync)
    return out, gate_up, L.counts, L.offsets, L.row_pair, L.pair_row, L.tile_expert


@torch.library.custom_op("megamoe::fp8_mega_moe_ep_fwd", mutates_args=())
def fp8_mega_moe_ep_fwd(
    x: Tensor, topk_ids: Tensor, topk_scores: Tensor, w1: Tensor, w2: Tensor, w3: Tensor, wq: list[Tensor],
    fp8_forward: bool, group_name: str, t_cap: int, max_rows: int, layer_name: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    return _fp8_fwd(x, topk_ids, topk_scores, w1, w2, w3, wq, fp8_forward, group_name, t_cap, max_rows, layer_name)


@fp8_mega_moe_ep_fwd.register_fake
def _fp8_fwd_fake(x, topk_ids, topk_scores, w1, w2, w3, wq, fp8_forward, group_name, t_cap, max_rows, layer_name):
    from titan_megamoe.ops.fp8_backend import FP8_BLOCK_M

    T, K = topk_ids.shape
    e_l, F, D = w1.shape
    R = _group(group_name).size()
    n_cap, n_tiles = layout_caps(R * t_cap, K, e_l, FP8_BLOCK_M, max_rows)
    i32 = dict(dtype=torch.int32, device=x.device)
    return (x.new_empty((T, D)), x.new_empty((n_cap, 2 * F)), torch.empty((e_l,), **i32),
            torch.empty((e_l + 1,), **i32), torch.empty((n_cap,), **i32), torch.empty((R * t_cap * K,), **i32),
            torch.empty((n_tiles,), **i32))


def _fp8_bwd(dout, x, topk_ids, topk_scores, w1, wq_bwd, gate_up, counts, offsets, row_pair, pair_row, tile_expert,
             group_name, t_cap, max_rows, layer_name):
    from titan_megamoe.ops.ep_fp8_backend import ep_fp8_backward_steps
    from titan_megamoe.ops.fp8_backend import FP8_BLOCK_M

    K = topk_ids.shape[1]
    e_l, _, D = w1.shape
    ctx = _fp8_ep_rank(group_name, t_cap, D, K, e_l, max_rows)
    L = RoutingLayout(counts=counts, offsets=offsets, row_pair=row_pair, pair_row=pair_row, tile_expert=tile_expert,
                      block_m=FP8_BLOCK_M, num_experts=e_l, top_k=K, max_rows=max_rows)
    WAITS.check()
    steps = ep_fp8_backward_steps(ctx, dout.contiguous(), x, topk_ids, topk_scores, wq_bwd, gate_up, L,
                                  _fp8_w_dtype(w1), layer_name)
    res = run_with_barriers(steps, ctx.peers)
    WAITS.record(f"{layer_name} (backward)", ctx.peers.sync)
    return res


@torch.library.custom_op("megamoe::fp8_mega_moe_ep_bwd", mutates_args=())
def fp8_mega_moe_ep_bwd(
    dout: Tensor, x: Tensor, topk_ids: Tensor, topk_scores: Tensor, w1: Tensor, wq_bwd: list[Tensor],
    gate_up: Tensor, counts: Tensor, offsets: Tensor, row_pair: Tensor, pair_row: Tensor, tile_expert: Tensor,
    group_name: str, t_cap: int, max_rows: int, layer_name: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    return _fp8_bwd(dout, x, topk_ids, topk_scores, w1, wq_bwd, gate_up, counts, offsets, row_pair, pair_row,
                    tile_expert, group_name, t_cap, max_rows, layer_name)


@fp8_mega_moe_ep_bwd.register_fake
def _fp8_bwd_fake(dout, x, topk_ids, topk_scores, w1, wq_bwd, gate_up, counts, offsets, row_pair, pair_row,
                  tile_expert, group_name, t_cap, max_rows, layer_name):
    e_l, F, D = w1.shape
    wd = _fp8_w_dtype(w1)
    return (x.new_empty(x.shape), torch.empty_like(topk_scores), w1.new_empty((e_l, F, D), dtype=wd),
            w1.new_empty((e_l, D, F), dtype=wd), w1.new_empty((e_l, F, D), dtype=wd))


def _fp8_setup_context(ctx, inputs, output):
    x, topk_ids, topk_scores, w1, w2, w3, wq, fp8_forward, group_name, t_cap, max_rows, layer_name = inputs
    _, gate_up, *layout = output
    ctx.meta = (group_name, t_cap, max_rows, layer_name)
    ctx.w_dtypes = (w1.dtype, w2.dtype, w3.dtype)
    ctx.n_wq = len(wq)
    ctx.set_materialize_grads(False)  # gate_up / layout are saved state, never differentiated
    # the transposed FP8 weights are the cache's tensors: saving them costs no memory
    ctx.save_for_backward(x, topk_ids, topk_scores, w1, gate_up, *layout, *wq[:6])


def _fp8_backward(ctx, dout, *unused):
    x, topk_ids, topk_scores, w1, gate_up, *rest = ctx.saved_tensors
    layout, wq_bwd = rest[:5], rest[5:]
    if dout is None:
        # every rank must still run the backward's barriers in step: a zero gradient, not a skip
        dout = torch.zeros_like(x)
    bwd = _fp8_bwd if getattr(ctx, "eager", False) else fp8_mega_moe_ep_bwd  # ops/eager.py
    dx, dscores, dw1, dw2, dw3 = bwd(dout, x, topk_ids, topk_scores, w1, list(wq_bwd), gate_up, *layout, *ctx.meta)
    dw1, dw2, dw3 = (g.to(d) for g, d in zip((dw1, dw2, dw3), ctx.w_dtypes))
    return dx, None, dscores, dw1, dw2, dw3, [None] * ctx.n_wq, None, None, None, None, None


fp8_mega_moe_ep_fwd.register_autograd(_fp8_backward, setup_context=_fp8_setup_context)
_FP8 = eager.OpFunctions(_fp8_fwd, _fp8_setup_context, _fp8_backward)


def mega_moe_ep_triton_fp8(x_TD: Tensor, topk_ids_TK: Tensor, topk_scores_TK: Tensor, w1: Tensor, w2: Tensor,
                           w3: Tensor, *, fp8_forward: bool, ep_group, max_tokens_per_rank: int, recv_capacity: int,
                           cache=None, layer_name: str = "moe") -> Tensor:
    """Blockwise-FP8 MoE experts with expert parallelism over ``ep_group`` (NVLink, symmetric memory), v1:
    the forward's x dispatched as e4m3 rows + fp32 scales quantized on the source ("fp8"; bf16 rows with
    ``ep_fp8_backend.FP8_DISPATCH = "bf16"`` / TITAN_MEGAMOE_FP8_DISPATCH=bf16, bitwise the same result) or
    as bf16 rows ("fp8_bwd"), the backward's x and dy as bf16 rows, the FP8 kernels of EP = 1 on the
    receive slab (``ops/ep_fp8_backend.py``).

    Args:
        x_TD: (T, D) bf16, T <= max_tokens_per_rank; topk_ids_TK (T, K) global ids; topk_scores_TK
            (T, K) fp32; w1 / w3 (E_l, F, D), w2 (E_l, D, F) bf16 or fp32 (fp32 master weights get fp32
            gradients): this rank's experts [rank * E_l, (rank + 1) * E_l). D and F multiples of 128.
        fp8_forward: True: precision "fp8" (FP8 forward and backward); False: "fp8_bwd" (bf16 forward).
        ep_group: the expert-parallel process group (every rank calls in the same order).
        max_tokens_per_rank: T_cap, the workspace's rows per source rank.
        recv_capacity: (token, expert) pairs one rank may receive per call.
        cache: an ``fp8_backend.Fp8WeightCache`` (the layer's; None: quantize every call).
        layer_name: used in errors.

    Returns:
        (T, D) bf16.

    Raises:
        CapacityError: T > max_tokens_per_rank now, or (a few calls later, see comm/capacity.py) an
            earlier call received more pairs than ``recv_capacity``.
        PeerTimeoutError: (at a later call) a peer did not reach one of an earlier call's waits.
        NonFiniteError: (at a later FP8 call, or ``post_optimizer_hook``) an earlier call quantized inf
            / NaN (``fp8_backend.NONFINITE``).
        ValueError: D or F not multiples of 128 (from the kernels' launchers).
    """
    from titan_megamoe.errors import CapacityError
    from titan_megamoe.ops.fp8_backend import prepare_weights

    if x_TD.shape[0] > max_tokens_per_rank:
        raise CapacityError(f"{layer_name}: {x_TD.shape[0]} tokens in one call on this rank, more than "
                            f"max_tokens_per_rank={max_tokens_per_rank}. Raise [megamoe] max_tokens_per_rank.")
    wq = prepare_weights(w1, w2, w3, fp8_forward=fp8_forward, cache=cache, layer_name=layer_name)
    return eager.call(torch.ops.megamoe.fp8_mega_moe_ep_fwd, _FP8,
                      x_TD, topk_ids_TK, topk_scores_TK, w1, w2, w3, wq, fp8_forward, ep_group.group_name,
                      max_tokens_per_rank, recv_capacity, layer_name)
