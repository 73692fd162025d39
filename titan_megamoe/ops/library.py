"""torch.library custom ops of the fused operator (namespace ``megamoe::``), with fake
implementations (torch.compile, meta tensors) and autograd. Model code reaches them only through
``titan_megamoe.ops.mega_moe``.

Ops (grammar ``<precision>_mega_moe_<fwd|bwd>``):
  megamoe::bf16_mega_moe_fwd(x (T,D) bf16, topk_ids (T,K) int, topk_scores (T,K) fp32,
                             w1 (E,F,D), w2 (E,D,F), w3 (E,F,D) bf16)
      -> out (T,D) bf16, gate_up (N_cap,2F) bf16 and the routing layout (5 int32 tensors)
  megamoe::bf16_mega_moe_bwd(dout, x, topk_scores, w1, w2, w3, gate_up, layout..., top_k)
      -> dx (T,D), dscores (T,K) fp32, dw1, dw2, dw3
The layout tensors have sizes fixed by (T, K, E, BM), so the fakes need no data. The ops have no
device restriction: on CPU they run through Triton's interpreter (TRITON_INTERPRET=1, tests only).
"""

from __future__ import annotations

import torch
from torch import Tensor

from titan_megamoe.kernels.routing import layout_caps
from titan_megamoe.ops import eager
from titan_megamoe.ops import triton_backend as tb

__all__ = ["mega_moe_triton", "mega_moe_triton_fp8"]

_LayoutT = tuple[Tensor, Tensor, Tensor, Tensor, Tensor]


def _bf16_fwd(x, topk_ids, topk_scores, w1, w2, w3):
    out, gate_up, L = tb.triton_fwd(x, topk_ids, topk_scores, w1, w2, w3)
    return out, gate_up, L.counts, L.offsets, L.row_pair, L.pair_row, L.tile_expert


def _bf16_bwd(dout, x, topk_scores, w1, w2, w3, gate_up, counts, offsets, row_pair, pair_row, tile_expert, top_k):
    L = tb.layout_from_tensors(counts, offsets, row_pair, pair_row, tile_expert, tb._block_m(), w1.shape[0], top_k)
    return tb.triton_bwd(dout, x, topk_scores, w1, w2, w3, gate_up, L)


@torch.library.custom_op("megamoe::bf16_mega_moe_fwd", mutates_args=())
def bf16_mega_moe_fwd(
    x: Tensor, topk_ids: Tensor, topk_scores: Tensor, w1: Tensor, w2: Tensor, w3: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    return _bf16_fwd(x, topk_ids, topk_scores, w1, w2, w3)


@bf16_mega_moe_fwd.register_fake
def _fwd_fake(x, topk_ids, topk_scores, w1, w2, w3):
    T, K = topk_ids.shape
    E, F, D = w1.shape
    n_cap, n_tiles = layout_caps(T, K, E, tb._block_m())
    i32 = dict(dtype=torch.int32, device=x.device)
    return (
        x.new_empty((T, D)), x.new_empty((n_cap, 2 * F)), torch.empty((E,), **i32), torch.empty((E + 1,), **i32),
        torch.empty((n_cap,), **i32), torch.empty((T * K,), **i32), torch.empty((n_tiles,), **i32),
    )


@torch.library.custom_op("megamoe::bf16_mega_moe_bwd", mutates_args=())
def bf16_mega_moe_bwd(
    dout: Tensor, x: Tensor, topk_scores: Tensor, w1: Tensor, w2: Tensor, w3: Tensor, gate_up: Tensor,
    counts: Tensor, offsets: Tensor, row_pair: Tensor, pair_row: Tensor, tile_expert: Tensor, top_k: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    return _bf16_bwd(dout, x, topk_scores, w1, w2, w3, gate_up, counts, offsets, row_pair, pair_row, tile_expert,
                     top_k)


@bf16_mega_moe_bwd.register_fake
def _bwd_fake(dout, x, topk_scores, w1, w2, w3, gate_up, counts, offsets, row_pair, pair_row, tile_expert, top_k):
    return (x.new_empty(x.shape), torch.empty_like(topk_scores), w1.new_empty(w1.shape),
            w2.new_empty(w2.shape), w3.new_empty(w3.shape))


def _setup_context(ctx, inputs, output):
    x, topk_ids, topk_scores, w1, w2, w3 = inputs
    _, gate_up, *layout = output
    ctx.top_k = topk_ids.shape[1]
    # gate_up and the layout are saved state, never differentiated: without this autograd would
    # allocate and zero-fill an (N_cap, 2F) gradient for gate_up every backward (0.45 GiB at 30B).
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(x, topk_scores, w1, w2, w3, gate_up, *layout)


def _backward(ctx, dout, *unused):
    x, topk_scores, w1, w2, w3, gate_up, *layout = ctx.saved_tensors
    if dout is None:  # the output was not used in the loss
        return None, None, None, None, None, None
    bwd = _bf16_bwd if getattr(ctx, "eager", False) else bf16_mega_moe_bwd  # ops/eager.py
    dx, dscores, dw1, dw2, dw3 = bwd(dout, x, topk_scores, w1, w2, w3, gate_up, *layout, ctx.top_k)
    return dx, None, dscores, dw1, dw2, dw3


bf16_mega_moe_fwd.register_autograd(_backward, setup_context=_setup_context)
_BF16 = eager.OpFunctions(_bf16_fwd, _setup_context, _backward)


def mega_moe_triton(x_TD: Tensor, topk_ids_TK: Tensor, topk_scores_TK: Tensor, w1: Tensor, w2: Tensor,
                    w3: Tensor) -> Tensor:
    """Fused bf16 MoE experts on one GPU (EP = 1): (T, D) bf16 out. See ops/triton_backend.py; eager
    calls skip the custom op's dispatch (ops/eager.py)."""
    return eager.call(torch.ops.megamoe.bf16_mega_moe_fwd, _BF16, x_TD, topk_ids_TK, topk_scores_TK, w1, w2, w3)


# --------------------------------------------------------------------------------------------------
# Blockwise FP8 (precision "fp8" and "fp8_bwd"), ops/fp8_backend.py
# --------------------------------------------------------------------------------------------------
#   megamoe::fp8_mega_moe_fwd(x (T,D) bf16, topk_ids, topk_scores (T,K) fp32, w1 (E,F,D), w2 (E,D,F),
#       w3 (E,F,D) (bf16 or fp32: the gradients come back in their dtype), wq (6 or 12 tensors from
#       fp8_backend.prepare_weights: transposed e4m3 weights + scales, then the forward ones),
#       fp8_forward (True: "fp8", False: "fp8_bwd"), layer_name)
#       -> out (T,D) bf16, gate_up (N_cap,2F) bf16, layout (5 int32 tensors; BM = 128)
#   megamoe::fp8_mega_moe_bwd(dout, x, topk_scores, w1, wq_bwd (6), gate_up, layout..., top_k, layer_name)
#       -> dx (T,D) bf16, dscores (T,K) fp32, dw1, dw2, dw3 (w1's dtype)
# One op pair for both precisions (a bool), so the grammar <precision>_mega_moe_<fwd|bwd> holds for
# the FP8 backward they share.


def _fp8_fwd(x, topk_ids, topk_scores, w1, w2, w3, wq, fp8_forward, layer_name):
    from titan_megamoe.ops import fp8_backend as fb

    out, gate_up, L = fb.fp8_fwd(x, topk_ids, topk_scores, w1, w2, w3, wq, fp8_forward, layer_name)
    return out, gate_up, L.counts, L.offsets, L.row_pair, L.pair_row, L.tile_expert


def _fp8_bwd(dout, x, topk_scores, w1, wq_bwd, gate_up, counts, offsets, row_pair, pair_row, tile_expert, top_k,
             layer_name):
    from titan_megamoe.ops import fp8_backend as fb

    L = tb.layout_from_tensors(counts, offsets, row_pair, pair_row, tile_expert, fb.FP8_BLOCK_M, w1.shape[0], top_k)
    w_dtype = w1.dtype if w1.dtype == torch.float32 else torch.bfloat16
    return fb.fp8_bwd(dout, x, topk_scores, wq_bwd, gate_up, L, w_dtype, layer_name)


@torch.library.custom_op("megamoe::fp8_mega_moe_fwd", mutates_args=())
def fp8_mega_moe_fwd(
    x: Tensor, topk_ids: Tensor, topk_scores: Tensor, w1: Tensor, w2: Tensor, w3: Tensor, wq: list[Tensor],
    fp8_forward: bool, layer_name: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    return _fp8_fwd(x, topk_ids, topk_scores, w1, w2, w3, wq, fp8_forward, layer_name)


@fp8_mega_moe_fwd.register_fake
def _fp8_fwd_fake(x, topk_ids, topk_scores, w1, w2, w3, wq, fp8_forward, layer_name):
    from titan_megamoe.ops.fp8_backend import FP8_BLOCK_M

    T, K = topk_ids.shape
    E, F, D = w1.shape
    n_cap, n_tiles = layout_caps(T, K, E, FP8_BLOCK_M)
    i32 = dict(dtype=torch.int32, device=x.device)
    return (
        x.new_empty((T, D)), x.new_empty((n_cap, 2 * F)), torch.empty((E,), **i32), torch.empty((E + 1,), **i32),
        torch.empty((n_cap,), **i32), torch.empty((T * K,), **i32), torch.empty((n_tiles,), **i32),
    )


@torch.library.custom_op("megamoe::fp8_mega_moe_bwd", mutates_args=())
def fp8_mega_moe_bwd(
    dout: Tensor, x: Tensor, topk_scores: Tensor, w1: Tensor, wq_bwd: list[Tensor], gate_up: Tensor,
    counts: Tensor, offsets: Tensor, row_pair: Tensor, pair_row: Tensor, tile_expert: Tensor, top_k: int,
    layer_name: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    return _fp8_bwd(dout, x, topk_scores, w1, wq_bwd, gate_up, counts, offsets, row_pair, pair_row, tile_expert,
                    top_k, layer_name)


@fp8_mega_moe_bwd.register_fake
def _fp8_bwd_fake(dout, x, topk_scores, w1, wq_bwd, gate_up, counts, offsets, row_pair, pair_row, tile_expert,
                  top_k, layer_name):
    E, F, D = w1.shape
    wd = w1.dtype if w1.dtype == torch.float32 else torch.bfloat16
    return (x.new_empty(x.shape), torch.empty_like(topk_scores), w1.new_empty((E, F, D), dtype=wd),
            w1.new_empty((E, D, F), dtype=wd), w1.new_empty((E, F, D), dtype=wd))


def _fp8_setup_context(ctx, inputs, output):
    x, topk_ids, topk_scores, w1, w2, w3, wq, fp8_forward, layer_name = inputs
    _, gate_up, *layout = output
    ctx.top_k = topk_ids.shape[1]
    ctx.layer_name = layer_name
    ctx.w_dtypes = (w1.dtype, w2.dtype, w3.dtype)
    ctx.n_wq = len(wq)
    ctx.set_materialize_grads(False)  # as the bf16 op: no zero-filled gate_up gradient
    # the transposed FP8 weights are the cache's tensors: saving them costs no memory
    ctx.save_for_backward(x, topk_scores, w1, gate_up, *layout, *wq[:6])


def _fp8_backward(ctx, dout, *unused):
    x, topk_scores, w1, gate_up, *rest = ctx.saved_tensors
    layout, wq_bwd = rest[:5], rest[5:]
    if dout is None:
        return None, None, None, None, None, None, [None] * ctx.n_wq, None, None
    bwd = _fp8_bwd if getattr(ctx, "eager", False) else fp8_mega_moe_bwd  # ops/eager.py
    dx, dscores, dw1, dw2, dw3 = bwd(dout, x, topk_scores, w1, list(wq_bwd), gate_up, *layout, ctx.top_k,
                                     ctx.layer_name)
    dw1, dw2, dw3 = (g.to(d) for g, d in zip((dw1, dw2, dw3), ctx.w_dtypes))
    return dx, None, dscores, dw1, dw2, dw3, [None] * ctx.n_wq, None, None


fp8_mega_moe_fwd.register_autograd(_fp8_backward, setup_context=_fp8_setup_context)
_FP8 = eager.OpFunctions(_fp8_fwd, _fp8_setup_context, _fp8_backward)


def mega_moe_triton_fp8(x_TD: Tensor, topk_ids_TK: Tensor, topk_scores_TK: Tensor, w1: Tensor, w2: Tensor,
                        w3: Tensor, *, fp8_forward: bool, cache=None, layer_name: str = "moe") -> Tensor:
    """Blockwise-FP8 MoE experts on one GPU (EP = 1): (T, D) bf16 out. ``fp8_forward`` False is
    precision "fp8_bwd". ``cache``: an ``fp8_backend.Fp8WeightCache`` (None: quantize every call).
    See ops/fp8_backend.py."""
    from titan_megamoe.ops.fp8_backend import prepare_weights

    wq = prepare_weights(w1, w2, w3, fp8_forward=fp8_forward, cache=cache, layer_name=layer_name)
    return eager.call(torch.ops.megamoe.fp8_mega_moe_fwd, _FP8, x_TD, topk_ids_TK, topk_scores_TK, w1, w2, w3, wq,
                      fp8_forward, layer_name)
