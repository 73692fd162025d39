"""Where the FP8 GEMM1 forward's epilogue-quantized h (``ws_gemm1_fwd_fp8(quantize_h=True)``) differs from the 1x128
pass over its bf16 h (``quantize_act_1x128``): mismatch counts by row within the 64-row consumer tile, by column, e4m3
distance, run-to-run repeatability. A diagnosis probe (session 38), not a test: prints one JSON line per case.

    python scripts/probe_quant_h.py
"""

import json

import torch


def main() -> int:
    import sys

    sys.path.insert(0, "tests")
    from test_ws_gemm_fp8 import _fp8_operands

    from titan_megamoe.kernels.fp8_quant import quantize_act_1x128
    from titan_megamoe.kernels.ws_gemm_fp8 import FP8_FWD_CONFIG, FP8_FWD_WIDE_CONFIG, ws_gemm1_fwd_fp8

    for case in [(1000, 8, 1, 256, 128, "uniform"), (16384, 128, 8, 2048, 768, "uniform")]:
        T, E, K, D, F, routing = case
        lay, xq, xs, w1q, w1s, w3q, w3s = _fp8_operands(T, E, K, D, F, routing, 3, "cuda")
        n = int(lay.offsets[-1])
        gu, h = ws_gemm1_fwd_fp8(xq, xs, w1q, w1s, w3q, w3s, lay, cfg=FP8_FWD_CONFIG)
        want_q, want_s = quantize_act_1x128(h, row_valid=lay.row_pair)
        for mode in (1,):
            runs = []
            for _ in range(3):
                oq = torch.full((lay.n_cap, F), 0x7F, device="cuda", dtype=torch.uint8).view(torch.float8_e4m3fn)
                _, q, s = ws_gemm1_fwd_fp8(xq, xs, w1q, w1s, w3q, w3s, lay, cfg=FP8_FWD_WIDE_CONFIG, quantize_h=True, h_out=oq)
                runs.append((q[:n].view(torch.uint8).clone(), s[:n].clone()))
            gq, gs = runs[0]
            wq, ws = want_q[:n].view(torch.uint8), want_s[:n]
            bad = gq != wq
            rows, cols = bad.nonzero(as_tuple=True)
            gf, wf = gq.view(torch.float8_e4m3fn).float(), wq.view(torch.float8_e4m3fn).float()
            rec = dict(case=list(case), mode=mode, n=n, mismatches=int(bad.sum()), of=bad.numel(),
                       rows_with_mismatch=int(bad.any(1).sum()), scale_mismatch_rows=int((gs != ws).any(1).sum()),
                       repeatable=all(torch.equal(r[0], gq) and torch.equal(r[1], gs) for r in runs[1:]),
                       row_in_tile_hist=torch.bincount(rows % 64, minlength=64).tolist() if len(rows) else [],
                       col_hist_by_16=torch.bincount(cols // 16, minlength=F // 16).tolist() if len(cols) else [],
                       unwritten_0x7f=int((gq == 0x7F).sum()),
                       examples=[dict(r=int(r), c=int(c), got=int(gq[r, c]), want=int(wq[r, c]), got_f=float(gf[r, c]),
                                      want_f=float(wf[r, c]), h=float(h[r, c]), scale_got=float(gs[r, c // 128]),
                                      scale_want=float(ws[r, c // 128]), pair=int(lay.row_pair[r]))
                                 for r, c in list(zip(rows.tolist(), cols.tolist()))[:12]])
            print(json.dumps(rec), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
