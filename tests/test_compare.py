"""compare/ harness on CPU: compare.layer --tiny (in process and as a 2-rank gloo EP run), option
validation, compare.regress on crafted records, capture_topk on a tiny Qwen3 MoE model."""

from __future__ import annotations

import copy
import json
import math
import os

import pytest
import torch

from compare import flops, timing
from compare.records import SCHEMA, new_record
from titan_megamoe.testing import run_gloo

SHAPE = "custom:64,32,8,2"  # D=64, F=32, E=8, K=2: small enough for CPU bf16 in well under a second
RECORD_FIELDS = {
    "implementation", "precision", "shape", "routing", "ep", "tokens_per_rank", "fwd_ms", "bwd_ms",
    "fwdbwd_ms", "fwd_p20_ms", "fwd_p80_ms", "fwdbwd_p20_ms", "fwdbwd_p80_ms", "peak_gib", "tflops",
    "floor_ms", "floor_ratio", "speedup_vs", "status", "reason", "routing_note", "host_fwd_ms", "host_fwdbwd_ms",
    "fwd_device_ms", "bwd_device_ms", "fwdbwd_device_ms", "device_time_head_start_ms",
    "fwd_cool_ms", "bwd_cool_ms", "fwdbwd_cool_ms", "cooldown_ms", "power",
}
RUN_FIELDS = {"gpu", "torch", "triton", "torchtitan", "git_rev", "git_dirty", "date_utc", "command",
              "hostnames", "gemm_rates_tflops"}


def _replay_file(path, T=50, E=16, K=2, seed=0):
    """A capture_routing-style file: distinct ids per token among E=16 experts (shape has 8)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]).to(torch.int16)
    torch.save({"layers.0.moe": ids, "num_experts": E, "top_k": K, "tokens": T, "source": "crafted"}, path)
    return path


def test_tiny_run_all_routings(tmp_path, capsys):
    from compare.layer import main

    replay = _replay_file(tmp_path / "ids.pt")
    out = tmp_path / "layer.json"
    rc = main(["--tiny", "--out", str(out), "--routings", f"random,skewed,replay:{replay}",
               "--precisions", "bf16,fp8,fp8_bwd"])
    assert rc == 0
    stdout = capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["schema"] == SCHEMA
    run = data["run"]
    assert RUN_FIELDS <= set(run), RUN_FIELDS - set(run)
    assert run["torchtitan"] == "0.2.2" and run["world_size"] == 1 and run["device_type"] == "cpu"
    assert run["command"].startswith("python -m compare.layer --tiny")
    assert run["gemm_rates_tflops"]["bf16"] > 0

    recs = data["records"]
    # 3 routings x 3 impls (tt-eager, megamoe-reference, megamoe-triton) x 3 precisions
    assert len(recs) == 27
    for r in recs:
        assert RECORD_FIELDS <= set(r), RECORD_FIELDS - set(r)
        assert r["shape"] == {"name": SHAPE, "dim": 64, "hidden": 32, "experts": 8, "top_k": 2}
        assert r["ep"] == 1 and r["tokens_per_rank"] == 64
    by = {(r["routing"], r["implementation"], r["precision"]): r for r in recs}
    for routing in ("random", "skewed", "replay"):
        for impl in ("tt-eager", "megamoe-reference"):
            r = by[(routing, impl, "bf16")]
            assert r["status"] == "ok", r["reason"]
            assert r["reason"] is None
            for p in ("fwd", "bwd", "fwdbwd"):
                assert r[f"{p}_ms"] > 0
                assert r[f"{p}_p20_ms"] <= r[f"{p}_ms"] <= r[f"{p}_p80_ms"]
            assert r["fwdbwd_ms"] >= r["fwd_ms"]
            assert r["flops"]["fwd"] == 2 * 64 * 2 * 64 * 32 * 3
            assert r["tflops"] > 0 and r["floor_ms"] > 0 and r["floor_ratio"] > 0
            assert r["peak_gib"] is None  # CPU: no device memory counter
            assert r["load_imbalance"] >= 1.0
        ref = by[(routing, "megamoe-reference", "bf16")]
        stock = by[(routing, "tt-eager", "bf16")]
        # megamoe rows record the kernels one more step launched, stock rows none. The reference backend launches
        # only the fused router's two (interpreted here), and a fixed routing replaces the router: none at all
        router = {"_topk_route_kernel", "_topk_route_bwd_kernel"} if routing == "random" else set()
        assert set(ref["kernel_configs"]) == router, (routing, ref["kernel_configs"])
        assert stock["kernel_configs"] is None
        sp = ref["speedup_vs"]["tt-eager/bf16"]["fwdbwd"]
        assert sp == pytest.approx(stock["fwdbwd_ms"] / ref["fwdbwd_ms"])
        # every combination that cannot run is recorded with its reason
        assert by[(routing, "megamoe-triton", "bf16")]["status"] == "skipped"
        assert "needs a CUDA GPU" in by[(routing, "megamoe-triton", "bf16")]["reason"]
        assert "needs a CUDA GPU" in by[(routing, "megamoe-triton", "fp8")]["reason"]
        assert "CUDA" in by[(routing, "tt-eager", "fp8")]["reason"]
        assert "megamoe" in by[(routing, "tt-eager", "fp8_bwd")]["reason"]
        assert by[(routing, "megamoe-reference", "fp8")]["status"] == "skipped"
    rep = by[("replay", "megamoe-reference", "bf16")]
    assert "16 experts mapped to 8 by id % 8" in rep["routing_note"]
    assert rep["routing_detail"]["captured_tokens"] == 50 and rep["routing_detail"]["tiled"] is True
    assert by[("random", "tt-eager", "bf16")]["routing_note"] is None
    # skewed (Zipf 1.2 over 8 experts) is visibly less balanced than its floor of 1.0
    assert by[("skewed", "tt-eager", "bf16")]["load_imbalance"] > 1.3

    assert "| shape | routing |" in stdout and "megamoe-reference" in stdout
    assert "skipped: titan_megamoe.config.AVAILABLE" in stdout
    png = out.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def _bad_replay(tmp_path):
    return _replay_file(tmp_path / "k3.pt", K=3)


INVALID = [
    # (argv, words the message must contain): the option and the allowed values
    (["--shapes", "qwen3-7b"], ["--shapes", "qwen3-30b-a3b", "custom:DIM,HIDDEN,EXPERTS,TOPK"]),
    (["--shapes", "custom:64,32"], ["--shapes", "custom:DIM,HIDDEN,EXPERTS,TOPK"]),
    (["--shapes", "custom:64,32,4,8"], ["--shapes", "top_k=8 > experts=4"]),
    (["--impls", "tt-fast"], ["--impls", "tt-eager", "megamoe-triton"]),
    (["--precisions", "fp4"], ["--precisions", "bf16", "fp8_bwd"]),
    (["--routings", "zipf"], ["--routings", "random, skewed, replay:PATH"]),
    (["--tokens", "0"], ["--tokens", "> 0"]),
    (["--routings", "replay:/nonexistent/ids.pt"], ["--routings", "does not exist"]),
    (["--iters", "0"], ["--iters", ">= 1"]),
    (["--switches", "COMBINE_DTYPE=fp32"], ["--switches", "cannot be flipped inside a process", "FUSED_ROUTER"]),
    (["--switches", "FUSED_ROUTER=2"], ["--switches", "expected one of 0, 1"]),
    (["--switches", "FUSED_ROUTER"], ["--switches", "NAME=VALUE"]),
    (["--gc", "off"], ["--gc", "titan", "python"]),
    (["--power-sampler", "nvidia-smi"], ["--power-sampler", "process", "thread", "off"]),
]


@pytest.mark.parametrize("argv,words", INVALID, ids=[" ".join(a) for a, _ in INVALID])
def test_invalid_options_exit_2(argv, words, capsys):
    from compare.layer import main

    with pytest.raises(SystemExit) as exc:
        main(["--tiny", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    for w in words:
        assert w in err, (w, err)


def test_replay_topk_mismatch_and_ep_divisibility_exit_2(tmp_path, capsys, monkeypatch):
    from compare.layer import main

    path = _bad_replay(tmp_path)
    with pytest.raises(SystemExit) as exc:
        main(["--tiny", "--routings", f"replay:{path}"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--routings" in err and "top_k=3" in err and "top_k=2" in err
    monkeypatch.setenv("WORLD_SIZE", "3")  # 8 experts over 3 ranks
    with pytest.raises(SystemExit) as exc:
        main(["--tiny"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--shapes" in err and "not divisible by the EP size 3" in err


# ---------------------------------------------------------------------------------------- regress

def _rec(impl, fwd, fwdbwd, routing="random", speedup=None):
    r = new_record(implementation=impl, family="stock" if impl.startswith("tt") else "megamoe",
                   backend=None, compile=False, precision="bf16", dtype="bfloat16",
                   shape={"name": "qwen3-30b-a3b", "dim": 2048, "hidden": 768, "experts": 128, "top_k": 8},
                   routing=routing, routing_detail={}, ep=2, tokens_per_rank=16384, iters=20, warmup=5)
    r.update(status="ok", fwd_ms=fwd, fwdbwd_ms=fwdbwd, bwd_ms=fwdbwd - fwd)
    if speedup is not None:
        r["speedup_vs"] = {"tt-eager/bf16": {"fwd": None, "bwd": None, "fwdbwd": speedup}}
    return r


def _write(path, records):
    path.write_text(json.dumps({"schema": SCHEMA, "run": {"gpu": "NVIDIA H200"}, "records": records}))
    return str(path)


def test_regress_pass_fail_missing(tmp_path, capsys):
    from compare.regress import main

    base = [_rec("tt-eager", 10.0, 24.0), _rec("megamoe-reference", 8.0, 20.0, speedup=1.2),
            _rec("tt-eager", 12.0, 30.0, routing="skewed")]
    old = _write(tmp_path / "old.json", base)

    within = copy.deepcopy(base)
    within[0]["fwd_ms"] = 10.4  # +4 % < 5 %
    within[1]["fwdbwd_ms"] = 19.0  # faster
    within[1]["speedup_vs"]["tt-eager/bf16"]["fwdbwd"] = 1.25
    assert main([_write(tmp_path / "a.json", within), "--baseline", old]) == 0
    out = capsys.readouterr().out
    assert "PASS" in out and "+4.0%" in out and "faster" in out

    slower = copy.deepcopy(base)
    slower[1]["fwdbwd_ms"] = 22.0  # +10 % > 5 %
    assert main([_write(tmp_path / "b.json", slower), "--baseline", old, "--tolerance", "0.05"]) == 1
    out = capsys.readouterr().out
    bad = [line for line in out.splitlines() if "REGRESSED" in line]
    assert len(bad) == 1 and "megamoe-reference/bf16 qwen3-30b-a3b random ep=2 T=16384" in bad[0]
    assert "fwdbwd_ms" in bad[0] and "+10.0%" in bad[0]
    # the same slow-down passes with a looser tolerance
    assert main([_write(tmp_path / "b2.json", slower), "--baseline", old, "--tolerance", "0.15"]) == 0
    capsys.readouterr()

    speed = copy.deepcopy(base)
    speed[1]["speedup_vs"]["tt-eager/bf16"]["fwdbwd"] = 1.0  # 1.2x -> 1.0x: stock caught up
    assert main([_write(tmp_path / "s.json", speed), "--baseline", old]) == 1
    assert "speedup vs tt-eager/bf16" in capsys.readouterr().out

    missing = copy.deepcopy(base[:2])
    assert main([_write(tmp_path / "c.json", missing), "--baseline", old]) == 1
    out = capsys.readouterr().out
    miss = [line for line in out.splitlines() if "MISSING" in line]
    assert len(miss) == 1 and "tt-eager/bf16 qwen3-30b-a3b skewed" in miss[0]
    assert "1 missing" in out

    notok = copy.deepcopy(base)
    notok[2].update(status="error", reason="OutOfMemoryError")
    assert main([_write(tmp_path / "d.json", notok), "--baseline", old]) == 1
    assert "NOT OK" in capsys.readouterr().out

    with pytest.raises(SystemExit) as exc:
        main([str(tmp_path / "nope.json"), "--baseline", old])
    assert exc.value.code == 2


# ----------------------------------------------------------------------------- flops and timing

def test_flop_model_and_percentiles():
    f = flops.phase_flops(16384, 8, 2048, 768)
    assert f["fwd"] == 2 * 16384 * 8 * 2048 * 768 * 3 and f["fwdbwd"] == 3 * f["fwd"]
    # DESIGN.md section 5: the 30B layer's fwd+bwd floor at 760 TF/s is 4.9 ms
    assert flops.floor_ms(f["fwd"], f["bwd"], 760.0, 760.0)["fwdbwd"] == pytest.approx(4.88, abs=0.01)
    q = timing.percentiles([5.0, 1.0, 3.0, 2.0, 4.0])
    assert q == {"median": 3.0, "p20": pytest.approx(1.8), "p80": pytest.approx(4.2)}
    assert timing.max_over_ranks([[1.0, 5.0], [2.0, 3.0]]) == [2.0, 5.0]


def test_host_enqueue_times_and_device_time_option(tmp_path, capsys):
    """Every record carries the host's enqueue times; --device-time adds the device-only pass on CUDA
    (on CPU there is no device to run ahead of: the fields stay null) and its table."""
    from compare.layer import main

    calls = []

    def fwd():
        calls.append("f")
        return torch.ones(3, requires_grad=True) * 2

    s = timing.time_fwd_bwd(fwd, lambda y: y.sum().backward(), device=torch.device("cpu"), iters=4, warmup=1,
                            head_start_ms=5.0)
    assert len(calls) == 5 and all(len(s[k]) == 4 for k in ("fwd", "bwd", "fwdbwd", "host_fwd", "host_fwdbwd"))
    assert all(0 < a <= b for a, b in zip(s["host_fwd"], s["host_fwdbwd"]))
    out = tmp_path / "layer.json"
    assert main(["--tiny", "--out", str(out), "--routings", "random", "--impls", "tt-eager,megamoe-reference",
                 "--precisions", "bf16", "--device-time", "--no-plot"]) == 0
    stdout = capsys.readouterr().out
    assert "| fwd device ms |" in stdout
    recs = json.loads(out.read_text())["records"]
    assert len(recs) == 2
    for r in recs:
        assert r["status"] == "ok" and 0 < r["host_fwd_ms"] <= r["host_fwdbwd_ms"]
        assert r["fwd_device_ms"] is None and r["fwdbwd_device_ms"] is None  # CPU


def test_cooldown_pass_sleeps_and_fills_cool_fields_and_power_table():
    """--cooldown-ms: time_fwd_bwd sleeps before every timed step (not inside it); the cool pass and the
    per-pass NVML summaries land in the record (max over ranks of the per-step times) and power_table."""
    import time as _time

    from compare.layer import _fill_measurements
    from compare.records import device_time_table, power_table

    t = _time.perf_counter()
    s = timing.time_fwd_bwd(lambda: torch.ones(3, requires_grad=True) * 2, lambda y: y.sum().backward(),
                            device=torch.device("cpu"), iters=3, warmup=0, cooldown_ms=60.0)
    assert _time.perf_counter() - t >= 3 * 0.06
    assert max(s["fwdbwd"]) < 50.0  # the sleep is outside the timed step

    def result(scale, cool_scale, mhz):
        steps = {k: [v * scale for v in (1.0, 2.0, 3.0)] for k in ("fwd", "bwd", "fwdbwd", "host_fwd", "host_fwdbwd")}
        cool = {k: [v * cool_scale for v in (1.0, 2.0, 3.0)] for k in ("fwd", "bwd", "fwdbwd")}
        pw = {"idle": {"samples": 5, "sm_mhz_median": mhz, "sm_mhz_min": mhz - 200, "power_w_median": 699.0,
                       "power_w_max": 702.0, "temp_c_max": 60.0, "reasons": ["sw_power_cap"]}, "cool": None}
        return {"status": "ok", "samples": steps, "peak": 1.0, "counts": [4.0, 4.0], "notes": [],
                "device_samples": None, "cool_samples": cool, "power": pw}

    rec = new_record(implementation="megamoe-triton", family="megamoe", backend="triton", compile=False,
                     precision="bf16", dtype="bfloat16", shape={"name": "s", "dim": 64, "hidden": 32, "experts": 2,
                                                                "top_k": 1}, routing="random", routing_detail={},
                     ep=2, tokens_per_rank=8, iters=3, warmup=0)
    _fill_measurements(rec, [result(1.0, 0.5, 1515.0), result(2.0, 0.25, 1600.0)], SimpleShape(), 8,
                       {"bf16": 100.0}, cooldown_ms=40.0)
    assert rec["status"] == "ok" and rec["fwdbwd_ms"] == 4.0 and rec["fwdbwd_cool_ms"] == 1.0
    assert rec["cooldown_ms"] == 40.0 and [p["idle"]["sm_mhz_median"] for p in rec["power"]] == [1515.0, 1600.0]
    table = power_table([rec])
    assert "| s | megamoe-triton | bf16 | idle | 1515 [1315] | 699 [702] | 60 | sw_power_cap |" in table
    assert "| cool |" not in table  # a pass without samples has no row
    assert "| s | 2 | megamoe-triton | bf16 | 4 | - | 1 | 4 | - | 1 | 4 | 4 |" in device_time_table([rec])


class SimpleShape:
    dim, hidden, top_k = 64, 32, 1


@pytest.mark.parametrize("gc_off", [True, False])
def test_time_fwd_bwd_gc_off_disables_collection_inside_the_pass_only(gc_off):
    """gc_off: automatic collection is off in every warm-up and timed step (as TorchTitan's trainer runs
    steps) and back on after the pass, also when a step raises; without it, collection stays on."""
    import gc

    assert gc.isenabled()
    seen = []

    def fwd():
        seen.append(gc.isenabled())
        return torch.ones(3, requires_grad=True) * 2

    timing.time_fwd_bwd(fwd, lambda y: y.sum().backward(), device=torch.device("cpu"), iters=3, warmup=2,
                        gc_off=gc_off)
    assert seen == [not gc_off] * 5 and gc.isenabled()

    def failing():
        raise RuntimeError("step failed")

    with pytest.raises(RuntimeError, match="step failed"):
        timing.time_fwd_bwd(failing, lambda y: None, device=torch.device("cpu"), iters=1, warmup=0, gc_off=gc_off)
    assert gc.isenabled()


def test_layer_records_gc_and_power_sampler_choice(tmp_path):
    """--gc / --power-sampler reach the plan and the run's provenance (default: gc off while timing)."""
    from compare.layer import main, parse_options

    _, plan = parse_options(["--tiny"])
    assert plan.gc_off is True and plan.power_sampler == "process"
    _, plan = parse_options(["--tiny", "--gc", "python", "--power-sampler", "thread"])
    assert plan.gc_off is False and plan.power_sampler == "thread"
    out = tmp_path / "layer.json"
    assert main(["--tiny", "--out", str(out), "--routings", "random", "--impls", "megamoe-reference",
                 "--precisions", "bf16", "--no-plot", "--gc", "python"]) == 0
    run = json.loads(out.read_text())["run"]
    assert run["gc_during_timing"] == "python default (automatic)"


@pytest.mark.parametrize("per_step", [False, True])
def test_fp8_weights_per_step_drops_the_weight_cache_before_every_step(tmp_path, monkeypatch, per_step):
    """--fp8-weights-per-step: each step of a megamoe row starts with its layer's FP8 weight copies dropped (as
    MegaMoEConverter.post_optimizer_hook does after an optimizer step), so the weight quantization is timed; the
    run's provenance says which. On the CPU machine the reference backend's layer stands in, given a cache."""
    import compare.layer as cl
    from titan_megamoe.ops.fp8_backend import Fp8WeightCache

    dropped = []

    class Cache(Fp8WeightCache):
        def invalidate(self):
            dropped.append(1)
            super().invalidate()

    real = cl.build_layer

    def build(*a, **kw):
        built = real(*a, **kw)
        built.module.experts.fp8_cache = Cache()
        return built

    monkeypatch.setattr(cl, "build_layer", build)
    out = tmp_path / "layer.json"
    argv = ["--tiny", "--out", str(out), "--routings", "random", "--impls", "megamoe-reference", "--precisions",
            "bf16", "--no-plot", "--iters", "3", "--warmup", "2"] + (["--fp8-weights-per-step"] if per_step else [])
    assert cl.main(argv) == 0
    assert json.loads(out.read_text())["run"]["fp8_weights_per_step"] is per_step
    # the timed and warm-up steps (and the untimed step that records the kernels) each drop it once
    assert len(dropped) == (3 + 2 + 1 if per_step else 0), len(dropped)


def test_switches_add_same_process_megamoe_rows(tmp_path, capsys, monkeypatch):
    """--switches: one more megamoe row per entry (stock rows once), each run with its switches in force
    (environment and import-time attributes) and restored after; records and tables name them."""
    import os

    import compare.layer as cl
    from titan_megamoe.kernels import configs
    from titan_megamoe.ops import eager

    seen = []
    real = cl._run_one

    def spy(impl, *a, **kw):
        seen.append((impl, os.environ.get("TITAN_MEGAMOE_FUSED_ROUTER"), eager.ENABLED, configs.PERSISTENT_GEMM2))
        return real(impl, *a, **kw)

    monkeypatch.setattr(cl, "_run_one", spy)
    monkeypatch.delenv("TITAN_MEGAMOE_FUSED_ROUTER", raising=False)
    before = (eager.ENABLED, configs.PERSISTENT_GEMM2)
    out = tmp_path / "layer.json"
    assert cl.main(["--tiny", "--out", str(out), "--routings", "random", "--impls", "tt-eager,megamoe-reference",
                    "--precisions", "bf16", "--no-plot",
                    "--switches", "EAGER_AUTOGRAD=0", "FUSED_ROUTER=0,PERSISTENT_GEMM2=0"]) == 0
    assert seen == [("tt-eager", None, True, True), ("megamoe-reference", None, True, True),
                    ("megamoe-reference", None, False, True), ("megamoe-reference", "0", True, False)]
    assert (eager.ENABLED, configs.PERSISTENT_GEMM2) == before and "TITAN_MEGAMOE_FUSED_ROUTER" not in os.environ
    recs = json.loads(out.read_text())["records"]
    assert [r["switches"] for r in recs] == [{}, {}, {"TITAN_MEGAMOE_EAGER_AUTOGRAD": "0"},
                                             {"TITAN_MEGAMOE_FUSED_ROUTER": "0", "TITAN_MEGAMOE_PERSISTENT_GEMM2": "0"}]
    assert all(r["status"] == "ok" and "tt-eager/bf16" in r["speedup_vs"] for r in recs)
    stdout = capsys.readouterr().out
    assert "| megamoe-reference[FUSED_ROUTER=0,PERSISTENT_GEMM2=0] | bf16 |" in stdout


def test_switch_rows_are_checked_against_their_default_row(tmp_path, capsys, monkeypatch):
    """Each switch row's output, dx and weight gradients (strided samples of one step) are compared with its default
    row's: a switch that leaves the math alone reads error 0 and no flag; one whose results differ (here: the row's
    output sample doubled, as a wrong epilogue would) is flagged in the record, its notes, the table and a warning."""
    import compare.layer as cl

    real = cl._run_one
    calls = []

    def spy(impl, *a, **kw):
        local = real(impl, *a, **kw)
        calls.append(impl)
        if len(calls) == 3:  # the second switch row
            local["fingerprint"]["out"] = local["fingerprint"]["out"] * 2
        return local

    monkeypatch.setattr(cl, "_run_one", spy)
    out = tmp_path / "layer.json"
    assert cl.main(["--tiny", "--out", str(out), "--routings", "random", "--impls", "megamoe-reference",
                    "--precisions", "bf16", "--no-plot", "--switches", "PERSISTENT_GEMM2=0", "WGRAD=triton"]) == 0
    default, same, bad = json.loads(out.read_text())["records"]
    assert default["numerics_vs_default"] is None and default["numerics_flag"] is None
    errs = same["numerics_vs_default"]
    assert {"out", "dx"} <= set(errs) and any(k.startswith("grad ") for k in errs), errs
    assert max(errs.values()) == 0.0 and same["numerics_flag"] is None, errs
    assert bad["numerics_vs_default"]["out"] == pytest.approx(1.0) and bad["numerics_vs_default"]["dx"] == 0.0
    assert "out rel err 1" in bad["numerics_flag"] and bad["numerics_flag"] in bad["notes"]
    stdout = capsys.readouterr().out
    assert "ok, but differs from the default row: out rel err 1" in stdout and "WARNING" in stdout


def test_numerics_rel_errs_and_flag():
    from compare import numerics

    w = {"out": torch.tensor([3.0, 4.0]), "dx": torch.zeros(2)}
    assert numerics.rel_errs({"out": torch.tensor([3.0, 4.0]), "dx": torch.zeros(2)}, w) == {"out": 0.0, "dx": 0.0}
    e = numerics.rel_errs({"out": torch.tensor([3.0, 4.5]), "dx": torch.ones(2)}, w)
    assert e["out"] == pytest.approx(0.1) and e["dx"] == float("inf")
    e = numerics.rel_errs({"out": torch.tensor([float("nan"), 4.0])}, w)
    assert math.isnan(e["out"]) and math.isnan(e["dx"])  # nan in the sample; a missing sample
    assert numerics.flag({"out": 0.01}) is None
    assert "out rel err 0.1" in numerics.flag({"out": 0.1, "dx": 0.0})
    assert "dx rel err nan" in numerics.flag({"out": 0.1, "dx": float("nan")})


# ---------------------------------------------------------------------------------- capture_topk

def _tiny_qwen3(E=8, K=2, layers=2):
    from torchtitan.models.moe import MoEArgs
    from torchtitan.models.qwen3 import Qwen3Model, Qwen3ModelArgs

    args = Qwen3ModelArgs(vocab_size=64, max_seq_len=64, head_dim=16, dim=32, n_layers=layers,
                          n_heads=2, n_kv_heads=1, qk_norm=True, hidden_dim=64, moe_enabled=True,
                          moe_inter_dim=16,
                          moe_args=MoEArgs(num_experts=E, num_shared_experts=0, top_k=K,
                                           score_func="softmax", route_norm=True,
                                           score_before_experts=False, use_grouped_mm=False))
    torch.manual_seed(0)
    model = Qwen3Model(args)
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    return model


def test_capture_topk_tiny_model(tmp_path):
    from compare.capture_routing import capture_topk
    from compare.layer import _load_replay
    from titan_megamoe.config import MegaMoEConfig
    from titan_megamoe.layer import MegaMoE
    from titan_megamoe.testing import stock_histc_on_cpu

    model = _tiny_qwen3(E=8, K=2, layers=2)
    # layer 1 converted to MegaMoE (the CPU oracle): both kinds of MoE layer are captured
    model.layers["1"].moe = MegaMoE.from_moe(model.layers["1"].moe, config=MegaMoEConfig(backend="reference"))
    for blk in ("0", "1"):
        model.layers[blk].moe.tokens_per_expert.zero_()
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 64, (2, 12), generator=gen) for _ in range(3)]
    with stock_histc_on_cpu():
        got = capture_topk(model, batches, source="tiny test")
    assert [k for k, v in got.items() if isinstance(v, torch.Tensor)] == ["layers.0.moe", "layers.1.moe"]
    assert got["num_experts"] == 8 and got["top_k"] == 2 and got["tokens"] == 72
    assert got["source"] == "tiny test"
    for name in ("layers.0.moe", "layers.1.moe"):
        ids = got[name]
        assert ids.shape == (3 * 2 * 12, 2) and ids.dtype == torch.int16
        assert int(ids.min()) >= 0 and int(ids.max()) < 8
        assert (ids[:, 0] != ids[:, 1]).all()  # top-k picks distinct experts
    # hooks are removed: a later forward does not grow anything
    assert all(len(m.router._forward_hooks) == 0 for m in (model.layers["0"].moe, model.layers["1"].moe))
    # the captured ids are what the layers routed: their own tokens_per_expert counters agree
    for name, blk in (("layers.0.moe", "0"), ("layers.1.moe", "1")):
        counts = torch.bincount(got[name].long().view(-1), minlength=8).float()
        assert torch.equal(counts, model.layers[blk].moe.tokens_per_expert)

    with stock_histc_on_cpu():
        only = capture_topk(model, batches[:1], layers=["layers.1.moe"])
    assert [k for k, v in only.items() if isinstance(v, torch.Tensor)] == ["layers.1.moe"]
    # the file round-trips into compare.layer's replay loader
    torch.save(got, tmp_path / "cap.pt")
    rep = _load_replay(str(tmp_path / "cap.pt"), "layers.1.moe")
    assert rep["top_k"] == 2 and rep["num_experts"] == 8 and rep["ids"].shape == (72, 2)
    with pytest.raises(ValueError, match="unknown MoE layers"):
        capture_topk(model, batches, layers=["layers.9.moe"])


# ------------------------------------------------------------------------------------ EP = 2 run

def _ep_worker(rank, world_size, out):
    from compare.layer import main

    rc = main(["--tiny", "--out", out, "--no-plot", "--routings", "random,skewed",
               "--impls", "tt-eager,megamoe-reference", "--precisions", "bf16"])
    assert rc == 0, f"rank {rank}: compare.layer returned {rc}"


def test_ep2_gloo_tiny_run(tmp_path):
    out = tmp_path / "ep2.json"
    run_gloo(_ep_worker, 2, str(out))  # one launch: spawning costs ~10 s
    data = json.loads(out.read_text())
    assert data["run"]["world_size"] == 2 and data["run"]["dist_backend"] == "gloo"
    assert data["run"]["command"].startswith("torchrun --nproc_per_node 2 -m compare.layer")
    recs = data["records"]
    assert len(recs) == 4
    for r in recs:
        assert r["ep"] == 2 and r["tokens_per_rank"] == 64
        assert r["status"] == "ok", r["reason"]
        assert r["fwd_ms"] > 0 and r["bwd_ms"] > 0 and r["fwdbwd_ms"] > 0
    ref = next(r for r in recs if r["implementation"] == "megamoe-reference" and r["routing"] == "skewed")
    assert set(ref["speedup_vs"]) == {"tt-eager/bf16"}


def test_profile_tiny_writes_kernel_table(tmp_path):
    """compare.profile --tiny (CPU): a per-op table whose shares sum to 1, with provenance."""
    from compare import profile

    out = tmp_path / "p.json"
    assert profile.main(["--tiny", "--impl", "tt-eager", "--out", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert rec["impl"] == "tt-eager" and rec["tokens"] == 64 and rec["time_kind"] == "CPU self"
    assert rec["kernels"] and all(r["ms_per_step"] > 0 for r in rec["kernels"])
    assert abs(sum(r["share"] for r in rec["kernels"]) - 1.0) < 1e-6
    assert any("mm" in r["name"] or "linear" in r["name"] for r in rec["kernels"])
    assert profile.main(["--iters", "0"]) == 2  # refused before anything is built
    assert profile.main(["--tiny", "--impl", "megamoe-triton"]) == 2  # no GPU: a clear refusal, no traceback


def test_git_revision_env_wins_over_git(monkeypatch):
    """A GPU machine's copy can carry a stale .git: the revision named by the caller is recorded."""
    from compare.records import git_revision

    monkeypatch.setenv("TITAN_MEGAMOE_GIT_REV", "abc1234")
    monkeypatch.setenv("TITAN_MEGAMOE_GIT_DIRTY", "0")
    assert git_revision() == ("abc1234", False)
    monkeypatch.delenv("TITAN_MEGAMOE_GIT_REV")
    rev, _ = git_revision()
    assert rev != "abc1234" and (rev is None or len(rev) == 40)


def test_regress_layer_select_subset(tmp_path, capsys):
    """--select compares a partial re-run (one implementation of a wider baseline) without MISSING rows."""
    from compare.regress import main

    base = [_rec("tt-eager", 10.0, 24.0), _rec("megamoe-reference", 8.0, 20.0, speedup=1.2),
            _rec("tt-eager", 12.0, 30.0, routing="skewed")]
    old = _write(tmp_path / "old.json", base)
    part = _write(tmp_path / "part.json", copy.deepcopy(base[1:2]))
    assert main([part, "--baseline", old]) == 1  # two baseline records absent
    assert "(2 missing)" in capsys.readouterr().out
    assert main([part, "--baseline", old, "--select", "implementation=megamoe-reference"]) == 0
    out = capsys.readouterr().out
    assert "MISSING" not in out and "| tt-eager/bf16" not in out and "compare.layer" in out
    assert "| megamoe-reference/bf16 qwen3-30b-a3b random ep=2 T=16384 | speedup vs tt-eager/bf16 | 1.200x" in out
    # fields combine (AND), values within a field are alternatives (OR); shape is matched by name
    assert main([part, "--baseline", old, "--select", "implementation=tt-eager,megamoe-reference",
                 "--select", "routing=random", "--select", "shape=qwen3-30b-a3b"]) == 1
    miss = [line for line in capsys.readouterr().out.splitlines() if "MISSING" in line]
    assert len(miss) == 1 and "tt-eager/bf16 qwen3-30b-a3b random" in miss[0]
    for args, msg in ((["--select", "label=x"], "unknown field 'label'"),
                      (["--metrics", "tps"], "unknown metric 'tps'"),
                      (["--select", "ep=4"], "nothing to compare")):
        with pytest.raises(SystemExit) as exc:
            main([part, "--baseline", old, *args])
        assert exc.value.code == 2 and msg in capsys.readouterr().err


@pytest.mark.parametrize("impl", ["tt-eager", "megamoe-reference"])
def test_layer_steps_time_a_training_step_and_reset_grads(impl):
    """compare.builders.layer_steps (the scripts' shared step callables): a forward returns the layer output, the
    backward fills x's and the parameters' grads, before() clears them, in the implementation's context."""
    from compare.builders import layer_steps
    from compare.shapes import parse_shape

    shape = parse_shape("custom:64,32,8,2")
    dev = torch.device("cpu")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 16, 64, generator=g).requires_grad_()
    grad = torch.randn(1, 16, 64, generator=g)
    st = layer_steps(impl, shape, dev, x, grad, precision="fp32")
    with st.context():
        y = st.fwd()
        assert y.shape == (1, 16, 64) and torch.isfinite(y).all()
        st.bwd(y)
        assert x.grad is not None and x.grad.abs().sum() > 0
        s = timing.time_fwd_bwd(st.fwd, st.bwd, device=dev, iters=2, warmup=0, before_step=st.before, gc_off=True)
    assert len(s["fwdbwd"]) == 2
    st.before()
    assert x.grad is None
    with pytest.raises(KeyError):
        layer_steps("tt-fast", shape, dev, x, grad)


def test_parse_impls_names_the_unknown_and_the_allowed():
    from compare.builders import parse_impls

    assert parse_impls(" tt-eager, ,megamoe-triton ") == ["tt-eager", "megamoe-triton"]
    with pytest.raises(ValueError, match=r"\['tt-fast'\].*megamoe-reference"):
        parse_impls("tt-eager,tt-fast")


def test_fp8_rows_are_compared_with_the_bf16_row(tmp_path, capsys, monkeypatch):
    """An FP8 row's output, dx and weight gradients are compared with the same implementation's bf16 row (same
    weights, input and routing): its record carries the relative errors (not a flag: the recipe's error is expected)
    and the report prints them. On the CPU machine the triton backend is skipped, so the fp8 row here is the
    reference backend's bf16 step with its output sample scaled by 1.03, as a 3 % output error would read."""
    import compare.layer as cl

    real = cl._run_one

    def spy(impl, precision, *a, **kw):
        local = real(impl, "bf16", *a, **kw)
        if precision == "fp8":
            local["fingerprint"]["out"] = local["fingerprint"]["out"] * 1.03
        return local

    monkeypatch.setattr(cl, "_run_one", spy)
    monkeypatch.setattr(cl, "skip_reason", lambda *a: None)
    out = tmp_path / "layer.json"
    assert cl.main(["--tiny", "--out", str(out), "--routings", "random", "--impls", "megamoe-reference",
                    "--precisions", "bf16,fp8", "--no-plot"]) == 0
    bf16, fp8 = json.loads(out.read_text())["records"]
    assert bf16["numerics_vs_bf16"] is None
    e = fp8["numerics_vs_bf16"]
    assert e["out"] == pytest.approx(0.03, rel=1e-3) and e["dx"] == 0.0 and fp8["numerics_flag"] is None, e
    assert any(k.startswith("grad ") for k in e) and fp8["status"] == "ok"
    stdout = capsys.readouterr().out
    assert "FP8 rows against the same implementation's bf16 row" in stdout
    assert "| megamoe-reference | fp8 | 0.03 | 0 |" in stdout


def test_fp8_before_bf16_in_precisions_says_the_bf16_comparison_is_left_out(tmp_path, capsys, monkeypatch):
    import compare.layer as cl

    real = cl._run_one
    monkeypatch.setattr(cl, "_run_one", lambda impl, precision, *a, **kw: real(impl, "bf16", *a, **kw))
    monkeypatch.setattr(cl, "skip_reason", lambda *a: None)
    out = tmp_path / "layer.json"
    assert cl.main(["--tiny", "--out", str(out), "--routings", "random", "--impls", "megamoe-reference",
                    "--precisions", "fp8,bf16", "--no-plot"]) == 0
    assert all(r["numerics_vs_bf16"] is None for r in json.loads(out.read_text())["records"])
    got = capsys.readouterr()
    assert "note: fp8 come before bf16 in --precisions" in got.out + got.err
