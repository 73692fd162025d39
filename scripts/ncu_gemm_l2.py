"""Launch the bf16 GEMMs whose limits Nsight Compute should compare (GPU only): a dense cuBLAS GEMM with the
235B GEMM1 dgrad's sizes, then the Gluon GEMM1 dgrad (default and split_n) and GEMM1 forward at the 235B shape,
each ``--reps`` + 1 times.

    ncu --clock-control none --launch-skip 1 -k regex:"gemm|nvjet|_ws_kernel" --metrics ... \
        python scripts/ncu_gemm_l2.py

Why: the bf16 Gluon GEMMs run at ~600-620 TF/s against ~740 for cuBLAS on an H100 (docs/NOTES.md, session 18).
A 128 x 256 tile at BK 64 loads 48 KB per 4.2 MFLOP (87 FLOP/byte), so 620 TF/s asks ~7 TB/s from L2 — the
hypothesis is that L2 -> SM bandwidth, not the tensor cores, bounds them (cuBLAS multicasts one operand within
a 2-CTA cluster). Without Nsight it prints do_bench times and the implied L2 read rate.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--time", action="store_true", help="do_bench medians instead of bare launches")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("ncu_gemm_l2: needs a CUDA GPU", file=sys.stderr)
        return 2
    from bench_ws_gemm import _inputs  # noqa: E402  (scripts/ on sys.path as the script's directory)

    from titan_megamoe.kernels.routing import build_routing_layout
    from titan_megamoe.kernels.ws_gemm import CONFIGS, ws_gemm1_dgrad, ws_gemm1_fwd
    from titan_megamoe.testing import make_routing

    D, F, E, K, T = 4096, 1536, 128, 8, 16384
    P = T * K
    lay, dgu, w1, w3 = _inputs(T, E, K, D, F, "uniform", seed=0)
    x = torch.randn(T, D, device="cuda").bfloat16()
    lay_f = build_routing_layout(make_routing("uniform", T, E, K, seed=0).cuda(), E, 128)
    a_dense = torch.randn(P, 2 * F, device="cuda").bfloat16()
    b_dense = torch.randn(2 * F, D, device="cuda").bfloat16()
    out = torch.empty(P, D, device="cuda", dtype=torch.bfloat16)
    runs = {"dense cuBLAS (P x 2F) @ (2F x D)": lambda: torch.mm(a_dense, b_dense, out=out),
            "gluon ws_gemm1_dgrad 235B": lambda: ws_gemm1_dgrad(dgu, w1, w3, lay),
            "gluon ws_gemm1_dgrad split_n 235B": lambda: ws_gemm1_dgrad(dgu, w1, w3, lay, cfg=CONFIGS["split"]),
            "gluon ws_gemm1_fwd 235B": lambda: ws_gemm1_fwd(x, w1, w3, lay_f)}
    launch_or_time(runs, dict.fromkeys(runs, 2 * P * 2 * F * D), a.time, a.reps)
    return 0


def launch_or_time(runs: dict, flops: dict, time: bool, reps: int) -> None:
    """Each of ``runs`` (name: launch) ``reps`` + 1 times for Nsight Compute, or with ``time`` its do_bench median
    printed as a JSON line with its TF/s (``flops``: name: FLOPs)."""
    for name, fn in runs.items():
        if time:
            import triton

            ms = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
            print(json.dumps(dict(kernel=name, ms=ms, tflops=flops[name] / ms / 1e9)), flush=True)
        else:
            for _ in range(reps + 1):
                fn()
            torch.cuda.synchronize()


if __name__ == "__main__":
    raise SystemExit(main())
