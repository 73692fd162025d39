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
from titan_megamoe.ops import triton_backend as tb

__all__ = ["mega_moe_triton"]

_LayoutT = tuple[Tensor, Tensor, Tensor, Tensor, Tensor]


@torch.library.custom_op("megamoe::bf16_mega_moe_fwd", mutates_args=())
def bf16_mega_moe_fwd(
    x: Tensor, topk_ids: Tensor, topk_scores: Tensor, w1: Tensor, w2: Tensor, w3: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    out, gate_up, L = tb.triton_fwd(x, topk_ids, topk_scores, w1, w2, w3)
    return out, gate_up, L.counts, L.offsets, L.row_pair, L.pair_row, L.tile_expert


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
    L = tb.layout_from_tensors(counts, offsets, row_pair, pair_row, tile_expert, tb._block_m(), w1.shape[0], top_k)
    return tb.triton_bwd(dout, x, topk_scores, w1, w2, w3, gate_up, L)


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
    dx, dscores, dw1, dw2, dw3 = bf16_mega_moe_bwd(dout, x, topk_scores, w1, w2, w3, gate_up, *layout, ctx.top_k)
    return dx, None, dscores, dw1, dw2, dw3


bf16_mega_moe_fwd.register_autograd(_backward, setup_context=_setup_context)


def mega_moe_triton(x_TD: Tensor, topk_ids_TK: Tensor, topk_scores_TK: Tensor, w1: Tensor, w2: Tensor,
                    w3: Tensor) -> Tensor:
    """Fused bf16 MoE experts on one GPU (EP = 1): (T, D) bf16 out. See ops/triton_backend.py."""
    return torch.ops.megamoe.bf16_mega_moe_fwd(x_TD, topk_ids_TK, topk_scores_TK, w1, w2, w3)[0]
