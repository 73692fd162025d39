"""Where a from-idle training step of one MoE layer leaves the GPU idle, kernel by kernel (GPU only).

compare.layer times each step from an idle device (grads set to None, L2 flushed, barrier), so the
from-idle fwd+bwd is the device time plus every gap in which the GPU waited for the host. This
script records ``--iters`` such steps under ``torch.profiler`` (CUDA activity only: kernels and the
runtime's launch calls, no per-operator CPU events to slow the host) and prints, for each kernel of
the step in order: its median duration, the median idle gap before it, and how often it was
*launched late* (its launch call ended after the previous kernel had finished: the gap is host
time). The forward's first gap is measured from the end of the device sync that starts the step (the
host's start), the backward's from the forward's last kernel.

    python scripts/step_gaps.py [--shape qwen3-30b-a3b] [--impl megamoe-triton] [--iters 10] [--out f.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from compare.builders import build_layer  # noqa: E402
from compare.records import git_revision  # noqa: E402
from compare.shapes import parse_shape  # noqa: E402
from compare.timing import barrier, flush_l2  # noqa: E402

def _phases(trace: dict) -> list[tuple[list[dict], list[dict], float]]:
    """(forward kernels, backward kernels, host start us) of each step, split at the ``spin`` kernels of
    ``torch.cuda._sleep`` (one before each step's L2 flush, one between forward and backward); the flush
    kernel is dropped. Each kernel carries the end of its launch call (``launch_end``, us, the kernels'
    clock); the host start is the end of the last device sync before the forward."""
    ev = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    runtime = [e for e in ev if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    launch_end = {e["args"]["correlation"]: e["ts"] + e["dur"] for e in runtime
                  if "Launch" in e["name"] and "correlation" in e.get("args", {})}
    sync_ends = sorted(e["ts"] + e["dur"] for e in runtime if "Synchronize" in e["name"])
    segments: list[list[dict]] = []
    for e in sorted((e for e in ev if e.get("cat") == "kernel"), key=lambda e: e["ts"]):
        if "spin" in e["name"].lower():
            segments.append([])
        elif segments:
            segments[-1].append({"name": e["name"], "ts": e["ts"], "dur": e["dur"],
                                 "launch_end": launch_end.get(e.get("args", {}).get("correlation"))})
    out = []
    for fwd, bwd in zip(segments[0::2], segments[1::2]):
        fwd = fwd[1:]  # the L2 flush
        if fwd and bwd:
            start = max((t for t in sync_ends if t < fwd[0]["ts"]), default=fwd[0]["ts"])
            out.append((fwd, bwd, start))
    return out


def _rows(steps: list[list[dict]], starts: list[float], host_starts: list[float]) -> list[dict]:
    """Per kernel position: median duration, median idle gap before it (the first kernel's from ``starts``),
    in how many steps it was launched after the previous kernel had finished (host-bound), and the median
    times its launch call ended and it started, from ``host_starts`` (the step's host start)."""
    rows = []
    for i in range(min(len(s) for s in steps)):
        durs, gaps, late, launched, started = [], [], 0, [], []
        for s, t0, h0 in zip(steps, starts, host_starts):
            k = s[i]
            prev_end = s[i - 1]["ts"] + s[i - 1]["dur"] if i else t0
            gaps.append(max(0.0, k["ts"] - prev_end))
            durs.append(k["dur"])
            late += k["launch_end"] is not None and k["launch_end"] > prev_end
            launched.append(k["launch_end"] - h0 if k["launch_end"] is not None else float("nan"))
            started.append(k["ts"] - h0)
        rows.append({"i": i, "name": steps[0][i]["name"][:90], "dur_us": statistics.median(durs),
                     "gap_before_us": statistics.median(gaps), "launched_late": late,
                     "launched_at_us": statistics.median(launched), "started_at_us": statistics.median(started)})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scripts/step_gaps.py", description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen3-30b-a3b")
    p.add_argument("--impl", default="megamoe-triton")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("step_gaps.py: needs a GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    shape = parse_shape(args.shape)
    moe = build_layer(args.impl, "bf16", shape, device, seed=0).module
    gen = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(1, args.tokens, shape.dim, device=device, generator=gen).to(torch.bfloat16).requires_grad_()
    g = torch.randn(1, args.tokens, shape.dim, device=device, generator=gen).to(torch.bfloat16)
    params = list(moe.parameters())

    def step(mark: bool):
        for q in params:
            q.grad = None
        x.grad = None
        if mark:
            torch.cuda._sleep(1)
        flush_l2(device)
        barrier(device)
        y = moe(x)
        if mark:  # a tiny kernel between the phases
            torch.cuda._sleep(1)
        y.backward(g)
        barrier(device)

    for _ in range(args.warmup):
        step(False)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(args.iters):
            step(True)
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        with open(f.name) as fh:
            trace = json.load(fh)
    steps = _phases(trace)
    if not steps:
        names = sorted({e["name"][:80] for e in trace["traceEvents"] if e.get("cat") == "kernel"})
        print(f"step_gaps.py: no steps found in the trace; its kernels: {names[:60]}", file=sys.stderr)
        return 1
    host0 = [s[2] for s in steps]
    fwd_rows = _rows([s[0] for s in steps], host0, host0)
    # the backward's first gap: from the mark kernel's end, i.e. the forward's last kernel
    bwd_rows = _rows([s[1] for s in steps], [s[0][-1]["ts"] + s[0][-1]["dur"] for s in steps], host0)
    summary = {}
    for phase, rows in (("fwd", fwd_rows), ("bwd", bwd_rows)):
        busy, idle = sum(r["dur_us"] for r in rows), sum(r["gap_before_us"] for r in rows)
        summary[phase] = {"kernel_us": busy, "gap_us": idle, "kernels": len(rows)}
        print(f"\n{args.impl} {shape.name} T={args.tokens} {phase}: {len(steps)} steps, {len(rows)} kernels, "
              f"kernel time {busy:.0f} us, idle gaps {idle:.0f} us (medians per position)")
        print("| i | kernel | dur us | gap before us | launched late | launch ends at us | starts at us |\n"
              "|---:|---|---:|---:|---:|---:|---:|")
        for r in rows:
            print(f"| {r['i']} | {r['name'][:70]} | {r['dur_us']:.1f} | {r['gap_before_us']:.1f} | "
                  f"{r['launched_late']}/{len(steps)} | {r['launched_at_us']:.0f} | {r['started_at_us']:.0f} |")
    if args.out:
        rev, dirty = git_revision()
        rec = {"script": "scripts/step_gaps.py", "argv": sys.argv[1:], "git_revision": os.environ.get(
            "TITAN_MEGAMOE_GIT_REV", rev), "git_dirty": dirty, "device": torch.cuda.get_device_name(device),
            "torch": torch.__version__, "shape": shape.name, "impl": args.impl, "tokens": args.tokens,
            "steps": len(steps), "summary": summary, "fwd": fwd_rows, "bwd": bwd_rows}
        with open(args.out, "w") as f:
            json.dump(rec, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
