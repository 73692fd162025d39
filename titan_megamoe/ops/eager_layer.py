"""The whole MoE layer's eager path (gate linear, fused router, fused experts) as one autograd node.

Why: compare.layer times the forward from an idle device, and until GEMM1 is enqueued the device has
~0.13 ms of work while the host spends ~1 ms (H200 host, ``scripts/host_profile.py``): the gate linear,
the router's autograd node, the experts module, ``mega_moe``'s checks and casts, the op's autograd
node, then the launches. Here the layer's forward makes the same kernel launches from one
``torch.autograd.Function``, after checks made once per layer call in ``MegaMoE.forward``; the
backward runs the experts' backward, the router's closed-form gradient and the gate linear's two
GEMMs, the router's dx added into the experts' by ``torch.addmm`` (one cuBLAS call instead of a GEMM
and an elementwise add).

With ``FUSED_GATE`` (default; ``TITAN_MEGAMOE_FUSED_GATE=0`` off) the gate linear runs inside the
router's kernel (``kernels/router.gate_topk_route``): one launch and no cuBLAS call before the routing
layout. Its logits come from another summation order than cuBLAS's and may differ in the last bf16
bit, so a near-tie may route differently than the modular path would; everything after the logits
is the same code.

With ``FUSED_GATE`` off: the same forward outputs and gradients as the modular path (router module +
experts module) bit for bit, except dx: the router's part is added in fp32 inside the GEMM and rounded
once (the modular path rounds the GEMM's output to bf16, then adds). ``TITAN_MEGAMOE_FUSED_LAYER=0``
turns the whole node off (read at import; a same-process switch, ``switches.py``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from titan_megamoe.kernels import router as fused_router
from titan_megamoe.kernels.jit import env_flag
from titan_megamoe.ops import triton_backend as tb

__all__ = ["ENABLED", "FUSED_GATE", "FusedLayerFunction"]

#: Run MegaMoE's eager forward through :class:`FusedLayerFunction` where it applies (``MegaMoE._fused_layer_ok``).
ENABLED = env_flag("TITAN_MEGAMOE_FUSED_LAYER", True)
#: Inside it, compute the gate linear in the router's kernel (``router.gate_topk_route``: one launch, no
#: cuBLAS call) where the kernel takes E; off: ``torch.mm`` then ``router.topk_route``.
FUSED_GATE = env_flag("TITAN_MEGAMOE_FUSED_GATE", True)


class FusedLayerFunction(torch.autograd.Function):
    """x (T, D) bf16 -> routed-experts output (T, D) bf16, through gate linear, fused top-k router and
    fused experts (EP = 1, bf16, scores applied after the experts).

    forward(x_TD, gate_w (E, D), expert_bias (E,) or None, counts_into (E,) fp32, w1 (E, F, D), w2 (E, D, F),
    w3 (E, F, D), top_k, score_func, route_norm, route_scale); the per-expert counts are added into
    ``counts_into`` by the router kernel. Gradients to x, gate_w, w1, w2, w3.
    """

    @staticmethod
    def forward(ctx, x_TD, gate_w, expert_bias, counts_into, w1, w2, w3, top_k, score_func, route_norm, route_scale):
        # The operands meet every precondition of the unchecked launches (MegaMoE._fused_layer_operands).
        if FUSED_GATE and fused_router.gate_block_t(gate_w.shape[0]) is not None:
            logits, top, ids = fused_router.launch_gate_topk_route(
                x_TD, gate_w, top_k, score_func, expert_bias, route_norm, route_scale, counts_into)
        else:
            logits = torch.mm(x_TD, gate_w.t())  # F.linear's call without a bias: the same cuBLAS GEMM
            top, ids, _ = fused_router.topk_route(logits, top_k, score_func=score_func, expert_bias=expert_bias,
                                                  route_norm=route_norm, route_scale=route_scale,
                                                  counts_into=counts_into)
        out, gate_up, L = tb.triton_fwd_unchecked(x_TD, ids, top, w1, w2, w3)
        ctx.save_for_backward(x_TD, gate_w, logits, ids, top, w1, w2, w3, gate_up, L.counts, L.offsets, L.row_pair,
                              L.pair_row, L.tile_expert)
        ctx.cfg = (top_k, score_func, bool(route_norm), float(route_scale), L.block_m)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        x, gate_w, logits, ids, top, w1, w2, w3, gate_up, *layout = ctx.saved_tensors
        top_k, score_func, route_norm, route_scale, block_m = ctx.cfg
        L = tb.layout_from_tensors(*layout, block_m, w1.shape[0], top_k)
        dx, dscores, dw1, dw2, dw3 = tb.triton_bwd(dout, x, top, w1, w2, w3, gate_up, L)
        dlogits = fused_router.topk_route_backward(logits, ids, dscores, score_func, route_norm, route_scale)
        dgate_w = dlogits.t().mm(x) if ctx.needs_input_grad[1] else None
        dx = torch.addmm(dx, dlogits, gate_w)
        return dx, dgate_w, None, None, dw1, dw2, dw3, None, None, None, None
