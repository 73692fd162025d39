"""ops/eager_layer.py: MegaMoE's eager forward as one autograd node (gate linear, fused router, fused experts)
gives the modular path's output, expert-weight gradients and per-expert counts bitwise (router module + experts
module), dx and the gate's gradient within bf16 error (dx: the router's part added in fp32 inside scatter_dx or
one GEMM, rounded once);
and every case it does not cover falls back to the modular path."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from torchtitan.models.moe.moe import MoEArgs  # noqa: E402

from titan_megamoe.config import MegaMoEConfig  # noqa: E402
from titan_megamoe.layer import MegaMoE  # noqa: E402
from titan_megamoe.ops import eager_layer  # noqa: E402
from titan_megamoe.testing import assert_close_rel  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _layer(D, F, E, K, *, score_func="softmax", route_norm=True, shared=0, seed=0, precision="bf16"):
    args = MoEArgs(num_experts=E, top_k=K, score_func=score_func, route_norm=route_norm, num_shared_experts=shared,
                   score_before_experts=False, load_balance_coeff=1e-3)
    layer = MegaMoE(args, D, F, config=MegaMoEConfig(backend="triton", precision=precision))
    torch.manual_seed(seed)
    with torch.no_grad():
        layer.init_weights(0.5, torch.device(DEV))
    layer = layer.to(DEV).to(torch.bfloat16)
    layer.tokens_per_expert = layer.tokens_per_expert.float()
    with torch.no_grad():
        layer.expert_bias.copy_(torch.randn(E) * 0.01)  # selection-only bias: exercised, no gradient
    return layer


def _step(layer, x, dy):
    layer.zero_grad(set_to_none=True)
    layer.tokens_per_expert.zero_()
    xx = x.clone().requires_grad_()
    out = layer(xx)
    out.backward(dy)
    grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
    return out.detach(), xx.grad, grads, layer.tokens_per_expert.clone()


CASES = [  # (T, D, F, E, K, score_func, route_norm, shared): the edge each row covers
    (37, 32, 48, 4, 2, "softmax", True, 0),  # T not a multiple of the block, F != D
    (20, 32, 32, 8, 1, "sigmoid", False, 0),  # top_k = 1, sigmoid, some experts without tokens
    (24, 48, 32, 4, 4, "softmax", True, 1),  # top_k = E, a shared expert (added outside the node)
]


@pytest.mark.parametrize("dx_in_scatter", [True, False], ids=["router-dx-in-scatter", "router-dx-addmm"])
@pytest.mark.parametrize("case", CASES, ids=[f"T{c[0]}-K{c[4]}-{c[5]}-shared{c[7]}" for c in CASES])
def test_fused_layer_matches_the_modular_path(case, dx_in_scatter, monkeypatch):
    T, D, F, E, K, score_func, route_norm, shared = case
    monkeypatch.setattr(eager_layer, "ROUTER_DX_IN_SCATTER", dx_in_scatter)
    layer = _layer(D, F, E, K, score_func=score_func, route_norm=route_norm, shared=shared)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, T, D, generator=g).bfloat16().to(DEV)
    dy = torch.randn(2, T, D, generator=g).bfloat16().to(DEV)
    calls = []
    real = eager_layer.FusedLayerFunction.apply
    monkeypatch.setattr(eager_layer.FusedLayerFunction, "apply", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(eager_layer, "FUSED_GATE", False)  # torch.mm: the modular path's own gate GEMM
    monkeypatch.setattr(eager_layer, "ENABLED", False)
    ref = _step(layer, x, dy)
    assert not calls
    monkeypatch.setattr(eager_layer, "ENABLED", True)
    from titan_megamoe.kernels import grouped_gemm_bwd

    scatters = []
    real_scatter = grouped_gemm_bwd.scatter_dx
    monkeypatch.setattr(grouped_gemm_bwd, "scatter_dx", lambda *a, **k: scatters.append("router_dlogits" in k)
                        or real_scatter(*a, **k))
    got = _step(layer, x, dy)
    assert calls, "the fused layer path did not run"
    assert scatters == [dx_in_scatter], "router dx path"
    assert torch.equal(got[0], ref[0]), "forward output"
    assert torch.equal(got[3], ref[3]), "tokens_per_expert"
    assert got[2].keys() == ref[2].keys() and "router.gate.weight" in got[2]
    for name in got[2]:
        if name == "router.gate.weight":  # the same GEMM, but cuBLAS may pick another algorithm than autograd's
            assert_close_rel(got[2][name].float(), ref[2][name].float(), torch.bfloat16, name)
        else:
            assert torch.equal(got[2][name], ref[2][name]), name
    assert_close_rel(got[1].float(), ref[1].float(), torch.bfloat16, "dx")  # router's part rounded once
    again = _step(layer, x, dy)
    assert torch.equal(again[1], got[1]) and all(torch.equal(again[2][n], got[2][n]) for n in got[2])


FP8_CASES = [  # (precision, T, E, K, score_func, shared): the edge each row covers (D = F = 128: one scale group)
    ("fp8", 37, 4, 2, "softmax", 0),  # FP8 forward and backward; T not a multiple of the block
    ("fp8_bwd", 20, 8, 1, "sigmoid", 1),  # bf16 forward, FP8 backward; top_k = 1, empty experts, a shared expert
]


def _fused_fp8_against_modular(case, monkeypatch):
    """(modular path's step, fused node's step) of an FP8_CASES row, the node's call checked to have run."""
    precision, T, E, K, score_func, shared = case
    layer = _layer(128, 128, E, K, score_func=score_func, route_norm=score_func == "softmax", shared=shared,
                   precision=precision)
    return _modular_and_fused_steps(layer, T, 5, monkeypatch)


def _modular_and_fused_steps(layer, T, seed, monkeypatch):
    """(modular path's step, fused FP8 node's step) of ``layer`` on T random tokens, the node checked to have run."""
    from titan_megamoe.ops import eager_layer_fp8

    D = layer.experts.w1.shape[2]
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, T, D, generator=g).bfloat16().to(DEV)
    dy = torch.randn(1, T, D, generator=g).bfloat16().to(DEV)
    calls = []
    real = eager_layer_fp8.FusedFp8LayerFunction.apply
    monkeypatch.setattr(eager_layer_fp8.FusedFp8LayerFunction, "apply", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(eager_layer, "FUSED_GATE", False)
    monkeypatch.setattr(eager_layer, "ENABLED", False)
    ref = _step(layer, x, dy)
    assert not calls
    monkeypatch.setattr(eager_layer, "ENABLED", True)
    got = _step(layer, x, dy)
    assert calls, "the fused FP8 layer path did not run"
    return ref, got


def _assert_fused_fp8_matches(ref, got):
    assert torch.equal(got[0], ref[0]), "forward output"
    assert torch.equal(got[3], ref[3]), "tokens_per_expert"
    assert got[2].keys() == ref[2].keys() and "experts.w1" in got[2] and "router.gate.weight" in got[2]
    for name in got[2]:
        if name == "router.gate.weight":
            assert_close_rel(got[2][name].float(), ref[2][name].float(), torch.bfloat16, name)
        else:
            assert torch.equal(got[2][name], ref[2][name]), name
    assert_close_rel(got[1].float(), ref[1].float(), torch.bfloat16, "dx")


@pytest.mark.parametrize("case", FP8_CASES, ids=[f"{c[0]}-T{c[1]}-K{c[3]}" for c in FP8_CASES])
def test_fused_fp8_layer_matches_the_modular_path(case, monkeypatch):
    """ops/eager_layer_fp8.py: precision fp8 / fp8_bwd through one autograd node gives the modular FP8 path's
    output, counts and expert-weight gradients bitwise, dx and the gate gradient within bf16 error."""
    _assert_fused_fp8_matches(*_fused_fp8_against_modular(case, monkeypatch))


@pytest.mark.cuda
@pytest.mark.parametrize("precision", ["fp8", "fp8_bwd"])
def test_fused_fp8_layer_matches_the_modular_path_on_gpu(precision, monkeypatch):
    """The fused FP8 node (what training runs) against the modular op on the GPU, at the 30B layer's D and F (the
    Gluon kernels, wide tiles, h quantized in GEMM1) with 16 experts, top-4, 1000 tokens: the output, counts and
    expert-weight gradients bitwise, dx and the gate gradient within bf16 error. On the CPU machine only D = F = 128
    runs (above); fp8_bwd's training runs had grad-norm spikes the op-level GPU tests would not see (session 39)."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs compute capability >= 8.9")
    ref, got = _modular_and_fused_steps(_layer(2048, 768, 16, 4, precision=precision), 1000, 11, monkeypatch)
    for name, t in got[2].items():
        assert torch.isfinite(t).all() and t.abs().sum() > 0, name
    _assert_fused_fp8_matches(ref, got)


def test_fused_fp8_bwd_layer_runs_the_bf16_forward_launches_then_takes_its_weights(monkeypatch):
    """Where the bf16 layout's block is the FP8 one (128: off the interpreter, emulated here with 128-row
    interpreter blocks), "fp8_bwd"'s node runs the bf16 node's unchecked forward launches and takes its FP8
    weights from the cache after them (only the backward reads them): the modular path's results, as above."""
    from titan_megamoe.kernels import grouped_gemm as gg
    from titan_megamoe.ops import fp8_backend as fb
    from titan_megamoe.ops import triton_backend as tb

    order = []
    real_fwd, real_prep = tb.triton_fwd_unchecked, fb.prepare_weights_eager
    monkeypatch.setattr(tb, "triton_fwd_unchecked", lambda *a: order.append("forward") or real_fwd(*a))
    monkeypatch.setattr(fb, "prepare_weights_eager", lambda *a, **k: order.append("weights") or real_prep(*a, **k))
    monkeypatch.setattr(tb, "_block_m", lambda: fb.FP8_BLOCK_M)
    real_cfg = gg.config_for  # the modular path's fp8_bwd forward passes 128-wide interpreter blocks: the same here
    monkeypatch.setattr(gg, "config_for", lambda kind, D, F, interp: dataclasses.replace(
        real_cfg(kind, D, F, interp), block_m=128, block_n=128, block_k=128))
    ref, got = _fused_fp8_against_modular(FP8_CASES[1], monkeypatch)
    assert order == ["forward", "weights"], order
    _assert_fused_fp8_matches(ref, got)


def test_fused_fp8_layer_leaves_dims_it_cannot_take_to_the_modular_path():
    """D not a multiple of 128: no fused node; the modular path raises the FP8 configuration error."""
    from titan_megamoe.errors import MegaMoEConfigError

    layer = _layer(64, 128, 4, 2, precision="fp8")
    x = torch.randn(1, 8, 64).bfloat16().to(DEV)
    assert layer._fused_layer_operands(x.view(-1, 64)) is None
    with pytest.raises(MegaMoEConfigError, match="multiples of 128"):
        layer(x)


class _GateGivenLogits(torch.autograd.Function):
    """The gate linear's autograd with given forward values (the fused kernel's logits)."""

    @staticmethod
    def forward(ctx, x, w, logits):
        ctx.save_for_backward(x, w)
        return logits.clone()

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g @ w, g.t() @ x, None


@pytest.mark.parametrize("case", CASES, ids=[f"T{c[0]}-K{c[4]}-{c[5]}-shared{c[7]}" for c in CASES])
def test_fused_gate_matches_the_modular_path_on_its_logits(case, monkeypatch):
    """FUSED_GATE: the gate linear inside the router's kernel. Its logits are x @ w.T rounded once to bf16
    (within one bf16 ulp of the fp32 product), and the layer equals the modular path whose gate returns those
    logits: output, counts and expert-weight gradients bitwise, dx and the gate gradient within bf16 error."""
    from titan_megamoe.kernels import router

    T, D, F, E, K, score_func, route_norm, shared = case
    layer = _layer(D, F, E, K, score_func=score_func, route_norm=route_norm, shared=shared, seed=3)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, T, D, generator=g).bfloat16().to(DEV)
    dy = torch.randn(2, T, D, generator=g).bfloat16().to(DEV)
    calls = []
    real = router.gate_topk_route
    launch = router.launch_gate_topk_route  # the layer's call (its operands checked once, by the layer)
    monkeypatch.setattr(router, "launch_gate_topk_route", lambda *a, **k: calls.append(1) or launch(*a, **k))
    monkeypatch.setattr(eager_layer, "FUSED_GATE", True)
    got = _step(layer, x, dy)
    assert calls, "the fused gate did not run"
    w = layer.router.gate.weight
    logits = real(x.view(-1, D), w.detach(), K, score_func=score_func, route_norm=route_norm, route_scale=1.0)[0]
    exact = x.view(-1, D).float() @ w.detach().float().t()
    assert ((logits.float() - exact).abs() <= exact.abs() * 2.0**-8 + 1e-30).all(), "logits beyond one bf16 ulp"
    monkeypatch.setattr(eager_layer, "ENABLED", False)
    monkeypatch.setattr(layer.router.gate, "forward", lambda xx: _GateGivenLogits.apply(xx, w, logits))
    ref = _step(layer, x, dy)
    assert torch.equal(got[0], ref[0]), "forward output"
    assert torch.equal(got[3], ref[3]), "tokens_per_expert"
    assert got[2].keys() == ref[2].keys()
    for name in got[2]:
        if name == "router.gate.weight":
            assert_close_rel(got[2][name].float(), ref[2][name].float(), torch.bfloat16, name)
        else:
            assert torch.equal(got[2][name], ref[2][name]), name
    assert_close_rel(got[1].float(), ref[1].float(), torch.bfloat16, "dx")


def test_fused_layer_falls_back_where_it_does_not_apply(monkeypatch):
    """Hooks on the experts (FSDP's all-gather would run there), a gate bias and the switch off all take the modular
    path, whose results stay right (fp8 has its own node now: ops/eager_layer_fp8.py)."""
    calls = []
    real = eager_layer.FusedLayerFunction.apply
    monkeypatch.setattr(eager_layer.FusedLayerFunction, "apply", lambda *a: calls.append(1) or real(*a))
    x = torch.randn(1, 16, 32).bfloat16().to(DEV)
    layer = _layer(32, 32, 4, 2)
    assert layer._fused_layer_ok(x.view(-1, 32))
    h = layer.experts.register_forward_pre_hook(lambda m, a: None)
    assert not layer._fused_layer_ok(x.view(-1, 32))
    layer(x)
    h.remove()
    assert not calls
    h = torch.nn.modules.module.register_module_forward_hook(lambda m, a, o: None)
    try:
        assert not layer._fused_layer_ok(x.view(-1, 32))
    finally:
        h.remove()
    layer.router.gate.bias = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16, device=DEV))
    assert not layer._fused_layer_ok(x.view(-1, 32))
    layer.router.gate.bias = None
    layer.experts.max_tokens_per_rank = 8  # fewer than the 16 tokens: the modular path raises CapacityError
    assert not layer._fused_layer_ok(x.view(-1, 32))
    layer.experts.max_tokens_per_rank = 0
    monkeypatch.setattr(eager_layer, "ENABLED", False)
    assert not layer._fused_layer_ok(x.view(-1, 32))
    monkeypatch.setattr(eager_layer, "ENABLED", True)
    fp8 = _layer(128, 128, 4, 2, precision="fp8")
    assert fp8._fused_layer_ok(torch.zeros(4, 128).bfloat16().to(DEV))
    fp8.experts.w1.data = fp8.experts.w1.data.float()  # fp32 master weights: the modular FP8 path
    assert not fp8._fused_layer_ok(torch.zeros(4, 128).bfloat16().to(DEV))
    layer(x)
    assert calls == [1]


@pytest.mark.parametrize("fused_gate", [False, True])
def test_kernels_launch_before_the_node_and_record_one_node(fused_gate, monkeypatch):
    """MegaMoE.forward launches the kernels (eager_layer.fused_forward) before FusedLayerFunction.apply and hands
    them in: the forward's graph is that one node (with the torch.mm gate too: no MmBackward recorded outside
    it), and the node's forward launches nothing again."""
    monkeypatch.setattr(eager_layer, "FUSED_GATE", fused_gate)
    layer = _layer(32, 48, 4, 2)
    x = torch.randn(1, 24, 32).bfloat16().to(DEV).requires_grad_()
    order = []
    real_fwd, real_apply = eager_layer.fused_forward, eager_layer.FusedLayerFunction.apply
    monkeypatch.setattr(eager_layer, "fused_forward", lambda *a: order.append("launch") or real_fwd(*a))
    monkeypatch.setattr(eager_layer.FusedLayerFunction, "apply", lambda *a: order.append("apply") or real_apply(*a))
    out = layer(x)
    assert order == ["launch", "apply"]
    names, todo = [], [out.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is not None:
            names.append(fn.name())
            todo += [f for f, _ in fn.next_functions]
    assert sum("FusedLayerFunction" in n for n in names) == 1, names
    assert not any("Mm" in n or "Linear" in n or "Topk" in n for n in names), names
    fn = out.grad_fn
    while "FusedLayerFunction" not in fn.name():
        fn = fn.next_functions[0][0]
    logits = fn.saved_tensors[2]  # made outside the node: no graph of their own
    assert logits.shape == (24, 4) and logits.grad_fn is None and not logits.requires_grad
    out.backward(torch.randn_like(out))
    assert x.grad is not None and torch.isfinite(x.grad.float()).all() and x.grad.abs().sum() > 0


def _buffers_by_name(run: dict) -> list:
    """The launches of a ``host_timeline_cpu._run`` with each address replaced by the buffer's name where it outlives
    the step (``run["named"]``: x, dy, the parameters, the FP8 weight cache), else by the order in which launches
    first name it ("new0", "new1", ...): two runs then compare by which buffer each launch reads and writes. The
    recorder keeps every launched tensor alive to the end of the step, so no address is reused and an address names
    one buffer (a CI run failed on a reused address before it did)."""
    named, new = run["named"], {}

    def relabel(v):
        if isinstance(v, list) and len(v) == 3 and isinstance(v[1], list) and (v[2] is None or isinstance(v[2], int)):
            if v[2] is None:
                return v[:2]
            if str(v[2]) in named:
                return v[:2] + [named[str(v[2])]]
            return v[:2] + [new.setdefault(v[2], f"new{len(new)}")]
        return v

    return [[name, grid, [relabel(v) for v in args], {k: relabel(v) for k, v in kw.items()}]
            for name, grid, args, kw in run["launches"]]


@pytest.mark.parametrize("quant_h", ["1", "0"])
def test_fp8_fast_forward_makes_the_checked_forwards_launches(quant_h):
    """FAST_FWD (``fp8_backend.fp8_fwd_unchecked``): the "fp8" node's forward through the launch halves makes the
    checked path's launches, in the same order: each kernel with the same grid, the same argument dtypes and shapes,
    the same buffers (by name where they outlive the step, else by first use) and the same constexprs (the Gluon FP8 GEMMs as on an sm_90 GPU: sm_90a builds on the host-only driver, no GPU;
    the results are compared on the GPU by ``test_fused_fp8_layer_matches_the_modular_path``). And the switch
    reaches the path: with it on, ``fp8_backend.fp8_fwd`` is not called. With h quantized in GEMM1's epilogue (the
    default) and without (``FP8_GEMM1_QUANT_H=0``: a 1x128 pass over h between the GEMMs)."""
    import importlib.util
    from pathlib import Path

    pytest.importorskip("triton.experimental.gluon")
    script = Path(__file__).resolve().parents[1] / "scripts" / "host_timeline_cpu.py"
    spec = importlib.util.spec_from_file_location("host_timeline_cpu", script)
    ht = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ht)
    root = str(script.parents[1])
    qh = {"TITAN_MEGAMOE_FP8_GEMM1_QUANT_H": quant_h}
    fast = ht._run(root, 1, "fp8", warmup=1, env={"TITAN_MEGAMOE_FP8_FAST_FWD": "1", **qh})
    checked = ht._run(root, 1, "fp8", warmup=1, env={"TITAN_MEGAMOE_FP8_FAST_FWD": "0", **qh})
    assert fast["paths"] == ["fp8_fwd_unchecked"] and checked["paths"] == ["fp8_fwd"], (fast["paths"], checked["paths"])
    names = [c[0] for c in checked["launches"]]
    want = ["_gate_topk_route_kernel", "_count_kernel", "_layout_kernel", "_quant_act_1x128_kernel",
            "_gemm1_fwd_fp8_ws_kernel", "_quant_act_1x128_kernel", "_gemm2_fwd_fp8_ws_kernel", "_combine_topk_fwd_kernel"]
    if quant_h == "1":
        del want[5]  # no 1x128 pass over h
    assert names[:len(want)] == want, names
    assert len(fast["launches"]) == len(checked["launches"])
    fast_l, checked_l = _buffers_by_name(fast), _buffers_by_name(checked)
    gemm1_reads = [v[2] for v in fast_l[4][2] if isinstance(v, list) and len(v) == 3]
    assert any(str(b).endswith(".w1.q") for b in gemm1_reads), gemm1_reads  # the cached FP8 w1, by name
    for i, (a, b) in enumerate(zip(fast_l, checked_l)):
        assert a == b, f"launch {i}: fast {a} vs checked {b}"
    # the fast path's launch times differ: GEMM1 is reached sooner (the point of the switch), not asserted here
    assert set(fast["launch_at_us"]) == set(checked["launch_at_us"])
