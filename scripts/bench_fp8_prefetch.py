"""Time the three Gluon blockwise-FP8 GEMMs of ``kernels/ws_gemm_fp8.py`` (GEMM1, GEMM1 dgrad, GEMM2) with their
consumers' scale loads one step ahead (``SCALE_PREFETCH``, the default) and at their step, in one process (GPU only).

    python scripts/bench_fp8_prefetch.py [--shapes 30b,235b] [--out f.json]

16384 tokens, top-8, 128 experts, near-uniform random routing, random operands quantized by the op's quantizers.
``triton.testing.do_bench`` medians (warm-up 25 ms, 100 ms of repeats) per kernel and setting, TF/s over the routed
rows, and each prefetching result compared bitwise with the other setting's and with the Triton kernel's (a
difference exits 1: the setting moves loads, not arithmetic).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

SHAPES = {"30b": (2048, 768), "235b": (4096, 1536)}


def main(argv=None) -> int:
    import triton

    from titan_megamoe.kernels import ws_gemm_fp8 as W
    from titan_megamoe.kernels.fp8_quant import quantize_act_1x128, quantize_weight_128x128
    from titan_megamoe.kernels.grouped_gemm_fp8 import gemm1_swiglu_fwd_fp8, gemm2_scatter_fwd_fp8
    from titan_megamoe.kernels.grouped_gemm_fp8_bwd import gemm1_dgrad_fp8
    from titan_megamoe.kernels.routing import build_routing_layout
    from titan_megamoe.testing import make_routing

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="30b,235b")
    p.add_argument("--out")
    args = p.parse_args(argv)
    bench = lambda fn: triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")  # noqa: E731
    rec = dict(device=torch.cuda.get_device_name(), git_rev=os.environ.get("TITAN_MEGAMOE_GIT_REV", "unknown"),
               command="python scripts/bench_fp8_prefetch.py " + " ".join(argv if argv is not None else sys.argv[1:]),
               rows=[])
    bad = 0
    T, E, K = 16384, 128, 8
    for shape in args.shapes.split(","):
        D, F = SHAPES[shape]
        g = torch.Generator(device="cuda").manual_seed(0)
        lay = build_routing_layout(make_routing("uniform", T, E, K, seed=0).cuda(), E, 128)
        n = int(lay.offsets[-1])
        rnd = lambda *s: torch.randn(*s, device="cuda", generator=g).bfloat16()  # noqa: E731
        xq, xs = quantize_act_1x128(rnd(T, D))
        w1 = quantize_weight_128x128(rnd(E, F, D) / D ** 0.5)
        w3 = quantize_weight_128x128(rnd(E, F, D) / D ** 0.5)
        dq, ds = quantize_act_1x128(rnd(lay.n_cap, 2 * F))
        w1t = quantize_weight_128x128(rnd(E, D, F) / F ** 0.5)
        w3t = quantize_weight_128x128(rnd(E, D, F) / F ** 0.5)
        hq, hs = quantize_act_1x128(rnd(lay.n_cap, F))
        w2 = quantize_weight_128x128(rnd(E, D, F) / F ** 0.5)
        scores = torch.rand(T, K, device="cuda", generator=g)
        flop = 2 * T * K * F * D
        cases = [
            ("gemm1", 2 * flop, lambda: W.ws_gemm1_fwd_fp8(xq, xs, *w1, *w3, lay),
             lambda: gemm1_swiglu_fwd_fp8(xq, xs, *w1, *w3, lay), lambda o: torch.cat([t[:n] for t in o], 1)),
            ("gemm1_dgrad", 2 * flop, lambda: W.ws_gemm1_dgrad_fp8(dq, ds, *w1t, *w3t, lay),
             lambda: gemm1_dgrad_fp8(dq, ds, *w1t, *w3t, lay), lambda o: o[:n]),
            ("gemm2", flop, lambda: W.ws_gemm2_fwd_fp8(hq, hs, *w2, scores, lay),
             lambda: gemm2_scatter_fwd_fp8(hq, hs, *w2, scores, lay), lambda o: o),
        ]
        for name, fl, gluon, tri, view in cases:
            ref = view(tri())
            outs = {}
            for pf in (False, True):
                W.SCALE_PREFETCH = pf
                outs[pf] = view(gluon())
                ms = bench(gluon)
                row = dict(shape=shape, kernel=name, prefetch=pf, ms=round(ms, 4), tflops=round(fl / ms / 1e9, 1),
                           bitwise_triton=bool(torch.equal(outs[pf], ref)))
                rec["rows"].append(row)
                print(row, flush=True)
            W.SCALE_PREFETCH = True
            same = bool(torch.equal(outs[False], outs[True]))
            bad += not same
            print(shape, name, "prefetch bitwise no-prefetch:", same, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rec, f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
