"""The whole MoE layer's eager path (gate linear, fused router, fused experts) as one autograd node.

Why: compare.layer times the forward from an idle device, and until GEMM1 is enqueued the device has
~0.13 ms of work while the host spends ~1 ms (H200 host, ``scripts/host_profile.py``): the gate linear,
the router's autograd node, the experts module, ``mega_moe``'s checks and casts, the op's autograd
node, then the launches. Here the layer's forward makes the same kernel launches from one
``torch.autograd.Function``, after checks made once per layer call in ``MegaMoE.forward``; the
backward runs the experts' backward, the router's closed-form gradient and the gate linear's two
GEMMs. The router's dx is added into the experts' inside ``scatter_dx`` (``ROUTER_DX_IN_SCATTER``, E <= 128:
a small tl.dot per dx tile, one rounding), else by an in-place ``Tensor.addmm_`` (one cuBLAS call; the
out-of-place ``torch.addmm`` first copied its (T, D) input: 36 us at the 30B shape on an H200, docs/NOTES.md
session 17).

With ``FUSED_GATE`` (default; ``TITAN_MEGAMOE_FUSED_GATE=0`` off) the gate linear runs inside the
router's kernel (``kernels/router.gate_topk_route``): one launch and no cuBLAS call before the routing
layout. Its logits come from another summation order than cuBLAS's and may differ in the last bf16
bit, so a near-tie may route differently than the modular path would; everything after the logits
is the same code.

With ``FUSED_GATE`` off: the same forward outputs and gradients as the modular path (router module +
experts module) bit for bit, except dx: the router's part is added in fp32 (inside ``scatter_dx``'s sum, or
the cuBLAS GEMM) and rounded once (the modular path rounds the GEMM's output to bf16, then adds). ``TITAN_MEGAMOE_FUSED_LAYER=0``
turns the whole node off (read at import; a same-process switch, ``switches.py``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from titan_megamoe.kernels import router as fused_router
from titan_megamoe.kernels.jit import env_flag
from titan_megamoe.ops import triton_backend as tb

__all__ = ["ENABLED", "FUSED_GATE", "ROUTER_DX_IN_SCATTER", "FusedLayerFunction", "fused_forward", "route",
           "router_backward"]

#: Run MegaMoE's eager forward through :class:`FusedLayerFunction` where it applies (``MegaMoE._fused_layer_ok``).
ENABLED = env_flag("TITAN_MEGAMOE_FUSED_LAYER", True)
#: Inside it, compute the gate linear in the router's kernel (``router.gate_topk_route``: one launch, no
#: cuBLAS call) where the kernel takes E; off: ``torch.mm`` then ``router.topk_route``.
FUSED_GATE = env_flag("TITAN_MEGAMOE_FUSED_GATE", True)
#: In the backward, add the router's dx (d logits @ gate weight) inside the experts' ``scatter_dx`` kernel
#: (E <= 128, bf16) instead of a cuBLAS ``addmm_`` over dx afterwards (docs/NOTES.md session 17).
ROUTER_DX_IN_SCATTER = env_flag("TITAN_MEGAMOE_ROUTER_DX_IN_SCATTER", True)


def route(x_TD: Tensor, gate_w: Tensor, expert_bias: Tensor | None, counts_into: Tensor, top_k: int, score_func: str,
          route_norm: bool, route_scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """The gate linear and the fused top-k router, outside autograd: (logits (T, E) bf16, top scores (T, K) fp32,
    expert ids (T, K) int64); the per-expert counts are added into ``counts_into``. The gate inside the router's
    kernel with ``FUSED_GATE`` where it applies, else ``torch.mm`` then the router kernel."""
    if FUSED_GATE and fused_router.gate_block_t(gate_w.shape[0]) is not None:
        return fused_router.launch_gate_topk_route(x_TD, gate_w, top_k, score_func, expert_bias, route_norm,
                                                   route_scale, counts_into)
    with torch.no_grad():  # outside the node, x may require grad: no graph for these
        logits = torch.mm(x_TD, gate_w.t())  # F.linear's call without a bias: the same cuBLAS GEMM
        top, ids, _ = fused_router.topk_route(logits, top_k, score_func=score_func, expert_bias=expert_bias,
                                              route_norm=route_norm, route_scale=route_scale, counts_into=counts_into)
    return logits, top, ids


def router_backward(dx_rows: Tensor, layout, dscores: Tensor, x: Tensor, gate_w: Tensor, logits: Tensor, ids: Tensor,
                    score_func: str, route_norm: bool, route_scale: float,
                    need_gate_grad: bool) -> tuple[Tensor, Tensor | None]:
    """(dx (T, D), d gate weight (E, D) or None) from the experts' dx rows and d scores: the router's closed-form
    gradient, the gate linear's two GEMMs, the experts' rows summed per token with the router's dx added
    (``ROUTER_DX_IN_SCATTER``: inside ``scatter_dx``, else one in-place ``addmm_``)."""
    from titan_megamoe.kernels.grouped_gemm_bwd import SCATTER_ROUTER_MAX_E, scatter_dx  # needs triton

    dlogits = fused_router.topk_route_backward(logits, ids, dscores, score_func, route_norm, route_scale)
    dgate_w = dlogits.t().mm(x) if need_gate_grad else None
    T, K = dscores.shape
    if ROUTER_DX_IN_SCATTER and gate_w.shape[0] <= SCATTER_ROUTER_MAX_E and dlogits.dtype == torch.bfloat16:
        return scatter_dx(dx_rows, layout, T, K, router_dlogits=dlogits, gate_w=gate_w), dgate_w
    dx = scatter_dx(dx_rows, layout, T, K)
    dx.addmm_(dlogits, gate_w)  # dx: scatter_dx's fresh (T, D) output, no other reader
    return dx, dgate_w


def fused_forward(x_TD: Tensor, gate_w: Tensor, expert_bias: Tensor | None, counts_into: Tensor, w1: Tensor,
                  w2: Tensor, w3: Tensor, top_k: int, score_func: str, route_norm: bool, route_scale: float):
    """Launch the layer's forward kernels (gate + router, routing layout, GEMM1 + SwiGLU, GEMM2, combine) for
    operands that meet every precondition of the unchecked launches (``MegaMoE._fused_layer_operands``).

    ``MegaMoE.forward`` calls it before :meth:`FusedLayerFunction.apply` and hands the result in: the node's
    own host time (``Function.apply`` before its forward runs: ~20 us on the CPU machine, more on the H200
    host) then comes after GEMM1 is enqueued instead of before the first launch (the forward from an idle
    device waits on the host until then, docs/NOTES.md session 15). Same launches, same results.

    Shapes as :class:`FusedLayerFunction`. Returns (out (T, D) bf16, the tensors the backward keeps, its
    constants).
    """
    logits, top, ids = route(x_TD, gate_w, expert_bias, counts_into, top_k, score_func, route_norm, route_scale)
    out, gate_up, L = tb.triton_fwd_unchecked(x_TD, ids, top, w1, w2, w3)
    saved = (x_TD, gate_w, logits, ids, top, w1, w2, w3, gate_up, L.counts, L.offsets, L.row_pair, L.pair_row,
             L.tile_expert)
    return out, saved, (top_k, score_func, bool(route_norm), float(route_scale), L.block_m)


class FusedLayerFunction(torch.autograd.Function):
    """x (T, D) bf16 -> routed-experts output (T, D) bf16, through gate linear, fused top-k router and
    fused experts (EP = 1, bf16, scores applied after the experts).

    forward(x_TD, gate_w (E, D), expert_bias (E,) or None, counts_into (E,) fp32, w1 (E, F, D), w2 (E, D, F),
    w3 (E, F, D), top_k, score_func, route_norm, route_scale, launched=None); the per-expert counts are added
    into ``counts_into`` by the router kernel. ``launched``: what :func:`fused_forward` returned for these
    operands (its kernels already enqueued), else the forward calls it. Gradients to x, gate_w, w1, w2, w3.
    """

    @staticmethod
    def forward(ctx, x_TD, gate_w, expert_bias, counts_into, w1, w2, w3, top_k, score_func, route_norm, route_scale,
                launched=None):
        if launched is None:
            launched = fused_forward(x_TD, gate_w, expert_bias, counts_into, w1, w2, w3, top_k, score_func,
                                     route_norm, route_scale)
        out, saved, ctx.cfg = launched
        ctx.save_for_backward(*saved)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        x, gate_w, logits, ids, top, w1, w2, w3, gate_up, *layout = ctx.saved_tensors
        top_k, score_func, route_norm, route_scale, block_m = ctx.cfg
        L = tb.layout_from_tensors(*layout, block_m, w1.shape[0], top_k)
        dx_rows, dscores, dw1, dw2, dw3 = tb.triton_bwd_rows(dout, x, top, w1, w2, w3, gate_up, L)
        dx, dgate_w = router_backward(dx_rows, L, dscores, x, gate_w, logits, ids, score_func, route_norm,
                                      route_scale, ctx.needs_input_grad[1])
        return dx, dgate_w, None, None, dw1, dw2, dw3, None, None, None, None, None
