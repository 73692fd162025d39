"""python -m compare.regress: compare new compare.layer records against a baseline file.

    python -m compare.regress NEW.json --baseline OLD.json [--tolerance 0.05] [--metrics fwd_ms,fwdbwd_ms,speedup]

Records are matched by (implementation, precision, shape name + dims, routing (+ zipf s / replay
file and layer), ep, tokens_per_rank) (``compare.records.record_key``). For every baseline record:

* missing from NEW -> MISSING (failure);
* ok in the baseline but not ok in NEW (skipped / error) -> NOT OK (failure);
* ok in both: ``fwd_ms`` and ``fwdbwd_ms`` regress when new > old * (1 + tolerance); each fwd+bwd
  speedup against a stock variant present in both regresses when new < old / (1 + tolerance)
  (the same relative slow-down, seen as a ratio). Faster is reported as "faster", never a failure.

Records only in NEW are listed as "new". Exit status: 0 nothing regressed and nothing missing;
1 a regression or a missing / not-ok record; 2 bad arguments or unreadable files.
"""

from __future__ import annotations

import argparse
import sys

from compare.records import key_str, load_results, record_key

__all__ = ["compare_records", "main"]

METRICS = ("fwd_ms", "fwdbwd_ms", "speedup")


def _index(records: list[dict]) -> dict[tuple, dict]:
    return {record_key(r): r for r in records}


def compare_records(new: list[dict], base: list[dict], tolerance: float,
                    metrics: tuple[str, ...] = METRICS) -> tuple[list[tuple], int]:
    """Rows (record, metric, baseline, new, change, verdict) and the number of failures."""
    new_ix, base_ix = _index(new), _index(base)
    rows: list[tuple] = []
    failures = 0
    for key, old in base_ix.items():
        name = key_str(key)
        cur = new_ix.get(key)
        if cur is None:
            rows.append((name, "-", old["status"], "absent", "-", "MISSING"))
            failures += 1
            continue
        if old["status"] != "ok":
            rows.append((name, "status", old["status"], cur["status"], "-", "not compared"))
            continue
        if cur["status"] != "ok":
            rows.append((name, "status", "ok", f"{cur['status']}: {cur.get('reason')}", "-", "NOT OK"))
            failures += 1
            continue
        for m in ("fwd_ms", "fwdbwd_ms"):
            if m not in metrics or old.get(m) is None or cur.get(m) is None:
                continue
            ratio = cur[m] / old[m]
            bad = ratio > 1 + tolerance
            failures += bad
            verdict = "REGRESSED" if bad else ("faster" if ratio < 1 / (1 + tolerance) else "ok")
            rows.append((name, m, f"{old[m]:.4g}", f"{cur[m]:.4g}", f"{(ratio - 1) * 100:+.1f}%", verdict))
        if "speedup" in metrics:
            self_variant = f"{old['implementation']}/{old['precision']}"
            for variant, sp_old in (old.get("speedup_vs") or {}).items():
                sp_new = (cur.get("speedup_vs") or {}).get(variant)
                if variant == self_variant or not sp_new or not sp_old.get("fwdbwd") or not sp_new.get("fwdbwd"):
                    continue
                ratio = sp_new["fwdbwd"] / sp_old["fwdbwd"]
                bad = ratio < 1 / (1 + tolerance)
                failures += bad
                verdict = "REGRESSED" if bad else ("better" if ratio > 1 + tolerance else "ok")
                rows.append((name, f"speedup vs {variant}", f"{sp_old['fwdbwd']:.3f}x",
                             f"{sp_new['fwdbwd']:.3f}x", f"{(ratio - 1) * 100:+.1f}%", verdict))
    for key, cur in new_ix.items():
        if key not in base_ix:
            rows.append((key_str(key), "-", "absent", cur["status"], "-", "new"))
    return rows, failures


def _table(rows: list[tuple]) -> str:
    head = ("record", "metric", "baseline", "new", "change", "verdict")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m compare.regress", description=__doc__.split("\n")[0])
    p.add_argument("new", help="results JSON of the new run")
    p.add_argument("--baseline", required=True, help="results JSON to compare against")
    p.add_argument("--tolerance", type=float, default=0.05,
                   help="allowed relative slow-down (default 0.05 = 5%%)")
    p.add_argument("--metrics", default=",".join(METRICS),
                   help=f"comma list of: {', '.join(METRICS)} (default: all)")
    args = p.parse_args(argv)
    if not args.tolerance >= 0:
        p.error(f"argument --tolerance: must be >= 0, got {args.tolerance}")
    metrics = tuple(m.strip() for m in args.metrics.split(",") if m.strip())
    for m in metrics:
        if m not in METRICS:
            p.error(f"argument --metrics: unknown metric {m!r}; allowed: {', '.join(METRICS)}")
    try:
        new, base = load_results(args.new), load_results(args.baseline)
    except ValueError as err:
        p.error(str(err))
    rows, failures = compare_records(new["records"], base["records"], args.tolerance, metrics)
    print(f"baseline: {args.baseline} ({base.get('run', {}).get('gpu', '?')}, "
          f"{base.get('run', {}).get('git_rev', '?')}); new: {args.new} "
          f"({new.get('run', {}).get('gpu', '?')}, {new.get('run', {}).get('git_rev', '?')}); "
          f"tolerance {args.tolerance:.1%}")
    print(_table(rows))
    missing = sum(r[5] == "MISSING" for r in rows)
    if failures:
        print(f"\nFAIL: {failures} regression(s) / missing or not-ok record(s) ({missing} missing)")
        return 1
    print(f"\nPASS: {len(rows)} comparison(s), nothing regressed beyond {args.tolerance:.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
