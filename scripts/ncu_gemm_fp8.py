"""Launch the Gluon blockwise-FP8 GEMMs whose stall reasons Nsight Compute should show (GPU only): a dense
``torch._scaled_mm`` (rowwise e4m3, cuBLAS) of the GEMM1's size, then the FP8 GEMM1 forward, GEMM1 dgrad, GEMM2
forward and GEMM2 dgrad (both schedules) at one shape, each ``--reps`` + 1 times.

    ncu --clock-control none --launch-skip 1 -k regex:"_fp8_ws_kernel|gemm|nvjet|sm90|cutlass|device_kernel" \
        --section SpeedOfLight --section SchedulerStats --metrics "regex:smsp__average_warps_issue_stalled_.*" \
        python scripts/ncu_gemm_fp8.py      (scripts/sessions/gpu_s34.sh PART c runs it with the full metric list)

Why (docs/NOTES.md, sessions 24-35): the FP8 GEMMs run at 750-900 TF/s on an H100, about the bf16 kernels' 600-700,
against 1,200-1,300 for a dense rowwise e4m3 GEMM; the wgrad's ablation put the bound in the per-K-block scaling
under the cooperative schedule, not in the operand stream, and wider tiles bought nothing. The stall reasons of the
forward-shaped kernels (whose scales are per row and per weight block, cheaper than the wgrad's outer products)
say whether the same holds there: barrier / wait stalls (the consumers' mbarrier waits and warpgroup syncs), long
scoreboard (scale loads), or math-pipe throttle (the promotion FMAs). Session 36's hypothesis to test: the main
loops of the gathered-row kernels (GEMM1 forward, GEMM2 dgrad) are bound by the L2 -> SM stream (~5 TB/s of operand
tiles: ``lts__t_bytes``), which wider tiles or TMA multicast would cut. ``--time`` prints do_bench medians and TF/s.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

SHAPES = {"30b": (2048, 768), "235b": (4096, 1536)}  # D, F (128 experts, top-8, 16384 tokens)


def _runs(shape: str) -> tuple[dict, dict]:
    """{name: launch} and {name: FLOPs} at ``shape``: operands quantized once, uniform routing."""
    from titan_megamoe.kernels.fp8_quant import quantize_act_1x128, quantize_weight_128x128
    from titan_megamoe.kernels.routing import build_routing_layout
    from titan_megamoe.kernels.ws_gemm2_dgrad_fp8 import (GEMM2_DGRAD_FP8_CONFIG, GEMM2_DGRAD_FP8_PINGPONG,
                                                          launch_gemm2_dgrad_fp8, ws_gemm2_dgrad_fp8)
    from titan_megamoe.kernels.ws_gemm_fp8 import ws_gemm1_dgrad_fp8, ws_gemm1_fwd_fp8, ws_gemm2_fwd_fp8
    from titan_megamoe.testing import make_routing

    D, F = SHAPES[shape]
    E, K, T = 128, 8, 16384
    P = T * K
    g = torch.Generator(device="cuda").manual_seed(0)
    lay = build_routing_layout(make_routing("uniform", T, E, K, seed=0).cuda(), E, 128)

    def weight(*dims: int, fan_in: int):
        return quantize_weight_128x128((torch.randn(*dims, device="cuda", generator=g) / fan_in ** 0.5).bfloat16())

    x = quantize_act_1x128(torch.randn(T, D, device="cuda", generator=g).bfloat16())
    w1, w3 = weight(E, F, D, fan_in=D), weight(E, F, D, fan_in=D)
    dgu = quantize_act_1x128(torch.randn(lay.n_cap, 2 * F, device="cuda", generator=g).bfloat16())
    w1t, w3t = weight(E, D, F, fan_in=F), weight(E, D, F, fan_in=F)
    h = quantize_act_1x128(torch.randn(lay.n_cap, F, device="cuda", generator=g).bfloat16())
    w2 = weight(E, D, F, fan_in=F)
    scores = torch.rand(T, K, device="cuda", generator=g)
    a = torch.randn(P, D, device="cuda", generator=g).to(torch.float8_e4m3fn)
    b = torch.randn(2 * F, D, device="cuda", generator=g).to(torch.float8_e4m3fn)
    sa, sb = torch.ones(P, 1, device="cuda"), torch.ones(1, 2 * F, device="cuda")
    g1, g1d = ws_gemm1_fwd_fp8(*x, *w1, *w3, lay), ws_gemm1_dgrad_fp8(*dgu, *w1t, *w3t, lay)
    g2 = ws_gemm2_fwd_fp8(*h, *w2, scores, lay)  # first launches: compile, and the outputs reused below
    dout = quantize_act_1x128(torch.randn(T, D, device="cuda", generator=g).bfloat16())
    w2t = weight(E, F, D, fan_in=D)
    gate_up = (2 * torch.randn(lay.n_cap, 2 * F, device="cuda", generator=g)).bfloat16()
    gate_up[lay.row_pair < 0] = 0
    g2d_ops = (*dout, *w2t, gate_up, scores, lay)
    g2d = ws_gemm2_dgrad_fp8(*g2d_ops, cfg=GEMM2_DGRAD_FP8_PINGPONG)
    runs = {
        f"dense torch._scaled_mm rowwise (P x D) @ (D x 2F) {shape}":
            lambda: torch._scaled_mm(a, b.t(), sa, sb, out_dtype=torch.bfloat16, use_fast_accum=True),
        f"gluon ws_gemm1_fwd_fp8 {shape}": lambda: ws_gemm1_fwd_fp8(*x, *w1, *w3, lay, gate_up_out=g1[0], h_out=g1[1]),
        f"gluon ws_gemm1_dgrad_fp8 {shape}": lambda: ws_gemm1_dgrad_fp8(*dgu, *w1t, *w3t, lay, out=g1d),
        f"gluon ws_gemm2_fwd_fp8 {shape}": lambda: ws_gemm2_fwd_fp8(*h, *w2, scores, lay, out=g2),
        f"gluon ws_gemm2_dgrad_fp8 cooperative {shape}":
            lambda: launch_gemm2_dgrad_fp8(*g2d_ops, *g2d, None, GEMM2_DGRAD_FP8_CONFIG),
        f"gluon ws_gemm2_dgrad_fp8 ping-pong {shape}":
            lambda: launch_gemm2_dgrad_fp8(*g2d_ops, *g2d, None, GEMM2_DGRAD_FP8_PINGPONG),
    }
    gemm1 = 2 * P * 2 * F * D
    flops = dict(zip(runs, (gemm1, gemm1, gemm1, gemm1 // 2, gemm1 // 2, gemm1 // 2)))
    return runs, flops


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="30b")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--time", action="store_true", help="do_bench medians and TF/s instead of bare launches")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("ncu_gemm_fp8: needs a CUDA GPU", file=sys.stderr)
        return 2
    from ncu_gemm_l2 import launch_or_time  # scripts/ on sys.path as the script's directory

    launch_or_time(*_runs(a.shape), a.time, a.reps)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
