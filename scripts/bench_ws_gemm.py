"""Check and time the warp-specialized Gluon GEMM1 dgrad, GEMM1 forward and GEMM2 dgrad (kernels/ws_gemm.py)
against the Triton ones (GPU only).

    python scripts/bench_ws_gemm.py check            # GEMM1 dgrad: edge-case routings, poisoned outputs
    python scripts/bench_ws_gemm.py bench [--out f]  # GEMM1 dgrad: do_bench at the 30B / 235B shapes, configs
    python scripts/bench_ws_gemm.py check-fwd        # GEMM1 forward (gathered rows, SwiGLU), same checks
    python scripts/bench_ws_gemm.py bench-fwd [--out f]
    python scripts/bench_ws_gemm.py bench-g2d [--out f]  # GEMM2 dgrad (checks: tests/test_ws_gemm.py on a GPU)
    python scripts/bench_ws_gemm.py bench-fwd-fp8 [--out f]  # blockwise-FP8 GEMM1 (kernels/ws_gemm_fp8.py) vs the
                                                             # Triton FP8 GEMM1 (checks: tests/test_ws_gemm_fp8.py)
    python scripts/bench_ws_gemm.py bench-dgrad-fp8 [--out f]  # FP8 GEMM1 dgrad, Gluon vs Triton (same checks file)
    python scripts/bench_ws_gemm.py bench-g2d-fp8 [--out f]  # FP8 GEMM2 dgrad (kernels/ws_gemm2_dgrad_fp8.py) vs the
                                                             # Triton one (checks: tests/test_ws_gemm2_dgrad_fp8.py)
    python scripts/bench_ws_gemm.py trace-g2d-fp8 [--out f]  # where its tiles' time goes (global-timer stamps)
    python scripts/bench_ws_gemm.py trace-g2d-fp8-pingpong [--out f]  # the same for its ping-pong config
    python scripts/bench_ws_gemm.py bench-g2-fp8 [--out f]  # FP8 GEMM2 (ws_gemm_fp8.ws_gemm2_fwd_fp8) vs the Triton
                                                            # one (checks: tests/test_ws_gemm_fp8.py)

check: for each case, dgate_up random (padding rows too: the kernel must zero them), dx_rows poisoned
with NaN; rows [0, offsets[E]) compared with an fp32 reference (relative error, bf16 bound 1e-2) and
with the Triton kernel (relative difference), rows of padding pairs must be exactly 0, no NaN left in
the live rows. Exit status 1 on any failure.

bench: 16384 tokens, top-8, 128 experts, near-uniform random routing; both kernels in one process,
``triton.testing.do_bench`` medians (warm-up 25 ms, 100 ms of repeats), TF/s = 2 * P * 2F * D / time,
beside the dense bf16 rate of this GPU (torch.matmul 8192^3) as the ceiling.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

SHAPES = {"30b": (2048, 768), "235b": (4096, 1536)}


def _write(out_path: str | None, what: str, rows: list[dict]) -> None:
    """The rows with their provenance (GPU, versions, date, git revision from the caller) as JSON."""
    if not out_path:
        return
    import triton

    with open(out_path, "w") as f:
        json.dump({"script": f"scripts/bench_ws_gemm.py {what}", "gpu": torch.cuda.get_device_name(),
                   "torch": torch.__version__, "triton": triton.__version__, "date": time.strftime("%Y-%m-%d"),
                   "git_rev": os.environ.get("TITAN_MEGAMOE_GIT_REV"), "tokens": 16384, "top_k": 8,
                   "experts": 128, "routing": "uniform", "rows": rows}, f, indent=1)


def _inputs(T, E, K, D, F, routing, seed):
    from titan_megamoe.kernels.routing import build_routing_layout
    from titan_megamoe.testing import make_routing

    g = torch.Generator(device="cuda").manual_seed(seed)
    ids = make_routing(routing, T, E, K, seed=seed).cuda()
    lay = build_routing_layout(ids, E, 128)
    dgu = (torch.randn(lay.n_cap, 2 * F, device="cuda", generator=g) * 0.5).to(torch.bfloat16)
    w1 = (torch.randn(E, F, D, device="cuda", generator=g) / F ** 0.5).to(torch.bfloat16)
    w3 = (torch.randn(E, F, D, device="cuda", generator=g) / F ** 0.5).to(torch.bfloat16)
    return lay, dgu, w1, w3


def _reference(lay, dgu, w1, w3):
    """fp32 dx_rows on the live rows, 0 on padding rows (same contract as the kernels)."""
    E, F, D = w1.shape
    off = lay.offsets.tolist()
    ref = torch.zeros(off[E], D, device="cuda")
    for e in range(E):
        a, b = off[e], off[e + 1]
        if b > a:
            x = dgu[a:b].float()
            ref[a:b] = x[:, :F] @ w1[e].float() + x[:, F:] @ w3[e].float()
    valid = (lay.row_pair[: off[E]] >= 0)
    return ref * valid[:, None], valid


def check() -> int:
    from titan_megamoe.kernels._bwd_common import default_bwd_config
    from titan_megamoe.kernels.grouped_gemm_bwd import gemm1_dgrad
    from titan_megamoe.kernels.ws_gemm import CONFIGS, WsConfig, ws_gemm1_dgrad

    torch.backends.cuda.matmul.allow_tf32 = False
    cases = [  # (name, T, E, K, D, F, routing, cfg)
        ("uniform", 4096, 16, 4, 512, 256, "uniform", WsConfig()),
        ("T not a multiple of BM, top_k 1", 1000, 8, 1, 256, 128, "uniform", WsConfig()),
        ("experts with zero tokens", 3000, 32, 4, 384, 192, "zero_expert", WsConfig()),
        ("all tokens to one expert", 2048, 16, 2, 256, 256, "one_expert", WsConfig()),
        ("skewed", 5000, 64, 8, 512, 128, "skewed", WsConfig()),
        ("one program (many tiles each)", 2048, 8, 4, 512, 256, "uniform", WsConfig()),
        ("3 stages, group_m 1", 2048, 8, 4, 512, 256, "uniform", WsConfig(stages=3, group_m=1)),
        ("D not a multiple of BN", 2000, 8, 2, 200, 128, "uniform", WsConfig()),
        ("30B shape", 16384, 128, 8, 2048, 768, "uniform", WsConfig()),
        ("coop, uniform", 4096, 16, 4, 512, 256, "uniform", CONFIGS["coop"]),
        ("coop, zero experts", 3000, 32, 4, 384, 192, "zero_expert", CONFIGS["coop"]),
        ("coop, one program", 2048, 8, 4, 512, 256, "uniform", CONFIGS["coop"]),
        ("coop, D not a multiple of BN", 2000, 8, 2, 200, 128, "skewed", CONFIGS["coop"]),
        ("coop, 30B shape", 16384, 128, 8, 2048, 768, "uniform", CONFIGS["coop"]),
    ]
    failed = 0
    for i, (name, T, E, K, D, F, routing, cfg) in enumerate(cases):
        lay, dgu, w1, w3 = _inputs(T, E, K, D, F, routing, seed=i + 1)
        ref, valid = _reference(lay, dgu, w1, w3)
        n = ref.shape[0]
        out = torch.full((lay.n_cap, D), float("nan"), device="cuda", dtype=torch.bfloat16)
        programs = 1 if "one program" in name else None
        t0 = time.perf_counter()
        ws_gemm1_dgrad(dgu, w1, w3, lay, out=out, cfg=cfg, programs=programs)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        tri = gemm1_dgrad(dgu, w1, w3, lay, default_bwd_config("gemm1_dgrad", lay, D, F))  # the Triton kernel
        live = out[:n].float()
        nan_rows = int(torch.isnan(live).any(1).sum())
        err = float((live - ref).norm() / ref.norm().clamp_min(1e-30))
        diff = float((live - tri[:n].float()).norm() / tri[:n].float().norm().clamp_min(1e-30))
        pad_nonzero = int((live[~valid] != 0).any(1).sum()) if (~valid).any() else 0
        bitwise = bool(torch.equal(out[:n], tri[:n]))
        ok = nan_rows == 0 and err < 1e-2 and pad_nonzero == 0
        failed += not ok
        print(json.dumps(dict(case=name, ok=ok, rel_err_vs_fp32=err, rel_diff_vs_triton=diff, bitwise_triton=bitwise,
                              nan_rows=nan_rows, nonzero_padding_rows=pad_nonzero, first_call_s=round(dt, 2),
                              cfg=repr(cfg))), flush=True)
    print(f"ws_gemm check: {len(cases) - failed}/{len(cases)} passed")
    return 1 if failed else 0


def bench(out_path: str | None, shapes: list[str]) -> int:
    import triton

    from titan_megamoe.kernels._bwd_common import default_bwd_config
    from titan_megamoe.kernels.grouped_gemm_bwd import gemm1_dgrad
    from titan_megamoe.kernels.ws_gemm import WsConfig, ws_gemm1_dgrad

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    dense_ms = triton.testing.do_bench(lambda: a @ b, warmup=25, rep=200, return_mode="median")
    dense_tf = 2 * 8192 ** 3 / dense_ms / 1e9
    del a, b
    rows = [dict(kernel="dense torch.matmul 8192^3", ms=dense_ms, tflops=dense_tf)]
    print(json.dumps(rows[-1]), flush=True)
    # session 10 swept ping-pong 128 x 128 (4 / 5 stages, group_m 1 / 8) and cooperative 128 x 256 (group_m 1 / 8 / 16):
    # the default is the last; session 27 adds its split accumulators (``split_n``: 4 stages at BK 64, 8 at BK 32)
    configs = [WsConfig(block_n=256, stages=3, coop=True, group_m=1),
               WsConfig(block_n=256, stages=4, coop=True, group_m=1, split_n=True),
               WsConfig(block_n=256, block_k=32, stages=8, coop=True, group_m=1, split_n=True),
               WsConfig(block_n=256, block_k=32, stages=6, coop=True, group_m=1)]
    for sh in shapes:
        D, F = SHAPES[sh]
        lay, dgu, w1, w3 = _inputs(16384, 128, 8, D, F, "uniform", seed=0)
        P = 16384 * 8
        flops = 2 * P * 2 * F * D
        # an explicit config: the Triton kernel (without one, gemm1_dgrad runs the Gluon default on sm_90; the rows
        # of this script before session 27 labelled "triton" timed that Gluon kernel)
        tcfg = default_bwd_config("gemm1_dgrad", lay, D, F)
        ms = triton.testing.do_bench(lambda: gemm1_dgrad(dgu, w1, w3, lay, tcfg), warmup=25, rep=100,
                                     return_mode="median")
        tri = gemm1_dgrad(dgu, w1, w3, lay, tcfg)
        rows.append(dict(shape=sh, kernel="triton gemm1_dgrad (default config)", ms=ms, tflops=flops / ms / 1e9))
        print(json.dumps(rows[-1]), flush=True)
        for cfg in configs:
            if cfg.smem_bytes() > 232448 - 1024:
                continue
            out = ws_gemm1_dgrad(dgu, w1, w3, lay, cfg=cfg)
            n = int(lay.offsets[-1])
            same = bool(torch.equal(out[:n], tri[:n]))
            ms = triton.testing.do_bench(lambda: ws_gemm1_dgrad(dgu, w1, w3, lay, out=out, cfg=cfg), warmup=25,
                                         rep=100, return_mode="median")
            rows.append(dict(shape=sh, kernel="gluon ws_gemm1_dgrad", cfg=repr(cfg), ms=ms, tflops=flops / ms / 1e9,
                             bitwise_triton=same))
            print(json.dumps(rows[-1]), flush=True)
    _write(out_path, "bench", rows)
    return 0


def check_fwd() -> int:
    from titan_megamoe import switches
    from titan_megamoe.kernels.grouped_gemm import gemm1_swiglu_fwd
    from titan_megamoe.kernels.routing import build_routing_layout
    from titan_megamoe.kernels.ws_gemm import ws_gemm1_fwd
    from titan_megamoe.testing import make_routing

    torch.backends.cuda.matmul.allow_tf32 = False
    cases = [  # (name, T, E, K, D, F, routing)
        ("uniform", 4096, 16, 4, 512, 256, "uniform"), ("T not a multiple of BM, top_k 1", 1000, 8, 1, 256, 128, "uniform"),
        ("experts with zero tokens", 3000, 32, 4, 384, 256, "zero_expert"),
        ("all tokens to one expert", 2048, 16, 2, 256, 256, "one_expert"), ("skewed", 5000, 64, 8, 512, 128, "skewed"),
        ("one program", 2048, 8, 4, 512, 256, "uniform"), ("30B shape", 16384, 128, 8, 2048, 768, "uniform"),
    ]
    failed = 0
    for i, (name, T, E, K, D, F, routing) in enumerate(cases):
        g = torch.Generator(device="cuda").manual_seed(i + 11)
        ids = make_routing(routing, T, E, K, seed=i).cuda()
        lay = build_routing_layout(ids, E, 128)
        x = torch.randn(T, D, device="cuda", generator=g).bfloat16()
        w1 = (torch.randn(E, F, D, device="cuda", generator=g) / D ** 0.5).bfloat16()
        w3 = (torch.randn(E, F, D, device="cuda", generator=g) / D ** 0.5).bfloat16()
        gu = torch.full((lay.n_cap, 2 * F), float("nan"), device="cuda", dtype=torch.bfloat16)
        h = torch.full((lay.n_cap, F), float("nan"), device="cuda", dtype=torch.bfloat16)
        ws_gemm1_fwd(x, w1, w3, lay, gate_up_out=gu, h_out=h, programs=1 if name == "one program" else None)
        torch.cuda.synchronize()
        with switches.override({"TITAN_MEGAMOE_WS_GEMM1": "0"}):  # the Triton kernel (the default is the Gluon one)
            tgu, th = gemm1_swiglu_fwd(x, w1, w3, lay)
        n = int(lay.offsets[-1])
        pair = lay.row_pair[:n]
        valid = pair >= 0
        xr = x[(pair.clamp_min(0) // K).long()].float() * valid[:, None]
        ref_g = torch.empty(n, F, device="cuda")
        ref_u = torch.empty(n, F, device="cuda")
        off = lay.offsets.tolist()
        for e in range(E):
            a, b = off[e], off[e + 1]
            ref_g[a:b] = xr[a:b] @ w1[e].float().T
            ref_u[a:b] = xr[a:b] @ w3[e].float().T
        ref_h = ref_g / (1 + torch.exp(-ref_g)) * ref_u
        live_gu, live_h = gu[:n].float(), h[:n].float()
        err = lambda a, b: float((a - b).norm() / b.norm().clamp_min(1e-30))  # noqa: E731
        nan_rows = int(torch.isnan(live_gu).any(1).sum() + torch.isnan(live_h).any(1).sum())
        pad_nonzero = int((live_gu[~valid] != 0).any(1).sum() + (live_h[~valid] != 0).any(1).sum())
        e_gu = err(live_gu, torch.cat([ref_g, ref_u], 1))
        e_h = err(live_h, ref_h)
        bitwise = bool(torch.equal(gu[:n], tgu[:n]) and torch.equal(h[:n], th[:n]))
        ok = nan_rows == 0 and pad_nonzero == 0 and e_gu < 1e-2 and e_h < 1e-2
        failed += not ok
        print(json.dumps(dict(case=name, ok=ok, rel_err_gate_up=e_gu, rel_err_h=e_h, bitwise_triton=bitwise,
                              nan_rows=nan_rows, nonzero_padding_rows=pad_nonzero)), flush=True)
    print(f"ws_gemm1_fwd check: {len(cases) - failed}/{len(cases)} passed")
    return 1 if failed else 0


def bench_fwd(out_path: str | None, shapes: list[str]) -> int:
    import triton

    from titan_megamoe import switches
    from titan_megamoe.kernels.grouped_gemm import gemm1_swiglu_fwd
    from titan_megamoe.kernels.routing import build_routing_layout
    from titan_megamoe.kernels.ws_gemm import FWD_CONFIG, WsConfig, ws_gemm1_fwd
    from titan_megamoe.testing import make_routing

    rows = []
    for sh in shapes:
        D, F = SHAPES[sh]
        E, K, T = 128, 8, 16384
        g = torch.Generator(device="cuda").manual_seed(0)
        lay = build_routing_layout(make_routing("uniform", T, E, K, seed=0).cuda(), E, 128)
        x = torch.randn(T, D, device="cuda", generator=g).bfloat16()
        w1 = (torch.randn(E, F, D, device="cuda", generator=g) / D ** 0.5).bfloat16()
        w3 = (torch.randn(E, F, D, device="cuda", generator=g) / D ** 0.5).bfloat16()
        flops = 2 * T * K * 2 * F * D
        with switches.override({"TITAN_MEGAMOE_WS_GEMM1": "0"}):  # the Triton kernel (the default is the Gluon one)
            tgu, th = gemm1_swiglu_fwd(x, w1, w3, lay)
            ms = triton.testing.do_bench(lambda: gemm1_swiglu_fwd(x, w1, w3, lay, gate_up_out=tgu, h_out=th),
                                         warmup=25, rep=100, return_mode="median")
        rows.append(dict(shape=sh, kernel="triton gemm1_swiglu_fwd (default config)", ms=ms, tflops=flops / ms / 1e9))
        print(json.dumps(rows[-1]), flush=True)
        n = int(lay.offsets[-1])
        for cfg in (FWD_CONFIG, WsConfig(block_n=128, stages=3, group_m=1, coop=True, consumer_regs=216,
                                         producer_regs=72),
                    WsConfig(block_n=128, stages=4, group_m=8, coop=True, consumer_regs=216, producer_regs=72)):
            gu, h = ws_gemm1_fwd(x, w1, w3, lay, cfg=cfg)
            same = bool(torch.equal(gu[:n], tgu[:n]) and torch.equal(h[:n], th[:n]))
            ms = triton.testing.do_bench(lambda: ws_gemm1_fwd(x, w1, w3, lay, gate_up_out=gu, h_out=h, cfg=cfg),
                                         warmup=25, rep=100, return_mode="median")
            rows.append(dict(shape=sh, kernel="gluon ws_gemm1_fwd", cfg=repr(cfg), ms=ms, tflops=flops / ms / 1e9,
                             bitwise_triton=same))
            print(json.dumps(rows[-1]), flush=True)
    _write(out_path, "bench-fwd", rows)
    return 0


def bench_g2d(out_path: str | None, shapes: list[str]) -> int:
    """GEMM2 dgrad (dout row gather, SwiGLU backward, d score partials, s h): Triton vs Gluon configs."""
    import triton

    from titan_megamoe import switches
    from titan_megamoe.kernels.grouped_gemm_bwd import gemm2_dgrad_swiglu_bwd
    from titan_megamoe.kernels.routing import build_routing_layout
    from titan_megamoe.kernels.ws_gemm import G2D_CONFIG, WsConfig, ws_gemm2_dgrad
    from titan_megamoe.testing import make_routing

    rows = []
    for sh in shapes:
        D, F = SHAPES[sh]
        E, K, T = 128, 8, 16384
        g = torch.Generator(device="cuda").manual_seed(0)
        lay = build_routing_layout(make_routing("uniform", T, E, K, seed=0).cuda(), E, 128)
        dout = torch.randn(T, D, device="cuda", generator=g).bfloat16()
        w2 = (torch.randn(E, D, F, device="cuda", generator=g) / D ** 0.5).bfloat16()
        gu = torch.randn(lay.n_cap, 2 * F, device="cuda", generator=g).bfloat16()
        sc = torch.rand(T, K, device="cuda", generator=g)
        flops = 2 * T * K * F * D
        ths = torch.empty(lay.n_cap, F, device="cuda", dtype=torch.bfloat16)
        with switches.override({"TITAN_MEGAMOE_WS_GEMM2_DGRAD": "0"}):  # the Triton kernel
            tdgu, tpart = gemm2_dgrad_swiglu_bwd(dout, w2, gu, sc, lay, hs_out=ths)
            ms = triton.testing.do_bench(lambda: gemm2_dgrad_swiglu_bwd(dout, w2, gu, sc, lay, hs_out=ths),
                                         warmup=25, rep=100, return_mode="median")
        rows.append(dict(shape=sh, kernel="triton gemm2_dgrad_swiglu_bwd (default config)", ms=ms,
                         tflops=flops / ms / 1e9))
        print(json.dumps(rows[-1]), flush=True)
        n = int(lay.offsets[-1])
        # 4 stages at most since the gate / up epilogue tiles moved to shared memory (64 KB; 213 KB at 4 stages)
        for cfg in (G2D_CONFIG, WsConfig(block_n=128, stages=3, group_m=1, coop=True, consumer_regs=216,
                                         producer_regs=72),
                    WsConfig(block_n=128, stages=4, group_m=8, coop=True, consumer_regs=216, producer_regs=72)):
            dgu, part, hs = ws_gemm2_dgrad(dout, w2, gu, sc, lay, cfg=cfg)
            same = bool(torch.equal(dgu[:n], tdgu[:n]) and torch.equal(hs[:n], ths[:n]))
            dscore_diff = float((part[:n].sum(1) - tpart[:n].sum(1)).abs().max())
            ms = triton.testing.do_bench(lambda: ws_gemm2_dgrad(dout, w2, gu, sc, lay, out=(dgu, part), hs_out=hs,
                                                                cfg=cfg), warmup=25, rep=100, return_mode="median")
            rows.append(dict(shape=sh, kernel="gluon ws_gemm2_dgrad", cfg=repr(cfg), ms=ms, tflops=flops / ms / 1e9,
                             bitwise_triton_dgate_up_hs=same, max_abs_diff_dscore_rows=dscore_diff))
            print(json.dumps(rows[-1]), flush=True)
    _write(out_path, "bench-g2d", rows)
    return 0


def bench_fwd_fp8(out_path: str | None, shapes: list[str]) -> int:
    """Blockwise-FP8 GEMM1: the Triton kernel (bf16 h; and with h quantized in its epilogue, the FP8 forward's
    default) vs the Gluon one at several configs (bf16 h, then the 1x128 pass over the live rows, timed apart)."""
    import dataclasses

    import triton

    from titan_megamoe.kernels.fp8_quant import quantize_act_1x128, quantize_weight_128x128
    from titan_megamoe.kernels.grouped_gemm_fp8 import gemm1_swiglu_fwd_fp8
    from titan_megamoe.kernels.routing import build_routing_layout
    from titan_megamoe.kernels.ws_gemm_fp8 import FP8_FWD_CONFIG, ws_gemm1_fwd_fp8
    from titan_megamoe.ops.fp8_backend import _live_rows
    from titan_megamoe.testing import make_routing

    rows = []
    bench = lambda fn: triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")  # noqa: E731
    for sh in shapes:
        D, F = SHAPES[sh]
        E, K, T = 128, 8, 16384
        g = torch.Generator(device="cuda").manual_seed(0)
        lay = build_routing_layout(make_routing("uniform", T, E, K, seed=0).cuda(), E, 128)
        xq, xs = quantize_act_1x128(torch.randn(T, D, device="cuda", generator=g).bfloat16())
        w1q, w1s = quantize_weight_128x128((torch.randn(E, F, D, device="cuda", generator=g) / D ** 0.5).bfloat16())
        w3q, w3s = quantize_weight_128x128((torch.randn(E, F, D, device="cuda", generator=g) / D ** 0.5).bfloat16())
        ops = (xq, xs, w1q, w1s, w3q, w3s, lay)
        flops = 2 * T * K * 2 * F * D
        n = int(lay.offsets[-1])

        def row(kernel, ms, **extra):
            rows.append(dict(shape=sh, kernel=kernel, ms=ms, tflops=flops / ms / 1e9, **extra))
            print(json.dumps(rows[-1]), flush=True)

        tgu, th = gemm1_swiglu_fwd_fp8(*ops)
        row("triton gemm1_swiglu_fwd_fp8 (bf16 h)", bench(lambda: gemm1_swiglu_fwd_fp8(*ops, gate_up_out=tgu, h_out=th)))
        row("triton gemm1_swiglu_fwd_fp8 quantize_h (the fp8 default)",
            bench(lambda: gemm1_swiglu_fwd_fp8(*ops, quantize_h=True)))
        live = _live_rows(lay)
        ms_q = bench(lambda: quantize_act_1x128(th, live, 1))
        rows.append(dict(shape=sh, kernel="quantize_act_1x128 of h (live rows)", ms=ms_q))
        print(json.dumps(rows[-1]), flush=True)
        for cfg in (FP8_FWD_CONFIG, dataclasses.replace(FP8_FWD_CONFIG, ordered=True),
                    dataclasses.replace(FP8_FWD_CONFIG, stages=4, ordered=True)):
            gu, h = ws_gemm1_fwd_fp8(*ops, cfg=cfg)
            same = bool(torch.equal(gu[:n], tgu[:n]) and torch.equal(h[:n], th[:n]))
            diff = float((gu[:n].float() - tgu[:n].float()).abs().max())
            ms = bench(lambda: ws_gemm1_fwd_fp8(*ops, gate_up_out=gu, h_out=h, cfg=cfg))
            row("gluon ws_gemm1_fwd_fp8", ms, cfg=repr(cfg), bitwise_triton=same, max_abs_diff_gate_up=diff,
                ms_with_quant_h=ms + ms_q)
    _write(out_path, "bench-fwd-fp8", rows)
    return 0


def bench_dgrad_fp8(out_path: str | None, shapes: list[str]) -> int:
    """Blockwise-FP8 GEMM1 dgrad: the Triton kernel vs the Gluon one (kernels/ws_gemm_fp8.py) at several configs."""
    import dataclasses

    import triton

    from titan_megamoe.kernels.fp8_quant import quantize_act_1x128, quantize_weight_128x128
    from titan_megamoe.kernels.grouped_gemm_fp8_bwd import gemm1_dgrad_fp8
    from titan_megamoe.kernels.routing import build_routing_layout
    from titan_megamoe.kernels.ws_gemm_fp8 import DGRAD_FP8_CONFIG, ws_gemm1_dgrad_fp8
    from titan_megamoe.testing import make_routing

    rows = []
    bench = lambda fn: triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")  # noqa: E731
    for sh in shapes:
        D, F = SHAPES[sh]
        E, K, T = 128, 8, 16384
        g = torch.Generator(device="cuda").manual_seed(0)
        lay = build_routing_layout(make_routing("uniform", T, E, K, seed=0).cuda(), E, 128)
        dq, ds = quantize_act_1x128(torch.randn(lay.n_cap, 2 * F, device="cuda", generator=g).bfloat16())
        w1t = (torch.randn(E, D, F, device="cuda", generator=g) / F ** 0.5).bfloat16()
        w3t = (torch.randn(E, D, F, device="cuda", generator=g) / F ** 0.5).bfloat16()
        ops = (dq, ds, *quantize_weight_128x128(w1t), *quantize_weight_128x128(w3t), lay)
        flops = 2 * T * K * 2 * F * D
        n = int(lay.offsets[-1])
        tdx = gemm1_dgrad_fp8(*ops)
        ms = bench(lambda: gemm1_dgrad_fp8(*ops))
        rows.append(dict(shape=sh, kernel="triton gemm1_dgrad_fp8 (default config)", ms=ms, tflops=flops / ms / 1e9))
        print(json.dumps(rows[-1]), flush=True)
        for cfg in (DGRAD_FP8_CONFIG, dataclasses.replace(DGRAD_FP8_CONFIG, ordered=True),
                    dataclasses.replace(DGRAD_FP8_CONFIG, stages=4, ordered=True)):
            dx = ws_gemm1_dgrad_fp8(*ops, cfg=cfg)
            same = bool(torch.equal(dx[:n], tdx[:n]))
            diff = float((dx[:n].float() - tdx[:n].float()).abs().max())
            ms = bench(lambda: ws_gemm1_dgrad_fp8(*ops, out=dx, cfg=cfg))
            rows.append(dict(shape=sh, kernel="gluon ws_gemm1_dgrad_fp8", cfg=repr(cfg), ms=ms, tflops=flops / ms / 1e9,
                             bitwise_triton=same, max_abs_diff=diff))
            print(json.dumps(rows[-1]), flush=True)
    _write(out_path, "bench-dgrad-fp8", rows)
    return 0


def bench_g2_fp8(out_path: str | None, shapes: list[str]) -> int:
    """Blockwise-FP8 GEMM2 (routing score, rows scattered to pairs): the Triton kernel (persistent, the default) vs
    the Gluon one (kernels/ws_gemm_fp8.ws_gemm2_fwd_fp8) at several configs; every Gluon row checked against it."""
    import dataclasses

    import triton

    from titan_megamoe.kernels.fp8_quant import quantize_act_1x128, quantize_weight_128x128
    from titan_megamoe.kernels.grouped_gemm_fp8 import gemm2_scatter_fwd_fp8
    from titan_megamoe.kernels.routing import build_routing_layout
    from titan_megamoe.kernels.ws_gemm_fp8 import GEMM2_FP8_CONFIG, ws_gemm2_fwd_fp8
    from titan_megamoe.testing import make_routing

    rows = []
    bench = lambda fn: triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")  # noqa: E731
    for sh in shapes:
        D, F = SHAPES[sh]
        E, K, T = 128, 8, 16384
        g = torch.Generator(device="cuda").manual_seed(0)
        lay = build_routing_layout(make_routing("uniform", T, E, K, seed=0).cuda(), E, 128)
        hq, hs = quantize_act_1x128(torch.randn(lay.n_cap, F, device="cuda", generator=g).bfloat16())
        w2q, w2s = quantize_weight_128x128((torch.randn(E, D, F, device="cuda", generator=g) / F ** 0.5).bfloat16())
        scores = torch.rand(T, K, device="cuda", generator=g)
        flops = 2 * T * K * F * D
        ty = gemm2_scatter_fwd_fp8(hq, hs, w2q, w2s, scores, lay)
        ms = bench(lambda: gemm2_scatter_fwd_fp8(hq, hs, w2q, w2s, scores, lay, out=ty))
        rows.append(dict(shape=sh, kernel="triton gemm2_scatter_fwd_fp8 (default config)", ms=ms,
                         tflops=flops / ms / 1e9))
        print(json.dumps(rows[-1]), flush=True)
        for cfg in (GEMM2_FP8_CONFIG, dataclasses.replace(GEMM2_FP8_CONFIG, ordered=True),
                    dataclasses.replace(GEMM2_FP8_CONFIG, stages=5, ordered=True)):
            y = ws_gemm2_fwd_fp8(hq, hs, w2q, w2s, scores, lay, cfg=cfg)
            same = bool(torch.equal(y, ty))
            diff = float((y.float() - ty.float()).abs().max())
            ms = bench(lambda: ws_gemm2_fwd_fp8(hq, hs, w2q, w2s, scores, lay, out=y, cfg=cfg))
            rows.append(dict(shape=sh, kernel="gluon ws_gemm2_fwd_fp8", cfg=repr(cfg), ms=ms, tflops=flops / ms / 1e9,
                             bitwise_triton=same, max_abs_diff=diff))
            print(json.dumps(rows[-1]), flush=True)
    _write(out_path, "bench-g2-fp8", rows)
    return 0


def _g2d_fp8_operands(sh: str):
    """The FP8 GEMM2 dgrad's operands at a shape (16384 tokens, top-8, 128 experts, uniform routing), and its FLOPs."""
    from titan_megamoe.kernels.fp8_quant import quantize_act_1x128, quantize_weight_128x128
    from titan_megamoe.kernels.routing import build_routing_layout
    from titan_megamoe.testing import make_routing

    D, F = SHAPES[sh]
    E, K, T = 128, 8, 16384
    g = torch.Generator(device="cuda").manual_seed(0)
    lay = build_routing_layout(make_routing("uniform", T, E, K, seed=0).cuda(), E, 128)
    dq, ds = quantize_act_1x128(torch.randn(T, D, device="cuda", generator=g).bfloat16())
    w2t = (torch.randn(E, F, D, device="cuda", generator=g) / D ** 0.5).bfloat16()
    gu = (2 * torch.randn(lay.n_cap, 2 * F, device="cuda", generator=g)).bfloat16()
    gu[lay.row_pair < 0] = 0
    sc = torch.rand(T, K, device="cuda", generator=g)
    return (dq, ds, *quantize_weight_128x128(w2t), gu, sc, lay), 2 * T * K * F * D


#: The points ``launch_gemm2_dgrad_fp8(trace=...)`` stamps in each consumer's tile, in order.
G2D_FP8_TRACE_POINTS = ("tile start", "store_wait done", "main loop done", "gate/up ready", "scores loaded",
                        "half 0 done", "half 1 done", "scale", "stores issued")


def trace_g2d_fp8(out_path: str | None, shapes: list[str], tiles: int = 24, pingpong: bool = False) -> int:
    """Where a tile's time goes in the Gluon FP8 GEMM2 dgrad: the global timer at each point of
    ``G2D_FP8_TRACE_POINTS`` for each consumer's first ``tiles`` tiles on every SM; median / mean microseconds from
    the tile's start to each point over tiles 1.. (tile 0 starts cold), tile to tile, and the kernel's time with and
    without the stamps (do_bench). The outputs of the stamped launch are compared bitwise with the plain one's.
    ``pingpong``: the ping-pong config (``GEMM2_DGRAD_FP8_PINGPONG``; a consumer's units are j = C, C + 2, ...)."""
    import triton

    from titan_megamoe.kernels.fp8_quant_bwd import empty_transposed
    from titan_megamoe.kernels.ws_gemm2_dgrad_fp8 import GEMM2_DGRAD_FP8_CONFIG, GEMM2_DGRAD_FP8_PINGPONG, \
        launch_gemm2_dgrad_fp8, ws_gemm2_dgrad_fp8

    bench = lambda fn: triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")  # noqa: E731
    rows = []
    n_sm = torch.cuda.get_device_properties(0).multi_processor_count
    cfg = GEMM2_DGRAD_FP8_PINGPONG if pingpong else GEMM2_DGRAD_FP8_CONFIG
    step = 2 if pingpong else 1  # a consumer's next unit
    for sh in shapes:
        ops, flops = _g2d_fp8_operands(sh)
        n = int(ops[-1].offsets[-1])
        ref = ws_gemm2_dgrad_fp8(*ops, cfg=cfg)
        hsT = empty_transposed(*ref[2].shape, ref[2].device)
        hsT.view(torch.uint8).fill_(0x7F)  # e4m3 NaN
        out = (torch.full_like(ref[0], float("nan")), torch.full_like(ref[1], float("nan")), hsT,
               torch.full_like(ref[3], float("nan")))
        tr = torch.zeros(n_sm, tiles, 2, 16, dtype=torch.int64, device="cuda")
        launch_gemm2_dgrad_fp8(*ops, *out, None, cfg, None, tr)
        same = [bool(torch.equal(out[0][:n], ref[0][:n])), bool(torch.equal(out[1][:n], ref[1][:n])),
                bool(torch.equal(out[2][:, :n].view(torch.uint8), ref[2][:, :n].view(torch.uint8))),
                bool(torch.equal(out[3][:n // 128], ref[3][:n // 128]))]
        ms = bench(lambda: launch_gemm2_dgrad_fp8(*ops, *out, None, cfg))
        ms_tr = bench(lambda: launch_gemm2_dgrad_fp8(*ops, *out, None, cfg, None, tr))
        tr.zero_()
        launch_gemm2_dgrad_fp8(*ops, *out, None, cfg, None, tr)
        torch.cuda.synchronize()
        t = tr.double()
        live = t[..., 0] > 0
        live[:, :step] = False
        points = {}
        for i, name in enumerate(G2D_FP8_TRACE_POINTS):
            ok = live & (t[..., i] > 0)
            if ok.any():
                d = (t[..., i] - t[..., 0])[ok] / 1e3
                points[name] = dict(median_us=float(d.median()), mean_us=float(d.mean()),
                                    p90_us=float(d.quantile(0.9)))
        nxt = live[:, step:] & live[:, :-step]
        d = (t[:, step:, :, 0] - t[:, :-step, :, 0])[nxt] / 1e3
        points["next tile start"] = dict(median_us=float(d.median()), mean_us=float(d.mean()),
                                         p90_us=float(d.quantile(0.9)))
        rows.append(dict(shape=sh, cfg=repr(cfg), ms=ms, ms_traced=ms_tr, tflops=flops / ms / 1e9, tiles=tiles,
                         traced_bitwise_dgu_part_hsT_hsTs=same, points_from_tile_start=points))
        print(json.dumps(dict(shape=sh, ms=round(ms, 4), ms_traced=round(ms_tr, 4), bitwise=same)), flush=True)
        for k, v in sorted(points.items(), key=lambda kv: kv[1]["median_us"]):
            print(f"  {k:20s} median {v['median_us']:8.2f} us  mean {v['mean_us']:8.2f}  p90 {v['p90_us']:8.2f}")
    _write(out_path, "trace-g2d-fp8", rows)
    return 0


def bench_g2d_fp8(out_path: str | None, shapes: list[str]) -> int:
    """Blockwise-FP8 GEMM2 dgrad (SwiGLU backward, d score partials, 128x1 s * h): Triton vs Gluon, a few configs;
    TF/s of the main loop's 2 * P * F * D FLOPs."""
    import dataclasses

    import triton

    from titan_megamoe.kernels.grouped_gemm_fp8_bwd import gemm2_dgrad_swiglu_bwd_fp8
    from titan_megamoe.kernels.ws_gemm2_dgrad_fp8 import (
        GEMM2_DGRAD_FP8_CONFIG,
        launch_gemm2_dgrad_fp8,
        ws_gemm2_dgrad_fp8,
    )

    rows = []
    bench = lambda fn: triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")  # noqa: E731
    for sh in shapes:
        ops, flops = _g2d_fp8_operands(sh)
        lay = ops[-1]
        n = int(lay.offsets[-1])
        t = gemm2_dgrad_swiglu_bwd_fp8(*ops)
        ms = bench(lambda: gemm2_dgrad_swiglu_bwd_fp8(*ops))
        rows.append(dict(shape=sh, kernel="triton gemm2_dgrad_swiglu_bwd_fp8 (default config)", ms=ms,
                         tflops=flops / ms / 1e9))
        print(json.dumps(rows[-1]), flush=True)
        for cfg in (GEMM2_DGRAD_FP8_CONFIG, dataclasses.replace(GEMM2_DGRAD_FP8_CONFIG, stages=3),
                    dataclasses.replace(GEMM2_DGRAD_FP8_CONFIG, group_m=1)):
            out = ws_gemm2_dgrad_fp8(*ops, cfg=cfg)
            same = [bool(torch.equal(a[:n], b[:n])) for a, b in ((out[0], t[0]), (out[3], t[3]))]
            same.append(bool(torch.equal(out[2][:, :n].view(torch.uint8), t[2][:, :n].view(torch.uint8))))
            diff = float((out[0][:n].float() - t[0][:n].float()).abs().max())
            ms = bench(lambda: launch_gemm2_dgrad_fp8(*ops, *out, None, cfg))
            rows.append(dict(shape=sh, kernel="gluon ws_gemm2_dgrad_fp8", cfg=repr(cfg), ms=ms,
                             tflops=flops / ms / 1e9, bitwise_triton_dgu_hsTs_hsT=same, max_abs_diff_dgu=diff))
            print(json.dumps(rows[-1]), flush=True)
    _write(out_path, "bench-g2d-fp8", rows)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("what", choices=["check", "bench", "check-fwd", "bench-fwd", "bench-g2d", "bench-fwd-fp8",
                                      "bench-dgrad-fp8", "bench-g2d-fp8", "trace-g2d-fp8", "trace-g2d-fp8-pingpong",
                                      "bench-g2-fp8"])
    p.add_argument("--out", default=None)
    p.add_argument("--shapes", default="30b,235b")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_ws_gemm: needs a CUDA GPU", file=sys.stderr)
        return 2
    if a.what == "check-fwd":
        return check_fwd()
    if a.what == "bench-fwd":
        return bench_fwd(a.out, a.shapes.split(","))
    if a.what == "bench-g2d":
        return bench_g2d(a.out, a.shapes.split(","))
    if a.what == "bench-fwd-fp8":
        return bench_fwd_fp8(a.out, a.shapes.split(","))
    if a.what == "bench-dgrad-fp8":
        return bench_dgrad_fp8(a.out, a.shapes.split(","))
    if a.what == "bench-g2d-fp8":
        return bench_g2d_fp8(a.out, a.shapes.split(","))
    if a.what in ("trace-g2d-fp8", "trace-g2d-fp8-pingpong"):
        return trace_g2d_fp8(a.out, a.shapes.split(","), pingpong=a.what.endswith("pingpong"))
    if a.what == "bench-g2-fp8":
        return bench_g2_fp8(a.out, a.shapes.split(","))
    return check() if a.what == "check" else bench(a.out, a.shapes.split(","))


if __name__ == "__main__":
    raise SystemExit(main())
