"""compare.loss_spread on synthetic compare.train records (pure Python, no GPU, well under a second)."""

from __future__ import annotations

import json
import math
import statistics

import pytest

from compare import loss_spread
from compare.regress import TRAIN_SCHEMA

MEGA = "train_configs/qwen3_debugmoe_1gpu_megamoe_triton_bf16.toml"
STOCK = "train_configs/qwen3_debugmoe_1gpu_baseline_bf16.toml"
MEGA_STEM, STOCK_STEM = "qwen3_debugmoe_1gpu_megamoe_triton_bf16", "qwen3_debugmoe_1gpu_baseline_bf16"
# final-window losses (mean of steps 91-100) per seed: megamoe spread 0.1 around 5.5, stock 5.6
FINAL = {"megamoe-triton": {42: 5.45, 43: 5.55, 44: 5.50}, "torchtitan-baseline": {42: 5.58, 43: 5.62, 44: 5.60}}


def _run(label, config, final, n_steps=100, status="ok", converters=None, steps=True):
    """A compare.train run whose last 10 steps average to ``final`` (a straight line elsewhere)."""
    if converters is None:
        converters = ["megamoe"] if "megamoe" in config else []
    rows = [dict(step=s, loss=8.0 - 0.02 * s, tps=1000, grad_norm=0.5 + (19.0 if s == 61 else 0.0))
            for s in range(1, n_steps + 1)]
    if n_steps >= 10:
        shift = final - statistics.fmean(r["loss"] for r in rows[-10:])
        for r in rows[-10:]:
            r["loss"] += shift
    ok = status == "ok"
    return dict(label=label, config=config, status=status, reason=None if ok else "exit code 1",
                toml={"model": {"name": "qwen3", "converters": converters},
                      "parallelism": {"expert_parallel_degree": 1}},
                summary={"final_loss_mean10": final} if ok else None, steps=rows if ok and steps else [])


def _file(path, runs, seed=42, rev="abc1234", steps=100):
    run = {"gpu": "NVIDIA H200", "git_rev": rev, "date_utc": "2026-11-30T00:00:00+00:00",
           "command": "python -m compare.train ...", "options": {"seed": seed, "steps": steps, "ngpu": 1, "extra": ""}}
    rec = {"schema": TRAIN_SCHEMA, "run": run, "runs": runs}
    path.write_text(json.dumps(rec))
    return str(path)


def _seed_files(tmp_path, seeds=(42, 43, 44)):
    return [_file(tmp_path / f"train_s{seed}.json",
                  [_run("megamoe-triton", MEGA, FINAL["megamoe-triton"][seed]),
                   _run("torchtitan-baseline", STOCK, FINAL["torchtitan-baseline"][seed])], seed=seed)
            for seed in seeds]


def _main(args, capsys):
    rc = loss_spread.main([str(a) for a in args])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def _row(out, first):
    return next(line for line in out.splitlines() if line.startswith(f"| {first} |"))


def test_groups_by_config_mean_std_and_reference(tmp_path, capsys):
    out_json = tmp_path / "spread.json"
    files = _seed_files(tmp_path)
    rc, out, err = _main([*files, "--reference", STOCK_STEM, "--out", out_json], capsys)
    assert rc == 0, err
    assert err == ""
    mega = list(FINAL["megamoe-triton"].values())
    stock = list(FINAL["torchtitan-baseline"].values())
    m_mean, m_std = statistics.fmean(mega), statistics.stdev(mega)  # 5.50, 0.05
    s_mean, s_std = statistics.fmean(stock), statistics.stdev(stock)  # 5.60, 0.02
    assert m_std == pytest.approx(0.05) and s_std == pytest.approx(0.02)
    rel = (m_mean - s_mean) / s_mean  # -1.79 %: within 2 %, but 0.1 > 2 * 0.02: outside the reference's spread
    assert "Grouped by config: the stem of the run's config path" in out
    assert _row(out, STOCK_STEM) == (f"| {STOCK_STEM} | torchtitan | 3 | 5.6000 | 0.0200 | 5.5800 | 5.6200 | "
                                     "(reference) | yes | yes |")
    assert _row(out, MEGA_STEM) == (f"| {MEGA_STEM} | megamoe | 3 | 5.5000 | 0.0500 | 5.4500 | 5.5500 | "
                                    f"{rel * 100:+.2f} % | yes | NO |")
    assert out.index(f"| {STOCK_STEM} |") < out.index(f"| {MEGA_STEM} |")  # the reference first
    # a tighter relative tolerance flips the first verdict
    rc, out, _ = _main([*files, "--reference", STOCK_STEM, "--rel-tolerance", "0.01", "--out", out_json], capsys)
    assert rc == 0 and _row(out, MEGA_STEM).endswith("| -1.79 % | NO | NO |")

    rec = json.loads(out_json.read_text())
    assert rec["schema"] == loss_spread.SCHEMA
    for k in ("gpu", "torch", "triton", "torchtitan", "torchao", "titan_megamoe", "python", "git_rev", "git_dirty",
              "date_utc", "command", "argv", "options"):
        assert k in rec["run"], k
    assert rec["run"]["gpu"] == "NVIDIA H200" and rec["run"]["command"].startswith("python -m compare.loss_spread ")
    assert [i["path"] for i in rec["inputs"]] == files and [i["seed"] for i in rec["inputs"]] == [42, 43, 44]
    assert rec["inputs"][0]["git_rev"] == "abc1234" and rec["inputs"][0]["runs"] == 2
    assert rec["group_by"] == "config" and rec["reference"] == STOCK_STEM and rec["window"] == 10
    assert rec["spread_criterion"] == loss_spread.SPREAD_CRITERION and rec["rel_tolerance"] == 0.01
    g = {x["key"]: x for x in rec["groups"]}
    assert g[MEGA_STEM]["n"] == 3 and g[MEGA_STEM]["mean"] == pytest.approx(m_mean)
    assert g[MEGA_STEM]["std"] == pytest.approx(m_std) and g[MEGA_STEM]["rel_diff"] == pytest.approx(rel)
    assert g[MEGA_STEM]["within_rel_tolerance"] is False and g[MEGA_STEM]["within_reference_spread"] is False
    # every run's value, with its file, seed and window
    assert len(rec["runs"]) == 6 and rec["excluded"] == [] and rec["warnings"] == []
    r0 = rec["runs"][0]
    assert r0["file"] == files[0] and r0["label"] == "megamoe-triton" and r0["seed"] == 42
    assert r0["value"] == pytest.approx(5.45) and r0["window_steps"] == [91, 100] and r0["group"] == MEGA_STEM


def test_reference_by_label_group_by_label_and_window(tmp_path, capsys):
    files = _seed_files(tmp_path)
    out_json = tmp_path / "s.json"
    # --group-by config: a run label whose runs lie in one config group names that group
    rc, out, _ = _main([*files, "--reference", "torchtitan-baseline", "--out", out_json], capsys)
    assert rc == 0 and f"Reference: {STOCK_STEM}." in out
    # --group-by label: the same grouping here, keyed by label
    rc, out, _ = _main([*files, "--reference", "torchtitan-baseline", "--group-by", "label", "--out", out_json], capsys)
    assert rc == 0 and "Grouped by label" in out
    assert _row(out, "megamoe-triton").startswith("| megamoe-triton | megamoe | 3 | 5.5000 | 0.0500 |")
    # another window: steps 96-100 of the synthetic runs (shifted last 10 steps) average to the same value
    rc, out, _ = _main([*files, "--reference", "torchtitan-baseline", "--window", "5", "--out", out_json], capsys)
    assert rc == 0 and "mean of the last 5 logged steps" in out
    assert json.loads(out_json.read_text())["runs"][0]["window_steps"] == [96, 100]


def test_not_ok_and_diverged_runs_are_excluded_with_a_warning(tmp_path, capsys):
    files = _seed_files(tmp_path, seeds=(42, 43))
    bad = _run("megamoe-triton", MEGA, 5.5, status="error")
    nan = _run("torchtitan-baseline", STOCK, 5.6)
    nan["steps"][-1]["loss"] = float("nan")
    files.append(_file(tmp_path / "bad.json", [bad, nan], seed=44))
    out_json = tmp_path / "s.json"
    rc, out, err = _main([*files, "--reference", STOCK_STEM, "--out", out_json], capsys)
    assert rc == 0
    assert f"warning: excluded {files[2]}: run 'megamoe-triton' ({MEGA_STEM}): status 'error': exit code 1" in err
    assert "run 'torchtitan-baseline' (qwen3_debugmoe_1gpu_baseline_bf16): final-window loss is nan" in err
    assert _row(out, MEGA_STEM).startswith(f"| {MEGA_STEM} | megamoe | 2 |")  # seeds 42 and 43 only
    assert f"| {MEGA_STEM} | {files[2]} | megamoe-triton | 44 | n/a | - | - | excluded: status 'error'" in out
    rec = json.loads(out_json.read_text())  # strict JSON: no NaN written
    assert [(e["label"], e["reason"].split(":")[0]) for e in rec["excluded"]] == [
        ("megamoe-triton", "status 'error'"), ("torchtitan-baseline", "final-window loss is nan (the run diverged")]
    assert rec["runs"][-1]["value"] is None and len(rec["warnings"]) == 2


def test_one_run_groups_say_n_a(tmp_path, capsys):
    files = _seed_files(tmp_path, seeds=(42,))
    out_json = tmp_path / "s.json"
    rc, out, _ = _main([*files, "--reference", STOCK_STEM, "--out", out_json], capsys)
    assert rc == 0
    # no std with one run, so no spread check against a one-run reference: n/a, never a guess
    assert _row(out, STOCK_STEM) == (f"| {STOCK_STEM} | torchtitan | 1 | 5.5800 | n/a | 5.5800 | 5.5800 | "
                                     "(reference) | yes | n/a |")
    assert _row(out, MEGA_STEM).endswith("| n/a |") and "| 1 | 5.4500 | n/a |" in _row(out, MEGA_STEM)
    g = {x["key"]: x for x in json.loads(out_json.read_text())["groups"]}
    assert g[STOCK_STEM]["std"] is None and g[STOCK_STEM]["within_reference_spread"] is None
    assert g[STOCK_STEM]["note"] == "one run: std n/a; one reference run: spread check n/a"


def test_group_warnings_and_summary_fallback(tmp_path, capsys):
    out_json = tmp_path / "s.json"
    a = _file(tmp_path / "a.json", [_run("mega", MEGA, 5.5)], seed=42, rev="1111111")
    longer = _run("mega", MEGA, 5.3, n_steps=200)
    longer["toml"]["parallelism"]["expert_parallel_degree"] = 2
    b = _file(tmp_path / "b.json", [longer], seed=43, rev="2222222", steps=200)
    # a full hash and its short form are one revision; a summary-only run counts with --window 10
    c = _file(tmp_path / "c.json", [_run("mega", MEGA, 5.4, steps=False)], seed=44,
              rev="1111111aaaabbbbccccddddeeeeffff000011112")
    rc, out, err = _main([a, b, c, "--reference", MEGA_STEM, "--out", out_json], capsys)
    assert rc == 0
    assert _row(out, MEGA_STEM).startswith(f"| {MEGA_STEM} | megamoe | 3 | 5.4000 | 0.1000 |")
    assert f"| {MEGA_STEM} | {c} | mega | 44 | 5.4000 | summary | - | ok |" in out
    assert f"| {MEGA_STEM} | {a} | mega | 42 | 5.5000 | 91-100 | 19.5 (61) | ok |" in out  # a spike's step
    assert f"group {MEGA_STEM}: runs end at different steps (100, 200)" in err
    assert "different LR schedule lengths (100, 200)" in err
    assert "runs from different git revisions (1111111aaaabbbbccccddddeeeeffff000011112, 2222222)" in err
    assert "parallelism.expert_parallel_degree: 1 -> 2" in err
    assert len(json.loads(out_json.read_text())["warnings"]) == 4
    # no per-step rows and another window: excluded, with the reason
    rc, out, err = _main([a, c, "--reference", MEGA_STEM, "--window", "5", "--out", out_json], capsys)
    assert rc == 0 and "no per-step losses (and no summary value for --window 5)" in err
    # a run shorter than the window
    short = _file(tmp_path / "short.json", [_run("mega", MEGA, 5.5, n_steps=4)], seed=45)
    rc, out, err = _main([a, short, "--reference", MEGA_STEM, "--out", out_json], capsys)
    assert rc == 0 and "only 4 steps logged, fewer than --window 10" in err


def test_bad_input_exits_2_with_a_clear_message(tmp_path, capsys):
    files = _seed_files(tmp_path, seeds=(42,))
    layer = tmp_path / "layer.json"
    layer.write_text(json.dumps({"schema": "titan_megamoe.compare.layer/1", "run": {}, "records": []}))
    trainlog = tmp_path / "trainlog.json"  # compare.trainlog's format: runs is a dict
    trainlog.write_text(json.dumps({"runs": {"a": {"summary": {}, "steps": []}}}))
    all_bad = _file(tmp_path / "allbad.json", [_run("stock", STOCK, 5.6, status="error"), _run("mega", MEGA, 5.5)])
    cases = [
        ([], "no input file"),
        ([tmp_path / "absent.json"], "cannot read results JSON"),
        ([layer], "a compare.layer results file, not a compare.train record"),
        ([trainlog], "neither a compare.layer results file"),
        ([files[0], files[0]], "given twice"),
        ([files[0], "--reference", "nope"], "--reference 'nope' is not a group (--group-by config: the stem"),
        ([files[0], "--reference", "nope", "--group-by", "label"],
         "groups with usable runs: megamoe-triton, torchtitan-baseline"),
        ([all_bad, "--reference", STOCK_STEM], f"groups whose runs were all excluded: {STOCK_STEM}"),
        ([files[0], "--window", "0"], "--window: must be >= 1"),
        ([files[0], "--rel-tolerance", "-0.1"], "--rel-tolerance: must be >= 0"),
        ([files[0], "--group-by", "seed"], "invalid choice: 'seed'"),
    ]
    for args, msg in cases:
        if "--reference" not in args:
            args = [*args, "--reference", STOCK_STEM]
        with pytest.raises(SystemExit) as exc:
            loss_spread.main([str(a) for a in args])
        assert exc.value.code == 2, args
        err = capsys.readouterr().err
        assert msg in err, (args, err)
    with pytest.raises(SystemExit):
        loss_spread.main([files[0]])  # --reference is required
    assert "--reference" in capsys.readouterr().err


def test_run_value_docstring_example():
    run = {"steps": [{"step": s, "loss": 8 - 0.02 * s} for s in range(1, 101)]}
    value, steps, source = loss_spread.run_value(run, 10)
    assert value == pytest.approx(6.09) and steps == [91, 100] and source == "steps"
    assert loss_spread.group_key({"config": "/root/x/train_configs/a_b.toml", "label": "l"}, "config") == "a_b"
    assert loss_spread.group_key({"config": "a_b.toml", "label": "l"}, "label") == "l"
    assert math.isnan(loss_spread.run_value({"steps": [{"step": 1, "loss": float("nan")}]}, 1)[0])
