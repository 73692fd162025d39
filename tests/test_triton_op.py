"""The Triton backend end to end (custom ops + autograd) against the reference operator.

On CPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, small shapes); on a GPU the
same tests run compiled (and tests/test_gpu.py adds real shapes and CUDA-graph capture).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from titan_megamoe.ops import mega_moe  # noqa: E402
from titan_megamoe.ops.reference import mega_moe_ref  # noqa: E402
from titan_megamoe.testing import assert_close_rel, make_routing  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"

CASES = [
    # (routing, T, D, F, E, K): the edge each row covers
    ("uniform", 37, 32, 32, 4, 2),  # T not a multiple of the block
    ("zero_expert", 40, 32, 48, 8, 3),  # experts with no token
    ("one_expert", 24, 48, 32, 4, 1),  # top_k = 1, all tokens on expert 0
    ("skewed", 33, 32, 32, 8, 4),
]


def _inputs(routing, T, D, F, E, K, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g).bfloat16()
    w1 = (torch.randn(E, F, D, generator=g) / D**0.5).bfloat16()
    w3 = (torch.randn(E, F, D, generator=g) / D**0.5).bfloat16()
    w2 = (torch.randn(E, D, F, generator=g) / F**0.5).bfloat16()
    s = torch.rand(T, K, generator=g)
    dout = torch.randn(T, D, generator=g).bfloat16()
    ids = make_routing(routing, T, E, K, seed=seed)
    return [t.to(DEV) for t in (x, ids, s, w1, w2, w3, dout)]


def _fwd_bwd(backend, x, ids, s, w1, w2, w3, dout):
    leaves = [t.clone().requires_grad_() for t in (x, s, w1, w2, w3)]
    if backend == "reference":
        # same bf16 operands, computed in fp32: the oracle
        f32 = [t.float() for t in leaves]
        out = mega_moe_ref(f32[0], ids, f32[1], *f32[2:], num_experts=w1.shape[0])
    else:
        out = mega_moe(leaves[0], ids, leaves[1], *leaves[2:], num_experts=w1.shape[0], backend="triton")
    out.backward(dout.to(out.dtype))
    return [out.detach()] + [t.grad for t in leaves]


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-T{c[1]}-K{c[5]}" for c in CASES])
def test_triton_matches_reference(case):
    inputs = _inputs(*case)
    got = _fwd_bwd("triton", *inputs)
    ref = _fwd_bwd("reference", *inputs)
    for name, a, b in zip(("out", "dx", "dscores", "dw1", "dw2", "dw3"), got, ref):
        assert a.dtype == (torch.float32 if name == "dscores" else torch.bfloat16), name
        assert_close_rel(a.float(), b.float(), torch.bfloat16, name)


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch has no _grouped_mm")
@pytest.mark.parametrize("case", CASES[1:3], ids=[f"{c[0]}-T{c[1]}-K{c[5]}" for c in CASES[1:3]])
def test_triton_with_grouped_mm_wgrad_matches_reference(case, monkeypatch):
    """The op with the sm_90 default wgrad (gathered rows + torch._grouped_mm) forced on this device."""
    monkeypatch.setenv("TITAN_MEGAMOE_WGRAD", "grouped_mm")
    inputs = _inputs(*case)
    got = _fwd_bwd("triton", *inputs)
    ref = _fwd_bwd("reference", *inputs)
    for name, a, b in zip(("out", "dx", "dscores", "dw1", "dw2", "dw3"), got, ref):
        assert_close_rel(a.float(), b.float(), torch.bfloat16, name)


def test_triton_deterministic_bitwise():
    inputs = _inputs("skewed", 33, 32, 32, 8, 4, seed=3)
    a = _fwd_bwd("triton", *inputs)
    b = _fwd_bwd("triton", *inputs)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_custom_ops_opcheck():
    import titan_megamoe.ops.library  # noqa: F401  (registers the ops; run alone, nothing else has)

    x, ids, s, w1, w2, w3, _ = _inputs("uniform", 20, 32, 32, 4, 2)
    args = (x, ids, s, w1.requires_grad_(), w2.requires_grad_(), w3.requires_grad_())
    torch.library.opcheck(torch.ops.megamoe.bf16_mega_moe_fwd.default, args,
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


def test_triton_refuses_what_it_cannot_do():
    x, ids, s, w1, w2, w3, _ = _inputs("uniform", 8, 32, 32, 4, 2)
    with pytest.raises(ValueError, match="floating point"):
        mega_moe(x.to(torch.int32), ids, s, w1, w2, w3, num_experts=4, backend="triton")
    with pytest.raises(NotImplementedError, match="score_before_experts"):
        mega_moe(x, ids, s, w1, w2, w3, num_experts=4, backend="triton", score_before_experts=True)
    odd = torch.zeros(4, 24, 20, dtype=torch.bfloat16, device=x.device)
    with pytest.raises(ValueError, match="multiples of 16"):
        mega_moe(torch.zeros(8, 20, dtype=torch.bfloat16, device=x.device), ids, s, odd, odd.transpose(1, 2), odd,
                 num_experts=4, backend="triton")


def test_fp32_params_compute_in_bf16_like_stock():
    """Without FSDP mixed precision, params are fp32: the op computes in bf16 (as stock TorchTitan's
    grouped-mm experts do) and returns x's dtype, with fp32 gradients for fp32 leaves."""
    x, ids, s, w1, w2, w3, dout = _inputs("uniform", 21, 32, 32, 4, 2, seed=5)
    leaves = [t.float().requires_grad_() for t in (x, w1, w2, w3)]
    out = mega_moe(leaves[0], ids, s, *leaves[1:], num_experts=4, backend="triton")
    assert out.dtype == torch.float32
    out.backward(dout.float())
    assert all(t.grad.dtype == torch.float32 for t in leaves)
    ref = mega_moe_ref(x.float(), ids, s, w1.float(), w2.float(), w3.float(), num_experts=4)
    assert_close_rel(out.detach(), ref, torch.bfloat16, "out")
