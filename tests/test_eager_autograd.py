"""ops/eager.py: eager calls of the fused ops skip the custom op's dispatch and give bitwise the custom
op's results; torch.compile still traces the custom ops. EP = 2 through both paths is covered by
tests/test_ep_triton.py / test_ep_fp8.py (eager, the default) and below (custom op, switched off)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from titan_megamoe.ops import eager, mega_moe  # noqa: E402
from titan_megamoe.ops.fp8_backend import NONFINITE, Fp8WeightCache  # noqa: E402
from titan_megamoe.testing import make_routing  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(T, D, F, E, K, routing="skewed", seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g).bfloat16()
    w1 = (torch.randn(E, F, D, generator=g) / D**0.5).bfloat16()
    w3 = (torch.randn(E, F, D, generator=g) / D**0.5).bfloat16()
    w2 = (torch.randn(E, D, F, generator=g) / F**0.5).bfloat16()
    s = torch.rand(T, K, generator=g) + 0.1
    dout = torch.randn(T, D, generator=g).bfloat16()
    ids = make_routing(routing, T, E, K, seed=seed)
    return [t.to(DEV) for t in (x, ids, s, w1, w2, w3, dout)]


def _run(precision, x, ids, s, w1, w2, w3, dout, *, wrap=None):
    leaves = [t.clone().requires_grad_() for t in (x, s, w1, w2, w3)]

    def layer(xx, ss, a, b, c):
        return mega_moe(xx, ids, ss, a, b, c, num_experts=w1.shape[0], backend="triton", precision=precision,
                        layer_name="layers.0.moe", fp8_cache=Fp8WeightCache() if precision != "bf16" else None)

    out = layer(*leaves) if wrap is None else wrap(layer, *leaves)
    out.backward(dout)
    NONFINITE.flush()
    return out, [out.detach()] + [t.grad for t in leaves]


CASES = [
    # (precision, T, D, F, E, K): the edge each row covers
    ("bf16", 37, 32, 48, 4, 2),  # T not a multiple of the block, F != D
    ("bf16", 20, 32, 32, 8, 1),  # top_k = 1, some experts without tokens
    ("fp8", 24, 128, 128, 4, 2),
    ("fp8_bwd", 17, 128, 256, 2, 2),
]


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-T{c[1]}-K{c[5]}" for c in CASES])
def test_eager_path_is_bitwise_the_custom_op(case, monkeypatch):
    precision, *shape = case
    inputs = _inputs(*shape)
    monkeypatch.setattr(eager, "ENABLED", True)
    out_e, got_e = _run(precision, *inputs)
    monkeypatch.setattr(eager, "ENABLED", False)
    out_o, got_o = _run(precision, *inputs)
    # the path each call took: the Function's node vs the custom op's generated autograd node
    assert type(out_e.grad_fn).__name__ == "_EagerFunctionBackward", type(out_e.grad_fn).__name__
    assert type(out_o.grad_fn).__name__ != "_EagerFunctionBackward"
    for name, a, b in zip(("out", "dx", "dscores", "dw1", "dw2", "dw3"), got_e, got_o):
        assert torch.isfinite(a).all() and a.abs().sum() > 0, name  # nothing trivially equal
        assert a.dtype == b.dtype and torch.equal(a, b), f"{precision} {name}: eager path differs from the op"


def test_eager_path_under_activation_checkpointing(monkeypatch):
    """Non-reentrant checkpointing (TorchTitan's full AC) packs the Function's saved intermediates
    (gate_up, the layout) through its hooks and recomputes them: same gradients as without AC."""
    from torch.utils.checkpoint import checkpoint

    monkeypatch.setattr(eager, "ENABLED", True)
    inputs = _inputs(29, 32, 32, 4, 2)
    _, plain = _run("bf16", *inputs)
    calls = []

    def wrap(layer, *leaves):
        def counted(*a):
            calls.append(1)
            return layer(*a)
        return checkpoint(counted, *leaves, use_reentrant=False)

    _, ckpt = _run("bf16", *inputs, wrap=wrap)
    assert len(calls) == 2, "the checkpointed forward was not recomputed in the backward"
    for a, b in zip(plain, ckpt):
        assert torch.equal(a, b)


def test_compile_traces_the_custom_op_not_the_function(monkeypatch):
    """Under torch.compile the custom op (fake + registered autograd) is what gets traced."""
    monkeypatch.setattr(eager, "ENABLED", True)
    x, ids, s, w1, w2, w3, dout = _inputs(21, 32, 32, 4, 2)

    def refuse(*a, **k):
        raise AssertionError("the eager Function was called while compiling")

    eager_out = mega_moe(x, ids, s, w1, w2, w3, num_experts=4, backend="triton")
    monkeypatch.setattr(eager._EagerFunction, "apply", refuse)

    def fn(x, s, w1, w2, w3):
        return mega_moe(x, ids, s, w1, w2, w3, num_experts=4, backend="triton")

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    leaves = [t.clone().requires_grad_() for t in (x, s, w1, w2, w3)]
    out = compiled(*leaves)
    out.backward(dout)
    assert torch.equal(out.detach(), eager_out)
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in leaves)
    torch._dynamo.reset()
