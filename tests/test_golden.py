"""Golden-output regression test of the tiny MoE case (CPU; Triton through its interpreter).

``tests/golden/moe_tiny_v1.pt`` holds the inputs, and the outputs + all gradients of the fp32
reference operator and of the bf16 Triton backend, made by ``scripts/make_golden.py``. Here both
are recomputed from the stored inputs and compared:

* reference: ``torch.allclose(rtol=1e-6, atol=1e-7 * max(1, max |golden|))``. On one machine with one torch build the fp32
  reference is deterministic (bitwise), but not bitwise across machines / torch versions: CPU GEMM
  kernels (MKL / oneDNN / OpenBLAS, AVX2 vs AVX-512 code paths, thread-count dependent blocking)
  sum in different orders and may use FMA or not, and torch may change a reduction's algorithm;
  each moves results by a few fp32 ulps (~1e-7 relative) of the largest terms summed (a Xeon without
  AVX-512 moved a d score of 0.05 by 7e-7, from terms up to 14). A real numerics change is far larger.
* Triton: against the golden *reference* with the bf16 tolerance of ``TOLERANCES`` (correctness),
  and against its own golden with rtol=1e-3 (about a quarter of a bf16 ulp, so any change in
  rounding of the kernels' results fails loudly even while still "correct").
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from titan_megamoe.testing import TOLERANCES, assert_close_rel  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "golden" / "moe_tiny_v1.pt"
NAMES = ("out", "dx", "dscores", "dw1", "dw2", "dw3")
REGEN = (
    "If this numerics change is intended, regenerate the golden file with "
    "`python scripts/make_golden.py` (on a CPU machine: Triton runs in the interpreter) and give the "
    "reason for regenerating in the commit message."
)


def _load_maker():
    spec = importlib.util.spec_from_file_location("make_golden", ROOT / "scripts" / "make_golden.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


make_golden = _load_maker()


@pytest.fixture(scope="module")
def golden():
    assert GOLDEN.is_file(), f"missing {GOLDEN}. {REGEN}"
    data = torch.load(GOLDEN, weights_only=True)
    assert data["version"] == make_golden.VERSION and data["case"] == make_golden.CASE, (
        f"{GOLDEN} was made for another case/version ({data['case']}, v{data['version']}). {REGEN}")
    return data


@pytest.fixture(scope="module")
def inputs(golden):
    return make_golden.load_inputs(golden)


def _mismatch(name: str, got: torch.Tensor, want: torch.Tensor) -> str:
    diff = (got.double() - want.double()).abs()
    return (f"{name}: max abs diff {diff.max().item():.3e} at flat index {int(diff.argmax())}, "
            f"max |golden| {want.abs().max().item():.3e}. {REGEN}")


def test_golden_file_small_and_complete(golden):
    assert GOLDEN.stat().st_size < 400 * 1024
    for which in ("reference", "triton"):
        assert set(golden[which]) == set(NAMES), which
    c = golden["case"]
    assert golden["inputs"]["ids"].shape == (c["T"], c["K"])
    assert golden["reference"]["dw1"].dtype == torch.float32
    assert golden["triton"]["out"].dtype == torch.bfloat16


def test_inputs_regenerate(golden, inputs):
    """The seeded inputs and routing still come out the same (else a diff below may be the RNG's)."""
    fresh = make_golden.make_inputs()
    for k, v in inputs.items():
        assert torch.equal(fresh[k], v), (
            f"input {k!r} no longer regenerates from the seed (torch RNG or make_routing changed); "
            f"the comparisons use the stored inputs, so they still hold. {REGEN}")


def test_reference_matches_golden(golden, inputs):
    got = make_golden.run_reference(inputs)
    for name in NAMES:
        want = golden["reference"][name]
        assert got[name].dtype == want.dtype == torch.float32, name
        # atol scaled by the tensor's size: a sum with cancellation (dscores) moves by ulps of its largest terms
        atol = 1e-7 * max(1.0, float(want.abs().max()))
        assert torch.allclose(got[name], want, rtol=1e-6, atol=atol), _mismatch(f"reference {name}", got[name], want)


def test_triton_matches_golden(golden, inputs):
    got = make_golden.run_triton(inputs)
    for name in NAMES:
        mine, ref = golden["triton"][name], golden["reference"][name]
        assert got[name].dtype == mine.dtype, name
        # correct: within the bf16 bound of the fp32 reference golden
        try:
            assert_close_rel(got[name].float(), ref, torch.bfloat16, f"triton {name} vs reference golden")
        except AssertionError as err:
            raise AssertionError(f"{err} (bound TOLERANCES[bf16] = {TOLERANCES[torch.bfloat16]}). {REGEN}") from None
        # unchanged: tight against its own golden, so a kernel numerics change fails loudly
        assert torch.allclose(got[name].float(), mine.float(), rtol=1e-3, atol=1e-6), (
            _mismatch(f"triton {name} vs its own golden (rtol 1e-3)", got[name].float(), mine.float()))
