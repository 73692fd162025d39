"""The warp-specialized Gluon GEMM1 dgrad (kernels/ws_gemm.py): sm_90a builds on the CPU machine
(registers, shared memory, wgmma count, no wgmma serialization by ptxas), its host-side errors and
fallback, and on a GPU its results against the Triton kernel and an fp32 reference."""

import dataclasses
import json
import os
import sys

import pytest
import torch

from _sm90 import sm90_result  # noqa: E402

SHAPES = {"30b": (2048, 768), "235b": (4096, 1536)}


def _compile_sm90_all() -> list[dict]:
    from triton.experimental.gluon import language as gl

    from _gluon_probe import gluon_serialized_wgmma_kernel
    from titan_megamoe.kernels import ws_gemm
    from titan_megamoe.kernels.sm90_check import compile_sm90

    out = []
    for name, cfg in ws_gemm.CONFIGS.items():
        for shape, (D, F) in SHAPES.items():
            sig, cx = ws_gemm.sm90_compile_args(cfg, D, F)
            r = compile_sm90(ws_gemm._gemm1_dgrad_ws_kernel, sig, cx, num_warps=4, num_stages=1, maxnreg=cfg.maxnreg)
            out.append(dict(label=f"{name}_{shape}", **r))
    # the expert-major tile order (group_m 0, WS_GEMM1_EXPERT_ORDER) at 235B: three more loads per tile
    cfg = dataclasses.replace(ws_gemm.CONFIGS["coop"], group_m=0)
    sig, cx = ws_gemm.sm90_compile_args(cfg, *SHAPES["235b"])
    r = compile_sm90(ws_gemm._gemm1_dgrad_ws_kernel, sig, cx, num_warps=4, num_stages=1, maxnreg=cfg.maxnreg)
    out.append(dict(label="coop_235b_expert_order", **r))
    cfg = dataclasses.replace(ws_gemm.FWD_CONFIG, group_m=0)
    sig, cx = ws_gemm.sm90_compile_args(cfg, *SHAPES["235b"], kind="gemm1")
    r = compile_sm90(ws_gemm._gemm1_fwd_ws_kernel, sig, cx, num_warps=4, num_stages=1, maxnreg=cfg.maxnreg)
    out.append(dict(label="fwd_235b_expert_order", **r))
    # tiles from the launch's counter (dynamic, WS_GEMM1_DYNAMIC), row and expert order, at 235B
    for name, base in (("coop", ws_gemm.CONFIGS["coop"]), ("split", ws_gemm.CONFIGS["split"])):
        for order, group_m in (("", base.group_m), ("_expert", 0)):
            cfg = dataclasses.replace(base, dynamic=True, group_m=group_m)
            sig, cx = ws_gemm.sm90_compile_args(cfg, *SHAPES["235b"])
            r = compile_sm90(ws_gemm._gemm1_dgrad_ws_kernel, sig, cx, num_warps=4, num_stages=1, maxnreg=cfg.maxnreg)
            out.append(dict(label=f"{name}_235b_dynamic{order}", **r))
    for order, group_m in (("", ws_gemm.FWD_CONFIG.group_m), ("_expert", 0)):
        cfg = dataclasses.replace(ws_gemm.FWD_CONFIG, dynamic=True, group_m=group_m)
        sig, cx = ws_gemm.sm90_compile_args(cfg, *SHAPES["235b"], kind="gemm1")
        r = compile_sm90(ws_gemm._gemm1_fwd_ws_kernel, sig, cx, num_warps=4, num_stages=1, maxnreg=cfg.maxnreg)
        out.append(dict(label=f"fwd_235b_dynamic{order}", **r))
    for shape, (D, F) in SHAPES.items():
        cfg = ws_gemm.FWD_CONFIG
        sig, cx = ws_gemm.sm90_compile_args(cfg, D, F, kind="gemm1")
        r = compile_sm90(ws_gemm._gemm1_fwd_ws_kernel, sig, cx, num_warps=4, num_stages=1, maxnreg=cfg.maxnreg)
        out.append(dict(label=f"fwd_{shape}", **r))
    for shape, (D, F) in SHAPES.items():
        for name, cfg in (("g2d", ws_gemm.G2D_CONFIG), ("g2d_split", ws_gemm.G2D_SPLIT_CONFIG)):
            sig, cx = ws_gemm.sm90_compile_args(cfg, D, F, kind="gemm2_dgrad")
            r = compile_sm90(ws_gemm._gemm2_dgrad_ws_kernel, sig, cx, num_warps=4, num_stages=1, maxnreg=cfg.maxnreg)
            out.append(dict(label=f"{name}_{shape}", **r))
    lay = gl.NVMMASharedLayout.get_default_for([64, 64], gl.bfloat16)
    lay_b = gl.NVMMASharedLayout.get_default_for([64, 128], gl.bfloat16)
    sig = {"a_desc": f"tensordesc<bf16[64, 64],{lay!r}>", "b_desc": f"tensordesc<bf16[64, 128],{lay_b!r}>",
           "c_desc": f"tensordesc<bf16[64, 128],{lay_b!r}>", "K": "i32"}
    out.append(dict(label="serialized", **compile_sm90(gluon_serialized_wgmma_kernel, sig, {}, num_warps=4,
                                                       num_stages=1)))
    return out


@pytest.mark.parametrize("label", ["pingpong_30b", "pingpong_235b", "coop_30b", "coop_235b", "split_30b",
                                   "split_235b", "coop_235b_expert_order", "coop_235b_dynamic", "coop_235b_dynamic_expert",
                                   "split_235b_dynamic", "split_235b_dynamic_expert"])
def test_ws_gemm1_dgrad_builds_for_sm90a_without_wgmma_serialization(label):
    from titan_megamoe.kernels.sm90_check import HOPPER_SMEM_BYTES
    from titan_megamoe.kernels.ws_gemm import CONFIGS

    r = sm90_result(__file__, label)
    assert r["target"], "PTX not built for sm_90a"
    # two consumer warpgroups; pingpong: 128 x 128 tiles -> 2 (m64) x 4 (k16) wgmma each; coop: 64 x 256 -> 4;
    # split: 64 x 256 as two m64n128 halves -> 8
    assert r["wgmma"] == (8 if label.startswith("coop") else 16), r
    assert r["tma"] > 0, "operands must load by TMA"
    # split: half the epilogue's staging buys a 4th stage (229,376 bytes of the 232,448)
    assert CONFIGS[label.split("_")[0]].smem_bytes() <= r["shared"] <= HOPPER_SMEM_BYTES, r["shared"]
    assert "STACK:0" in r["usage"] and "REG:168" in r["usage"], r["usage"]  # the cap, no spills
    assert r["wgmma_serialized"] == "", r["wgmma_serialized"]
    # the counter schedule: one atomic add per ticket (the producer's); the static schedules none
    assert (r["atomics"] > 0) == ("dynamic" in label), r["atomics"]


@pytest.mark.parametrize("label", ["fwd_30b", "fwd_235b", "fwd_235b_expert_order", "fwd_235b_dynamic",
                                   "fwd_235b_dynamic_expert"])
def test_ws_gemm1_fwd_builds_for_sm90a_without_spills_or_wgmma_serialization(label):
    from titan_megamoe.kernels.sm90_check import HOPPER_SMEM_BYTES

    r = sm90_result(__file__, label)
    assert r["target"], "PTX not built for sm_90a"
    assert r["wgmma"] == 16, r  # two consumers x (gate, up) x 4 k16 steps of m64n128
    assert r["cp_async"] > 0 and r["tma"] > 0, "gathered rows by cp.async, weights by TMA"
    assert 0 < r["shared"] <= HOPPER_SMEM_BYTES, r["shared"]
    # 216 / 72 registers: no spills (the counter schedule in the expert order had 8 bytes with session 31's scalar
    # ticket atomic; none with the partition-wide one of session 33)
    assert "STACK:0" in r["usage"] and "REG:168" in r["usage"], r["usage"]
    assert r["wgmma_serialized"] == "", r["wgmma_serialized"]
    assert (r["atomics"] > 0) == ("dynamic" in label), r["atomics"]


@pytest.mark.parametrize("label", ["g2d_30b", "g2d_235b", "g2d_split_30b", "g2d_split_235b"])
def test_ws_gemm2_dgrad_builds_for_sm90a_without_spills_or_wgmma_serialization(label):
    from titan_megamoe.kernels.sm90_check import HOPPER_SMEM_BYTES

    r = sm90_result(__file__, label)
    assert r["target"], "PTX not built for sm_90a"
    # two consumers x 4 k16 steps x (one m64n128, or split: two m64n64 column halves)
    assert r["wgmma"] == (16 if "split" in label else 8), r
    assert r["cp_async"] > 0 and r["tma"] > 0, "gathered dout rows by cp.async, w2 by TMA"
    assert 0 < r["shared"] <= HOPPER_SMEM_BYTES, r["shared"]
    assert "STACK:0" in r["usage"] and "REG:168" in r["usage"], r["usage"]  # 216 / 72 registers: no spills
    assert r["wgmma_serialized"] == "", r["wgmma_serialized"]


def test_the_serialization_check_reports_a_serialized_kernel():
    """The check above can fail: a kernel ptxas serializes is reported."""
    r = sm90_result(__file__, "serialized")
    assert r["wgmma"] > 0
    assert "C751" in r["wgmma_serialized"], r


def test_ws_gemm1_dgrad_refuses_what_it_cannot_take():
    from titan_megamoe.kernels import ws_gemm

    dgu = torch.zeros(256, 256, dtype=torch.bfloat16)
    w1 = torch.zeros(2, 128, 64, dtype=torch.bfloat16)
    reason = ws_gemm.ws_gemm1_dgrad_supported(dgu, w1)
    assert reason is not None and ("sm_90" in reason or "Gluon" in reason)
    with pytest.raises(ValueError, match="ws_gemm1_dgrad: "):
        ws_gemm.ws_gemm1_dgrad(dgu, w1, w1, None)
    x = torch.zeros(16, 64, dtype=torch.bfloat16)
    assert ws_gemm.ws_gemm1_fwd_supported(x, w1) is not None
    with pytest.raises(ValueError, match="ws_gemm1_fwd: "):
        ws_gemm.ws_gemm1_fwd(x, w1, w1, None)
    dout, w2 = torch.zeros(16, 64, dtype=torch.bfloat16), torch.zeros(2, 64, 128, dtype=torch.bfloat16)
    gu = torch.zeros(256, 256, dtype=torch.bfloat16)
    assert ws_gemm.ws_gemm2_dgrad_supported(dout, w2) is not None
    with pytest.raises(ValueError, match="ws_gemm2_dgrad: "):
        ws_gemm.ws_gemm2_dgrad(dout, w2, gu, torch.zeros(16, 2), None)
    # operands the kernels would misread through raw pointers are refused by name, before anything else
    with pytest.raises(ValueError, match="ws_gemm2_dgrad: scores must be a contiguous torch.float32"):
        ws_gemm.ws_gemm2_dgrad(dout, w2, gu, torch.zeros(16, 2, dtype=torch.bfloat16), None)
    with pytest.raises(ValueError, match="ws_gemm2_dgrad: gate_up must be a contiguous torch.bfloat16.*strided"):
        ws_gemm.ws_gemm2_dgrad(dout, w2, gu.t(), torch.zeros(16, 2), None)
    with pytest.raises(ValueError, match="ws_gemm1_fwd: w3 must be a contiguous torch.bfloat16"):
        ws_gemm.ws_gemm1_fwd(x, w1, w1.float(), None)
    with pytest.raises(ValueError, match="ws_gemm1_dgrad: out must be"):
        ws_gemm.ws_gemm1_dgrad(dgu, w1, w1, None, out=torch.zeros(256, 64))
    if ws_gemm.HAVE_GLUON:
        assert ws_gemm.WsConfig(coop=True, block_n=256, stages=3).smem_bytes() <= 232448
        assert ws_gemm.WsConfig(stages=4).smem_bytes() <= 232448


def test_descriptor_fast_path_builds_the_same_descriptor():
    """``ws_gemm._desc``: after the first (checked) descriptor of a key, the unchecked construction gives the same
    fields; a misaligned base still goes through TensorDescriptor's checks and fails there."""
    from titan_megamoe.kernels import ws_gemm

    if not ws_gemm.HAVE_GLUON:
        pytest.skip("no Gluon in this Triton")
    t = torch.zeros(512 * 256 + 8, dtype=torch.bfloat16)
    v = t[:512 * 256]
    first = ws_gemm._desc(v, (512, 256), (64, 128))
    again = ws_gemm._desc(v, (512, 256), (64, 128))
    assert type(again) is type(first)
    for f in ("base", "shape", "strides", "block_shape", "layout", "padding"):
        assert getattr(again, f) == getattr(first, f) if f != "base" else again.base is first.base, f
    assert again.strides == [256, 1]
    with pytest.raises(AssertionError, match="16-byte aligned"):
        ws_gemm._desc(t[1:512 * 256 + 1], (512, 256), (64, 128))


def test_interpreting_reads_the_environment_at_call_time(monkeypatch):
    from titan_megamoe.kernels import jit

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert jit.interpreting()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not jit.interpreting()
    monkeypatch.delenv("TRITON_INTERPRET")
    assert not jit.interpreting()


def test_gemm1_dgrad_switch_falls_back_to_triton_where_ws_cannot_run(monkeypatch):
    """With the switch on, a case the Gluon kernel does not take (here: no GPU, D below its minimum) runs the
    Triton kernel."""
    if torch.cuda.is_available():
        pytest.skip("runs the Triton interpreter on CPU tensors (CPU machines; the GPU cases below cover the GPU)")
    from titan_megamoe.kernels import grouped_gemm_bwd as B
    from titan_megamoe.kernels.routing import build_routing_layout_torch

    g = torch.Generator().manual_seed(0)
    T, K, E, D, F = 40, 2, 4, 32, 32
    lay = build_routing_layout_torch(torch.randint(0, E, (T, K), generator=g), E, 16)
    dgu = torch.randn(lay.n_cap, 2 * F, generator=g).bfloat16()
    w1, w3 = torch.randn(E, F, D, generator=g).bfloat16(), torch.randn(E, F, D, generator=g).bfloat16()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(B, "WS_GEMM1_DGRAD", "0")
    ref = B.gemm1_dgrad(dgu, w1, w3, lay)
    monkeypatch.setattr(B, "WS_GEMM1_DGRAD", "coop")
    got = B.gemm1_dgrad(dgu, w1, w3, lay)
    n = int(lay.offsets[-1])
    assert torch.equal(got[:n], ref[:n])


def test_gemm2_dgrad_switch_falls_back_to_triton_where_ws_cannot_run(monkeypatch):
    """With WS_GEMM2_DGRAD on, a case the Gluon kernel does not take (no GPU, D below its minimum) runs the Triton
    kernel, with its outputs."""
    if torch.cuda.is_available():
        pytest.skip("runs the Triton interpreter on CPU tensors (CPU machines; the GPU cases below cover the GPU)")
    from titan_megamoe.kernels import grouped_gemm_bwd as B
    from titan_megamoe.kernels.routing import build_routing_layout_torch

    g = torch.Generator().manual_seed(1)
    T, K, E, D, F = 40, 2, 4, 32, 32
    lay = build_routing_layout_torch(torch.randint(0, E, (T, K), generator=g), E, 16)
    dout = torch.randn(T, D, generator=g).bfloat16()
    w2 = torch.randn(E, D, F, generator=g).bfloat16()
    gu = torch.randn(lay.n_cap, 2 * F, generator=g).bfloat16()
    sc = torch.rand(T, K, generator=g)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    outs = []
    for on in (False, True):
        monkeypatch.setattr(B, "WS_GEMM2_DGRAD", on)
        hs = torch.empty(lay.n_cap, F, dtype=torch.bfloat16)
        outs.append((*B.gemm2_dgrad_swiglu_bwd(dout, w2, gu, sc, lay, hs_out=hs), hs))
    n = int(lay.offsets[-1])
    for a, b in zip(*outs):
        assert torch.equal(a[:n], b[:n])


def _g2d_reference(dout, w2, gu, sc, lay):
    """fp32 GEMM2 dgrad + SwiGLU backward from the definitions: (dgate_up, hs, dscore per row)."""
    n = int(lay.offsets[-1])
    K, F = lay.top_k, w2.shape[2]
    pair = lay.row_pair[:n].long()
    valid = pair >= 0
    tok = pair.clamp_min(0) // K
    g = torch.zeros(n, F, device=dout.device)
    off = lay.offsets.tolist()
    for e in range(w2.shape[0]):
        a, b = off[e], off[e + 1]
        g[a:b] = dout[tok[a:b]].float() @ w2[e].float()
    g[~valid] = 0
    s = (sc.reshape(-1)[pair.clamp_min(0)] * valid)[:, None]
    gate, up = gu[:n, :F].float(), gu[:n, F:].float()
    sig = torch.sigmoid(gate)
    silu = gate * sig
    h = (silu * up).bfloat16().float()
    dh = g * s
    dgu = torch.cat([dh * up * sig * (1 + gate * (1 - sig)), dh * silu], 1)
    return dgu, silu * up * s, (g * h).sum(1)


@pytest.mark.cuda
@pytest.mark.parametrize("case", [
    (4096, 16, 4, 512, 256, "uniform"), (1000, 8, 1, 256, 128, "uniform"), (3000, 32, 4, 384, 256, "zero_expert"),
    (2048, 16, 2, 256, 384, "one_expert"), (16384, 128, 8, 2048, 768, "uniform"),
], ids=["uniform", "top1-odd-T", "zero-expert", "one-expert", "30b"])
@pytest.mark.parametrize("split", [False, True], ids=["m64n128", "split-m64n64"])
def test_ws_gemm2_dgrad_matches_triton_and_fp32_on_gpu(case, split):
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs an sm_90 GPU")
    from titan_megamoe import switches
    from titan_megamoe.kernels.grouped_gemm_bwd import gemm2_dgrad_swiglu_bwd
    from titan_megamoe.kernels.routing import build_routing_layout
    from titan_megamoe.kernels.ws_gemm import G2D_CONFIG, G2D_SPLIT_CONFIG, ws_gemm2_dgrad
    from titan_megamoe.testing import make_routing, rel_err

    T, E, K, D, F, routing = case
    g = torch.Generator(device="cuda").manual_seed(5)
    lay = build_routing_layout(make_routing(routing, T, E, K, seed=5).cuda(), E, 128)
    dout = torch.randn(T, D, device="cuda", generator=g).bfloat16()
    w2 = (torch.randn(E, D, F, device="cuda", generator=g) / D ** 0.5).bfloat16()
    gu = torch.randn(lay.n_cap, 2 * F, device="cuda", generator=g).bfloat16()
    n = int(lay.offsets[-1])
    gu[:n][lay.row_pair[:n] < 0] = 0  # the forward's padding rows
    sc = torch.rand(T, K, device="cuda", generator=g)
    nan = lambda *shape, dt=torch.bfloat16: torch.full(shape, float("nan"), device="cuda", dtype=dt)  # noqa: E731
    out = (nan(lay.n_cap, 2 * F), nan(lay.n_cap, F // 128, dt=torch.float32))
    hs = nan(lay.n_cap, F)
    ws_gemm2_dgrad(dout, w2, gu, sc, lay, out=out, hs_out=hs, cfg=G2D_SPLIT_CONFIG if split else G2D_CONFIG)
    with switches.override({"TITAN_MEGAMOE_WS_GEMM2_DGRAD": "0"}):  # the Triton kernel
        ths = torch.empty_like(hs)
        tdgu, tpart = gemm2_dgrad_swiglu_bwd(dout, w2, gu, sc, lay, hs_out=ths)
    dgu, part = out
    valid = lay.row_pair[:n] >= 0
    for t in (dgu, part, hs):
        assert not torch.isnan(t[:n]).any(), "live rows left unwritten"
        assert (t[:n][~valid] == 0).all(), "padding rows must be zero"
    rdgu, rhs, rdscore = _g2d_reference(dout, w2, gu, sc, lay)
    assert rel_err(dgu[:n], rdgu) < 1e-2 and rel_err(hs[:n], rhs) < 1e-2
    assert rel_err(part[:n].sum(1), rdscore) < 1e-2
    assert rel_err(dgu[:n], tdgu[:n]) < 1e-2 and rel_err(hs[:n], ths[:n]) < 1e-2
    assert rel_err(part[:n].sum(1), tpart[:n].sum(1)) < 1e-3
    print(f"gemm2 dgrad {case[-1]} split={split}: bitwise the Triton kernel's dgate_up {torch.equal(dgu[:n], tdgu[:n])}, "
          f"hs {torch.equal(hs[:n], ths[:n])}")


#: The counter schedule is fenced off (``ws_gemm.DYNAMIC_FENCED``: it hung before session 33's fix, then passed these
#: tests on an H100 in session 37 and measured no faster): its GPU tests run only when asked for
#: (``TITAN_MEGAMOE_TEST_DYNAMIC=1``, under a kill timeout).
_DYNAMIC_DEBUG = os.environ.get("TITAN_MEGAMOE_TEST_DYNAMIC") == "1"
_DYNAMIC_SKIP = pytest.mark.skipif(not _DYNAMIC_DEBUG, reason="the counter schedule is fenced off (no gain measured, "
                                   "session 37); TITAN_MEGAMOE_TEST_DYNAMIC=1 runs these tests")


def _unfence(monkeypatch):
    from titan_megamoe.kernels import ws_gemm

    monkeypatch.setattr(ws_gemm, "DYNAMIC_FENCED", False)


def _check_dynamic(run, outs, cfg, n, kernel):
    """Tiles from the launch's counter (``WsConfig.dynamic``, ``WS_GEMM1_DYNAMIC``) give ``outs``' bits: with the SM
    count of programs, with 3 (many tiles each) and in the expert order, each twice into NaN-poisoned outputs (the
    first launch must leave the counter at zero for the second), and the counter is zero at the end."""
    from titan_megamoe.kernels import ws_gemm

    for c, programs in ((dataclasses.replace(cfg, dynamic=True), None), (dataclasses.replace(cfg, dynamic=True), 3),
                        (dataclasses.replace(cfg, dynamic=True, group_m=0), None)):
        for rep in range(2):
            got = tuple(torch.full_like(o, float("nan")) for o in outs)
            run(got, c, programs)
            for o, g in zip(outs, got):
                assert torch.equal(o[:n], g[:n]), f"{c} with {programs} programs, launch {rep}: not the same bits"
    assert int(ws_gemm._tile_counter(outs[0].device, kernel).item()) == 0, "the counter was not left at zero"


def _gpu_case(T, E, K, D, F, routing, cfg, seed):
    from titan_megamoe.kernels._bwd_common import default_bwd_config
    from titan_megamoe.kernels.grouped_gemm_bwd import gemm1_dgrad
    from titan_megamoe.kernels.routing import build_routing_layout
    from titan_megamoe.kernels.ws_gemm import ws_gemm1_dgrad
    from titan_megamoe.testing import make_routing, rel_err

    g = torch.Generator(device="cuda").manual_seed(seed)
    lay = build_routing_layout(make_routing(routing, T, E, K, seed=seed).cuda(), E, 128)
    dgu = torch.randn(lay.n_cap, 2 * F, device="cuda", generator=g).bfloat16()
    w1 = (torch.randn(E, F, D, device="cuda", generator=g) / F ** 0.5).bfloat16()
    w3 = (torch.randn(E, F, D, device="cuda", generator=g) / F ** 0.5).bfloat16()
    out = torch.full((lay.n_cap, D), float("nan"), device="cuda", dtype=torch.bfloat16)
    ws_gemm1_dgrad(dgu, w1, w3, lay, out=out, cfg=cfg)
    # an explicit config: the Triton kernel (without one, D >= 2048 on sm_90 dispatches to the Gluon default)
    tri = gemm1_dgrad(dgu, w1, w3, lay, default_bwd_config("gemm1_dgrad", lay, D, F))
    n = int(lay.offsets[-1])
    off = lay.offsets.tolist()
    ref = torch.zeros(n, D, device="cuda")
    for e in range(E):
        a, b = off[e], off[e + 1]
        ref[a:b] = dgu[a:b, :F].float() @ w1[e].float() + dgu[a:b, F:].float() @ w3[e].float()
    valid = lay.row_pair[:n] >= 0
    ref[~valid] = 0
    assert not torch.isnan(out[:n]).any(), "live rows left unwritten"
    assert (out[:n][~valid] == 0).all(), "padding rows must be zero"
    assert rel_err(out[:n], ref) < 1e-2
    assert torch.equal(out[:n], tri[:n]), "not bitwise the Triton kernel (same K order, fp32 accumulation)"
    if cfg.coop:  # skip_empty (opt-in): the MMAs it leaves out were on zero-weighted padding rows only
        skip = ws_gemm1_dgrad(dgu, w1, w3, lay, cfg=dataclasses.replace(cfg, skip_empty=True))
        assert torch.equal(out[:n], skip[:n]), "skip_empty changed the result"
        # one program per tile (WS_GEMM1_GRID's launch), into a poisoned output: the same tiles, the same bits
        grid = torch.full_like(out, float("nan"))
        ws_gemm1_dgrad(dgu, w1, w3, lay, out=grid, cfg=cfg, programs=lay.n_tiles_cap * -(-D // cfg.block_n))
        assert torch.equal(out[:n], grid[:n]), "one program per tile changed the result"
    expert = torch.full_like(out, float("nan"))  # the expert-major tile order (WS_GEMM1_EXPERT_ORDER)
    ws_gemm1_dgrad(dgu, w1, w3, lay, out=expert, cfg=dataclasses.replace(cfg, group_m=0))
    assert torch.equal(out[:n], expert[:n]), "the expert-major tile order changed the result"


@pytest.mark.cuda
@pytest.mark.parametrize("config", ["pingpong", "coop", "split"])
@pytest.mark.parametrize("case", [
    (4096, 16, 4, 512, 256, "uniform"), (1000, 8, 1, 256, 128, "uniform"), (3000, 32, 4, 384, 192, "zero_expert"),
    (2048, 16, 2, 256, 256, "one_expert"), (2000, 8, 2, 200, 128, "skewed"), (16384, 128, 8, 2048, 768, "uniform"),
], ids=["uniform", "top1-odd-T", "zero-expert", "one-expert", "odd-D", "30b"])
def test_ws_gemm1_dgrad_matches_triton_and_fp32_on_gpu(config, case):
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs an sm_90 GPU")
    from titan_megamoe.kernels.ws_gemm import CONFIGS

    _gpu_case(*case, CONFIGS[config], seed=7)


@pytest.mark.cuda
@pytest.mark.parametrize("case", [
    (4096, 16, 4, 512, 256, "uniform"), (1000, 8, 1, 256, 128, "uniform"), (3000, 32, 4, 384, 256, "zero_expert"),
    (2048, 16, 2, 256, 256, "one_expert"), (16384, 128, 8, 2048, 768, "uniform"),
], ids=["uniform", "top1-odd-T", "zero-expert", "one-expert", "30b"])
def test_ws_gemm1_fwd_matches_triton_on_gpu(case):
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs an sm_90 GPU")
    from titan_megamoe import switches
    from titan_megamoe.kernels.grouped_gemm import gemm1_swiglu_fwd
    from titan_megamoe.kernels.routing import build_routing_layout
    from titan_megamoe.kernels.ws_gemm import ws_gemm1_fwd
    from titan_megamoe.testing import make_routing, rel_err

    T, E, K, D, F, routing = case
    g = torch.Generator(device="cuda").manual_seed(3)
    lay = build_routing_layout(make_routing(routing, T, E, K, seed=3).cuda(), E, 128)
    x = torch.randn(T, D, device="cuda", generator=g).bfloat16()
    w1 = (torch.randn(E, F, D, device="cuda", generator=g) / D ** 0.5).bfloat16()
    w3 = (torch.randn(E, F, D, device="cuda", generator=g) / D ** 0.5).bfloat16()
    gu = torch.full((lay.n_cap, 2 * F), float("nan"), device="cuda", dtype=torch.bfloat16)
    h = torch.full((lay.n_cap, F), float("nan"), device="cuda", dtype=torch.bfloat16)
    ws_gemm1_fwd(x, w1, w3, lay, gate_up_out=gu, h_out=h)
    with switches.override({"TITAN_MEGAMOE_WS_GEMM1": "0"}):  # the Triton kernel (the default is the Gluon one)
        tgu, th = gemm1_swiglu_fwd(x, w1, w3, lay)
    n = int(lay.offsets[-1])
    valid = lay.row_pair[:n] >= 0
    assert not torch.isnan(gu[:n]).any() and not torch.isnan(h[:n]).any(), "live rows left unwritten"
    assert (gu[:n][~valid] == 0).all() and (h[:n][~valid] == 0).all(), "padding rows must be zero"
    assert rel_err(gu[:n], tgu[:n]) < 1e-2 and rel_err(h[:n], th[:n]) < 1e-2
    # skip_empty (opt-in): a consumer whose 64 rows are all padding issues no MMA; the same bits as with them
    from titan_megamoe.kernels.ws_gemm import FWD_CONFIG
    fgu, fh = ws_gemm1_fwd(x, w1, w3, lay, cfg=dataclasses.replace(FWD_CONFIG, skip_empty=True))
    assert torch.equal(gu[:n], fgu[:n]) and torch.equal(h[:n], fh[:n]), "skip_empty changed the result"
    ggu, gh = torch.full_like(gu, float("nan")), torch.full_like(h, float("nan"))  # one program per tile
    ws_gemm1_fwd(x, w1, w3, lay, gate_up_out=ggu, h_out=gh, programs=lay.n_tiles_cap * (F // FWD_CONFIG.block_n))
    assert torch.equal(gu[:n], ggu[:n]) and torch.equal(h[:n], gh[:n]), "one program per tile changed the result"
    egu, eh = torch.full_like(gu, float("nan")), torch.full_like(h, float("nan"))  # expert-major tile order
    ws_gemm1_fwd(x, w1, w3, lay, gate_up_out=egu, h_out=eh, cfg=dataclasses.replace(FWD_CONFIG, group_m=0))
    assert torch.equal(gu[:n], egu[:n]) and torch.equal(h[:n], eh[:n]), "the expert-major tile order changed the result"


DYNAMIC_CASES = [(4096, 16, 4, 512, 256, "uniform"), (1000, 8, 1, 256, 128, "uniform"),
                 (3000, 32, 4, 384, 256, "zero_expert"), (2048, 16, 2, 256, 256, "one_expert"),
                 (16384, 128, 8, 2048, 768, "uniform")]
DYNAMIC_IDS = ["uniform", "top1-odd-T", "zero-expert", "one-expert", "30b"]


@pytest.mark.cuda
@_DYNAMIC_SKIP
@pytest.mark.parametrize("config", ["coop", "split"])
@pytest.mark.parametrize("case", DYNAMIC_CASES, ids=DYNAMIC_IDS)
def test_ws_gemm1_dgrad_dynamic_schedule_on_gpu(config, case, monkeypatch):
    """Separate from the tests above so a GPU run can take it last (a hang in the counter hand-off would stall it)."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs an sm_90 GPU")
    _unfence(monkeypatch)
    from titan_megamoe.kernels.routing import build_routing_layout
    from titan_megamoe.kernels.ws_gemm import CONFIGS, ws_gemm1_dgrad
    from titan_megamoe.testing import make_routing

    T, E, K, D, F, routing = case
    g = torch.Generator(device="cuda").manual_seed(13)
    lay = build_routing_layout(make_routing(routing, T, E, K, seed=13).cuda(), E, 128)
    dgu = torch.randn(lay.n_cap, 2 * F, device="cuda", generator=g).bfloat16()
    w1 = (torch.randn(E, F, D, device="cuda", generator=g) / F ** 0.5).bfloat16()
    w3 = (torch.randn(E, F, D, device="cuda", generator=g) / F ** 0.5).bfloat16()
    cfg = CONFIGS[config]
    out = ws_gemm1_dgrad(dgu, w1, w3, lay, cfg=cfg)  # the static schedule (bitwise the Triton kernel, tested above)
    _check_dynamic(lambda o, c, programs: ws_gemm1_dgrad(dgu, w1, w3, lay, out=o[0], cfg=c, programs=programs),
                   (out,), cfg, int(lay.offsets[-1]), "gemm1_dgrad")


@pytest.mark.cuda
@_DYNAMIC_SKIP
@pytest.mark.parametrize("case", DYNAMIC_CASES, ids=DYNAMIC_IDS)
def test_ws_gemm1_fwd_dynamic_schedule_on_gpu(case, monkeypatch):
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs an sm_90 GPU")
    _unfence(monkeypatch)
    from titan_megamoe.kernels.routing import build_routing_layout
    from titan_megamoe.kernels.ws_gemm import FWD_CONFIG, ws_gemm1_fwd
    from titan_megamoe.testing import make_routing

    T, E, K, D, F, routing = case
    g = torch.Generator(device="cuda").manual_seed(17)
    lay = build_routing_layout(make_routing(routing, T, E, K, seed=17).cuda(), E, 128)
    x = torch.randn(T, D, device="cuda", generator=g).bfloat16()
    w1 = (torch.randn(E, F, D, device="cuda", generator=g) / D ** 0.5).bfloat16()
    w3 = (torch.randn(E, F, D, device="cuda", generator=g) / D ** 0.5).bfloat16()
    gu, h = ws_gemm1_fwd(x, w1, w3, lay)
    _check_dynamic(lambda o, c, programs: ws_gemm1_fwd(x, w1, w3, lay, gate_up_out=o[0], h_out=o[1], cfg=c,
                                                       programs=programs), (gu, h), FWD_CONFIG,
                   int(lay.offsets[-1]), "gemm1_fwd")


@pytest.mark.cuda
@_DYNAMIC_SKIP
def test_ws_gemm1_dgrad_dynamic_schedule_replays_in_a_cuda_graph_on_gpu(monkeypatch):
    """A captured launch of the counter schedule gets its own zeroed counter (its fill captured with it) and
    leaves it at zero: three replays give the eager launch's bits."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs an sm_90 GPU")
    _unfence(monkeypatch)
    from titan_megamoe.kernels.routing import build_routing_layout
    from titan_megamoe.kernels.ws_gemm import CONFIGS, ws_gemm1_dgrad
    from titan_megamoe.testing import make_routing

    T, E, K, D, F = 4096, 16, 4, 512, 256
    g = torch.Generator(device="cuda").manual_seed(11)
    lay = build_routing_layout(make_routing("uniform", T, E, K, seed=11).cuda(), E, 128)
    dgu = torch.randn(lay.n_cap, 2 * F, device="cuda", generator=g).bfloat16()
    w1 = (torch.randn(E, F, D, device="cuda", generator=g) / F ** 0.5).bfloat16()
    w3 = (torch.randn(E, F, D, device="cuda", generator=g) / F ** 0.5).bfloat16()
    cfg = dataclasses.replace(CONFIGS["coop"], dynamic=True)
    ref = ws_gemm1_dgrad(dgu, w1, w3, lay, cfg=dataclasses.replace(cfg, dynamic=False))
    out = torch.full_like(ref, float("nan"))
    ws_gemm1_dgrad(dgu, w1, w3, lay, out=out, cfg=cfg)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ws_gemm1_dgrad(dgu, w1, w3, lay, out=out, cfg=cfg)
    n = int(lay.offsets[-1])
    for _ in range(3):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out[:n], ref[:n])


if __name__ == "__main__":
    if sys.argv[1:2] == ["compile-sm90"]:
        print(json.dumps(_compile_sm90_all()))
    else:
        raise SystemExit("usage: python tests/test_ws_gemm.py compile-sm90")
