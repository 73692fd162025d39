"""scripts/protocol_ab.py's bookkeeping (the script itself needs a GPU)."""

import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "protocol_ab", Path(__file__).resolve().parents[1] / "scripts" / "protocol_ab.py")
protocol_ab = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(protocol_ab)


def test_rounds_rotate_the_condition_order():
    names = list(protocol_ab.CONDITIONS)
    orders = [protocol_ab.rotated(names, r) for r in range(len(names))]
    assert [o[0] for o in orders] == names  # each condition goes first once
    assert all(sorted(o) == sorted(names) for o in orders)
    assert protocol_ab.rotated(names, len(names) + 1) == orders[1]


def test_summary_medians_and_ratio_of_second_impl_over_first():
    samples = {"none+gc": {"ours": {"fwd": [1.0, 3.0, 2.0], "fwdbwd": [4.0, 5.0, 6.0], "host_fwd": [0.5, 0.5, 0.7]},
                           "stock": {"fwd": [5.0, 5.0, 7.0], "fwdbwd": [10.0, 12.0, 11.0],
                                     "host_fwd": [0.1, 0.2, 0.3]}}}
    s = protocol_ab.summarize(samples, ["ours", "stock"])["none+gc"]
    assert s["ours"] == {"fwd_ms": 2.0, "fwdbwd_ms": 5.0, "host_fwd_ms": 0.5}
    assert s["ratio_fwd"] == pytest.approx(2.5) and s["ratio_fwdbwd"] == pytest.approx(2.2)
    one = protocol_ab.summarize({"c": {"ours": samples["none+gc"]["ours"]}}, ["ours"])["c"]
    assert "ratio_fwd" not in one
