"""compare.train with a fake launcher that prints TorchTitan-style metrics lines (no GPU, fast)."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from compare import train

ROOT = Path(__file__).resolve().parents[1]
CFG_A = ROOT / "train_configs" / "qwen3_debugmoe_baseline_bf16.toml"
CFG_B = ROOT / "train_configs" / "qwen3_debugmoe_megamoe_bf16.toml"

# tokens/s per config (by name) after warm-up; warm-up steps (<= 2) log a slow 50
BASE_TPS = {"baseline": 1000, "megamoe": 1500}

FAKE = textwrap.dedent('''
    """Fake titan_megamoe.launch: same arguments, prints TorchTitan metrics lines."""
    import argparse, os, sys
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser()
    p.add_argument("--config"); p.add_argument("--ngpu", type=int); p.add_argument("--steps", type=int)
    a = p.parse_args(argv)
    print("fake launcher args:", " ".join(sys.argv[1:]), flush=True)
    if os.environ.get("FAKE_FAIL") and os.environ["FAKE_FAIL"] in a.config:
        for i in range(40):
            print(f"traceback line {i}")
        print("RuntimeError: CUDA out of memory (fake)")
        sys.exit(3)
    if os.environ.get("FAKE_NOMETRICS") and os.environ["FAKE_NOMETRICS"] in a.config:
        print("trained nothing")
        sys.exit(0)
    base = 1500 if "megamoe" in a.config else 1000
    spike = os.environ.get("FAKE_SPIKE") and os.environ["FAKE_SPIKE"] in a.config
    for s in range(1, a.steps + 1):
        tps = 50 if s <= 2 else base + 10 * s
        loss, gn = (10 - 0.5 * s + 3, 19.5) if spike and s == 7 else (10 - 0.5 * s, 1.2345)
        print(f"[rank0]:[titan] 2026-11-29 12:00:00,000 - root - INFO - step: {s:2d}  loss: {loss:8.5f}"
              f"  grad_norm:  {gn:.4f}  memory:  {1.0 + 0.1 * s:.2f}GiB(1.00%)  tps: {tps:,}"
              f"  tflops: 12.34  mfu: {2.0 + 0.1 * s:.2f}%")
''')


@pytest.fixture()
def fake(tmp_path):
    path = tmp_path / "fake_launch.py"
    path.write_text(FAKE)
    return str(path)


def _expected(base, steps=10, skip=2):
    steady = [base + 10 * s for s in range(1, steps + 1) if s > skip]
    return dict(median_tps=statistics.median(steady),
                final_loss_mean10=statistics.fmean(10 - 0.5 * s for s in range(max(1, steps - 9), steps + 1)),
                peak_memory_gib=1.0 + 0.1 * steps,
                median_mfu_pct=statistics.median(round(2.0 + 0.1 * s, 2) for s in range(skip + 1, steps + 1)))


def _main(args, monkeypatch=None, env=None):
    if monkeypatch is not None:
        for k, v in (env or {}).items():
            monkeypatch.setenv(k, v)
    return train.main([str(a) for a in args])


def test_two_configs(tmp_path, fake, capsys):
    out = tmp_path / "res" / "cmp.json"
    rc = _main(["--configs", CFG_A, CFG_B, "--steps", 10, "--skip", 2, "--ngpu", 2, "--labels", "stock", "mega",
                "--out", out, "--launcher", fake, "--extra", "--training.local_batch_size 4"])
    assert rc == 0
    table = capsys.readouterr().out
    ea, eb = _expected(1000), _expected(1500)
    assert ea["median_tps"] == 1065 and eb["median_tps"] == 1565
    rec = json.loads(out.read_text())
    assert rec["schema"] == train.SCHEMA
    a, b = rec["runs"]
    for r, e, label in ((a, ea, "stock"), (b, eb, "mega")):
        assert r["label"] == label and r["status"] == "ok" and r["returncode"] == 0
        assert r["summary"]["steps"] == 10 and len(r["steps"]) == 10
        for k, v in e.items():
            assert r["summary"][k] == pytest.approx(v), k
        assert Path(r["log"]) == out.parent / f"cmp_{label}.log"
        log = Path(r["log"]).read_text()
        # same seed and steps for every run, ngpu and extra passed through
        assert "--ngpu 2 --steps 10 -- --debug.seed 42 --training.local_batch_size 4" in log
    assert a["speedup_vs_first"] == pytest.approx(1.0)
    assert b["speedup_vs_first"] == pytest.approx(1565 / 1065)
    # provenance and the config tables
    run = rec["run"]
    for k in ("gpu", "torch", "torchtitan", "git_rev", "date_utc", "command", "python"):
        assert k in run
    assert "compare.train" in run["command"] and run["options"]["seed"] == 42
    assert a["config"] == str(CFG_A)
    assert b["toml"]["model"]["converters"] == ["megamoe"] and b["toml"]["megamoe"]["backend"] == "triton"
    assert "parallelism" in a["toml"] and "megamoe" not in a["toml"]["model"].get("converters", [])
    # table rows with the numbers; PNG exists
    assert ea["final_loss_mean10"] == 7.25 and ea["median_mfu_pct"] == pytest.approx(2.65)
    assert "| stock | 10 | 1,065 | 1.00 | 2.00 | 2.65 | 7.2500 | - | ok |" in table
    # the same losses: the worst step is the first one at +0.0 %
    assert b["worst_step_vs_first"]["rel"] == 0 and a["worst_step_vs_first"] is None
    assert (f"| mega | 10 | 1,565 | {1565 / 1065:.2f} | 2.00 | 2.65 | 7.2500 | step 1: 9.5 vs 9.5 (+0.0 %), "
            "grad norm 1.23 vs 1.23 | ok |") in table
    png = out.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_loss_spike_is_named_by_its_step_against_the_first_run(tmp_path, fake, capsys, monkeypatch):
    """A run whose loss jumps at one step (same seed, so the same batches as the first run) gets that step in its
    record and its table row, though its final loss (mean of the last 10 steps) hides most of it."""
    out = tmp_path / "cmp.json"
    rc = _main(["--configs", CFG_A, CFG_B, "--steps", 10, "--skip", 2, "--labels", "stock", "mega", "--out", out,
                "--launcher", fake], monkeypatch, {"FAKE_SPIKE": "megamoe"})
    assert rc == 0
    table = capsys.readouterr().out
    w = json.loads(out.read_text())["runs"][1]["worst_step_vs_first"]
    assert w == dict(step=7, loss=9.5, ref_loss=6.5, rel=pytest.approx(9.5 / 6.5 - 1), grad_norm=19.5,
                     ref_grad_norm=1.2345)
    assert "step 7: 9.5 vs 6.5 (+46.2 %), grad norm 19.5 vs 1.23" in table
    s = json.loads(out.read_text())["runs"][1]["summary"]
    assert s["max_grad_norm"] == 19.5 and s["max_grad_norm_step"] == 7


def test_worst_step_vs_skips_steps_the_reference_lacks():
    from compare.trainlog import worst_step_vs

    rows = [dict(step=s, loss=l, grad_norm=1.0) for s, l in ((1, 5.0), (2, 9.0), (3, 4.0))]
    ref = [dict(step=1, loss=5.0, grad_norm=1.0), dict(step=3, loss=2.0, grad_norm=0.5)]
    assert worst_step_vs(rows, ref) == dict(step=3, loss=4.0, ref_loss=2.0, rel=1.0, grad_norm=1.0, ref_grad_norm=0.5)
    assert worst_step_vs(rows, []) is None
    # a run that diverges later: its first non-finite loss is the worst step, as strings (strict JSON has no NaN)
    bad = rows + [dict(step=4, loss=float("nan"), grad_norm=float("nan")), dict(step=5, loss=7.0, grad_norm=1.0)]
    ref4 = ref + [dict(step=4, loss=2.0, grad_norm=0.5), dict(step=5, loss=2.0, grad_norm=0.5)]
    w = worst_step_vs(bad, ref4)
    assert w["step"] == 4 and w["loss"] == "nan" and w["rel"] == "nan", w
    from compare.train import _worst
    assert _worst(w) == "step 4: loss nan (diverged), grad norm nan"


def test_summary_max_grad_norm_ranks_a_nan_highest():
    from compare.trainlog import summarize

    rows = [dict(step=s, loss=5.0, grad_norm=g, memory_gib=1.0, tps=100, mfu_pct=1.0)
            for s, g in ((1, 3.0), (2, float("nan")), (3, 9.0))]
    s = summarize(rows, skip=0)
    assert (s["max_grad_norm"], s["max_grad_norm_step"]) == ("nan", 2)
    rows[1]["grad_norm"] = 1.0
    s = summarize(rows, skip=0)
    assert (s["max_grad_norm"], s["max_grad_norm_step"]) == (9.0, 3)


def test_failure_reported_others_still_run(tmp_path, fake, capsys, monkeypatch):
    out = tmp_path / "f.json"
    plot = tmp_path / "plots" / "f.png"
    # the first config fails: the second still runs, no speedup can be computed against the first
    rc = _main(["--configs", CFG_A, CFG_B, "--steps", 8, "--out", out, "--plot", plot],
               monkeypatch, {"COMPARE_TRAIN_LAUNCHER": fake, "FAKE_FAIL": "baseline"})
    assert rc == 1
    cap = capsys.readouterr()
    # the reason names the log's last line (a launcher's own error message ends its log)
    assert "qwen3_debugmoe_baseline_bf16 FAILED (exit code 3: RuntimeError: CUDA out of memory (fake))" in cap.err
    assert "RuntimeError: CUDA out of memory (fake)" in cap.err
    assert "traceback line 11" in cap.err and "traceback line 10\n" not in cap.err  # last 30 lines only
    rec = json.loads(out.read_text())
    a, b = rec["runs"]
    assert a["status"] == "error" and a["returncode"] == 3 and a["summary"] is None
    assert "CUDA out of memory" in a["log_tail"]
    assert b["status"] == "ok" and b["summary"]["median_tps"] == statistics.median(1500 + 10 * s for s in range(6, 9))
    assert "| qwen3_debugmoe_baseline_bf16 | - |" in cap.out and "error: exit code 3: RuntimeError" in cap.out
    assert plot.is_file()


def test_no_metrics_is_an_error(tmp_path, fake, capsys, monkeypatch):
    out = tmp_path / "n.json"
    rc = _main(["--configs", CFG_A, CFG_B, "--steps", 8, "--out", out, "--launcher", fake],
               monkeypatch, {"FAKE_NOMETRICS": "megamoe"})
    assert rc == 1
    assert "no TorchTitan metrics line" in capsys.readouterr().err
    a, b = json.loads(out.read_text())["runs"]
    assert a["status"] == "ok" and b["status"] == "error" and b["returncode"] == 0


@pytest.mark.parametrize("args, msg", [
    (["--configs", CFG_A, "missing.toml"], "config file(s) not found: missing.toml"),
    (["--configs", CFG_A, CFG_B, "--labels", "one"], "--labels has 1 names for 2 configs"),
    (["--configs", CFG_A, "--steps", 5, "--skip", 5], "must be greater than --skip"),
    (["--configs", CFG_A, CFG_A], "labels must be distinct"),
])
def test_bad_options_exit_2(tmp_path, fake, capsys, args, msg):
    with pytest.raises(SystemExit) as e:
        _main([*args, "--out", tmp_path / "x.json", "--launcher", fake])
    assert e.value.code == 2
    assert msg in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def test_cli_entry_point(tmp_path, fake):
    """``python -m compare.train`` end to end in a subprocess (exit status and files)."""
    out = tmp_path / "cli.json"
    env = dict(os.environ, COMPARE_TRAIN_LAUNCHER=fake)
    res = subprocess.run([sys.executable, "-m", "compare.train", "--configs", str(CFG_A), "--steps", "7",
                          "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert json.loads(out.read_text())["runs"][0]["summary"]["steps"] == 7
    assert (tmp_path / "cli_qwen3_debugmoe_baseline_bf16.log").is_file()


# ----------------------------------------------------------------------------- the comparison set
# train_configs/ is written by scripts/gen_train_configs.py (one table); these tests keep the two in
# sync and check that every config is what it says: TorchTitan's ConfigManager parses it with our
# [megamoe] table, and the megamoe converter accepts it (or refuses it as "not available yet").

def _gen():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gen_train_configs", ROOT / "scripts" / "gen_train_configs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


GEN = _gen()
GENERATED = sorted(GEN.render_all())
SETS = {f"{stem}_{v}.toml": (stem, v) for stem, m in GEN.MODELS.items() for v in GEN.variants_of(m)}


def test_generator_output_equals_committed_configs(tmp_path):
    assert GEN.check() == [], "train_configs/ is out of date: run python scripts/gen_train_configs.py"
    assert {p.name for p in (ROOT / "train_configs").glob("*.toml")} == set(GENERATED)
    # the generator writes the same bytes again, and --check notices a hand edit and a stale file
    assert GEN.main(["--out", str(tmp_path)]) == 0
    assert GEN.main(["--check", "--out", str(tmp_path)]) == 0
    edited = tmp_path / GENERATED[0]
    edited.write_text(edited.read_text().replace("seed = 42", "seed = 43"))
    (tmp_path / "qwen3_old_megamoe_bf16.toml").write_text(GEN.MARKER + "\n")
    assert GEN.main(["--check", "--out", str(tmp_path)]) == 1
    assert set(GEN.check(tmp_path)) == {f"differs from the generator: {edited}",
                                        f"generated by an older table (delete it): {tmp_path / 'qwen3_old_megamoe_bf16.toml'}"}
    assert GEN.main(["--out", str(tmp_path)]) == 0 and GEN.check(tmp_path) == []


def test_every_set_has_the_five_variants():
    assert GEN.FIVE == ("baseline_bf16", "baseline_fp8", "megamoe_bf16", "megamoe_fp8", "megamoe_fp8_bwd")
    sets = {"qwen3_debugmoe": 2, "qwen3_debugmoe_1gpu": 1, "qwen3_30b_a3b_8L": 2, "qwen3_235b_a22b_4L": 2,
            "qwen3_30b_a3b": 8, "qwen3_235b_a22b": 32}
    assert {stem: m["gpus"] for stem, m in GEN.MODELS.items()} == sets
    for stem in sets:
        for v in GEN.FIVE:
            assert f"{stem}_{v}.toml" in GENERATED, (stem, v)
    # the oracle in every set; the GPU CI baseline's file name in the 1-GPU set; no opt-in EP variant left
    assert sorted(n for n in GENERATED if "reference_bf16" in n) == sorted(f"{stem}_megamoe_reference_bf16.toml" for stem in sets)
    assert [n for n in GENERATED if "triton_bf16" in n] == ["qwen3_debugmoe_1gpu_megamoe_triton_bf16.toml"]
    assert not [n for n in GENERATED if "triton_ep" in n]


def _parallel_dims(ep):
    from types import SimpleNamespace

    return SimpleNamespace(tp=1, etp=1, pp=1, cp=1, ep=ep)


@pytest.mark.parametrize("name", GENERATED, ids=[n[:-5] for n in GENERATED])
def test_generated_config_parses_and_converts(name):
    from torchtitan.config import ConfigManager

    import titan_megamoe  # noqa: F401  registers flavors, dataset, converter
    from titan_megamoe.config import AVAILABLE
    from titan_megamoe.converter import MegaMoEConverter

    stem, variant = SETS[name]
    m = GEN.MODELS[stem]
    path = ROOT / "train_configs" / name
    text = path.read_text()
    assert text.splitlines()[0].startswith("# ") and GEN.MARKER in text
    cfg = ConfigManager().parse_args(["--job.config_file", str(path), "--job.custom_config_module", "titan_megamoe.config"])
    assert cfg.model.name == "qwen3" and cfg.model.flavor == m["flavor"]
    assert cfg.parallelism.expert_parallel_degree == m["ep"] and cfg.parallelism.data_parallel_shard_degree == -1
    assert cfg.debug.seed == 42 and cfg.training.steps == m["steps"]
    if stem.startswith("qwen3_debugmoe"):
        assert cfg.compile.enable == (variant == "baseline_fp8")  # eager set, stock FP8 always compiled
    else:  # the 30B / 235B sets: as the published comparisons
        assert cfg.training.seq_len == 16384 and cfg.activation_checkpoint.mode == "full" and cfg.compile.enable
    if variant.startswith("baseline"):
        assert "custom_config_module" not in text.split("[experimental]")[0]  # stock configs stay stock
        assert cfg.model.converters == (["quantize.grouped_mm.float8"] if variant == "baseline_fp8" else [])
        return
    assert cfg.model.converters == ["megamoe"]
    precision = variant.split("megamoe_", 1)[1].replace("triton_", "").replace("reference_", "")
    assert cfg.megamoe.precision == precision
    assert precision in AVAILABLE[cfg.megamoe.backend]
    if precision != "bf16":  # the fused FP8 kernels, at EP > 1 inside the operator (FP8 EP v1)
        assert cfg.megamoe.backend == "triton"
        assert "WAITING ON FP8" not in text and "refused" not in text
    if precision == "bf16":  # the fused kernels (EP inside the operator at EP > 1), or the named oracle
        assert cfg.megamoe.backend == ("reference" if "reference" in variant else "triton")
        assert "TITAN_MEGAMOE_EP_TRITON" not in text  # no opt-in flag any more
    MegaMoEConverter(cfg, _parallel_dims(m["ep"]))  # accepted


# ----------------------------------------------------------------------------- compare.regress on train JSON

def _run(label, n_steps, tps, loss, converters=(), backend=None, skip=10, status="ok"):
    """A compare.train run: per-step rows from tps(step) / loss(step), summary as compare.train makes it."""
    from compare.trainlog import summarize

    rows = [dict(step=s, loss=loss(s), grad_norm=1.0, memory_gib=5.0, tps=tps(s), tflops=1.0, mfu_pct=1.0)
            for s in range(1, n_steps + 1)]
    toml = {"model": {"name": "qwen3", "flavor": "debugmodel_moe", "converters": list(converters)},
            "megamoe": {"backend": backend, "precision": "bf16"} if backend else {},
            "parallelism": {"expert_parallel_degree": 1}}
    ok = status == "ok"
    return dict(label=label, config=f"{label}.toml", toml=toml, status=status, returncode=0 if ok else 1,
                reason=None if ok else "exit code 1", summary=summarize(rows, skip) if ok else None,
                steps=rows if ok else [])


def _tps_triton(s):  # fast for 100 steps, then slower (data-dependent, as in the committed run)
    return 100 if s <= 2 else (1200 + s % 7 if s <= 100 else 900)


def _tps_stock(s):
    return 100 if s <= 2 else (1000 + s % 5 if s <= 100 else 950)


def _loss(s):
    return 8.0 - 0.02 * s


def _train_file(path, runs, steps, seed=42, extra=""):
    rec = {"schema": train.SCHEMA, "run": {"gpu": "NVIDIA H200", "git_rev": "abc1234",
                                           "options": {"ngpu": 1, "seed": seed, "extra": extra, "steps": steps}},
           "runs": runs}
    path.write_text(json.dumps(rec))
    return str(path)


def _base(tmp_path):
    runs = [_run("megamoe-triton", 200, _tps_triton, _loss, ["megamoe"], "triton"),
            _run("megamoe-reference", 200, lambda s: 200, _loss, ["megamoe"], "reference"),
            _run("torchtitan-baseline", 200, _tps_stock, _loss)]
    return _train_file(tmp_path / "base.json", runs, 200)


def _new(tmp_path, name="new.json", tps_scale=1.0, loss_shift=0.0, stock_scale=1.0, drop=(), shift_from=1, **kw):
    """The CI-style 100-step file; megamoe-triton's loss is shifted by ``loss_shift`` from step
    ``shift_from`` on (a late shift is the run-to-run divergence; from step 1 a numerics change)."""
    runs = [_run("megamoe-triton", 100, lambda s: int(_tps_triton(s) * tps_scale),
                 lambda s: _loss(s) + (loss_shift if s >= shift_from else 0.0), ["megamoe"], "triton"),
            _run("torchtitan-baseline", 100, lambda s: int(_tps_stock(s) * stock_scale), _loss)]
    kw.setdefault("extra", "--lr_scheduler.total_steps 200")  # the baseline's LR schedule
    return _train_file(tmp_path / name, [r for r in runs if r["label"] not in drop], 100, **kw)


SEL = ["--select", "label=megamoe-triton,torchtitan-baseline"]


def test_regress_train_pass_on_the_same_steps(tmp_path, capsys):
    from compare.regress import main

    base = _base(tmp_path)
    # 3 % slower and 0.05 higher loss after step 20 (late divergence): within 10 % / 0.1. Over steps
    # 11-100 the baseline's median is ~1203 tokens/s; its whole-run summary (steps 11-200, 900) would
    # have hidden a 15 % slow-down.
    assert main([_new(tmp_path, tps_scale=0.97, loss_shift=0.05, shift_from=20), "--baseline", base,
                 "--tolerance", "0.1", "--loss-tolerance", "0.1", *SEL]) == 0
    out = capsys.readouterr().out
    assert "compare.train" in out and "PASS" in out
    assert "| megamoe-triton | median tokens/s/GPU (steps 11-100) | 1,203 | 1,166 | -3.1% | ok |" in out
    assert "| megamoe-triton | mean loss (steps 91-100) | 6.0900 | 6.1400 | +0.0500 | ok |" in out
    assert "| megamoe-triton | speedup vs torchtitan-baseline | 1.201x | 1.164x | -3.1% | ok |" in out
    assert "megamoe-reference" not in out  # not selected
    assert main([_new(tmp_path, "same.json"), "--baseline", base, *SEL]) == 0
    capsys.readouterr()


def test_regress_train_fail_tps_speedup_loss(tmp_path, capsys):
    from compare.regress import main

    base = _base(tmp_path)
    assert main([_new(tmp_path, tps_scale=0.85), "--baseline", base, "--tolerance", "0.1", *SEL]) == 1
    out = capsys.readouterr().out
    bad = [line for line in out.splitlines() if "REGRESSED" in line]
    assert len(bad) == 2 and all(line.startswith("| megamoe-triton |") for line in bad)
    assert "median tokens/s/GPU" in bad[0] and "-15.0%" in bad[0] and "speedup vs torchtitan-baseline" in bad[1]
    assert "FAIL: 2 regression(s)" in out
    # only --metrics tps: the speedup is not checked
    assert main([_new(tmp_path, tps_scale=0.85), "--baseline", base, "--tolerance", "0.1", "--metrics", "loss", *SEL]) == 0
    capsys.readouterr()
    # stock got faster, megamoe did not: megamoe's own tokens/s are fine but its speedup regressed
    assert main([_new(tmp_path, stock_scale=1.2), "--baseline", base, "--tolerance", "0.1", *SEL]) == 1
    out = capsys.readouterr().out
    assert "| torchtitan-baseline | median tokens/s/GPU (steps 11-100) | 1,002 | 1,202 | +20.0% | faster |" in out
    assert [line for line in out.splitlines() if "REGRESSED" in line][0].startswith(
        "| megamoe-triton | speedup vs torchtitan-baseline | 1.201x | 1.001x | -16.6% | REGRESSED |")
    # final-window loss (shifted after the early steps): either direction beyond the absolute
    # tolerance, and a NaN
    for shift in (0.3, -0.3, float("nan")):
        assert main([_new(tmp_path, loss_shift=shift, shift_from=20), "--baseline", base,
                     "--loss-tolerance", "0.1", *SEL]) == 1
        out = capsys.readouterr().out
        assert "| megamoe-triton | mean loss (steps 91-100) | 6.0900 |" in out and "| LOSS CHANGED |" in out
        assert "EARLY LOSS CHANGED" not in out
    assert main([_new(tmp_path, loss_shift=0.3, shift_from=20), "--baseline", base, "--loss-tolerance", "0.5",
                 *SEL]) == 0
    # the same shift from step 1 on is a numerics change: the early check fails, whatever --loss-tolerance
    assert main([_new(tmp_path, loss_shift=0.3), "--baseline", base, "--loss-tolerance", "0.5", *SEL]) == 1
    assert "EARLY LOSS CHANGED (15 of 15 steps beyond 0.002)" in capsys.readouterr().out


def test_regress_train_missing_notok_and_changed(tmp_path, capsys):
    from compare.regress import main

    base = _base(tmp_path)
    # without --select the reference run of the baseline is missing from the new file
    assert main([_new(tmp_path), "--baseline", base]) == 1
    out = capsys.readouterr().out
    miss = [line for line in out.splitlines() if "MISSING" in line]
    assert len(miss) == 1 and miss[0].startswith("| megamoe-reference |") and "(1 missing)" in out
    assert main([_new(tmp_path, drop=("torchtitan-baseline",)), "--baseline", base, *SEL]) == 1
    assert "| torchtitan-baseline | - | ok | absent | - | MISSING |" in capsys.readouterr().out
    # a failed run
    new = json.loads(Path(_new(tmp_path)).read_text())
    new["runs"][0].update(status="error", reason="exit code 1", summary=None, steps=[])
    (tmp_path / "err.json").write_text(json.dumps(new))
    assert main([str(tmp_path / "err.json"), "--baseline", base, *SEL]) == 1
    assert "| megamoe-triton | status | ok | error: exit code 1 | - | NOT OK |" in capsys.readouterr().out
    # another config under the same label, or other compare.train options: not comparable
    new = json.loads(Path(_new(tmp_path)).read_text())
    new["runs"][0]["toml"]["megamoe"]["backend"] = "reference"
    new["runs"][0]["toml"]["training"] = {"steps": 100}  # the step count is compare.train's --steps
    (tmp_path / "cfg.json").write_text(json.dumps(new))
    assert main([str(tmp_path / "cfg.json"), "--baseline", base, *SEL]) == 1
    out = capsys.readouterr().out
    assert "megamoe.backend: 'triton' -> 'reference' | - | CONFIG CHANGED |" in out and "training" not in out
    assert main([_new(tmp_path, seed=43), "--baseline", base, *SEL]) == 1
    assert "--seed: 42 -> 43" in capsys.readouterr().out
    # 100 steps with TorchTitan's default LR schedule (decay over 100 steps) vs the baseline's 200
    assert main([_new(tmp_path, extra=""), "--baseline", base, *SEL]) == 1
    out = capsys.readouterr().out
    assert "LR schedule length (--lr_scheduler.total_steps, default --steps): 200 -> 100" in out
    assert "CONFIG CHANGED" in out
    assert main([_new(tmp_path, extra="--lr_scheduler.total_steps=200"), "--baseline", base, *SEL]) == 0
    assert main([_new(tmp_path, extra="--lr_scheduler.total_steps 200 --foo 1"), "--baseline", base, *SEL]) == 1
    assert "--extra: '' -> '--foo 1'" in capsys.readouterr().out
    # a run only in the new file is listed, not a failure
    new = json.loads(Path(_new(tmp_path)).read_text())
    new["runs"].append(_run("extra", 100, _tps_stock, _loss))
    (tmp_path / "more.json").write_text(json.dumps(new))
    assert main([str(tmp_path / "more.json"), "--baseline", base, "--select", "label=megamoe-triton"]) == 0
    assert main([str(tmp_path / "more.json"), "--baseline", base, *SEL]) == 0
    capsys.readouterr()


def test_regress_train_bad_arguments(tmp_path, capsys):
    from compare.records import SCHEMA as LAYER_SCHEMA
    from compare.regress import main

    base = _base(tmp_path)
    layer = tmp_path / "layer.json"
    layer.write_text(json.dumps({"schema": LAYER_SCHEMA, "run": {}, "records": []}))
    for args, msg in (([_new(tmp_path), "--baseline", str(layer)], "is a compare.train file but"),
                      ([_new(tmp_path), "--baseline", base, "--metrics", "fwd_ms"], "unknown metric 'fwd_ms'"),
                      ([_new(tmp_path), "--baseline", base, "--select", "shape=x"], "unknown field 'shape'"),
                      ([_new(tmp_path), "--baseline", base, "--select", "label"], "expected FIELD=V1,V2"),
                      ([_new(tmp_path), "--baseline", base, "--select", "label=nope"], "nothing to compare"),
                      ([_new(tmp_path), "--baseline", base, "--loss-tolerance", "-1"], "must be >= 0"),
                      ([str(tmp_path / "absent.json"), "--baseline", base], "cannot read results JSON")):
        with pytest.raises(SystemExit) as exc:
            main(args)
        assert exc.value.code == 2
        assert msg in capsys.readouterr().err


def _late_noise(s):
    """Run-to-run noise as measured: ~1e-4 over the first 15 steps, then growing chaotically."""
    return (1e-4 if s % 2 else -1e-4) if s <= 15 else 0.004 * (s - 15) ** 0.8 * (1 if s % 3 else -1)


def test_regress_train_early_loss_passes_when_only_late_steps_differ(tmp_path, capsys):
    from compare.regress import main

    base = _base(tmp_path)
    new = json.loads(Path(_new(tmp_path)).read_text())
    for r in new["runs"]:
        for row in r["steps"]:
            row["loss"] = _loss(row["step"]) + _late_noise(row["step"])
    (tmp_path / "late.json").write_text(json.dumps(new))
    # late per-step differences of up to ~0.14 (step 100) do not fail: the early steps agree to 1e-4
    assert main([str(tmp_path / "late.json"), "--baseline", base, "--loss-tolerance", "0.25", *SEL]) == 0
    out = capsys.readouterr().out
    assert "| megamoe-triton | early loss (steps 1-15), worst step 1 | 7.98000 | 7.98010 | +1.00e-04 | ok |" in out
    assert "early loss (steps 1-15) +-0.002 per step, final loss +-0.25" in out and "PASS" in out
    # the early window is an option: at 25 steps the divergence is inside it
    assert main([str(tmp_path / "late.json"), "--baseline", base, "--loss-tolerance", "0.25",
                 "--early-steps", "25", *SEL]) == 1
    assert "EARLY LOSS CHANGED (10 of 25 steps beyond 0.002)" in capsys.readouterr().out


def test_regress_train_early_loss_fails_on_one_early_step(tmp_path, capsys):
    from compare.regress import compare_early_losses, main

    base = _base(tmp_path)
    new = json.loads(Path(_new(tmp_path)).read_text())
    new["runs"][0]["steps"][2]["loss"] += 0.01  # step 3 of megamoe-triton; its final-window loss is unchanged
    (tmp_path / "step3.json").write_text(json.dumps(new))
    assert main([str(tmp_path / "step3.json"), "--baseline", base, *SEL]) == 1
    out = capsys.readouterr().out
    bad = [line for line in out.splitlines() if "EARLY LOSS CHANGED" in line]
    assert bad == ["| megamoe-triton | early loss (steps 1-15), worst step 3 | 7.94000 | 7.95000 | +1.00e-02 "
                   "| EARLY LOSS CHANGED (1 of 15 steps beyond 0.002) |"]
    assert "| megamoe-triton | mean loss (steps 91-100) | 6.0900 | 6.0900 | +0.0000 | ok |" in out
    assert "FAIL: 1 regression(s)" in out
    # a looser per-step tolerance, or leaving the check out, passes
    assert main([str(tmp_path / "step3.json"), "--baseline", base, "--early-loss-tolerance", "0.02", *SEL]) == 0
    assert "worst step 3 | 7.94000 | 7.95000 | +1.00e-02 | ok |" in capsys.readouterr().out
    assert main([str(tmp_path / "step3.json"), "--baseline", base, "--metrics", "tps,loss,speedup", *SEL]) == 0
    assert "| early loss" not in capsys.readouterr().out
    # a NaN in the early steps is the worst step
    new["runs"][0]["steps"][4]["loss"] = float("nan")
    (tmp_path / "nan.json").write_text(json.dumps(new))
    assert main([str(tmp_path / "nan.json"), "--baseline", base, *SEL]) == 1
    assert "worst step 5 | 7.90000 | nan | +nan | EARLY LOSS CHANGED (2 of 15 steps" in capsys.readouterr().out
    # the docstring's example
    row, failed = compare_early_losses(
        {"steps": [{"step": s, "loss": v} for s, v in ((1, 8.10), (2, 7.90), (3, 7.71))]},
        {"label": "x", "steps": [{"step": s, "loss": v} for s, v in ((1, 8.10), (2, 7.90), (3, 7.70))]}, 3, 2e-3)
    assert failed and row[1] == "early loss (steps 1-3), worst step 3" and row[4] == "+1.00e-02"
    assert row[5] == "EARLY LOSS CHANGED (1 of 3 steps beyond 0.002)"


def test_regress_train_early_loss_missing_steps(tmp_path, capsys):
    from compare.regress import compare_early_losses, main

    base = _base(tmp_path)
    # a 10-step run: steps 11-15 of the baseline are absent
    new = json.loads(Path(_new(tmp_path)).read_text())
    for r in new["runs"]:
        r["steps"] = r["steps"][:10]
    (tmp_path / "short.json").write_text(json.dumps(new))
    assert main([str(tmp_path / "short.json"), "--baseline", base, "--metrics", "early_loss", *SEL]) == 1
    out = capsys.readouterr().out
    assert ("EARLY LOSS NOT COMPARABLE (steps 11-15 of the baseline are missing from the new run, which logged "
            "steps 1-10; run at least 15 steps or lower --early-steps)") in out
    assert main([str(tmp_path / "short.json"), "--baseline", base, "--metrics", "early_loss",
                 "--early-steps", "10", *SEL]) == 0
    assert "early loss (steps 1-10), worst step 1" in capsys.readouterr().out
    # a hole in the new run's steps
    new = json.loads(Path(_new(tmp_path)).read_text())
    del new["runs"][1]["steps"][6]  # step 7 of torchtitan-baseline
    (tmp_path / "hole.json").write_text(json.dumps(new))
    assert main([str(tmp_path / "hole.json"), "--baseline", base, *SEL]) == 1
    bad = [line for line in capsys.readouterr().out.splitlines() if "NOT COMPARABLE" in line]
    assert len(bad) == 1 and bad[0].startswith("| torchtitan-baseline |")
    assert "steps 7 of the baseline are missing from the new run, which logged steps 1-6, 8-15" in bad[0]
    # a baseline without per-step losses (summary only)
    old = json.loads(Path(base).read_text())
    for r in old["runs"]:
        r["steps"] = []
    (tmp_path / "summ.json").write_text(json.dumps(old))
    assert main([_new(tmp_path), "--baseline", str(tmp_path / "summ.json"), "--metrics", "early_loss", *SEL]) == 1
    assert "the baseline has no per-step loss in steps 1-15" in capsys.readouterr().out
    # steps that neither run logged (metrics.log_freq > 1) are not asked for
    sparse = [{"step": s, "loss": _loss(s)} for s in (1, 5, 10, 15, 20)]
    row, failed = compare_early_losses({"steps": sparse}, {"label": "x", "steps": sparse})
    assert not failed and row[1] == "early loss (steps 1, 5, 10, 15), worst step 1"
    # bad values of the options
    for args, msg in ((["--early-steps", "0"], "--early-steps: must be >= 1"),
                      (["--early-loss-tolerance", "-1"], "--early-loss-tolerance: must be >= 0")):
        with pytest.raises(SystemExit) as exc:
            main([_new(tmp_path), "--baseline", base, *args])
        assert exc.value.code == 2 and msg in capsys.readouterr().err


def test_regress_train_end_to_end(tmp_path, fake):
    """compare.train output (fake launcher) against itself and against a slower copy, as gpu_ci.sh runs it."""
    out = tmp_path / "ci.json"
    assert _main(["--configs", CFG_B, CFG_A, "--labels", "megamoe", "stock", "--steps", 20, "--skip", 3,
                  "--out", out, "--launcher", fake, "--extra", "--lr_scheduler.total_steps 40"]) == 0
    rec = json.loads(out.read_text())
    assert rec["runs"][0]["toml"]["compile"] == {"enable": False, "components": ["model", "loss"]}
    assert rec["runs"][0]["toml"]["activation_checkpoint"]["mode"] == "none"
    res = subprocess.run([sys.executable, "-m", "compare.regress", str(out), "--baseline", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "| megamoe | speedup vs stock |" in res.stdout
    for r in rec["runs"]:
        if r["label"] == "megamoe":
            for row in r["steps"]:
                row["tps"] = int(row["tps"] * 0.8)
    slow = tmp_path / "slow.json"
    slow.write_text(json.dumps(rec))
    res = subprocess.run([sys.executable, "-m", "compare.regress", str(slow), "--baseline", str(out),
                          "--tolerance", "0.1"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert res.returncode == 1 and "REGRESSED" in res.stdout


# ----------------------------------------------------------------------------- scripts/gpu_ci.sh wiring
# The script runs on a GPU; here PYTHON is a fake interpreter that answers compare.layer and
# compare.train from the committed baseline files (filtered by the options the script passes, so
# wrong shapes / impls / labels / steps show up as MISSING or CONFIG CHANGED) and runs the real
# compare.regress.

FAKE_PY = textwrap.dedent('''
    import json, os, subprocess, sys
    args = sys.argv[1:]
    if args[0] != "-m" or args[1] not in ("compare.layer", "compare.train", "compare.regress"):
        sys.exit(subprocess.call([sys.executable, *args]))
    mod, rest = args[1], args[2:]
    def opt(name, n=1):
        i = rest.index(name)
        return rest[i + 1] if n == 1 else rest[i + 1:i + 1 + n]
    slow = float(os.environ.get("FAKE_SLOW", "1"))
    if mod == "compare.regress":
        sys.exit(subprocess.call([sys.executable, "-m", "compare.regress", *rest]))
    if mod == "compare.layer":
        d = json.load(open("benchmarks/results/layer_1xh200_ep1_triton_gmm_wgrad_20261130.json"))
        impls, shapes = opt("--impls").split(","), opt("--shapes").split(",")
        assert opt("--precisions") == "bf16" and opt("--routings") == "random", rest
        d["records"] = [r for r in d["records"] if r["implementation"] in impls and r["shape"]["name"] in shapes]
        for r in d["records"]:
            if r["implementation"] == "megamoe-triton":
                r["fwd_ms"] *= slow; r["fwdbwd_ms"] *= slow
                for v in r["speedup_vs"].values():
                    v["fwdbwd"] /= slow
        json.dump(d, open(opt("--out"), "w"))
    elif mod == "compare.train":
        if os.environ.get("FAKE_NO_TRAIN"):
            sys.exit(1)
        d = json.load(open("benchmarks/results/train_debug_1xh200_triton_20261130.json"))
        steps = int(opt("--steps"))
        configs = rest[rest.index("--configs") + 1:rest.index("--labels")]
        labels = opt("--labels", len(configs))
        by_config = {r["config"]: r for r in d["runs"]}
        runs = []
        for config, label in zip(configs, labels):
            r = dict(by_config[config], label=label, steps=by_config[config]["steps"][:steps])
            if label == "megamoe-triton":
                r["steps"] = [dict(s, tps=int(s["tps"] / slow)) for s in r["steps"]]
            runs.append(r)
        d["runs"] = runs
        d["run"]["options"].update(steps=steps, skip=int(opt("--skip")), ngpu=int(opt("--ngpu")), extra=opt("--extra"))
        json.dump(d, open(opt("--out"), "w"))
''')


def _gpu_ci(tmp_path, **env):
    fake_py = tmp_path / "fake_python.py"
    fake_py.write_text(FAKE_PY)
    wrapper = tmp_path / "python"
    wrapper.write_text(f"#!/bin/sh\nexec {sys.executable} {fake_py} \"$@\"\n")
    wrapper.chmod(0o755)
    out = tmp_path / "out"
    e = dict(os.environ, PYTHON=str(wrapper), OUT=str(out), GPU_CI_ENV="plain", REV="abc1234", **env)
    res = subprocess.run(["bash", "scripts/gpu_ci.sh"], cwd=ROOT, env=e, capture_output=True, text=True, timeout=300)
    return res, out


def test_gpu_ci_script_wiring(tmp_path):
    res, out = _gpu_ci(tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    layer = (out / "regress_layer.txt").read_text()
    train = (out / "regress_train.txt").read_text()
    assert "PASS" in layer and "megamoe-triton/bf16 qwen3-30b-a3b random ep=1" in layer and "235b" not in layer
    assert "speedup vs tt-compile/bf16 | 1.721x | 1.721x" in layer  # gpu_ci's default layer baseline
    assert "PASS" in train and "(steps 11-100)" in train and "speedup vs torchtitan-baseline" in train
    assert "early loss (steps 1-15) +-0.002 per step, final loss +-0.25" in train
    assert "| megamoe-triton | early loss (steps 1-15), worst step 1 |" in train
    assert "megamoe-reference" not in train and "[gpu_ci] PASS" in res.stdout
    # a CI result is a valid baseline for the next run (same LR schedule, labels and records)
    rec = json.loads((out / "train_ci.json").read_text())
    assert rec["run"]["options"]["extra"] == "--lr_scheduler.total_steps 200"
    (tmp_path / "prev").mkdir()
    for f in ("layer_ci.json", "train_ci.json"):
        (tmp_path / "prev" / f).write_text((out / f).read_text())
    res, out = _gpu_ci(tmp_path, LAYER_BASELINE=str(tmp_path / "prev" / "layer_ci.json"),
                       TRAIN_BASELINE=str(tmp_path / "prev" / "train_ci.json"))
    assert res.returncode == 0, res.stdout + res.stderr
    assert str(tmp_path / "prev" / "train_ci.json") in (out / "regress_train.txt").read_text()


def test_gpu_ci_script_takes_the_baselines_of_its_gpu(tmp_path):
    """The default baselines follow the GPU's name: an H100 gets the committed H100 results (times do not carry
    across GPU models), anything else the H200 ones; a baseline given in the environment wins."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'NVIDIA H100 80GB HBM3'\n")
    smi.chmod(0o755)
    path = f"{bin_dir}{os.pathsep}{os.environ['PATH']}"
    res, out = _gpu_ci(tmp_path, PATH=path)
    assert "[gpu_ci] GPU NVIDIA H100 80GB HBM3; baselines benchmarks/results/gpu_ci_layer_1xh100_s33c" in res.stdout
    assert "baseline: benchmarks/results/gpu_ci_train_1xh100_s33c_20261207.json (NVIDIA H100 80GB HBM3" in (
        out / "regress_train.txt").read_text()
    smi.write_text("#!/bin/sh\necho 'NVIDIA H200'\n")
    res, out = _gpu_ci(tmp_path, PATH=path)
    assert "baselines benchmarks/results/layer_1xh200_ep1_triton_gmm_wgrad_20261130.json" in res.stdout
    res, out = _gpu_ci(tmp_path, PATH=path, TRAIN_BASELINE="benchmarks/results/gpu_ci_train_1xh100_s33c_20261207.json")
    assert "benchmarks/results/train_debug_1xh200" not in res.stdout and "gpu_ci_train_1xh100" in res.stdout


def test_gpu_ci_script_fails_on_regression(tmp_path):
    res, out = _gpu_ci(tmp_path, FAKE_SLOW="1.2")
    assert res.returncode == 1, res.stdout + res.stderr
    assert "REGRESSED" in (out / "regress_layer.txt").read_text()
    assert "REGRESSED" in (out / "regress_train.txt").read_text()
    assert "[gpu_ci] FAIL (exit 1)" in res.stdout


def test_gpu_ci_script_missing_result(tmp_path):
    res, out = _gpu_ci(tmp_path, FAKE_NO_TRAIN="1")
    assert res.returncode == 2, res.stdout + res.stderr
    assert "train_ci.json was not written" in res.stdout and (out / "regress_layer.txt").is_file()


def test_failed_run_message_keeps_a_launcher_error_whole():
    """The table's message of a failed run: the log's last line, whole up to 600 characters (the launcher's GPU
    message is ~420), marked with "..." where cut."""
    from compare.train import _last_line

    msg = "error: --ngpu 2 but this machine has 0 CUDA GPU(s) visible: " + "x" * 360
    assert _last_line(f"starting\n{msg}\n\n") == msg
    long = "y" * 700
    assert _last_line(long) == "y" * 597 + "..." and _last_line("") == "(empty log)"
