"""Host glue of the Triton backend (EP = 1): checks, allocation and launch order. No autograd here.

Shape legend: T tokens, D model dim, F expert hidden dim, E experts, K top_k, P = T*K pairs,
N_cap padded expert-major rows (see kernels/routing.py).

Forward: routing layout (device ops, no host sync) -> GEMM1 with the x-row gather in its prologue and
SwiGLU in its epilogue (saves gate_up) -> GEMM2 with the routing weight in its epilogue, writing
(token, slot) rows -> fp32 sum over the K slots in fixed order.

Backward: GEMM2 dgrad with dout gathered by token, SwiGLU backward and d(score) = <dout W2, h> in its
epilogue -> w2 / w1 / w3 wgrad as K-grouped GEMMs over each expert's rows -> GEMM1 dgrad -> fp32 sum of
each token's K dx rows in fixed order. Every reduction has a fixed order: deterministic.

Saved for the backward (per layer, Qwen3-30B-A3B shape, 16384 tokens, top-8, bf16): gate_up
(N_cap x 2F = (131072 + 128*127) x 1536 x 2 B = 0.45 GiB) plus the routing layout (~1.2 MB); x and the
weights are the layer's own inputs. h (0.22 GiB) and the expert outputs y (0.5 GiB) are recomputed or
never needed: s*h is rebuilt from gate_up by the GEMM2-dgrad epilogue (a transient N_cap x F buffer in
the backward) and d(score) comes from that epilogue too.
Stock TorchTitan keeps the routed input copy (0.5 GiB), both GEMM1 outputs and h, the GEMM2 output
and the unpermute buffers.
"""

from __future__ import annotations

import torch
from torch import Tensor

from titan_megamoe.kernels.jit import interpreting
from titan_megamoe.kernels.routing import RoutingLayout, build_routing_layout

try:  # the kernels need triton (Linux); the reference backend does not
    from titan_megamoe.kernels import grouped_gemm as _gg
except ImportError:  # pragma: no cover - machines without triton
    _gg = None

__all__ = ["BLOCK_M", "check_triton_inputs", "triton_fwd", "triton_fwd_unchecked", "triton_bwd", "triton_bwd_rows", "layout_from_tensors"]

#: Row block of the grouped GEMMs (and of the routing layout).
BLOCK_M = 128


def _block_m() -> int:
    # the interpreter runs tiny shapes: a small block keeps the CPU tests fast
    return 16 if interpreting() else BLOCK_M


def check_triton_inputs(x_TD: Tensor, topk_ids_TK: Tensor, topk_scores_TK: Tensor, w1: Tensor, w2: Tensor,
                        w3: Tensor, layer_name: str) -> None:
    """Preconditions of the Triton backend; raises ValueError naming what is wrong and what to do."""
    if not x_TD.dtype.is_floating_point or any(not w.dtype.is_floating_point for w in (w1, w2, w3)):
        raise ValueError(f"{layer_name}: x and expert weights must be floating point (got {x_TD.dtype}, {w1.dtype})")
    D = x_TD.shape[1]
    F = w1.shape[1]
    if D % 16 or F % 16:
        raise ValueError(
            f"{layer_name}: the triton backend needs dim and moe hidden dim multiples of 16 (got D={D}, F={F}); "
            "use backend = 'reference' for this model"
        )


def layout_from_tensors(counts, offsets, row_pair, pair_row, tile_expert, block_m: int, E: int, K: int) -> RoutingLayout:
    return RoutingLayout(counts=counts, offsets=offsets, row_pair=row_pair, pair_row=pair_row,
                         tile_expert=tile_expert, block_m=block_m, num_experts=E, top_k=K)


def triton_fwd(x_TD: Tensor, topk_ids_TK: Tensor, topk_scores_TK: Tensor, w1: Tensor, w2: Tensor, w3: Tensor):
    """Forward: returns (out (T, D) bf16, gate_up (N_cap, 2F) bf16, layout)."""
    T, K = topk_ids_TK.shape
    E = w1.shape[0]
    layout = build_routing_layout(topk_ids_TK, E, _block_m())
    gate_up, h = _gg.gemm1_swiglu_fwd(x_TD.contiguous(), w1.contiguous(), w3.contiguous(), layout)
    y_PD = _gg.gemm2_scatter_fwd(h, w2.contiguous(), topk_scores_TK.contiguous(), layout)
    out = _gg.combine_topk(y_PD, T, K)
    return out, gate_up, layout


def triton_fwd_unchecked(x_TD: Tensor, topk_ids_TK: Tensor, topk_scores_TK: Tensor, w1: Tensor, w2: Tensor,
                         w3: Tensor):
    """:func:`triton_fwd` through the kernels' launch halves, which skip the per-kernel checks, for a caller
    that has made them: x (T, D), w1 / w3 (E, F, D), w2 (E, D, F) bf16 contiguous on one device with D and F
    multiples of 16; ids (T, K) int64 in [0, E) and scores (T, K) fp32 contiguous, as the fused router writes
    them (``ops/eager_layer.py``, after ``layer.MegaMoE._fused_layer_ok``). Same launches, same results: the
    from-idle forward is host-bound until GEMM1 is enqueued (docs/NOTES.md, session 14)."""
    T, K = topk_ids_TK.shape
    layout = build_routing_layout(topk_ids_TK, w1.shape[0], _block_m(), one_allocation=True)
    gate_up, h = _gg.launch_gemm1_swiglu_fwd(x_TD, w1, w3, layout)
    y_PD = _gg.launch_gemm2_scatter_fwd(h, w2, topk_scores_TK, layout)
    return _gg.launch_combine_topk(y_PD, T, K), gate_up, layout


def triton_bwd(dout_TD: Tensor, x_TD: Tensor, topk_scores_TK: Tensor, w1: Tensor, w2: Tensor, w3: Tensor,
               gate_up: Tensor, layout: RoutingLayout):
    """Backward: returns (dx (T, D), dscores (T, K) fp32, dw1, dw2, dw3) in the weights' dtype."""
    from titan_megamoe.kernels.grouped_gemm_bwd import scatter_dx

    dx_rows, dscores, dw1, dw2, dw3 = triton_bwd_rows(dout_TD, x_TD, topk_scores_TK, w1, w2, w3, gate_up, layout)
    T, K = topk_scores_TK.shape
    return scatter_dx(dx_rows, layout, T, K), dscores, dw1, dw2, dw3


def triton_bwd_rows(dout_TD: Tensor, x_TD: Tensor, topk_scores_TK: Tensor, w1: Tensor, w2: Tensor, w3: Tensor,
                    gate_up: Tensor, layout: RoutingLayout):
    """:func:`triton_bwd` up to GEMM1's dgrad: returns (dx_rows (N_cap, D) in layout order, dscores, dw1, dw2,
    dw3); ``grouped_gemm_bwd.scatter_dx(dx_rows, layout, T, K)`` sums the rows into dx. Split so the fused layer
    can add the router's dx inside that kernel (it needs dscores first)."""
    from titan_megamoe.kernels.grouped_gemm_bwd import (
        gemm1_dgrad,
        gemm2_dgrad_swiglu_bwd,
        reduce_dscore,
        wgrad_w2,
        wgrad_w13,
    )

    T, K = topk_scores_TK.shape
    dout_TD = dout_TD.contiguous()
    # s*h rows stored by the dgrad epilogue for the w2 wgrad: 4x faster there than recomputing h from
    # gate_up in the wgrad loader (H200, 30B shape: 1.04 vs 4.42 ms), for a transient N_cap x F bf16.
    hs = torch.empty((layout.n_cap, w1.shape[1]), dtype=gate_up.dtype, device=gate_up.device)
    dgate_up, dscore_part = gemm2_dgrad_swiglu_bwd(dout_TD, w2.contiguous(), gate_up, topk_scores_TK, layout,
                                                   hs_out=hs)
    dscores = reduce_dscore(dscore_part, layout, T, K)
    dw2 = wgrad_w2(dout_TD, gate_up, topk_scores_TK, layout, hs_NF=hs)
    del hs  # 0.2 GiB at 30B back to the allocator before wgrad_w13's gathered x rows (peak memory)
    dw1, dw3 = wgrad_w13(dgate_up, x_TD.contiguous(), layout)
    dx_rows = gemm1_dgrad(dgate_up, w1.contiguous(), w3.contiguous(), layout)
    return dx_rows, dscores, dw1, dw2, dw3
