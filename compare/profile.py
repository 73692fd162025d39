"""python -m compare.profile: where one MoE layer's training step spends its GPU time, per kernel.

Builds one layer exactly as ``compare.layer`` does (same builders, same seed, router routing), runs
``--warmup`` untimed fwd+bwd steps, then records ``--iters`` steps under ``torch.profiler`` and
prints a table: kernel name, calls per step, device ms per step, share of the step's kernel time.
The JSON (``--out``) holds the same rows plus provenance; ``--trace`` also writes a Chrome trace.

Kernel time is the sum of device kernel durations (overlapping kernels on several streams add up),
so compare it with ``compare.layer``'s wall-clock fwd+bwd to see idle gaps (host overhead, syncs).

Examples::

    python -m compare.profile --shape qwen3-30b-a3b --impl megamoe-triton
    python -m compare.profile --tiny           # CPU smoke run (CPU operators instead of kernels)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch

from compare.builders import IMPLS, PRECISIONS, build_layer, skip_reason, stock_layer_context
from compare.records import git_revision
from compare.shapes import parse_shape, shape_choices

__all__ = ["build_parser", "kernel_table", "main"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m compare.profile", description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen3-30b-a3b", help=f"one of: {shape_choices()}")
    p.add_argument("--impl", default=None, choices=sorted(IMPLS),
                   help="default: megamoe-triton (megamoe-reference with --tiny)")
    p.add_argument("--precision", default="bf16", choices=PRECISIONS)
    p.add_argument("--tokens", type=int, default=16384, help="tokens (default 16384)")
    p.add_argument("--iters", type=int, default=5, help="profiled steps (default 5)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    p.add_argument("--top", type=int, default=25, help="rows printed (default 25)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON path (optional)")
    p.add_argument("--trace", default=None, help="Chrome trace path (optional)")
    p.add_argument("--tiny", action="store_true",
                   help="CPU smoke run: shape custom:64,32,8,2, 64 tokens, 1 warm-up, 1 step")
    return p


def kernel_table(events, iters: int, use_device: bool) -> list[dict]:
    """Rows {name, calls_per_step, ms_per_step, share} from profiler ``key_averages()`` events,
    largest first. ``use_device``: sum device (kernel) time; else CPU self time (CPU runs)."""
    acc: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for ev in events:
        if use_device:
            us = getattr(ev, "self_device_time_total", None)
            if us is None:
                us = ev.self_cuda_time_total
            if getattr(ev, "device_type", None) is not None and str(ev.device_type).endswith("CPU"):
                continue
        else:
            us = ev.self_cpu_time_total
        if us <= 0:
            continue
        acc[ev.key][0] += ev.count
        acc[ev.key][1] += us
    total = sum(v[1] for v in acc.values()) or 1.0
    rows = [{"name": k, "calls_per_step": v[0] / iters, "ms_per_step": v[1] / 1e3 / iters,
             "share": v[1] / total} for k, v in acc.items()]
    return sorted(rows, key=lambda r: -r["ms_per_step"])


def host_enqueue_ms(moe, x, g, device, iters: int) -> dict[str, float]:
    """Median host time to enqueue the forward / backward (Python + launches, device idle at the
    start, as in compare.layer after its barrier) beside their device time by CUDA events. When the
    host time of a phase approaches its device time, that phase is launch-bound."""
    import statistics
    import time

    res: dict[str, list[float]] = {"fwd_host": [], "fwd_device": [], "bwd_host": [], "bwd_device": []}
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
    for _ in range(iters):
        for p in moe.parameters():
            p.grad = None
        x.grad = None
        for phase, (e0, e1) in (("fwd", (ev[0], ev[1])), ("bwd", (ev[2], ev[3]))):
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            e0.record()
            if phase == "fwd":
                y = moe(x)
            else:
                y.backward(g)
            e1.record()
            res[f"{phase}_host"].append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize(device)
        res["fwd_device"].append(ev[0].elapsed_time(ev[1]))
        res["bwd_device"].append(ev[2].elapsed_time(ev[3]))
    return {k: statistics.median(v) for k, v in res.items()}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.tiny:
        args.shape, args.tokens, args.warmup, args.iters = "custom:64,32,8,2", 64, 1, 1
    if args.impl is None:
        args.impl = "megamoe-reference" if args.tiny else "megamoe-triton"
    if args.iters < 1 or args.warmup < 0 or args.tokens < 1:
        print("compare.profile: --iters >= 1, --warmup >= 0 and --tokens >= 1 are required", file=sys.stderr)
        return 2
    try:
        shape = parse_shape(args.shape)
    except ValueError as err:
        print(f"compare.profile: {err}", file=sys.stderr)
        return 2
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    use_device = device.type == "cuda"
    reason = skip_reason(args.impl, args.precision, device)
    if reason:
        print(f"compare.profile: cannot run {args.impl} / {args.precision} here: {reason}", file=sys.stderr)
        return 2
    spec = IMPLS[args.impl]
    ctx = stock_layer_context(args.precision, device) if spec.family == "stock" else contextlib.nullcontext()
    with ctx:
        built = build_layer(args.impl, args.precision, shape, device, seed=args.seed)
        moe = built.module
        gen = torch.Generator(device=device).manual_seed(args.seed + 1)
        x = torch.randn(1, args.tokens, shape.dim, device=device, generator=gen).to(built.dtype).requires_grad_()
        g = torch.randn(1, args.tokens, shape.dim, device=device, generator=gen).to(built.dtype)

        def step():
            for p in moe.parameters():
                p.grad = None
            x.grad = None
            moe(x).backward(g)

        for _ in range(args.warmup):
            step()
        if use_device:
            torch.cuda.synchronize(device)
        acts = [torch.profiler.ProfilerActivity.CPU]
        if use_device:
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=acts) as prof:
            for _ in range(args.iters):
                step()
            if use_device:
                torch.cuda.synchronize(device)
        host = host_enqueue_ms(moe, x, g, device, args.iters) if use_device else None
    rows = kernel_table(prof.key_averages(), args.iters, use_device)
    total = sum(r["ms_per_step"] for r in rows)
    unit = "device kernel" if use_device else "CPU self"
    print(f"{args.impl} {args.precision} {shape.name} T={args.tokens}: {total:.3f} ms {unit} time per step")
    print("| ms/step | share | calls | name |\n|---:|---:|---:|---|")
    for r in rows[:args.top]:
        print(f"| {r['ms_per_step']:.3f} | {100 * r['share']:.1f}% | {r['calls_per_step']:g} | {r['name'][:110]} |")
    if host is not None:
        print("host enqueue vs device (median ms, device idle before each phase): "
              + ", ".join(f"{k} {v:.3f}" for k, v in host.items()))
    if args.trace:
        prof.export_chrome_trace(args.trace)
    if args.out:
        rev, dirty = git_revision()
        rec = {"impl": args.impl, "precision": args.precision, "shape": shape.name, "tokens": args.tokens,
               "iters": args.iters, "warmup": args.warmup, "device": torch.cuda.get_device_name(device)
               if use_device else "cpu", "git_revision": rev, "git_dirty": dirty,
               "command": "python -m compare.profile " + " ".join(argv if argv is not None else sys.argv[1:]),
               "torch": torch.__version__, "total_ms_per_step": total, "time_kind": unit,
               "host_vs_device_ms": host, "kernels": rows}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(rec, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
