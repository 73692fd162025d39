"""The blockwise-FP8 fused operator end to end (precision "fp8" and "fp8_bwd", triton backend, EP = 1):
custom ops + autograd against the unquantized reference (``FP8_REL_BOUNDS``), the weight cache,
the lazy non-finite report, and the early errors (dims, GPU capability). FP8 with expert parallelism:
tests/test_ep_fp8.py.

Kernel-level checks against the dequantized-operand reference are in tests/test_kernels_fp8.py
(forward) and tests/test_kernels_fp8_bwd.py (backward). On CPU the kernels run in Triton's
interpreter; tests/test_gpu.py runs the op at the Qwen3-30B-A3B shape.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from titan_megamoe.config import MegaMoEConfig, MegaMoEConfigError  # noqa: E402
from titan_megamoe.errors import NonFiniteError  # noqa: E402
from titan_megamoe.ops import mega_moe  # noqa: E402
from titan_megamoe.ops.fp8_backend import NONFINITE, Fp8WeightCache, check_fp8_supported  # noqa: E402
from titan_megamoe.ops.reference import mega_moe_ref  # noqa: E402
from titan_megamoe.testing import FP8_REL_BOUNDS, make_routing, rel_err  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
DEV = "cuda" if torch.cuda.is_available() else "cpu"

CASES = [
    # (precision, routing, T, D, F, E, K, weight dtype): the edge each row covers
    ("fp8", "uniform", 37, 256, 128, 4, 2, torch.bfloat16),  # T not a multiple of the block; two D blocks
    ("fp8", "one_expert", 24, 128, 128, 4, 1, torch.float32),  # top_k = 1, all on expert 0; fp32 params -> fp32 grads
    ("fp8_bwd", "zero_expert", 40, 128, 128, 4, 2, torch.bfloat16),  # experts with no token
]


def _inputs(routing, T, D, F, E, K, wdt, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g).bfloat16()
    w1 = (torch.randn(E, F, D, generator=g) / D**0.5).bfloat16().to(wdt)
    w3 = (torch.randn(E, F, D, generator=g) / D**0.5).bfloat16().to(wdt)
    w2 = (torch.randn(E, D, F, generator=g) / F**0.5).bfloat16().to(wdt)
    s = torch.softmax(torch.randn(T, K, generator=g), -1)
    dout = torch.randn(T, D, generator=g).bfloat16()
    ids = make_routing(routing, T, E, K, seed=seed)
    return [t.to(DEV) for t in (x, ids, s, w1, w2, w3, dout)]


def _fwd_bwd(precision, x, ids, s, w1, w2, w3, dout, cache=None):
    leaves = [t.clone().requires_grad_() for t in (x, s, w1, w2, w3)]
    if precision == "reference":  # the same bf16-valued operands, computed in fp32
        f32 = [t.float() for t in leaves]
        out = mega_moe_ref(f32[0], ids, f32[1], *f32[2:], num_experts=w1.shape[0])
    else:
        out = mega_moe(leaves[0], ids, leaves[1], *leaves[2:], num_experts=w1.shape[0], backend="triton",
                       precision=precision, layer_name="layers.0.moe", fp8_cache=cache)
    out.backward(dout.to(out.dtype))
    return [out.detach()] + [t.grad for t in leaves]


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{c[1]}-K{c[6]}" for c in CASES])
def test_fp8_op_matches_reference_within_bounds(case):
    precision, *shape, wdt = case
    inputs = _inputs(*shape, wdt)
    cache = Fp8WeightCache()
    got = _fwd_bwd(precision, *inputs, cache=cache)
    ref = _fwd_bwd("reference", *inputs)
    NONFINITE.flush()  # nothing non-finite in these inputs
    assert cache.misses == 3 and cache.hits == 0
    bounds = FP8_REL_BOUNDS[precision]
    for name, a, b in zip(("out", "dx", "dscores", "dw1", "dw2", "dw3"), got, ref):
        want = {"out": torch.bfloat16, "dx": torch.bfloat16, "dscores": torch.float32}.get(name, wdt)
        assert a.dtype == want, (name, a.dtype)
        assert torch.isfinite(a).all(), name
        err = rel_err(a.float(), b.float())
        bound = bounds["out"] if name == "out" else bounds["grad"]
        assert err <= bound, f"{precision} {name}: relative error {err:.4f} > {bound}"


def test_wgrad_diagnosis_switch(monkeypatch):
    """fp8_backend._WGRAD (private ablation switch): "bf16" takes dw1..dw3 from the bf16 wgrad kernels
    (errors vs the reference drop to the FP8 dgrad's dgate_up error), "fp8_acc32" is the FP8 wgrad with
    finer fp32 promotion (the interpreter's dot is fp32: bitwise the default); dx and d scores untouched."""
    from titan_megamoe.ops import fp8_backend

    # the bf16 variant's s * h rows take the Triton GEMM2 dgrad; the default's too, so d scores compare bitwise
    monkeypatch.setattr(fp8_backend, "WS_GEMM2_DGRAD_FP8", "0")
    inputs = _inputs("uniform", 24, 128, 128, 4, 2, torch.bfloat16)
    base = _fwd_bwd("fp8_bwd", *inputs)
    ref = _fwd_bwd("reference", *inputs)
    for variant in ("bf16", "fp8_acc32"):
        monkeypatch.setattr(fp8_backend, "_WGRAD", variant)
        got = _fwd_bwd("fp8_bwd", *inputs)
        for i in (0, 1, 2):  # out, dx, dscores
            assert torch.equal(got[i], base[i]), (variant, i)
        for i in (3, 4, 5):  # dw1, dw2, dw3
            assert got[i].dtype == torch.bfloat16 and torch.isfinite(got[i]).all()
            if variant == "fp8_acc32" and DEV == "cpu":
                assert torch.equal(got[i], base[i])
            assert rel_err(got[i].float(), ref[i].float()) <= FP8_REL_BOUNDS["fp8_bwd"]["grad"]
        if variant == "bf16":  # no 128x1 quantization of the wgrad operands left
            assert rel_err(got[4].float(), ref[4].float()) < rel_err(base[4].float(), ref[4].float())
    monkeypatch.setattr(fp8_backend, "_WGRAD", "bogus")
    with pytest.raises(ValueError, match="TITAN_MEGAMOE_FP8_WGRAD"):
        _fwd_bwd("fp8_bwd", *inputs)


@pytest.mark.parametrize("forward", [True, False], ids=["fp8", "fp8_bwd"])
def test_weight_copies_switch_keeps_the_bits(monkeypatch, forward):
    """``FP8_WEIGHT_T_KERNEL``: the transposed copy stored by the quantizing kernel (default) or by PyTorch's strided
    copy after it (the path before session 40): the same four tensors, bit for bit, for "fp8" and "fp8_bwd"."""
    from titan_megamoe.ops import fp8_backend
    from titan_megamoe.ops.fp8_backend import quantize_weights

    w = (torch.randn(3, 200, 256, generator=torch.Generator().manual_seed(5)) * 0.02).bfloat16().to(DEV)
    got = quantize_weights(w, transposed=True, forward=forward, count=None, name="w")
    monkeypatch.setattr(fp8_backend, "FP8_WEIGHT_T_KERNEL", False)
    before = quantize_weights(w, transposed=True, forward=forward, count=None, name="w")
    assert (got[0] is None) == (before[0] is None) == (not forward)
    for a, b in zip(got, before):
        if a is not None:
            assert a.shape == b.shape and a.is_contiguous()
            assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                               b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b)


def test_weight_cache_hits_until_the_weight_changes():
    from titan_megamoe.ops import fp8_reference as R

    g = torch.Generator().manual_seed(3)
    w = torch.nn.Parameter(torch.randn(2, 128, 256, generator=g).bfloat16().to(DEV))
    cache = Fp8WeightCache()
    q, s, qT, sT = cache.get("w1", w, forward=True)
    rq, rs = R.quantize_weight_128x128(w.detach())
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)
    # the transposed copy equals the quantization of w^T (a block's amax ignores the orientation)
    tq, ts = R.quantize_weight_128x128(w.detach().transpose(1, 2).contiguous())
    assert torch.equal(qT.view(torch.uint8), tq.view(torch.uint8)) and torch.equal(sT, ts)
    assert cache.get("w1", w, forward=True)[0] is q and (cache.hits, cache.misses) == (1, 1)
    assert cache.get("w1", w, forward=False)[2] is qT  # the bwd-only request reuses the entry
    with torch.no_grad():
        w.mul_(2.0)  # what the optimizer does: in place, bumps w._version
    q2, s2, _, _ = cache.get("w1", w, forward=True)
    assert cache.misses == 2 and torch.equal(s2, 2 * s) and torch.equal(q2.view(torch.uint8), q.view(torch.uint8))
    cache.invalidate()
    cache.get("w1", w, forward=True)
    assert cache.misses == 3
    # a bwd-only entry (fp8_bwd) is recomputed when the forward copy is asked for
    c2 = Fp8WeightCache()
    assert c2.get("w", w, forward=False)[0] is None and c2.get("w", w, forward=True)[0] is not None
    assert c2.misses == 2


def test_prepare_weights_served_by_the_cache_launches_and_records_nothing(monkeypatch):
    """A call whose three weights all hit the cache makes no non-finite counter and queues no check (no launch, no
    copy per layer call); a miss makes one counter for the call and records it, as before."""
    from titan_megamoe.ops import fp8_backend as fb

    g = torch.Generator().manual_seed(4)
    ws = [torch.nn.Parameter(torch.randn(2, 128, 256, generator=g).bfloat16().to(DEV)) for _ in range(2)]
    w2 = torch.nn.Parameter(torch.randn(2, 256, 128, generator=g).bfloat16().to(DEV))
    records, zeros = [], []
    monkeypatch.setattr(fb.NONFINITE, "record", lambda name, count: records.append((name, count)))
    real_zeros = torch.zeros
    monkeypatch.setattr(fb.torch, "zeros", lambda *a, **k: zeros.append(a) or real_zeros(*a, **k))
    cache = Fp8WeightCache()
    first = fb.prepare_weights(ws[0], w2, ws[1], fp8_forward=True, cache=cache, layer_name="L")
    assert len(zeros) == 1 and len(records) == 1 and records[0][0] == "L expert weights"
    assert int(records[0][1]) == 0  # finite weights: nothing counted
    again = fb.prepare_weights(ws[0], w2, ws[1], fp8_forward=True, cache=cache, layer_name="L")
    assert len(zeros) == 1 and len(records) == 1, "a call served by the cache launched or recorded something"
    assert all(a is b for a, b in zip(first, again)) and (cache.hits, cache.misses) == (3, 3)
    with torch.no_grad():
        w2.mul_(2.0)  # one weight changes: one counter for the call
    fb.prepare_weights(ws[0], w2, ws[1], fp8_forward=True, cache=cache, layer_name="L")
    assert len(zeros) == 2 and len(records) == 2 and cache.misses == 4


def test_converter_hook_invalidates_caches_and_experts_own_one():
    from titan_megamoe.converter import MegaMoEConverter
    from titan_megamoe.experts import MegaMoEExperts

    experts = MegaMoEExperts(128, 128, 2, config=MegaMoEConfig(backend="triton", precision="fp8_bwd"), top_k=1)
    assert isinstance(experts.fp8_cache, Fp8WeightCache)
    assert MegaMoEExperts(128, 128, 2, config=MegaMoEConfig(backend="triton")).fp8_cache is None
    experts.fp8_cache._entries["x"] = ((), ())
    MegaMoEConverter.post_optimizer_hook(SimpleNamespace(config=experts.config), torch.nn.Sequential(experts))
    assert experts.fp8_cache._entries == {}


def test_nonfinite_is_reported_with_the_layer_name():
    x, ids, s, w1, w2, w3, _ = _inputs("uniform", 16, 128, 128, 2, 2, torch.bfloat16)
    NONFINITE.flush()
    x[3, 7] = float("inf")
    with torch.no_grad():
        mega_moe(x, ids, s, w1, w2, w3, num_experts=2, backend="triton", precision="fp8", layer_name="layers.5.moe")
    with pytest.raises(NonFiniteError, match=r"layers\.5\.moe forward activations: \d+ FP8 scaling groups"):
        NONFINITE.flush()
    NONFINITE.flush()  # reported once
    # a broken weight is named too (reported by the next fp8 call's check, or at the end of the step)
    from titan_megamoe.ops.fp8_backend import prepare_weights

    w1[0, 0, 0] = float("nan")
    prepare_weights(w1, w2, w3, fp8_forward=False, cache=None, layer_name="layers.6.moe")
    with pytest.raises(NonFiniteError, match=r"layers\.6\.moe expert weights"):
        NONFINITE.check()


def test_nonfinite_check_queries_no_event_while_a_cuda_graph_is_captured(monkeypatch):
    """The fp8 ops call ``NONFINITE.check()`` at every forward; inside a CUDA-graph capture it must not
    query events (CUDA forbids cudaEventQuery while capturing, as CapacityMonitor knows): it returns and
    the records wait for a later check."""
    from titan_megamoe.ops.fp8_backend import NonfiniteMonitor

    class NoQuery:
        def query(self):
            raise RuntimeError("cudaEventQuery during capture")

        def synchronize(self):
            pass

    mon = NonfiniteMonitor()
    mon._pending.append(("layers.0.moe forward activations", torch.tensor([2], dtype=torch.int32), NoQuery()))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    mon.check()  # nothing queried, nothing raised
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    with pytest.raises(NonFiniteError, match=r"layers\.0\.moe forward activations: 2 FP8"):
        mon.flush()


def test_early_errors(monkeypatch):
    from titan_megamoe.converter import check_fp8_setup

    x, ids, s, w1, w2, w3, _ = _inputs("uniform", 8, 128, 128, 2, 2, torch.bfloat16)
    odd = torch.zeros(2, 96, 128, dtype=torch.bfloat16, device=x.device)
    with pytest.raises(MegaMoEConfigError, match=r"layers\.1\.moe.*multiples of 128.*moe hidden dim=96.*'bf16'"):
        mega_moe(x, ids, s, odd, odd.transpose(1, 2).contiguous(), odd, num_experts=2, backend="triton",
                 precision="fp8", layer_name="layers.1.moe")
    check_fp8_setup(MegaMoEConfig(backend="triton", precision="fp8"), ep=2)  # FP8 with EP: ops/ep_fp8_backend.py
    check_fp8_setup(MegaMoEConfig(backend="triton", precision="bf16"), ep=2)  # not FP8: not this check's business
    # a GPU without FP8 tensor cores (A100, sm_80), refused by the op and by the converter up front
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(MegaMoEConfigError, match=r"FP8 tensor cores.*A100.*sm_80.*precision = 'bf16'"):
        check_fp8_supported(torch.device("cuda", 0), 2048, 768, "layers.0.moe", "fp8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    with pytest.raises(MegaMoEConfigError, match="sm_80"):
        check_fp8_setup(MegaMoEConfig(backend="triton", precision="fp8_bwd"), ep=1)


def test_fp8_fwd_op_fake_matches_real():
    x, ids, s, w1, w2, w3, _ = _inputs("uniform", 8, 128, 128, 2, 2, torch.bfloat16)
    import titan_megamoe.ops.library  # noqa: F401  (registers the ops; run alone, nothing else has)
    from titan_megamoe.ops.fp8_backend import prepare_weights

    wq = prepare_weights(w1, w2, w3, fp8_forward=True, cache=None, layer_name="moe")
    torch.library.opcheck(torch.ops.megamoe.fp8_mega_moe_fwd.default, (x, ids, s, w1, w2, w3, wq, True, "moe"),
                          test_utils=("test_faketensor",))  # test_schema: no fp8 mul on CPU


def test_megamoe_layer_fp8_matches_reference_layer_and_caches_per_step():
    """The whole MegaMoE layer (router, scores, experts through ``self.experts`` with its weight cache)
    with precision "fp8" vs the same layer on the reference backend: output, dx, expert and router
    gradients within the FP8 bounds (fp32 parameters: fp32 gradients). After an in-place update of
    w1 (what the optimizer does) only w1 is re-quantized."""
    import copy

    from torchtitan.models.moe.moe import MoEArgs

    from titan_megamoe.layer import MegaMoE
    from titan_megamoe.testing import build_moe_pair

    args = MoEArgs(num_experts=4, top_k=2, score_func="softmax", route_norm=True, score_before_experts=False,
                   num_shared_experts=0)
    pair = build_moe_pair(args, 128, 128, dtype=torch.float32, seed=0)
    fp8 = MegaMoE.from_moe(copy.deepcopy(pair.stock), config=MegaMoEConfig(backend="triton", precision="fp8"))
    ref = pair.mega.to(DEV)
    fp8 = fp8.to(DEV)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 24, 128, generator=g).to(DEV)
    dy = torch.randn(1, 24, 128, generator=g).to(DEV)
    res = []
    for layer in (fp8, ref):
        xi = x.clone().requires_grad_()
        out = layer(xi)
        out.backward(dy)
        e = layer.experts
        res.append([out.detach(), xi.grad, e.w1.grad, e.w2.grad, e.w3.grad, layer.router.gate.weight.grad])
    NONFINITE.flush()
    for name, a, b in zip(("out", "dx", "dw1", "dw2", "dw3", "dgate"), *res):
        assert a.dtype == torch.float32 and torch.isfinite(a).all(), name
        bound = FP8_REL_BOUNDS["fp8"]["out" if name == "out" else "grad"]
        assert rel_err(a, b) <= bound, f"{name}: {rel_err(a, b):.4f} > {bound}"
    cache = fp8.experts.fp8_cache
    assert (cache.misses, cache.hits) == (3, 0)
    with torch.no_grad():
        fp8.experts.w1.mul_(0.5)
        fp8(x)
    assert (cache.misses, cache.hits) == (4, 2)


def test_fp8_bwd_forward_lets_gemm1_pick_its_kernel(monkeypatch):
    """Off the interpreter, "fp8_bwd"'s bf16 forward calls GEMM1 without a config, as the bf16 path does: an
    explicit config turns off the Gluon GEMM1 (``grouped_gemm._launch_gemm1``), which the bf16 path runs on sm_90.
    In the interpreter it passes the 128-wide interpreter blocks."""
    import titan_megamoe.kernels.grouped_gemm as gg
    import titan_megamoe.ops.fp8_backend as fb
    from titan_megamoe.kernels.routing import build_routing_layout

    seen = {}

    def gemm1(x, w1, w3, layout, *, config=None, **kw):
        seen["gemm1"] = config
        N, (E, F, D) = layout.n_cap, w1.shape
        return torch.full((N, 2 * F), 1.5, dtype=torch.bfloat16), torch.full((N, F), 0.5, dtype=torch.bfloat16)

    def gemm2(h, w2, scores, layout, *, config=None, by_row=False, **kw):
        seen["gemm2"] = config
        return torch.full((scores.numel(), w2.shape[1]), 2.0, dtype=torch.bfloat16)

    monkeypatch.setattr(gg, "gemm1_swiglu_fwd", gemm1)
    monkeypatch.setattr(gg, "gemm2_scatter_fwd", gemm2)
    x, ids, s, w1, w2, w3, _ = [t.cpu() for t in _inputs("uniform", 37, 256, 128, 4, 2, torch.bfloat16)]
    layout = build_routing_layout(ids, 4, fb.FP8_BLOCK_M)
    for interp in (False, True):
        monkeypatch.setattr(fb, "_interp", lambda interp=interp: interp)
        seen.clear()
        y, gate_up = fb.fp8_experts_fwd(x, s.float(), layout, w1, w2, w3, [], False, "layers.0.moe")
        assert y.shape == (37 * 2, 256) and gate_up.shape == (layout.n_cap, 256)
        if interp:
            assert seen["gemm1"] is not None and seen["gemm1"].block_m == fb.FP8_BLOCK_M == 128
        else:
            assert seen["gemm1"] is None
        assert seen["gemm2"].block_m == fb.FP8_BLOCK_M
