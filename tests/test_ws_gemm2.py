"""The warp-specialized bf16 GEMM2 forward (kernels/ws_gemm2.py): sm_90a builds on the CPU machine (registers,
shared memory, wgmma count, no wgmma serialization), its host-side errors and dispatch, and on a GPU its output
against the Triton kernel (bitwise) and an fp32 reference, into NaN-poisoned outputs."""

import dataclasses
import json
import sys

import pytest
import torch

from _sm90 import sm90_result  # noqa: E402

SHAPES = {"30b": (2048, 768), "235b": (4096, 1536)}


def _compile_sm90_all() -> list[dict]:
    from titan_megamoe.kernels import ws_gemm2
    from titan_megamoe.kernels.sm90_check import compile_sm90

    out = []
    for shape, (D, F) in SHAPES.items():
        for name, cfg in (("wide", ws_gemm2.GEMM2_CONFIG),
                          ("n128", dataclasses.replace(ws_gemm2.GEMM2_CONFIG, block_n=128, stages=6))):
            sig, cx = ws_gemm2.sm90_compile_args_gemm2(cfg, D, F)
            r = compile_sm90(ws_gemm2._gemm2_fwd_ws_kernel, sig, cx, num_warps=4, num_stages=1, maxnreg=cfg.maxnreg)
            out.append(dict(label=f"{name}_{shape}", **r))
    return out


@pytest.mark.parametrize("label", ["wide_30b", "wide_235b", "n128_30b", "n128_235b"])
def test_ws_gemm2_fwd_builds_for_sm90a_without_spills_or_wgmma_serialization(label):
    from titan_megamoe.kernels.sm90_check import HOPPER_SMEM_BYTES

    r = sm90_result(__file__, label)
    assert r["target"], "PTX not built for sm_90a"
    # two consumers x two column halves x 4 k16 steps (m64n128 wide, m64n64 at BN 128)
    assert r["wgmma"] == 16, r
    assert r["tma"] > 0 and r["cp_async"] == 0, "both operands by TMA"
    # the ring (4 x 48 KB or 6 x 32 KB) and the scatter's 16 KB layout-conversion scratch
    assert 196608 < r["shared"] <= HOPPER_SMEM_BYTES, r["shared"]
    assert "STACK:0" in r["usage"] and "REG:168" in r["usage"], r["usage"]
    assert r["wgmma_serialized"] == "", r["wgmma_serialized"]


def _operands(T, E, K, D, F, routing, seed, device):
    from titan_megamoe.kernels.routing import build_routing_layout
    from titan_megamoe.testing import make_routing

    g = torch.Generator(device=device).manual_seed(seed)
    lay = build_routing_layout(make_routing(routing, T, E, K, seed=seed).to(device), E, 128)
    h = torch.randn(lay.n_cap, F, device=device, generator=g).bfloat16()
    w2 = (torch.randn(E, D, F, device=device, generator=g) / F ** 0.5).bfloat16()
    sc = torch.rand(T, K, device=device, generator=g)
    return lay, h, w2, sc


def test_ws_gemm2_fwd_refuses_what_it_cannot_take():
    from titan_megamoe.kernels import ws_gemm2

    lay, h, w2, sc = _operands(64, 4, 2, 256, 128, "uniform", 0, "cpu")
    reason = ws_gemm2.ws_gemm2_fwd_supported(h, w2)
    assert reason is not None and ("sm_90" in reason or "Gluon" in reason)
    with pytest.raises(ValueError, match="ws_gemm2_fwd: "):
        ws_gemm2.ws_gemm2_fwd(h, w2, sc, lay)
    with pytest.raises(ValueError, match="ws_gemm2_fwd: scores must be a contiguous torch.float32"):
        ws_gemm2.ws_gemm2_fwd(h, w2, sc.double(), lay)


def test_ws_gemm2_switch_dispatches_the_token_major_default_launch_only(monkeypatch):
    """``WS_GEMM2`` (default on since session 32) sends ``gemm2_scatter_fwd`` / ``launch_gemm2_scatter_fwd`` to the Gluon kernel where it
    applies (default config, token-major output, D >= 2048); ``by_row``, an explicit config and small D keep the Triton
    kernel (the launchers are replaced by recorders: no GPU, nothing compiled)."""
    from titan_megamoe import switches
    from titan_megamoe.kernels import grouped_gemm as G
    from titan_megamoe.kernels import ws_gemm2
    from titan_megamoe.kernels.configs import config_for

    if not ws_gemm2.HAVE_GLUON:
        pytest.skip("this Triton has no Gluon Hopper API")
    calls = []
    monkeypatch.setattr(ws_gemm2, "_platform_reason", lambda t: None)  # as on an sm_90 GPU
    monkeypatch.setattr(ws_gemm2, "launch_gemm2_fwd", lambda h, w2, sc, lay, y, *a, **k: calls.append("gluon") or y)
    monkeypatch.setattr(G, "launch", lambda kernel, grid, *a, **k: calls.append("triton"))
    monkeypatch.setattr(G, "interpret_mode", lambda: False)  # the GPU's configs (block_m 128), not the interpreter's
    monkeypatch.setattr(G, "persistent_programs", lambda dev, tiles, interpret: 132)
    D, F = 2048, 128
    lay, h, w2, sc = _operands(64, 4, 2, D, F, "uniform", 1, "cpu")

    def which(**kw):
        calls.clear()
        G.gemm2_scatter_fwd(h, w2, sc, lay, **kw)
        G.launch_gemm2_scatter_fwd(h, w2, sc, lay)
        return calls[:]

    assert which() == ["gluon", "gluon"]
    with switches.override({"TITAN_MEGAMOE_WS_GEMM2": "0"}):
        assert which() == ["triton", "triton"]
    with switches.override({"TITAN_MEGAMOE_WS_GEMM2": "1"}):
        assert which() == ["gluon", "gluon"]
        assert which(by_row=True)[0] == "triton"
        assert which(config=config_for("gemm2", D, F, False))[0] == "triton"
        lay_s, h_s, w2_s, sc_s = _operands(64, 4, 2, 1024, F, "uniform", 1, "cpu")
        calls.clear()
        G.gemm2_scatter_fwd(h_s, w2_s, sc_s, lay_s)
        assert calls == ["triton"], "D < 2048 keeps the Triton kernel"
    assert which() == ["gluon", "gluon"]


def _reference(h, w2, sc, lay):
    """fp32 y[p] = score[p] * (h[r] @ w2[e].T) from the definitions, (P, D), NaN where no row holds p."""
    n = int(lay.offsets[-1])
    P, D = sc.numel(), w2.shape[1]
    y = torch.full((P, D), float("nan"), device=h.device)
    off = lay.offsets.tolist()
    pair = lay.row_pair.long()
    for e in range(w2.shape[0]):
        a, b = off[e], off[e + 1]
        rows = torch.arange(a, b, device=h.device)
        rows = rows[pair[a:b] >= 0]
        if rows.numel():
            p = pair[rows]
            y[p] = (h[rows].float() @ w2[e].float().T) * sc.reshape(-1)[p][:, None]
    assert n == off[-1]
    return y


@pytest.mark.cuda
@pytest.mark.parametrize("case", [
    (4096, 16, 4, 2048, 256, "uniform"), (1000, 8, 1, 2048, 128, "uniform"), (3000, 32, 4, 2048, 192, "zero_expert"),
    (2048, 16, 2, 2304, 256, "one_expert"), (2000, 8, 2, 2048, 128, "skewed"), (16384, 128, 8, 2048, 768, "uniform"),
    (16384, 128, 8, 4096, 1536, "uniform"),
], ids=["uniform", "top1-odd-T", "zero-expert", "one-expert", "skewed", "30b", "235b"])
@pytest.mark.parametrize("config", ["wide", "n128"])
def test_ws_gemm2_fwd_matches_triton_and_fp32_on_gpu(case, config):
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs an sm_90 GPU")
    from titan_megamoe import switches
    from titan_megamoe.kernels.grouped_gemm import gemm2_scatter_fwd
    from titan_megamoe.kernels.ws_gemm2 import GEMM2_CONFIG, ws_gemm2_fwd
    from titan_megamoe.testing import rel_err

    T, E, K, D, F, routing = case
    lay, h, w2, sc = _operands(T, E, K, D, F, routing, 9, "cuda")
    cfg = GEMM2_CONFIG if config == "wide" else dataclasses.replace(GEMM2_CONFIG, block_n=128, stages=6)
    y = torch.full((T * K, D), float("nan"), device="cuda", dtype=torch.bfloat16)
    ws_gemm2_fwd(h, w2, sc, lay, out=y, cfg=cfg)
    with switches.override({"TITAN_MEGAMOE_WS_GEMM2": "0"}):  # the Triton kernel
        tri = gemm2_scatter_fwd(h, w2, sc, lay)
    ref = _reference(h, w2, sc, lay)
    placed = ~torch.isnan(ref[:, 0])
    assert not torch.isnan(y[placed]).any(), "placed pairs left unwritten"
    assert torch.isnan(y[~placed]).all(), "pairs without a row were written"
    assert rel_err(y[placed], ref[placed]) < 1e-2
    assert torch.equal(y[placed], tri[placed]), "not bitwise the Triton kernel (same K order, fp32 accumulation)"
    # a second launch into a new poisoned output: the same bits (deterministic)
    y2 = torch.full_like(y, float("nan"))
    ws_gemm2_fwd(h, w2, sc, lay, out=y2, cfg=cfg)
    assert torch.equal(y[placed], y2[placed])


if __name__ == "__main__":
    if sys.argv[1:2] == ["compile-sm90"]:
        print(json.dumps(_compile_sm90_all()))
    else:
        raise SystemExit("usage: python tests/test_ws_gemm2.py compile-sm90")
