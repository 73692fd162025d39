"""python -m compare.loss_spread: run-to-run spread of the final training loss, per config.

    python -m compare.loss_spread RUNS.json [RUNS.json ...] --reference KEY [--window 10]
        [--group-by config|label] [--rel-tolerance 0.02] [--out OUT.json]

TorchTitan training is not bitwise reproducible run to run (nondeterministic stock kernels): two runs
of one config and seed agree to ~2e-4 over the first ~15 steps and then diverge chaotically (1-GPU
debug model, H200: the mean loss of steps 91-100 moved by 0.108 between two megamoe triton runs, a
300-step run's final loss by 0.19). One pair of runs therefore cannot say whether two configs train
to the same loss; several runs of each (one file per seed, or repeats of one seed) can. This module
reads compare.train JSON records (schema ``titan_megamoe.compare.train/1``) and reports, per group:

* the **final-window loss** of each run: the mean loss of its last ``--window`` logged steps (a run
  with fewer steps, or no per-step rows, is excluded; without rows and with ``--window 10`` the
  record's ``summary.final_loss_mean10`` is used);
* over the group's runs: their number, mean, standard deviation (sample, n - 1: "n/a" with one run),
  min and max;
* against the reference group: the relative difference of the means, (mean - ref) / ref; whether
  it is within ``--rel-tolerance`` (|rel| <= tol; 0.02 = "within 2 %"); and whether it is within the
  reference's spread, defined as |mean - ref mean| <= 2 * std of the reference's runs ("n/a" when
  the reference has one run). Both are rough criteria, not significance tests: with three runs a
  standard deviation is itself uncertain by about +-50 %.

**Grouping key** (``--group-by``): ``config`` (default), the file name of the run's ``config`` field
without its directory and ``.toml`` (e.g. ``qwen3_debugmoe_1gpu_megamoe_triton_bf16``, whatever the
run's label and the directory it was launched from); ``label``, the run's compare.train label. The
table's ``family`` column says whether the group's runs use the megamoe converter (``megamoe``) or are
stock TorchTitan (``torchtitan``), from the recorded ``[model] converters``. Runs that differ only by an
environment variable (ablations) share a config: group those by label. ``--reference`` names a group
key; with ``--group-by config`` a run label whose runs all lie in one group is accepted too.

Runs whose status is not "ok" are listed and excluded with a warning, and so are runs whose final
loss is not finite (a diverged run has no place in a spread: the warning says so). A group whose runs
end at different steps, or whose recorded config tables or LR schedule lengths differ, gets a warning
(their final windows are then not the same measurement).

Output: a markdown table on stdout (groups, then every run) and a JSON record (``--out``, default
``outputs/loss_spread/loss_spread_<utc time>.json``) with the provenance fields of the other compare
records (versions, git revision, date, command, options), the input files with their own provenance,
every run's value, the groups, the exclusions and the warnings. Exit status: 0 report written; 2 bad
input (no or unreadable file, not a compare.train record, a file given twice, an unknown reference,
no usable run in the reference group, bad option values).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import shlex
import socket
import statistics
import sys
from pathlib import Path

from compare.records import REPO_ROOT, _version, git_revision
from compare.regress import TRAIN_SCHEMA, _config_diff, _is_stock, load_any, lr_schedule

__all__ = ["SCHEMA", "SPREAD_CRITERION", "LossSpreadError", "load_train_records", "run_value", "group_key",
           "collect_runs", "spread", "markdown", "provenance", "main"]

SCHEMA = "titan_megamoe.compare.loss_spread/1"
SPREAD_CRITERION = "|mean - reference mean| <= 2 * std of the reference's runs (sample std, n - 1)"
GROUP_KEYS = {
    "config": "the stem of the run's config path: its file name without directory and .toml",
    "label": "the run's compare.train label",
}


EPILOG = f"""\
Per group: runs, mean, std (sample, n - 1; n/a with one run), min, max of the final-window loss
(the mean of each run's last --window logged steps); vs the reference group: (mean - ref) / ref,
within --rel-tolerance, and within the reference's spread: {SPREAD_CRITERION}.
Runs whose status is not "ok" or whose final loss is not finite are excluded with a warning.
Writes a markdown table to stdout and a JSON record (--out). Exit 0, or 2 on bad input.
"""


class LossSpreadError(ValueError):
    """Bad input: the message says which file or option and what to do."""


# ------------------------------------------------------------------------------------ reading

def load_train_records(paths: list[str]) -> list[tuple[str, dict]]:
    """(path, record) of each compare.train JSON file, in order.

    Raises:
        LossSpreadError: no path, a path given twice, a file that cannot be read, or one that is not
            a compare.train record (e.g. a compare.layer file, or compare.trainlog's ``runs`` dict).
    """
    if not paths:
        raise LossSpreadError("no input file: pass one or more compare.train JSON records")
    seen: dict[str, str] = {}
    out = []
    for path in paths:
        real = str(Path(path).resolve())
        if real in seen:
            raise LossSpreadError(f"{path}: given twice (also as {seen[real]}); its runs would count twice")
        seen[real] = path
        try:
            kind, data = load_any(path)
        except ValueError as err:
            raise LossSpreadError(str(err)) from err
        if kind != "train":
            raise LossSpreadError(f"{path}: a compare.layer results file, not a compare.train record "
                                  f"(schema {TRAIN_SCHEMA}, a 'runs' list)")
        for i, run in enumerate(data["runs"]):
            if not isinstance(run, dict) or "label" not in run:
                raise LossSpreadError(f"{path}: runs[{i}] is not a compare.train run (no 'label')")
        out.append((path, data))
    return out


def run_value(run: dict, window: int) -> tuple[float | None, list[int] | None, str]:
    """(final-window loss, [first, last] step of the window, source) of one compare.train run.

    The mean loss of the run's last ``window`` logged steps (by step number); source "steps". A run
    without per-step rows falls back to its summary's ``final_loss_mean10`` when ``window`` is 10
    (source "summary", window None). Otherwise (None, None, why).

    Example: steps 1..100 with loss 8 - 0.02 * step, window 10 -> (6.09, [91, 100], "steps").
    """
    rows = sorted((r for r in (run.get("steps") or []) if "loss" in r), key=lambda r: r["step"])
    if not rows:
        summary = run.get("summary") or {}
        if window == 10 and summary.get("final_loss_mean10") is not None:
            return float(summary["final_loss_mean10"]), None, "summary"
        return None, None, f"no per-step losses (and no summary value for --window {window})"
    if len(rows) < window:
        return None, None, f"only {len(rows)} steps logged, fewer than --window {window}"
    last = rows[-window:]
    return statistics.fmean(float(r["loss"]) for r in last), [last[0]["step"], last[-1]["step"]], "steps"


def group_key(run: dict, group_by: str) -> str:
    """The grouping key of a run: ``config`` -> the stem of its config path; ``label`` -> its label."""
    if group_by == "label":
        return str(run.get("label"))
    if group_by == "config":
        config = run.get("config")
        return Path(str(config)).stem if config else f"(no config: {run.get('label')})"
    raise LossSpreadError(f"--group-by: unknown key {group_by!r}; allowed: {', '.join(GROUP_KEYS)}")


def _max_grad_norm(run: dict) -> list | None:
    """[largest grad norm, its step] of a run's logged steps, None without per-step grad norms."""
    rows = [r for r in (run.get("steps") or []) if r.get("grad_norm") is not None]
    if not rows:
        return None
    top = max(rows, key=lambda r: r["grad_norm"] if math.isfinite(r["grad_norm"]) else math.inf)  # NaN: the worst
    g = float(top["grad_norm"])
    return [g if math.isfinite(g) else str(g), int(top["step"])]  # strict JSON has no NaN


def collect_runs(records: list[tuple[str, dict]], window: int, group_by: str) -> tuple[list[dict], list[str]]:
    """One entry per run of every file (file, label, config, group, family, seed, status, value,
    window_steps, source, max_grad_norm: [value, step] or None (a loss spike shows there, where the final-window
    loss may hide it), excluded: reason or None) and the exclusion warnings."""
    runs, warnings = [], []
    for path, data in records:
        options = (data.get("run") or {}).get("options") or {}
        for run in data["runs"]:
            value, steps, source = run_value(run, window) if run.get("status") == "ok" else (None, None, "")
            entry = dict(file=path, label=run.get("label"), config=run.get("config"),
                         group=group_key(run, group_by), family="torchtitan" if _is_stock(run) else "megamoe",
                         seed=options.get("seed"), git_rev=(data.get("run") or {}).get("git_rev"),
                         lr_schedule=lr_schedule(options)[0] if options else None,
                         status=run.get("status"), value=value, window_steps=steps, source=source,
                         max_grad_norm=_max_grad_norm(run), excluded=None, _run=run)
            if run.get("status") != "ok":
                entry["excluded"] = f"status {run.get('status')!r}: {run.get('reason')}"
            elif value is None:
                entry["excluded"] = source
            elif not math.isfinite(value):
                entry["value"] = None  # JSON has no NaN; the reason keeps the value
                entry["excluded"] = f"final-window loss is {value} (the run diverged: look at it, it is not noise)"
            if entry["excluded"]:
                warnings.append(f"excluded {path}: run {entry['label']!r} ({entry['group']}): {entry['excluded']}")
            runs.append(entry)
    return runs, warnings


# ------------------------------------------------------------------------------------ statistics

def _resolve_reference(reference: str, groups: dict[str, list[dict]], runs: list[dict], group_by: str) -> str:
    if reference in groups:
        return reference
    if group_by == "config":
        hits = {r["group"] for r in runs if r["label"] == reference and not r["excluded"]}
        if len(hits) == 1:
            return hits.pop()
        if len(hits) > 1:
            raise LossSpreadError(f"--reference {reference!r}: runs with this label lie in several config groups "
                                  f"({', '.join(sorted(hits))}); name one of them")
    excluded = sorted({r["group"] for r in runs if r["excluded"]} - set(groups))
    raise LossSpreadError(
        f"--reference {reference!r} is not a group (--group-by {group_by}: {GROUP_KEYS[group_by]}); groups with "
        f"usable runs: {', '.join(sorted(groups)) or 'none'}"
        + (f"; groups whose runs were all excluded: {', '.join(excluded)}" if excluded else ""))


def _group_warnings(key: str, members: list[dict]) -> list[str]:
    out = []
    ends = sorted({m["window_steps"][1] for m in members if m["window_steps"]})
    if len(ends) > 1:
        out.append(f"group {key}: runs end at different steps ({', '.join(map(str, ends))}): their final "
                   "windows are not the same steps")
    revs = sorted({str(m["git_rev"]) for m in members if m["git_rev"]})
    revs = [r for r in revs if not any(o != r and o.startswith(r) for o in revs)]  # short and full hash: one
    if len(revs) > 1:
        out.append(f"group {key}: runs from different git revisions ({', '.join(revs)}): code changes and "
                   "run-to-run noise are mixed in its spread")
    schedules = sorted({str(m["lr_schedule"]) for m in members if m["lr_schedule"] is not None})
    if len(schedules) > 1:
        out.append(f"group {key}: different LR schedule lengths ({', '.join(schedules)})")
    first = members[0]
    for m in members[1:]:
        diff = _config_diff(first["_run"], m["_run"])
        if diff:
            out.append(f"group {key}: run {m['label']!r} of {m['file']} has other config tables than run "
                       f"{first['label']!r} of {first['file']}: {'; '.join(diff)}")
    return out


def spread(runs: list[dict], reference: str, rel_tolerance: float,
           group_by: str = "config") -> tuple[list[dict], str, list[str]]:
    """Groups (key, family, n, mean, std, min, max, rel_diff, within_rel_tolerance,
    within_reference_spread, note), the resolved reference key, and the group warnings.

    ``std`` is the sample standard deviation (n - 1), None with one run; ``within_reference_spread``
    is |mean - ref mean| <= 2 * ref std (:data:`SPREAD_CRITERION`), None when the reference has one
    run. Raises LossSpreadError for an unknown reference or one without a usable run.
    """
    groups: dict[str, list[dict]] = {}
    for r in runs:
        if not r["excluded"]:
            groups.setdefault(r["group"], []).append(r)
    ref_key = _resolve_reference(reference, groups, runs, group_by)
    out, warnings = [], []
    for key, members in groups.items():
        values = [m["value"] for m in members]
        families = sorted({m["family"] for m in members})
        out.append(dict(key=key, family="/".join(families), n=len(values), mean=statistics.fmean(values),
                        std=statistics.stdev(values) if len(values) > 1 else None,
                        min=min(values), max=max(values)))
        warnings += _group_warnings(key, members)
    ref = next(g for g in out if g["key"] == ref_key)
    for g in out:
        diff = g["mean"] - ref["mean"]
        g["rel_diff"] = diff / ref["mean"] if ref["mean"] else None
        g["within_rel_tolerance"] = None if g["rel_diff"] is None else abs(g["rel_diff"]) <= rel_tolerance
        g["within_reference_spread"] = None if ref["std"] is None else abs(diff) <= 2 * ref["std"]
        notes = []
        if g["std"] is None:
            notes.append("one run: std n/a")
        if ref["std"] is None and g is ref:
            notes.append("one reference run: spread check n/a")
        g["note"] = "; ".join(notes) or None
    out.sort(key=lambda g: (g["key"] != ref_key, g["key"]))
    return out, ref_key, warnings


# ------------------------------------------------------------------------------------ output

def _gn(m: list | None) -> str:
    return "-" if not m else (f"{m[0]} ({m[1]})" if isinstance(m[0], str) else f"{m[0]:.3g} ({m[1]})")


def _f(x, spec=".4f"):
    return "n/a" if x is None else format(x, spec)


def _yes(x):
    return "n/a" if x is None else ("yes" if x else "NO")


def markdown(groups: list[dict], runs: list[dict], ref_key: str, window: int, group_by: str,
             rel_tolerance: float) -> str:
    """The groups table, then one row per run (excluded runs with their reason)."""
    lines = [f"Final-window loss: mean of the last {window} logged steps of each run. Grouped by {group_by}: "
             f"{GROUP_KEYS[group_by]}. Reference: {ref_key}. Within 2 std: {SPREAD_CRITERION}.", "",
             f"| group | family | runs | mean | std | min | max | vs reference | within {rel_tolerance:.1%} "
             "| within 2 std of reference |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for g in groups:
        if g["key"] == ref_key:
            rel = "(reference)"
        else:
            rel = "n/a" if g["rel_diff"] is None else f"{g['rel_diff'] * 100:+.2f} %"
        lines.append(f"| {g['key']} | {g['family']} | {g['n']} | {_f(g['mean'])} | {_f(g['std'])} | "
                     f"{_f(g['min'])} | {_f(g['max'])} | {rel} | {_yes(g['within_rel_tolerance'])} | "
                     f"{_yes(g['within_reference_spread'])} |")
    lines += ["", "| group | file | label | seed | final-window loss | steps | max grad norm (step) | status |",
              "|---|---|---|---|---|---|---|---|"]
    for r in runs:
        steps = f"{r['window_steps'][0]}-{r['window_steps'][1]}" if r["window_steps"] else r["source"] or "-"
        status = f"excluded: {r['excluded']}" if r["excluded"] else "ok"
        lines.append(f"| {r['group']} | {r['file']} | {r['label']} | {r['seed'] if r['seed'] is not None else '-'} | "
                     f"{_f(r['value'])} | {steps} | {_gn(r.get('max_grad_norm'))} | {status} |")
    return "\n".join(lines)


def provenance(argv: list[str], options: dict, records: list[tuple[str, dict]]) -> dict:
    """The compare records' provenance fields (versions, git revision, date, command, options) for an
    analysis that measures nothing itself: ``gpu`` is the input files' GPU ("mixed: ..." when they
    differ). Reads package versions from their metadata (no torch import)."""
    gpus = sorted({str((d.get("run") or {}).get("gpu")) for _, d in records if (d.get("run") or {}).get("gpu")})
    rev, dirty = git_revision()
    return {
        "gpu": gpus[0] if len(gpus) == 1 else (f"mixed: {', '.join(gpus)}" if gpus else None),
        "hostnames": [socket.gethostname()],
        "torch": _version("torch"),
        "triton": _version("triton"),
        "torchtitan": _version("torchtitan"),
        "torchao": _version("torchao"),
        "titan_megamoe": _version("titan_megamoe") or _version("titan-megamoe"),
        "python": platform.python_version(),
        "git_rev": rev,
        "git_dirty": dirty,
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join(["python", "-m", "compare.loss_spread", *argv]),
        "argv": [sys.argv[0], *argv],
        "options": options,
    }


def _input_entry(path: str, data: dict) -> dict:
    run = data.get("run") or {}
    options = run.get("options") or {}
    return dict(path=path, schema=data.get("schema"), gpu=run.get("gpu"), git_rev=run.get("git_rev"),
                date_utc=run.get("date_utc"), command=run.get("command"), seed=options.get("seed"),
                steps=options.get("steps"), runs=len(data["runs"]))


def _default_out() -> Path:
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d_%H%M%S")
    return REPO_ROOT / "outputs" / "loss_spread" / f"loss_spread_{stamp}.json"


def main(argv: list[str] | None = None) -> int:
    """The command line (see the module docstring); returns the exit status (argparse exits 2 on bad input)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m compare.loss_spread", description=__doc__.split("\n")[0],
                                epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("records", nargs="*", metavar="RUNS.json", help="compare.train JSON records (e.g. one per seed)")
    p.add_argument("--reference", required=True, metavar="KEY",
                   help="the group the others are compared with: a group key (see --group-by); with "
                        "--group-by config also a run label whose runs all lie in one group")
    p.add_argument("--window", type=int, default=10, metavar="N", help="final-window loss: mean of each run's last N logged "
                                                          "steps (default 10)")
    p.add_argument("--group-by", choices=tuple(GROUP_KEYS), default="config",
                   help="config (default): the stem of each run's config path; label: the run's label")
    p.add_argument("--rel-tolerance", type=float, default=0.02, metavar="TOL",
                   help="a group is 'within' when |mean / reference mean - 1| <= this (default 0.02 = 2%%)")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON record (default outputs/loss_spread/loss_spread_<utc time>.json)")
    a = p.parse_args(argv)
    if a.window < 1:
        p.error(f"argument --window: must be >= 1, got {a.window}")
    if not a.rel_tolerance >= 0:
        p.error(f"argument --rel-tolerance: must be >= 0, got {a.rel_tolerance}")
    try:
        records = load_train_records(a.records)
        runs, warnings = collect_runs(records, a.window, a.group_by)
        groups, ref_key, group_warnings = spread(runs, a.reference, a.rel_tolerance, a.group_by)
    except LossSpreadError as err:
        p.error(str(err))
    warnings += group_warnings
    for w in warnings:
        print(f"warning: {w}", file=sys.stderr)
    print(markdown(groups, runs, ref_key, a.window, a.group_by, a.rel_tolerance))

    out = a.out or _default_out()
    options = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()}
    options["out"] = str(out)
    rec = {
        "schema": SCHEMA,
        "run": provenance(argv, options, records),
        "inputs": [_input_entry(path, data) for path, data in records],
        "group_by": a.group_by, "group_key": GROUP_KEYS[a.group_by], "window": a.window,
        "reference": ref_key, "rel_tolerance": a.rel_tolerance, "spread_criterion": SPREAD_CRITERION,
        "std": "sample standard deviation (n - 1); null with one run",
        "groups": groups,
        "runs": [{k: v for k, v in r.items() if not k.startswith("_")} for r in runs],
        "excluded": [{"file": r["file"], "label": r["label"], "group": r["group"], "reason": r["excluded"]}
                     for r in runs if r["excluded"]],
        "warnings": warnings,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w") as f:
        json.dump(rec, f, indent=1)
        f.write("\n")
    print(f"\n[compare.loss_spread] wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
