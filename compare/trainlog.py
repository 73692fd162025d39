"""Parse TorchTitan's per-step metrics lines and summarize / plot training runs.

A metrics line (rank 0, ``--metrics.disable_color_printing``) looks like::

    step:  8  loss:  3.71995  grad_norm:  2.8532  memory:  6.36GiB(4.55%)  tps: 40,939  tflops: 29.01  mfu: 2.93%

``tps`` is tokens/s per GPU. Usage::

    python -m compare.trainlog RUN_A.log RUN_B.log --labels megamoe baseline \
        --out-json benchmarks/results/x.json --out-png benchmarks/results/x.png [--skip 5]
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
from pathlib import Path

__all__ = ["parse_metrics", "summarize", "worst_step_vs", "main"]

_LINE = re.compile(
    r"step:\s*(?P<step>\d+)\s+loss:\s*(?P<loss>[-+0-9.eEnaif]+)\s+grad_norm:\s*(?P<grad_norm>[-+0-9.eEnaif]+)"
    r"\s+memory:\s*(?P<mem>[0-9.]+)GiB\((?P<mem_pct>[0-9.]+)%\)\s+tps:\s*(?P<tps>[0-9,]+)"
    r"\s+tflops:\s*(?P<tflops>[0-9.,]+)\s+mfu:\s*(?P<mfu>[0-9.]+)%"
)
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def parse_metrics(text: str) -> list[dict]:
    """Metrics lines of a log, one per step (the first seen: rank 0 logs first when several ranks
    print), in step order: dicts with step, loss, grad_norm, memory_gib, tps, tflops, mfu_pct."""
    rows, seen = [], set()
    for line in _ANSI.sub("", text).splitlines():
        m = _LINE.search(line)
        if not m or int(m["step"]) in seen:
            continue
        seen.add(int(m["step"]))
        rows.append(dict(
            step=int(m["step"]), loss=float(m["loss"]), grad_norm=float(m["grad_norm"]),
            memory_gib=float(m["mem"]), tps=int(m["tps"].replace(",", "")),
            tflops=float(m["tflops"].replace(",", "")), mfu_pct=float(m["mfu"]),
        ))
    return rows


def summarize(rows: list[dict], skip: int = 5) -> dict:
    """Median tokens/s/GPU after the first ``skip`` steps (compile, warm-up), peak memory, losses.

    Raises:
        ValueError: no metrics line, or no step left after ``skip``.
    """
    if not rows:
        raise ValueError("no TorchTitan metrics line found in the log (did the run fail? see its tail)")
    steady = [r for r in rows if r["step"] > skip]
    if not steady:
        raise ValueError(f"only {len(rows)} steps logged; nothing left after skipping {skip}")
    last = rows[-1]
    return dict(
        steps=last["step"], first_loss=rows[0]["loss"], final_loss=last["loss"],
        final_loss_mean10=statistics.fmean(r["loss"] for r in rows[-10:]),
        median_tps=statistics.median(r["tps"] for r in steady),
        peak_memory_gib=max(r["memory_gib"] for r in rows),
        median_mfu_pct=statistics.median(r["mfu_pct"] for r in steady),
        skipped_warmup_steps=skip,
        max_grad_norm=_nan_last(max(rows, key=lambda r: _nan_high(r["grad_norm"]))["grad_norm"]),
        max_grad_norm_step=max(rows, key=lambda r: _nan_high(r["grad_norm"]))["step"],
    )


def _nan_high(v: float) -> float:
    """Sort key: a non-finite value ranks above every finite one (a NaN grad norm is the worst step, not skipped)."""
    return v if math.isfinite(v) else math.inf


def _nan_last(v: float):
    return v if math.isfinite(v) else str(v)  # "nan" / "inf": strict JSON has no NaN


def worst_step_vs(rows: list[dict], ref_rows: list[dict]) -> dict | None:
    """The step where a run's loss exceeds a reference run's the most, relative to the reference's loss at that
    step (same seed, so the same batches: a gap at one step is the run's, not the data's; a precision's loss spike
    shows here where the final loss alone hides it).

    Args:
        rows, ref_rows: per-step metrics (:func:`parse_metrics`) of the run and of the reference run.

    Returns:
        {step, loss, ref_loss, rel (loss / ref_loss - 1), grad_norm, ref_grad_norm} of that step, or None when the
        runs share no step with a positive reference loss. The run's first non-finite loss (a divergence) is the worst
        step: its loss and rel are then the strings "nan" / "inf" (strict JSON has no NaN).
    """
    ref = {r["step"]: r for r in ref_rows}
    best = None
    for r in rows:
        q = ref.get(r["step"])
        if q is None or not q["loss"] > 0:
            continue
        rel = r["loss"] / q["loss"] - 1 if math.isfinite(r["loss"]) else math.inf
        if best is None or rel > best["rel"]:
            best = dict(step=r["step"], loss=r["loss"], ref_loss=q["loss"], rel=rel, grad_norm=r["grad_norm"],
                        ref_grad_norm=q["grad_norm"])
        if rel == math.inf:
            break
    if best is not None and not math.isfinite(best["rel"]):
        best.update(loss=str(best["loss"]), rel=str(best["loss"]))
    return best


def _plot(runs: dict[str, list[dict]], out_png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for label, rows in runs.items():
        a.plot([r["step"] for r in rows], [r["loss"] for r in rows], label=label, lw=1.2)
        b.plot([r["step"] for r in rows], [r["tps"] for r in rows], label=label, lw=1.2)
    a.set(xlabel="step", ylabel="loss", title="training loss")
    b.set(xlabel="step", ylabel="tokens/s/GPU", title="throughput")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m compare.trainlog", description=__doc__.split("\n")[0])
    p.add_argument("logs", nargs="+", type=Path)
    p.add_argument("--labels", nargs="+")
    p.add_argument("--skip", type=int, default=5, help="warm-up steps left out of the throughput median")
    p.add_argument("--out-json", type=Path)
    p.add_argument("--out-png", type=Path)
    p.add_argument("--meta", default="{}", help="JSON object merged into the record (provenance)")
    a = p.parse_args(argv)
    labels = a.labels or [lg.stem for lg in a.logs]
    if len(labels) != len(a.logs):
        p.error(f"--labels has {len(labels)} names for {len(a.logs)} logs")
    runs, summaries = {}, {}
    for lg, label in zip(a.logs, labels):
        if not lg.exists():
            p.error(f"log file not found: {lg}")
        runs[label] = parse_metrics(lg.read_text(errors="replace"))
        summaries[label] = summarize(runs[label], a.skip)
    first = labels[0]
    print(f"| run | steps | first loss | final loss (mean last 10) | median tokens/s/GPU | x {first} | peak GiB |")
    print("|---|---|---|---|---|---|---|")
    for label in labels:
        s = summaries[label]
        print(f"| {label} | {s['steps']} | {s['first_loss']:.4f} | {s['final_loss_mean10']:.4f} | "
              f"{s['median_tps']:,.0f} | {s['median_tps'] / summaries[first]['median_tps']:.2f} | {s['peak_memory_gib']:.2f} |")
    if a.out_json:
        rec = dict(json.loads(a.meta), runs={lb: dict(summary=summaries[lb], steps=runs[lb]) for lb in labels})
        a.out_json.write_text(json.dumps(rec, indent=1))
    if a.out_png:
        _plot(runs, a.out_png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
