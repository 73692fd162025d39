"""Routing layout (kernels/routing.py) against a host-side construction, on named routings."""

from __future__ import annotations

import pytest
import torch

from titan_megamoe.kernels.routing import build_routing_layout, layout_caps
from titan_megamoe.testing import make_routing


def test_docstring_example():
    L = build_routing_layout(torch.tensor([[2, 0], [0, 1]]), 3, 2)
    assert L.counts.tolist() == [2, 1, 1]
    assert L.offsets.tolist() == [0, 2, 4, 6]
    assert L.row_pair.tolist()[:6] == [1, 2, 3, -1, 0, -1]
    assert L.pair_row.tolist() == [4, 0, 1, 2]
    assert L.tile_expert.tolist()[:4] == [0, 1, 2, -1]


CASES = [
    # (routing, T, E, K, BM): what it covers
    ("uniform", 37, 8, 2, 4),
    ("zero_expert", 64, 8, 3, 8),  # experts with no row have no tile
    ("one_expert", 50, 8, 1, 16),  # top_k = 1, one expert gets every token
    ("skewed", 101, 16, 4, 32),  # T not a multiple of BM, hot experts
    ("uniform", 1, 4, 4, 128),  # one token, K = E
]


@pytest.mark.parametrize("routing,T,E,K,BM", CASES, ids=[f"{c[0]}-T{c[1]}-K{c[3]}-BM{c[4]}" for c in CASES])
def test_layout_invariants(routing, T, E, K, BM):
    ids = make_routing(routing, T, E, K, seed=T)
    L = build_routing_layout(ids, E, BM)
    n_cap, n_tiles = layout_caps(T, K, E, BM)
    assert L.row_pair.shape == (n_cap,) and L.tile_expert.shape == (n_tiles,)
    flat = ids.reshape(-1)
    counts = torch.bincount(flat, minlength=E)
    assert torch.equal(L.counts.long(), counts)
    padded = (counts + BM - 1) // BM * BM
    assert L.offsets.tolist() == [0] + torch.cumsum(padded, 0).tolist()
    # every pair sits in its expert's range, in ascending pair order, and the maps are inverse
    for e in range(E):
        lo, hi = L.offsets[e].item(), L.offsets[e + 1].item()
        pairs = L.row_pair[lo:hi]
        real = pairs[pairs >= 0]
        assert real.tolist() == torch.nonzero(flat == e).squeeze(1).tolist()
        assert torch.all(pairs[len(real):] == -1)  # padding at the end of the expert's block
        assert all(L.tile_expert[r // BM].item() == e for r in range(lo, hi, BM))
    assert torch.equal(L.row_pair[L.pair_row.long()], torch.arange(T * K, dtype=torch.int32))
    assert torch.all(L.row_pair[L.offsets[E]:] == -1)
    assert torch.all(L.tile_expert[L.offsets[E].item() // BM:] == -1)
