"""The warp-specialized blockwise-FP8 GEMM2 dgrad (kernels/ws_gemm2_dgrad_fp8.py): sm_90a builds on the CPU machine
(registers, bounded spills, wgmma count and waits, no wgmma serialization), its host-side errors, the opt-in switch's
wiring in the FP8 backward, and on a GPU its outputs against the Triton FP8 kernel and an fp32 reference of the
dequantized operands (NaN-poisoned outputs, edge cases)."""

import json
import re
import sys

import pytest
import torch

from _sm90 import sm90_result  # noqa: E402

SHAPES = {"30b": (2048, 768), "235b": (4096, 1536)}


def _compile_sm90_all() -> list[dict]:
    from titan_megamoe.kernels import ws_gemm2_dgrad_fp8 as W
    from titan_megamoe.kernels.sm90_check import compile_sm90

    out = []
    for shape, (D, F) in SHAPES.items():
        for kind, cfg in (("", W.GEMM2_DGRAD_FP8_CONFIG), ("_pingpong", W.GEMM2_DGRAD_FP8_PINGPONG)):
            sig, cx = W.sm90_compile_args_gemm2_dgrad_fp8(cfg, D, F)
            r = compile_sm90(W._gemm2_dgrad_fp8_ws_kernel, sig, cx, num_warps=4, num_stages=1, maxnreg=cfg.maxnreg)
            out.append(dict(label=f"gemm2_dgrad_fp8{kind}_{shape}", **r))
    return out


@pytest.mark.parametrize("label", ["gemm2_dgrad_fp8_30b", "gemm2_dgrad_fp8_235b", "gemm2_dgrad_fp8_pingpong_30b",
                                   "gemm2_dgrad_fp8_pingpong_235b"])
def test_ws_gemm2_dgrad_fp8_builds_for_sm90a_with_bounded_spills_and_no_wgmma_serialization(label):
    from titan_megamoe.kernels.sm90_check import HOPPER_SMEM_BYTES
    from titan_megamoe.kernels.ws_gemm2_dgrad_fp8 import (GEMM2_DGRAD_FP8_CONFIG, GEMM2_DGRAD_FP8_PINGPONG,
                                                          _smem_bytes)

    cfg = GEMM2_DGRAD_FP8_PINGPONG if "pingpong" in label else GEMM2_DGRAD_FP8_CONFIG
    r = sm90_result(__file__, label)
    assert r["target"], "PTX not built for sm_90a"
    assert r["wgmma"] == 16, r  # two consumers x two 64-row halves x 4 k32 steps of m64n64 e4m3
    # per consumer and K block: the first half's partial scaled under the second half's MMA
    assert r["wgmma_waits"] == ["1", "0", "1", "0"], r["wgmma_waits"]
    assert r["cp_async"] > 0 and r["tma"] > 0, "gathered dout rows by cp.async, weights and gate / up by TMA"
    # ping-pong: one w2 tile per stage and 6 stages (231,608 bytes): the largest ring that fits
    assert _smem_bytes(cfg) <= r["shared"] <= HOPPER_SMEM_BYTES, r["shared"]
    # the cap; the one-pass epilogue keeps both halves' s * h live: a few spills, bounded (session 22: 52 bytes)
    stack = int(re.search(r"STACK:(\d+)", r["usage"]).group(1))
    assert "REG:168" in r["usage"] and stack <= 64, r["usage"]
    assert r["wgmma_serialized"] == "", r["wgmma_serialized"]


def _operands(T, E, K, D, F, routing, seed, device):
    """FP8 dout and w2t, the forward's gate_up (zeros on padding rows, as GEMM1 writes it) and scores."""
    from titan_megamoe.kernels.routing import build_routing_layout
    from titan_megamoe.ops import fp8_reference as R
    from titan_megamoe.testing import make_routing

    g = torch.Generator(device=device).manual_seed(seed)
    lay = build_routing_layout(make_routing(routing, T, E, K, seed=seed).to(device), E, 128)
    dout = torch.randn(T, D, device=device, generator=g).bfloat16()
    w2 = (torch.randn(E, D, F, device=device, generator=g) / F ** 0.5).bfloat16()
    gate_up = (2 * torch.randn(lay.n_cap, 2 * F, device=device, generator=g)).bfloat16()
    gate_up[lay.row_pair < 0] = 0
    scores = torch.rand(T, K, device=device, generator=g)
    dq, ds = R.quantize_act_1x128(dout)
    w2tq, w2ts = R.quantize_weight_128x128(w2.transpose(1, 2).contiguous())
    return lay, dq, ds, w2tq, w2ts, gate_up, scores


def test_ws_gemm2_dgrad_fp8_refuses_what_it_cannot_take(monkeypatch):
    from titan_megamoe.kernels import ws_gemm2_dgrad_fp8 as W
    from titan_megamoe.kernels.routing import build_routing_layout_torch

    lay, dq, ds, w2tq, w2ts, gu, sc = _operands(40, 4, 2, 256, 128, "uniform", 0, "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="ws_gemm2_dgrad_fp8: .*(sm_90|Gluon|Triton)"):
            W.ws_gemm2_dgrad_fp8(dq, ds, w2tq, w2ts, gu, sc, lay)
    monkeypatch.setattr(W, "_platform_reason", lambda t: None)  # past the platform: the case and shape checks
    assert W.ws_gemm2_dgrad_fp8_supported(dq, w2tq) is None
    assert "hs_out" in W.ws_gemm2_dgrad_fp8_supported(dq, w2tq, torch.empty(1))
    assert "F % 128 == 0" in W.ws_gemm2_dgrad_fp8_supported(dq, w2tq[:, :64].contiguous())
    with pytest.raises(ValueError, match="ws_gemm2_dgrad_fp8: dout_s must be a contiguous torch.float32"):
        W.ws_gemm2_dgrad_fp8(dq, ds.bfloat16(), w2tq, w2ts, gu, sc, lay)
    with pytest.raises(ValueError, match=r"ws_gemm2_dgrad_fp8: gate_up must be .* of shape \(%d, 256\)" % lay.n_cap):
        W.ws_gemm2_dgrad_fp8(dq, ds, w2tq, w2ts, gu[:, :128].contiguous(), sc, lay)
    with pytest.raises(ValueError, match=r"scores_TK must be .* of shape \(40, 2\)"):
        W.ws_gemm2_dgrad_fp8(dq, ds, w2tq, w2ts, gu, sc[:, :1].contiguous(), lay)
    with pytest.raises(ValueError, match="layout.block_m=64 != cfg.block_m=128"):
        W.ws_gemm2_dgrad_fp8(dq, ds, w2tq, w2ts, gu, sc, build_routing_layout_torch(torch.randint(0, 4, (40, 2)), 4, 64))


def test_trace_buffer_too_small_or_of_another_dtype_is_refused():
    """The diagnosis stamps write trace[program, j, consumer, point]: a buffer that cannot hold them is refused before
    any launch (it would be written out of bounds)."""
    from titan_megamoe.kernels.ws_gemm2_dgrad_fp8 import _check_trace

    dev = torch.device("cpu")
    _check_trace(torch.zeros(4, 3, 2, 16, dtype=torch.int64), 4, dev)  # fits
    for bad in (torch.zeros(3, 3, 2, 16, dtype=torch.int64), torch.zeros(4, 3, 2, 8, dtype=torch.int64),
                torch.zeros(4, 3, 2, 16, dtype=torch.int32), torch.zeros(4, 3, 2, 32, dtype=torch.int64)[..., :16]):
        with pytest.raises(ValueError, match="trace must be a contiguous int64 tensor"):
            _check_trace(bad, 4, dev)


def test_fp8_backward_takes_the_gluon_gemm2_dgrad_only_when_switched_on(monkeypatch):
    """``WS_GEMM2_DGRAD_FP8`` on ("auto": ping-pong below D = 4096, cooperative from it), off the interpreter, a
    supported case: the FP8 backward's GEMM2 dgrad is the Gluon kernel; "0", or with the bf16 wgrads' ``hs_out``: the
    Triton kernel with the backward's config."""
    import titan_megamoe.kernels.grouped_gemm_fp8_bwd as B8
    import titan_megamoe.kernels.ws_gemm2_dgrad_fp8 as W
    import titan_megamoe.ops.fp8_backend as fb
    from titan_megamoe import switches

    assert switches.SWITCHES["TITAN_MEGAMOE_WS_GEMM2_DGRAD_FP8"].default == "auto"
    calls = []
    monkeypatch.setattr(W, "_platform_reason", lambda t: None)
    monkeypatch.setattr(W, "ws_gemm2_dgrad_fp8", lambda *a, **k: calls.append(("gluon", k)) or "gluon")
    monkeypatch.setattr(B8, "gemm2_dgrad_swiglu_bwd_fp8", lambda *a, **k: calls.append(("triton", a[7], k)) or "triton")
    monkeypatch.setattr(fb, "_interp", lambda: False)
    count, hs = torch.zeros(1, dtype=torch.int32), torch.empty(8, 128)
    pp, coop = W.GEMM2_DGRAD_FP8_PINGPONG, W.GEMM2_DGRAD_FP8_CONFIG
    for on, D, hs_out, want, cfg in (("1", 256, None, "gluon", coop), ("pingpong", 256, None, "gluon", pp),
                                     ("auto", 2048, None, "gluon", pp), ("auto", 4096, None, "gluon", coop),
                                     ("0", 256, None, "triton", None), ("1", 256, hs, "triton", None),
                                     ("auto", 2048, hs, "triton", None), ("pingpong", 256, hs, "triton", None)):
        calls.clear()
        dq, w2tq = torch.empty(8, D, dtype=torch.float8_e4m3fn), torch.empty(4, 128, D, dtype=torch.float8_e4m3fn)
        with switches.override({"TITAN_MEGAMOE_WS_GEMM2_DGRAD_FP8": on}):
            assert fb.WS_GEMM2_DGRAD_FP8 == on
            got = fb._gemm2_dgrad_fp8(dq, "ds", w2tq, "w2ts", "gate_up", "scores", "layout", "cfg", count, hs_out)
        assert got == want and len(calls) == 1 and calls[0][0] == want, (on, D)
        if want == "gluon":
            assert calls[0][1]["nonfinite_count"] is count
            assert calls[0][1]["cfg"] == cfg, (on, D)
        else:
            assert calls[0][1] == "cfg" and calls[0][2]["hs_out"] is hs_out and calls[0][2]["nonfinite_count"] is count


@pytest.mark.cuda
@pytest.mark.parametrize("case", [
    (4096, 16, 4, 512, 256, "uniform"), (1000, 8, 1, 256, 128, "uniform"), (3000, 32, 4, 384, 384, "zero_expert"),
    (2048, 16, 2, 256, 384, "one_expert"), (16384, 128, 8, 2048, 768, "uniform"),
], ids=["uniform", "top1-odd-T", "zero-expert", "one-expert", "30b"])
@pytest.mark.parametrize("schedule", ["coop", "pingpong"])
def test_ws_gemm2_dgrad_fp8_matches_triton_and_fp32_on_gpu(case, schedule):
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs an sm_90 GPU")
    from titan_megamoe.kernels.fp8_quant_bwd import empty_transposed
    from titan_megamoe.kernels.grouped_gemm_bwd import reduce_dscore
    from titan_megamoe.kernels.grouped_gemm_fp8_bwd import gemm2_dgrad_swiglu_bwd_fp8
    from titan_megamoe.kernels.ws_gemm2_dgrad_fp8 import (GEMM2_DGRAD_FP8_CONFIG, GEMM2_DGRAD_FP8_PINGPONG,
                                                          launch_gemm2_dgrad_fp8, ws_gemm2_dgrad_fp8)
    from titan_megamoe.ops import fp8_reference as R
    from titan_megamoe.testing import rel_err

    T, E, K, D, F, routing = case
    cfg = GEMM2_DGRAD_FP8_PINGPONG if schedule == "pingpong" else GEMM2_DGRAD_FP8_CONFIG
    lay, dq, ds, w2tq, w2ts, gu, sc = _operands(T, E, K, D, F, routing, 5, "cuda")
    N, nan = lay.n_cap, float("nan")
    dgu = torch.full((N, 2 * F), nan, device="cuda", dtype=torch.bfloat16)
    part = torch.full((N, F // 64), nan, device="cuda")
    hsT = empty_transposed(F, N, "cuda")
    hsT.view(torch.uint8).fill_(0x7F)  # e4m3 NaN
    hsTs = torch.full((N // 128, F), nan, device="cuda")
    count = torch.zeros(1, dtype=torch.int32, device="cuda")
    launch_gemm2_dgrad_fp8(dq, ds, w2tq, w2ts, gu, sc, lay, dgu, part, hsT, hsTs, count, cfg)
    n = int(lay.offsets[-1])
    if schedule == "pingpong":  # each unit computed as the cooperative kernel computes that chunk: the same bits
        coop = ws_gemm2_dgrad_fp8(dq, ds, w2tq, w2ts, gu, sc, lay)
        assert torch.equal(dgu[:n], coop[0][:n]) and torch.equal(part[:n], coop[1][:n])
        assert torch.equal(hsT[:, :n].view(torch.uint8), coop[2][:, :n].view(torch.uint8))
        assert torch.equal(hsTs[: n // 128], coop[3][: n // 128])
        for programs in (1, 3):  # many units per program, an odd count: the order barriers' parities over many phases
            pp = ws_gemm2_dgrad_fp8(dq, ds, w2tq, w2ts, gu, sc, lay, cfg=cfg, programs=programs)
            assert torch.equal(pp[0][:n], coop[0][:n]) and torch.equal(pp[1][:n], coop[1][:n]), programs
            assert torch.equal(pp[2][:, :n].view(torch.uint8), coop[2][:, :n].view(torch.uint8)), programs
            assert torch.equal(pp[3][: n // 128], coop[3][: n // 128]), programs
    tc = torch.zeros(1, dtype=torch.int32, device="cuda")
    tdgu, tpart, thsT, thsTs = gemm2_dgrad_swiglu_bwd_fp8(dq, ds, w2tq, w2ts, gu, sc, lay, nonfinite_count=tc)
    pair = lay.row_pair[:n].long()
    valid = pair >= 0
    assert not torch.isnan(dgu[:n]).any() and not torch.isnan(part[:n]).any(), "live rows left unwritten"
    assert not torch.isnan(hsTs[: n // 128]).any() and not hsT[:, :n].float().isnan().any()
    assert (dgu[:n][~valid] == 0).all() and (part[:n][~valid] == 0).all(), "padding rows must be zero"
    assert int(count) == 0 and int(tc) == 0
    # the same products and expressions as the Triton kernel: dgate_up and s * h agree to rounding
    assert rel_err(dgu[:n], tdgu[:n]) < 1e-3
    assert rel_err(hsTs[: n // 128], thsTs[: n // 128]) < 1e-6
    same = (hsT[:, :n].view(torch.uint8) == thsT[:, :n].view(torch.uint8)).float().mean().item()
    assert same >= 0.999, f"only {same:.4%} of the s * h e4m3 bytes equal the Triton kernel's"
    dsc, tdsc = reduce_dscore(part, lay, T, K), reduce_dscore(tpart, lay, T, K)
    assert rel_err(dsc, tdsc) < 1e-5
    # fp32 reference of the dequantized operands
    x = R.dequantize_act_1x128(dq, ds)[pair.clamp_min(0) // K]
    w2t = R.dequantize_weight_128x128(w2tq, w2ts)
    g = torch.zeros(n, F, device="cuda")
    off = lay.offsets.tolist()
    for e in range(E):
        a, b = off[e], off[e + 1]
        g[a:b] = x[a:b] @ w2t[e].T
    g[~valid] = 0
    s = sc.reshape(-1)[pair.clamp_min(0)] * valid
    gate, up = gu[:n, :F].float(), gu[:n, F:].float()
    sig = torch.sigmoid(gate)
    dh = g * s[:, None]
    ref = torch.cat([dh * up * sig * (1 + gate * (1 - sig)), dh * gate * sig], 1)
    assert rel_err(dgu[:n], ref) < 1e-2
    ref_dsc = torch.zeros(T * K, device="cuda")
    ref_dsc[pair[valid]] = (g * (gate * sig * up).bfloat16().float()).sum(1)[valid]
    assert rel_err(dsc.reshape(-1), ref_dsc) < 1e-2
    hs = R.dequantize_act_128x1(hsT[:, :n].T.contiguous(), hsTs[: n // 128])
    assert rel_err(hs, gate * sig * up * s[:, None]) < 0.03


@pytest.mark.cuda
def test_ws_gemm2_dgrad_fp8_counts_nonfinite_columns_as_the_triton_kernel():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs an sm_90 GPU")
    from titan_megamoe.kernels.grouped_gemm_fp8_bwd import gemm2_dgrad_swiglu_bwd_fp8
    from titan_megamoe.kernels.ws_gemm2_dgrad_fp8 import ws_gemm2_dgrad_fp8

    lay, dq, ds, w2tq, w2ts, gu, sc = _operands(4096, 16, 4, 512, 256, "uniform", 6, "cuda")
    r = int(torch.nonzero(lay.row_pair >= 0)[3])
    gu[r, 5] = float("inf")  # gate inf: s * h of column 5 inf in that row's 128-row group
    gu[r, 256 + 77] = float("nan")  # up NaN: column 77
    from titan_megamoe.kernels.ws_gemm2_dgrad_fp8 import GEMM2_DGRAD_FP8_PINGPONG

    counts, bad = [], []
    for fn in (ws_gemm2_dgrad_fp8, lambda *a, **k: ws_gemm2_dgrad_fp8(*a, **k, cfg=GEMM2_DGRAD_FP8_PINGPONG),
               gemm2_dgrad_swiglu_bwd_fp8):
        c = torch.zeros(1, dtype=torch.int32, device="cuda")
        hsTs = fn(dq, ds, w2tq, w2ts, gu, sc, lay, nonfinite_count=c)[3]
        counts.append(int(c))
        s = hsTs[r // 128, [5, 77]]
        bad.append((torch.isinf(s).tolist(), torch.isnan(s).tolist()))
    assert counts == [2, 2, 2], counts
    # the non-finite scales themselves as the Triton kernel's division gives them (inf stays inf, NaN stays NaN)
    assert bad[0] == bad[1] == bad[2], bad


if __name__ == "__main__":
    if sys.argv[1:2] == ["compile-sm90"]:
        print(json.dumps(_compile_sm90_all()))
    else:
        raise SystemExit("usage: python tests/test_ws_gemm2_dgrad_fp8.py compile-sm90")
