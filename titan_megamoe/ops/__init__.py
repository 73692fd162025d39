"""The one functional entry point of the fused MoE operator.

Shape legend: T tokens on this rank, D model dim, F expert hidden dim, K top_k, E routed experts,
e = E // R local experts, R the expert-parallel group size.
"""

from __future__ import annotations


import torch
import torch.distributed as dist
from torch import Tensor

from titan_megamoe.config import AVAILABLE
from titan_megamoe.ops.reference import mega_moe_ref

__all__ = ["mega_moe", "mega_moe_ref"]


def mega_moe(
    x_TD: Tensor,
    topk_ids_TK: Tensor,
    topk_scores_TK: Tensor,
    w1_eFD: Tensor,
    w2_eDF: Tensor,
    w3_eFD: Tensor,
    *,
    num_experts: int,
    ep_group: dist.ProcessGroup | None = None,
    score_before_experts: bool = False,
    backend: str = "reference",
    precision: str = "bf16",
    recv_capacity: int | None = None,
    max_tokens_per_rank: int | None = None,
    layer_name: str = "moe",
    fp8_cache=None,
) -> Tensor:
    """Routed-expert path of an MoE layer: EP dispatch + SwiGLU experts + weighted combine.

    Args:
        x_TD: (T, D) bf16/fp32 tokens of this rank.
        topk_ids_TK: (T, K) integer global expert ids.
        topk_scores_TK: (T, K) fp32 routing scores.
        w1_eFD, w3_eFD: (e, F, D) local gate / up weights; w2_eDF: (e, D, F) local down weights.
        num_experts: E; rank r of ``ep_group`` owns experts [r*e, (r+1)*e).
        ep_group: expert-parallel process group, None for no expert parallelism.
        score_before_experts: scale the expert input (True) or output (False) by the score.
        backend: "reference" (pure PyTorch) or "triton" (fused kernels).
        precision: "bf16", "fp8" or "fp8_bwd".
        recv_capacity: largest number of routed rows a rank accepts (CapacityError beyond).
        max_tokens_per_rank: T_cap of the expert-parallel Triton path's workspace (needed there, bf16
            and FP8).
        layer_name: name used in error messages.
        fp8_cache: an ``ops.fp8_backend.Fp8WeightCache`` keeping the FP8 weights between calls
            (precision "fp8" / "fp8_bwd"); None quantizes the weights on every call.

    Returns:
        (T, D) output in x's dtype; the fp32 weighted sum over top_k is done in a fixed order.

    Raises:
        NotImplementedError: the (backend, precision) pair is not built yet.
        MegaMoEConfigError: FP8 on a GPU without FP8 tensor cores, or D or F not multiples of 128.
        NonFiniteError: an earlier FP8 call quantized inf / NaN (reported lazily, ops/fp8_backend.py).
        ValueError: inconsistent shapes or expert ids out of range.
        CapacityError: routed rows beyond ``recv_capacity``.
    """
    if backend not in AVAILABLE or precision not in AVAILABLE[backend]:
        raise NotImplementedError(
            f"mega_moe: backend={backend!r}, precision={precision!r} is not available yet"
        )
    if backend == "triton" and precision in ("fp8", "fp8_bwd"):
        return _mega_moe_fp8(x_TD, topk_ids_TK, topk_scores_TK, w1_eFD, w2_eDF, w3_eFD, ep_group=ep_group,
                             score_before_experts=score_before_experts, precision=precision,
                             recv_capacity=recv_capacity, max_tokens_per_rank=max_tokens_per_rank,
                             layer_name=layer_name, fp8_cache=fp8_cache)
    if backend == "triton":
        if ep_group is not None:
            # Expert parallelism inside the fused operator (ops/ep_backend.py; 2-GPU test:
            # tests/test_gpu.py::test_ep_triton_two_gpus, training: benchmarks/results/train_30b8L_*).
            from titan_megamoe.ops.ep_library import mega_moe_ep_triton

            if score_before_experts or not max_tokens_per_rank or recv_capacity is None:
                raise NotImplementedError(
                    f"{layer_name}: the EP triton path needs score-after-experts and [megamoe] "
                    "max_tokens_per_rank > 0 (a static workspace size)")
            bf = torch.bfloat16
            out = mega_moe_ep_triton(x_TD.to(bf), topk_ids_TK, topk_scores_TK.to(torch.float32), w1_eFD.to(bf),
                                     w2_eDF.to(bf), w3_eFD.to(bf), ep_group=ep_group,
                                     max_tokens_per_rank=max_tokens_per_rank, recv_capacity=recv_capacity,
                                     layer_name=layer_name)
            return out.to(x_TD.dtype)
        if score_before_experts:
            raise NotImplementedError(
                f"{layer_name}: the triton backend applies the routing score after the experts (Qwen3 style); "
                "score_before_experts models (Llama4) need backend = 'reference' for now"
            )
        from titan_megamoe.ops.library import mega_moe_triton
        from titan_megamoe.ops.triton_backend import check_triton_inputs

        check_triton_inputs(x_TD, topk_ids_TK, topk_scores_TK, w1_eFD, w2_eDF, w3_eFD, layer_name)
        # bf16 compute whatever the parameter dtype, as stock TorchTitan's grouped-mm experts do
        # (fp32 params without FSDP mixed precision): the casts are no-ops for bf16 tensors.
        bf = torch.bfloat16
        out = mega_moe_triton(x_TD.to(bf), topk_ids_TK, topk_scores_TK.to(torch.float32),
                              w1_eFD.to(bf), w2_eDF.to(bf), w3_eFD.to(bf))
        return out.to(x_TD.dtype)
    return mega_moe_ref(
        x_TD, topk_ids_TK, topk_scores_TK, w1_eFD, w2_eDF, w3_eFD,
        num_experts=num_experts, ep_group=ep_group, score_before_experts=score_before_experts,
        recv_capacity=recv_capacity, layer_name=layer_name,
    )


def _mega_moe_fp8(x_TD, topk_ids_TK, topk_scores_TK, w1, w2, w3, *, ep_group, score_before_experts, precision,
                  recv_capacity, max_tokens_per_rank, layer_name, fp8_cache):
    """precision "fp8" / "fp8_bwd" on the triton backend: checks, then ops/library.py (EP = 1, or an EP
    group of one rank) or ops/ep_library.py (EP > 1: "fp8" dispatches x as e4m3 rows + scales, "fp8_bwd"
    as bf16 rows; the FP8 expert GEMMs on the receiving rank)."""
    from titan_megamoe.ops.fp8_backend import check_fp8_supported
    from titan_megamoe.ops.triton_backend import check_triton_inputs

    if score_before_experts:
        raise NotImplementedError(
            f"{layer_name}: the triton backend applies the routing score after the experts (Qwen3 style); "
            "score_before_experts models (Llama4) need backend = 'reference' for now")
    check_triton_inputs(x_TD, topk_ids_TK, topk_scores_TK, w1, w2, w3, layer_name)
    check_fp8_supported(x_TD.device, x_TD.shape[1], w1.shape[1], layer_name, precision)
    # Weights keep their dtype (fp32 master weights quantize straight from fp32 and get fp32
    # gradients); other dtypes (fp16) go through bf16.
    ok = (torch.bfloat16, torch.float32)
    w1, w2, w3 = (w if w.dtype in ok else w.to(torch.bfloat16) for w in (w1, w2, w3))
    x, scores = x_TD.to(torch.bfloat16), topk_scores_TK.to(torch.float32)
    if ep_group is not None and dist.get_world_size(ep_group) > 1:
        # Expert parallelism inside the fused operator, FP8 v1 (ops/ep_fp8_backend.py); 2-GPU check:
        # tests/ep_triton_worker.py (fp8 / fp8_bwd cases).
        from titan_megamoe.ops.ep_library import mega_moe_ep_triton_fp8

        if not max_tokens_per_rank or recv_capacity is None:
            raise NotImplementedError(
                f"{layer_name}: the EP triton path needs [megamoe] max_tokens_per_rank > 0 (a static workspace "
                "size) and a receive capacity")
        out = mega_moe_ep_triton_fp8(x, topk_ids_TK, scores, w1, w2, w3, fp8_forward=precision == "fp8",
                                     ep_group=ep_group, max_tokens_per_rank=max_tokens_per_rank,
                                     recv_capacity=recv_capacity, cache=fp8_cache, layer_name=layer_name)
        return out.to(x_TD.dtype)
    from titan_megamoe.ops.library import mega_moe_triton_fp8

    out = mega_moe_triton_fp8(x, topk_ids_TK, scores, w1, w2, w3, fp8_forward=precision == "fp8", cache=fp8_cache,
                              layer_name=layer_name)
    return out.to(x_TD.dtype)
