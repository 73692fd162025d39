"""GPU: time each fused kernel (forward and backward) under a list of launch configs, at a real shape.

    python scripts/sweep_kernel_configs.py 30b|235b [--out results.json] [--kinds gemm1,wgrad_w13,...] [--quick | --two-cta]

Kinds: gemm1, gemm2, gemm2_dgrad, gemm2_dgrad_nohs (the same without its s*h store: an epilogue
ablation), gemm1_dgrad, wgrad_w2, wgrad_w13; and the blockwise-FP8 backward's Triton kernels
(``grouped_gemm_fp8_bwd.py``) gemm2_dgrad_fp8, wgrad_w2_fp8, wgrad_w13_fp8 (operands quantized as the op does; the
wgrad kinds also time the Gluon kernel of ``ws_wgrad_fp8.py`` against the Triton default);
and its memory-bound quantization passes (``fp8_quant_bwd.py``: quant_dual_fp8 of dgate_up, quant_gather_t_fp8 of x)
over their warps / column block (module constants, set for the sweep).

Every variant's output is checked against the default config's (same math, so rel. error ~0); a
config that fails to compile or run is reported and skipped. Each row also gives what the compiled
kernels use (registers, spills, shared memory) and how many programs that lets an SM hold. Prints one JSON line per variant and
writes them all to --out. This is how kernels/configs.py and default_bwd_config chose their defaults.
"""

from __future__ import annotations

import argparse
import dataclasses
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
from titan_megamoe.kernels import grouped_gemm_fp8_bwd as B8  # noqa: E402
from titan_megamoe.kernels.configs import GemmConfig, config_for  # noqa: E402
from titan_megamoe.kernels.routing import build_routing_layout  # noqa: E402
from titan_megamoe.testing import BENCH_SHAPES as SHAPES, bench_layer_inputs, rel_err  # noqa: E402



def variants(base: GemmConfig, kind: str) -> list[GemmConfig]:
    """The default first, then tile / warps / stages / group / TMA alternatives."""
    r = dataclasses.replace
    out = [base]
    if kind.endswith("_fp8"):  # BK = 128 (the scale block), BN <= 128; the dgrad's BM is the layout's 128
        if kind == "gemm2_dgrad_fp8":  # (BN, warps, stages, maxnreg): BN 64 at 128 registers fits two per SM
            alts = [(64, 8, 4, 128), (64, 8, 3, 128), (64, 4, 4, None), (64, 8, 4, None), (128, 8, 3, None),
                    (128, 8, 5, None), (128, 8, 4, 168)]
            out += [r(base, block_n=n, num_warps=w, num_stages=s_, maxnreg=m) for n, w, s_, m in alts]
        else:  # (BM, BN, warps, stages, maxnreg)
            alts = [(64, 128, 4, 4, None), (64, 128, 4, 3, None), (128, 64, 4, 4, None), (128, 128, 8, 5, None),
                    (64, 128, 8, 4, 128)]  # 128 x 128 at 128 registers spills (224 B)
            out += [r(base, block_m=m_, block_n=n, num_warps=w, num_stages=s_, maxnreg=m) for m_, n, w, s_, m in alts]
            # the warp-specialized Gluon kernel (kernels/ws_wgrad_fp8.py) at 5 / 4 / 6 stages
            from titan_megamoe.kernels.ws_wgrad_fp8 import Fp8WgradConfig

            if os.environ.get("SWEEP_NO_GLUON_WGRAD") != "1":  # set by a session script whose GPU tests failed
                out += [Fp8WgradConfig(stages=st) for st in (5, 4, 6)]
        return list(dict.fromkeys(out + [r(base, group_m=8 if base.group_m == 1 else 1)]))
    if kind in ("wgrad_w2", "wgrad_w13"):  # BM is free here (an output tile of the weight)
        tiles = [(128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (256, 128, 64, 8, 3), (128, 128, 128, 8, 3),
                 (128, 128, 32, 8, 6), (128, 128, 64, 4, 4), (128, 128, 64, 8, 5), (128, 128, 64, 8, 3),
                 # 64-row output tiles, 4 warps: <= 168 registers and <= 113 KiB so two CTAs share an SM and
                 # one's prologue / epilogue hides under the other's main loop (the K loop is one expert's
                 # ~1024 rows, so a 128x128 program spends much of its time filling and draining)
                 (64, 128, 64, 4, 4), (64, 128, 64, 4, 5), (64, 128, 32, 4, 6), (64, 256, 64, 8, 5),
                 (64, 128, 128, 4, 3)]
        out += [r(base, block_m=m, block_n=n, block_k=k, num_warps=w, num_stages=s) for m, n, k, w, s in tiles]
    else:  # BM is the layout's (128)
        for n, k, w, s in [(256, 64, 8, 3), (128, 64, 8, 3), (128, 64, 8, 5), (64, 64, 4, 4), (128, 32, 8, 6),
                           (256, 64, 8, 4), (128, 128, 8, 2)]:
            if kind == "gemm1" and n > 128:  # two fp32 accumulators of BM x 256 spill
                continue
            if (n, k, w, s) != (base.block_n, base.block_k, base.num_warps, base.num_stages):
                out.append(r(base, block_n=n, block_k=k, num_warps=w, num_stages=s))
    # TMA loads: grid kernels only (a persistent default's TMA variant is the grid kernel with TMA)
    out += [r(base, group_m=8), r(base, use_tma=not base.use_tma, persistent=False)]
    if kind.startswith("gemm2_dgrad"):  # two programs per SM: <= 128 registers at 8 warps, <= 113 KiB
        out += [r(base, num_stages=s_, maxnreg=128, use_tma=t) for s_, t in [(3, True), (2, True), (3, False)]]
        out.append(r(base, num_stages=4, maxnreg=None, use_tma=True))  # one program per SM (the session-8 default)
    if kind == "gemm2":  # persistent (GemmConfig.persistent): flattened tile x K loop, pointer loads, 1 CTA / SM
        out += [r(base, persistent=True, use_tma=False, block_n=n, block_k=k, num_stages=s_)
                for n, k, s_ in [(256, 64, 3), (256, 64, 4), (128, 64, 4), (128, 64, 5)]]

    seen, uniq = set(), []
    for c in out:
        if c not in seen:
            seen.add(c)
            uniq.append(c)
    return uniq


def _fp8_operands(x, dout, w2, gu, s, lay) -> dict:
    """The FP8 backward's operands, made by the kernels the op uses (``ops/fp8_backend.py``)."""
    from titan_megamoe.kernels.fp8_quant import quantize_act_1x128
    from titan_megamoe.kernels.fp8_quant_bwd import quantize_dual_1x128_128x1_t, quantize_gather_128x1_t
    from titan_megamoe.ops.fp8_backend import quantize_weights

    K = lay.top_k
    o = {}
    _, _, o["w2tq"], o["w2ts"] = quantize_weights(w2, transposed=True, forward=False, count=None, name="w2")
    o["dq"], o["ds"] = quantize_act_1x128(dout)
    o["dgu"], _, o["hsT"], o["hsTs"] = B8.gemm2_dgrad_swiglu_bwd_fp8(o["dq"], o["ds"], o["w2tq"], o["w2ts"], gu, s,
                                                                    lay)
    _, _, o["dguTq"], o["dguTs"] = quantize_dual_1x128_128x1_t(o["dgu"], lay.row_pair >= 0)
    o["doTq"], o["doTs"] = quantize_gather_128x1_t(dout, lay.row_pair, K)
    o["xTq"], o["xTs"] = quantize_gather_128x1_t(x, lay.row_pair, K)
    return o


def _sweep_quant(kind: str, shape: str, x, lay, q8: dict) -> list[dict]:
    """Time one quantization pass of the FP8 backward under variants of its module settings (warps, column
    block), bitwise-checked against the module's defaults; reports GB/s of
    its DRAM traffic (bf16 in, e4m3 out, scales ignored; the gathered pass counts its rows' reads)."""
    from titan_megamoe.kernels import fp8_quant_bwd as QB

    names = ("_DUAL_WARPS", "_WARPS")
    saved = {n: getattr(QB, n) for n in names}
    saved_bc = dict(QB._T_BLOCK_C)
    # (session 20 also timed v2 kernels of both passes here, several tiles per program with a register prefetch:
    # slower, removed; sweep_fp8_bwd_30b_1xh100_s20c_20261206.json)
    if kind == "quant_dual_fp8":
        src = q8["dgu"]
        fn = lambda: QB.quantize_dual_1x128_128x1_t(src, lay.row_pair >= 0)  # noqa: E731
        nbytes = src.numel() * (2 + 1 + 1)
        todo = [{}, {"_DUAL_WARPS": 4}, {"_DUAL_WARPS": 16}]
    elif kind == "quant_gather_t_fp8":
        fn = lambda: QB.quantize_gather_128x1_t(x, lay.row_pair, lay.top_k)  # noqa: E731
        nbytes = lay.n_cap * x.shape[1] * (2 + 1)
        todo = [{}, {"_WARPS": 4}, {"block_c": 32}, {"_WARPS": 4, "block_c": 32}, {"block_c": 128}]
    else:
        raise ValueError(kind)
    out, ref = [], None
    for var in todo:
        rec = {"shape": shape, "kind": kind, "cfg": dict(var), "default": not var}
        try:
            for n, v in var.items():
                if n == "block_c":
                    QB._T_BLOCK_C[False] = v
                else:
                    setattr(QB, n, v)
            _forget_compiled()
            got = [t.float() if t.dtype != torch.float32 else t for t in fn()]
            rec["compiled"] = _compiled_stats()
            ref = got if ref is None else ref
            rec["bitwise_default"] = all(torch.equal(a, b) for a, b in zip(got, ref))
            rec["rel_err_vs_default"] = 0.0 if rec["bitwise_default"] else 1.0
            ms = triton.testing.do_bench(fn, warmup=10, rep=50)
            rec.update(ms=round(ms, 4), gb_per_s=round(nbytes / ms / 1e6, 1))
        except Exception as err:
            rec["error"] = repr(err)[:200]
        finally:
            for n, v in saved.items():
                setattr(QB, n, v)
            QB._T_BLOCK_C.clear()
            QB._T_BLOCK_C.update(saved_bc)
        print(json.dumps(rec), flush=True)
        out.append(rec)
    return out


def _forget_compiled() -> None:
    """Empty the fast launch path's kernel cache: the next launches re-enter it (from Triton's own cache,
    no recompile), so :func:`_compiled_stats` sees exactly the kernels one call launched."""
    from titan_megamoe.kernels import launch as L

    L._CACHES.clear()


def _compiled_stats() -> list[dict]:
    """Registers, spills and shared memory of the kernels launched since :func:`_forget_compiled`, and
    the programs per SM they allow (64 K registers, 227 KiB shared memory per H200 SM)."""
    from titan_megamoe.kernels import launch as L

    out = []
    for cache in L._CACHES.values():
        for k in cache.values():
            k = next((v for v in (k if isinstance(k, tuple) else (k,)) if hasattr(v, "metadata")), None)
            if k is None:  # an entry of the fast launch path's cache that holds no compiled kernel
                continue
            regs, shared = getattr(k, "n_regs", 0), k.metadata.shared
            threads = 32 * k.metadata.num_warps
            by_regs = 65536 // max(1, regs * threads)
            by_smem = 232448 // max(1, shared + 1024)  # + the 1 KiB the driver reserves per block
            out.append(dict(name=k.name, n_regs=regs, n_spills=getattr(k, "n_spills", None), shared=shared,
                            programs_per_sm=min(by_regs, by_smem)))
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("--out", default=None)
    ap.add_argument("--kinds", default="gemm1,gemm2,gemm2_dgrad,gemm1_dgrad,wgrad_w2,wgrad_w13")
    ap.add_argument("--quick", action="store_true",
                    help="only the default config and the 64-row (two CTAs per SM) wgrad tiles: one compile each")
    ap.add_argument("--two-cta", action="store_true",
                    help="only the default config and the register-capped variants that fit two programs per SM")
    args = ap.parse_args()
    v = bench_layer_inputs(args.shape, "cuda")
    T, E, K, D, F = v.T, v.E, v.K, v.D, v.F
    dev = "cuda"
    x, w1, w2, w3, ids, s, dout = v.x, v.w1, v.w2, v.w3, v.ids, v.scores, v.dout
    lay = build_routing_layout(ids, E, 128)
    gu, h = gg.gemm1_swiglu_fwd(x, w1, w3, lay)
    hs = torch.empty(lay.n_cap, F, device=dev, dtype=torch.bfloat16)
    dgu, _ = B.gemm2_dgrad_swiglu_bwd(dout, w2, gu, s, lay, hs_out=hs)
    P = T * K
    flop = 2 * P * D * F
    live = int(lay.offsets[-1])
    q8 = _fp8_operands(x, dout, w2, gu, s, lay) if "_fp8" in args.kinds else {}

    def run(kind: str, cfg: GemmConfig):
        if kind == "gemm1":
            return lambda: gg.gemm1_swiglu_fwd(x, w1, w3, lay, config=cfg)[1][:live], 2 * flop
        if kind == "gemm2":
            return lambda: gg.gemm2_scatter_fwd(h, w2, s, lay, config=cfg), flop
        if kind == "gemm2_dgrad":
            return lambda: B.gemm2_dgrad_swiglu_bwd(dout, w2, gu, s, lay, cfg, hs_out=hs)[0][:live], flop
        if kind == "gemm2_dgrad_nohs":  # without the s*h store: what that third epilogue store costs
            return lambda: B.gemm2_dgrad_swiglu_bwd(dout, w2, gu, s, lay, cfg)[0][:live], flop
        if kind == "gemm1_dgrad":
            return lambda: B.gemm1_dgrad(dgu, w1, w3, lay, cfg)[:live], 2 * flop
        if kind == "wgrad_w2":
            return lambda: B.wgrad_w2(dout, gu, s, lay, cfg, hs_NF=hs), flop
        if kind == "wgrad_w13":
            return lambda: torch.stack(B.wgrad_w13(dgu, x, lay, cfg)), 2 * flop
        if kind == "gemm2_dgrad_fp8":  # dgate_up and the 128x1 s*h (values and scales) side by side
            def g2d():  # views only: the comparison's copies stay out of the timed call
                dgu8, _, hsT, hsTs = B8.gemm2_dgrad_swiglu_bwd_fp8(q8["dq"], q8["ds"], q8["w2tq"], q8["w2ts"], gu, s,
                                                                  lay, cfg)
                return dgu8[:live], hsT[:, :live], hsTs[: live // 128]
            return g2d, flop
        if kind in ("wgrad_w2_fp8", "wgrad_w13_fp8"):
            ops = (q8["doTq"], q8["doTs"], q8["hsT"], q8["hsTs"]) if kind == "wgrad_w2_fp8" else (
                q8["dguTq"], q8["dguTs"], q8["xTq"], q8["xTs"])
            split = None if kind == "wgrad_w2_fp8" else F
            if isinstance(cfg, GemmConfig):
                return lambda: B8.wgrad_fp8(*ops, lay, split=split, config=cfg), flop * (1 + bool(split))
            from titan_megamoe.kernels.ws_wgrad_fp8 import ws_wgrad_fp8

            return lambda: ws_wgrad_fp8(*ops, lay, split=split, cfg=cfg), flop * (1 + bool(split))
        raise ValueError(kind)

    rows = []
    for kind in [k for k in args.kinds.split(",") if k.startswith("quant_")]:
        rows += _sweep_quant(kind, args.shape, x, lay, q8)
    for kind in [k for k in args.kinds.split(",") if not k.startswith("quant_")]:
        base = (config_for(kind, D, F, False) if kind in ("gemm1", "gemm2")
                else B8.fp8_bwd_config_for(kind.removesuffix("_fp8"), D, F, False) if kind.endswith("_fp8")
                else B.default_bwd_config(kind.removesuffix("_nohs"), lay, D, F))
        ref = None
        todo = variants(base, kind)
        if args.quick:
            todo = [c for c in todo if c == base or (kind.startswith("wgrad") and getattr(c, "block_m", 0) == 64)]
        if args.two_cta:
            todo = [c for c in todo if c == base or getattr(c, "maxnreg", None) is not None
                    or (kind.startswith("gemm2_dgrad") and c.num_stages == 4)]
        for cfg in todo:
            rec = {"shape": args.shape, "kind": kind, "cfg": dataclasses.asdict(cfg), "default": cfg == base}
            try:
                fn, nflop = run(kind, cfg)
                _forget_compiled()
                got = fn()  # a tensor, or a tuple of outputs (compared side by side, outside the timed call)
                got = (torch.cat([t.float().flatten() for t in got]) if isinstance(got, (tuple, list))
                       else got.float())
                rec["compiled"] = _compiled_stats()
                if ref is None:
                    ref = got
                rec["rel_err_vs_default"] = rel_err(got, ref)
                rec["bitwise_default"] = bool(torch.equal(got, ref))
                ms = triton.testing.do_bench(fn, warmup=10, rep=50)
                rec.update(ms=round(ms, 4), tflops=round(nflop / ms / 1e9, 1))
            except Exception as err:  # one bad config must not hide the others
                rec["error"] = repr(err)[:200]
            print(json.dumps(rec), flush=True)
            rows.append(rec)
    best = {}
    for r in rows:
        if "ms" in r and r["rel_err_vs_default"] < 1e-2 and (r["kind"] not in best or r["ms"] < best[r["kind"]]["ms"]):
            best[r["kind"]] = r
    for kind, r in best.items():
        print(json.dumps({"best": kind, "ms": r["ms"], "tflops": r.get("tflops"), "cfg": r["cfg"]}), flush=True)
    if args.out:
        from compare.records import provenance

        run = provenance(device=torch.device(dev), world_size=1, dist_backend=None, hostnames=[],
                         argv=sys.argv[1:], options=vars(args), module="scripts.sweep_kernel_configs")
        run["command"] = "python scripts/sweep_kernel_configs.py " + " ".join(sys.argv[1:])
        run["timer"] = "triton.testing.do_bench (warmup 10, rep 50 ms), median"
        Path(args.out).write_text(json.dumps({"shape": args.shape, "run": run, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
