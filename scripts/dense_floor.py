"""The layer's floor under compare.layer's own protocol: a dense cuBLAS GEMM chain of the layer's shape, timed
from an idle device beside the layers (GPU only).

compare.layer's "x floor" divides the layer's FLOPs by a short 8192^3 matmul's rate, taken at the boost clock.
A back-to-back from-idle step of the 235B layer runs power-capped (SM clock ~1450-1620 MHz on the H200s seen),
and so would any kernel doing the same work. This script times a dense chain with the layer's rows and dims,
y = (x @ Wa) @ Wb with x (P, D), Wa (D, 2F), Wb (2F, D), P = tokens x top_k, forward and autograd backward
(six GEMMs, 24 P D F FLOPs), with ``compare.timing.time_fwd_bwd`` (L2 flush, sync, gc off: the protocol of the
layer rows), from idle and behind a head start, in rounds alternating with the layer implementations. The
chain's rate is what cuBLAS sustains on this card at this duty cycle; the layer's FLOPs (18 P D F) at that rate
is its floor, printed beside each implementation's time and beside stock / target for a speedup target.

    python scripts/dense_floor.py [--shapes qwen3-30b-a3b,qwen3-235b-a22b] [--impls megamoe-triton,tt-compile]
        [--rounds 2] [--iters 15] [--target 1.7] [--out f.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from compare.builders import IMPLS, LayerSteps, layer_steps, parse_impls  # noqa: E402
from compare.records import git_revision  # noqa: E402
from compare.shapes import parse_shape  # noqa: E402
from compare.timing import time_fwd_bwd  # noqa: E402

HEAD_START_MS = 40.0


def chain_flops(P: int, D: int, F: int) -> tuple[float, float]:
    """(forward, forward+backward) FLOPs of y = (x @ Wa) @ Wb, x (P, D), Wa (D, 2F), Wb (2F, D)."""
    fwd = 2 * P * D * 2 * F * 2
    return fwd, 3 * fwd


def layer_flops(P: int, D: int, F: int) -> tuple[float, float]:
    """(forward, forward+backward) GEMM FLOPs of the routed-experts layer: GEMM1 (D -> 2F) and GEMM2 (F -> D) per
    (token, slot) row, backward twice the forward."""
    fwd = 2 * P * D * 2 * F + 2 * P * F * D
    return fwd, 3 * fwd


def floors(rate_tflops: float, P: int, D: int, F: int) -> tuple[float, float]:
    """The layer's (forward, forward+backward) floor in ms at ``rate_tflops``."""
    f, fb = layer_flops(P, D, F)
    return f / rate_tflops / 1e9, fb / rate_tflops / 1e9


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scripts/dense_floor.py", description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="qwen3-30b-a3b,qwen3-235b-a22b")
    p.add_argument("--impls", default="megamoe-triton,tt-compile")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--iters", type=int, default=15)
    p.add_argument("--target", type=float, default=1.7, help="speedup target over the stock row, for the table")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    try:
        impls = parse_impls(args.impls)
    except ValueError as err:
        p.error(f"--impls: {err}")
    if not torch.cuda.is_available():
        print("dense_floor.py: needs a GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    results = []
    for shape_name in args.shapes.split(","):
        shape = parse_shape(shape_name)
        T, D, F, K = args.tokens, shape.dim, shape.hidden, shape.top_k
        P = T * K
        gen = torch.Generator(device=dev).manual_seed(0)
        x = (torch.randn(P, D, device=dev, generator=gen) / 4).bfloat16().requires_grad_()
        wa = (torch.randn(D, 2 * F, device=dev, generator=gen) / D**0.5).bfloat16().requires_grad_()
        wb = (torch.randn(2 * F, D, device=dev, generator=gen) / (2 * F)**0.5).bfloat16().requires_grad_()
        gy = torch.randn(P, D, device=dev, generator=gen).bfloat16()

        def chain_before():
            x.grad = wa.grad = wb.grad = None

        chain = LayerSteps(fwd=lambda: (x @ wa) @ wb, bwd=lambda y: y.backward(gy), before=chain_before,
                           context=contextlib.nullcontext)
        xt = torch.randn(1, T, D, device=dev, generator=gen).bfloat16().requires_grad_()
        gt = torch.randn(1, T, D, device=dev, generator=gen).bfloat16()
        steps = {"dense-chain": chain, **{impl: layer_steps(impl, shape, dev, xt, gt) for impl in impls}}
        samples = {name: {"idle": {"fwd": [], "fwdbwd": []}, "device": {"fwd": [], "fwdbwd": []}} for name in steps}
        names = list(steps)
        for name in names:  # compile / autotune outside the timed rounds
            st = steps[name]
            with st.context():
                time_fwd_bwd(st.fwd, st.bwd, device=dev, iters=1, warmup=3, before_step=st.before, gc_off=True)
        for r in range(args.rounds):
            for name in (names if r % 2 == 0 else names[::-1]):
                st = steps[name]
                with st.context():
                    for mode, hs in (("idle", 0.0), ("device", HEAD_START_MS)):
                        s = time_fwd_bwd(st.fwd, st.bwd, device=dev, iters=args.iters, warmup=1, before_step=st.before,
                                         gc_off=True, head_start_ms=hs)
                        for k in ("fwd", "fwdbwd"):
                            samples[name][mode][k] += s[k]
            print(f"{shape.name}: round {r + 1}/{args.rounds} done", flush=True)
        med = {n: {m: {k: statistics.median(v) for k, v in d.items()} for m, d in per.items()}
               for n, per in samples.items()}
        cf, cfb = chain_flops(P, D, F)
        rec = {"shape": shape.name, "tokens": T, "P": P, "D": D, "F": F, "medians_ms": med,
               "chain_tflops": {m: {"fwd": cf / med["dense-chain"][m]["fwd"] / 1e9,
                                    "fwdbwd": cfb / med["dense-chain"][m]["fwdbwd"] / 1e9} for m in ("idle", "device")}}
        rec["layer_floor_ms"] = {m: dict(zip(("fwd", "fwdbwd"), (
            floors(rec["chain_tflops"][m]["fwd"], P, D, F)[0], floors(rec["chain_tflops"][m]["fwdbwd"], P, D, F)[1])))
            for m in ("idle", "device")}
        stock = next((i for i in impls if IMPLS[i].family == "stock"), None)
        if stock:
            rec["target_ms"] = {m: med[stock][m]["fwdbwd"] / args.target for m in ("idle", "device")}
        results.append(rec)
        print(f"\n{shape.name}, T={T} (P={P}), medians of {args.rounds} x {args.iters} steps; dense chain from idle "
              f"{rec['chain_tflops']['idle']['fwdbwd']:.0f} TF/s fwd+bwd ({rec['chain_tflops']['idle']['fwd']:.0f} fwd), "
              f"behind a head start {rec['chain_tflops']['device']['fwdbwd']:.0f} ({rec['chain_tflops']['device']['fwd']:.0f})")
        print("| row | fwd ms idle | fwd+bwd ms idle | fwd+bwd ms device | x floor idle | x floor device |")
        print("|---|---:|---:|---:|---:|---:|")
        fl = rec["layer_floor_ms"]
        print(f"| layer floor at the chain's rate | {fl['idle']['fwd']:.3f} | {fl['idle']['fwdbwd']:.3f} | "
              f"{fl['device']['fwdbwd']:.3f} | 1 | 1 |")
        for name in names:
            m = med[name]
            print(f"| {name} | {m['idle']['fwd']:.3f} | {m['idle']['fwdbwd']:.3f} | {m['device']['fwdbwd']:.3f} | "
                  f"{m['idle']['fwdbwd'] / fl['idle']['fwdbwd']:.2f} | {m['device']['fwdbwd'] / fl['device']['fwdbwd']:.2f} |")
        if stock:
            print(f"| {stock} / {args.target} (target) | | {rec['target_ms']['idle']:.3f} | {rec['target_ms']['device']:.3f} "
                  f"| {rec['target_ms']['idle'] / fl['idle']['fwdbwd']:.2f} | {rec['target_ms']['device'] / fl['device']['fwdbwd']:.2f} |")
        del steps, x, wa, wb, gy, xt, gt
        torch._dynamo.reset()
        torch.cuda.empty_cache()
    if args.out:
        rev, dirty = git_revision()
        with open(args.out, "w") as f:
            json.dump({"script": "scripts/dense_floor.py", "argv": sys.argv[1:],
                       "git_revision": os.environ.get("TITAN_MEGAMOE_GIT_REV", rev), "git_dirty": dirty,
                       "device": torch.cuda.get_device_name(dev), "torch": torch.__version__,
                       "protocol": "compare.timing.time_fwd_bwd: L2 flush, sync, gc off; idle and 40 ms head start",
                       "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
