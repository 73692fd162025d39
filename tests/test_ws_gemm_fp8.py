"""The warp-specialized blockwise-FP8 GEMM1 (kernels/ws_gemm_fp8.py): sm_90a builds on the CPU machine (registers,
shared memory, wgmma count and waits, no wgmma serialization by ptxas), its host-side errors, the opt-in switch's
wiring in the FP8 forward, and on a GPU its results against the Triton FP8 kernel and an fp32 reference of the
dequantized operands."""

import dataclasses
import json
import re
import sys

import pytest
import torch

from _sm90 import sm90_result  # noqa: E402

SHAPES = {"30b": (2048, 768), "235b": (4096, 1536)}


def _compile_sm90_all() -> list[dict]:
    from titan_megamoe.kernels import ws_gemm_fp8 as W
    from titan_megamoe.kernels.sm90_check import compile_sm90

    out = []
    for shape, (D, F) in SHAPES.items():
        cfg = W.FP8_FWD_CONFIG
        sig, cx = W.sm90_compile_args_fp8(cfg, D, F)
        r = compile_sm90(W._gemm1_fwd_fp8_ws_kernel, sig, cx, num_warps=4, num_stages=1, maxnreg=cfg.maxnreg)
        out.append(dict(label=f"fwd_fp8_{shape}", **r))
        cfg = W.DGRAD_FP8_CONFIG
        sig, cx = W.sm90_compile_args_dgrad_fp8(cfg, D, F)
        r = compile_sm90(W._gemm1_dgrad_fp8_ws_kernel, sig, cx, num_warps=4, num_stages=1, maxnreg=cfg.maxnreg)
        out.append(dict(label=f"dgrad_fp8_{shape}", **r))
        cfg = W.GEMM2_FP8_CONFIG
        sig, cx = W.sm90_compile_args_gemm2_fp8(cfg, D, F)
        r = compile_sm90(W._gemm2_fwd_fp8_ws_kernel, sig, cx, num_warps=4, num_stages=1, maxnreg=cfg.maxnreg)
        out.append(dict(label=f"gemm2_fp8_{shape}", **r))
        cfg = W.FP8_FWD_WIDE_CONFIG
        sig, cx = W.sm90_compile_args_fp8(cfg, D, F)
        r = compile_sm90(W._gemm1_fwd_fp8_ws_kernel, sig, cx, num_warps=4, num_stages=1, maxnreg=cfg.maxnreg)
        out.append(dict(label=f"fwd_fp8_wide_{shape}", **r))
    # the wide GEMM1 dgrad / GEMM2 tiles and the ordered consumers (Fp8WsConfig.ordered), 30B only
    D, F = SHAPES["30b"]
    for name, cfg, args, kernel in (
            ("dgrad_fp8_wide", W.DGRAD_FP8_WIDE_CONFIG, W.sm90_compile_args_dgrad_fp8, W._gemm1_dgrad_fp8_ws_kernel),
            ("gemm2_fp8_wide", W.GEMM2_FP8_WIDE_CONFIG, W.sm90_compile_args_gemm2_fp8, W._gemm2_fwd_fp8_ws_kernel)):
        sig, cx = args(cfg, D, F)
        r = compile_sm90(kernel, sig, cx, num_warps=4, num_stages=1, maxnreg=cfg.maxnreg)
        out.append(dict(label=f"{name}_30b", **r))
    for shape, (D2, F2) in SHAPES.items():  # h quantized in the wide tiles' epilogue (FP8_GEMM1_QUANT_H)
        cfg = W.FP8_FWD_WIDE_CONFIG
        sig, cx = W.sm90_compile_args_fp8(cfg, D2, F2, quant_h=True)
        r = compile_sm90(W._gemm1_fwd_fp8_ws_kernel, sig, cx, num_warps=4, num_stages=1, maxnreg=cfg.maxnreg)
        out.append(dict(label=f"fwd_fp8_wide_quant_h_{shape}", **r))
    for name, base, args, kernel in _kernels(W):
        cfg = dataclasses.replace(base, ordered=True)
        sig, cx = args(cfg, D, F)
        r = compile_sm90(kernel, sig, cx, num_warps=4, num_stages=1, maxnreg=cfg.maxnreg)
        out.append(dict(label=f"{name}_ordered_30b", **r))
    return out


def _kernels(W):
    """(label prefix, default config, compile-args function, kernel) of the three kernels."""
    return [("fwd_fp8", W.FP8_FWD_CONFIG, W.sm90_compile_args_fp8, W._gemm1_fwd_fp8_ws_kernel),
            ("dgrad_fp8", W.DGRAD_FP8_CONFIG, W.sm90_compile_args_dgrad_fp8, W._gemm1_dgrad_fp8_ws_kernel),
            ("gemm2_fp8", W.GEMM2_FP8_CONFIG, W.sm90_compile_args_gemm2_fp8, W._gemm2_fwd_fp8_ws_kernel)]


@pytest.mark.parametrize("name,k_loops", [("fwd_fp8", 1), ("dgrad_fp8", 2), ("gemm2_fp8", 1)])
def test_ordered_consumers_build_with_one_turn_handoff_per_k_loop(name, k_loops):
    """``ordered=True``: the same MMAs and waits, no spills, no wgmma serialization, and per consumer one more
    mbarrier arrive per K loop (the turn handed to the other consumer); the default build has none of them."""
    plain = sm90_result(__file__, f"{name}_30b")
    r = sm90_result(__file__, f"{name}_ordered_30b")
    assert r["wgmma"] == plain["wgmma"] and r["wgmma_waits"] == plain["wgmma_waits"], r
    assert r["mbarrier_arrive"] == plain["mbarrier_arrive"] + 2 * k_loops, (r["mbarrier_arrive"],
                                                                            plain["mbarrier_arrive"])
    assert "STACK:0" in r["usage"] and "REG:168" in r["usage"], r["usage"]
    assert r["wgmma_serialized"] == "", r["wgmma_serialized"]


def test_ordered_switch_reaches_launches_without_an_explicit_choice():
    """``TITAN_MEGAMOE_FP8_ORDERED_MMA`` decides for configs whose ``ordered`` is None (the defaults); an explicit
    True / False wins."""
    from titan_megamoe import switches
    from titan_megamoe.kernels import ws_gemm_fp8 as W

    assert W.FP8_FWD_CONFIG.ordered is None and W.DGRAD_FP8_CONFIG.ordered is None
    assert W.GEMM2_FP8_CONFIG.ordered is None
    on, off = dataclasses.replace(W.FP8_FWD_CONFIG, ordered=True), dataclasses.replace(W.FP8_FWD_CONFIG, ordered=False)
    for value in ("0", "1"):
        with switches.override({"TITAN_MEGAMOE_FP8_ORDERED_MMA": value}):
            assert W._ordered(W.FP8_FWD_CONFIG) is (value == "1")
            assert W._ordered(on) is True and W._ordered(off) is False
    assert W._ordered(W.DGRAD_FP8_CONFIG) is False  # default off


@pytest.mark.parametrize("label", ["fwd_fp8_30b", "fwd_fp8_235b"])
def test_ws_gemm1_fwd_fp8_builds_for_sm90a_without_spills_or_wgmma_serialization(label):
    from titan_megamoe.kernels.sm90_check import HOPPER_SMEM_BYTES
    from titan_megamoe.kernels.ws_gemm_fp8 import FP8_FWD_CONFIG

    r = sm90_result(__file__, label)
    assert r["target"], "PTX not built for sm_90a"
    assert r["wgmma"] == 16, r  # two consumers x (gate, up) x 4 k32 steps of m64n64 e4m3
    # per consumer and K block: wait for the gate partial with the up one in flight (1), then for the up one (0)
    assert r["wgmma_waits"] == ["1", "0", "1", "0"], r["wgmma_waits"]
    assert r["cp_async"] > 0 and r["tma"] > 0, "gathered rows by cp.async, weights by TMA"
    assert 0 < r["shared"] <= HOPPER_SMEM_BYTES, r["shared"]
    assert r["shared"] >= FP8_FWD_CONFIG.smem_bytes(), (r["shared"], FP8_FWD_CONFIG.smem_bytes())
    assert "STACK:0" in r["usage"] and "REG:168" in r["usage"], r["usage"]  # the cap, no spills
    assert r["wgmma_serialized"] == "", r["wgmma_serialized"]


@pytest.mark.parametrize("label", ["fwd_fp8_wide_30b", "fwd_fp8_wide_235b"])
def test_ws_gemm1_fwd_fp8_wide_tiles_build_for_sm90a_with_bounded_spills(label):
    """``FP8_FWD_WIDE_CONFIG``: four MMAs per consumer and K step, each partial scaled under the next MMA (waits 1, 1,
    1, 0), no wgmma serialization; six 64 x 64 fp32 tiles per consumer thread leave a few spilled scalars (48 bytes
    at 232 consumer registers in session 36's build, 104 at 216), bounded here."""
    from titan_megamoe.kernels.sm90_check import HOPPER_SMEM_BYTES
    from titan_megamoe.kernels.ws_gemm_fp8 import FP8_FWD_WIDE_CONFIG

    r = sm90_result(__file__, label)
    assert r["target"] and r["wgmma"] == 32, r  # two consumers x four 64-column chunks x 4 k32 steps
    assert r["wgmma_waits"] == ["1", "1", "1", "0"] * 2, r["wgmma_waits"]
    assert FP8_FWD_WIDE_CONFIG.smem_bytes() <= r["shared"] <= HOPPER_SMEM_BYTES, r["shared"]
    stack = int(re.search(r"STACK:(\d+)", r["usage"]).group(1))
    assert "REG:168" in r["usage"] and stack <= 128, r["usage"]
    assert r["wgmma_serialized"] == "", r["wgmma_serialized"]


@pytest.mark.parametrize("label", ["dgrad_fp8_30b", "dgrad_fp8_235b"])
def test_ws_gemm1_dgrad_fp8_builds_for_sm90a_without_spills_or_wgmma_serialization(label):
    from titan_megamoe.kernels.sm90_check import HOPPER_SMEM_BYTES

    r = sm90_result(__file__, label)
    assert r["target"], "PTX not built for sm_90a"
    assert r["wgmma"] == 32, r  # two consumers x two halves of 2F x (lo, hi) x 4 k32 steps of m64n64
    assert r["wgmma_waits"] == ["1", "0"] * 4, r["wgmma_waits"]  # the lo partial scaled under the hi MMA
    assert r["tma"] > 0 and r["cp_async"] == 0, "both operands by TMA"
    assert 0 < r["shared"] <= HOPPER_SMEM_BYTES, r["shared"]
    assert "STACK:0" in r["usage"] and "REG:168" in r["usage"], r["usage"]
    assert r["wgmma_serialized"] == "", r["wgmma_serialized"]


@pytest.mark.parametrize("label", ["gemm2_fp8_30b", "gemm2_fp8_235b"])
def test_ws_gemm2_fwd_fp8_builds_for_sm90a_without_spills_or_wgmma_serialization(label):
    from titan_megamoe.kernels.sm90_check import HOPPER_SMEM_BYTES

    r = sm90_result(__file__, label)
    assert r["target"], "PTX not built for sm_90a"
    assert r["wgmma"] == 16, r  # two consumers x (lo, hi) x 4 k32 steps of m64n64: one K segment
    assert r["wgmma_waits"] == ["1", "0"] * 2, r["wgmma_waits"]  # the lo partial scaled under the hi MMA
    assert r["tma"] > 0 and r["cp_async"] == 0, "both operands by TMA"
    assert 0 < r["shared"] <= HOPPER_SMEM_BYTES, r["shared"]
    assert "STACK:0" in r["usage"] and "REG:168" in r["usage"], r["usage"]
    assert r["wgmma_serialized"] == "", r["wgmma_serialized"]


@pytest.mark.parametrize("label", ["dgrad_fp8_wide_30b", "gemm2_fp8_wide_30b"])
def test_ws_gemm1_dgrad_and_gemm2_fp8_wide_tiles_build_for_sm90a_without_spills_in_the_k_loop(label):
    """``DGRAD_FP8_WIDE_CONFIG`` / ``GEMM2_FP8_WIDE_CONFIG``: four 64-column chunks per consumer and K step, each
    partial scaled under the next MMA (waits 1, 1, 1, 0), both operands by TMA, no wgmma serialization. Six 64 x 64
    fp32 tiles per consumer thread sit at the register cap: the dgrad's two K halves run as one loop with one selected
    weight scale pointer (two unrolled loops, or two masked scale loads, spilled accumulators in the K loop: session
    37's SASS); the few spilled scalars left (8 bytes in that build) lie outside the K loops."""
    from titan_megamoe.kernels.sm90_check import HOPPER_SMEM_BYTES

    r = sm90_result(__file__, label)
    assert r["target"] and r["wgmma"] == 32, r  # two consumers x four chunks x 4 k32 steps, in one K loop
    assert r["wgmma_waits"] == ["1", "1", "1", "0"] * 2, r["wgmma_waits"]
    assert r["tma"] > 0 and r["cp_async"] == 0, "both operands by TMA"
    assert 4 * (128 + 256) * 128 <= r["shared"] <= HOPPER_SMEM_BYTES, r["shared"]  # 4 stages of 48 KiB
    stack = int(re.search(r"STACK:(\d+)", r["usage"]).group(1))
    assert "REG:168" in r["usage"] and stack <= 16, r["usage"]
    assert r["mma_loop_spills"] in (None, [0, 0]), r["mma_loop_spills"]  # one K loop per consumer, no spill in it
    assert r["wgmma_serialized"] == "", r["wgmma_serialized"]


@pytest.mark.parametrize("shape", ["30b", "235b"])
def test_h_quantized_in_the_gemm1_epilogue_builds_for_sm90a_with_the_same_k_loop(shape):
    """``quantize_h`` (FP8_GEMM1_QUANT_H, on the wide tiles): the same K loop as the bf16-h build (wgmma count, waits,
    no serialization, no spill in it), the same TMA copies (the two e4m3 h chunks through the bf16 staging tile,
    reinterpreted), one atomic per consumer (the non-finite count) and the same shared memory."""
    r, b = sm90_result(__file__, f"fwd_fp8_wide_quant_h_{shape}"), sm90_result(__file__, f"fwd_fp8_wide_{shape}")
    assert r["target"] and r["wgmma"] == b["wgmma"] and r["wgmma_waits"] == b["wgmma_waits"], r
    assert r["wgmma_serialized"] == "", r["wgmma_serialized"]
    assert r["tma"] == b["tma"] and r["cp_async"] == b["cp_async"], (r["tma"], b["tma"])
    assert r["atomics"] == 2 and b["atomics"] == 0, (r["atomics"], b["atomics"])
    assert abs(r["shared"] - b["shared"]) <= 64, (r["shared"], b["shared"])
    assert r["mma_loop_spills"] is None or r["mma_loop_spills"] in ([0, 0], [2, 0], [0, 2]), r["mma_loop_spills"]
    stack = int(re.search(r"STACK:(\d+)", r["usage"]).group(1))
    assert "REG:168" in r["usage"] and stack <= int(re.search(r"STACK:(\d+)", b["usage"]).group(1)), r["usage"]


def _fp8_operands(T, E, K, D, F, routing, seed, device):
    from titan_megamoe.kernels.routing import build_routing_layout
    from titan_megamoe.ops import fp8_reference as R
    from titan_megamoe.testing import make_routing

    g = torch.Generator(device=device).manual_seed(seed)
    lay = build_routing_layout(make_routing(routing, T, E, K, seed=seed).to(device), E, 128)
    x = torch.randn(T, D, device=device, generator=g).bfloat16()
    w1 = (torch.randn(E, F, D, device=device, generator=g) / D ** 0.5).bfloat16()
    w3 = (torch.randn(E, F, D, device=device, generator=g) / D ** 0.5).bfloat16()
    xq, xs = R.quantize_act_1x128(x)
    w1q, w1s = R.quantize_weight_128x128(w1)
    w3q, w3s = R.quantize_weight_128x128(w3)
    return lay, xq, xs, w1q, w1s, w3q, w3s


def test_ws_gemm1_fwd_fp8_refuses_what_it_cannot_take(monkeypatch):
    from titan_megamoe.kernels import ws_gemm_fp8 as W

    lay, xq, xs, w1q, w1s, w3q, w3s = _fp8_operands(40, 4, 2, 256, 128, "uniform", 0, "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="ws_gemm1_fwd_fp8: .*(sm_90|Gluon|Triton)"):
            W.ws_gemm1_fwd_fp8(xq, xs, w1q, w1s, w3q, w3s, lay)
    monkeypatch.setattr(W, "_platform_reason", lambda t: None)  # past the platform: the shape checks
    assert W.ws_gemm1_fwd_fp8_supported(xq, w1q) is None
    assert "F % 128 == 0" in W.ws_gemm1_fwd_fp8_supported(xq, w1q[:, :64])
    with pytest.raises(ValueError, match="x_scale must be a contiguous torch.float32"):
        W.ws_gemm1_fwd_fp8(xq, xs.bfloat16(), w1q, w1s, w3q, w3s, lay)
    with pytest.raises(ValueError, match="w3_fp8 must be a contiguous torch.float8_e4m3fn"):
        W.ws_gemm1_fwd_fp8(xq, xs, w1q, w1s, w3q.float(), w3s, lay)
    with pytest.raises(ValueError, match=r"w1_scale must be .* of shape \(4, 1, 2\)"):
        W.ws_gemm1_fwd_fp8(xq, xs, w1q, w1s[:, :, :1].contiguous(), w3q, w3s, lay)
    from titan_megamoe.kernels.routing import build_routing_layout_torch

    lay64 = build_routing_layout_torch(torch.randint(0, 4, (40, 2)), 4, 64)
    with pytest.raises(ValueError, match="layout.block_m=64 != cfg.block_m=128"):
        W.ws_gemm1_fwd_fp8(xq, xs, w1q, w1s, w3q, w3s, lay64)
    with pytest.raises(ValueError, match="quantize_h needs the wide tiles .* got wide=False, block_n=64"):
        W.ws_gemm1_fwd_fp8(xq, xs, w1q, w1s, w3q, w3s, lay, quantize_h=True)


def test_fp8_forward_takes_the_gluon_gemm1_only_when_switched_on(monkeypatch):
    """``WS_GEMM1_FP8`` on, off the interpreter and on a supported case: the fp8 forward runs the Gluon GEMM1, then
    the 1x128 pass over its bf16 h, then GEMM2 on that; off: the Triton GEMM1 with h quantized in its epilogue."""
    import titan_megamoe.kernels.fp8_quant as Q
    import titan_megamoe.kernels.grouped_gemm_fp8 as G8
    import titan_megamoe.kernels.ws_gemm_fp8 as W
    import titan_megamoe.ops.fp8_backend as fb
    from titan_megamoe import switches

    assert switches.SWITCHES["TITAN_MEGAMOE_WS_GEMM1_FP8"].default == "1"
    lay, xq, xs, w1q, w1s, w3q, w3s = _fp8_operands(40, 4, 2, 256, 128, "uniform", 0, "cpu")
    N, F = lay.n_cap, 128
    calls, cfgs = [], []

    def quant(x, row_index=None, top_k=1, **kw):
        calls.append(("quant", x.shape[0]))
        return torch.zeros(x.shape, dtype=torch.float8_e4m3fn), torch.ones(x.shape[0], x.shape[1] // 128)

    def ws(*a, quantize_h=False, nonfinite_count=None, **kw):
        calls.append(("ws_gemm1", quantize_h) if quantize_h else ("ws_gemm1",))
        cfgs.append(kw.get("cfg"))
        gu = torch.full((N, 2 * F), 0.5, dtype=torch.bfloat16)
        if quantize_h:  # the forward's own counter reaches the epilogue
            assert nonfinite_count is not None and nonfinite_count.dtype == torch.int32
            return gu, torch.zeros((N, F), dtype=torch.float8_e4m3fn), torch.ones(N, F // 128)
        return gu, torch.full((N, F), 0.25, dtype=torch.bfloat16)

    def triton_gemm1(*a, quantize_h=False, **kw):
        calls.append(("triton_gemm1", quantize_h))
        return (torch.full((N, 2 * F), 0.5, dtype=torch.bfloat16), torch.zeros((N, F), dtype=torch.float8_e4m3fn),
                torch.ones(N, 1))

    def gemm2(hq, hs, *a, **kw):
        calls.append(("gemm2", hq.dtype))
        return torch.full((80, 256), 1.0, dtype=torch.bfloat16)

    monkeypatch.setattr(Q, "quantize_act_1x128", quant)
    monkeypatch.setattr(W, "ws_gemm1_fwd_fp8", ws)
    monkeypatch.setattr(W, "ws_gemm1_fwd_fp8_supported", lambda x, w: None)
    monkeypatch.setattr(G8, "gemm1_swiglu_fwd_fp8", triton_gemm1)
    monkeypatch.setattr(G8, "gemm2_scatter_fwd_fp8", gemm2)
    monkeypatch.setattr(fb, "_interp", lambda: False)
    x = torch.randn(40, 256).bfloat16()
    w = torch.randn(4, 128, 256).bfloat16()  # w1 / w3 (E, F, D): only their shape is read by the fp8 forward
    wq = [None] * 6 + [w1q, w1s, w3q, w3s, torch.zeros(4, 256, 128, dtype=torch.float8_e4m3fn), torch.ones(4, 2, 1)]
    for on, want in ((True, [("quant", 40), ("ws_gemm1",), ("quant", N), ("gemm2", torch.float8_e4m3fn)]),
                     (False, [("quant", 40), ("triton_gemm1", True), ("gemm2", torch.float8_e4m3fn)])):
        calls.clear()
        with switches.override({"TITAN_MEGAMOE_WS_GEMM1_FP8": "1" if on else "0",
                                "TITAN_MEGAMOE_FP8_GEMM1_QUANT_H": "0"}):
            y, gate_up = fb.fp8_experts_fwd(x, torch.rand(40, 2), lay, w, w.transpose(1, 2), w, wq, True,
                                            "layers.0.moe")
        assert calls == want, (on, calls)
        assert float(gate_up[0, 0]) == 0.5 and y.shape == (80, 256)
    # FP8_FWD_WIDE (opt-in) reaches the Gluon GEMM1's config
    assert cfgs == [W.FP8_FWD_CONFIG] and switches.SWITCHES["TITAN_MEGAMOE_FP8_FWD_WIDE"].default == "0"
    with switches.override({"TITAN_MEGAMOE_WS_GEMM1_FP8": "1", "TITAN_MEGAMOE_FP8_FWD_WIDE": "1",
                            "TITAN_MEGAMOE_FP8_GEMM1_QUANT_H": "0"}):
        fb.fp8_experts_fwd(x, torch.rand(40, 2), lay, w, w.transpose(1, 2), w, wq, True, "layers.0.moe")
    assert cfgs[-1] == W.FP8_FWD_WIDE_CONFIG and cfgs[-1].wide
    # FP8_GEMM1_QUANT_H (default on since session 39): h quantized in the Gluon GEMM1's epilogue on the wide tiles,
    # no 1x128 pass over h
    assert switches.SWITCHES["TITAN_MEGAMOE_FP8_GEMM1_QUANT_H"].default == "1" and fb.FP8_GEMM1_QUANT_H
    calls.clear()
    with switches.override({"TITAN_MEGAMOE_WS_GEMM1_FP8": "1"}):
        fb.fp8_experts_fwd(x, torch.rand(40, 2), lay, w, w.transpose(1, 2), w, wq, True, "layers.0.moe")
    assert calls == [("quant", 40), ("ws_gemm1", True), ("gemm2", torch.float8_e4m3fn)], calls
    assert cfgs[-1] == W.FP8_FWD_WIDE_CONFIG


@pytest.mark.cuda
def test_h_quantized_in_the_epilogue_counts_non_finite_groups_as_the_pass_does_on_gpu():
    """An inf x scale on token 7 makes the h of its rows non-finite: the epilogue's count (one atomic per consumer and
    tile) equals the 1x128 pass's count over the bf16 h, and the finite rows keep the pass's bits."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs an sm_90 GPU")
    from titan_megamoe.kernels.fp8_quant import quantize_act_1x128
    from titan_megamoe.kernels.ws_gemm_fp8 import FP8_FWD_WIDE_CONFIG, ws_gemm1_fwd_fp8

    lay, xq, xs, w1q, w1s, w3q, w3s = _fp8_operands(1000, 8, 2, 256, 256, "uniform", 5, "cuda")
    xs = xs.clone()
    xs[7, 0] = float("inf")  # token 7's rows: gate and up inf / nan in every column
    n = int(lay.offsets[-1])
    gu, h = ws_gemm1_fwd_fp8(xq, xs, w1q, w1s, w3q, w3s, lay, cfg=FP8_FWD_WIDE_CONFIG)
    c_pass = torch.zeros(1, dtype=torch.int32, device="cuda")
    want_q, want_s = quantize_act_1x128(h, row_valid=lay.row_pair, nonfinite_count=c_pass)
    c_epi = torch.zeros(1, dtype=torch.int32, device="cuda")
    _, q, sc = ws_gemm1_fwd_fp8(xq, xs, w1q, w1s, w3q, w3s, lay, cfg=FP8_FWD_WIDE_CONFIG, quantize_h=True,
                                nonfinite_count=c_epi)
    assert int(c_pass) > 0 and int(c_epi) == int(c_pass), (int(c_epi), int(c_pass))
    ok = torch.isfinite(want_s[:n]).all(1)
    assert torch.equal(q[:n][ok].view(torch.uint8), want_q[:n][ok].view(torch.uint8))
    assert torch.equal(sc[:n][ok], want_s[:n][ok])


@pytest.mark.cuda
@pytest.mark.parametrize("case", [
    (4096, 16, 4, 512, 256, "uniform"), (1000, 8, 1, 256, 128, "uniform"), (3000, 32, 4, 384, 256, "zero_expert"),
    (2048, 16, 2, 256, 384, "one_expert"), (16384, 128, 8, 2048, 768, "uniform"),
], ids=["uniform", "top1-odd-T", "zero-expert", "one-expert", "30b"])
def test_ws_gemm1_fwd_fp8_matches_triton_and_fp32_on_gpu(case):
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs an sm_90 GPU")
    from titan_megamoe.kernels.grouped_gemm_fp8 import gemm1_swiglu_fwd_fp8
    from titan_megamoe.kernels.ws_gemm_fp8 import FP8_FWD_CONFIG, FP8_FWD_WIDE_CONFIG, ws_gemm1_fwd_fp8
    from titan_megamoe.ops import fp8_reference as R
    from titan_megamoe.testing import rel_err

    T, E, K, D, F, routing = case
    lay, xq, xs, w1q, w1s, w3q, w3s = _fp8_operands(T, E, K, D, F, routing, 3, "cuda")
    gu = torch.full((lay.n_cap, 2 * F), float("nan"), device="cuda", dtype=torch.bfloat16)
    h = torch.full((lay.n_cap, F), float("nan"), device="cuda", dtype=torch.bfloat16)
    ws_gemm1_fwd_fp8(xq, xs, w1q, w1s, w3q, w3s, lay, gate_up_out=gu, h_out=h)
    tgu, th = gemm1_swiglu_fwd_fp8(xq, xs, w1q, w1s, w3q, w3s, lay)
    n = int(lay.offsets[-1])
    # the same partials in the same order, whichever consumer issues first, and on the wide tiles
    for base, ordered in ((FP8_FWD_CONFIG, False), (FP8_FWD_CONFIG, True), (FP8_FWD_WIDE_CONFIG, False),
                          (FP8_FWD_WIDE_CONFIG, True)):
        ogu, oh = torch.full_like(gu, float("nan")), torch.full_like(h, float("nan"))  # poisoned: a missed tile shows
        ws_gemm1_fwd_fp8(xq, xs, w1q, w1s, w3q, w3s, lay, gate_up_out=ogu, h_out=oh,
                         cfg=dataclasses.replace(base, ordered=ordered))
        assert torch.equal(ogu[:n], gu[:n]) and torch.equal(oh[:n], h[:n]), \
            f"wide={base.wide} ordered={ordered}"
    # h quantized in the epilogue: the bits of the 1x128 pass over the bf16 h (on every row of the live tiles)
    from titan_megamoe.kernels.fp8_quant import quantize_act_1x128

    want_q, want_s = quantize_act_1x128(h, row_valid=lay.row_pair)
    for base in (FP8_FWD_WIDE_CONFIG,):  # (a 128 x 128 tile holds half of a 1x128 group: refused)
        ogu = torch.full_like(gu, float("nan"))
        oq = torch.full((lay.n_cap, F), float("nan"), device="cuda").to(torch.float8_e4m3fn)  # poisoned
        count = torch.zeros(1, dtype=torch.int32, device="cuda")
        _, got_q, got_s = ws_gemm1_fwd_fp8(xq, xs, w1q, w1s, w3q, w3s, lay, gate_up_out=ogu, h_out=oq, cfg=base,
                                           quantize_h=True, nonfinite_count=count)
        assert got_q is oq and torch.equal(ogu[:n], gu[:n]), f"quantize_h wide={base.wide}: gate_up differs"
        assert torch.equal(got_q[:n].view(torch.uint8), want_q[:n].view(torch.uint8)), f"wide={base.wide}: h values"
        assert torch.equal(got_s[:n], want_s[:n]), f"wide={base.wide}: h scales"
        assert int(count) == 0
    pair = lay.row_pair[:n].long()
    valid = pair >= 0
    assert not torch.isnan(gu[:n]).any() and not torch.isnan(h[:n]).any(), "live rows left unwritten"
    assert (gu[:n][~valid] == 0).all() and (h[:n][~valid] == 0).all(), "padding rows must be zero"
    # fp32 reference of the dequantized operands
    x = R.dequantize_act_1x128(xq, xs)[pair.clamp_min(0) // K]
    w1, w3 = R.dequantize_weight_128x128(w1q, w1s), R.dequantize_weight_128x128(w3q, w3s)
    ref = torch.zeros(n, 2 * F, device="cuda")
    off = lay.offsets.tolist()
    for e in range(E):
        a, b = off[e], off[e + 1]
        ref[a:b] = torch.cat([x[a:b] @ w1[e].T, x[a:b] @ w3[e].T], 1)
    ref[~valid] = 0
    ref_h = ref[:, :F] * torch.sigmoid(ref[:, :F]) * ref[:, F:]
    assert rel_err(gu[:n], ref) < 1e-2 and rel_err(h[:n], ref_h) < 1e-2
    assert rel_err(gu[:n], tgu[:n]) < 1e-2 and rel_err(h[:n], th[:n]) < 1e-2



def _dgrad_operands(T, E, K, D, F, routing, seed, device):
    from titan_megamoe.kernels.routing import build_routing_layout
    from titan_megamoe.ops import fp8_reference as R
    from titan_megamoe.testing import make_routing

    g = torch.Generator(device=device).manual_seed(seed)
    lay = build_routing_layout(make_routing(routing, T, E, K, seed=seed).to(device), E, 128)
    dgu = torch.randn(lay.n_cap, 2 * F, device=device, generator=g).bfloat16()
    w1 = (torch.randn(E, F, D, device=device, generator=g) / F ** 0.5).bfloat16()
    w3 = (torch.randn(E, F, D, device=device, generator=g) / F ** 0.5).bfloat16()
    dq, ds = R.quantize_act_1x128(dgu)
    w1q, w1s = R.quantize_weight_128x128(w1.transpose(1, 2).contiguous())
    w3q, w3s = R.quantize_weight_128x128(w3.transpose(1, 2).contiguous())
    return lay, dq, ds, w1q, w1s, w3q, w3s


def test_ws_gemm1_dgrad_fp8_refuses_what_it_cannot_take(monkeypatch):
    from titan_megamoe.kernels import ws_gemm_fp8 as W

    lay, dq, ds, w1q, w1s, w3q, w3s = _dgrad_operands(40, 4, 2, 256, 128, "uniform", 0, "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="ws_gemm1_dgrad_fp8: .*(sm_90|Gluon|Triton)"):
            W.ws_gemm1_dgrad_fp8(dq, ds, w1q, w1s, w3q, w3s, lay)
    monkeypatch.setattr(W, "_platform_reason", lambda t: None)
    assert W.ws_gemm1_dgrad_fp8_supported(dq, w1q) is None
    assert "D % 128 == 0" in W.ws_gemm1_dgrad_fp8_supported(dq, w1q[:, :64].contiguous())
    assert W.ws_gemm1_dgrad_fp8_supported(dq, w1q, W.DGRAD_FP8_WIDE_CONFIG) is None  # D = 256
    assert "D % 256 == 0" in W.ws_gemm1_dgrad_fp8_supported(dq, w1q[:, :128].contiguous(), W.DGRAD_FP8_WIDE_CONFIG)
    with pytest.raises(ValueError, match="ws_gemm1_dgrad_fp8: dgu_scale must be"):
        W.ws_gemm1_dgrad_fp8(dq, ds[:, :1].contiguous(), w1q, w1s, w3q, w3s, lay)
    with pytest.raises(ValueError, match="ws_gemm1_dgrad_fp8: w3t_fp8 must be"):
        W.ws_gemm1_dgrad_fp8(dq, ds, w1q, w1s, w3q.float(), w3s, lay)


def test_fp8_backward_takes_the_gluon_dgrad_only_when_switched_on(monkeypatch):
    """``WS_GEMM1_DGRAD_FP8`` on, off the interpreter, a supported case: the FP8 backward's dx rows come from the
    Gluon dgrad; off: from the Triton one."""
    import titan_megamoe.kernels.grouped_gemm_fp8_bwd as B8
    import titan_megamoe.kernels.ws_gemm_fp8 as W
    import titan_megamoe.ops.fp8_backend as fb
    from titan_megamoe import switches

    assert switches.SWITCHES["TITAN_MEGAMOE_WS_GEMM1_DGRAD_FP8"].default == "1"
    calls = []
    monkeypatch.setattr(W, "ws_gemm1_dgrad_fp8_supported", lambda d, w: None)
    monkeypatch.setattr(W, "ws_gemm1_dgrad_fp8", lambda *a, **k: calls.append("gluon") or "gluon rows")
    monkeypatch.setattr(B8, "gemm1_dgrad_fp8", lambda *a, **k: calls.append("triton") or "triton rows")
    monkeypatch.setattr(fb, "_interp", lambda: False)
    for on, want in (("1", ["gluon"]), ("0", ["triton"])):
        calls.clear()
        with switches.override({"TITAN_MEGAMOE_WS_GEMM1_DGRAD_FP8": on}):
            assert fb.WS_GEMM1_DGRAD_FP8 is (on == "1")
            dx = fb._gemm1_dgrad_fp8_rows("dq", "ds", torch.empty(2, 512, 128), "w1ts", "w3tq", "w3ts", "layout")
        assert calls == want and dx == f"{want[0]} rows"
    # FP8_DGRAD_WIDE (on by default) reaches the Gluon dgrad's config where D % 256 == 0, else the 128 x 128 tiles
    cfgs = []
    monkeypatch.setattr(W, "ws_gemm1_dgrad_fp8", lambda *a, cfg=None, **k: cfgs.append(cfg))
    assert switches.SWITCHES["TITAN_MEGAMOE_FP8_DGRAD_WIDE"].default == "1"
    for wide, D in (("0", 512), ("1", 512), ("1", 384)):
        with switches.override({"TITAN_MEGAMOE_FP8_DGRAD_WIDE": wide}):
            fb._gemm1_dgrad_fp8_rows("dq", "ds", torch.empty(2, D, 128), "w1ts", "w3tq", "w3ts", "layout")
    assert cfgs == [W.DGRAD_FP8_CONFIG, W.DGRAD_FP8_WIDE_CONFIG, W.DGRAD_FP8_CONFIG], cfgs


@pytest.mark.cuda
@pytest.mark.parametrize("case", [
    (4096, 16, 4, 512, 256, "uniform"), (1000, 8, 1, 256, 128, "uniform"), (3000, 32, 4, 384, 256, "zero_expert"),
    (2048, 16, 2, 256, 384, "one_expert"), (16384, 128, 8, 2048, 768, "uniform"),
], ids=["uniform", "top1-odd-T", "zero-expert", "one-expert", "30b"])
def test_ws_gemm1_dgrad_fp8_matches_triton_and_fp32_on_gpu(case):
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs an sm_90 GPU")
    from titan_megamoe.kernels.grouped_gemm_fp8_bwd import gemm1_dgrad_fp8
    from titan_megamoe.kernels.ws_gemm_fp8 import ws_gemm1_dgrad_fp8
    from titan_megamoe.ops import fp8_reference as R
    from titan_megamoe.testing import rel_err

    T, E, K, D, F, routing = case
    lay, dq, ds, w1q, w1s, w3q, w3s = _dgrad_operands(T, E, K, D, F, routing, 9, "cuda")
    dx = torch.full((lay.n_cap, D), float("nan"), device="cuda", dtype=torch.bfloat16)
    ws_gemm1_dgrad_fp8(dq, ds, w1q, w1s, w3q, w3s, lay, out=dx)
    tdx = gemm1_dgrad_fp8(dq, ds, w1q, w1s, w3q, w3s, lay)
    n = int(lay.offsets[-1])
    from titan_megamoe.kernels.ws_gemm_fp8 import DGRAD_FP8_CONFIG, DGRAD_FP8_WIDE_CONFIG
    # the same partials in the same order, whichever consumer issues first, and on the wide tiles (D % 256 == 0)
    for base, ordered in ((DGRAD_FP8_CONFIG, False), (DGRAD_FP8_CONFIG, True), (DGRAD_FP8_WIDE_CONFIG, False),
                          (DGRAD_FP8_WIDE_CONFIG, True)):
        if base.wide and D % 256:
            continue
        odx = torch.full_like(dx, float("nan"))  # poisoned: a missed tile shows
        ws_gemm1_dgrad_fp8(dq, ds, w1q, w1s, w3q, w3s, lay, out=odx, cfg=dataclasses.replace(base, ordered=ordered))
        assert torch.equal(odx[:n], dx[:n]), f"wide={base.wide} ordered={ordered} differs"
    valid = lay.row_pair[:n] >= 0
    assert not torch.isnan(dx[:n]).any(), "live rows left unwritten"
    assert (dx[:n][~valid] == 0).all(), "padding rows must be zero"
    dgu = R.dequantize_act_1x128(dq, ds)[:n]
    w1t, w3t = R.dequantize_weight_128x128(w1q, w1s), R.dequantize_weight_128x128(w3q, w3s)
    ref = torch.zeros(n, D, device="cuda")
    off = lay.offsets.tolist()
    for e in range(E):
        a, b = off[e], off[e + 1]
        ref[a:b] = dgu[a:b, :F] @ w1t[e].T + dgu[a:b, F:] @ w3t[e].T
    ref[~valid] = 0
    assert rel_err(dx[:n], ref) < 1e-2
    assert rel_err(dx[:n], tdx[:n]) < 1e-2


def _gemm2_operands(T, E, K, D, F, routing, seed, device):
    from titan_megamoe.kernels.routing import build_routing_layout
    from titan_megamoe.ops import fp8_reference as R
    from titan_megamoe.testing import make_routing

    g = torch.Generator(device=device).manual_seed(seed)
    lay = build_routing_layout(make_routing(routing, T, E, K, seed=seed).to(device), E, 128)
    h = torch.randn(lay.n_cap, F, device=device, generator=g).bfloat16()
    w2 = (torch.randn(E, D, F, device=device, generator=g) / F ** 0.5).bfloat16()
    scores = torch.rand(T, K, device=device, generator=g)
    hq, hs = R.quantize_act_1x128(h)
    w2q, w2s = R.quantize_weight_128x128(w2)
    return lay, hq, hs, w2q, w2s, scores


def test_ws_gemm2_fwd_fp8_refuses_what_it_cannot_take(monkeypatch):
    from titan_megamoe.kernels import ws_gemm_fp8 as W

    lay, hq, hs, w2q, w2s, scores = _gemm2_operands(40, 4, 2, 256, 128, "uniform", 0, "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="ws_gemm2_fwd_fp8: .*(sm_90|Gluon|Triton)"):
            W.ws_gemm2_fwd_fp8(hq, hs, w2q, w2s, scores, lay)
    monkeypatch.setattr(W, "_platform_reason", lambda t: None)
    assert W.ws_gemm2_fwd_fp8_supported(hq, w2q) is None
    assert "D % 128 == 0" in W.ws_gemm2_fwd_fp8_supported(hq, w2q[:, :64].contiguous())
    with pytest.raises(ValueError, match="ws_gemm2_fwd_fp8: h_scale must be"):
        W.ws_gemm2_fwd_fp8(hq, hs[:-1].contiguous(), w2q, w2s, scores, lay)
    with pytest.raises(ValueError, match=r"ws_gemm2_fwd_fp8: scores must be a contiguous \(T, 2\) fp32"):
        W.ws_gemm2_fwd_fp8(hq, hs, w2q, w2s, scores.reshape(-1), lay)
    with pytest.raises(ValueError, match="ws_gemm2_fwd_fp8: the layout was built for 80 pairs and 4 experts, the "
                                         "scores hold 78 pairs"):
        W.ws_gemm2_fwd_fp8(hq, hs, w2q, w2s, scores[:39].contiguous(), lay)
    with pytest.raises(ValueError, match="ws_gemm2_fwd_fp8: out must be"):
        W.ws_gemm2_fwd_fp8(hq, hs, w2q, w2s, scores, lay, out=torch.empty(3, 256, dtype=torch.bfloat16))


def test_fp8_forward_takes_the_gluon_gemm2_only_when_switched_on(monkeypatch):
    """``WS_GEMM2_FP8`` on (the default), off the interpreter, a supported case, rows by pair: the FP8 forward's y comes from
    the Gluon GEMM2; off, or by_row (the EP combine's layout rows): from the Triton one."""
    import titan_megamoe.kernels.grouped_gemm_fp8 as G8
    import titan_megamoe.kernels.ws_gemm_fp8 as W
    import titan_megamoe.ops.fp8_backend as fb
    from titan_megamoe import switches

    from titan_megamoe.kernels.jit import interpreting

    assert switches.SWITCHES["TITAN_MEGAMOE_WS_GEMM2_FP8"].default == "1"
    if not interpreting():  # the quantization kernels on the way run on CPU tensors only in Triton's interpreter
        pytest.skip("needs TRITON_INTERPRET=1 (CPU tensors through the FP8 forward's Triton kernels)")
    T, E, K, D, F = 40, 4, 2, 256, 128
    lay, hq, hs, w2q, w2s, scores = _gemm2_operands(T, E, K, D, F, "uniform", 0, "cpu")
    calls = []
    monkeypatch.setattr(W, "ws_gemm2_fwd_fp8_supported", lambda h, w: None)
    monkeypatch.setattr(W, "ws_gemm2_fwd_fp8", lambda *a, **k: calls.append("gluon") or "gluon y")
    monkeypatch.setattr(G8, "gemm2_scatter_fwd_fp8", lambda *a, **k: calls.append(("triton", k["by_row"])) or "triton y")
    monkeypatch.setattr(W, "ws_gemm1_fwd_fp8_supported", lambda *a: "not here")  # the Triton GEMM1 path below
    monkeypatch.setattr(G8, "gemm1_swiglu_fwd_fp8", lambda *a, **k: ("gate_up", hq, hs))
    monkeypatch.setattr(fb, "_interp", lambda: False)
    x = torch.randn(T * K, D).bfloat16()
    w1 = torch.randn(E, F, D).bfloat16()
    wq = [None] * 6 + [hq, hs, hq, hs, w2q, w2s]  # only wq[10:12] (w2) reaches GEMM2 here
    for on, by_row, want in (("1", False, "gluon"), ("0", False, ("triton", False)), ("1", True, ("triton", True))):
        calls.clear()
        with switches.override({"TITAN_MEGAMOE_WS_GEMM2_FP8": on}):
            assert fb.WS_GEMM2_FP8 is (on == "1")
            out = fb.fp8_experts_fwd(x, scores, lay, w1, w2q, w1, wq, True, "layer", by_row=by_row)
        assert calls == [want], calls
        assert out[0] == (want if isinstance(want, str) else want[0]) + " y"
    # FP8_GEMM2_WIDE (on by default) reaches the Gluon GEMM2's config (D = 256 here)
    cfgs = []
    monkeypatch.setattr(W, "ws_gemm2_fwd_fp8", lambda *a, cfg=None, **k: cfgs.append(cfg) or "gluon y")
    assert switches.SWITCHES["TITAN_MEGAMOE_FP8_GEMM2_WIDE"].default == "1"
    for wide in ("0", "1"):
        with switches.override({"TITAN_MEGAMOE_FP8_GEMM2_WIDE": wide}):
            fb.fp8_experts_fwd(x, scores, lay, w1, w2q, w1, wq, True, "layer")
    assert cfgs == [W.GEMM2_FP8_CONFIG, W.GEMM2_FP8_WIDE_CONFIG], cfgs


@pytest.mark.cuda
@pytest.mark.parametrize("case", [
    (4096, 16, 4, 512, 256, "uniform"), (1000, 8, 1, 256, 128, "uniform"), (3000, 32, 4, 384, 256, "zero_expert"),
    (2048, 16, 2, 256, 384, "one_expert"), (16384, 128, 8, 2048, 768, "uniform"),
], ids=["uniform", "top1-odd-T", "zero-expert", "one-expert", "30b"])
def test_ws_gemm2_fwd_fp8_matches_triton_and_fp32_on_gpu(case):
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs an sm_90 GPU")
    from titan_megamoe.kernels.grouped_gemm_fp8 import gemm2_scatter_fwd_fp8
    from titan_megamoe.kernels.ws_gemm_fp8 import ws_gemm2_fwd_fp8
    from titan_megamoe.ops import fp8_reference as R
    from titan_megamoe.testing import rel_err

    T, E, K, D, F, routing = case
    lay, hq, hs, w2q, w2s, scores = _gemm2_operands(T, E, K, D, F, routing, 5, "cuda")
    y = torch.full((T * K, D), float("nan"), device="cuda", dtype=torch.bfloat16)
    ws_gemm2_fwd_fp8(hq, hs, w2q, w2s, scores, lay, out=y)
    ty = gemm2_scatter_fwd_fp8(hq, hs, w2q, w2s, scores, lay)
    from titan_megamoe.kernels.ws_gemm_fp8 import GEMM2_FP8_CONFIG, GEMM2_FP8_WIDE_CONFIG
    # the same partials in the same order, whichever consumer issues first, and on the wide tiles (D % 256 == 0)
    for base, ordered in ((GEMM2_FP8_CONFIG, False), (GEMM2_FP8_CONFIG, True), (GEMM2_FP8_WIDE_CONFIG, False),
                          (GEMM2_FP8_WIDE_CONFIG, True)):
        if base.wide and D % 256:
            continue
        oy = torch.full_like(y, float("nan"))  # poisoned: a missed row shows
        ws_gemm2_fwd_fp8(hq, hs, w2q, w2s, scores, lay, out=oy, cfg=dataclasses.replace(base, ordered=ordered))
        assert torch.equal(oy, y), f"wide={base.wide} ordered={ordered} differs"
    assert not torch.isnan(y).any(), "a pair row left unwritten"
    n = int(lay.offsets[-1])
    rows = (lay.row_pair[:n] >= 0).nonzero().squeeze(1)
    pairs = lay.row_pair[rows].long()
    expert = lay.tile_expert.long()[rows // 128]
    h = R.dequantize_act_1x128(hq, hs)[rows]
    w2 = R.dequantize_weight_128x128(w2q, w2s)
    ref = torch.zeros(T * K, D, device="cuda")
    for e in range(E):
        m = expert == e
        ref[pairs[m]] = (h[m] @ w2[e].T) * scores.reshape(-1)[pairs[m]][:, None]
    assert rel_err(y, ref) < 1e-2
    assert rel_err(y, ty) < 1e-3  # the Triton kernel's partials and expression: equal to fp32 rounding
    print(f"bitwise the Triton kernel: {torch.equal(y, ty)}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["compile-sm90"]:
        print(json.dumps(_compile_sm90_all()))
    else:
        raise SystemExit("usage: python tests/test_ws_gemm_fp8.py compile-sm90")
