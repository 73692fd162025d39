"""scripts/l2_order_model.py: the tile orders it models (the Python statement of ``ws_gemm._tile_of`` and
``_tile_in_expert``) are permutations of the live tiles, the expert order puts a weight tile's readers next to each
other, and its LRU model charges each operand once when everything fits and more when it does not."""

import importlib.util
import os

import pytest

_SPEC = importlib.util.spec_from_file_location(
    "l2_order_model", os.path.join(os.path.dirname(__file__), "..", "scripts", "l2_order_model.py"))
model = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(model)


def _layout(routing="uniform"):
    from titan_megamoe.kernels.routing import build_routing_layout_torch
    from titan_megamoe.testing import make_routing

    lay = build_routing_layout_torch(make_routing(routing, 2048, 8, 2, seed=0), 8, 128)
    return lay.offsets.tolist(), lay.tile_expert.tolist()


@pytest.mark.parametrize("routing", ["uniform", "zero_expert", "one_expert", "skewed"])
def test_orders_are_permutations_of_the_live_tiles_expert_order_keeps_weight_readers_adjacent(routing):
    """Relies on the layout's experts starting on 128-aligned rows with ``tile_expert`` naming each row tile's
    expert, as the Gluon kernels' expert order (``WS_GEMM1_EXPERT_ORDER``) does."""
    offsets, tile_expert = _layout(routing)
    n_live = offsets[-1] // 128
    orders = model.tile_orders(offsets, tile_expert, 128, 5)
    for name, seq in orders.items():
        assert sorted(seq) == [(m, n) for m in range(n_live) for n in range(5)], name
    readers = [(tile_expert[m], n) for m, n in orders["expert order"]]
    runs = [k for i, k in enumerate(readers) if i == 0 or readers[i - 1] != k]
    assert len(runs) == len(set(readers)), "a weight tile's readers are not consecutive"


@pytest.mark.parametrize("grid", [False, True])
def test_lru_charges_each_operand_once_when_it_fits_and_more_when_it_does_not(grid):
    offsets, tile_expert = _layout()
    seq = model.tile_orders(offsets, tile_expert, 128, 4)["group_m 1"]
    n_live = offsets[-1] // 128
    k_steps, a_bytes, b_bytes = 6, 1000, 2000
    once = (n_live * k_steps * a_bytes + len(set(tile_expert[m] for m, _ in seq)) * k_steps * 4 * b_bytes) / 1e9
    big = model.simulate(seq, tile_expert, k_steps, a_bytes, b_bytes, 1, 10**9, 8, 0.05, grid, 0)
    assert big == pytest.approx(once)
    small = model.simulate(seq, tile_expert, k_steps, a_bytes, b_bytes, 1, 20 * b_bytes, 8, 0.05, grid, 0)
    assert small > 1.5 * once
