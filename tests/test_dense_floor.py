"""scripts/dense_floor.py's FLOP bookkeeping (the script itself needs a GPU)."""

import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "dense_floor", Path(__file__).resolve().parents[1] / "scripts" / "dense_floor.py")
dense_floor = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(dense_floor)


def test_chain_and_layer_flops_at_the_30b_shape():
    P, D, F = 16384 * 8, 2048, 768
    cf, cfb = dense_floor.chain_flops(P, D, F)
    lf, lfb = dense_floor.layer_flops(P, D, F)
    assert cf == 8 * P * D * F and cfb == 24 * P * D * F  # two GEMMs of P x D x 2F, backward twice
    assert lf == 6 * P * D * F and lfb == 18 * P * D * F  # GEMM1 (D -> 2F) + GEMM2 (F -> D)
    assert lfb / 1e12 == pytest.approx(3.71, rel=1e-2)  # 3.71 TFLOP per fwd+bwd step


def test_floor_is_layer_flops_over_rate():
    P, D, F = 131072, 4096, 1536
    f, fb = dense_floor.floors(600.0, P, D, F)
    assert fb == pytest.approx(18 * P * D * F / 600e12 * 1e3)
    assert fb == pytest.approx(3 * f)
    assert fb == pytest.approx(24.7, rel=1e-2)  # the 235B layer at 600 TF/s
