"""Where a from-idle training step of one MoE layer leaves the GPU idle, kernel by kernel (GPU only).

compare.layer times each step from an idle device (grads set to None, L2 flushed, barrier), so the
from-idle fwd+bwd is the device time plus every gap in which the GPU waited for the host. This
script records ``--iters`` such steps under ``torch.profiler`` (CUDA activity only: kernels and the
runtime's launch calls, no per-operator CPU events to slow the host) and prints, for each kernel of
the step in order: its median duration, the median idle gap before it, and how often it was
*launched late* (its launch call ended after the previous kernel had finished: the gap is host
time). The forward's first gap is measured from the end of the device sync that starts the step (the
host's start), the backward's from the forward's last kernel.

With ``--head-start-ms`` (default 40, as compare.layer --device-time) a second pass records the same
steps behind a device sleep queued after the L2 flush, so the host has enqueued the step before the
device starts it; each kernel's from-idle duration is printed beside its head-start duration. A
from-idle excess that is not idle gaps is then slower kernels (clocks, cold caches), not the host.

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
from compare.timing import _sleep_cycles, barrier, flush_l2  # noqa: E402

def _phases(trace: dict, head_start: bool = False) -> list[tuple[list[dict], list[dict], float]]:
    """(forward kernels, backward kernels, host start us) of each step, split at the ``spin`` kernels of
    ``torch.cuda._sleep`` (one before each step's L2 flush, one between forward and backward, and with
    ``head_start`` one between the flush and the forward); the flush kernel is dropped. Each kernel
    carries the end of its launch call (``launch_end``, us, the kernels' clock); the host start is the
    end of the last device sync before the forward."""
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
    if head_start:  # (flush), (forward), (backward)
        segments = [[None] + f for f in segments[1::3]], segments[2::3]
    else:
        segments = segments[0::2], segments[1::2]
    for fwd, bwd in zip(*segments):
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


def _pair(rows: list[dict], head_start_rows: list[dict]) -> None:
    """Adds each head-start kernel's median duration to the from-idle row at the same position, when the
    two passes ran the same kernel sequence (else the pairing would be meaningless: left out)."""
    if [r["name"] for r in rows] != [r["name"] for r in head_start_rows]:
        print("step_gaps.py: the head-start pass ran other kernels; durations not paired", file=sys.stderr)
        return
    for r, h in zip(rows, head_start_rows):
        r["head_start_dur_us"] = h["dur_us"]


def _summary(rows: list[dict]) -> dict:
    """Sums over kernel positions: from-idle kernel time, head-start kernel time (nan if unpaired), gaps."""
    return {"kernel_us": sum(r["dur_us"] for r in rows),
            "head_start_kernel_us": sum(r.get("head_start_dur_us", float("nan")) for r in rows),
            "gap_us": sum(r["gap_before_us"] for r in rows), "kernels": len(rows)}


def _profile(step, iters: int) -> dict:
    """The chrome trace (as a dict) of ``iters`` calls of ``step`` under the profiler, CUDA activity only."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            step()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        with open(f.name) as fh:
            return json.load(fh)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scripts/step_gaps.py", description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen3-30b-a3b")
    p.add_argument("--impl", default="megamoe-triton")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--head-start-ms", type=float, default=40.0,
                   help="second pass with a device sleep before each step (0: skip it)")
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

    def step(mark: bool, head_cycles: int = 0):
        for q in params:
            q.grad = None
        x.grad = None
        if mark:
            torch.cuda._sleep(1)
        flush_l2(device)
        barrier(device)
        if head_cycles:
            torch.cuda._sleep(head_cycles)
        y = moe(x)
        if mark:  # a tiny kernel between the phases
            torch.cuda._sleep(1)
        y.backward(g)
        barrier(device)

    for _ in range(args.warmup):
        step(False)
    trace = _profile(lambda: step(True), args.iters)
    steps = _phases(trace)
    if not steps:
        names = sorted({e["name"][:80] for e in trace["traceEvents"] if e.get("cat") == "kernel"})
        print(f"step_gaps.py: no steps found in the trace; its kernels: {names[:60]}", file=sys.stderr)
        return 1
    host0 = [s[2] for s in steps]
    fwd_rows = _rows([s[0] for s in steps], host0, host0)
    # the backward's first gap: from the mark kernel's end, i.e. the forward's last kernel
    bwd_rows = _rows([s[1] for s in steps], [s[0][-1]["ts"] + s[0][-1]["dur"] for s in steps], host0)
    if args.head_start_ms > 0:
        cycles = _sleep_cycles(device, args.head_start_ms)
        hs = _phases(_profile(lambda: step(True, cycles), args.iters), head_start=True)
        if hs:
            hs_rows = {"fwd": _rows([s[0] for s in hs], [s[0][0]["ts"] for s in hs], [s[2] for s in hs]),
                       "bwd": _rows([s[1] for s in hs], [s[0][-1]["ts"] + s[0][-1]["dur"] for s in hs],
                                    [s[2] for s in hs])}
            for phase, rows in (("fwd", fwd_rows), ("bwd", bwd_rows)):
                _pair(rows, hs_rows[phase])
        else:
            print("step_gaps.py: no head-start steps found in the trace", file=sys.stderr)
    summary = {}
    for phase, rows in (("fwd", fwd_rows), ("bwd", bwd_rows)):
        summary[phase] = _summary(rows)
        s = summary[phase]
        print(f"\n{args.impl} {shape.name} T={args.tokens} {phase}: {len(steps)} steps, {len(rows)} kernels, "
              f"kernel time {s['kernel_us']:.0f} us from idle, {s['head_start_kernel_us']:.0f} us with a head "
              f"start; idle gaps {s['gap_us']:.0f} us (medians per position)")
        print("| i | kernel | dur us | head-start dur us | gap before us | launched late | launch ends at us "
              "| starts at us |\n|---:|---|---:|---:|---:|---:|---:|---:|")
        for r in rows:
            print(f"| {r['i']} | {r['name'][:70]} | {r['dur_us']:.1f} | {r.get('head_start_dur_us', float('nan')):.1f} "
                  f"| {r['gap_before_us']:.1f} | {r['launched_late']}/{len(steps)} | {r['launched_at_us']:.0f} "
                  f"| {r['started_at_us']:.0f} |")
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
