"""The whole MoE layer's eager path as one autograd node for precision "fp8" / "fp8_bwd" at EP = 1.

Why: the FP8 layer's forward went through the router module (the gate linear, the router kernel, an autograd
node), the experts module, ``mega_moe``'s checks and the FP8 custom op: on the CPU machine's host-only driver its
forward took ~850 us to the last launch against ~450 for the bf16 layer's fused node, and on an H100 host the fp8
forward's host enqueue was 1.3 ms against bf16's 0.6 (compare.layer ``host_fwd_ms``, docs/NOTES.md session 21): the
from-idle fp8 forward waits on the host. Here, as ``eager_layer.FusedLayerFunction`` does for bf16: the checks
once per layer call (``MegaMoE._fused_layer_operands``), the router launched by ``eager_layer.route`` (the gate
inside the router's kernel with ``FUSED_GATE``), the FP8 experts' forward (``fp8_backend.fp8_fwd``), the autograd
node recorded after the launches; the backward runs ``fp8_backend.fp8_experts_bwd``, the fixed-order d score sum and
``eager_layer.router_backward`` (the router's dx added inside ``scatter_dx``).

Results: with ``FUSED_GATE`` off, the modular FP8 path's output, counts and expert-weight gradients bit for bit, dx
and the gate's gradient within bf16 error (the router's dx added in fp32 and rounded once), as the bf16 node.
``TITAN_MEGAMOE_FUSED_LAYER=0`` turns both nodes off.
"""

from __future__ import annotations

import torch
from torch import Tensor

from titan_megamoe.kernels.jit import env_flag
from titan_megamoe.ops import eager_layer
from titan_megamoe.ops import fp8_backend as fb
from titan_megamoe.ops import triton_backend as tb

__all__ = ["FAST_FWD", "FusedFp8LayerFunction", "fused_forward_fp8"]

#: The "fp8" forward through the kernels' launch halves (``fp8_backend.fp8_fwd_unchecked``: the checks made once
#: here, the earlier calls' non-finite records read after the launches) where it applies; same launches and results
#: as ``fp8_backend.fp8_fwd``. ``TITAN_MEGAMOE_FP8_FAST_FWD=0``: the checked launches.
FAST_FWD = env_flag("TITAN_MEGAMOE_FP8_FAST_FWD", True)


def fused_forward_fp8(x_TD: Tensor, gate_w: Tensor, expert_bias: Tensor | None, counts_into: Tensor, w1: Tensor,
                      w2: Tensor, w3: Tensor, top_k: int, score_func: str, route_norm: bool, route_scale: float,
                      cache: fb.Fp8WeightCache | None, fp8_forward: bool, layer_name: str):
    """Launch the FP8 layer's forward kernels (router, routing layout, x / h quantization, GEMM1 + SwiGLU, GEMM2,
    combine) for operands that meet the fused path's preconditions (``MegaMoE._fused_layer_operands``).

    Host work the from-idle forward would wait on is kept off the path to GEMM1 (docs/NOTES.md session 32):

    * "fp8_bwd" runs the bf16 layer's forward launches (``triton_backend.triton_fwd_unchecked``: the same kernels
      and configs as ``fp8_backend.fp8_experts_fwd``'s bf16 branch, without the per-kernel checks) wherever the
      bf16 layout's block is the FP8 one (128: off the interpreter), and takes its FP8 weights from the cache
      (``cache``: ``fp8_backend.prepare_weights_eager``) after the forward is enqueued: only the backward reads them.
    * "fp8" takes its FP8 weights after the router's launch, then the FP8 experts' forward, through the launch
      halves (``FAST_FWD``: ``fp8_backend.fp8_fwd_unchecked``) where they apply.
    * The non-finite records of earlier calls (``fp8_backend.NONFINITE``) are checked after the launches ("fp8_bwd",
      and "fp8" with ``FAST_FWD``: before this call's own is queued), else before the experts' launches in
      ``fp8_backend.fp8_fwd``.

    Shapes as :class:`FusedFp8LayerFunction`. Returns (out (T, D) bf16, the tensors the backward keeps, its
    constants).

    Raises:
        NonFiniteError: an earlier call's FP8 scales held inf / nan.
    """
    logits, top, ids = eager_layer.route(x_TD, gate_w, expert_bias, counts_into, top_k, score_func, route_norm,
                                         route_scale)
    if not fp8_forward and tb._block_m() == fb.FP8_BLOCK_M:
        out, gate_up, L = tb.triton_fwd_unchecked(x_TD, ids, top, w1, w2, w3)
        wq = fb.prepare_weights_eager(w1, w2, w3, fp8_forward=False, cache=cache, layer_name=layer_name)
        fb.NONFINITE.check()  # records of earlier calls that have landed (this forward records none)
    else:  # the earlier calls' records: fp8_fwd_unchecked reads them after its launches, fp8_fwd before, as the op
        wq = fb.prepare_weights_eager(w1, w2, w3, fp8_forward=fp8_forward, cache=cache, layer_name=layer_name)
        if fp8_forward and FAST_FWD and fb.fp8_fwd_unchecked_ok(x_TD, wq):
            out, gate_up, L = fb.fp8_fwd_unchecked(x_TD, ids, top, wq, layer_name)
        else:
            out, gate_up, L = fb.fp8_fwd(x_TD, ids, top, w1, w2, w3, wq, fp8_forward, layer_name,
                                         one_allocation=True)
    # the transposed FP8 weights are the cache's tensors: keeping them costs no memory
    saved = (x_TD, gate_w, logits, ids, top, gate_up, L.counts, L.offsets, L.row_pair, L.pair_row, L.tile_expert,
             *wq[:6])
    return out, saved, (top_k, score_func, bool(route_norm), float(route_scale), layer_name,
                        (w1.dtype, w2.dtype, w3.dtype))


class FusedFp8LayerFunction(torch.autograd.Function):
    """x (T, D) bf16 -> routed-experts output (T, D) bf16 through gate linear, fused top-k router and the
    blockwise-FP8 experts (EP = 1; "fp8": FP8 forward and backward, "fp8_bwd": bf16 forward, FP8 backward).

    forward(x_TD, gate_w (E, D), expert_bias (E,) or None, counts_into (E,) fp32, w1 (E, F, D), w2 (E, D, F),
    w3 (E, F, D), top_k, score_func, route_norm, route_scale, cache (``fp8_backend.Fp8WeightCache`` or None: quantize
    the weights now), fp8_forward, layer_name, launched=None):
    ``launched`` is what :func:`fused_forward_fp8` returned for these operands (its kernels already enqueued), else
    the forward calls it. Gradients to x, gate_w, w1, w2, w3 (in the weights' dtypes).
    """

    @staticmethod
    def forward(ctx, x_TD, gate_w, expert_bias, counts_into, w1, w2, w3, top_k, score_func, route_norm, route_scale,
                cache, fp8_forward, layer_name, launched=None):
        if launched is None:
            launched = fused_forward_fp8(x_TD, gate_w, expert_bias, counts_into, w1, w2, w3, top_k, score_func,
                                         route_norm, route_scale, cache, fp8_forward, layer_name)
        out, saved, ctx.cfg = launched
        ctx.save_for_backward(*saved)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        from titan_megamoe.kernels.grouped_gemm_bwd import reduce_dscore  # needs triton

        x, gate_w, logits, ids, top, gate_up, *rest = ctx.saved_tensors
        layout, wq_bwd = rest[:5], list(rest[5:])
        top_k, score_func, route_norm, route_scale, layer_name, w_dtypes = ctx.cfg
        L = tb.layout_from_tensors(*layout, fb.FP8_BLOCK_M, gate_w.shape[0], top_k)
        w_dtype = torch.float32 if w_dtypes[0] == torch.float32 else torch.bfloat16
        dx_rows, part, dw1, dw2, dw3 = fb.fp8_experts_bwd(dout.contiguous(), x, top, wq_bwd, gate_up, L, w_dtype,
                                                          layer_name)
        T, K = top.shape
        dscores = reduce_dscore(part, L, T, K)
        dx, dgate_w = eager_layer.router_backward(dx_rows, L, dscores, x, gate_w, logits, ids, score_func, route_norm,
                                                  route_scale, ctx.needs_input_grad[1])
        dw1, dw2, dw3 = (g.to(d) for g, d in zip((dw1, dw2, dw3), w_dtypes))
        return (dx, dgate_w, None, None, dw1, dw2, dw3, None, None, None, None, None, None, None, None)
