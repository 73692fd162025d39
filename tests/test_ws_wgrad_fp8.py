"""The warp-specialized blockwise-FP8 wgrad (kernels/ws_wgrad_fp8.py): sm_90a builds on the CPU machine (registers,
shared memory, wgmma count and waits, no wgmma serialization by ptxas), its host-side errors, the opt-in switch's
wiring in the FP8 backward, and on a GPU its results against the Triton FP8 wgrad and an fp32 reference of the
dequantized operands (edge cases: experts without rows, all rows on one expert, top_k 1, fp32 outputs)."""

import json
import sys

import pytest
import torch

from _sm90 import sm90_result  # noqa: E402

# (label, MA, NC, split, out dtype): dw2 (D x F), dw1 | dw3 (2F x D split at F) at both Qwen3 shapes
BUILDS = [("w2_30b", 2048, 768, None, torch.bfloat16), ("w13_30b", 1536, 2048, 768, torch.bfloat16),
          ("w2_235b", 4096, 1536, None, torch.bfloat16), ("w13_235b", 3072, 4096, 1536, torch.bfloat16),
          ("w2_30b_fp32", 2048, 768, None, torch.float32), ("w13_30b_v1", 1536, 2048, 768, torch.bfloat16),
          ("w2_30b_epi2", 2048, 768, None, torch.bfloat16), ("w13_235b_epi2", 3072, 4096, 1536, torch.bfloat16),
          ("w2_30b_n128", 2048, 768, None, torch.bfloat16), ("w13_30b_n128", 1536, 2048, 768, torch.bfloat16),
          ("w13_235b_n128", 3072, 4096, 1536, torch.bfloat16), ("w2_30b_n128_2buf", 2048, 768, None, torch.bfloat16),
          ("w2_30b_fp32_n128_4st", 2048, 768, None, torch.float32)]


def _config(label: str):
    """The default config; with the label's suffix ``_v1`` session 20's consumer (scales loaded from global memory
    every step), with ``_epi2`` two output staging tiles per consumer, with ``_n128`` one m64n128 MMA chain per
    consumer (``_n128_2buf``: with two staging tiles and 4 stages, the A/B's row; ``_n128_4st``: 4 stages, as fp32
    outputs need)."""
    import dataclasses

    from titan_megamoe.kernels.ws_wgrad_fp8 import FP8_WGRAD_CONFIG, FP8_WGRAD_EPI2_CONFIG, FP8_WGRAD_N128_CONFIG

    if label.endswith("_v1"):
        return dataclasses.replace(FP8_WGRAD_CONFIG, smem_scales=False)
    if label.endswith("_n128_2buf"):
        return dataclasses.replace(FP8_WGRAD_N128_CONFIG, epilogue_buffers=2, stages=4)
    if label.endswith("_n128_4st"):
        return dataclasses.replace(FP8_WGRAD_N128_CONFIG, stages=4)
    if label.endswith("_n128"):
        return FP8_WGRAD_N128_CONFIG
    return FP8_WGRAD_EPI2_CONFIG if label.endswith("_epi2") else FP8_WGRAD_CONFIG


def _compile_sm90_all() -> list[dict]:
    from titan_megamoe.kernels import ws_wgrad_fp8 as W
    from titan_megamoe.kernels.sm90_check import compile_sm90

    out = []
    for label, MA, NC, split, dt in BUILDS:
        cfg = _config(label)
        sig, cx = W.sm90_compile_args_wgrad_fp8(MA, NC, split or MA, dt, cfg)
        r = compile_sm90(W._wgrad_fp8_ws_kernel, sig, cx, num_warps=4, num_stages=1, maxnreg=cfg.maxnreg)
        out.append(dict(label=label, **r))
    return out


@pytest.mark.parametrize("label", [b[0] for b in BUILDS])
def test_ws_wgrad_fp8_builds_for_sm90a_without_spills_or_wgmma_serialization(label):
    from titan_megamoe.kernels.sm90_check import HOPPER_SMEM_BYTES

    r = sm90_result(__file__, label)
    dt = dict((b[0], b[4]) for b in BUILDS)[label]
    cfg = _config(label)
    assert r["target"], "PTX not built for sm_90a"
    if "_n128" in label:  # two consumers x 4 k32 steps of m64n128 e4m3, the partial scaled once it completes
        assert r["wgmma"] == 8 and r["wgmma_waits"] == ["0", "0"], (r["wgmma"], r["wgmma_waits"])
    else:
        assert r["wgmma"] == 16, r  # two consumers x (lo, hi) halves x 4 k32 steps of m64n64 e4m3
        assert r["wgmma_waits"] == ["1", "0", "1", "0"], r["wgmma_waits"]  # the lo partial scaled under the hi MMA
    assert r["tma"] > 0 and r["cp_async"] == 0, "both operands by TMA"
    if label == "w13_30b":  # the same kernel with global scale loads: two TMA copies (the scale rows) fewer
        assert r["tma"] == sm90_result(__file__, "w13_30b_v1")["tma"] + 2, r["tma"]
    assert cfg.smem_bytes(dt) <= r["shared"] <= HOPPER_SMEM_BYTES, r["shared"]
    assert "STACK:0" in r["usage"] and f"REG:{cfg.maxnreg}" in r["usage"], r["usage"]  # the cap, no spills
    assert r["wgmma_serialized"] == "", r["wgmma_serialized"]
    if label.endswith("_epi2"):  # a second 64 x 64 bf16 staging tile per consumer, the same MMA schedule
        base = sm90_result(__file__, label.removesuffix("_epi2"))
        assert r["shared"] == base["shared"] + 2 * 64 * 64 * 2, (r["shared"], base["shared"])
        assert r["mma_loop_spills"] == base["mma_loop_spills"] == [0, 0], r["mma_loop_spills"]


def _operands(T, E, K, D, F, routing, seed, device):
    """The FP8 backward's wgrad operands as the op makes them: dout and x gathered and quantized 128x1 (transposed),
    s * h and dgate_up random bf16 rows (zeros on padding rows), quantized the same way."""
    from titan_megamoe.kernels.fp8_quant_bwd import quantize_dual_1x128_128x1_t, quantize_gather_128x1_t
    from titan_megamoe.kernels.routing import build_routing_layout
    from titan_megamoe.testing import make_routing

    g = torch.Generator(device=device).manual_seed(seed)
    lay = build_routing_layout(make_routing(routing, T, E, K, seed=seed).to(device), E, 128)
    valid = lay.row_pair >= 0
    dout = torch.randn(T, D, device=device, generator=g).bfloat16()
    x = torch.randn(T, D, device=device, generator=g).bfloat16()
    hs = torch.randn(lay.n_cap, F, device=device, generator=g).bfloat16()
    dgu = torch.randn(lay.n_cap, 2 * F, device=device, generator=g).bfloat16()
    doT = quantize_gather_128x1_t(dout, lay.row_pair, K)
    xT = quantize_gather_128x1_t(x, lay.row_pair, K)
    hsT = quantize_dual_1x128_128x1_t(hs, valid)[2:]
    dguT = quantize_dual_1x128_128x1_t(dgu, valid)[2:]
    return lay, doT, xT, hsT, dguT


def test_fp8_wgrad_consumer_switch_names_the_two_consumers():
    """``TITAN_MEGAMOE_FP8_WGRAD_CONSUMER``: a same-process switch (compare.layer --switches) whose values map to the two
    consumer configs; smem (scale rows through shared memory) is the default."""
    from titan_megamoe import switches
    from titan_megamoe.kernels import ws_wgrad_fp8 as W

    sw = switches.SWITCHES["TITAN_MEGAMOE_FP8_WGRAD_CONSUMER"]
    assert sw.default == "smem" and set(sw.values) == {"smem", "v1"}
    assert W.consumer_config("smem") == W.FP8_WGRAD_CONFIG and W.FP8_WGRAD_CONFIG.smem_scales
    assert not W.consumer_config("v1").smem_scales
    for value in sw.values:
        with switches.override({sw.env: value}):
            assert W.CONSUMER == value
    assert W.CONSUMER == "smem"


def test_ws_wgrad_fp8_refuses_what_it_cannot_take(monkeypatch):
    """Host-side checks only (CPU tensors of the right shapes, pure-PyTorch layout: also on a GPU machine)."""
    from titan_megamoe.kernels import ws_wgrad_fp8 as W
    from titan_megamoe.kernels.fp8_quant_bwd import empty_transposed
    from titan_megamoe.kernels.routing import build_routing_layout_torch

    lay = build_routing_layout_torch(torch.randint(0, 4, (40, 2), generator=torch.Generator().manual_seed(0)), 4, 128)
    n = lay.n_cap
    doT, hsT = empty_transposed(256, n, "cpu"), empty_transposed(128, n, "cpu")
    doTs, hsTs = torch.ones(n // 128, 256), torch.ones(n // 128, 128)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="ws_wgrad_fp8: .*(sm_90|Gluon|Triton)"):
            W.ws_wgrad_fp8(doT, doTs, hsT, hsTs, lay)
    monkeypatch.setattr(W, "_platform_reason", lambda t: None)  # past the platform: the shape checks
    assert W.ws_wgrad_fp8_supported(doT, 256, 128, None, lay) is None
    assert "multiples of 128" in W.ws_wgrad_fp8_supported(doT, 256, 64, None, lay)
    assert "multiples of 128" in W.ws_wgrad_fp8_supported(doT, 256, 128, 64, lay)
    lay64 = build_routing_layout_torch(torch.randint(0, 4, (40, 2)), 4, 64)
    assert "block_m 128" in W.ws_wgrad_fp8_supported(doT, 256, 128, None, lay64)
    with pytest.raises(ValueError, match="ws_wgrad_fp8: aT_s must be a contiguous fp32"):
        W.ws_wgrad_fp8(doT, doTs[:, :128].contiguous(), hsT, hsTs, lay)
    with pytest.raises(ValueError, match="ws_wgrad_fp8: bT_q must be a"):
        W.ws_wgrad_fp8(doT, doTs, hsT.float(), hsTs, lay)
    with pytest.raises(ValueError, match="out_dtype must be bf16 or fp32"):
        W.ws_wgrad_fp8(doT, doTs, hsT, hsTs, lay, out_dtype=torch.float16)
    with pytest.raises(ValueError, match=r"split=256 must be in \(0, 256\)"):
        W.ws_wgrad_fp8(doT, doTs, hsT, hsTs, lay, split=256)
    with pytest.raises(ValueError, match="out must be 1 contiguous"):
        W.ws_wgrad_fp8(doT, doTs, hsT, hsTs, lay, out=(torch.empty(4, 256, 64),))
    with pytest.raises(ValueError, match="cfg.mma_n must be 64 or 128"):
        W.ws_wgrad_fp8(doT, doTs, hsT, hsTs, lay, cfg=W.Fp8WgradConfig(mma_n=256))
    with pytest.raises(ValueError, match=r"234576 bytes of shared memory with torch.float32 outputs "
                                         r"\(\+ alignment\).*fewer stages"):
        W.ws_wgrad_fp8(doT, doTs, hsT, hsTs, lay, out_dtype=torch.float32, cfg=W.FP8_WGRAD_N128_CONFIG)


def test_default_wgrad_config_has_two_staging_tiles_only_for_unsplit_bf16_launches(monkeypatch):
    """Without ``cfg``: dw2 (unsplit) with bf16 outputs takes FP8_WGRAD_EPI2_CONFIG's two output staging tiles (session
    38's A/B: faster there, slower for the split dw1 | dw3); split or fp32 launches keep one."""
    from titan_megamoe.kernels import ws_wgrad_fp8 as W
    from titan_megamoe.kernels.fp8_quant_bwd import empty_transposed
    from titan_megamoe.kernels.routing import build_routing_layout_torch

    lay = build_routing_layout_torch(torch.randint(0, 4, (40, 2), generator=torch.Generator().manual_seed(0)), 4, 128)
    n = lay.n_cap
    aT, bT = empty_transposed(256, n, "cpu"), empty_transposed(256, n, "cpu")
    aTs, bTs = torch.ones(n // 128, 256), torch.ones(n // 128, 256)
    got = []
    monkeypatch.setattr(W, "_platform_reason", lambda t: None)
    monkeypatch.setattr(W, "_programs", lambda dev, tiles, programs: 1)
    monkeypatch.setattr(W, "launch", lambda kernel, grid, *args, **kw: got.append(args[-1]))
    for split, dt, want in ((None, torch.bfloat16, 2), (128, torch.bfloat16, 1), (None, torch.float32, 1)):
        W.ws_wgrad_fp8(aT, aTs, bT, bTs, lay, split=split, out_dtype=dt)
        assert got[-1] == want, (split, dt, got)
    W.ws_wgrad_fp8(aT, aTs, bT, bTs, lay, cfg=W.FP8_WGRAD_CONFIG)  # an explicit config is kept
    assert got[-1] == 1


def test_fp8_backward_takes_the_gluon_wgrad_only_when_switched_on(monkeypatch):
    """``WS_WGRAD_FP8`` on, off the interpreter, a supported case, no fp32-promotion diagnosis: the FP8 backward's weight
    gradients come from the Gluon kernel; off (or with the diagnosis): from the Triton one, with the same arguments."""
    import titan_megamoe.kernels.grouped_gemm_fp8_bwd as B8
    import titan_megamoe.kernels.ws_wgrad_fp8 as W
    import titan_megamoe.ops.fp8_backend as fb
    from titan_megamoe import switches

    assert switches.SWITCHES["TITAN_MEGAMOE_WS_WGRAD_FP8"].default == "1"
    calls = []
    monkeypatch.setattr(W, "ws_wgrad_fp8_supported", lambda *a: None)
    monkeypatch.setattr(W, "ws_wgrad_fp8", lambda *a, **k: calls.append(("gluon", k["split"], k["out_dtype"])) or "g")
    monkeypatch.setattr(B8, "wgrad_fp8", lambda *a, **k: calls.append(
        ("triton", k["split"], k["out_dtype"], k["_max_imprecise_acc"])) or "t")
    monkeypatch.setattr(fb, "_interp", lambda: False)
    aT = torch.zeros(256, 128, dtype=torch.float8_e4m3fn)
    for on, acc, want in (("1", None, ("gluon", 128, torch.float32)), ("0", None, ("triton", 128, torch.float32, None)),
                          ("1", 32, ("triton", 128, torch.float32, 32))):
        calls.clear()
        with switches.override({"TITAN_MEGAMOE_WS_WGRAD_FP8": on}):
            assert fb.WS_WGRAD_FP8 is (on == "1")
            got = fb._wgrad_fp8(aT, "aTs", aT, "bTs", "layout", 128, torch.float32, acc)
        assert calls == [want] and got == want[0][0]


@pytest.mark.cuda
@pytest.mark.parametrize("case", [
    (4096, 16, 4, 512, 256, "uniform", torch.bfloat16), (1000, 8, 1, 256, 128, "uniform", torch.float32),
    (3000, 32, 4, 384, 256, "zero_expert", torch.bfloat16), (2048, 16, 2, 256, 384, "one_expert", torch.float32),
    (16384, 128, 8, 2048, 768, "uniform", torch.bfloat16),
], ids=["uniform", "top1-odd-T-fp32", "zero-expert", "one-expert-fp32", "30b"])
def test_ws_wgrad_fp8_matches_triton_and_fp32_on_gpu(case):
    import dataclasses

    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs an sm_90 GPU")
    from titan_megamoe.kernels.grouped_gemm_fp8_bwd import wgrad_fp8
    from titan_megamoe.kernels.ws_wgrad_fp8 import ws_wgrad_fp8
    from titan_megamoe.ops import fp8_reference as R
    from titan_megamoe.testing import rel_err

    T, E, K, D, F, routing, dt = case
    lay, doT, xT, hsT, dguT = _operands(T, E, K, D, F, routing, 11, "cuda")
    off = lay.offsets.tolist()
    empty = (lay.counts == 0).nonzero().squeeze(1)
    if routing == "zero_expert":
        assert len(empty) > 0, "the case needs an expert without rows"

    def ref(aT, bT):  # fp32 math of the dequantized operands, per expert
        a = R.dequantize_act_128x1(aT[0].T.contiguous(), aT[1])
        b = R.dequantize_act_128x1(bT[0].T.contiguous(), bT[1])
        return torch.stack([a[off[e]:off[e + 1]].T @ b[off[e]:off[e + 1]] for e in range(E)])

    for name, aT, bT, split in (("dw2", doT, hsT, None), ("dw13", dguT, xT, F)):
        shapes = [(E, aT[0].shape[0], bT[0].shape[0])] if split is None else [(E, F, D), (E, F, D)]
        out = tuple(torch.full(sh, float("nan"), device="cuda", dtype=dt) for sh in shapes)  # poisoned
        got = ws_wgrad_fp8(*aT, *bT, lay, split=split, out_dtype=dt, out=out)
        assert all(g is o for g, o in zip(got, out))
        v1 = ws_wgrad_fp8(*aT, *bT, lay, split=split, out_dtype=dt, cfg=_config("_v1"))  # the same partials, order
        assert all(torch.equal(g, o) for g, o in zip(got, v1)), f"{name}: the v1 consumer differs"
        if dt == torch.bfloat16:  # one and two staging tiles per consumer: the same stores (the default takes two
            for label in ("_epi2", "one staging tile"):  # for dw2)
                epi = tuple(torch.full_like(o, float("nan")) for o in out)
                ws_wgrad_fp8(*aT, *bT, lay, split=split, out_dtype=dt, out=epi, cfg=_config(label))
                assert all(torch.equal(g, o) for g, o in zip(got, epi)), f"{name}: {label} differs"
        n128 = _config("_n128") if dt == torch.bfloat16 else dataclasses.replace(_config("_n128"), stages=4)
        wide = tuple(torch.full_like(o, float("nan")) for o in out)
        ws_wgrad_fp8(*aT, *bT, lay, split=split, out_dtype=dt, out=wide, cfg=n128)
        print(f"{name} {case[5]} {dt}: m64n128 consumer bitwise {all(torch.equal(g, o) for g, o in zip(got, wide))}, "
              f"rel err {rel_err(torch.cat(wide, 1).float(), torch.cat(got, 1).float()):.2e}")
        assert all(torch.equal(g, o) for g, o in zip(got, wide)), f"{name}: the m64n128 consumer differs"
        tri = wgrad_fp8(*aT, *bT, lay, split=split, out_dtype=dt)
        got, tri = torch.cat(got, 1).float(), torch.cat(tri, 1).float()
        assert not torch.isnan(got).any(), f"{name}: output tiles left unwritten"
        assert (got[empty] == 0).all(), f"{name}: experts without rows get exact zeros"
        err_ref, err_tri = rel_err(got, ref(aT, bT)), rel_err(got, tri)
        print(f"{name} {case[5]} {dt}: rel err vs fp32 {err_ref:.2e}, vs Triton {err_tri:.2e}, "
              f"bitwise Triton {torch.equal(got, tri)}")
        assert err_ref < 2e-3 if dt == torch.float32 else err_ref < 1e-2
        assert err_tri < 1e-5 if dt == torch.float32 else err_tri < 1e-2


if __name__ == "__main__":
    if sys.argv[1:2] == ["compile-sm90"]:
        print(json.dumps(_compile_sm90_all()))
    else:
        raise SystemExit("usage: python tests/test_ws_wgrad_fp8.py compile-sm90")
