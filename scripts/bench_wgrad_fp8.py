"""Time the blockwise-FP8 weight gradients (dw2, dw1 | dw3) of the FP8 backward: the Triton kernel, the Gluon kernel
of ``kernels/ws_wgrad_fp8.py`` per config, in one process (GPU only).

    python scripts/bench_wgrad_fp8.py [--shapes 30b,235b] [--out f.json] [--ncu] [--default-only] [--ablate]

16384 tokens, top-8, 128 experts, near-uniform random routing; operands made by the op's own quantizers (dout and x
gathered 128x1, s * h and dgate_up random bf16 rows through the dual pass). For each shape: the dense e4m3 rate of
this GPU (``torch._scaled_mm`` rowwise 8192^3, the ceiling), then ``triton.testing.do_bench`` medians (warm-up 25 ms,
100 ms of repeats) per kernel, TF/s = 2 * P * MA * NC / time over the live rows P, the ratio to the dense rate, and
each result compared bitwise with the first Gluon config's (``bitwise_first_gluon``: the default config since
session 39; ``bitwise_gluon_v1`` in earlier records, when v1 came first) and with the Triton kernel's (a mismatch with the Gluon
reference exits 1: every config computes the same partials in the same order). ``--ncu``: each kernel runs twice,
untimed (for ``ncu -k regex:_wgrad``); with ``--default-only`` only the Gluon kernel as the op launches it (its default
config: two output staging tiles for dw2), no Triton launch: ``ncu -k regex:_wgrad_fp8_ws_kernel --launch-skip 1
--launch-count 3`` then profiles dw2's second launch and dw1 | dw3's two. ``--ablate``: also the Gluon v1 kernel with parts left out (``ws_wgrad_fp8``'s
``_ablate`` bits; wrong results, timing only): where its time goes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

SHAPES = {"30b": (2048, 768), "235b": (4096, 1536)}


def _configs():
    from titan_megamoe.kernels.ws_wgrad_fp8 import FP8_WGRAD_CONFIG as C

    v1 = dataclasses.replace(C, smem_scales=False)
    return [("gluon default", None), ("gluon v1", v1), ("gluon smem scales", dataclasses.replace(v1, smem_scales=True)),
            ("gluon smem scales, 6 stages", dataclasses.replace(v1, smem_scales=True, stages=6))]


def _dense_fp8_tflops(bench) -> float:
    a = torch.randn(8192, 8192, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(8192, 8192, device="cuda").to(torch.float8_e4m3fn).T
    sa = torch.ones(8192, 1, device="cuda")
    sb = torch.ones(1, 8192, device="cuda")
    ms = bench(lambda: torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16))
    return 2 * 8192 ** 3 / ms / 1e9


def main(argv=None) -> int:
    import triton

    from titan_megamoe.kernels.fp8_quant_bwd import quantize_dual_1x128_128x1_t, quantize_gather_128x1_t
    from titan_megamoe.kernels.grouped_gemm_fp8_bwd import wgrad_fp8
    from titan_megamoe.kernels.routing import build_routing_layout
    from titan_megamoe.kernels.ws_wgrad_fp8 import ws_wgrad_fp8
    from titan_megamoe.testing import make_routing

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="30b,235b")
    p.add_argument("--out")
    p.add_argument("--ncu", action="store_true")
    p.add_argument("--default-only", action="store_true",
                   help="only the Gluon kernel with the op's default config (with --ncu: nothing else launched)")
    p.add_argument("--ablate", action="store_true")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_wgrad_fp8: needs a CUDA GPU (the Gluon kernels run on sm_90 only)", file=sys.stderr)
        return 2
    bench = lambda fn: triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")  # noqa: E731
    dense = None if args.ncu else _dense_fp8_tflops(bench)
    rec = dict(device=torch.cuda.get_device_name(), git_rev=os.environ.get("TITAN_MEGAMOE_GIT_REV", "unknown"),
               command="python scripts/bench_wgrad_fp8.py " + " ".join(argv if argv is not None else sys.argv[1:]),
               dense_fp8_tflops=dense, shapes=[])
    if dense:
        print(f"dense e4m3 (torch._scaled_mm rowwise 8192^3): {dense:.0f} TF/s")
    T, E, K, bad = 16384, 128, 8, 0
    for shape in args.shapes.split(","):
        D, F = SHAPES[shape]
        g = torch.Generator(device="cuda").manual_seed(0)
        lay = build_routing_layout(make_routing("uniform", T, E, K, seed=0).cuda(), E, 128)
        valid = lay.row_pair >= 0
        live = int(valid.sum())
        dout = torch.randn(T, D, device="cuda", generator=g).bfloat16()
        x = torch.randn(T, D, device="cuda", generator=g).bfloat16()
        hs = (torch.randn(lay.n_cap, F, device="cuda", generator=g) * valid[:, None]).bfloat16()
        dgu = (torch.randn(lay.n_cap, 2 * F, device="cuda", generator=g) * valid[:, None]).bfloat16()
        doT = quantize_gather_128x1_t(dout, lay.row_pair, K)
        xT = quantize_gather_128x1_t(x, lay.row_pair, K)
        hsT = quantize_dual_1x128_128x1_t(hs, valid)[2:]
        dguT = quantize_dual_1x128_128x1_t(dgu, valid)[2:]
        rows = []
        for name, aT, bT, split in (("dw2", doT, hsT, None), ("dw13", dguT, xT, F)):
            flop = 2 * live * aT[0].shape[0] * bT[0].shape[0]
            tri = None if args.default_only else torch.cat(wgrad_fp8(*aT, *bT, lay, split=split), 1)
            ref = None
            kernels = [] if args.default_only else [("triton", lambda: wgrad_fp8(*aT, *bT, lay, split=split))]
            kernels += [(label, (lambda c: lambda: ws_wgrad_fp8(*aT, *bT, lay, split=split, cfg=c))(cfg))
                        for label, cfg in _configs() if not args.default_only or cfg is None]
            for label, fn in kernels:
                out = torch.cat(fn(), 1)
                if ref is None and label != "triton":
                    ref = out
                if args.ncu:
                    fn()
                    continue
                ms = bench(fn)
                row = dict(kernel=name, variant=label, ms=round(ms, 4), tflops=round(flop / ms / 1e9, 1),
                           of_dense=round(flop / ms / 1e9 / dense, 3),
                           bitwise_triton=None if tri is None else bool(torch.equal(out, tri)),
                           bitwise_first_gluon=None if label == "triton" else bool(torch.equal(out, ref)))
                bad += row["bitwise_first_gluon"] is False
                rows.append(row)
                print(shape, row)
            if args.ablate and not args.ncu:
                v1 = dict(_configs())["gluon v1"]
                for bits, what in ((1, "scales loaded once per tile"), (2, "no scaling"), (4, "no output stores"),
                                   (16, "one accumulator chain"), (20, "one chain, no stores"),
                                   (8, "no MMA (operand stream)"), (12, "no MMA, no stores")):
                    ms = bench((lambda b: lambda: ws_wgrad_fp8(*aT, *bT, lay, split=split, cfg=v1, _ablate=b))(bits))
                    row = dict(kernel=name, variant=f"gluon v1 ablate {bits}: {what}", ms=round(ms, 4),
                               tflops=round(flop / ms / 1e9, 1), of_dense=round(flop / ms / 1e9 / dense, 3))
                    rows.append(row)
                    print(shape, row)
            del tri, ref
        rec["shapes"].append(dict(shape=shape, T=T, E=E, K=K, D=D, F=F, live_rows=live, rows=rows))
    if args.out and not args.ncu:
        with open(args.out, "w") as f:
            json.dump(rec, f, indent=1)
    print(json.dumps(rec))
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
