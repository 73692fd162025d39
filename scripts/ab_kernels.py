"""Interleaved A/B of kernel variants (GPU only) at the 30B and 235B shapes: the bf16 GEMM1 dgrad (Triton, Gluon
cooperative, Gluon split_n; the Gluon kernel's tile order, group_m 1 / 4 / 8 or expert-major; persistent or one
program per tile), the bf16 GEMM1 forward's tile order and grid, the bf16 wgrads (Gluon default, split_n)
and the bf16 GEMM2 dgrad (Triton two programs per SM, one per SM, 128 x 256 tiles at 16 warps; Gluon with one
m64n128 accumulator per consumer or two m64n64 ones); the FP8 GEMM2 dgrad (Gluon cooperative, Gluon ping-pong,
Triton); the FP8 GEMM1 forward, GEMM1 dgrad and GEMM2 forward on 128 x 128 and 128 x 256 tiles.

Why: timing variants one after the other with ``do_bench`` favours the first (session 27, one H100: the same Gluon
GEMM1 dgrad took 1.212 ms timed first and 1.343 ms timed second; the card's power cap lowers clocks as it heats).
Here every round times each variant once, in a rotated order, and the report is the median over rounds.

    python scripts/ab_kernels.py [--shapes 30b,235b] [--groups gemm2_dgrad,...] [--rounds 8] [--reps 10] [--out f.json]

Per variant and round: 2 untimed launches, then ``--reps`` back-to-back launches between two CUDA events (ms per
launch). Outputs are compared bit for bit with the first variant of their group (the GEMM2 dgrad's d score partials
are left out: the Gluon kernel sums them in another order). As an Nsight Compute launcher: ``--rounds 1 --reps 1``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

SHAPES = {"30b": (2048, 768), "235b": (4096, 1536)}


def _time(fn, reps: int) -> float:
    fn()
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def _groups(shape: str):
    """{group: [(variant, fn returning its outputs)]} at one shape, inputs as scripts/bench_ws_gemm.py's."""
    import dataclasses

    from titan_megamoe.kernels._bwd_common import default_bwd_config
    from titan_megamoe.kernels.configs import HOPPER_GEMM2, HOPPER_GEMM2_PERSISTENT
    from titan_megamoe.kernels.grouped_gemm import gemm2_scatter_fwd
    from titan_megamoe.kernels.grouped_gemm_bwd import gemm1_dgrad, gemm2_dgrad_swiglu_bwd
    from titan_megamoe.kernels.routing import build_routing_layout
    from titan_megamoe.kernels.grouped_gemm_wgrad import _ws_wgrad_config
    from titan_megamoe.kernels.ws_gemm import (CONFIGS, FWD_CONFIG, G2D_CONFIG, G2D_SPLIT_CONFIG, ws_gemm1_dgrad,
                                               ws_gemm1_fwd, ws_gemm2_dgrad)
    from titan_megamoe.kernels import ws_wgrad
    from titan_megamoe.kernels.ws_wgrad import SPLIT_CONFIG, WGRAD_CONFIG, ws_wgrad_w2, ws_wgrad_w13
    from titan_megamoe.kernels.ws_gemm2 import GEMM2_CONFIG, ws_gemm2_fwd
    from titan_megamoe.testing import make_routing

    D, F = SHAPES[shape]
    T, E, K = 16384, 128, 8
    g = torch.Generator(device="cuda").manual_seed(0)
    lay = build_routing_layout(make_routing("uniform", T, E, K, seed=0).cuda(), E, 128)
    n = int(lay.offsets[-1])
    pad = lay.row_pair[:n] < 0
    dgu = (torch.randn(lay.n_cap, 2 * F, device="cuda", generator=g) * 0.1).bfloat16()
    dgu[:n][pad] = 0
    w1 = (torch.randn(E, F, D, device="cuda", generator=g) / F ** 0.5).bfloat16()
    w3 = (torch.randn(E, F, D, device="cuda", generator=g) / F ** 0.5).bfloat16()
    x = torch.randn(T, D, device="cuda", generator=g).bfloat16()
    dout = torch.randn(T, D, device="cuda", generator=g).bfloat16()
    hs = torch.randn(lay.n_cap, F, device="cuda", generator=g).bfloat16()
    hs[:n][pad] = 0
    dx = torch.empty(lay.n_cap, D, device="cuda", dtype=torch.bfloat16)

    tri_cfg = default_bwd_config("gemm1_dgrad", lay, D, F)  # an explicit config: the Triton kernel, never Gluon

    def triton_dgrad():
        return gemm1_dgrad(dgu, w1, w3, lay, tri_cfg, out=dx)[:n]

    gu = (torch.randn(lay.n_cap, 2 * F, device="cuda", generator=g) * 2).bfloat16()
    scores = torch.rand(T, K, device="cuda", generator=g)
    hs2 = torch.empty_like(hs)
    g2_out = (torch.empty(lay.n_cap, 2 * F, device="cuda", dtype=torch.bfloat16),
              torch.empty(lay.n_cap, F // 128, device="cuda"))
    g2_two = default_bwd_config("gemm2_dgrad", lay, D, F)  # two programs per SM at D >= 2048
    g2_one = dataclasses.replace(g2_two, num_stages=4, maxnreg=None)  # session 9's one-per-SM config

    # one program per SM on 128 x 256 tiles, 16 warps (2 x 2 warpgroups of m64n128): per thread the registers of the
    # two-per-SM 128 x 128 config (sm_90a: 128 registers, 16 B of stack), wgmma's B tile read by 2 warpgroups, not 4
    g2_wide = {s: dataclasses.replace(g2_two, block_n=256, num_warps=16, num_stages=s) for s in (3, 4)}
    g2_out_wide = (g2_out[0], torch.empty(lay.n_cap, F // 256, device="cuda"))

    def gemm2_dgrad(cfg):
        out = g2_out if cfg.block_n == 128 else g2_out_wide
        gemm2_dgrad_swiglu_bwd(dout, w2t, gu, scores, lay, cfg, out=out, hs_out=hs2)
        return g2_out[0][:n], hs2[:n]

    def gluon_gemm2_dgrad(cfg):
        ws_gemm2_dgrad(dout, w2t, gu, scores, lay, out=g2_out, hs_out=hs2, cfg=cfg)
        return g2_out[0][:n], hs2[:n]

    w2t = (torch.randn(E, D, F, device="cuda", generator=g) / D ** 0.5).bfloat16()
    coop = CONFIGS["coop"]
    o13 = tuple(torch.empty(E, F, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    o2 = torch.empty(E, D, F, device="cuda", dtype=torch.bfloat16)
    # GEMM2 forward: the persistent 8-warp default (235 registers, 3 stages) against 16 warps (2 x 2 warpgroups of
    # m64n128: 118 registers; 4 stages do not fit the flattened loop's shared memory) and the grid kernels
    # (sm_90a, checked on the CPU: 16 warps x 4 stages 196,608 B, 94-106 registers, no spills)
    y_pairs = torch.empty(T * K, D, device="cuda", dtype=torch.bfloat16)
    g2f = {"persistent 8w 3st": HOPPER_GEMM2_PERSISTENT,
           "persistent 16w 3st": dataclasses.replace(HOPPER_GEMM2_PERSISTENT, num_warps=16),
           "grid 8w 4st": HOPPER_GEMM2,
           "grid 16w 4st": dataclasses.replace(HOPPER_GEMM2, num_warps=16)}

    def gemm2_fwd(cfg):
        return gemm2_scatter_fwd(hs, w2t_fwd, scores, lay, out_pairs=y_pairs, config=cfg)

    def gluon_gemm2_fwd(cfg):  # the warp-specialized GEMM2 (ws_gemm2, WS_GEMM2), into the same output
        return ws_gemm2_fwd(hs, w2t_fwd, scores, lay, out=y_pairs, cfg=cfg)

    w2t_fwd = (torch.randn(E, D, F, device="cuda", generator=g) / F ** 0.5).bfloat16()
    # padding-aware variants against the full ones (half the experts end in a tile whose second 64 rows are padding)
    # zeros, not empty: rows past the last expert stay unwritten, and an uninitialized NaN pattern is unequal to itself
    # (session 32's forward groups read "bitwise False" for that reason alone)
    gu1 = torch.zeros(lay.n_cap, 2 * F, device="cuda", dtype=torch.bfloat16)
    h1 = torch.zeros(lay.n_cap, F, device="cuda", dtype=torch.bfloat16)
    wcfg = _ws_wgrad_config(D)

    def trim(on, fn):  # the wgrads' trim is on by default (WGRAD_TRIM_K): its "False" rows turn it off per launch
        def run():
            old, ws_wgrad.TRIM_K = ws_wgrad.TRIM_K, on
            try:
                return fn()
            finally:
                ws_wgrad.TRIM_K = old
        return run

    skip_groups = {
        "gemm1_fwd_skip": [(f"skip_empty {on}", lambda on=on: ws_gemm1_fwd(
            x, w1, w3, lay, gate_up_out=gu1, h_out=h1, cfg=dataclasses.replace(FWD_CONFIG, skip_empty=on)))
            for on in (True, False)],
        "gemm1_dgrad_skip": [(f"skip_empty {on}", lambda on=on: ws_gemm1_dgrad(
            dgu, w1, w3, lay, out=dx, cfg=dataclasses.replace(coop, skip_empty=on))[:n]) for on in (True, False)],
        "wgrad_w13_trim": [(f"trim_k {on}", trim(on, lambda on=on: ws_wgrad_w13(
            dgu, x, lay, out=o13, cfg=dataclasses.replace(wcfg, trim_k=on)))) for on in (True, False)],
        "wgrad_w2_trim": [(f"trim_k {on}", trim(on, lambda on=on: ws_wgrad_w2(
            dout, hs, lay, out=o2, cfg=dataclasses.replace(wcfg, trim_k=on)))) for on in (True, False)],
    }
    # one program per tile (WS_GEMM1_GRID) against the persistent default: tiles started in order by the hardware
    skip_groups.update({
        "gemm1_fwd_grid": [(name, lambda p=p: ws_gemm1_fwd(x, w1, w3, lay, gate_up_out=gu1, h_out=h1,
                                                           programs=p))
                           for name, p in (("persistent", None),
                                           ("grid", lay.n_tiles_cap * (F // FWD_CONFIG.block_n)))]
        + [("grid expert order", lambda: ws_gemm1_fwd(x, w1, w3, lay, gate_up_out=gu1, h_out=h1,
                                                      cfg=dataclasses.replace(FWD_CONFIG, group_m=0),
                                                      programs=lay.n_tiles_cap * (F // FWD_CONFIG.block_n)))],
        "gemm1_dgrad_grid": [(name, lambda p=p: ws_gemm1_dgrad(dgu, w1, w3, lay, out=dx, cfg=coop, programs=p)[:n])
                             for name, p in (("persistent", None), ("grid", lay.n_tiles_cap * (D // coop.block_n)))]
        + [("grid expert order", lambda: ws_gemm1_dgrad(dgu, w1, w3, lay, out=dx,
                                                        cfg=dataclasses.replace(coop, group_m=0),
                                                        programs=lay.n_tiles_cap * (D // coop.block_n))[:n])],
    })
    # tiles in order from a per-launch counter, persistent (WS_GEMM1_DYNAMIC), against the grid and the default
    fwd_tiles = lay.n_tiles_cap * (F // FWD_CONFIG.block_n)
    dgrad_tiles = lay.n_tiles_cap * (D // coop.block_n)
    skip_groups.update({
        "gemm1_fwd_dynamic": [(name, lambda c=c, p=p: ws_gemm1_fwd(x, w1, w3, lay, gate_up_out=gu1, h_out=h1,
                                                                   cfg=dataclasses.replace(FWD_CONFIG, **c), programs=p))
                              for name, c, p in (("persistent", {}, None), ("grid", {}, fwd_tiles),
                                                 ("dynamic", {"dynamic": True}, None),
                                                 ("dynamic expert order", {"dynamic": True, "group_m": 0}, None),
                                                 ("grid expert order", {"group_m": 0}, fwd_tiles))],
        "gemm1_dgrad_dynamic": [(name, lambda c=c, p=p: ws_gemm1_dgrad(dgu, w1, w3, lay, out=dx,
                                                                       cfg=dataclasses.replace(coop, **c), programs=p)[:n])
                                for name, c, p in (("persistent", {}, None), ("grid", {}, dgrad_tiles),
                                                   ("dynamic", {"dynamic": True}, None),
                                                   ("dynamic expert order", {"dynamic": True, "group_m": 0}, None),
                                                   ("grid expert order", {"group_m": 0}, dgrad_tiles))],
    })
    skip_groups["gemm1_fwd_order"] = [
        (f"group_m {m}" if m else "expert order", lambda m=m: ws_gemm1_fwd(
            x, w1, w3, lay, gate_up_out=gu1, h_out=h1, cfg=dataclasses.replace(FWD_CONFIG, group_m=m)))
        for m in (1, 0)]
    flops = {"gemm1_fwd_order": 4 * T * K * D * F, "gemm1_fwd_grid": 4 * T * K * D * F,
             "gemm1_fwd_dynamic": 4 * T * K * D * F, "gemm1_dgrad_dynamic": 4 * T * K * D * F,
             "gemm1_dgrad_grid": 4 * T * K * D * F,
             "gemm1_fwd_skip": 4 * T * K * D * F, "gemm1_dgrad_skip": 4 * T * K * D * F,
             "wgrad_w13_trim": 4 * T * K * D * F, "wgrad_w2_trim": 2 * T * K * D * F,
             "gemm2_fwd": 2 * T * K * D * F, "gemm2_fwd_gluon": 2 * T * K * D * F, "gemm1_dgrad": 4 * T * K * D * F, "gemm1_dgrad_order": 4 * T * K * D * F, "wgrad_w13": 4 * T * K * D * F,
             "wgrad_w2": 2 * T * K * D * F, "gemm2_dgrad": 2 * T * K * D * F}
    groups = {
        "gemm1_dgrad": [("triton", triton_dgrad),
                        ("gluon coop", lambda: ws_gemm1_dgrad(dgu, w1, w3, lay, out=dx, cfg=CONFIGS["coop"])[:n]),
                        ("gluon split", lambda: ws_gemm1_dgrad(dgu, w1, w3, lay, out=dx, cfg=CONFIGS["split"])[:n])],
        "gemm1_dgrad_order": [(f"gluon group_m {m}", lambda m=m: ws_gemm1_dgrad(
            dgu, w1, w3, lay, out=dx, cfg=dataclasses.replace(coop, group_m=m))[:n]) for m in (1, 4, 8)]
        + [("gluon expert order", lambda: ws_gemm1_dgrad(dgu, w1, w3, lay, out=dx,
                                                         cfg=dataclasses.replace(coop, group_m=0))[:n])],
        "gemm2_fwd": [(name, lambda c=c: gemm2_fwd(c)) for name, c in g2f.items()],
        "gemm2_fwd_gluon": [("triton persistent 8w 3st", lambda: gemm2_fwd(HOPPER_GEMM2_PERSISTENT)),
                            ("gluon 128x256 4st", lambda: gluon_gemm2_fwd(GEMM2_CONFIG)),
                            ("gluon 128x128 6st", lambda: gluon_gemm2_fwd(
                                dataclasses.replace(GEMM2_CONFIG, block_n=128, stages=6)))],
        "gemm2_dgrad": [("triton 2/SM", lambda: gemm2_dgrad(g2_two)),
                        ("triton 1/SM", lambda: gemm2_dgrad(g2_one)),
                        ("triton 128x256 16w 3st", lambda: gemm2_dgrad(g2_wide[3])),
                        ("triton 128x256 16w 4st", lambda: gemm2_dgrad(g2_wide[4])),
                        ("gluon m64n128", lambda: gluon_gemm2_dgrad(G2D_CONFIG)),
                        ("gluon split m64n64", lambda: gluon_gemm2_dgrad(G2D_SPLIT_CONFIG))],
        "wgrad_w13": [("gluon default", lambda: ws_wgrad_w13(dgu, x, lay, out=o13, cfg=WGRAD_CONFIG)),
                      ("gluon split", lambda: ws_wgrad_w13(dgu, x, lay, out=o13, cfg=SPLIT_CONFIG))],
        "wgrad_w2": [("gluon default", lambda: ws_wgrad_w2(dout, hs, lay, out=o2, cfg=WGRAD_CONFIG)),
                     ("gluon split", lambda: ws_wgrad_w2(dout, hs, lay, out=o2, cfg=SPLIT_CONFIG))],
    }
    groups.update(skip_groups)
    # the FP8 GEMM2 dgrad (session 36): the cooperative Gluon kernel first (the ping-pong one must equal it bit for bit),
    # the ping-pong one at 6 and 5 stages, the Triton kernel with the backward's config (dgate_up equal to rounding
    # only: "bitwise False" is expected there). Operands as bench_ws_gemm.py's, made on the group's first call; each
    # config's first launch writes into NaN-poisoned outputs (the bitwise check is that launch: a missed tile shows)
    g2d8_state, poisoned = {}, set()

    def g2d8(cfg):
        from titan_megamoe.kernels.grouped_gemm_fp8_bwd import gemm2_dgrad_swiglu_bwd_fp8
        from titan_megamoe.kernels.ws_gemm2_dgrad_fp8 import launch_gemm2_dgrad_fp8, ws_gemm2_dgrad_fp8

        if not g2d8_state:
            from bench_ws_gemm import _g2d_fp8_operands

            ops, _ = _g2d_fp8_operands(shape)
            g2d8_state.update(ops=ops, n=int(ops[-1].offsets[-1]), out=ws_gemm2_dgrad_fp8(*ops))
        ops, n8, out = g2d8_state["ops"], g2d8_state["n"], g2d8_state["out"]
        if cfg is None:
            res = gemm2_dgrad_swiglu_bwd_fp8(*ops)
        else:
            if ("g2d", repr(cfg)) not in poisoned:
                poisoned.add(("g2d", repr(cfg)))
                for t in out:
                    t.view(torch.uint8).fill_(0x7F) if t.dtype == torch.float8_e4m3fn else t.fill_(float("nan"))
            launch_gemm2_dgrad_fp8(*ops, *out, None, cfg)
            res = out
        return res[0][:n8], res[1][:n8], res[2][:, :n8].view(torch.uint8), res[3][: n8 // 128]

    from titan_megamoe.kernels.ws_gemm2_dgrad_fp8 import GEMM2_DGRAD_FP8_CONFIG, GEMM2_DGRAD_FP8_PINGPONG

    groups["gemm2_dgrad_fp8"] = [("gluon coop", lambda: g2d8(GEMM2_DGRAD_FP8_CONFIG)),
                                 ("gluon pingpong 6st", lambda: g2d8(GEMM2_DGRAD_FP8_PINGPONG)),
                                 ("gluon pingpong 5st", lambda: g2d8(dataclasses.replace(GEMM2_DGRAD_FP8_PINGPONG,
                                                                                          stages=5))),
                                 ("triton", lambda: g2d8(None))]
    flops["gemm2_dgrad_fp8"] = 2 * T * K * D * F
    # the FP8 GEMM1 forward on its default 128 x 128 tiles and on the wide 128 x 256 ones (session 36, opt-in: the
    # gathered x rows of a stage feed twice the columns), with two register splits; all bitwise the default
    g1f8_state = {}

    def g1f8(cfg):
        from titan_megamoe.kernels.fp8_quant import quantize_act_1x128, quantize_weight_128x128
        from titan_megamoe.kernels.ws_gemm_fp8 import launch_gemm1_fwd_fp8

        if not g1f8_state:
            xq = quantize_act_1x128(x)
            w13 = [quantize_weight_128x128(w) for w in (w1, w3)]
            g1f8_state.update(ops=(*xq, *w13[0], *w13[1], lay), out=(torch.zeros_like(gu1), torch.zeros_like(h1)))
        if ("g1f", repr(cfg)) not in poisoned:  # as the GEMM2 dgrad group: the bitwise check on poisoned outputs
            poisoned.add(("g1f", repr(cfg)))
            for t in g1f8_state["out"]:
                t.fill_(float("nan"))
        launch_gemm1_fwd_fp8(*g1f8_state["ops"], *g1f8_state["out"], cfg)
        return g1f8_state["out"][0][:n], g1f8_state["out"][1][:n]

    from titan_megamoe.kernels.ws_gemm_fp8 import FP8_FWD_CONFIG, FP8_FWD_WIDE_CONFIG

    groups["gemm1_fwd_fp8_wide"] = [
        ("default 128x128", lambda: g1f8(FP8_FWD_CONFIG)),
        ("wide 232/48 regs", lambda: g1f8(FP8_FWD_WIDE_CONFIG)),
        ("wide 216/72 regs", lambda: g1f8(dataclasses.replace(FP8_FWD_WIDE_CONFIG, consumer_regs=216,
                                                              producer_regs=72))),
        ("wide 3 stages", lambda: g1f8(dataclasses.replace(FP8_FWD_WIDE_CONFIG, stages=3)))]
    flops["gemm1_fwd_fp8_wide"] = 4 * T * K * D * F

    # h quantized in the GEMM1 epilogue (session 38, FP8_GEMM1_QUANT_H) against GEMM1 then the 1x128 pass over the
    # bf16 h (the default forward's two launches); outputs (gate_up, h e4m3 bits, h scales) on the live rows
    def g1q(fused, cfg):
        from titan_megamoe.kernels.fp8_quant import launch_quant_act_1x128
        from titan_megamoe.kernels.ws_gemm_fp8 import launch_gemm1_fwd_fp8

        if not g1f8_state:
            g1f8(FP8_FWD_CONFIG)
        gu_o, h_o = g1f8_state["out"]
        st = g1f8_state.setdefault("qh", dict(count=torch.zeros(1, dtype=torch.int32, device="cuda"),
                                              hq=torch.empty(lay.n_cap, F, device="cuda", dtype=torch.float8_e4m3fn),
                                              hs=torch.empty(lay.n_cap, F // 128, device="cuda")))
        if fused:
            launch_gemm1_fwd_fp8(*g1f8_state["ops"], gu_o, st["hq"], cfg, None, st["hs"], st["count"])
            hq, hs = st["hq"], st["hs"]
        else:
            launch_gemm1_fwd_fp8(*g1f8_state["ops"], gu_o, h_o, cfg)
            hq, hs = launch_quant_act_1x128(h_o, st["count"], row_valid=lay.row_pair)
        return gu_o[:n], hq[:n].view(torch.uint8), hs[:n]

    groups["gemm1_fwd_fp8_quant_h"] = [("gemm1 + 1x128 pass", lambda: g1q(False, FP8_FWD_CONFIG)),
                                       ("wide + 1x128 pass", lambda: g1q(False, FP8_FWD_WIDE_CONFIG)),
                                       ("wide, h quantized", lambda: g1q(True, FP8_FWD_WIDE_CONFIG))]
    flops["gemm1_fwd_fp8_quant_h"] = 4 * T * K * D * F
    # the FP8 GEMM1 dgrad and GEMM2 forward on their 128 x 128 tiles and on the wide 128 x 256 ones (session 37,
    # opt-in: a stage's A rows feed twice the columns); bitwise the default, each config's first launch poisoned
    k8_state = {}

    def k8(kind, cfg):
        from titan_megamoe.kernels.fp8_quant import quantize_act_1x128, quantize_weight_128x128
        from titan_megamoe.kernels.ws_gemm_fp8 import launch_gemm1_dgrad_fp8, launch_gemm2_fwd_fp8

        if not k8_state:
            wt = [quantize_weight_128x128(w.transpose(1, 2).contiguous()) for w in (w1, w3)]
            w2q = quantize_weight_128x128((torch.randn(E, D, F, device="cuda", generator=g) / F ** 0.5).bfloat16())
            scores = torch.rand(T, K, device="cuda", generator=g)
            k8_state.update(dgrad=(*quantize_act_1x128(dgu), *wt[0], *wt[1], lay),
                            gemm2=(*quantize_act_1x128(hs), *w2q, scores, lay),
                            out=dict(dgrad=torch.zeros_like(dx), gemm2=torch.zeros(T * K, D, device="cuda",
                                                                                    dtype=torch.bfloat16)))
        out = k8_state["out"][kind]
        if (kind, repr(cfg)) not in poisoned:
            poisoned.add((kind, repr(cfg)))
            out.fill_(float("nan"))
        (launch_gemm1_dgrad_fp8 if kind == "dgrad" else launch_gemm2_fwd_fp8)(*k8_state[kind], out, cfg)
        return out[:n] if kind == "dgrad" else out

    from titan_megamoe.kernels.ws_gemm_fp8 import (DGRAD_FP8_CONFIG, DGRAD_FP8_WIDE_CONFIG, GEMM2_FP8_CONFIG,
                                                   GEMM2_FP8_WIDE_CONFIG)

    groups["gemm1_dgrad_fp8_wide"] = [("default 128x128", lambda: k8("dgrad", DGRAD_FP8_CONFIG)),
                                      ("wide 4 stages", lambda: k8("dgrad", DGRAD_FP8_WIDE_CONFIG)),
                                      ("wide 3 stages", lambda: k8("dgrad", dataclasses.replace(DGRAD_FP8_WIDE_CONFIG,
                                                                                                stages=3)))]
    flops["gemm1_dgrad_fp8_wide"] = 4 * T * K * D * F
    groups["gemm2_fwd_fp8_wide"] = [("default 128x128", lambda: k8("gemm2", GEMM2_FP8_CONFIG)),
                                    ("wide 4 stages", lambda: k8("gemm2", GEMM2_FP8_WIDE_CONFIG)),
                                    ("wide 3 stages", lambda: k8("gemm2", dataclasses.replace(GEMM2_FP8_WIDE_CONFIG,
                                                                                              stages=3)))]
    flops["gemm2_fwd_fp8_wide"] = 2 * T * K * D * F
    # the FP8 wgrads (the op's operands: dout, x gathered 128x1; s * h, dgate_up dual-quantized) with one or two
    # output staging tiles per consumer (session 38, opt-in); bitwise the default, first launch poisoned
    w8_state = {}

    def w8(kind, cfg):
        from titan_megamoe.kernels.fp8_quant_bwd import quantize_dual_1x128_128x1_t, quantize_gather_128x1_t
        from titan_megamoe.kernels.ws_wgrad_fp8 import ws_wgrad_fp8

        if not w8_state:
            valid = lay.row_pair >= 0
            w8_state.update(w2=(*quantize_gather_128x1_t(dout, lay.row_pair, K),
                                *quantize_dual_1x128_128x1_t(hs, valid)[2:]),
                            w13=(*quantize_dual_1x128_128x1_t(dgu, valid)[2:],
                                 *quantize_gather_128x1_t(x, lay.row_pair, K)),
                            out=dict(w2=(o2,), w13=o13))
        out = w8_state["out"][kind]
        if (kind, repr(cfg)) not in poisoned:
            poisoned.add((kind, repr(cfg)))
            for t in out:
                t.fill_(float("nan"))
        return ws_wgrad_fp8(*w8_state[kind], lay, split=F if kind == "w13" else None, out=out, cfg=cfg)

    from titan_megamoe.kernels.ws_wgrad_fp8 import FP8_WGRAD_CONFIG, FP8_WGRAD_EPI2_CONFIG, FP8_WGRAD_N128_CONFIG

    # session 40: one m64n128 MMA chain per consumer (Fp8WgradConfig.mma_n), with one or two staging tiles
    for kind, fl in (("w13", 4 * T * K * D * F), ("w2", 2 * T * K * D * F)):
        groups[f"wgrad_{kind}_fp8"] = [
            ("default", lambda kind=kind: w8(kind, FP8_WGRAD_CONFIG)),
            ("2 staging tiles", lambda kind=kind: w8(kind, FP8_WGRAD_EPI2_CONFIG)),
            ("n128", lambda kind=kind: w8(kind, FP8_WGRAD_N128_CONFIG)),
            ("n128 2 staging 4 stages", lambda kind=kind: w8(kind, dataclasses.replace(FP8_WGRAD_N128_CONFIG,
                                                                                          epilogue_buffers=2,
                                                                                          stages=4)))]
        flops[f"wgrad_{kind}_fp8"] = fl
    # session 40: the expert weights' FP8 copies, made once per optimizer step in training (not in compare.layer's
    # default timing): 128x128 quantization then PyTorch's strided copy of the e4m3 tensor for the transposed copy,
    # against the transposed copy stored by the quantizing kernel (quantize_weight_128x128_t); bitwise the same
    from titan_megamoe.kernels.fp8_quant import quantize_weight_128x128, quantize_weight_128x128_t

    w2 = (torch.randn(E, D, F, device="cuda", generator=g) / D ** 0.5).bfloat16()

    def wq_torch_t():
        out = []
        for w in (w1, w3, w2):
            q, s = quantize_weight_128x128(w)
            out += [q, s, q.transpose(1, 2).contiguous(), s.transpose(1, 2).contiguous()]
        return tuple(out)

    def wq_fused_t():
        return tuple(t for w in (w1, w3, w2) for t in quantize_weight_128x128_t(w))

    groups["fp8_weight_quant"] = [("quant + torch transpose", wq_torch_t), ("fused transposed", wq_fused_t)]
    flops["fp8_weight_quant"] = 0
    return groups, flops


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="30b,235b")
    p.add_argument("--groups", default=None, help="comma-separated kernel groups, run in this order (default: all)")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--out", default=None)
    p.add_argument("--unfence-dynamic", action="store_true",
                   help="allow the counter schedule (ws_gemm.DYNAMIC_FENCED) for the *_dynamic groups: debugging only")
    a = p.parse_args(argv)
    if a.unfence_dynamic:
        from titan_megamoe.kernels import ws_gemm

        ws_gemm.DYNAMIC_FENCED = False
    if not torch.cuda.is_available():
        print("ab_kernels: needs a CUDA GPU", file=sys.stderr)
        return 2
    rows = []
    for shape in a.shapes.split(","):
        groups, flops = _groups(shape)
        wanted = a.groups.split(",") if a.groups else list(groups)  # in the order asked: the first ones matter most
        unknown = [g for g in wanted if g not in groups]
        if unknown:
            print(f"ab_kernels: unknown groups {unknown}; known: {', '.join(groups)}", file=sys.stderr)
            return 2
        for group in wanted:
            variants = groups[group]
            first = [t.clone() for t in _as_tuple(variants[0][1]())]
            same = {name: all(torch.equal(_bits(u), _bits(v)) for u, v in zip(_as_tuple(fn()), first))
                    for name, fn in variants}
            times = {name: [] for name, _ in variants}
            for r in range(a.rounds):
                k = r % len(variants)
                for name, fn in variants[k:] + variants[:k]:  # rotated order
                    times[name].append(_time(fn, a.reps))
            base = statistics.median(times[variants[0][0]])
            for name, _ in variants:
                ms = statistics.median(times[name])
                rows.append(dict(shape=shape, group=group, variant=name, ms=ms, tflops=flops[group] / ms / 1e9,
                                 vs_first=ms / base, rounds_ms=times[name], bitwise_first=same[name]))
                print(f"{shape:5s} {group:12s} {name:14s} {ms:7.3f} ms {rows[-1]['tflops']:5.0f} TF/s "
                      f"x{ms / base:.3f} of {variants[0][0]}  bitwise {same[name]}", flush=True)
            _write(a, rows)  # after every group: a run cut short by a time limit keeps what it measured
    _write(a, rows)
    return 0


def _write(a, rows: list[dict]) -> None:
    if a.out:
        import triton

        with open(a.out, "w") as f:
            json.dump({"script": "scripts/ab_kernels.py", "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "triton": triton.__version__, "date": time.strftime("%Y-%m-%d"),
                       "git_rev": os.environ.get("TITAN_MEGAMOE_GIT_REV"), "rounds": a.rounds, "reps": a.reps,
                       "tokens": 16384, "top_k": 8, "experts": 128, "routing": "uniform", "rows": rows}, f, indent=1)


def _as_tuple(out):
    return out if isinstance(out, tuple) else (out,)


def _bits(t):
    """t as its raw bits (torch.equal on floats compares values: +0 == -0, NaN != NaN)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]) \
        if t.is_floating_point() else t


if __name__ == "__main__":
    raise SystemExit(main())
