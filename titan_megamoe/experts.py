"""MegaMoEExperts: owns the routed experts' weights and calls the fused operator."""

from __future__ import annotations

from torch import Tensor

from torchtitan.models.moe.moe import GroupedExperts

from titan_megamoe.config import MegaMoEConfig
from titan_megamoe.errors import CapacityError
from titan_megamoe.ops import mega_moe
from titan_megamoe.parallelize import local_expert_weights

__all__ = ["MegaMoEExperts"]


class MegaMoEExperts(GroupedExperts):
    """Routed experts with TorchTitan's parameters (FQNs w1/w2/w3, same shapes and init).

    w1, w3: (E, F, D) gate / up; w2: (E, D, F) down. Under expert parallelism these are DTensors
    sharded ``Shard(0)`` on the "ep" mesh (TorchTitan's EP partitioning), and the operator does the
    dispatch and combine itself. ``forward`` takes the tokens and the routing, not pre-permuted rows.
    """

    def __init__(
        self,
        dim: int,
        hidden_dim: int,
        num_experts: int,
        *,
        config: MegaMoEConfig | None = None,
        score_before_experts: bool = False,
        top_k: int = 1,
        max_tokens_per_rank: int = 0,
        layer_name: str = "moe",
    ):
        super().__init__(dim=dim, hidden_dim=hidden_dim, num_experts=num_experts, use_grouped_mm=True)
        self.config = config or MegaMoEConfig()
        self.score_before_experts = score_before_experts
        self.top_k = top_k
        self.max_tokens_per_rank = max_tokens_per_rank
        self.layer_name = layer_name
        # FP8 weights (this rank's experts, at any EP size) quantized once per optimizer step
        # (ops/fp8_backend.py); None for bf16
        self.fp8_cache = None
        if self.config.precision in ("fp8", "fp8_bwd"):
            from titan_megamoe.ops.fp8_backend import Fp8WeightCache

            self.fp8_cache = Fp8WeightCache()

    def forward(self, x_TD: Tensor, topk_ids_TK: Tensor, topk_scores_TK: Tensor) -> Tensor:  # type: ignore[override]
        """x (T, D), topk_ids (T, K) int, topk_scores (T, K) fp32 -> (T, D) in x's dtype.

        Raises:
            CapacityError: T above ``max_tokens_per_rank`` or routed rows above the receive capacity.
        """
        w1, w2, w3, group = local_expert_weights(self, self.layer_name)
        T = x_TD.shape[0]
        capacity = None
        if self.max_tokens_per_rank > 0:
            if T > self.max_tokens_per_rank:
                raise CapacityError(
                    f"{self.layer_name}: {T} tokens in one call on this rank, more than "
                    f"max_tokens_per_rank={self.max_tokens_per_rank}. Raise [megamoe] max_tokens_per_rank."
                )
            ep = self.num_experts // w1.shape[0]
            capacity = self.config.recv_capacity(self.max_tokens_per_rank, self.top_k, ep, w1.shape[0])
        return mega_moe(
            x_TD, topk_ids_TK, topk_scores_TK, w1, w2, w3,
            num_experts=self.num_experts, ep_group=group,
            score_before_experts=self.score_before_experts,
            backend=self.config.backend, precision=self.config.precision,
            recv_capacity=capacity, max_tokens_per_rank=self.max_tokens_per_rank or None,
            layer_name=self.layer_name, fp8_cache=self.fp8_cache,
        )

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, backend={self.config.backend}, "
            f"precision={self.config.precision}, layer={self.layer_name}"
        )
