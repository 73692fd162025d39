"""Result records of compare.layer: the JSON schema, run provenance, speedups and the markdown table.

File layout (``SCHEMA = "titan_megamoe.compare.layer/1"``)::

    {
      "schema": "titan_megamoe.compare.layer/1",
      "run": {                                  # provenance: where every number came from
        "gpu": "NVIDIA H200" | "cpu (x86_64)",  "device_type": "cuda" | "cpu",
        "world_size": 2, "dist_backend": "nccl" | "gloo" | null,
        "hostnames": ["node-a"],                # one per distinct host over ranks
        "torch": "2.11.0", "triton": "3.6.0", "torchtitan": "0.2.2", "torchao": "0.16.0",
        "titan_megamoe": "0.1.0", "python": "3.11.7",
        "git_rev": "<sha>" | null, "git_dirty": true | false | null,   # without .git: from the
                                                # env TITAN_MEGAMOE_GIT_REV / TITAN_MEGAMOE_GIT_DIRTY
        "date_utc": "2026-11-30T12:00:00+00:00",
        "command": "torchrun --nproc_per_node 2 -m compare.layer --shapes ...",   # exact, re-runnable
        "argv": [...], "options": {...parsed options...},
        "gemm_rates_tflops": {"bf16": 761.2, "fp8": 1210.0},  # dense GEMM rates measured in this run
        "gemm_rate_method": {"bf16": "torch.matmul 8192x8192x8192 bf16", ...},
        "timer": "cuda-events" | "cpu-perf-counter",
        "power_sampling": "nvml every 20 ms" | "unavailable: <why>",  "power_limit_w": 700.0,   # CUDA only
        "flop_model": "compare/flops.py: routed GEMMs 2*T*K*D*F*3 fwd, x2 bwd, x3 fwd+bwd"
      },
      "records": [ { ...one per (implementation, precision, shape, routing)... } ]
    }

Record fields (times in ms, median over timed steps of the per-step max over ranks; ``*_p20_ms`` /
``*_p80_ms`` the 20th / 80th percentiles; null where not measured)::

    implementation   "tt-eager" | "tt-compile" | "megamoe-reference" | "megamoe-triton"
    family           "stock" | "megamoe";   backend: "reference" | "triton" | null;  compile: bool
    precision        "bf16" | "fp8" | "fp8_bwd" | "fp32";   dtype: "bfloat16" | "float32"
    shape            {"name", "dim", "hidden", "experts", "top_k"}
    routing          "random" | "skewed" | "replay";  routing_detail: {zipf_s | path, layer, ...}
    routing_note     text or null (e.g. replayed ids mapped by id % experts)
    load_imbalance   max over experts of (tokens routed to it) / mean, all ranks, from the layer's
                     own tokens_per_expert buffer (1.0 = perfectly balanced)
    ep, tokens_per_rank, iters, warmup
    fwd_ms, fwd_p20_ms, fwd_p80_ms, bwd_ms, bwd_p20_ms, bwd_p80_ms, fwdbwd_ms, fwdbwd_p20_ms, fwdbwd_p80_ms
    host_fwd_ms, host_fwdbwd_ms   median (of the per-step max over ranks) host time to enqueue the
                     forward / the whole step (time.perf_counter around the calls)
    fwd_device_ms, bwd_device_ms, fwdbwd_device_ms   with --device-time (CUDA): the same medians for
                     steps started behind a device sleep of device_time_head_start_ms, i.e. the
                     device's work alone; null without it
    fwd_cool_ms, bwd_cool_ms, fwdbwd_cool_ms   with --cooldown-ms (CUDA): the same medians for steps
                     started from an idle device after the host slept cooldown_ms (lower duty cycle:
                     a power-capped layer runs at a higher SM clock); null without it
    power            (CUDA, NVML available) one entry per rank: {"idle" | "device" | "cool": {samples,
                     sm_mhz_median, sm_mhz_min, power_w_median, power_w_max, temp_c_max, reasons}} for
                     each timing pass (compare/power.py; reasons e.g. ["sw_power_cap"]); null otherwise
    peak_gib         max over ranks of torch.cuda.max_memory_allocated (weights included) | null on CPU
    kernel_configs   megamoe rows: {kernel: [{constexprs, options (num_warps, num_stages, maxnreg), grids}]} of
                     one more fwd+bwd step after the timing (rank 0; kernels/launch.record_launches) | null
    flops            {"fwd", "bwd", "fwdbwd"} per rank (compare/flops.py)
    tflops           effective fwd+bwd TFLOP/s per rank;  tflops_fwd, tflops_bwd
    floor_ms         fwd+bwd FLOPs / GEMM rate of this precision measured in this run; floor_fwd_ms
    floor_ratio      fwdbwd_ms / floor_ms (1.0 = at the dense-GEMM compute floor); floor_ratio_fwd
    speedup_vs       {"tt-eager/bf16": {"fwd": x, "bwd": x, "fwdbwd": x}, ...}: stock time / this
                     time for every stock variant measured ok in this run with the same shape,
                     routing, ep and tokens (> 1 = this one is faster)
    status           "ok" | "skipped" | "error";  reason: why skipped / the error (null when ok)
    notes            list of build notes (recipe details, CPU fallbacks)
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import shlex
import socket
import subprocess
import sys
from pathlib import Path

__all__ = [
    "SCHEMA",
    "REPO_ROOT",
    "new_record",
    "record_key",
    "key_str",
    "fill_speedups",
    "provenance",
    "default_out_path",
    "write_results",
    "load_results",
    "markdown_table",
    "device_time_table",
    "power_table",
]

SCHEMA = "titan_megamoe.compare.layer/1"
REPO_ROOT = Path(__file__).resolve().parents[1]
PHASES = ("fwd", "bwd", "fwdbwd")


def new_record(*, implementation: str, family: str, backend: str | None, compile: bool,
               precision: str, dtype: str, shape: dict, routing: str, routing_detail: dict,
               ep: int, tokens_per_rank: int, iters: int, warmup: int, switches: dict | None = None) -> dict:
    """A record with every schema field present (measurements null, status "pending"). ``switches``:
    the environment switches this row ran with flipped in-process (compare.layer --switches), {}."""
    rec = dict(
        implementation=implementation, family=family, backend=backend, compile=compile,
        switches=dict(switches or {}),
        precision=precision, dtype=dtype, shape=dict(shape), routing=routing,
        routing_detail=dict(routing_detail), routing_note=None, load_imbalance=None,
        ep=ep, tokens_per_rank=tokens_per_rank, iters=iters, warmup=warmup,
    )
    for p in PHASES:
        rec[f"{p}_ms"] = rec[f"{p}_p20_ms"] = rec[f"{p}_p80_ms"] = None
    rec.update(host_fwd_ms=None, host_fwdbwd_ms=None, fwd_device_ms=None, bwd_device_ms=None,
               fwdbwd_device_ms=None, device_time_head_start_ms=None, fwd_cool_ms=None, bwd_cool_ms=None,
               fwdbwd_cool_ms=None, cooldown_ms=None, power=None)
    rec.update(peak_gib=None, kernel_configs=None, flops=None, tflops=None, tflops_fwd=None, tflops_bwd=None,
               floor_ms=None, floor_fwd_ms=None, floor_ratio=None, floor_ratio_fwd=None,
               speedup_vs={}, status="pending", reason=None, notes=[], numerics_vs_default=None,
               numerics_flag=None, numerics_vs_bf16=None)
    return rec


def record_key(rec: dict) -> tuple:
    """Identity of a record across runs: (implementation, precision, shape name + dims, routing
    (+ detail that changes the routing), ep, tokens_per_rank)."""
    s = rec["shape"]
    detail = rec.get("routing_detail") or {}
    routing = rec["routing"]
    if routing == "skewed":
        routing = f"skewed(s={detail.get('zipf_s')})"
    elif routing == "replay":
        routing = f"replay({Path(str(detail.get('path', ''))).name}:{detail.get('layer')})"
    return (impl_label(rec), rec["precision"],
            (s["name"], s["dim"], s["hidden"], s["experts"], s["top_k"]),
            routing, rec["ep"], rec["tokens_per_rank"])


def impl_label(rec: dict) -> str:
    """The implementation, with the switches a --switches row ran with: ``megamoe-triton[FUSED_ROUTER=0]``."""
    from titan_megamoe.switches import label

    sw = rec.get("switches") or {}
    return f"{rec['implementation']}[{label(sw)}]" if sw else rec["implementation"]


def key_str(key: tuple) -> str:
    impl, prec, shape, routing, ep, tokens = key
    return f"{impl}/{prec} {shape[0]} {routing} ep={ep} T={tokens}"


def _stock_variant(rec: dict) -> str:
    return f"{rec['implementation']}/{rec['precision']}"


def fill_speedups(records: list[dict]) -> None:
    """Set ``speedup_vs`` of every ok record against every ok stock record of the same shape,
    routing, ep and tokens (stock ms / this ms, per phase). A stock record gets its ratio against
    the other stock variants too (and 1.0 against itself)."""
    def group(rec):
        k = record_key(rec)
        return k[2:]

    stock = [r for r in records if r["family"] == "stock" and r["status"] == "ok"]
    for rec in records:
        if rec["status"] != "ok":
            continue
        sv = {}
        for base in stock:
            if group(base) != group(rec):
                continue
            sv[_stock_variant(base)] = {
                p: (base[f"{p}_ms"] / rec[f"{p}_ms"]) if rec[f"{p}_ms"] and base[f"{p}_ms"] else None
                for p in PHASES
            }
        rec["speedup_vs"] = sv


def _git(*args: str) -> str | None:
    try:
        res = subprocess.run(["git", "-C", str(REPO_ROOT), *args], capture_output=True, text=True,
                             timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return res.stdout.strip() if res.returncode == 0 else None


def _version(dist_name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist_name)
    except metadata.PackageNotFoundError:
        return None


def _pkg_version() -> str | None:
    try:
        import titan_megamoe

        return getattr(titan_megamoe, "__version__", None)
    except ImportError:
        return None


def command_line(argv: list[str], world_size: int, module: str = "compare.layer") -> str:
    """The command that reproduces this run (torchrun prefix when launched by torchrun)."""
    args = " ".join(shlex.quote(a) for a in argv)
    if "TORCHELASTIC_RUN_ID" in os.environ or world_size > 1:
        return f"torchrun --nproc_per_node {world_size} -m {module} {args}".rstrip()
    return f"python -m {module} {args}".rstrip()


def provenance(*, device, world_size: int, dist_backend: str | None, hostnames: list[str],
               argv: list[str], options: dict, module: str = "compare.layer") -> dict:
    """Everything a reader needs to know where the numbers came from (see the module docstring);
    ``module``: the ``python -m`` module of the command line (compare.layer, compare.ep_overlap)."""
    import torch

    if device.type == "cuda":
        gpu = torch.cuda.get_device_name(device)
    else:
        gpu = f"cpu ({platform.machine() or 'unknown'})"
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    rev, dirty = git_revision()
    return {
        "gpu": gpu,
        "device_type": device.type,
        "world_size": world_size,
        "dist_backend": dist_backend,
        "hostnames": sorted(set(hostnames)) or [socket.gethostname()],
        "torch": torch.__version__,
        "triton": triton_version,
        "torchtitan": _version("torchtitan"),
        "torchao": _version("torchao"),
        "titan_megamoe": _version("titan_megamoe") or _version("titan-megamoe") or _pkg_version(),
        "python": platform.python_version(),
        "git_rev": rev,
        "git_dirty": dirty,
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command_line(argv, world_size, module),
        "argv": [sys.argv[0], *argv],
        "options": options,
        # the package's switches set in this run's environment (fast launch, persistent GEMM2, combine
        # dtype, FP8 variants...): part of what produced the numbers
        "switches": {k: v for k, v in sorted(os.environ.items())
                     if k.startswith("TITAN_MEGAMOE_") and k not in ("TITAN_MEGAMOE_GIT_REV", "TITAN_MEGAMOE_GIT_DIRTY")},
        "flop_model": "compare/flops.py: routed GEMMs 2*T*K*D*F*3 fwd, x2 bwd, x3 fwd+bwd",
    }


def git_revision() -> tuple[str | None, bool | None]:
    """(commit, dirty) of this checkout. TITAN_MEGAMOE_GIT_REV / TITAN_MEGAMOE_GIT_DIRTY, when set,
    win over git: a copy of the tree on a remote GPU machine can carry a stale .git."""
    if os.environ.get("TITAN_MEGAMOE_GIT_REV"):
        dirty_env = os.environ.get("TITAN_MEGAMOE_GIT_DIRTY")
        dirty = None if dirty_env is None else dirty_env not in ("0", "false", "")
        return os.environ["TITAN_MEGAMOE_GIT_REV"], dirty
    rev = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain") if rev else None
    return rev, None if status is None else bool(status)


def _slug(name: str) -> str:
    s = name.lower().replace("nvidia", "").replace("geforce", "")
    s = re.sub(r"[^a-z0-9]+", "-", s).strip("-")
    return s or "unknown"


def default_out_path(gpu: str, device_type: str, world_size: int, note: str | None = None,
                     date: datetime.date | None = None, theme: str = "layer") -> Path:
    """``benchmarks/results/<theme>_<hardware>_<yyyymmdd>[_<note>].json`` under the repo root
    (``outputs/`` for CPU runs);
    hardware is e.g. ``h200`` or ``2xh200`` or ``cpu``. An existing file is never overwritten: a
    ``_2``, ``_3``, ... suffix is added."""
    date = date or datetime.datetime.now(datetime.timezone.utc).date()
    hw = "cpu" if device_type == "cpu" else _slug(gpu)
    if world_size > 1:
        hw = f"{world_size}x{hw}"
    stem = f"{theme}_{hw}_{date:%Y%m%d}" + (f"_{note}" if note else "")
    # CPU smoke runs are not results to commit: they go to the git-ignored outputs/ folder
    base = REPO_ROOT / ("outputs" if device_type == "cpu" else "benchmarks/results")
    base.mkdir(parents=True, exist_ok=True)
    path = base / f"{stem}.json"
    i = 2
    while path.exists():
        path = base / f"{stem}_{i}.json"
        i += 1
    return path


def write_results(path: Path, run: dict, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump({"schema": SCHEMA, "run": run, "records": records}, f, indent=1, sort_keys=False)
        f.write("\n")


def load_results(path: str | Path) -> dict:
    """Read a results file. Raises ValueError (naming the file) if it is not one."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: cannot read results JSON ({err})") from err
    if not isinstance(data, dict) or not isinstance(data.get("records"), list):
        raise ValueError(f"{path}: not a compare.layer results file (no 'records' list)")
    return data


def _fmt(x, spec=".2f"):
    return "-" if x is None else format(x, spec)


def device_time_table(records: list[dict]) -> str:
    """One row per ok record: the idle-start times beside the device-only times (--device-time), the
    cool-down times (--cooldown-ms) and the host's enqueue times, so a host-bound layer shows as fwd ms
    well above fwd device ms and a power-capped one as fwd+bwd ms well above fwd+bwd cool ms."""
    head = ("| shape | ep | impl | prec | fwd ms | fwd device ms | fwd cool ms | fwd+bwd ms | fwd+bwd device ms "
            "| fwd+bwd cool ms | host enqueue fwd ms | host enqueue fwd+bwd ms |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in records:
        if r["status"] != "ok":
            continue
        lines.append(
            f"| {r['shape']['name']} | {r['ep']} | {impl_label(r)} | {r['precision']} | "
            f"{_fmt(r['fwd_ms'], '.4g')} | {_fmt(r.get('fwd_device_ms'), '.4g')} | {_fmt(r.get('fwd_cool_ms'), '.4g')} | "
            f"{_fmt(r['fwdbwd_ms'], '.4g')} | {_fmt(r.get('fwdbwd_device_ms'), '.4g')} | "
            f"{_fmt(r.get('fwdbwd_cool_ms'), '.4g')} | {_fmt(r.get('host_fwd_ms'), '.3g')} | "
            f"{_fmt(r.get('host_fwdbwd_ms'), '.3g')} |")
    return "\n".join(lines)


def power_table(records: list[dict]) -> str:
    """One row per (ok record, timing pass) with NVML samples (rank 0's GPU): median / min SM clock,
    median / max power, max temperature and the clock-event reasons seen."""
    head = "| shape | impl | prec | pass | SM MHz median [min] | power W median [max] | max C | reasons |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in records:
        if r["status"] != "ok" or not r.get("power") or not r["power"][0]:
            continue
        for name, w in r["power"][0].items():
            if not w:
                continue
            lines.append(
                f"| {r['shape']['name']} | {impl_label(r)} | {r['precision']} | {name} | "
                f"{w['sm_mhz_median']:.0f} [{w['sm_mhz_min']:.0f}] | {w['power_w_median']:.0f} [{w['power_w_max']:.0f}] | "
                f"{w['temp_c_max']:.0f} | {', '.join(w['reasons']) or '-'} |")
    return "\n".join(lines)


def markdown_table(records: list[dict]) -> str:
    """One row per record: times, memory, TFLOP/s, floor ratio, speedups, status."""
    head = ("| shape | routing | ep | T/rank | impl | prec | fwd ms | bwd ms | fwd+bwd ms [p20-p80] "
            "| peak GiB | TFLOP/s | x floor | speedup fwd+bwd | status |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in records:
        routing = r["routing"]
        if r.get("routing_note"):
            routing += "*"
        if r["status"] == "ok":
            fb = f"{_fmt(r['fwdbwd_ms'], '.4g')} [{_fmt(r['fwdbwd_p20_ms'], '.4g')}-{_fmt(r['fwdbwd_p80_ms'], '.4g')}]"
            sp = ", ".join(f"{k} {v['fwdbwd']:.2f}x" for k, v in r["speedup_vs"].items()
                           if v.get("fwdbwd") is not None and k != f"{r['implementation']}/{r['precision']}")
            status = "ok" if not r.get("numerics_flag") else f"ok, but {r['numerics_flag']}"
        else:
            fb, sp = "-", ""
            status = f"{r['status']}: {r['reason']}"
        lines.append(
            f"| {r['shape']['name']} | {routing} | {r['ep']} | {r['tokens_per_rank']} | "
            f"{impl_label(r)} | {r['precision']} | {_fmt(r['fwd_ms'], '.4g')} | {_fmt(r['bwd_ms'], '.4g')} | "
            f"{fb} | {_fmt(r['peak_gib'])} | {_fmt(r['tflops'], '.4g')} | {_fmt(r['floor_ratio'])} | "
            f"{sp or '-'} | {status} |"
        )
    notes = sorted({r["routing_note"] for r in records if r.get("routing_note")})
    if notes:
        lines.append("")
        lines.extend(f"\\* {n}" for n in notes)
    return "\n".join(lines)
