"""Pure-PyTorch expert-parallel MoE: the oracle for every kernel and the "reference" backend.

Shape legend (per rank):
    T   tokens on this rank                 D   model dim            F   expert hidden dim
    K   top_k                               E   routed experts (global)
    R   EP group size                       e   local experts = E // R
    S   rows this rank sends (one per (token, destination rank) pair)
    M   rows this rank receives              P   (row, slot) pairs computed here = routed rows

Math (same as TorchTitan 0.2.2 ``MoE`` with ``GroupedExperts``)::

    out[t] = sum_k  s[t,k] * W2[i] (silu(W1[i] x[t]) * (W3[i] x[t])),   i = topk_ids[t,k]

with the weighted sum over k in fp32, then cast to x.dtype. With ``score_before_experts`` (DeepSeek-V3,
Llama4) the score scales the expert input instead (``(x * s).to(x.dtype)``) and the outputs are summed.

Expert parallelism (rank r owns experts [r*e, (r+1)*e)):
  1. dispatch: one copy of x[t] per destination rank that owns any of t's experts (not one per
     expert), with the K slot ids (local expert or -1) and scores of that rank's slots;
  2. each rank runs its local experts on every valid (row, slot) pair and pre-sums the weighted
     outputs of a row over its slots in fp32, in slot order -> one fp32 partial row per received row;
  3. combine: partial rows go back to their source, which adds them in rank order (fp32) and casts.

Every reduction runs in a fixed order, without atomics on shared addresses, so forward and
backward are deterministic for a given input. The split sizes of the all-to-all are read on the
host (one sync per call): fine for an oracle, and the reason the fused backends exist.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.distributed._functional_collectives import all_to_all_single_autograd

from titan_megamoe.errors import CapacityError

__all__ = ["mega_moe_ref", "local_experts_ref", "swiglu_expert_ref"]


def swiglu_expert_ref(x_MD: Tensor, w1_FD: Tensor, w2_DF: Tensor, w3_FD: Tensor) -> Tensor:
    """One SwiGLU expert: ``W2 (silu(W1 x) * (W3 x))``. x (M, D), w1/w3 (F, D), w2 (D, F) -> (M, D)."""
    h_MF = F.silu(x_MD @ w1_FD.transpose(0, 1)) * (x_MD @ w3_FD.transpose(0, 1))
    return h_MF @ w2_DF.transpose(0, 1)


def local_experts_ref(
    x_MD: Tensor,
    slot_ids_MK: Tensor,
    slot_scores_MK: Tensor,
    w1_eFD: Tensor,
    w2_eDF: Tensor,
    w3_eFD: Tensor,
    *,
    score_before_experts: bool = False,
    recv_capacity: int | None = None,
    layer_name: str = "moe",
) -> Tensor:
    """Run the local experts on received rows and pre-sum each row over its slots.

    Args:
        x_MD: (M, D) received token rows (bf16 or fp32).
        slot_ids_MK: (M, K) int64 local expert id of each slot, -1 where the slot lives elsewhere.
        slot_scores_MK: (M, K) fp32 routing scores (0 where the id is -1).
        w1_eFD, w3_eFD: (e, F, D) gate / up projections; w2_eDF: (e, D, F) down projection.
        score_before_experts: scale the expert input by the score instead of the output.
        recv_capacity: largest number of valid (row, slot) pairs accepted, or None for no limit.
        layer_name: used in error messages.

    Returns:
        (M, D) fp32 partial sums ``sum_k s[m,k] * expert_{id[m,k]}(x[m])`` over valid slots, added in
        slot order.

    Raises:
        CapacityError: more routed (row, slot) pairs than ``recv_capacity``.
    """
    M, D = x_MD.shape
    K = slot_ids_MK.shape[1]
    e = w1_eFD.shape[0]
    ids_P = slot_ids_MK.reshape(-1)
    valid_P = torch.nonzero(ids_P >= 0).squeeze(1)
    num_pairs = valid_P.numel()
    if recv_capacity is not None and num_pairs > recv_capacity:
        raise CapacityError(
            f"{layer_name}: this rank received {num_pairs} routed (token, expert) rows, more than its "
            f"capacity of {recv_capacity}. Raise [megamoe] capacity_factor (or max_tokens_per_rank); "
            "tokens are never dropped."
        )
    # Expert-major order (stable: ties keep (row, slot) order, so the layout is deterministic).
    order = torch.argsort(ids_P[valid_P], stable=True)
    pair_P = valid_P[order]
    rows_P, slots_P = pair_P // K, pair_P % K
    counts = torch.bincount(ids_P[pair_P], minlength=e).tolist()  # host sync: oracle only

    # Expanding to (M, K, D) and indexing unique (row, slot) pairs keeps the backward free of
    # duplicate-index accumulation (deterministic).
    xp_PD = x_MD.unsqueeze(1).expand(M, K, D)[rows_P, slots_P]
    score_P1 = slot_scores_MK[rows_P, slots_P].unsqueeze(1)
    if score_before_experts:
        xp_PD = (xp_PD.to(score_P1.dtype) * score_P1).to(x_MD.dtype)

    w1s, w2s, w3s = w1_eFD.unbind(0), w2_eDF.unbind(0), w3_eFD.unbind(0)
    outs = []
    for i, (xi_D) in enumerate(torch.split(xp_PD, counts, dim=0)):
        if counts[i] == 0:
            continue
        outs.append(swiglu_expert_ref(xi_D, w1s[i], w2s[i], w3s[i]))
    if not outs:
        # No routed row here: still put the weights in the graph (zero gradients), so every rank
        # produces the same set of gradients (FSDP's reduce-scatter needs that).
        outs.append(swiglu_expert_ref(xp_PD[:0], w1s[0], w2s[0], w3s[0]))
    acc = torch.promote_types(x_MD.dtype, torch.float32)
    y_PD = torch.cat(outs, 0).to(acc)
    if not score_before_experts:
        y_PD = y_PD * score_P1

    partial_MD = torch.zeros((M, D), dtype=acc, device=x_MD.device)
    for k in range(K):  # fixed slot order; within one slot every row appears at most once
        sel = torch.nonzero(slots_P == k).squeeze(1)
        partial_MD = partial_MD.index_add(0, rows_P[sel], y_PD[sel])
    return partial_MD


def _all_to_all(x: Tensor, out_splits: list[int], in_splits: list[int], group) -> Tensor:
    # Functional collective: differentiable (backward = the reverse all-to-all), works on gloo.
    return all_to_all_single_autograd(x.contiguous(), out_splits, in_splits, group)


def mega_moe_ref(
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
    recv_capacity: int | None = None,
    layer_name: str = "moe",
) -> Tensor:
    """Expert-parallel MoE expert path (dispatch, SwiGLU experts, weighted combine), differentiable.

    Args:
        x_TD: (T, D) tokens of this rank, bf16 or fp32.
        topk_ids_TK: (T, K) int global expert ids in [0, num_experts), distinct per token.
        topk_scores_TK: (T, K) routing scores (fp32; gradients flow back to the router).
        w1_eFD, w3_eFD: (e, F, D) this rank's gate / up weights; w2_eDF: (e, D, F) down weights,
            with e = num_experts // R; rank r owns global experts [r*e, (r+1)*e).
        num_experts: E, the global number of routed experts.
        ep_group: the expert-parallel process group (R ranks), or None for R = 1.
        score_before_experts: apply the score to the expert input (Llama4 style).
        recv_capacity: largest number of routed (token, expert) rows this rank accepts.
        layer_name: used in error messages.

    Returns:
        (T, D) tensor in x's dtype.

    Raises:
        ValueError: inconsistent shapes, expert ids out of range, or E not divisible by R.
        CapacityError: more routed rows than ``recv_capacity`` on this rank.

    Example (R = 1, one token, K = 2): out = s0 * expert_a(x) + s1 * expert_b(x), summed in fp32.
    """
    T, D = x_TD.shape
    K = topk_ids_TK.shape[1]
    e = w1_eFD.shape[0]
    R = 1 if ep_group is None else dist.get_world_size(ep_group)
    _check_inputs(x_TD, topk_ids_TK, topk_scores_TK, w1_eFD, w2_eDF, w3_eFD, num_experts, R)
    ids_TK = topk_ids_TK.to(torch.int64)
    scores_TK = topk_scores_TK.to(torch.promote_types(x_TD.dtype, torch.float32))

    dest_TK = ids_TK // e
    local_TK = ids_TK % e
    present_TR = torch.zeros((T, R), dtype=torch.bool, device=x_TD.device)
    present_TR.scatter_(1, dest_TK, True)
    present_RT = present_TR.transpose(0, 1)
    send_dst_S, send_tok_S = torch.nonzero(present_RT, as_tuple=True)  # rank-major, token order
    same_SK = dest_TK[send_tok_S] == send_dst_S.unsqueeze(1)
    ids_SK = torch.where(same_SK, local_TK[send_tok_S], torch.full_like(local_TK[send_tok_S], -1))
    scores_SK = torch.where(same_SK, scores_TK[send_tok_S], torch.zeros_like(scores_TK[send_tok_S]))
    # Unique (token, rank) pairs: deterministic backward for the dispatch gather.
    x_SD = x_TD.unsqueeze(1).expand(T, R, D)[send_tok_S, send_dst_S]

    if R == 1:
        partial_SD = local_experts_ref(
            x_SD, ids_SK, scores_SK, w1_eFD, w2_eDF, w3_eFD,
            score_before_experts=score_before_experts, recv_capacity=recv_capacity,
            layer_name=layer_name,
        )
        back_SD = partial_SD
    else:
        send_counts = torch.bincount(send_dst_S, minlength=R)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=ep_group)
        in_splits = send_counts.tolist()  # host sync: oracle only
        out_splits = recv_counts.tolist()
        x_MD = _all_to_all(x_SD, out_splits, in_splits, ep_group)
        ids_MK = _all_to_all(ids_SK, out_splits, in_splits, ep_group)
        scores_MK = _all_to_all(scores_SK, out_splits, in_splits, ep_group)
        partial_MD = local_experts_ref(
            x_MD, ids_MK, scores_MK, w1_eFD, w2_eDF, w3_eFD,
            score_before_experts=score_before_experts, recv_capacity=recv_capacity,
            layer_name=layer_name,
        )
        back_SD = _all_to_all(partial_MD, in_splits, out_splits, ep_group)

    out_TD = torch.zeros((T, D), dtype=back_SD.dtype, device=x_TD.device)
    bounds = torch.bincount(send_dst_S, minlength=R).tolist() if R > 1 else [send_tok_S.numel()]
    start = 0
    for n in bounds:  # rank order; each token appears at most once per rank
        out_TD = out_TD.index_add(0, send_tok_S[start:start + n], back_SD[start:start + n])
        start += n
    return out_TD.to(x_TD.dtype)


def _check_inputs(x, ids, scores, w1, w2, w3, num_experts, R):
    if x.dim() != 2:
        raise ValueError(f"x must be (T, D), got shape {tuple(x.shape)}")
    T, D = x.shape
    if ids.dim() != 2 or ids.shape[0] != T:
        raise ValueError(f"topk_ids must be (T={T}, K), got {tuple(ids.shape)}")
    if scores.shape != ids.shape:
        raise ValueError(f"topk_scores {tuple(scores.shape)} must match topk_ids {tuple(ids.shape)}")
    if ids.dtype.is_floating_point:
        raise ValueError(f"topk_ids must be an integer tensor, got {ids.dtype}")
    e, F_, D1 = w1.shape
    if D1 != D or w3.shape != w1.shape or tuple(w2.shape) != (e, D, F_):
        raise ValueError(
            f"expert weights must be w1/w3 (e, F, D={D}) and w2 (e, D, F); got w1 {tuple(w1.shape)}, "
            f"w2 {tuple(w2.shape)}, w3 {tuple(w3.shape)}"
        )
    if num_experts % R != 0 or num_experts // R != e:
        raise ValueError(
            f"num_experts={num_experts} must equal EP size {R} x local experts {e}"
        )
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_experts):
        raise ValueError(f"topk_ids out of range [0, {num_experts})")
