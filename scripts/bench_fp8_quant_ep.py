"""One-GPU diagnosis: the FP8 backward's quantization passes and FP8 backward GEMMs on the EP = 1
layout and on an EP = 2-like receive layout (slab of R * T rows, slots of the other rank -1, capacity
2 * T * K), same routed rows. Why are the passes 4-5x slower inside the EP = 2 backward
(``ep_overlap_2xh200_fp8_20261130.json``) than in ``bench_fp8.py`` at EP = 1? Prints one JSON line.

    python scripts/bench_fp8_quant_ep.py [--shape 30b] [--out FILE]

Timing: ``triton.testing.do_bench`` (median ms, L2 cleared between runs).
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


def main() -> int:
    import triton

    from titan_megamoe.kernels.fp8_quant import quantize_act_1x128
    from titan_megamoe.kernels.fp8_quant_bwd import quantize_dual_1x128_128x1_t, quantize_gather_128x1_t
    from titan_megamoe.kernels.grouped_gemm_fp8_bwd import gemm2_dgrad_swiglu_bwd_fp8, wgrad_fp8
    from titan_megamoe.kernels.routing import build_routing_layout
    from titan_megamoe.ops.fp8_backend import placed_token_rows, quantize_weights

    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="30b")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--out")
    ap.add_argument("--cpu-check", action="store_true", help="TRITON_INTERPRET=1 on CPU: run each case once")
    a = ap.parse_args()
    D, F = {"30b": (2048, 768), "235b": (4096, 1536), "tiny": (128, 128)}[a.shape]
    T, E, K, R = a.tokens, 128, 8, 2
    torch.manual_seed(0)
    dev = "cpu" if a.cpu_check else "cuda"
    ids = torch.rand(R * T, E, device=dev).topk(K, dim=1).indices.int()
    res = {"shape": a.shape, "T": T, "D": D, "F": F, "E": E, "K": K, "gpu": "cpu" if a.cpu_check else torch.cuda.get_device_name()}
    w2 = (torch.randn(E, D, F, device=dev) / F**0.5).bfloat16()
    layouts = {
        # EP = 1: this rank's T tokens, all E experts
        "ep1": (build_routing_layout(ids[:T], E, 128), T),
        # EP = 2 receive side of rank 0: slab of R * T rows, experts >= E / R belong to rank 1 (-1 here)
        "ep2_recv": (build_routing_layout(torch.where(ids < E // R, ids, -1), E // R, 128, max_rows=R * T * K),
                     R * T),
    }
    for name, (L, rows) in layouts.items():
        x = torch.randn(rows, D, device=dev).bfloat16()
        dout = torch.randn(rows, D, device=dev).bfloat16()
        dgu = torch.randn(L.n_cap, 2 * F, device=dev).bfloat16()
        valid = L.row_pair >= 0
        end = L.offsets[-1:]
        gu = torch.randn(L.n_cap, 2 * F, device=dev).bfloat16()
        sc = torch.rand(rows, K, device=dev)
        ne = L.num_experts
        _, _, w2tq, w2ts = quantize_weights(w2[:ne].contiguous(), transposed=True, forward=False, count=None,
                                            name="w2")
        dq, ds = quantize_act_1x128(dout)
        _, _, hsT, hsTs = gemm2_dgrad_swiglu_bwd_fp8(dq, ds, w2tq, w2ts, gu, sc, L)
        doT, doTs = quantize_gather_128x1_t(dout, L.row_pair, K, end_row=end)
        cases = {
            "quant_dual_end": lambda: quantize_dual_1x128_128x1_t(dgu, valid, end_row=end),
            "quant_dual_noend": lambda: quantize_dual_1x128_128x1_t(dgu, valid),
            "quant_gather_T_end": lambda: quantize_gather_128x1_t(x, L.row_pair, K, end_row=end),
            "quant_gather_T_noend": lambda: quantize_gather_128x1_t(x, L.row_pair, K),
            "quant_1x128_placed": lambda: quantize_act_1x128(x, placed_token_rows(L), 1),
            "gemm2_dgrad_fp8": lambda: gemm2_dgrad_swiglu_bwd_fp8(dq, ds, w2tq, w2ts, gu, sc, L),
            "wgrad_w2_fp8": lambda: wgrad_fp8(doT, doTs, hsT, hsTs, L),
            "copy_dgu_bf16": lambda: dgu.clone(),
        }
        out = {"n_cap": L.n_cap, "rows_in_use": int(L.offsets[-1]), "experts": ne}
        for k, fn in cases.items():
            fn()
            if a.cpu_check:
                continue
            torch.cuda.synchronize()
            out[k] = round(triton.testing.do_bench(fn, warmup=10, rep=60), 4)
            print(f"[bench_fp8_quant_ep] {name} {k}: {out[k]} ms", file=sys.stderr, flush=True)
        res[name] = out
    line = json.dumps(res)
    print(line)
    if a.out:
        Path(a.out).write_text(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
