"""Reference operator and MegaMoE layer against stock TorchTitan 0.2.2 MoE, forward and all grads (CPU)."""

from __future__ import annotations

import pytest
import torch
from torchtitan.models.moe.moe import MoEArgs

from titan_megamoe.errors import CapacityError
from titan_megamoe.ops import mega_moe
from titan_megamoe.ops.reference import mega_moe_ref, swiglu_expert_ref
from titan_megamoe.testing import assert_close_rel, build_moe_pair, make_routing, stock_histc_on_cpu

QWEN3 = dict(score_func="softmax", route_norm=True, score_before_experts=False, num_shared_experts=0)
DSV3 = dict(score_func="sigmoid", route_norm=True, route_scale=2.5, score_before_experts=True,
            num_shared_experts=1, num_expert_groups=4, num_limited_groups=2)
LLAMA4 = dict(score_func="sigmoid", route_norm=False, score_before_experts=True, num_shared_experts=1)


def _run(layer, x, g):
    x = x.detach().clone().requires_grad_()
    out = layer(x)
    out.backward(g)
    grads = {n: p.grad.detach().clone() for n, p in layer.named_parameters() if p.grad is not None}
    return out.detach(), x.grad.detach(), grads


CASES = [
    # (name, style, T, D, F, E, K, dtype, grouped_mm)
    ("qwen3 fp32", QWEN3, 48, 32, 24, 8, 2, torch.float32, False),
    ("qwen3 top_k=1", QWEN3, 40, 32, 24, 8, 1, torch.float32, False),
    ("qwen3 T not multiple of anything", QWEN3, 37, 32, 24, 16, 4, torch.float32, False),
    ("qwen3 odd hidden sizes", QWEN3, 29, 33, 19, 8, 3, torch.float32, False),
    # stock's grouped_mm path needs a Triton GPU kernel (generate_permute_indices): for-loop on CPU
    ("qwen3 bf16", QWEN3, 64, 64, 32, 8, 2, torch.bfloat16, False),
    ("deepseek_v3 style: sigmoid, groups, shared, score before", DSV3, 45, 32, 16, 16, 4, torch.float32, False),
    ("llama4 style: top_k=1, shared, score before", LLAMA4, 33, 32, 16, 8, 1, torch.float32, False),
    ("deepseek_v3 style bf16", DSV3, 64, 64, 32, 16, 4, torch.bfloat16, False),
]


@pytest.mark.parametrize("name,style,T,D,F,E,K,dtype,gmm", CASES, ids=[c[0] for c in CASES])
def test_layer_matches_stock_torchtitan(name, style, T, D, F, E, K, dtype, gmm):
    args = MoEArgs(num_experts=E, top_k=K, use_grouped_mm=gmm, load_balance_coeff=1e-3, **style)
    pair = build_moe_pair(args, D, F, dtype=dtype, seed=T)
    gen = torch.Generator().manual_seed(T + 1)
    x = torch.randn(2, T, D, generator=gen).to(dtype)
    g = torch.randn(2, T, D, generator=gen).to(dtype)
    with stock_histc_on_cpu():
        ref_out, ref_dx, ref_grads = _run(pair.stock, x, g)
    out, dx, grads = _run(pair.mega, x, g)
    assert_close_rel(out, ref_out, dtype, "output")
    assert_close_rel(dx, ref_dx, dtype, "dx")
    assert set(grads) == set(ref_grads), "parameter FQNs must match stock TorchTitan"
    for n in ref_grads:
        if n == "router.gate.weight" and K == 1 and style.get("route_norm"):
            # s / s == 1 for every token: the gate gradient is zero up to rounding noise in both
            assert grads[n].abs().max() < 1e-6 and ref_grads[n].abs().max() < 1e-6
            continue
        assert_close_rel(grads[n], ref_grads[n], dtype, f"d{n}")
    # tokens_per_expert accounting is the same as stock (histc) - exact counts
    assert torch.equal(pair.mega.tokens_per_expert, pair.stock.tokens_per_expert)
    assert pair.mega.tokens_per_expert.sum().item() == 2 * T * K


def _fixed_router(layer, ids, scores):
    E = layer.router.num_experts
    counts = torch.bincount(ids.reshape(-1), minlength=E).float()
    layer.router.forward = lambda x, bias=None: (scores, ids, counts)


ROUTED = [
    # (routing, T, E, K): edge each covers is in testing.ROUTINGS
    ("zero_expert", 40, 16, 4),
    ("one_expert", 40, 8, 3),
    ("one_expert", 25, 8, 1),  # top_k = 1: every token on expert 0
    ("skewed", 61, 16, 2),
    ("uniform", 7, 8, 8),  # K = E: every expert on every token
]


@pytest.mark.parametrize("routing,T,E,K", ROUTED, ids=[f"{r[0]}-T{r[1]}-E{r[2]}-K{r[3]}" for r in ROUTED])
def test_forced_routing_matches_stock(routing, T, E, K):
    D, F = 24, 40
    args = MoEArgs(num_experts=E, top_k=K, use_grouped_mm=False, **QWEN3)
    pair = build_moe_pair(args, D, F, seed=K)
    ids = make_routing(routing, 2 * T, E, K, seed=3)
    results = []
    for layer in (pair.stock, pair.mega):
        scores = torch.rand(2 * T, K, generator=torch.Generator().manual_seed(5)).requires_grad_()
        _fixed_router(layer, ids, scores)
        x = torch.randn(2, T, D, generator=torch.Generator().manual_seed(6), requires_grad=True)
        with stock_histc_on_cpu():
            out = layer(x)
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(7)))
        results.append((out, x.grad, scores.grad, layer.experts.w1.grad, layer.experts.w2.grad, layer.experts.w3.grad))
    for name, a, b in zip(("out", "dx", "dscores", "dw1", "dw2", "dw3"), results[1], results[0]):
        assert_close_rel(a, b, torch.float32, name)
    # experts that received no token get an exactly zero weight gradient
    used = torch.zeros(E, dtype=torch.bool)
    used[ids.reshape(-1)] = True
    assert torch.all(results[1][3][~used] == 0)
    assert torch.all(results[1][3][used].abs().sum((1, 2)) > 0)


def test_reference_matches_naive_loop_fp64():
    """Oracle check of the oracle: per-token, per-slot loop in float64."""
    gen = torch.Generator().manual_seed(0)
    T, D, F, E, K = 13, 10, 7, 6, 3
    x = torch.randn(T, D, generator=gen, dtype=torch.float64)
    ids = make_routing("uniform", T, E, K, seed=1)
    s = torch.rand(T, K, generator=gen, dtype=torch.float64)
    w1, w3 = (torch.randn(E, F, D, generator=gen, dtype=torch.float64) for _ in range(2))
    w2 = torch.randn(E, D, F, generator=gen, dtype=torch.float64)
    out = mega_moe_ref(x, ids, s, w1, w2, w3, num_experts=E)
    expect = torch.stack([
        sum(s[t, k] * swiglu_expert_ref(x[t:t + 1], w1[ids[t, k]], w2[ids[t, k]], w3[ids[t, k]])[0] for k in range(K))
        for t in range(T)
    ])
    assert_close_rel(out, expect, torch.float64, "out")


def test_rank_with_no_tokens():
    E, D, F = 8, 16, 8
    x = torch.randn(0, D, requires_grad=True)
    w1 = torch.randn(E, F, D, requires_grad=True)
    w2 = torch.randn(E, D, F, requires_grad=True)
    out = mega_moe_ref(x, torch.zeros(0, 2, dtype=torch.int64), torch.zeros(0, 2), w1, w2, w1, num_experts=E)
    assert out.shape == (0, D)
    out.sum().backward()
    assert torch.equal(w1.grad, torch.zeros_like(w1)) and torch.equal(w2.grad, torch.zeros_like(w2))


def test_deterministic_forward_backward_bitwise():
    T, D, F, E, K = 50, 32, 16, 8, 3
    outs = []
    for _ in range(2):
        gen = torch.Generator().manual_seed(11)
        x = torch.randn(T, D, generator=gen, requires_grad=True)
        w1 = torch.randn(E, F, D, generator=gen, requires_grad=True)
        w2 = torch.randn(E, D, F, generator=gen, requires_grad=True)
        w3 = torch.randn(E, F, D, generator=gen, requires_grad=True)
        s = torch.rand(T, K, generator=gen, requires_grad=True)
        ids = make_routing("skewed", T, E, K, seed=2)
        y = mega_moe_ref(x, ids, s, w1, w2, w3, num_experts=E)
        y.backward(torch.randn(T, D, generator=gen))
        outs.append([y, x.grad, s.grad, w1.grad, w2.grad, w3.grad])
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def test_capacity_overflow_raises_with_layer_name():
    T, D, F, E, K = 20, 8, 8, 4, 2
    x = torch.randn(T, D)
    w = torch.randn(E, F, D)
    ids = make_routing("uniform", T, E, K)
    with pytest.raises(CapacityError, match=r"layers\.3\.moe.*40 routed.*capacity of 39.*capacity_factor"):
        mega_moe_ref(x, ids, torch.rand(T, K), w, w.transpose(1, 2).contiguous(), w,
                     num_experts=E, recv_capacity=39, layer_name="layers.3.moe")
    mega_moe_ref(x, ids, torch.rand(T, K), w, w.transpose(1, 2).contiguous(), w, num_experts=E, recv_capacity=40)


def test_bad_inputs_raise_clear_errors():
    x = torch.randn(4, 8)
    w = torch.randn(4, 6, 8)
    w2 = torch.randn(4, 8, 6)
    ids = torch.tensor([[0, 1]] * 4)
    s = torch.rand(4, 2)
    with pytest.raises(ValueError, match="out of range"):
        mega_moe_ref(x, ids + 3, s, w, w2, w, num_experts=4)
    with pytest.raises(ValueError, match="w1/w3"):
        mega_moe_ref(x, ids, s, w, w, w, num_experts=4)
    with pytest.raises(ValueError, match="must match"):
        mega_moe_ref(x, ids, s[:, :1], w, w2, w, num_experts=4)
    with pytest.raises(ValueError, match="multiples of"):  # triton fp8 exists; these dims (8, 6) it cannot take
        mega_moe(x, ids, s, w, w2, w, num_experts=4, backend="triton", precision="fp8")
    with pytest.raises(NotImplementedError, match="not available yet"):
        mega_moe(x, ids, s, w, w2, w, num_experts=4, precision="fp8")
