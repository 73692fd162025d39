"""Routing metadata for the fused kernels: expert-major, block-aligned row layout, no host sync.

Shape legend: T tokens, K top_k, P = T*K (token, slot) pairs (pair p = t*K + k), E experts,
BM the GEMM row block, N_cap = P + E*(BM-1) rows (static upper bound of the padded layout),
n_tiles_cap = N_cap // BM (rounded up).

Layout: each expert's rows are contiguous, in ascending pair order (stable, so deterministic), and
padded to a multiple of BM; an expert with no pair has no rows and no tile. Row r of expert e lives
at ``offsets[e] + i``. Padding rows hold pair -1. Every buffer has a size known from (T, K, E, BM)
alone, so nothing is read back to the host and the whole layer can be captured in a CUDA graph;
kernels launch ``n_tiles_cap`` row tiles and return early on tiles whose expert is -1.

Example (T=2, K=2, E=3, BM=2; ids [[2, 0], [0, 1]], pairs p = 0..3 with experts [2, 0, 0, 1]):
counts [2, 1, 1] -> padded [2, 2, 2] -> offsets [0, 2, 4, 6];
row_pair = [1, 2, 3, -1, 0, -1, (-1 ...)]; pair_row = [4, 0, 1, 2]; tile_expert = [0, 1, 2, -1, ...].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["RoutingLayout", "build_routing_layout", "layout_caps"]


def layout_caps(T: int, K: int, E: int, block_m: int) -> tuple[int, int]:
    """(N_cap, n_tiles_cap): rows and row tiles of the padded layout, for any routing."""
    n_cap = T * K + E * (block_m - 1)
    n_tiles = -(-n_cap // block_m)
    return n_tiles * block_m, n_tiles


@dataclass
class RoutingLayout:
    """Expert-major padded layout of the (token, slot) pairs; all int32 device tensors.

    Attributes:
        counts: (E,) pairs per expert.
        offsets: (E + 1,) first padded row of each expert; offsets[E] = rows in use.
        row_pair: (N_cap,) pair id t*K + k of each padded row, -1 for padding / unused rows.
        pair_row: (P,) padded row of each pair.
        tile_expert: (n_tiles_cap,) expert of each BM-row tile, -1 for tiles past the end.
        block_m, num_experts, top_k: the constants the layout was built for.
    """

    counts: Tensor
    offsets: Tensor
    row_pair: Tensor
    pair_row: Tensor
    tile_expert: Tensor
    block_m: int
    num_experts: int
    top_k: int

    @property
    def n_cap(self) -> int:
        return self.row_pair.shape[0]

    @property
    def n_tiles_cap(self) -> int:
        return self.tile_expert.shape[0]


def build_routing_layout(topk_ids_TK: Tensor, num_experts: int, block_m: int) -> RoutingLayout:
    """Build the padded expert-major layout from top-k ids with device ops only (no host sync).

    Args:
        topk_ids_TK: (T, K) integer expert ids in [0, num_experts) (ids outside give undefined layout;
            the op checks them up front).
        num_experts: E.
        block_m: BM, the row block of the grouped GEMMs (a power of two).

    Returns:
        RoutingLayout (see its attributes).
    """
    T, K = topk_ids_TK.shape
    E, BM = num_experts, block_m
    dev = topk_ids_TK.device
    P = T * K
    n_cap, n_tiles = layout_caps(T, K, E, BM)
    ids_P = topk_ids_TK.reshape(-1).to(torch.int64)
    # scatter_add instead of bincount: bincount reads max() back to the host.
    counts = torch.zeros(E, dtype=torch.int64, device=dev).scatter_add_(0, ids_P, torch.ones_like(ids_P))
    padded = (counts + BM - 1) // BM * BM
    offsets = torch.zeros(E + 1, dtype=torch.int64, device=dev)
    offsets[1:] = torch.cumsum(padded, 0)
    order = torch.argsort(ids_P, stable=True)  # pairs grouped by expert, ascending pair id within
    sorted_ids = ids_P[order]
    starts = torch.cumsum(counts, 0) - counts  # unpadded start of each expert in `order`
    rank_in_expert = torch.arange(P, device=dev) - starts[sorted_ids]
    rows = offsets[sorted_ids] + rank_in_expert
    row_pair = torch.full((n_cap,), -1, dtype=torch.int32, device=dev)
    row_pair[rows] = order.to(torch.int32)
    pair_row = torch.empty(P, dtype=torch.int32, device=dev)
    pair_row[order] = rows.to(torch.int32)
    tile_start = torch.arange(n_tiles, device=dev) * BM
    tile_expert = torch.searchsorted(offsets[1:], tile_start, right=True)  # first expert ending after
    tile_expert = torch.where(tile_start < offsets[E], tile_expert, torch.full_like(tile_expert, -1))
    return RoutingLayout(
        counts=counts.to(torch.int32), offsets=offsets.to(torch.int32), row_pair=row_pair,
        pair_row=pair_row, tile_expert=tile_expert.to(torch.int32), block_m=BM, num_experts=E, top_k=K,
    )
