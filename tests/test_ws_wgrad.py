"""The warp-specialized Gluon wgrads (kernels/ws_wgrad.py): sm_90a builds on the CPU machine (registers,
shared memory, wgmma count, cp.async gathers, no wgmma serialization), host-side refusals and the
``TITAN_MEGAMOE_WGRAD=gluon`` fallback, and on a GPU the gradients against an fp32 reference and the
grouped_mm path over the edge-case routings, with poisoned outputs."""

import dataclasses
import json
import sys

import pytest
import torch

from _sm90 import sm90_result  # noqa: E402

SHAPES = {"30b": (2048, 768), "235b": (4096, 1536)}


def _compile_sm90_all() -> list[dict]:
    from titan_megamoe.kernels import ws_wgrad as W
    from titan_megamoe.kernels.sm90_check import compile_sm90

    out = []
    for suffix, cfg in (("", W.WGRAD_CONFIG), ("_split", W.SPLIT_CONFIG)):
        for kind in ("w13", "w2"):
            for shape, (D, F) in SHAPES.items():
                sig, cx = W.wgrad_compile_args(D, F, kind, cfg)
                r = compile_sm90(W._wgrad_ws_kernel, sig, cx, num_warps=4, num_stages=1, maxnreg=cfg.maxnreg)
                out.append(dict(label=f"{kind}_{shape}{suffix}", **r))
    return out


@pytest.mark.parametrize("label", ["w13_30b", "w13_235b", "w2_30b", "w2_235b", "w13_30b_split", "w13_235b_split",
                                   "w2_30b_split", "w2_235b_split"])
def test_ws_wgrad_builds_for_sm90a_without_spills_or_wgmma_serialization(label):
    from titan_megamoe.kernels.sm90_check import HOPPER_SMEM_BYTES
    from titan_megamoe.kernels.ws_wgrad import SPLIT_CONFIG, WGRAD_CONFIG

    split = label.endswith("_split")
    cfg = SPLIT_CONFIG if split else WGRAD_CONFIG
    r = sm90_result(__file__, label)
    assert r["target"], "PTX not built for sm_90a"
    # two consumers x 4 k16 steps of m64n256 per 64-row step; split: m64n128 halves, twice as many
    assert r["wgmma"] == (16 if split else 8), r
    assert r["cp_async"] > 0 and r["tma"] > 0, "token rows gathered by cp.async, the other operand by TMA"
    assert 0 < r["shared"] <= HOPPER_SMEM_BYTES and r["shared"] >= cfg.smem_bytes(), r["shared"]
    assert "STACK:0" in r["usage"] and "REG:168" in r["usage"], r["usage"]  # 216 / 72 registers: no spills
    assert r["wgmma_serialized"] == "", r["wgmma_serialized"]


def test_ws_wgrad_refuses_what_it_cannot_take():
    from titan_megamoe.kernels.routing import build_routing_layout_torch
    from titan_megamoe.kernels.ws_wgrad import WGRAD_CONFIG, ws_wgrad_supported, ws_wgrad_w2, ws_wgrad_w13

    g = torch.Generator().manual_seed(0)
    T, K, E, D, F = 40, 2, 4, 256, 256
    lay = build_routing_layout_torch(torch.randint(0, E, (T, K), generator=g), E, 128)
    x = torch.randn(T, D, generator=g).bfloat16()
    dgu = torch.randn(lay.n_cap, 2 * F, generator=g).bfloat16()
    reason = ws_wgrad_supported(D, F, lay, x)
    assert reason is not None and ("sm_90" in reason or "Gluon" in reason)
    with pytest.raises(ValueError, match="ws_wgrad_w13: .*(sm_90|Gluon)"):
        ws_wgrad_w13(dgu, x, lay)
    with pytest.raises(ValueError, match="ws_wgrad_w2: .*(sm_90|Gluon)"):
        ws_wgrad_w2(x, dgu[:, :F].contiguous(), lay)
    # operands the kernel would misread through raw pointers are refused by name, before anything else
    with pytest.raises(ValueError, match="ws_wgrad_w13: x must be a contiguous torch.bfloat16"):
        ws_wgrad_w13(dgu, x.float(), lay)
    with pytest.raises(ValueError, match="ws_wgrad_w2: hs must be a contiguous torch.bfloat16.*strided"):
        ws_wgrad_w2(x, dgu[:, :F], lay)
    with pytest.raises(ValueError, match="ws_wgrad_w13: dgate_up .* do not match the layout"):
        ws_wgrad_w13(dgu[:128].contiguous(), x, lay)
    assert WGRAD_CONFIG.smem_bytes() <= 232448


def test_gluon_wgrad_switch_runs_the_triton_kernels_off_sm90(monkeypatch):
    """``TITAN_MEGAMOE_WGRAD=gluon`` off an sm_90 GPU picks the Triton kernels (here through the interpreter),
    with their results."""
    if torch.cuda.is_available():
        pytest.skip("runs the Triton interpreter on CPU tensors (CPU machines; the GPU cases below cover the GPU)")
    from titan_megamoe.kernels import grouped_gemm_wgrad as W
    from titan_megamoe.kernels.routing import build_routing_layout_torch

    assert W.wgrad_impl(torch.device("cpu"), impl="gluon") == "triton"
    g = torch.Generator().manual_seed(2)
    T, K, E, D, F = 40, 2, 4, 32, 32
    lay = build_routing_layout_torch(torch.randint(0, E, (T, K), generator=g), E, 16)
    x = torch.randn(T, D, generator=g).bfloat16()
    dgu = torch.randn(lay.n_cap, 2 * F, generator=g).bfloat16()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    ref = W.wgrad_w13(dgu, x, lay, impl="triton")
    got = W.wgrad_w13(dgu, x, lay, impl="gluon")
    assert all(torch.equal(a, b) for a, b in zip(got, ref))


def _reference(a_rows, b_rows, lay):
    """fp32 out[e] = a_rows[e]^T @ b_rows[e] over each expert's layout rows."""
    off = lay.offsets.tolist()
    E = lay.num_experts
    out = torch.zeros(E, a_rows.shape[1], b_rows.shape[1], device=a_rows.device)
    for e in range(E):
        a, b = off[e], off[e + 1]
        out[e] = a_rows[a:b].float().t() @ b_rows[a:b].float()
    return out


@pytest.mark.cuda
@pytest.mark.parametrize("case", [
    (4096, 16, 4, 512, 256, "uniform"), (1000, 8, 1, 256, 256, "uniform"), (3000, 32, 4, 512, 512, "zero_expert"),
    (2048, 16, 2, 256, 256, "one_expert"), (2000, 8, 2, 768, 256, "skewed"), (16384, 128, 8, 2048, 768, "uniform"),
], ids=["uniform", "top1-odd-T", "zero-expert", "one-expert", "skewed", "30b"])
@pytest.mark.parametrize("split", [False, True], ids=["default", "split"])
def test_ws_wgrad_matches_fp32_and_grouped_mm_on_gpu(case, split):
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs an sm_90 GPU")
    from titan_megamoe import switches
    from titan_megamoe.kernels.grouped_gemm_wgrad import gather_rows, wgrad_w2, wgrad_w13
    from titan_megamoe.kernels.routing import build_routing_layout
    from titan_megamoe.kernels.ws_wgrad import SPLIT_CONFIG, WGRAD_CONFIG, ws_wgrad_w2, ws_wgrad_w13
    from titan_megamoe.testing import make_routing, rel_err

    cfg = SPLIT_CONFIG if split else WGRAD_CONFIG
    T, E, K, D, F, routing = case
    g = torch.Generator(device="cuda").manual_seed(11)
    lay = build_routing_layout(make_routing(routing, T, E, K, seed=11).cuda(), E, 128)
    n = int(lay.offsets[-1])
    pad = lay.row_pair[:n] < 0
    x = torch.randn(T, D, device="cuda", generator=g).bfloat16()
    dout = torch.randn(T, D, device="cuda", generator=g).bfloat16()
    dgu = torch.randn(lay.n_cap, 2 * F, device="cuda", generator=g).bfloat16()
    hs = torch.randn(lay.n_cap, F, device="cuda", generator=g).bfloat16()
    for t in (dgu, hs):  # the GEMM2 dgrad's contract: zeros on padding rows, rows from offsets[E] unwritten
        t[:n][pad] = 0
        t[n:] = float("nan")
    nan = lambda *s: torch.full(s, float("nan"), device="cuda", dtype=torch.bfloat16)  # noqa: E731
    with switches.override({"TITAN_MEGAMOE_WGRAD_TRIM_K": "0"}):  # every padded row reduced (trim_k: below)
        dw1, dw3 = ws_wgrad_w13(dgu, x, lay, out=(nan(E, F, D), nan(E, F, D)), cfg=cfg)
        dw2 = ws_wgrad_w2(dout, hs, lay, out=nan(E, D, F), cfg=cfg)
    for t in (dw1, dw3, dw2):
        assert not torch.isnan(t).any(), "output left unwritten"
    x_rows, dout_rows = gather_rows(x, lay)[:n], gather_rows(dout, lay)[:n]
    counts = lay.offsets.diff()
    for t in (dw1, dw3, dw2):
        assert (t[counts == 0] == 0).all(), "experts without rows must get zeros"
    assert rel_err(dw1, _reference(dgu[:n, :F], x_rows, lay)) < 1e-2
    assert rel_err(dw3, _reference(dgu[:n, F:], x_rows, lay)) < 1e-2
    assert rel_err(dw2, _reference(dout_rows, hs[:n], lay)) < 1e-2
    g1, g3 = wgrad_w13(dgu, x, lay, impl="grouped_mm")
    g2 = wgrad_w2(dout, dgu, torch.rand(T, K, device="cuda"), lay, hs_NF=hs, impl="grouped_mm")
    assert rel_err(dw1, g1) < 1e-2 and rel_err(dw3, g3) < 1e-2 and rel_err(dw2, g2) < 1e-2
    # trim_k (the default, WGRAD_TRIM_K) ends each expert at its last row rounded up to 64: bitwise the padded
    # end's sums, and rows past that end are not read (poisoned, the results stay the same)
    trim = dataclasses.replace(cfg, trim_k=True)
    assert torch.equal(ws_wgrad_w13(dgu, x, lay, cfg=trim)[0], dw1)
    assert torch.equal(ws_wgrad_w2(dout, hs, lay, cfg=trim), dw2)
    cut = lay.offsets[:-1] + (lay.counts + 63) // 64 * 64
    tail = torch.zeros(lay.n_cap, dtype=torch.bool, device="cuda")
    for e in range(E):
        tail[int(cut[e]):int(lay.offsets[e + 1])] = True
    if tail.any():
        dgu_p, hs_p = dgu.clone(), hs.clone()
        dgu_p[tail], hs_p[tail] = float("nan"), float("nan")
        assert torch.equal(ws_wgrad_w13(dgu_p, x, lay, cfg=trim)[1], dw3), "trim_k read rows past the cut"
        assert torch.equal(ws_wgrad_w2(dout, hs_p, lay, cfg=trim), dw2), "trim_k read rows past the cut"
    again = ws_wgrad_w13(dgu, x, lay, cfg=cfg)
    assert torch.equal(again[0], dw1) and torch.equal(again[1], dw3), "not deterministic"
    # the dispatch of wgrad_w13 / wgrad_w2 with impl="gluon" is this kernel; split_n changes no sum's order
    assert torch.equal(wgrad_w13(dgu, x, lay, impl="gluon")[0], dw1)
    assert torch.equal(wgrad_w2(dout, dgu, torch.rand(T, K, device="cuda"), lay, hs_NF=hs, impl="gluon"), dw2)


if __name__ == "__main__":
    if sys.argv[1:2] == ["compile-sm90"]:
        print(json.dumps(_compile_sm90_all()))
    else:
        raise SystemExit("usage: python tests/test_ws_wgrad.py compile-sm90")
