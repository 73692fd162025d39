"""GPU: the GEMM2 dgrad's first-wave stagger (``grouped_gemm_bwd.GEMM2_DGRAD_STAGGER``) swept at a real shape.

    python scripts/sweep_gemm2_dgrad_stagger.py 30b|235b [--ns 0,4000,8000,12000,16000] [--out f.json]

Hypothesis (docs/NOTES.md session 18): with two programs per SM the kernel costs about its main loop plus its
epilogue (30B: 0.62 + 0.29 ms of DRAM time = 0.91 measured) because both programs of an SM run in step; one
program per SM starting about half a tile late should let one's epilogue run under the other's main loop.
Each (mode, ns) is timed with ``triton.testing.do_bench`` (median) in rotated order, twice, and its outputs
(dgate_up, d score partials, s h) are compared bitwise with the unstaggered kernel's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402

from titan_megamoe.kernels import grouped_gemm as gg  # noqa: E402
from titan_megamoe.kernels import grouped_gemm_bwd as B  # noqa: E402
from titan_megamoe.kernels.routing import build_routing_layout  # noqa: E402
from titan_megamoe.testing import BENCH_SHAPES as SHAPES, bench_layer_inputs  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("--ns", default="4000,8000,12000,16000")
    ap.add_argument("--modes", default="1,2")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    v = bench_layer_inputs(args.shape, "cuda")
    T, E, K, D, F = v.T, v.E, v.K, v.D, v.F
    lay = build_routing_layout(v.ids, E, 128)
    gu, _ = gg.gemm1_swiglu_fwd(v.x, v.w1, v.w3, lay)
    hs = torch.empty(lay.n_cap, F, device="cuda", dtype=torch.bfloat16)
    live = int(lay.offsets[-1])
    flop = 2 * T * K * D * F
    settings = [(0, 0)] + [(m, int(n)) for m in map(int, args.modes.split(",")) for n in args.ns.split(",")]

    def run():
        dgu, part = B.gemm2_dgrad_swiglu_bwd(v.dout, v.w2, gu, v.scores, lay, hs_out=hs)
        return dgu, part

    ref = None
    rows = {s: {"mode": s[0], "ns": s[1], "ms": []} for s in settings}
    for r in range(args.rounds):
        order = settings[r % len(settings):] + settings[:r % len(settings)]
        for st in order:
            B.GEMM2_DGRAD_STAGGER = f"{st[0]}:{st[1]}"
            dgu, part = run()
            got = (dgu[:live].clone(), part[:live].clone(), hs[:live].clone())
            if ref is None:
                ref = got
            rows[st]["bitwise"] = all(torch.equal(a, b) for a, b in zip(got, ref)) and rows[st].get("bitwise", True)
            rows[st]["ms"].append(triton.testing.do_bench(run, warmup=10, rep=60))
    B.GEMM2_DGRAD_STAGGER = "0:0"
    out = []
    for st in settings:
        rec = rows[st]
        rec["ms_min_of_rounds"] = min(rec["ms"])
        rec["tflops"] = round(flop / rec["ms_min_of_rounds"] / 1e9, 1)
        print(json.dumps({"shape": args.shape, **rec}), flush=True)
        out.append(rec)
    if args.out:
        from compare.records import provenance

        run_info = provenance(device=torch.device("cuda"), world_size=1, dist_backend=None, hostnames=[],
                              argv=sys.argv[1:], options=vars(args), module="scripts.sweep_gemm2_dgrad_stagger")
        run_info["timer"] = "triton.testing.do_bench (warmup 10, rep 60 ms) median per round"
        Path(args.out).write_text(json.dumps({"shape": args.shape, "run": run_info, "rows": out}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
