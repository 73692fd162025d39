"""Time the warp-specialized Gluon wgrads (kernels/ws_wgrad.py) against the default sm_90 path (gather_rows +
torch._grouped_mm) in one process (GPU only).

    python scripts/bench_ws_wgrad.py [--shapes 30b,235b] [--out f.json]

16384 tokens, top-8, 128 experts, near-uniform random routing. For each shape: the dense bf16 rate of this
GPU (torch.matmul 8192^3, the ceiling), then ``triton.testing.do_bench`` medians (warm-up 25 ms, 100 ms of
repeats) of: the grouped_mm w13 and w2 wgrads (gathers included) and the gathers alone, and the Gluon kernel
per config; TF/s = 2 * P * D * F * (2 for w13 | 1 for w2) / time, P = T * K pairs. Each Gluon result is
compared with the grouped_mm one (relative error, bf16 bound 1e-2; a failure exits 1).
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


def main(argv=None) -> int:
    import triton

    from titan_megamoe.kernels.grouped_gemm_wgrad import gather_rows, wgrad_w2, wgrad_w13
    from titan_megamoe.kernels.routing import build_routing_layout
    from titan_megamoe.kernels.ws_wgrad import WgradConfig, ws_wgrad_w2, ws_wgrad_w13
    from titan_megamoe.testing import make_routing, rel_err

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="30b,235b")
    p.add_argument("--out")
    args = p.parse_args(argv)
    bench = lambda fn: triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")  # noqa: E731
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    dense_ms = triton.testing.do_bench(lambda: a @ a, warmup=25, rep=200, return_mode="median")
    rows = [dict(kernel="dense torch.matmul 8192^3", ms=dense_ms, tflops=2 * 8192 ** 3 / dense_ms / 1e9)]
    print(f"dense bf16: {rows[0]['tflops']:.0f} TF/s")
    del a
    T, E, K, bad = 16384, 128, 8, 0
    # (session 13 also timed BN 128 at 5 / 6 stages: slower; session 27 adds the split accumulators, 4 / 8 stages)
    configs = [WgradConfig(), WgradConfig(stages=4, split_n=True), WgradConfig(block_k=32, stages=8, split_n=True)]
    for shape in args.shapes.split(","):
        D, F = SHAPES[shape]
        g = torch.Generator(device="cuda").manual_seed(0)
        lay = build_routing_layout(make_routing("uniform", T, E, K, seed=0).cuda(), E, 128)
        n = int(lay.offsets[-1])
        pad = lay.row_pair[:n] < 0
        x = torch.randn(T, D, device="cuda", generator=g).bfloat16()
        dout = torch.randn(T, D, device="cuda", generator=g).bfloat16()
        dgu = (torch.randn(lay.n_cap, 2 * F, device="cuda", generator=g) * 0.1).bfloat16()
        hs = torch.randn(lay.n_cap, F, device="cuda", generator=g).bfloat16()
        dgu[:n][pad] = 0
        hs[:n][pad] = 0
        sc = torch.rand(T, K, device="cuda", generator=g)
        flop13, flop2 = 4 * T * K * D * F, 2 * T * K * D * F

        def row(kernel, ms, flop, **kw):
            r = dict(shape=shape, kernel=kernel, ms=ms, tflops=flop / ms / 1e9 if flop else None, **kw)
            rows.append(r)
            print(f"{shape} {kernel:44s} {ms:7.3f} ms" + (f" {r['tflops']:5.0f} TF/s" if flop else ""), flush=True)

        ref13 = wgrad_w13(dgu, x, lay, impl="grouped_mm")
        ref2 = wgrad_w2(dout, dgu, sc, lay, hs_NF=hs, impl="grouped_mm")
        row("grouped_mm w13 (gather + 2 grouped_mm)", bench(lambda: wgrad_w13(dgu, x, lay, impl="grouped_mm")), flop13)
        row("grouped_mm w2 (gather + grouped_mm)",
            bench(lambda: wgrad_w2(dout, dgu, sc, lay, hs_NF=hs, impl="grouped_mm")), flop2)
        row("gather_rows alone (one of the two)", bench(lambda: gather_rows(x, lay)), 0)
        first = None
        for cfg in configs:
            o13 = (torch.empty_like(ref13[0]), torch.empty_like(ref13[1]))
            o2 = torch.empty_like(ref2)
            ws_wgrad_w13(dgu, x, lay, out=o13, cfg=cfg)
            ws_wgrad_w2(dout, hs, lay, out=o2, cfg=cfg)
            err = max(rel_err(o13[0], ref13[0]), rel_err(o13[1], ref13[1]), rel_err(o2, ref2))
            first = first or (o13, o2)  # the first config's outputs: the others must match them bit for bit
            same = all(torch.equal(a, b) for a, b in zip((*o13, o2), (*first[0], first[1])))
            ok = err < 1e-2
            bad += not ok
            tag = f"BN {cfg.block_n}, BK {cfg.block_k}, {cfg.stages} stages{', split_n' if cfg.split_n else ''}"
            row(f"gluon w13 ({tag})", bench(lambda: ws_wgrad_w13(dgu, x, lay, out=o13, cfg=cfg)), flop13,
                rel_err_vs_grouped_mm=err, ok=ok, bitwise_first_config=same)
            row(f"gluon w2 ({tag})", bench(lambda: ws_wgrad_w2(dout, hs, lay, out=o2, cfg=cfg)), flop2,
                rel_err_vs_grouped_mm=err, ok=ok, bitwise_first_config=same)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"script": "scripts/bench_ws_wgrad.py", "gpu": torch.cuda.get_device_name(),
                       "torch": torch.__version__, "triton": triton.__version__, "date": time.strftime("%Y-%m-%d"),
                       "git_rev": os.environ.get("TITAN_MEGAMOE_GIT_REV"), "tokens": T, "top_k": K, "experts": E,
                       "routing": "uniform", "rows": rows}, f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
