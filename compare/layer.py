"""python -m compare.layer: one MoE layer, stock TorchTitan vs megamoe, fwd / bwd / fwd+bwd.

    torchrun --nproc_per_node N -m compare.layer [options]     # EP = N (NCCL on GPU, gloo on CPU)
    python -m compare.layer [options]                          # EP = 1
    python -m compare.layer --tiny                             # CPU smoke run (tests use it)

For every (shape, routing, implementation, precision) it builds the layer (see compare/builders.py),
times training steps (compare/timing.py: warm-up, barrier, CUDA events, median / p20 / p80 of the
per-step max over ranks; Python's automatic garbage collection off during the timed steps as in
TorchTitan's trainer, NVML sampled from a child process: neither runs in the timed process), and records times, peak memory, TFLOP/s and the ratio to the compute
floor (compare/flops.py) against the dense GEMM rate measured at the start of the same run, and
the speedup against every stock TorchTitan variant of the same run. Output: a JSON file (schema
in compare/records.py), a markdown table on stdout, a PNG chart (compare/plots.py). Combinations
that cannot run are recorded as "skipped" with the reason; failures as "error" (exit code 1).

Times (see compare/timing.py): fwd = the training forward (autograd on), bwd = the backward of
that same step, timed separately, fwdbwd = the whole step, each step started from an idle device
(so host time before a kernel counts); every record also carries the host's enqueue time of the
forward and of the step (``host_fwd_ms``, ``host_fwdbwd_ms``), and with ``--device-time`` a second
pass of steps started behind a ~40 ms device sleep times the device's work alone (``*_device_ms``,
second table): host-bound layers show it as fwd_ms well above fwd_device_ms. Note that
shared/probes/stock_layer_baseline.py (DESIGN.md section 5) timed its "fwd" under torch.no_grad().
tt-compile follows that probe (``torch.compile(moe.experts, fullgraph=False)``), not TorchTitan's
``apply_compile`` (which compiles the router / reorderer with fullgraph=True and patches
``_run_experts_grouped_mm``).

Failure handling: a combination that raises is recorded as "error" on every rank (results are
gathered after each combination). A rank that fails while the others are inside a collective
(e.g. out of memory during the all-to-all) leaves them waiting until ``--timeout-s``.

Routings: "random" = the layer's own router at random init (near uniform); "skewed" = Zipf-like
expert popularity (titan_megamoe.testing.make_routing, --zipf-s); "replay:PATH" = top-k ids captured
from a real model (python -m compare.capture_routing). Fixed routings replace only the router's
top-k selection (compare.builders.inject_routing): the scores keep their gradient.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import math
import os
import socket
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from compare import flops as flop_model
from compare import numerics
from titan_megamoe.switches import label as switch_label
from titan_megamoe.switches import override as override_switches
from titan_megamoe.switches import parse_switches
from compare.builders import (IMPLS, PRECISIONS, build_layer, inject_routing, model_dtype, skip_reason,
                              stock_layer_context)
from compare.power import PowerSampler
from compare.records import (default_out_path, device_time_table, fill_speedups, markdown_table, new_record,
                             power_table, provenance, write_results)
from compare.shapes import LayerShape, parse_shape, shape_choices
from compare.timing import (flush_l2, l2_flush_bytes, max_over_ranks, measure_gemm_tflops, percentiles, time_fwd_bwd,
                            timer_name)

__all__ = ["main", "build_parser", "parse_options"]

ROUTING_CHOICES = "random, skewed, replay:PATH"
TINY = dict(shapes="custom:64,32,8,2", tokens=64, iters=2, warmup=1, precisions="bf16,fp8",
            impls="tt-eager,megamoe-reference,megamoe-triton")
DEFAULTS = dict(shapes="qwen3-30b-a3b,qwen3-235b-a22b", tokens=16384, iters=20, warmup=5,
                precisions="bf16,fp8,fp8_bwd", impls=",".join(IMPLS))
#: GEMM arithmetic of (forward, backward) per precision, for the compute floor.
GEMM_KINDS = {"bf16": ("bf16", "bf16"), "fp8": ("fp8", "fp8"), "fp8_bwd": ("bf16", "fp8"),
              "fp32": ("fp32", "fp32")}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m compare.layer", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", help=f"comma list of: {shape_choices()} (default {DEFAULTS['shapes']})")
    p.add_argument("--impls", help=f"comma list of: {', '.join(IMPLS)} (default: all)")
    p.add_argument("--precisions", help=f"comma list of: {', '.join(PRECISIONS)} (default bf16,fp8,fp8_bwd;"
                   " fp32 is a CPU/debug choice)")
    p.add_argument("--routings", default="random,skewed", help=f"comma list of: {ROUTING_CHOICES}")
    p.add_argument("--zipf-s", type=float, default=1.2, help="Zipf exponent of 'skewed' (default 1.2)")
    p.add_argument("--replay-layer", default=None,
                   help="layer name in the replay file (default: its first layer)")
    p.add_argument("--tokens", type=int, help="tokens per rank (default 16384)")
    p.add_argument("--iters", type=int, help="timed steps (default 20)")
    p.add_argument("--warmup", type=int, help="untimed warm-up steps (default 5)")
    p.add_argument("--seed", type=int, default=0, help="weights / routing / token seed (default 0)")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default=None,
                   help="auto (cuda if available; default), cuda or cpu (default with --tiny)")
    p.add_argument("--out", help="JSON path (default benchmarks/results/layer_<gpu>_<yyyymmdd>.json)")
    p.add_argument("--plot", help="PNG path (default: the JSON path with .png)")
    p.add_argument("--no-plot", action="store_true", help="do not write the PNG")
    p.add_argument("--timeout-s", type=float, default=900.0, help="process-group timeout (default 900)")
    p.add_argument("--device-time", action="store_true",
                   help="CUDA: also time --iters steps behind a device sleep, so the host enqueues ahead: the "
                        "layer's device time alone (*_device_ms fields, second table)")
    p.add_argument("--cooldown-ms", type=float, default=0.0,
                   help="CUDA: also time --iters steps from an idle device after the host sleeps this many ms "
                        "before each (lower duty cycle: a power-capped layer runs at a higher clock); "
                        "*_cool_ms fields, shown beside the default times (0: off)")
    p.add_argument("--gc", choices=("titan", "python"), default="titan",
                   help="titan (default): Python's automatic garbage collection off during each timing pass "
                        "(collected before it), as TorchTitan's trainer runs its steps (training.gc_freq); "
                        "python: left on (the harness's protocol before 2026-12-05)")
    p.add_argument("--power-sampler", choices=("process", "thread", "off"), default="process",
                   help="CUDA: where NVML clock / power samples are taken: a child process (default), a thread "
                        "of the timed process (the protocol before 2026-12-05; it competes for the GIL with the "
                        "thread that launches the kernels), or off")
    p.add_argument("--fp8-weights-per-step", action="store_true",
                   help="megamoe FP8 rows: drop the layer's FP8 weight copies before every step, as each optimizer "
                        "step does in training, so the 128x128 weight quantization is timed in every step (stock "
                        "TorchTitan's FP8 quantizes its weights in every forward); default: quantized once, "
                        "the cache serves every timed step")
    p.add_argument("--tiny", action="store_true",
                   help=f"CPU smoke run: defaults {TINY} (explicit options still win)")
    p.add_argument("--switches", nargs="+", default=[], metavar="NAME=V[,NAME=V]",
                   help="each adds megamoe rows run with those environment switches flipped in this process "
                        "(same-process A/B; titan_megamoe/switches.py lists the switches), e.g. "
                        "--switches FUSED_ROUTER=0 PERSISTENT_GEMM2=0")
    return p


@dataclass
class RoutingSpec:
    name: str  # "random" | "skewed" | "replay"
    detail: dict = field(default_factory=dict)
    replay: dict | None = None  # {"ids": (N, K) int tensor, "num_experts": int, ...}


@dataclass
class Plan:
    shapes: list[LayerShape]
    impls: list[str]
    precisions: list[str]
    routings: list[RoutingSpec]
    tokens: int
    iters: int
    warmup: int
    device: torch.device
    world_size: int
    device_time: bool = False
    #: host sleep before each step of the cool-down pass (ms); 0: no such pass
    cooldown_ms: float = 0.0
    #: switch settings of the megamoe rows: {} (as the process runs) first, then one per --switches entry
    variants: list[dict] = field(default_factory=lambda: [{}])
    #: automatic garbage collection off during the timing passes (--gc titan)
    gc_off: bool = True
    #: compare.power.PowerSampler mode (--power-sampler)
    power_sampler: str = "process"
    #: megamoe FP8 rows: the FP8 weight caches dropped before every step (--fp8-weights-per-step)
    fp8_weights_per_step: bool = False


def _split(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def _split_shapes(s: str) -> list[str]:
    """Comma list of shapes, where ``custom:D,F,E,K`` keeps its own commas."""
    out: list[str] = []
    for tok in _split(s):
        if out and out[-1].startswith("custom:") and out[-1].count(",") < 3 and tok.isdigit():
            out[-1] += "," + tok
        else:
            out.append(tok)
    return out


def _world_size() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def _load_replay(path: str, layer: str | None) -> dict:
    """Read a capture_routing file; ValueError with the reason if unusable."""
    if not Path(path).is_file():
        raise ValueError(f"replay file {path!r} does not exist")
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - any unreadable file gets the same message
        raise ValueError(f"replay file {path!r} cannot be read by torch.load ({err})") from err
    if not isinstance(data, dict):
        raise ValueError(f"replay file {path!r} is not a dict written by compare.capture_routing")
    layers = {k: v for k, v in data.items() if isinstance(v, torch.Tensor)}
    if not layers:
        raise ValueError(f"replay file {path!r} holds no layer ids")
    name = layer or next(iter(layers))
    if name not in layers:
        raise ValueError(f"--replay-layer {name!r} not in {path!r}; layers: {', '.join(layers)}")
    ids = layers[name]
    if ids.dim() != 2 or ids.dtype.is_floating_point or ids.shape[0] == 0:
        raise ValueError(f"replay file {path!r} layer {name!r}: ids must be a non-empty (T, K) integer "
                         f"tensor, got {tuple(ids.shape)} {ids.dtype}")
    num_experts = int(data.get("num_experts", int(ids.max()) + 1))
    if int(ids.min()) < 0 or int(ids.max()) >= num_experts:
        raise ValueError(f"replay file {path!r} layer {name!r}: ids outside [0, num_experts={num_experts})")
    return {"ids": ids.to(torch.int64), "num_experts": num_experts, "layer": name,
            "top_k": int(ids.shape[1]), "source": str(data.get("source", ""))}


def parse_options(argv: list[str] | None) -> tuple[argparse.Namespace, Plan]:
    """Parse and validate every option before any GPU work; invalid ones exit with code 2 and an
    argparse-style message naming the option and the allowed values."""
    parser = build_parser()
    args = parser.parse_args(argv)
    base = TINY if args.tiny else DEFAULTS
    for k in ("shapes", "tokens", "iters", "warmup", "precisions", "impls"):
        if getattr(args, k) is None:
            setattr(args, k, base[k])
    if args.device is None:
        args.device = "cpu" if args.tiny else "auto"

    try:
        shapes = [parse_shape(s) for s in _split_shapes(args.shapes)]
    except ValueError as err:
        parser.error(f"argument --shapes: {err}")
    if not shapes:
        parser.error(f"argument --shapes: empty; allowed: {shape_choices()}")
    impls = _split(args.impls)
    for i in impls:
        if i not in IMPLS:
            parser.error(f"argument --impls: unknown implementation {i!r}; allowed: {', '.join(IMPLS)}")
    precisions = _split(args.precisions)
    for pr in precisions:
        if pr not in PRECISIONS:
            parser.error(f"argument --precisions: unknown precision {pr!r}; allowed: {', '.join(PRECISIONS)}")
    if not impls or not precisions:
        parser.error("argument --impls / --precisions: empty list")
    if args.tokens <= 0:
        parser.error(f"argument --tokens: must be > 0 (tokens per rank), got {args.tokens}")
    if args.iters < 1:
        parser.error(f"argument --iters: must be >= 1, got {args.iters}")
    if args.warmup < 0:
        parser.error(f"argument --warmup: must be >= 0, got {args.warmup}")
    if not (0.0 <= args.cooldown_ms <= 10_000.0):
        parser.error(f"argument --cooldown-ms: must be in [0, 10000] ms, got {args.cooldown_ms}")
    if not (args.zipf_s > 0 and math.isfinite(args.zipf_s)):
        parser.error(f"argument --zipf-s: must be a finite number > 0, got {args.zipf_s}")
    ws = _world_size()
    for s in shapes:
        if s.experts % ws:
            parser.error(f"argument --shapes: {s.name} has {s.experts} experts, not divisible by the EP "
                         f"size {ws} (= world size)")
        if s.top_k > s.experts:
            parser.error(f"argument --shapes: {s.name} top_k={s.top_k} > experts={s.experts}")

    routings = []
    for r in _split(args.routings):
        if r == "random":
            routings.append(RoutingSpec("random", {"router": "layer's own router, random init"}))
        elif r == "skewed":
            routings.append(RoutingSpec("skewed", {"zipf_s": args.zipf_s, "seed": args.seed}))
        elif r.startswith("replay:") and len(r) > len("replay:"):
            path = r[len("replay:"):]
            try:
                rep = _load_replay(path, args.replay_layer)
            except ValueError as err:
                parser.error(f"argument --routings: {err}")
            for s in shapes:
                if rep["top_k"] != s.top_k:
                    parser.error(f"argument --routings: replay file {path!r} holds top_k={rep['top_k']} ids, "
                                 f"shape {s.name} has top_k={s.top_k}; capture with a matching model or "
                                 "choose a shape with that top_k")
            routings.append(RoutingSpec("replay", {"path": str(path), "layer": rep["layer"],
                                                   "captured_tokens": int(rep["ids"].shape[0]),
                                                   "captured_experts": rep["num_experts"],
                                                   "source": rep["source"]}, rep))
        else:
            parser.error(f"argument --routings: unknown routing {r!r}; allowed: {ROUTING_CHOICES}")
    if not routings:
        parser.error(f"argument --routings: empty; allowed: {ROUTING_CHOICES}")

    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("argument --device: cuda requested but torch.cuda.is_available() is False")
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if use_cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    else:
        device = torch.device("cpu")
    if device.type == "cpu" and not args.tiny and args.tokens * max(s.dim for s in shapes) > 2**22:
        print(f"compare.layer: warning: measuring {args.tokens} tokens/rank of {shapes[0].name}... on "
              "CPU will be very slow (use --tiny or a GPU)", file=sys.stderr)
    variants = [{}]
    for spec in args.switches:
        try:
            variants.append(parse_switches(spec))
        except ValueError as err:
            parser.error(f"argument --switches: {err}")
    return args, Plan(shapes, impls, precisions, routings, args.tokens, args.iters, args.warmup,
                      device, ws, args.device_time, args.cooldown_ms if use_cuda else 0.0, variants,
                      gc_off=args.gc == "titan", power_sampler=args.power_sampler,
                      fp8_weights_per_step=args.fp8_weights_per_step)


#: Device sleep queued before each step of the --device-time pass (ms): above the host's enqueue time of
#: a whole step (a few ms on the H200 hosts seen so far; the record notes it when not).
DEVICE_HEAD_START_MS = 40.0


def _fixed_ids(spec: RoutingSpec, shape: LayerShape, T: int, ws: int, rank: int, seed: int,
               ) -> tuple[torch.Tensor | None, str | None, dict]:
    """This rank's (T, K) int64 ids for a fixed routing (None for "random"), a routing note, and
    extra routing detail."""
    if spec.name == "random":
        return None, None, {}
    if spec.name == "skewed":
        from titan_megamoe.testing import make_routing

        ids = make_routing("skewed", T * ws, shape.experts, shape.top_k, ep=ws, seed=seed,
                           zipf_s=spec.detail["zipf_s"])
        return ids[rank * T:(rank + 1) * T], None, {}
    rep = spec.replay
    ids, E, note = rep["ids"], shape.experts, None
    need = T * ws
    reps = -(-need // ids.shape[0])
    ids = ids.repeat(reps, 1)[:need]  # tile / cut to T x EP rows; rank r takes rows [r*T, (r+1)*T)
    extra = {"tiled": reps > 1, "tile_repeats": reps}
    if rep["num_experts"] != E:
        ids = ids % E
        dup = int((ids.sort(dim=1).values.diff(dim=1) == 0).any(dim=1).sum())
        note = (f"replay ids captured with {rep['num_experts']} experts mapped to {E} by id % {E}"
                + (f"; {dup} of {need} tokens then repeat an expert" if dup else ""))
    return ids[rank * T:(rank + 1) * T].contiguous(), note, extra


def _inputs(shape: LayerShape, T: int, dtype: torch.dtype, device: torch.device, seed: int):
    """This rank's input x (1, T, D) (requires grad) and output gradient g, same for every
    implementation: generated from ``seed`` in fp32, then cast (the fp32 copies are freed before
    the peak-memory counter is reset)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(1, T, shape.dim, device=device, generator=gen).to(dtype)
    g = torch.randn(1, T, shape.dim, device=device, generator=gen).to(dtype)
    return x.requires_grad_(), g


def _run_one(impl, precision, shape, ids, device, mesh, plan, seed, rank, sampler: PowerSampler | None = None) -> dict:
    """Build and time one layer on this rank. Returns the local result (never raises). ``sampler``: the
    clock / power samples of each timing pass go into the result's "power" (compare/power.py)."""
    spec = IMPLS[impl]
    ctx = stock_layer_context(precision, device) if spec.family == "stock" else contextlib.nullcontext()
    moe = None
    try:
        with ctx:
            built = build_layer(impl, precision, shape, device, mesh=mesh, seed=seed, max_tokens=plan.tokens)
            moe = built.module
            if ids is not None:
                counts = torch.bincount(ids.reshape(-1), minlength=shape.experts).to(torch.float32)
                inject_routing(moe, ids, counts)
            params = list(moe.parameters())
            x_in, g = _inputs(shape, plan.tokens, built.dtype, device, seed + 1 + rank)  # own tokens per rank
            # --fp8-weights-per-step: what MegaMoEConverter.post_optimizer_hook does after each optimizer step
            caches = ([m.fp8_cache for m in moe.modules() if getattr(m, "fp8_cache", None) is not None]
                      if plan.fp8_weights_per_step and spec.family == "megamoe" else [])

            def before_step():
                for p in params:
                    p.grad = None
                x_in.grad = None
                for c in caches:
                    c.invalidate()

            def fwd():
                return moe(x_in)

            def bwd(y):
                y.backward(g)

            power = {}

            def timed(name, **kw):
                t_start = time.time()
                out = time_fwd_bwd(fwd, bwd, device=device, iters=plan.iters, before_step=before_step,
                                   gc_off=plan.gc_off, **kw)
                if sampler is not None and sampler.active:
                    power[name] = sampler.window(t_start, time.time())
                return out

            if device.type == "cuda":
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
            samples = timed("idle", warmup=plan.warmup)
            peak = None
            if device.type == "cuda":  # the L2-flush scratch buffer is not the layer's
                peak = (torch.cuda.max_memory_allocated(device) - l2_flush_bytes(device)) / 2**30
            tpe = moe.tokens_per_expert.detach().float().cpu().tolist()
            device_samples = cool_samples = None
            if plan.device_time and device.type == "cuda":
                device_samples = timed("device", warmup=1, head_start_ms=DEVICE_HEAD_START_MS)
            if plan.cooldown_ms > 0 and device.type == "cuda":
                cool_samples = timed("cool", warmup=1, cooldown_ms=plan.cooldown_ms)
            kernels = fp = None
            if spec.family == "megamoe":  # one more step, untimed: the kernels and configs it launched, and what
                from titan_megamoe.kernels.launch import kernel_configs, record_launches  # it computed

                with record_launches() as launched:
                    before_step()
                    y = fwd()
                    bwd(y)
                kernels = kernel_configs(launched)
                fp = numerics.fingerprint(y, x_in, moe)
                del y
        return {"status": "ok", "samples": samples, "peak": peak, "counts": tpe, "notes": built.notes,
                "device_samples": device_samples, "cool_samples": cool_samples, "power": power or None,
                "kernels": kernels, "fingerprint": fp}
    except Exception as err:  # recorded as status "error"; all ranks still reach the gather
        traceback.print_exc()
        msg = f"{type(err).__name__}: {str(err).strip().splitlines()[0][:300] if str(err).strip() else ''}"
        return {"status": "error", "reason": msg}
    finally:
        del moe
        if spec.compile:
            torch._dynamo.reset()
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


#: Precisions whose rows are compared with the same implementation's bf16 row (``numerics_vs_bf16``).
FP8_PRECISIONS = ("fp8", "fp8_bwd")


def _gather(obj, ws: int) -> list:
    if ws == 1:
        return [obj]
    out = [None] * ws
    dist.all_gather_object(out, obj)
    return out


def _fill_measurements(rec: dict, results: list[dict], shape: LayerShape, T: int,
                       rates: dict[str, float | None], cooldown_ms: float = 0.0) -> None:
    bad = [f"rank {i}: {r['reason']}" for i, r in enumerate(results) if r["status"] != "ok"]
    if bad:
        rec.update(status="error", reason="; ".join(bad))
        return
    for phase in ("fwd", "bwd", "fwdbwd"):
        q = percentiles(max_over_ranks([r["samples"][phase] for r in results]))
        rec[f"{phase}_ms"], rec[f"{phase}_p20_ms"], rec[f"{phase}_p80_ms"] = q["median"], q["p20"], q["p80"]
    for phase in ("fwd", "fwdbwd"):
        rec[f"host_{phase}_ms"] = percentiles(max_over_ranks([r["samples"][f"host_{phase}"] for r in results]))["median"]
    if all(r.get("device_samples") for r in results):
        for phase in ("fwd", "bwd", "fwdbwd"):
            rec[f"{phase}_device_ms"] = percentiles(max_over_ranks([r["device_samples"][phase] for r in results]))["median"]
        host_max = max(max(r["device_samples"]["host_fwdbwd"]) for r in results)
        rec["device_time_head_start_ms"] = DEVICE_HEAD_START_MS
        if host_max >= DEVICE_HEAD_START_MS:  # the device caught up with the host: not device time alone
            rec["notes"] = list(results[0]["notes"]) + [
                f"device-time pass: a step's host enqueue took {host_max:.1f} ms >= the {DEVICE_HEAD_START_MS} ms head "
                "start; *_device_ms include host time"]
    if all(r.get("cool_samples") for r in results):
        for phase in ("fwd", "bwd", "fwdbwd"):
            rec[f"{phase}_cool_ms"] = percentiles(max_over_ranks([r["cool_samples"][phase] for r in results]))["median"]
        rec["cooldown_ms"] = cooldown_ms
    if any(r.get("power") for r in results):
        rec["power"] = [r.get("power") for r in results]
    peaks = [r["peak"] for r in results if r["peak"] is not None]
    rec["peak_gib"] = max(peaks) if peaks else None
    rec["kernel_configs"] = results[0].get("kernels")  # rank 0's: every rank runs the same configs
    counts = [sum(c) for c in zip(*[r["counts"] for r in results])]
    mean = sum(counts) / len(counts)
    rec["load_imbalance"] = max(counts) / mean if mean > 0 else None
    rec["notes"] = rec["notes"] or results[0]["notes"]
    errs = [r["numerics"] for r in results if r.get("numerics")]
    if errs:  # a switch row against its default row, worst over ranks (nan first)
        rec["numerics_vs_default"] = numerics.worst(errs)
        rec["numerics_flag"] = numerics.flag(rec["numerics_vs_default"])
        if rec["numerics_flag"]:
            rec["notes"] = list(rec["notes"]) + [rec["numerics_flag"]]
    errs = [r["numerics_bf16"] for r in results if r.get("numerics_bf16")]
    if errs:  # an FP8 row against the same implementation's bf16 row: the recipe's error (reported, not flagged)
        rec["numerics_vs_bf16"] = numerics.worst(errs)
    fl = flop_model.phase_flops(T, shape.top_k, shape.dim, shape.hidden)
    rec["flops"] = fl
    rec["tflops"] = flop_model.tflops(fl["fwdbwd"], rec["fwdbwd_ms"])
    rec["tflops_fwd"] = flop_model.tflops(fl["fwd"], rec["fwd_ms"])
    rec["tflops_bwd"] = flop_model.tflops(fl["bwd"], rec["bwd_ms"])
    kf, kb = GEMM_KINDS[rec["precision"]]
    floor = flop_model.floor_ms(fl["fwd"], fl["bwd"], rates.get(kf), rates.get(kb))
    rec["floor_ms"], rec["floor_fwd_ms"] = floor["fwdbwd"], floor["fwd"]
    rec["floor_ratio"] = rec["fwdbwd_ms"] / floor["fwdbwd"] if floor["fwdbwd"] else None
    rec["floor_ratio_fwd"] = rec["fwd_ms"] / floor["fwd"] if floor["fwd"] else None
    rec.update(status="ok", reason=None)


def _init_distributed(plan: Plan, timeout_s: float) -> tuple[int, bool, str | None]:
    """(rank, whether we created the process group, backend name)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), False, dist.get_backend()
    if plan.world_size == 1:
        return 0, False, None
    timeout = datetime.timedelta(seconds=timeout_s)
    if plan.device.type == "cuda":
        torch.cuda.set_device(plan.device)
        dist.init_process_group("nccl", device_id=plan.device, timeout=timeout)
    else:
        dist.init_process_group("gloo", timeout=timeout)
    return dist.get_rank(), True, dist.get_backend()


def main(argv: list[str] | None = None) -> int:
    """Run the harness; returns 0 if every combination ran or was skipped, 1 if any failed."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args, plan = parse_options(argv)
    device, ws = plan.device, plan.world_size
    if device.type == "cuda":
        torch.cuda.set_device(device)
    rank, own_pg, backend = _init_distributed(plan, args.timeout_s)
    mesh = None
    if ws > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (ws,), mesh_dim_names=("ep",))
    threads = torch.get_num_threads()
    if args.tiny and device.type == "cpu":
        # one intra-op thread: OpenMP barriers on a busy small machine stall for hundreds of ms
        torch.set_num_threads(1)
    try:
        return _main(args, argv, plan, rank, mesh, backend)
    finally:
        torch.set_num_threads(threads)
        if own_pg:
            dist.destroy_process_group()


def _main(args, argv, plan: Plan, rank: int, mesh, backend) -> int:
    from tqdm import tqdm

    device, ws, T = plan.device, plan.world_size, plan.tokens
    say = (lambda msg: tqdm.write(msg, file=sys.stdout)) if rank == 0 else (lambda msg: None)

    # Dense GEMM rates of this run (slowest rank), for the compute floor of each precision.
    kinds = sorted({k for p in plan.precisions for k in GEMM_KINDS[p]})
    gemm_iters = (20, 5) if device.type == "cuda" else (5, 1)  # (timed, warm-up) calls
    local_rates = {k: measure_gemm_tflops(k, device, iters=gemm_iters[0], warmup=gemm_iters[1])
                   for k in kinds}
    all_rates = _gather({k: v[0] for k, v in local_rates.items()}, ws)
    rates = {k: (min(r[k] for r in all_rates) if all(r[k] for r in all_rates) else None) for k in kinds}
    hostnames = _gather(socket.gethostname(), ws)
    sampler = PowerSampler(device.index or 0, mode=plan.power_sampler) if device.type == "cuda" else None
    flush_l2(device)  # allocate the L2-flush buffer before any peak-memory window opens

    records: list[dict] = []
    n_impl_rows = sum(len(plan.variants) if IMPLS[i].family == "megamoe" else 1 for i in plan.impls)
    total = len(plan.shapes) * len(plan.routings) * n_impl_rows * len(plan.precisions)
    late = [p for p in plan.precisions if p in FP8_PRECISIONS and "bf16" in plan.precisions
            and plan.precisions.index(p) < plan.precisions.index("bf16")]
    if late:
        say(f"note: {', '.join(late)} come before bf16 in --precisions: their numerics_vs_bf16 (the FP8 error against "
            "our bf16 row) needs bf16 first and is left out")
    bar = tqdm(total=total, disable=rank != 0, file=sys.stderr, desc="compare.layer", dynamic_ncols=True)
    with sampler if sampler is not None else contextlib.nullcontext():
        _run_all(plan, args, rank, mesh, ws, T, rates, sampler, records, bar, say)
    bar.close()
    fill_speedups(records)

    if rank == 0:
        run = provenance(device=device, world_size=ws, dist_backend=backend, hostnames=hostnames,
                         argv=argv, options={k: v for k, v in vars(args).items()})
        run["gemm_rates_tflops"] = rates
        run["gemm_rate_method"] = {k: v[1] for k, v in local_rates.items()}
        run["timer"] = timer_name(device)
        run["cpu_threads"] = torch.get_num_threads()
        run["fp8_weights_per_step"] = plan.fp8_weights_per_step
        run["gc_during_timing"] = ("off (TorchTitan trainer's protocol), collected before each pass" if plan.gc_off
                                   else "python default (automatic)")
        if sampler is not None:
            run["power_sampling"] = sampler.describe()
            run["power_limit_w"] = sampler.power_limit_w()
        _report(args, plan, run, records, rates, ws, device)
    if ws > 1:
        dist.barrier()
    return 1 if any(r["status"] == "error" for r in records) else 0


def _run_all(plan: Plan, args, rank: int, mesh, ws: int, T: int, rates, sampler, records: list, bar, say) -> None:
    device = plan.device
    defaults = {}  # (shape, routing, impl, precision) -> this rank's fingerprint of the row without switches
    for shape in plan.shapes:
        for rspec in plan.routings:
            ids, note, extra = _fixed_ids(rspec, shape, T, ws, rank, args.seed)
            if ids is not None:
                ids = ids.to(device)
            for impl in plan.impls:
                spec = IMPLS[impl]
                for precision in plan.precisions:
                    for sw in (plan.variants if spec.family == "megamoe" else [{}]):
                        what = f"{impl}/{precision}" + (f" [{switch_label(sw)}]" if sw else "")
                        bar.set_postfix_str(f"{shape.name} {rspec.name} {what}")
                        dtype = model_dtype(precision)
                        rec = new_record(implementation=impl, family=spec.family, backend=spec.backend,
                                         compile=spec.compile, precision=precision,
                                         dtype=str(dtype).replace("torch.", ""), shape=shape.as_dict(),
                                         routing=rspec.name, routing_detail={**rspec.detail, **extra},
                                         ep=ws, tokens_per_rank=T, iters=plan.iters, warmup=plan.warmup,
                                         switches=sw)
                        rec["routing_note"] = note
                        why = skip_reason(impl, precision, device)
                        if why is not None:
                            rec.update(status="skipped", reason=why)
                            say(f"skip {what} {shape.name} {rspec.name}: {why}")
                        else:
                            with override_switches(sw):
                                local = _run_one(impl, precision, shape, ids, device, mesh, plan, args.seed, rank,
                                                 sampler)
                            fp, key = local.pop("fingerprint", None), (shape.name, rspec.name, impl, precision)
                            if fp is not None and not sw:
                                defaults[key] = fp
                                bf16 = defaults.get((shape.name, rspec.name, impl, "bf16"))
                                if precision in FP8_PRECISIONS and bf16 is not None:  # same weights, x, routing
                                    local["numerics_bf16"] = numerics.rel_errs(fp, bf16)
                            elif fp is not None and key in defaults:
                                local["numerics"] = numerics.rel_errs(fp, defaults[key])
                            _fill_measurements(rec, _gather(local, ws), shape, T, rates, plan.cooldown_ms)
                            if rec["status"] != "ok":
                                say(f"ERROR {what} {shape.name} {rspec.name}: {rec['reason']}")
                            elif rec.get("numerics_flag"):
                                say(f"WARNING {what} {shape.name} {rspec.name}: {rec['numerics_flag']}")
                        records.append(rec)
                        bar.update(1)


def _report(args, plan: Plan, run: dict, records: list[dict], rates, ws: int, device) -> None:
    """Rank 0: write the JSON, print the tables, draw the chart."""
    out = Path(args.out) if args.out else default_out_path(run["gpu"], device.type, ws,
                                                           note="tiny" if args.tiny else None)
    write_results(out, run, records)
    print(markdown_table(records))
    if plan.device_time or plan.cooldown_ms > 0:
        print("\n" + device_time_table(records))
    acc = numerics.table(records)
    if acc:
        print("\nFP8 rows against the same implementation's bf16 row (same weights, input and routing; relative "
              "errors of strided samples, compare/numerics.py):\n" + acc)
    if any(r.get("power") for r in records):
        print("\n" + power_table(records))
    rate_txt = ", ".join(f"{k} {v:.4g}" if v else f"{k} n/a" for k, v in rates.items())
    print(f"\nGEMM rates (TFLOP/s, this run): {rate_txt}; times: median of {plan.iters} steps, "
          f"max over {ws} rank(s); wrote {out}")
    if not args.no_plot:
        from compare.plots import layer_chart

        png = Path(args.plot) if args.plot else out.with_suffix(".png")
        layer_chart(records, png, title=f"{run['gpu']} x{ws}  {run['date_utc']}  {run['git_rev'] or ''}"[:120])
        print(f"wrote {png}")
    sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
