"""Train several TorchTitan configs the same way and compare them: throughput, memory, MFU, loss.

    python -m compare.train --configs A.toml B.toml ... [--steps 50] [--ngpu G] [--skip 5]
        [--seed 42] [--labels a b ...] [--out RESULT.json] [--plot RESULT.png] [--extra "--foo 1"]
        [--launcher MODULE_OR_SCRIPT]

For each config, in order, runs (as a subprocess, with the same seed and step count for all)::

    <python> -m titan_megamoe.launch --config X.toml [--ngpu G] --steps N -- --debug.seed S <extra>

(the launcher sets offline mode and prepares the embedded corpus / tokenizer), writes its output to
``<out dir>/<out stem>_<label>.log``, parses the log with :func:`compare.trainlog.parse_metrics` /
:func:`compare.trainlog.summarize`, and prints a markdown table: median tokens/s/GPU after the
first ``--skip`` steps, speedup vs the first config, peak memory, median MFU, final loss (mean of
the last 10 steps), and for every run after the first the step whose loss most exceeds the first
run's at the same step (same seed, same batches: a loss spike the final loss hides). Also writes the
JSON record (provenance + per-run summary and steps) and a PNG (loss curves + throughput,
:func:`compare.trainlog._plot`).

A run that exits non-zero or logs no metrics line is reported with the last 30 lines of its log and
recorded with ``status: "error"``; the other configs still run; the exit code is then 1. Bad options
(missing config, ``--labels`` count mismatch, ``--steps <= --skip``) exit 2.

The launcher is injectable (tests use a fake one): ``--launcher`` or the env var
``COMPARE_TRAIN_LAUNCHER`` names a python module (run with ``-m``) or a ``.py`` script, called with
the arguments above.

JSON layout (``SCHEMA = "titan_megamoe.compare.train/1"``)::

    {"schema": ..., "run": {gpu, gpu_count, torch, triton, torchtitan, torchao, titan_megamoe,
                            python, git_rev, git_dirty, date_utc, command, argv, options, launcher},
     "runs": [{label, config, toml: {model, megamoe, parallelism, training, compile,
                                     activation_checkpoint} (the config file's tables; compare.regress
                                     refuses to compare runs whose tables differ), command, log, returncode,
               status: "ok" | "error", reason, summary (compare.trainlog.summarize) | null,
               speedup_vs_first | null, worst_step_vs_first (compare.trainlog.worst_step_vs against the
               first run) | null, steps: [per-step metrics]}]}
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shlex
import subprocess
import sys
from pathlib import Path

from compare.records import REPO_ROOT, _pkg_version, _version, git_revision
from compare.trainlog import _plot, parse_metrics, summarize, worst_step_vs

__all__ = ["SCHEMA", "DEFAULT_LAUNCHER", "launcher_argv", "run_command", "markdown_table", "main"]

SCHEMA = "titan_megamoe.compare.train/1"
DEFAULT_LAUNCHER = "titan_megamoe.launch"
LAUNCHER_ENV = "COMPARE_TRAIN_LAUNCHER"
TAIL_LINES = 30
TOML_TABLES = ("model", "megamoe", "parallelism", "training", "compile", "activation_checkpoint")


def launcher_argv(launcher: str) -> list[str]:
    """``[python, script.py]`` for a path ending in .py, else ``[python, -m, module]``."""
    if launcher.endswith(".py"):
        return [sys.executable, launcher]
    return [sys.executable, "-m", launcher]


def run_command(launcher: str, config: str, ngpu: int | None, steps: int, seed: int,
                extra: list[str]) -> list[str]:
    cmd = launcher_argv(launcher) + ["--config", str(config)]
    if ngpu is not None:
        cmd += ["--ngpu", str(ngpu)]
    return cmd + ["--steps", str(steps), "--", "--debug.seed", str(seed), *extra]


def _read_toml(path: Path) -> dict:
    # as titan_megamoe.launch._read_toml, without importing the package (it imports torchtitan: slow)
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    with open(path, "rb") as f:
        return tomllib.load(f)


def _provenance(argv: list[str], options: dict, launcher: str) -> dict:
    import torch

    if torch.cuda.is_available():
        gpu, count = torch.cuda.get_device_name(0), torch.cuda.device_count()
    else:
        gpu, count = f"cpu ({platform.machine() or 'unknown'})", 0
    rev, dirty = git_revision()
    return {
        "gpu": gpu,
        "gpu_count": count,
        "torch": str(torch.__version__),
        "triton": _version("triton"),
        "torchtitan": _version("torchtitan"),
        "torchao": _version("torchao"),
        "titan_megamoe": _version("titan_megamoe") or _version("titan-megamoe") or _pkg_version(),
        "python": platform.python_version(),
        "git_rev": rev,
        "git_dirty": dirty,
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join(["python", "-m", "compare.train", *argv]),
        "argv": [sys.argv[0], *argv],
        "options": options,
        "launcher": launcher,
    }


def _tail(text: str, n: int = TAIL_LINES) -> str:
    return "\n".join(text.splitlines()[-n:])


def _last_line(text: str, limit: int = 600) -> str:
    """The log's last non-empty line (a launcher's error message: the launcher exits with it), cut to ``limit``
    characters with "..." where longer (its full text is in the run's log and the JSON's log tail)."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if not lines:
        return "(empty log)"
    return lines[-1] if len(lines[-1]) <= limit else lines[-1][:limit - 3] + "..."


def _slug(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", label).strip("_") or "run"


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def markdown_table(runs: list[dict]) -> str:
    first = runs[0]["label"] if runs else "-"
    lines = [f"| run | steps | median tokens/s/GPU | x {first} | peak GiB | MFU % | final loss (mean last 10) | "
             f"worst step vs {first} | status |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        s = r["summary"] or {}
        status = "ok" if r["status"] == "ok" else f"error: {r['reason']}"
        lines.append(
            f"| {r['label']} | {s.get('steps', '-')} | {_fmt(s.get('median_tps'), ',.0f')} | "
            f"{_fmt(r['speedup_vs_first'], '.2f')} | {_fmt(s.get('peak_memory_gib'), '.2f')} | "
            f"{_fmt(s.get('median_mfu_pct'), '.2f')} | {_fmt(s.get('final_loss_mean10'), '.4f')} | "
            f"{_worst(r.get('worst_step_vs_first'))} | {status} |")
    return "\n".join(lines)


def _worst(w: dict | None) -> str:
    """Table cell of ``worst_step_vs_first``: "step 61: 8.842 vs 5.938 (+48.9 %), grad norm 19.5 vs 0.56"."""
    if not w:
        return "-"
    if isinstance(w["rel"], str):  # a non-finite loss: the run diverged there
        return f"step {w['step']}: loss {w['loss']} (diverged), grad norm {w['grad_norm']:.3g}"
    return (f"step {w['step']}: {w['loss']:.4g} vs {w['ref_loss']:.4g} ({100 * w['rel']:+.1f} %), "
            f"grad norm {w['grad_norm']:.3g} vs {w['ref_grad_norm']:.3g}")


def _default_out() -> Path:
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d_%H%M%S")
    return REPO_ROOT / "outputs" / "compare_train" / f"train_{stamp}.json"


def _run_one(cmd: list[str], log: Path) -> int:
    with open(log, "w") as f:
        f.write("# " + shlex.join(cmd) + "\n")
        f.flush()
        try:
            return subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL).returncode
        except OSError as err:
            f.write(f"compare.train: cannot start the launcher: {err}\n")
            return 127


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m compare.train", description=__doc__.split("\n")[0])
    p.add_argument("--configs", nargs="+", required=True, type=Path, help="TorchTitan TOML configs")
    p.add_argument("--steps", type=int, default=50, help="training steps of every run (default 50)")
    p.add_argument("--ngpu", type=int, default=None, help="ranks per run (default: the launcher's, all GPUs)")
    p.add_argument("--skip", type=int, default=5, help="warm-up steps left out of the medians (default 5)")
    p.add_argument("--seed", type=int, default=42, help="--debug.seed of every run (default 42)")
    p.add_argument("--labels", nargs="+", help="one name per config (default: config file stems)")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON record (default outputs/compare_train/train_<utc time>.json); logs go next to it")
    p.add_argument("--plot", type=Path, default=None, help="PNG (default: the JSON path with .png)")
    p.add_argument("--extra", default="", help="extra TorchTitan arguments for every run, one string")
    p.add_argument("--launcher", default=None,
                   help=f"python module or .py script to launch a run (default ${LAUNCHER_ENV} or {DEFAULT_LAUNCHER})")
    a = p.parse_args(argv)

    missing = [str(c) for c in a.configs if not c.is_file()]
    if missing:
        p.error(f"config file(s) not found: {', '.join(missing)} (working directory {Path.cwd()})")
    labels = a.labels or [c.stem for c in a.configs]
    if len(labels) != len(a.configs):
        p.error(f"--labels has {len(labels)} names for {len(a.configs)} configs")
    if len(set(labels)) != len(labels):
        p.error(f"labels must be distinct (got {labels}); name the runs with --labels")
    if a.steps <= a.skip:
        p.error(f"--steps ({a.steps}) must be greater than --skip ({a.skip}): no step would be left to measure")
    if a.skip < 0:
        p.error(f"--skip must be >= 0, got {a.skip}")
    if a.ngpu is not None and a.ngpu < 1:
        p.error(f"--ngpu must be >= 1, got {a.ngpu}")
    tomls = {}
    for c in a.configs:
        try:
            tomls[c] = _read_toml(c)
        except Exception as err:  # tomllib / tomli decode error
            p.error(f"config file {c} is not valid TOML: {err}")
    try:
        extra = shlex.split(a.extra)
    except ValueError as err:
        p.error(f"--extra cannot be split into arguments: {err}")
    launcher = a.launcher or os.environ.get(LAUNCHER_ENV) or DEFAULT_LAUNCHER
    out = a.out or _default_out()
    png = a.plot or out.with_suffix(".png")
    out.parent.mkdir(parents=True, exist_ok=True)

    runs = []
    for config, label in zip(a.configs, labels):
        cmd = run_command(launcher, str(config), a.ngpu, a.steps, a.seed, extra)
        log = out.parent / f"{out.stem}_{_slug(label)}.log"
        print(f"[compare.train] {label}: {shlex.join(cmd)} > {log}", flush=True)
        rc = _run_one(cmd, log)
        text = log.read_text(errors="replace")
        rows = parse_metrics(text)
        summary, reason = None, None
        if rc != 0:
            reason = f"exit code {rc}: {_last_line(text)}"
        else:
            try:
                summary = summarize(rows, a.skip)
            except ValueError as err:
                reason = str(err)
        if reason is not None:
            print(f"[compare.train] {label} FAILED ({reason}); last {TAIL_LINES} lines of {log}:\n"
                  f"{_tail(text)}\n[compare.train] end of {label} log tail", file=sys.stderr, flush=True)
        toml = tomls[config]
        runs.append(dict(
            label=label, config=str(config), toml={k: toml.get(k, {}) for k in TOML_TABLES},
            command=shlex.join(cmd), log=str(log), returncode=rc,
            status="ok" if reason is None else "error", reason=reason,
            summary=summary, speedup_vs_first=None, worst_step_vs_first=None, steps=rows,
            log_tail=None if reason is None else _tail(text),
        ))

    base = runs[0]["summary"]
    for r in runs:
        if base and r["summary"] and base["median_tps"]:
            r["speedup_vs_first"] = r["summary"]["median_tps"] / base["median_tps"]
        if base and r["summary"] and r is not runs[0]:
            r["worst_step_vs_first"] = worst_step_vs(r["steps"], runs[0]["steps"])

    print(markdown_table(runs))
    options = {k: (str(v) if isinstance(v, Path) else [str(x) for x in v] if isinstance(v, list) else v)
               for k, v in vars(a).items()}
    options.update(labels=labels, out=str(out), plot=str(png), launcher=launcher)
    rec = {"schema": SCHEMA, "run": _provenance(argv, options, launcher), "runs": runs}
    with open(out, "w") as f:
        json.dump(rec, f, indent=1)
        f.write("\n")
    print(f"[compare.train] wrote {out}")
    ok = {r["label"]: r["steps"] for r in runs if r["status"] == "ok"}
    if ok:
        png.parent.mkdir(parents=True, exist_ok=True)
        _plot(ok, png)
        print(f"[compare.train] wrote {png}")
    failed = [r["label"] for r in runs if r["status"] != "ok"]
    if failed:
        print(f"[compare.train] failed runs: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
