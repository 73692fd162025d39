"""Fused router kernel (kernels/router.py) against TorchTitan 0.2.2's ``TokenChoiceTopKRouter`` and the
torch path of ``MegaMoERouter``: selection, scores, counts, gradients, tie rule, errors, the layer.

On CPU the kernel runs in Triton's interpreter (conftest sets TRITON_INTERPRET=1). Logits are random
normal and resampled per token until the K-th and (K+1)-th choice values are clearly apart, so the
selected sets are defined whatever the summation order (bf16 logits collide often: 8 mantissa bits).

The sm_90a compile check runs in a subprocess with TRITON_INTERPRET=0 (``python
tests/test_router_kernel.py compile-sm90``), as in test_routing.py.
"""

import os

# Before any import of triton. Run as a script (compile check), the default is the real compiler.
os.environ.setdefault("TRITON_INTERPRET", "0" if __name__ == "__main__" else "1")

import sys  # noqa: E402

if __name__ == "__main__":
    import _script_setup  # noqa: F401  (this checkout first; registration stubs on a bare GPU machine)

import json  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from titan_megamoe.kernels import router  # noqa: E402
from titan_megamoe.kernels.jit import flavor, next_pow2  # noqa: E402
from titan_megamoe.kernels.sm90_check import compile_sm90  # noqa: E402
from _sm90 import sm90_result  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# Selected scores vs torch: numpy's exp and division in the interpreter; compiled, ex2.approx and
# div.full.f32 add a few ulps (kernels/router.py, "Numerics"; on an H200 the tie test's softmax
# scores differed from torch's in the last bits while ids and counts were exact).
SCORE_RTOL = 1e-6 if DEV == "cpu" else 4e-6
FLAG = "TITAN_MEGAMOE_FUSED_ROUTER"


def _choice(logits, score_func, bias):
    x = logits.float()
    s = torch.softmax(x, dim=1) if score_func == "softmax" else torch.sigmoid(x)
    return s if bias is None else s + bias


def _untied_rows(draw, to_logits, K, score_func, bias, margin=1e-5):
    """``draw(n)`` rows (a (T, .) tensor for n = T), redrawn per token until the K-th and (K+1)-th
    choice values of ``to_logits(rows)`` differ by more than ``margin`` (relative) in every row."""
    x = draw(None)
    for _ in range(100):
        with torch.no_grad():
            logits = to_logits(x)
        if K == logits.shape[1] or x.shape[0] == 0:
            return x
        c = _choice(logits, score_func, bias).sort(dim=1, descending=True).values
        bad = ((c[:, K - 1] - c[:, K]) <= margin * c[:, K - 1].abs()).cpu()
        if not bad.any():
            return x
        x[bad] = draw(int(bad.sum()))
    raise AssertionError("could not draw untied logits")


def _untied_logits(T, E, K, dtype, score_func, bias, gen):
    """(T, E) random normal logits in ``dtype`` without ties at the selection boundary."""
    return _untied_rows(lambda n: torch.randn(T if n is None else n, E, generator=gen).to(dtype),
                        lambda x: x, K, score_func, bias)


def _by_expert(scores, ids):
    """(scores, ids) with each row's slots sorted by expert id (slot order is not part of the contract)."""
    ids_sorted, order = ids.sort(dim=1)
    return scores.gather(1, order), ids_sorted


def _routers(E, K, score_func, route_norm, route_scale, dtype):
    """TorchTitan's router and a MegaMoERouter with the identity as gate weight (so the gate output is
    exactly the logits we drew, in ``dtype``)."""
    from torchtitan.models.moe.moe import TokenChoiceTopKRouter

    from titan_megamoe.layer import MegaMoERouter

    kw = dict(dim=E, num_experts=E, num_expert_groups=None, num_limited_groups=None, top_k=K,
              score_func=score_func, route_norm=route_norm, route_scale=route_scale, gate_bias=False)
    stock, mega = TokenChoiceTopKRouter(**kw), MegaMoERouter(**kw)
    with torch.no_grad():
        stock.gate.weight.copy_(torch.eye(E))
        mega.gate.weight.copy_(torch.eye(E))
    return stock.to(DEV, dtype), mega.to(DEV, dtype)


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts launcher calls, so a test sees which path the router took."""
    calls = []
    orig = router.topk_route

    def spy(*a, **kw):
        calls.append(a[0].shape)
        return orig(*a, **kw)

    monkeypatch.setattr(router, "topk_route", spy)
    return calls


FWD_EK = [(8, 1), (16, 8), (60, 8), (128, 8), (128, 1), (61, 20)]  # 60, 61: E not a power of two; K=20: the
# rounds as a loop (K > UNROLL_K), 61: odd E


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("E,K", FWD_EK, ids=[f"E{e}-K{k}" for e, k in FWD_EK])
@pytest.mark.parametrize("route_norm,route_scale", [(True, 2.5), (False, 0.75)], ids=["norm", "nonorm"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_matches_torchtitan_and_torch_path(monkeypatch, kernel_calls, score_func, with_bias, route_norm,
                                           route_scale, E, K, dtype):
    from titan_megamoe.testing import stock_histc_on_cpu

    gen = torch.Generator().manual_seed(E * 10 + K)
    bias = (torch.randn(E, generator=gen) * 0.05).to(DEV) if with_bias else None
    stock, mega = _routers(E, K, score_func, route_norm, route_scale, dtype)
    for T in (0, 1, 37):  # 37: not a multiple of BLOCK_T
        x = _untied_logits(T, E, K, dtype, score_func, None if bias is None else bias.cpu(), gen).to(DEV)
        with torch.no_grad(), stock_histc_on_cpu():
            ref = stock(x, bias)
        monkeypatch.setenv(FLAG, "0")
        n = len(kernel_calls)
        with torch.no_grad():
            torch_path = mega(x, bias)
        assert len(kernel_calls) == n, "switch off: the torch path must not launch the kernel"
        monkeypatch.setenv(FLAG, "1")
        with torch.no_grad():
            top, ids, counts = mega(x, bias)
        assert len(kernel_calls) == n + 1, "switch on: the fused path must launch the kernel"
        assert top.shape == ids.shape == (T, K) and counts.shape == (E,)
        assert (top.dtype, ids.dtype, counts.dtype) == (torch.float32, torch.int64, torch.float32)
        got_s, got_i = _by_expert(top, ids)
        for name, (r_top, r_ids, r_counts) in (("torchtitan", ref), ("torch path", torch_path)):
            want_s, want_i = _by_expert(r_top, r_ids)
            assert torch.equal(got_i, want_i), f"{name}: selected sets differ (T={T})"
            torch.testing.assert_close(got_s, want_s, rtol=SCORE_RTOL, atol=1e-7,
                                       msg=lambda m: f"{name} T={T}: {m}")
            assert torch.equal(counts, r_counts.float()), f"{name}: counts differ (T={T})"
        assert torch.equal(counts, torch.bincount(ids.reshape(-1), minlength=E).float())
        assert counts.sum().item() == T * K
        # documented slot order: descending choice value
        c = _choice(x, score_func, bias).gather(1, ids)
        assert (c[:, :-1] >= c[:, 1:]).all(), "slots not in descending choice order"


def _torch_route(logits, K, score_func, bias, route_norm, route_scale):
    """The torch path's math on given logits (differentiable), for the gradient checks."""
    s = _choice(logits, score_func, None)
    choice = s if bias is None else s + bias
    ids = torch.topk(choice, K, dim=-1, sorted=False).indices
    top = s.gather(1, ids)
    if route_norm:
        top = top / (top.sum(dim=-1, keepdim=True) + 1e-20)
    return top * route_scale, ids


GRAD_CASES = [  # (score_func, route_norm, with_bias, E, K)
    ("softmax", True, False, 60, 8),
    ("softmax", False, True, 16, 8),
    ("sigmoid", True, True, 60, 8),
    ("sigmoid", False, False, 128, 8),
    ("softmax", False, False, 8, 1),
    ("sigmoid", True, True, 16, 1),  # route_norm with K=1: d logits is rounding noise only
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", GRAD_CASES, ids=[f"{c[0]}-norm{int(c[1])}-bias{int(c[2])}-E{c[3]}-K{c[4]}"
                                                  for c in GRAD_CASES])
def test_gradients_match_torch_path(monkeypatch, case, dtype):
    from titan_megamoe.layer import MegaMoERouter
    from titan_megamoe.testing import rel_err

    score_func, route_norm, with_bias, E, K = case
    T, D, scale = 37, 24, 2.5
    gen = torch.Generator().manual_seed(E + K)
    bias = (torch.randn(E, generator=gen) * 0.05).to(DEV) if with_bias else None
    G = torch.randn(T, E, generator=gen).to(DEV)  # loss = sum top * G[t, expert]: slot order free
    bound = 1e-5 if dtype == torch.float32 else 1e-2
    tiny = route_norm and K == 1

    # d logits: the kernel's backward against autograd through the torch math
    logits = _untied_logits(T, E, K, dtype, score_func, None if bias is None else bias.cpu(), gen).to(DEV)
    grads = []
    for fused in (True, False):
        leaf = logits.clone().requires_grad_()
        if fused:
            top, ids, _ = router.topk_route_differentiable(leaf, K, score_func=score_func, expert_bias=bias,
                                                           route_norm=route_norm, route_scale=scale)
        else:
            top, ids = _torch_route(leaf, K, score_func, bias, route_norm, scale)
        (top * G.gather(1, ids)).sum().backward()
        grads.append(leaf.grad)
    assert grads[0].dtype == dtype and grads[0].shape == (T, E)
    if tiny:
        assert grads[0].abs().max() < 1e-6 and grads[1].abs().max() < 1e-6
    else:
        assert grads[0].abs().max() > 0
        assert rel_err(grads[0].float(), grads[1].float()) <= bound, "d logits"

    # d gate weight and d x through MegaMoERouter, switch on vs off
    mr = MegaMoERouter(dim=D, num_experts=E, num_expert_groups=None, num_limited_groups=None, top_k=K,
                       score_func=score_func, route_norm=route_norm, route_scale=scale, gate_bias=False)
    with torch.no_grad():
        mr.gate.weight.copy_(torch.randn(E, D, generator=gen) / D**0.5)
    mr = mr.to(DEV, dtype)
    # bf16 gate outputs tie often: tokens whose boundary ties are drawn again
    x = _untied_rows(lambda n: torch.randn(T if n is None else n, D, generator=gen).to(DEV, dtype), mr.gate, K,
                     score_func, bias)
    out = []
    for flag in ("1", "0"):
        monkeypatch.setenv(FLAG, flag)
        mr.zero_grad(set_to_none=True)
        xl = x.clone().requires_grad_()
        top, ids, _ = mr(xl, bias)
        (top * G.gather(1, ids)).sum().backward()
        out.append((ids, xl.grad, mr.gate.weight.grad))
    (ids1, dx1, dw1), (ids0, dx0, dw0) = out
    assert torch.equal(ids1.sort(1).values, ids0.sort(1).values), "selection differs (ties in the gate output?)"
    for name, a, b in (("dx", dx1, dx0), ("d gate weight", dw1, dw0)):
        if tiny:
            assert a.abs().max() < 1e-5 and b.abs().max() < 1e-5, name
        else:
            assert rel_err(a.float(), b.float()) <= bound, name


def test_ties_pick_lowest_index():
    E = 12  # not a power of two: padded columns must never win a tie
    rows = torch.tensor([
        [0.5] * E,  # all equal: experts 0..K-1
        [1.0, 3.0, 3.0, 0.0, 3.0, 2.0, 3.0, -1.0, 0.0, 0.0, 0.0, 0.0],
        [-2.0] * (E - 3) + [4.0, 4.0, 4.0],  # ties at the top, at the end of the row
    ], device=DEV)
    for score_func in ("softmax", "sigmoid"):
        top, ids, counts = router.topk_route(rows, 3, score_func=score_func, route_norm=False, route_scale=1.0)
        assert ids.tolist() == [[0, 1, 2], [1, 2, 4], [9, 10, 11]], score_func
        s = _choice(rows, score_func, None)
        torch.testing.assert_close(top, s.gather(1, ids), rtol=SCORE_RTOL, atol=0)
        assert counts.tolist() == [1, 2, 2, 0, 1, 0, 0, 0, 0, 1, 1, 1]
    # a tie made by the bias: scores differ, choice values equal -> lowest index, scores unbiased
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]], device=DEV)
    s = torch.sigmoid(logits)
    bias = (s.max() - s[0]).contiguous()  # choice = s + bias: all equal to max(s)
    top, ids, _ = router.topk_route(logits, 2, score_func="sigmoid", expert_bias=bias, route_norm=False,
                                    route_scale=1.0)
    c = s + bias
    assert (c == c[0, 0]).all(), "test setup: the bias must make every choice equal"
    assert ids.tolist() == [[0, 1]]
    torch.testing.assert_close(top, s[:, :2], rtol=SCORE_RTOL, atol=0)
    # K = E: every expert, descending choice (ties by index)
    _, ids, counts = router.topk_route(rows[1:2], E, score_func="softmax", route_norm=True, route_scale=1.0)
    assert ids.tolist() == [[1, 2, 4, 6, 5, 0, 3, 8, 9, 10, 11, 7]] and counts.tolist() == [1.0] * E


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy, in the interpreter
def test_nan_logits_give_valid_distinct_ids():
    x = torch.randn(5, 10, generator=torch.Generator().manual_seed(1)).to(DEV)
    x[0, 3] = float("nan")
    x[1] = float("nan")
    top, ids, counts = router.topk_route(x, 4, score_func="softmax", route_norm=True, route_scale=1.0)
    assert ((ids >= 0) & (ids < 10)).all()
    assert all(len(set(r)) == 4 for r in ids.tolist())
    assert ids[1].tolist() == [0, 1, 2, 3]  # all NaN: a tie, lowest ids
    assert counts.sum().item() == 20


@pytest.mark.parametrize("poison", [float("nan"), 7.0])
def test_every_output_written_and_deterministic(monkeypatch, poison):
    """Outputs start as ``poison`` (an unwritten element shows); two calls agree bitwise, and the
    counts (summed by atomics over 10 programs) equal a bincount."""
    def poisoned(shape, dtype, device):
        return torch.full(shape, poison if dtype.is_floating_point else -7, dtype=dtype, device=device)

    monkeypatch.setattr(router, "_empty", poisoned)
    E, K = 60, 8
    T = 10 * router.block_t_for(E) - 3
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(T, E, generator=gen).bfloat16().to(DEV)
    bias = (torch.randn(E, generator=gen) * 0.05).to(DEV)
    kw = dict(score_func="sigmoid", expert_bias=bias, route_norm=True, route_scale=2.5)
    a = router.topk_route(x, K, **kw)
    b = router.topk_route(x, K, **kw)
    assert torch.isfinite(a[0]).all() and (a[1] >= 0).all()
    for u, v in zip(a, b):
        assert torch.equal(u, v)
    assert torch.equal(a[2], torch.bincount(a[1].reshape(-1), minlength=E).float())


BWD_CASES = [  # (T, E, K, score_func, route_norm, logits dtype)
    (37, 60, 8, "softmax", True, torch.float32),  # E not a power of two, T not a multiple of BLOCK_T
    (37, 60, 8, "sigmoid", False, torch.bfloat16),
    (70, 128, 8, "softmax", True, torch.bfloat16),  # Qwen3's E and K
    (5, 8, 1, "softmax", False, torch.float32),  # top_k = 1
    (5, 8, 1, "sigmoid", True, torch.bfloat16),  # route_norm with K=1
    (33, 61, 20, "sigmoid", True, torch.float32),  # odd E, K > 16
    (1, 3, 3, "softmax", True, torch.float16),  # K = E, one token
]


@pytest.mark.parametrize("case", BWD_CASES, ids=[f"T{c[0]}-E{c[1]}-K{c[2]}-{c[3]}-norm{int(c[4])}-{str(c[5])[6:]}"
                                                 for c in BWD_CASES])
def test_route_backward_kernel_matches_torch_form(monkeypatch, case):
    """``topk_route_backward`` (the Triton kernel) against ``topk_route_backward_torch`` on random logits, ids
    and top-score gradients: poisoned output, every element written, bitwise the same on a second call."""
    from titan_megamoe.testing import rel_err

    T, E, K, score_func, norm, dtype = case
    monkeypatch.setattr(router, "_empty", lambda shape, dt, device: torch.full(shape, float("nan"), dtype=dt,
                                                                               device=device))
    gen = torch.Generator().manual_seed(T * E + K)
    logits = (torch.randn(T, E, generator=gen) * 2).to(dtype).to(DEV)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]).to(DEV)
    g = torch.randn(T, K, generator=gen).to(DEV)
    got = router.topk_route_backward(logits, ids, g, score_func, norm, 2.5)
    ref = router.topk_route_backward_torch(logits, ids, g, score_func, norm, 2.5)
    assert got.dtype == dtype and got.shape == (T, E) and torch.isfinite(got).all()
    assert torch.equal(got, router.topk_route_backward(logits, ids, g, score_func, norm, 2.5))
    if norm and K == 1:  # d logits is rounding noise only (y = v / v)
        assert got.float().abs().max() < 1e-6 and ref.float().abs().max() < 1e-6
        return
    # one bf16 / fp16 rounding of values whose fp32 sums were taken in another order
    bound = 1e-5 if dtype == torch.float32 else 1e-2
    assert ref.float().abs().max() > 0
    assert rel_err(got.float(), ref.float()) <= bound
    # the columns no slot selected carry only the softmax coupling term (sigmoid: exactly zero)
    unselected = torch.ones(T, E, dtype=torch.bool, device=DEV).scatter_(1, ids, False)
    if score_func == "sigmoid":
        assert (got[unselected] == 0).all()


def test_route_backward_no_tokens():
    out = router.topk_route_backward(torch.randn(0, 16).to(DEV), torch.zeros(0, 4, dtype=torch.int64, device=DEV),
                                     torch.randn(0, 4).to(DEV), "softmax", True, 1.0)
    assert out.shape == (0, 16)


def test_counts_added_into_a_given_buffer():
    """counts_into (the layer's tokens_per_expert): the kernel adds the exact counts into the buffer's
    earlier values and returns None for them; the scores and ids are those of the plain call; a buffer
    of the wrong dtype / shape is refused."""
    E, K, T = 24, 3, 45
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(T, E, generator=gen).to(DEV)
    kw = dict(score_func="softmax", route_norm=False, route_scale=1.0)
    top, ids, counts = router.topk_route(x, K, **kw)
    base = torch.rand(E, generator=gen).to(DEV) * 100 + 1
    buf = base.clone()
    top2, ids2, none = router.topk_route(x, K, counts_into=buf, **kw)
    assert none is None and torch.equal(top2, top) and torch.equal(ids2, ids)
    assert torch.equal(buf, base + counts) and counts.sum().item() == T * K
    xl = x.clone().requires_grad_()
    top3, _, none = router.topk_route_differentiable(xl, K, counts_into=buf, **kw)
    top3.sum().backward()
    assert none is None and torch.equal(buf, base + 2 * counts) and torch.isfinite(xl.grad).all()
    for bad in (torch.zeros(E, dtype=torch.float64, device=DEV), torch.zeros(E + 1, device=DEV)):
        with pytest.raises(ValueError, match="counts_into"):
            router.topk_route(x, K, counts_into=bad, **kw)


def test_block_t_choice():
    assert [router.block_t_for(e) for e in (2, 8, 60, 64, 128, 256, 1024)] == [64, 64, 64, 64, 32, 16, 4]
    assert [router.block_t_for(e) for e in (1, 61, 127, 255, 1023)] == [64, 32, 16, 8, 2]  # odd E: half
    assert router.UNROLL_K < 20  # FWD_EK's K=20 case runs the rounds as a loop


def test_errors():
    x = torch.randn(4, 8, device=DEV)
    kw = dict(score_func="softmax", route_norm=False, route_scale=1.0)
    with pytest.raises(ValueError, match="top_k"):
        router.topk_route(x, 9, **kw)
    with pytest.raises(ValueError, match="top_k"):
        router.topk_route(x, 0, **kw)
    with pytest.raises(ValueError, match="2-D"):
        router.topk_route(x.reshape(2, 2, 8), 2, **kw)
    with pytest.raises(ValueError, match="expert_bias shape"):
        router.topk_route(x, 2, expert_bias=torch.randn(7, device=DEV), **kw)
    with pytest.raises(ValueError, match="expert_bias shape"):
        router.topk_route(x, 2, expert_bias=torch.randn(1, 8, device=DEV), **kw)
    with pytest.raises(ValueError, match="score_func"):
        router.topk_route(x, 2, score_func="relu", route_norm=False, route_scale=1.0)
    with pytest.raises(ValueError, match="dtype"):
        router.topk_route(x.to(torch.int32), 2, **kw)
    with pytest.raises(ValueError, match="experts"):
        router.topk_route(torch.randn(2, router.MAX_EXPERTS + 1, device=DEV), 2, **kw)


GATE_CASES = [  # (T, D, E, K, score_func, bias, route_norm): the edge each row covers
    (37, 48, 8, 2, "softmax", False, True),  # E < 16 (tile padded to 16 columns), T not a multiple of BLOCK_T
    (70, 200, 128, 8, "softmax", False, True),  # the Qwen3 router width, D not a multiple of the 64-wide step
    (33, 65, 127, 8, "sigmoid", True, True),  # odd E (half BLOCK_T), odd D, expert bias
    (20, 64, 16, 1, "sigmoid", False, False),  # top_k = 1
    (9, 32, 6, 6, "softmax", True, False),  # top_k = E
    (0, 32, 8, 2, "softmax", False, True),  # no tokens
]


@pytest.mark.parametrize("case", GATE_CASES, ids=[f"T{c[0]}-D{c[1]}-E{c[2]}-K{c[3]}-{c[4]}" for c in GATE_CASES])
def test_gate_topk_route_is_topk_route_of_its_logits(monkeypatch, case):
    """router.gate_topk_route: logits = x @ w.T rounded once to bf16 (the round-to-nearest-even of the fp32
    product, up to the summation order: within one bf16 ulp everywhere, equal almost everywhere), then
    exactly topk_route's routing of those logits: ids and counts equal, scores equal up to the order of
    the row reductions. Every output is written (poisoned first)."""
    T, D, E, K, score_func, with_bias, route_norm = case

    def poisoned(shape, dtype, device):
        return torch.full(shape, float("nan") if dtype.is_floating_point else -7, dtype=dtype, device=device)

    monkeypatch.setattr(router, "_empty", poisoned)
    gen = torch.Generator().manual_seed(T + D + E)
    x = torch.randn(T, D, generator=gen).bfloat16().to(DEV)
    w = (torch.randn(E, D, generator=gen) / D**0.5).bfloat16().to(DEV)
    bias = (torch.randn(E, generator=gen) * 0.05).to(DEV) if with_bias else None
    kw = dict(score_func=score_func, expert_bias=bias, route_norm=route_norm, route_scale=1.5)
    counts_into = torch.full((E,), 3.0, device=DEV)
    logits, top, ids, none = router.gate_topk_route(x, w, K, counts_into=counts_into, **kw)
    assert none is None and logits.dtype == torch.bfloat16 and logits.shape == (T, E)
    exact = x.float() @ w.float().t()
    assert ((logits.float() - exact).abs() <= exact.abs() * 2.0**-8).all(), "logits beyond one bf16 ulp"
    if T:
        assert (logits == exact.bfloat16()).float().mean() > 0.99, "logits not rounded to nearest"
    top2, ids2, counts2 = router.topk_route(logits, K, **kw)
    assert torch.equal(ids, ids2) and torch.equal(counts_into, counts2 + 3.0)
    # scores: the same formulas over another reduction tree (the tile has >= 16 columns; compiled, the
    # dot's output layout is not the load's), so equal up to a few ulps (bitwise in the interpreter for E >= 16)
    torch.testing.assert_close(top, top2, rtol=SCORE_RTOL * 4, atol=0)
    if E >= 16 and DEV == "cpu":
        assert torch.equal(top, top2)
    again = router.gate_topk_route(x, w, K, **kw)
    assert torch.equal(again[0], logits) and torch.equal(again[1], top) and torch.equal(again[2], ids)


def test_gate_topk_route_errors():
    x = torch.randn(4, 32, device=DEV).bfloat16()
    kw = dict(score_func="softmax", route_norm=False, route_scale=1.0)
    with pytest.raises(ValueError, match="gate_w"):
        router.gate_topk_route(x, torch.randn(8, 31, device=DEV).bfloat16(), 2, **kw)
    with pytest.raises(ValueError, match="share dtype"):
        router.gate_topk_route(x, torch.randn(8, 32, device=DEV), 2, **kw)
    with pytest.raises(ValueError, match="contiguous"):
        router.gate_topk_route(torch.randn(32, 4, device=DEV).bfloat16().t(), torch.randn(8, 32, device=DEV).bfloat16(),
                               2, **kw)
    with pytest.raises(ValueError, match="fewer than 16 tokens"):
        router.gate_topk_route(x, torch.randn(512, 32, device=DEV).bfloat16(), 2, **kw)
    with pytest.raises(ValueError, match="top_k"):
        router.gate_topk_route(x, torch.randn(8, 32, device=DEV).bfloat16(), 9, **kw)
    assert [router.gate_block_t(e) for e in (2, 16, 64, 128, 256, 512)] == [64, 64, 64, 32, 16, None]
    assert [router.gate_block_t(e) for e in (127, 129)] == [16, None]  # odd E: half the tile


def test_switch_value_is_checked(monkeypatch):
    from titan_megamoe.layer import MegaMoERouter

    mr = MegaMoERouter(dim=8, num_experts=8, num_expert_groups=None, num_limited_groups=None, top_k=2,
                       score_func="softmax", route_norm=False, route_scale=1.0, gate_bias=False).to(DEV)
    monkeypatch.setenv(FLAG, "true")
    with pytest.raises(ValueError, match=FLAG):
        mr(torch.randn(3, 8, device=DEV))


LAYER_STYLES = {
    "qwen3": dict(score_func="softmax", route_norm=True, score_before_experts=False, num_shared_experts=0),
    "sigmoid+bias": dict(score_func="sigmoid", route_norm=True, route_scale=2.5, score_before_experts=True,
                         num_shared_experts=1, load_balance_coeff=1e-3),
}


@pytest.mark.parametrize("style", list(LAYER_STYLES))
def test_layer_same_with_switch_on_and_off(monkeypatch, kernel_calls, style):
    from torchtitan.models.moe.moe import MoEArgs

    from titan_megamoe.testing import assert_close_rel, build_moe_pair

    E, K, D, F, T = 16, 4, 32, 24, 19
    args = MoEArgs(num_experts=E, top_k=K, use_grouped_mm=False, **LAYER_STYLES[style])
    mega = build_moe_pair(args, D, F, dtype=torch.float32, seed=E).mega.to(DEV)
    if mega.expert_bias is not None:
        assert mega.expert_bias.abs().max() > 0  # build_moe_pair draws a nonzero bias
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(2, T, D, generator=gen).to(DEV)
    g = torch.randn(2, T, D, generator=gen).to(DEV)
    results = []
    base = torch.arange(E, dtype=torch.float32, device=DEV) * 3 + 0.5
    for flag in ("1", "0"):
        monkeypatch.setenv(FLAG, flag)
        n = len(kernel_calls)
        mega.zero_grad(set_to_none=True)
        mega.tokens_per_expert.copy_(base)  # not zeros: the fused path adds into the buffer
        xl = x.clone().requires_grad_()
        out = mega(xl)
        out.backward(g)
        assert len(kernel_calls) == n + (flag == "1"), f"switch {flag}: wrong router path"
        grads = {n: p.grad.clone() for n, p in mega.named_parameters() if p.grad is not None}
        results.append((out.detach(), xl.grad, grads, mega.tokens_per_expert.clone()))
    (o1, dx1, g1, c1), (o0, dx0, g0, c0) = results
    assert torch.equal(c1, c0) and (c1 - base).sum().item() == 2 * T * K
    assert_close_rel(o1, o0, torch.float32, "out")
    assert_close_rel(dx1, dx0, torch.float32, "dx")
    assert set(g1) == set(g0) and "router.gate.weight" in g1
    for n in g0:
        assert_close_rel(g1[n], g0[n], torch.float32, f"d{n}")


# --------------------------------------------------------------------------------------------------
# sm_90a compile check (subprocess, TRITON_INTERPRET=0)
# --------------------------------------------------------------------------------------------------

COMPILE_CASES = [
    # (label, logits type, E, K, softmax, bias, route_norm)
    ("bf16_e128_k8_softmax_norm", "*bf16", 128, 8, True, False, True),  # Qwen3-30B/235B
    ("bf16_e128_k8_sigmoid_bias", "*bf16", 128, 8, False, True, True),
    ("bf16_e256_k8_sigmoid_bias", "*bf16", 256, 8, False, True, True),  # DeepSeek-V3 sized
    ("fp32_e256_k8_softmax_bias", "*fp32", 256, 8, True, True, False),
    ("bf16_e127_k8_softmax", "*bf16", 127, 8, True, False, True),  # odd E: scalar loads, half BLOCK_T
    ("bf16_e64_k32_softmax", "*bf16", 64, 32, True, True, True),  # K > UNROLL_K: the rounds as a loop
    ("bf16_e1024_k8_softmax_bias", "*bf16", 1024, 8, True, True, True),  # MAX_EXPERTS
]
GATE_COMPILE_CASES = [
    # (label, E, D, K, softmax, bias, route_norm): gate_topk_route's kernel
    ("gate_e128_d2048_k8_softmax_norm", 128, 2048, 8, True, False, True),  # Qwen3-30B-A3B
    ("gate_e128_d4096_k8_softmax_norm", 128, 4096, 8, True, False, True),  # Qwen3-235B-A22B
    ("gate_e256_d7168_k8_sigmoid_bias", 256, 7168, 8, False, True, True),  # DeepSeek-V3 sized
    ("gate_e127_d2048_k8_softmax", 127, 2048, 8, True, False, True),  # odd E
    ("gate_e8_d1000_k2_softmax", 8, 1000, 2, True, False, True),  # E < 16, D not a multiple of 64
]


BWD_COMPILE_CASES = [
    # (label, logits type, E, K, softmax, route_norm): topk_route_backward's kernel
    ("bwd_bf16_e128_k8_softmax_norm", "*bf16", 128, 8, True, True),  # Qwen3-30B/235B
    ("bwd_bf16_e256_k8_sigmoid_norm", "*bf16", 256, 8, False, True),  # DeepSeek-V3 sized
    ("bwd_fp32_e127_k8_softmax", "*fp32", 127, 8, True, False),  # odd E
]


def _compile_sm90_all() -> list[dict]:
    results = []
    for label, logits_ty, E, K, softmax, norm in BWD_COMPILE_CASES:
        sig = {"logits_ptr": logits_ty, "ids_ptr": "*i64", "g_ptr": "*fp32", "dlogits_ptr": logits_ty, "T": "i32",
               "route_scale": "fp32"}
        cx = dict(E=E, K=K, E_PAD=next_pow2(E), BLOCK_T=router.block_t_for(E), SOFTMAX=softmax, ROUTE_NORM=norm)
        r = compile_sm90(flavor(router._topk_route_bwd_kernel, False), sig, cx, num_warps=router._NUM_WARPS,
                         num_stages=1)
        results.append(dict(label=label, **r))
    for label, logits_ty, E, K, softmax, bias, norm in COMPILE_CASES:
        sig = {"logits_ptr": logits_ty, "bias_ptr": "*fp32", "scores_ptr": "*fp32", "ids_ptr": "*i64",
               "counts_ptr": "*fp32", "T": "i32", "route_scale": "fp32"}
        # every constexpr: triton.compile(ASTSource) does not apply the kernel's defaults
        cx = dict(E=E, K=K, K_PAD=next_pow2(K), E_PAD=next_pow2(E), BLOCK_T=router.block_t_for(E), SOFTMAX=softmax,
                  HAS_BIAS=bias, ROUTE_NORM=norm, UNROLL_K=router.UNROLL_K)
        r = compile_sm90(flavor(router._topk_route_kernel, False), sig, cx, num_warps=router._NUM_WARPS,
                         num_stages=1)
        results.append(dict(label=label, **r))
    for label, E, D, K, softmax, bias, norm in GATE_COMPILE_CASES:
        sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "logits_ptr": "*bf16", "bias_ptr": "*fp32", "scores_ptr": "*fp32",
               "ids_ptr": "*i64", "counts_ptr": "*fp32", "T": "i32", "route_scale": "fp32"}
        cx = dict(D=D, E=E, K=K, K_PAD=next_pow2(K), E_PAD=max(16, next_pow2(E)), BLOCK_T=router.gate_block_t(E),
                  BLOCK_D=router._GATE_BLOCK_D, SOFTMAX=softmax, HAS_BIAS=bias, ROUTE_NORM=norm,
                  UNROLL_K=router.UNROLL_K, UPCAST_FP32=False)
        r = compile_sm90(flavor(router._gate_topk_route_kernel, False), sig, cx, num_warps=router._NUM_WARPS,
                         num_stages=3)
        results.append(dict(label=label, **r))
    return results


@pytest.mark.parametrize("label", [c[0] for c in COMPILE_CASES + GATE_COMPILE_CASES + BWD_COMPILE_CASES])
def test_compiles_for_sm90a(label):
    r = sm90_result(__file__, label)
    assert r["target"], "PTX not built for sm_90a"
    assert r["usage"], "no cuobjdump resource line: spills cannot be checked"
    assert "STACK:0" in r["usage"], f"{label}: register spills ({r['usage']})"


if __name__ == "__main__":
    if sys.argv[1:2] == ["compile-sm90"]:
        print(json.dumps(_compile_sm90_all()))
    else:
        raise SystemExit("usage: python tests/test_router_kernel.py compile-sm90")
