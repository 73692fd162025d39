"""Per-kernel GPU benchmark of the blockwise-FP8 path, beside the bf16 kernels and
``torch._scaled_grouped_mm`` (FP8 rowwise, CUTLASS) at the same GEMM shapes. Prints one JSON line.

    python scripts/bench_fp8.py                      # Qwen3-30B-A3B and 235B-A22B layer shapes, T = 16384
    python scripts/bench_fp8.py --shapes 30b --tokens 4096
    TRITON_INTERPRET=1 python scripts/bench_fp8.py --smoke   # CPU: every call once at a tiny shape (~5 min)

Shapes: 30b D 2048 / F 768, 235b D 4096 / F 1536; E 128, K 8, near-uniform random routing (distinct
experts per token), BM = 128 layout. Timing: ``triton.testing.do_bench`` (warm-up, L2 cleared between
runs, median ms). ``gemm1_fwd_quant_h/fp8`` is GEMM1 with h
quantized in its epilogue (BN 128, 16 warps; what the op runs, ``fp8_backend.FUSE_H_QUANT``) and
replaces ``gemm1_fwd/fp8`` + ``quant_h_1x128/fp8``. FLOP model (useful work, P = T*K routed rows; the same for every implementation,
so ms compare directly): GEMM1 fwd 2*P*D*2F, GEMM2 fwd 2*P*F*D, GEMM2 dgrad 2*P*D*F, GEMM1 dgrad
2*P*2F*D, wgrad w2 2*P*D*F, wgrad w13 2*P*D*2F; quantization passes report ms only.

torch._scaled_grouped_mm baselines (rowwise scales, use_fast_accum=True as torchao's forward): the
same six GEMMs on pre-gathered, pre-quantized rows in the same padded expert-major layout (offsets
= the layout's); the wgrads as its 2D x 2D form (groups along K); a baseline it refuses is recorded
with its error instead of a time. Before timing, each FP8 kernel's output is compared with the bf16
kernel's (``rel_err_vs_bf16``: expect a few percent).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

if "--smoke" not in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "0")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

SHAPES = {"30b": (2048, 768), "235b": (4096, 1536), "smoke": (128, 128)}
E, K = 128, 8
SMOKE = False  # --smoke: CPU, Triton interpreter, E = 4, each call once (checks the script, times nothing)
FP8 = torch.float8_e4m3fn


def _rowwise(x2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rowwise e4m3 quantization (torchao-style; not timed): values (M, N) and fp32 scales (M,)."""
    s = x2d.float().abs().amax(-1).clamp(min=1e-12) / 448.0
    return (x2d.float() / s[:, None]).clamp(-448, 448).to(FP8), s


def _bench_shape(name: str, T: int) -> dict:
    import triton

    from titan_megamoe.kernels import grouped_gemm as gg
    from titan_megamoe.kernels import grouped_gemm_bwd as gb
    from titan_megamoe.kernels.configs import config_for
    from titan_megamoe.kernels.fp8_quant import quantize_act_1x128, quantize_weight_128x128
    from titan_megamoe.kernels.fp8_quant_bwd import quantize_dual_1x128_128x1_t, quantize_gather_128x1_t
    from titan_megamoe.kernels.grouped_gemm_fp8 import fp8_config_for, gemm1_swiglu_fwd_fp8, gemm2_scatter_fwd_fp8
    from titan_megamoe.kernels.grouped_gemm_fp8_bwd import gemm1_dgrad_fp8, gemm2_dgrad_swiglu_bwd_fp8, wgrad_fp8
    from titan_megamoe.kernels.routing import build_routing_layout
    from titan_megamoe.ops.fp8_backend import quantize_weights
    from titan_megamoe.testing import rel_err

    global E, K
    D, F = SHAPES[name]
    dev = "cpu" if SMOKE else "cuda"
    if SMOKE:
        E, K = 4, 2
    torch.manual_seed(0)
    x = torch.randn(T, D, device=dev).bfloat16()
    dout = torch.randn(T, D, device=dev).bfloat16()
    w1 = (torch.randn(E, F, D, device=dev) / D**0.5).bfloat16()
    w3 = (torch.randn(E, F, D, device=dev) / D**0.5).bfloat16()
    w2 = (torch.randn(E, D, F, device=dev) / F**0.5).bfloat16()
    ids = torch.rand(T, E, device=dev).topk(K, dim=1).indices
    scores = torch.softmax(torch.randn(T, K, device=dev), -1).float()
    L = build_routing_layout(ids, E, 128)
    P, N = T * K, L.n_cap
    valid = L.row_pair >= 0
    live = torch.where(valid, torch.arange(N, device=dev, dtype=torch.int32), -1)
    bm = dict(block_m=128)
    import dataclasses

    c1 = dataclasses.replace(config_for("gemm1", D, F, SMOKE), **bm)
    c2 = dataclasses.replace(config_for("gemm2", D, F, SMOKE), **bm)
    f1 = dataclasses.replace(fp8_config_for("gemm1", D, F, SMOKE), **bm)
    f2 = dataclasses.replace(fp8_config_for("gemm2", D, F, SMOKE), **bm)
    # the persistent GEMM2 configs (GemmConfig.persistent; the FP8 default, TITAN_MEGAMOE_PERSISTENT_GEMM2_FP8;
    # TITAN_MEGAMOE_PERSISTENT_GEMM2=1 for bf16); the plain rows are the grid kernels whatever the default
    from titan_megamoe.kernels.configs import HOPPER_GEMM2, HOPPER_GEMM2_PERSISTENT
    from titan_megamoe.kernels.grouped_gemm_fp8 import HOPPER_GEMM2_FP8, HOPPER_GEMM2_FP8_PERSISTENT

    if c2.persistent:
        c2 = dataclasses.replace(HOPPER_GEMM2, block_n=c2.block_n, block_k=c2.block_k, **bm)
    if f2.persistent:
        f2 = dataclasses.replace(HOPPER_GEMM2_FP8, block_n=f2.block_n, **bm)

    c2p = dataclasses.replace(c2, persistent=True) if SMOKE else dataclasses.replace(
        HOPPER_GEMM2_PERSISTENT, block_n=c2.block_n, block_k=c2.block_k)
    f2p = dataclasses.replace(f2, persistent=True) if SMOKE else dataclasses.replace(
        HOPPER_GEMM2_FP8_PERSISTENT, block_n=f2.block_n)

    # ---- operands (every FP8 operand from the kernels that make it in the op) ----------------------
    w1q, w1s, w1tq, w1ts = quantize_weights(w1, transposed=True, forward=True, count=None, name="w1")
    w3q, w3s, w3tq, w3ts = quantize_weights(w3, transposed=True, forward=True, count=None, name="w3")
    w2q, w2s, w2tq, w2ts = quantize_weights(w2, transposed=True, forward=True, count=None, name="w2")
    xq, xs = quantize_act_1x128(x)
    gu16, h16 = gg.gemm1_swiglu_fwd(x, w1, w3, L, config=c1)
    gu8, h8 = gemm1_swiglu_fwd_fp8(xq, xs, w1q, w1s, w3q, w3s, L, config=f1)
    hq, hs = quantize_act_1x128(h8, live, 1)
    y16 = gg.gemm2_scatter_fwd(h16, w2, scores, L, config=c2)
    y8 = gemm2_scatter_fwd_fp8(hq, hs, w2q, w2s, scores, L, config=f2)
    dq, ds = quantize_act_1x128(dout)
    hs16 = torch.empty((N, F), dtype=torch.bfloat16, device=dev)
    dgu16, part16 = gb.gemm2_dgrad_swiglu_bwd(dout, w2, gu16, scores, L, hs_out=hs16)
    dgu8, part8, hsT, hsTs = gemm2_dgrad_swiglu_bwd_fp8(dq, ds, w2tq, w2ts, gu16, scores, L)
    dguq, dgus, dguTq, dguTs = quantize_dual_1x128_128x1_t(dgu16, valid)
    doTq, doTs = quantize_gather_128x1_t(dout, L.row_pair, K)
    xTq, xTs = quantize_gather_128x1_t(x, L.row_pair, K)
    rows = valid.nonzero().squeeze(1)
    # the persistent GEMM2s: bitwise the grid kernels' outputs
    y8p = gemm2_scatter_fwd_fp8(hq, hs, w2q, w2s, scores, L, config=f2p)
    y16p = gg.gemm2_scatter_fwd(h16, w2, scores, L, config=c2p)
    persistent_bitwise = {"fp8": torch.equal(y8p, y8), "bf16": torch.equal(y16p, y16)}
    checks = {
        "gemm1_fwd_h": rel_err(h8[rows], h16[rows]), "gemm2_fwd_y": rel_err(y8, y16),
        "gemm2_dgrad_dgate_up": rel_err(dgu8[rows], dgu16[rows]),
        "wgrad_w2": rel_err(wgrad_fp8(doTq, doTs, hsT, hsTs, L)[0], gb.wgrad_w2(dout, gu16, scores, L, hs_NF=hs16)),
        "wgrad_w13": rel_err(torch.cat(wgrad_fp8(dguTq, dguTs, xTq, xTs, L, split=F), 1),
                             torch.cat(gb.wgrad_w13(dgu16, x, L), 1)),
        "gemm1_dgrad": rel_err(gemm1_dgrad_fp8(dguq, dgus, w1tq, w1ts, w3tq, w3ts, L)[rows],
                               gb.gemm1_dgrad(dgu16, w1, w3, L)[rows]),
    }

    g1, g2 = 2 * P * D * 2 * F, 2 * P * D * F
    cases = [  # (kernel, implementation, flops, fn)
        ("gemm1_fwd", "fp8", g1, lambda: gemm1_swiglu_fwd_fp8(xq, xs, w1q, w1s, w3q, w3s, L, gate_up_out=gu8, h_out=h8,
                                                              config=f1)),
        ("gemm1_fwd_quant_h", "fp8", g1, lambda: gemm1_swiglu_fwd_fp8(
            xq, xs, w1q, w1s, w3q, w3s, L, quantize_h=True,
            config=dataclasses.replace(f1, block_n=128) if SMOKE else None)),
        ("gemm1_fwd", "bf16", g1, lambda: gg.gemm1_swiglu_fwd(x, w1, w3, L, gate_up_out=gu16, h_out=h16, config=c1)),
        ("gemm2_fwd", "fp8", g2, lambda: gemm2_scatter_fwd_fp8(hq, hs, w2q, w2s, scores, L, out=y8,
                                                               config=f2)),
        ("gemm2_fwd", "bf16", g2, lambda: gg.gemm2_scatter_fwd(h16, w2, scores, L, out_pairs=y16, config=c2)),
        ("gemm2_fwd_persistent", "fp8", g2, lambda: gemm2_scatter_fwd_fp8(hq, hs, w2q, w2s, scores, L, out=y8p,
                                                                          config=f2p)),
        ("gemm2_fwd_persistent", "bf16", g2, lambda: gg.gemm2_scatter_fwd(h16, w2, scores, L, out_pairs=y16p,
                                                                          config=c2p)),
        ("gemm2_dgrad", "fp8", g2, lambda: gemm2_dgrad_swiglu_bwd_fp8(dq, ds, w2tq, w2ts, gu16, scores, L)),
        ("gemm2_dgrad", "bf16", g2, lambda: gb.gemm2_dgrad_swiglu_bwd(dout, w2, gu16, scores, L, hs_out=hs16)),
        ("gemm1_dgrad", "fp8", g1, lambda: gemm1_dgrad_fp8(dguq, dgus, w1tq, w1ts, w3tq, w3ts, L)),
        ("gemm1_dgrad", "bf16", g1, lambda: gb.gemm1_dgrad(dgu16, w1, w3, L)),
        ("wgrad_w2", "fp8", g2, lambda: wgrad_fp8(doTq, doTs, hsT, hsTs, L)),
        ("wgrad_w2", "bf16", g2, lambda: gb.wgrad_w2(dout, gu16, scores, L, hs_NF=hs16)),
        ("wgrad_w13", "fp8", g1, lambda: wgrad_fp8(dguTq, dguTs, xTq, xTs, L, split=F)),
        ("wgrad_w13", "bf16", g1, lambda: gb.wgrad_w13(dgu16, x, L)),
        ("quant_x_1x128", "fp8", 0, lambda: quantize_act_1x128(x)),
        ("quant_h_1x128", "fp8", 0, lambda: quantize_act_1x128(h8, live, 1)),
        ("quant_dout_1x128", "fp8", 0, lambda: quantize_act_1x128(dout)),
        ("quant_dgate_up_dual", "fp8", 0, lambda: quantize_dual_1x128_128x1_t(dgu16, valid)),
        ("quant_dout_128x1_t", "fp8", 0, lambda: quantize_gather_128x1_t(dout, L.row_pair, K)),
        ("quant_x_128x1_t", "fp8", 0, lambda: quantize_gather_128x1_t(x, L.row_pair, K)),
        ("quant_weights_fwd_and_t", "fp8", 0, lambda: [quantize_weights(w, transposed=True, forward=True, count=None,
                                                                        name="w") for w in (w1, w3, w2)]),
        ("quant_weights_128x128_only", "fp8", 0, lambda: [quantize_weight_128x128(w) for w in (w1, w3, w2)]),
        # before session 40: the transposed copy by PyTorch's strided copy of the e4m3 tensor (now in the kernel)
        ("quant_weights_fwd_then_torch_t", "fp8", 0,
         lambda: [(q.transpose(1, 2).contiguous(), s.transpose(1, 2).contiguous())
                  for q, s in (quantize_weight_128x128(w) for w in (w1, w3, w2))]),
        ("quant_weights_t_only", "fp8", 0, lambda: [quantize_weights(w, transposed=True, forward=False, count=None,
                                                                     name="w") for w in (w1, w3, w2)]),
    ]
    cases += _scaled_grouped_mm_cases(x, dout, w1, w3, w2, L, D, F, g1, g2)

    out = {}
    for kernel, impl, flops, fn in cases:
        key = f"{kernel}/{impl}"
        try:
            if SMOKE:
                t0 = time.perf_counter()
                fn()
                ms = (time.perf_counter() - t0) * 1e3
            else:
                fn()
                torch.cuda.synchronize()
                ms = triton.testing.do_bench(fn, warmup=25, rep=100)
            out[key] = {"ms": round(ms, 4)}
            if flops:
                out[key]["tflops"] = round(flops / ms / 1e9, 1)
        except Exception as e:  # one failing baseline must not hide the others
            out[key] = {"error": repr(e)[:300]}
        print(f"[bench_fp8] {name} {key}: {out[key]}", file=sys.stderr, flush=True)
    return {"shape": name, "T": T, "D": D, "F": F, "E": E, "K": K, "rows_padded": N,
            "rel_err_fp8_vs_bf16": {k: round(v, 5) for k, v in checks.items()},
            "gemm2_persistent_bitwise_grid": persistent_bitwise, "kernels": out}


def _scaled_grouped_mm_cases(x, dout, w1, w3, w2, L, D, F, g1, g2) -> list:
    """torch._scaled_grouped_mm (rowwise) at the six GEMM shapes, on pre-gathered rows of the layout."""
    dev = x.device
    valid = (L.row_pair >= 0)
    tok = torch.where(valid, L.row_pair.long() // K, 0)
    xr = torch.where(valid[:, None], x[tok], 0)  # (N, D) gathered rows
    dr = torch.where(valid[:, None], dout[tok], 0)
    hr = torch.randn(L.n_cap, F, device=dev).bfloat16()
    gur = torch.randn(L.n_cap, 2 * F, device=dev).bfloat16()
    offs = L.offsets[1:].contiguous()  # (E,) int32 cumulative row ends (multiples of 128)
    w13 = torch.cat([w1, w3], 1)  # (E, 2F, D)
    xq, xs = _rowwise(xr)
    hq, hs = _rowwise(hr)
    dq, ds = _rowwise(dr)
    gq, gs = _rowwise(gur)

    def wt(w):  # (E, N, Kd) -> B_t (E, Kd, N) column-major + (E, N) scales
        s = w.float().abs().amax(-1).clamp(min=1e-12) / 448.0
        q = (w.float() / s[..., None]).clamp(-448, 448).to(FP8)
        return q.transpose(-2, -1), s

    b1, s1 = wt(w13)  # GEMM1 fwd: x (N, D) @ w13^T
    b2, s2 = wt(w2)  # GEMM2 fwd: h (N, F) @ w2^T
    b3, s3 = wt(w2.transpose(1, 2).contiguous())  # GEMM2 dgrad: dout (N, D) @ w2
    b4, s4 = wt(w13.transpose(1, 2).contiguous())  # GEMM1 dgrad: dgate_up (N, 2F) @ w13
    kw = dict(offs=offs, out_dtype=torch.bfloat16, use_fast_accum=True)
    sgm = torch._scaled_grouped_mm

    # wgrad (2D x 2D, groups along K = rows): A (M, rows) row-major, B (rows, N) column-major;
    # rowwise scales per (group, row of A) and (group, column of B)
    def wg(aT_bf16, b_bf16):
        aq = aT_bf16.contiguous()
        a_s = aq.float().abs().amax(-1).clamp(min=1e-12) / 448.0
        a8 = (aq.float() / a_s[:, None]).clamp(-448, 448).to(FP8)
        bT = b_bf16.t().contiguous()
        b_s = bT.float().abs().amax(-1).clamp(min=1e-12) / 448.0
        b8 = (bT.float() / b_s[:, None]).clamp(-448, 448).to(FP8).t()  # (rows, N) column-major
        return a8, a_s.repeat(E), b8, b_s.repeat(E)

    a5, sa5, bb5, sb5 = wg(dr.t(), torch.randn(L.n_cap, F, device=dev).bfloat16())
    a6, sa6, bb6, sb6 = wg(gur.t(), xr)
    return [
        ("gemm1_fwd", "scaled_grouped_mm_rowwise", g1, lambda: sgm(xq, b1, xs, s1, **kw)),
        ("gemm2_fwd", "scaled_grouped_mm_rowwise", g2, lambda: sgm(hq, b2, hs, s2, **kw)),
        ("gemm2_dgrad", "scaled_grouped_mm_rowwise", g2, lambda: sgm(dq, b3, ds, s3, **kw)),
        ("gemm1_dgrad", "scaled_grouped_mm_rowwise", g1, lambda: sgm(gq, b4, gs, s4, **kw)),
        ("wgrad_w2", "scaled_grouped_mm_rowwise", g2, lambda: sgm(a5, bb5, sa5, sb5, **kw)),
        ("wgrad_w13", "scaled_grouped_mm_rowwise", g1, lambda: sgm(a6, bb6, sa6, sb6, **kw)),
    ]


def _provenance() -> dict:
    import triton

    if SMOKE:
        return {"gpu": None, "torch": torch.__version__, "triton": triton.__version__, "smoke": True}
    # the GPU machine's copy of .git can be stale: the session scripts pass the revision in TITAN_MEGAMOE_GIT_REV
    commit = os.environ.get("TITAN_MEGAMOE_GIT_REV")
    if not commit:
        try:
            commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                                    text=True).stdout.strip()
        except OSError:
            commit = None
    return {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "commit": commit, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join([Path(sys.executable).name] + sys.argv)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="30b,235b", help="comma list of 30b, 235b")
    p.add_argument("--tokens", type=int, default=16384, help="tokens T (routed rows P = T * 8)")
    p.add_argument("--smoke", action="store_true", help="CPU + interpreter, tiny shape, each call once")
    a = p.parse_args(argv)
    global SMOKE
    if a.smoke:
        SMOKE = True
        a.shapes, a.tokens = "smoke", 24
    elif not torch.cuda.is_available():
        raise SystemExit("bench_fp8 needs a CUDA GPU (FP8 tensor cores: compute capability >= 8.9)")
    rec = {"bench": "fp8_kernels", **_provenance(), "shapes": [_bench_shape(s, a.tokens) for s in a.shapes.split(",")]}
    print(json.dumps(rec))
    return 0


if __name__ == "__main__":
    sys.exit(main())
