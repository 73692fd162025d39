"""python -m compare.ep_overlap: how much of the expert-parallel layer is NVLink, compute and barriers.

    torchrun --nproc_per_node R -m compare.ep_overlap [options]   # R GPUs, symmetric memory (NCCL)
    python -m compare.ep_overlap --tiny                           # CPU: 2 emulated ranks, interpreter
    torchrun --nproc_per_node 2 -m compare.ep_overlap --tiny      # CPU: 2 gloo processes, shared memory

For every (shape, routing, precision, mode) it drives the EP Triton backend's host steps
(``ops/ep_backend.py`` for bf16, ``ops/ep_fp8_backend.py`` for "fp8" / "fp8_bwd": what the custom ops
run, without autograd) on random bf16 weights and tokens and measures, median of ``--iters`` after
``--warmup`` (each sample the max over ranks; a barrier and an L2 flush before each):

    full      the whole forward, and forward + backward
    comm      the same dispatch_push / combine_push / dscore_push / combine_sum kernels and barriers,
              same routing and sizes, no GEMMs (rows to combine pre-computed once)
    compute   routing layout + the grouped GEMM kernels on the received rows (same counts), no
              communication, no barrier
    phases    CUDA events between the phases of one forward + backward (``mark`` labels of the steps)
    profile   torch.profiler over ``--profile-iters`` full steps: top kernels by device time, the
              summed kernel time, the busy time (union of kernel intervals on all streams) and the
              idle gap = kernel span - busy time (launch latency, barrier skew, host syncs)

and prints ``overlap = (comm + compute - full) / min(comm, compute)``: 0 when the phases run back to
back (v1), 1 when the shorter one is completely hidden, negative when the layer costs more than its
parts (barrier waits, launch gaps). NVLink bytes per rank come from the routing (rows that cross to
another rank; metadata excluded), with the comm-alone GB/s they imply.

FP8 (``--precisions fp8,fp8_bwd``; FP8 EP v1 only, so with modes "v1" / "v1b" alone): the FP8 weights of
every rank come from ``fp8_backend.prepare_weights`` once, before anything is timed (as the weight cache
hits on every call after an optimizer step's first): no weight quantization is in any time. Mode "v1" of
"fp8" dispatches the forward's x as FP8 (e4m3 rows + scales quantized in the push kernel,
``ep_comm.dispatch_push_fp8``, the default payload); mode "v1b" ("fp8" only) as bf16 rows quantized on the
receiving rank (the v1 payload, ``ep_fp8_backend.FP8_DISPATCH = "bf16"``): ``--precisions fp8 --modes
v1,v1b`` compares the two in one run (records say ``x_payload``). "comm" is the same driver as bf16's
(v1 kernels and barriers, on the FP8 path's rows: layout BM = 128; the FP8 push in the forward of
"v1"); "compute" is the receive layout, the placed-row index and ``fp8_experts_fwd`` /
``fp8_experts_bwd`` on the received rows ("v1": on x quantized once before timing, since the backward's
dy overwrites the received FP8 slab, which shares its bytes). The phases carry the finer FP8 labels
(``quant_x`` (v1b only), ``gemm1``, ..., ``quant_dgate_up``, ``wgrad_w13``, ``gemm1_dgrad``; ``ops/fp8_backend.py``).

Times on CPU (``--tiny``) are the interpreter's and, with emulated ranks, the sum over the ranks run in
lockstep: they exercise the harness, they measure nothing. Output: a markdown table on stdout and a
JSON file (``schema titan_megamoe.compare.ep_overlap/1``, provenance as compare/records.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from compare.records import default_out_path, provenance
from compare.shapes import LayerShape, parse_shape, shape_choices
from compare.timing import barrier, flush_l2, max_over_ranks, percentiles, sync

__all__ = ["main", "build_parser", "overlap_fraction", "SCHEMA"]

SCHEMA = "titan_megamoe.compare.ep_overlap/1"
TINY = dict(shapes="custom:16,16,4,2", tokens=16, iters=1, warmup=0, profile_iters=1)
DEFAULTS = dict(shapes="qwen3-30b-a3b,qwen3-235b-a22b", tokens=16384, iters=20, warmup=5, profile_iters=3)
MODES = ("v1", "v2", "v3", "v1b")
PRECISIONS = ("bf16", "fp8", "fp8_bwd")
FP8_MODES = ("v1", "v1b")  # FP8 EP has no overlap mode yet (ops/ep_fp8_backend.py); v1b: "fp8" with bf16 x rows
FP8_WEIGHTS_NOTE = ("FP8 weights quantized once per rank before timing (fp8_backend.prepare_weights, no cache), "
                    "as the weight cache's hits after an optimizer step's first call: no weight quantization "
                    "in any time")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m compare.ep_overlap", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", help=f"comma list of: {shape_choices()} (default {DEFAULTS['shapes']})")
    p.add_argument("--tokens", type=int, help="tokens per rank (default 16384)")
    p.add_argument("--routings", default="random", help="comma list of: random, skewed (default random)")
    p.add_argument("--zipf-s", type=float, default=1.2, help="Zipf exponent of 'skewed' (default 1.2)")
    p.add_argument("--modes", default="v1", help=f"comma list of: {', '.join(MODES)} (default v1; v2 = x rows "
                   "streamed into GEMM1 through per-block arrival flags, ops/ep_backend.ep_forward_steps_v2; v3 = v1's "
                   "forward, backward with the dx / d score pushes under the wgrads, ep_backward_steps_v3; v1b = "
                   "precision fp8's v1 with the forward's x dispatched as bf16 rows instead of FP8)")
    p.add_argument("--precisions", default="bf16", help=f"comma list of: {', '.join(PRECISIONS)} (default bf16; "
                   "fp8 / fp8_bwd drive ops/ep_fp8_backend's steps with FP8 weights quantized once before timing, "
                   "mode v1 only: other modes are recorded as skipped for them)")
    p.add_argument("--iters", type=int, help="timed iterations per measurement (default 20)")
    p.add_argument("--warmup", type=int, help="untimed iterations first (default 5)")
    p.add_argument("--profile-iters", type=int, help="profiled full steps (default 3; 0 = no profile)")
    p.add_argument("--emulate-ranks", type=int, default=2,
                   help="ranks emulated in one process when not under torchrun (CPU; default 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="JSON path (default benchmarks/results/ep_overlap_<hw>_<date>.json, "
                   "outputs/ on CPU)")
    p.add_argument("--timeout-s", type=float, default=600.0, help="process-group timeout (default 600)")
    p.add_argument("--tiny", action="store_true", help=f"CPU smoke run: defaults {TINY}")
    return p


def overlap_fraction(full: float, comm: float, compute: float) -> float | None:
    """(comm + compute - full) / min(comm, compute): the share of the shorter part hidden by the other."""
    m = min(comm, compute)
    return (comm + compute - full) / m if m > 0 else None


# --------------------------------------------------------------------------------------------------
# The ranks this process drives: one (real peers, barriers) or all R (emulated, lockstep)
# --------------------------------------------------------------------------------------------------

class Driver:
    """Runs step generators (``ops/ep_backend.py`` style) for the local ranks.

    ``ctxs`` / ``data``: one entry per local rank (index i); ``real``: peers with a real barrier
    (``run_with_barriers``), else emulated ranks in lockstep (``run_lockstep``). ``precision``: "bf16"
    (``ops/ep_backend.py``) or "fp8" / "fp8_bwd" (``ops/ep_fp8_backend.py``, with ``wq[i]`` the FP8
    weights of local rank i from ``fp8_backend.prepare_weights`` and ``ctxs`` at block_m 128).
    """

    def __init__(self, ctxs: list, data: list[dict], real: bool, device: torch.device, precision: str = "bf16",
                 wq: list | None = None):
        self.ctxs, self.data, self.real, self.device = ctxs, data, real, device
        self.precision, self.wq = precision, wq

    def for_fp8(self, precision: str) -> "Driver":
        """The same peers, workspace and data, the FP8 steps' contexts (block_m 128) and FP8 weights
        quantized now (once: nothing below times it)."""
        from titan_megamoe.ops.fp8_backend import FP8_BLOCK_M, prepare_weights

        fwd = precision == "fp8"
        ctxs = [dataclasses.replace(c, block_m=FP8_BLOCK_M) for c in self.ctxs]
        wq = [prepare_weights(d["w1"], d["w2"], d["w3"], fp8_forward=fwd, cache=None, layer_name=f"ovl.rank{i}")
              for i, d in enumerate(self.data)]
        drv = Driver(ctxs, self.data, self.real, self.device, precision, wq)
        drv.ids_all = self.ids_all
        return drv

    def run(self, make) -> list:
        from titan_megamoe.ops.ep_backend import run_lockstep, run_with_barriers

        if self.real:
            return [run_with_barriers(make(0), self.ctxs[0].peers)]
        return run_lockstep([make(i) for i in range(len(self.ctxs))], [c.peers for c in self.ctxs])


def _make_data(shape: LayerShape, T: int, R: int, ranks: list[int], routing: str, zipf_s: float, seed: int,
               device: torch.device) -> tuple[list[dict], torch.Tensor]:
    """Per local rank: x, dout (T, D) bf16, ids (T, K) int64, scores (T, K) fp32 (normalized), local
    w1 / w3 (E_l, F, D), w2 (E_l, D, F) bf16; plus all ranks' ids (R*T, K) for the byte model."""
    from titan_megamoe.testing import make_routing

    D, F, E, K = shape.dim, shape.hidden, shape.experts, shape.top_k
    kind = "uniform" if routing == "random" else routing
    ids_all = make_routing(kind, R * T, E, K, ep=R, seed=seed, zipf_s=zipf_s)
    e_l = E // R
    out = []
    for r in ranks:
        g = torch.Generator(device=device).manual_seed(seed + 1000 + r)
        rnd = lambda *s: torch.randn(*s, device=device, generator=g)  # noqa: E731
        s = torch.rand(T, K, device=device, generator=g)
        out.append(dict(
            x=rnd(T, D).bfloat16(), dout=rnd(T, D).bfloat16(),
            ids=ids_all[r * T:(r + 1) * T].to(device), scores=(s / s.sum(1, keepdim=True)).contiguous(),
            w1=(rnd(e_l, F, D) * D**-0.5).bfloat16(), w3=(rnd(e_l, F, D) * D**-0.5).bfloat16(),
            w2=(rnd(e_l, D, F) * F**-0.5).bfloat16()))
    return out, ids_all


def x_row_bytes(D: int, payload: str) -> int:
    """Bytes of one dispatched x row: bf16 ``2 D``; FP8 ``D`` e4m3 + ``D / 128`` fp32 scales."""
    return 2 * D if payload == "bf16" else D + 4 * (D // 128)


def nvlink_bytes(ids_all: torch.Tensor, R: int, T: int, D: int, e_l: int, x_payload: str = "bf16") -> dict[str, int]:
    """Bytes one rank sends to other ranks (max over ranks), v1's protocol: x rows once per (token,
    remote rank holding one of its experts), bf16 or (``x_payload`` "fp8", the forward of "fp8") e4m3 +
    scales (:func:`x_row_bytes`); combine rows (``comm.workspace.COMBINE_DTYPE``: bf16, or fp32) back once
    per such pair; the backward sends bf16 x and dy rows and the dx rows back (d scores and ids / scores
    metadata excluded)."""
    from titan_megamoe.comm.workspace import COMBINE_DTYPE

    cb = COMBINE_DTYPE.itemsize
    owner = ids_all.view(R, T, -1) // e_l  # (R, T, K) rank holding each slot's expert
    sent_rows, recv_rows = [0] * R, [0] * R
    for src in range(R):
        for dst in range(R):
            if dst != src:
                n = int((owner[src] == dst).any(-1).sum())
                sent_rows[src] += n  # src pushes n rows to dst
                recv_rows[dst] += n  # dst pushes n combine rows back to src
    fwd = [sent_rows[r] * x_row_bytes(D, x_payload) + recv_rows[r] * D * cb for r in range(R)]
    bwd = [sent_rows[r] * D * 4 + recv_rows[r] * D * cb for r in range(R)]
    return {"fwd": max(fwd), "bwd": max(bwd), "fwdbwd": max(f + b for f, b in zip(fwd, bwd))}


# --------------------------------------------------------------------------------------------------
# What is measured: generators yielding at each barrier
# --------------------------------------------------------------------------------------------------

def _x_payload(driver: Driver, mode: str) -> str:
    """Payload of the forward's x rows: "fp8" for precision fp8 in mode v1, else "bf16"."""
    return "fp8" if driver.precision == "fp8" and mode != "v1b" else "bf16"


def _full(driver: Driver, mode: str, bwd: bool, mark=None):
    if driver.precision != "bf16":
        return _full_fp8(driver, mode, bwd, mark)
    from titan_megamoe.ops import ep_backend as eb

    fwd_steps, bwd_steps = eb.FORWARD_STEPS[mode], eb.BACKWARD_STEPS[mode]

    def make(i):
        c, d = driver.ctxs[i], driver.data[i]
        m = mark(i) if mark else eb._no_mark
        out, gate_up, layout = yield from fwd_steps(c, d["x"], d["ids"], d["scores"], d["w1"], d["w2"], d["w3"],
                                                    mark=m)
        if not bwd:
            return out, gate_up, layout
        return (yield from bwd_steps(c, d["dout"], d["x"], d["ids"], d["scores"], d["w1"], d["w2"], d["w3"],
                                     gate_up, layout, mark=m))
    return make


def _full_fp8(driver: Driver, mode: str, bwd: bool, mark=None):
    """FP8 EP v1 (``ep_fp8_forward_steps`` / ``ep_fp8_backward_steps``), bf16 weight gradients; the x
    payload of "fp8" by mode (v1: FP8, v1b: bf16)."""
    from titan_megamoe.ops import ep_backend as eb
    from titan_megamoe.ops.ep_fp8_backend import ep_fp8_backward_steps, ep_fp8_forward_steps

    fp8_forward = driver.precision == "fp8"
    payload = _x_payload(driver, mode)

    def make(i):
        c, d, wq = driver.ctxs[i], driver.data[i], driver.wq[i]
        m = mark(i) if mark else eb._no_mark
        out, gate_up, layout = yield from ep_fp8_forward_steps(c, d["x"], d["ids"], d["scores"], d["w1"], d["w2"],
                                                               d["w3"], wq, fp8_forward, f"ovl.rank{i}", mark=m,
                                                               payload=payload)
        if not bwd:
            return out, gate_up, layout
        return (yield from ep_fp8_backward_steps(c, d["dout"], d["x"], d["ids"], d["scores"], wq[:6], gate_up, layout,
                                                 torch.bfloat16, f"ovl.rank{i}", mark=m))
    return make


def _compute(driver: Driver, bwd: bool, mode: str = "v1"):
    """Layout + GEMMs on the rows already in this rank's workspace (left by an earlier dispatch)."""
    if driver.precision != "bf16":
        return _compute_fp8(driver, bwd, mode)
    from titan_megamoe.kernels.grouped_gemm import gemm1_swiglu_fwd, gemm2_scatter_fwd
    from titan_megamoe.kernels.grouped_gemm_bwd import gemm1_dgrad, gemm2_dgrad_swiglu_bwd
    from titan_megamoe.kernels.grouped_gemm_wgrad import wgrad_w2, wgrad_w13
    from titan_megamoe.kernels.routing import build_routing_layout

    def make(i):
        c, d = driver.ctxs[i], driver.data[i]
        layout = build_routing_layout(c.received("ids"), c.experts_per_rank, c.block_m, max_rows=c.max_rows)
        x_r, sc_r = c.received("x"), c.received("scores")
        gate_up, h = gemm1_swiglu_fwd(x_r, d["w1"], d["w3"], layout)
        y_rows = gemm2_scatter_fwd(h, d["w2"], sc_r, layout, by_row=True)
        res = dict(layout=layout, y_rows=y_rows)
        if bwd:
            dy_r = c.received("dy")
            hs = torch.empty_like(h)
            dgate_up, part = gemm2_dgrad_swiglu_bwd(dy_r, d["w2"], gate_up, sc_r, layout, hs_out=hs)
            wgrad_w2(dy_r, gate_up, sc_r, layout, hs_NF=hs)
            wgrad_w13(dgate_up, x_r, layout)
            res.update(dx_rows=gemm1_dgrad(dgate_up, d["w1"], d["w3"], layout), part=part)
        return res
        yield  # a generator with no barrier: no communication at all
    return make


def _compute_fp8(driver: Driver, bwd: bool, mode: str = "v1"):
    """FP8 EP v1's local compute alone: receive layout (BM = 128), placed-row index, ``fp8_experts_fwd``
    (+ ``fp8_experts_bwd``) on the rows already in this rank's workspace; no communication. FP8 x
    payload (mode v1 of "fp8"): the received x rows quantized here, once, before anything is timed (as
    the source's push kernel does; the received FP8 slab itself was overwritten by the backward's dy,
    which shares its bytes), and GEMM1 fed from them: no ``quant_x`` pass in the time."""
    from titan_megamoe.kernels.fp8_quant import quantize_act_1x128
    from titan_megamoe.kernels.routing import build_routing_layout
    from titan_megamoe.ops.fp8_backend import FP8_BLOCK_M, fp8_experts_bwd, fp8_experts_fwd, placed_token_rows

    fp8_forward = driver.precision == "fp8"
    x_q = [None] * len(driver.ctxs)
    if _x_payload(driver, mode) == "fp8":  # here, not in make(): outside the timed region
        for i, c in enumerate(driver.ctxs):
            layout = build_routing_layout(c.received("ids"), c.experts_per_rank, FP8_BLOCK_M, max_rows=c.max_rows)
            x_q[i] = quantize_act_1x128(c.received("x"), placed_token_rows(layout), 1)

    def make(i):
        c, d, wq = driver.ctxs[i], driver.data[i], driver.wq[i]
        layout = build_routing_layout(c.received("ids"), c.experts_per_rank, FP8_BLOCK_M, max_rows=c.max_rows)
        placed = placed_token_rows(layout)
        x_r, sc_r = c.received("x"), c.received("scores")
        y_rows, gate_up = fp8_experts_fwd(x_r, sc_r, layout, d["w1"], d["w2"], d["w3"], wq, fp8_forward,
                                          f"ovl.rank{i}", by_row=True, x_quantized=x_q[i],
                                          x_rows_index=placed if fp8_forward and x_q[i] is None else None)
        res = dict(layout=layout, y_rows=y_rows)
        if bwd:
            dx_rows, part, *_ = fp8_experts_bwd(c.received("dy"), x_r, sc_r, wq[:6], gate_up, layout, torch.bfloat16,
                                                f"ovl.rank{i}", dout_rows_index=placed_token_rows(layout))
            res.update(dx_rows=dx_rows, part=part)
        return res
        yield  # a generator with no barrier: no communication at all
    return make


def _comm(driver: Driver, pre: list[dict], bwd: bool, mode: str = "v1"):
    """v1's communication kernels and barriers alone, on rows pre-computed by ``_compute`` (the same
    kernels for FP8 EP v1: bf16 rows out, or the FP8 push of x in the forward of "fp8" mode v1; fp32
    combine rows back, on its layout)."""
    from titan_megamoe.kernels import ep_comm

    fp8_x = _x_payload(driver, mode) == "fp8"

    def make(i):
        c, d, q = driver.ctxs[i], driver.data[i], pre[i]
        p, ws, e_l = c.peers, c.ws, c.experts_per_rank
        for phase in ("fwd", "bwd") if bwd else ("fwd",):
            yield f"{phase}.before_dispatch"
            if phase == "fwd" and fp8_x:  # x quantized in the push kernel (the time of the quantization included)
                ep_comm.dispatch_push_fp8(d["x"], d["ids"], d["scores"], ws, p.ptr_table(), p.rank, e_l)
            else:
                ep_comm.dispatch_push(d["x"], d["dout"] if phase == "bwd" else None, d["ids"], d["scores"], ws,
                                      p.ptr_table(), p.rank, e_l)
            yield f"{phase}.after_dispatch"
            if phase == "bwd":
                ep_comm.dscore_push(q["part"], q["layout"], ws, p.ptr_table())
            ep_comm.combine_push(q["y_rows" if phase == "fwd" else "dx_rows"], q["layout"], ws, p.ptr_table(),
                                 p.rank)
            yield f"{phase}.after_combine_push"
            ep_comm.combine_sum(c.region("comb"), d["ids"], e_l, torch.bfloat16)
    return make


# --------------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------------

class _Clock:
    """CUDA event on GPU, perf_counter on CPU."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.ev = torch.cuda.Event(enable_timing=True) if self.cuda else None
        self.t = 0.0

    def record(self):
        if self.cuda:
            self.ev.record()
        else:
            self.t = time.perf_counter()
        return self

    def ms_since(self, other: "_Clock") -> float:
        return other.ev.elapsed_time(self.ev) if self.cuda else (self.t - other.t) * 1e3


def _time(driver: Driver, make, iters: int, warmup: int) -> list[float]:
    dev = driver.device
    for _ in range(warmup):
        driver.run(make)
    samples = []
    for _ in range(iters):
        flush_l2(dev)
        barrier(dev)
        a = _Clock(dev).record()
        driver.run(make)
        b = _Clock(dev).record()
        sync(dev)
        samples.append(b.ms_since(a))
    return samples


def _phases(driver: Driver, mode: str, iters: int) -> dict[str, list[float]]:
    """Per phase label (``fwd.gemm1``, ``bwd.barrier1``, ...): ms of this process's iterations
    (local rank 0's marks)."""
    dev = driver.device
    per: dict[str, list[float]] = {}
    for _ in range(iters):
        marks: list[tuple[str, _Clock]] = []
        phase = ["fwd"]

        def mark(i):
            def m(label):
                if i == 0:
                    marks.append((f"{phase[0]}.{label}", _Clock(dev).record()))
                    if label == "combine_sum":  # the forward's last label
                        phase[0] = "bwd"
            return m
        flush_l2(dev)
        barrier(dev)
        start = _Clock(dev).record()
        driver.run(_full(driver, mode, True, mark))
        sync(dev)
        prev = start
        for label, clk in marks:
            per.setdefault(label, []).append(clk.ms_since(prev))
            prev = clk
    return per


def _profile(driver: Driver, mode: str, iters: int, top: int = 12) -> dict:
    """Top kernels (device time) of ``iters`` full fwd+bwd steps, summed kernel time, busy time (union
    of kernel intervals) and the idle gap inside the kernel span, all per step; CPU: CPU ops."""
    from compare.profile import kernel_table

    dev = driver.device
    use_device = dev.type == "cuda"
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if use_device else [])
    barrier(dev)
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(iters):
            driver.run(_full(driver, mode, True))
        sync(dev)
    rows = kernel_table(prof.key_averages(), iters, use_device)
    res = {"time_kind": "device kernel" if use_device else "CPU self", "top": rows[:top],
           "kernel_ms": sum(r["ms_per_step"] for r in rows), "busy_ms": None, "span_ms": None, "idle_ms": None}
    if use_device:
        iv = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                    if str(getattr(e, "device_type", "")).endswith("CUDA") and e.time_range.end > e.time_range.start)
        busy, cur = 0.0, None
        for s, e in iv:
            if cur is None or s > cur[1]:
                if cur is not None:
                    busy += cur[1] - cur[0]
                cur = [s, e]
            else:
                cur[1] = max(cur[1], e)
        if cur is not None:
            busy += cur[1] - cur[0]
        span = (iv[-1][1] - iv[0][0]) if iv else 0.0
        res.update(busy_ms=busy / 1e3 / iters, span_ms=span / 1e3 / iters, idle_ms=(span - busy) / 1e3 / iters)
    return res


def _gather(obj, real: bool):
    if not (real and dist.is_initialized() and dist.get_world_size() > 1):
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _stat(per_rank: list[list[float]]) -> dict:
    q = percentiles(max_over_ranks(per_rank))
    return {"ms": q["median"], "p20_ms": q["p20"], "p80_ms": q["p80"]}


# --------------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------------

def _setup(args, shape: LayerShape, T: int, routing: str, device, real: bool, R: int, rank: int) -> Driver:
    from titan_megamoe.comm.peers import emulated_group, make_peers
    from titan_megamoe.comm.workspace import WorkspaceLayout
    from titan_megamoe.ops.ep_backend import EPRank
    from titan_megamoe.ops.triton_backend import _block_m

    ws = WorkspaceLayout.build(R, T, shape.dim, shape.top_k)
    e_l = shape.experts // R
    ranks = [rank] if real else list(range(R))
    data, ids_all = _make_data(shape, T, R, ranks, routing, args.zipf_s, args.seed, device)
    if real:
        peers = [make_peers(dist.group.WORLD, ws.nbytes, tag=f"ovl_{T}_{shape.dim}_{shape.top_k}")]
    else:
        peers = emulated_group(R, ws.nbytes, device)
    cap = R * T * shape.top_k  # nothing dropped: the receive capacity of every routing
    ctxs = [EPRank(p, ws, e_l, cap, _block_m()) for p in peers]
    drv = Driver(ctxs, data, real, device)
    drv.ids_all = ids_all
    return drv


def _measure(args, drv: Driver, shape: LayerShape, T: int, routing: str, mode: str, R: int) -> dict:
    from titan_megamoe.comm.workspace import COMBINE_DTYPE
    from titan_megamoe.ops.fp8_backend import NONFINITE

    it, wu = args.iters, args.warmup
    rec = dict(shape=shape.as_dict(), routing=routing, precision=drv.precision, mode=mode, ep=R, tokens_per_rank=T,
               iters=it, warmup=wu, emulated=not drv.real, status="ok", reason=None,
               weights=FP8_WEIGHTS_NOTE if drv.precision != "bf16" else "bf16", x_payload=_x_payload(drv, mode),
               # dtype of the combine rows (TITAN_MEGAMOE_COMBINE_DTYPE, comm/workspace.py)
               combine_dtype=str(COMBINE_DTYPE).replace("torch.", ""))
    drv.run(_full(drv, mode, True))  # fills every workspace region (x, dy, ids, scores) once
    pre = drv.run(_compute(drv, True, mode))
    local = {
        "full_fwd": _time(drv, _full(drv, mode, False), it, wu),
        "full_fwdbwd": _time(drv, _full(drv, mode, True), it, wu),
        "comm_fwd": _time(drv, _comm(drv, pre, False, mode), it, wu),
        "comm_fwdbwd": _time(drv, _comm(drv, pre, True, mode), it, wu),
    }
    drv.run(_full(drv, mode, True))  # the received rows of a full step again (comm alone left them too)
    local["compute_fwd"] = _time(drv, _compute(drv, False, mode), it, wu)
    local["compute_fwdbwd"] = _time(drv, _compute(drv, True, mode), it, wu)
    phases = _phases(drv, mode, it)
    prof = _profile(drv, mode, args.profile_iters) if args.profile_iters > 0 else None
    if drv.precision != "bf16":
        NONFINITE.flush()  # every fp8 pass above queued a non-finite count; raises (-> error record) if one is set
    everyone = _gather({"t": local, "phases": phases, "profile": prof}, drv.real)
    for k in local:
        rec[k] = _stat([e["t"][k] for e in everyone])
    labels = list(everyone[0]["phases"])
    rec["phases"] = {lb: max(statistics.median(e["phases"][lb]) for e in everyone) for lb in labels}
    rec["profile_rank0"] = everyone[0]["profile"]
    for ph in ("fwd", "fwdbwd"):
        rec[f"overlap_{ph}"] = overlap_fraction(rec[f"full_{ph}"]["ms"], rec[f"comm_{ph}"]["ms"],
                                                rec[f"compute_{ph}"]["ms"])
    for c in drv.ctxs:  # a timed-out cross-rank wait makes every number above meaningless
        st = c.peers.sync.status.tolist()
        if st[0]:
            rec.update(status="error", reason=c.peers.sync.describe(st, "compare.ep_overlap"))
    nb = nvlink_bytes(drv.ids_all, R, T, shape.dim, shape.experts // R, rec["x_payload"])
    rec["nvlink_bytes_per_rank"] = nb
    rec["comm_gbps"] = {ph: nb[ph] / (rec[f"comm_{ph}"]["ms"] * 1e6) if rec[f"comm_{ph}"]["ms"] else None
                        for ph in ("fwd", "fwdbwd")}
    return rec


# Times are medians in ms (the max over ranks); overlap is a fraction: 0 = serial, 1 = the shorter phase hidden.
HEAD = ("| shape | routing | precision | mode | EP | tokens/rank | full fwd ms | comm fwd ms | compute fwd ms | "
        "overlap fwd | full fwd+bwd ms | comm fwd+bwd ms | compute fwd+bwd ms | overlap fwd+bwd | NVLink MB/rank | "
        "comm GB/s |")


def markdown(records: list[dict], header: bool = True, details: bool = True) -> str:
    """The records as one markdown table (``header``: with its head) and, with ``details``, each ok record's
    phase times and rank 0's top kernels below it."""
    f = lambda x, s=".3g": "-" if x is None else format(x, s)  # noqa: E731
    lines = [] if not header else [HEAD, "|" + "---|" * (HEAD.count("|") - 1)]
    for r in records:
        if r["status"] != "ok":
            lines.append(f"| {r['shape']['name']} | {r['routing']} | {r.get('precision', 'bf16')} | {r['mode']} | "
                         f"{r['ep']} | {r['tokens_per_rank']} | {r['status']}: {r['reason']} |" + " |" * (HEAD.count("|") - 8))
            continue
        lines.append(
            f"| {r['shape']['name']} | {r['routing']} | {r.get('precision', 'bf16')} | {r['mode']} | {r['ep']} | "
            f"{r['tokens_per_rank']} | "
            f"{f(r['full_fwd']['ms'])} | {f(r['comm_fwd']['ms'])} | {f(r['compute_fwd']['ms'])} | "
            f"{f(r['overlap_fwd'], '.2f')} | {f(r['full_fwdbwd']['ms'])} | {f(r['comm_fwdbwd']['ms'])} | "
            f"{f(r['compute_fwdbwd']['ms'])} | {f(r['overlap_fwdbwd'], '.2f')} | "
            f"{f(r['nvlink_bytes_per_rank']['fwdbwd'] / 1e6, '.1f')} | {f(r['comm_gbps']['fwdbwd'], '.0f')} |")
    for r in records if details else []:
        if r["status"] != "ok":
            continue
        lines.append(f"\nphases (ms, median, max over ranks) {r['shape']['name']} {r['routing']} "
                     f"{r.get('precision', 'bf16')} {r['mode']}: "
                     + ", ".join(f"{k} {v:.3f}" for k, v in r["phases"].items()))
        p = r.get("profile_rank0")
        if p:
            lines.append(f"profile rank 0 ({p['time_kind']} time per step): total {p['kernel_ms']:.3f} ms"
                         + (f", busy {p['busy_ms']:.3f}, span {p['span_ms']:.3f}, idle gap {p['idle_ms']:.3f}"
                            if p["busy_ms"] is not None else ""))
            lines.extend(f"  {x['ms_per_step']:.3f} ms {100 * x['share']:.1f}% x{x['calls_per_step']:g} "
                         f"{x['name'][:90]}" for x in p["top"][:8])
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    base = TINY if args.tiny else DEFAULTS
    for k in ("shapes", "tokens", "iters", "warmup", "profile_iters"):
        if getattr(args, k) is None:
            setattr(args, k, base[k])
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    use_cuda = torch.cuda.is_available() and not args.tiny
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if use_cuda else torch.device("cpu")
    if device.type == "cpu":
        # Triton fixes its library's flavor (tl.max, ...) when it is imported: the flag goes first, before
        # anything below imports titan_megamoe (the shape parsing does)
        if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            parser.error("on a CPU this harness runs the kernels in Triton's interpreter, but triton was imported "
                         "before TRITON_INTERPRET=1 could be set: export TRITON_INTERPRET=1 first")
        os.environ.setdefault("TRITON_INTERPRET", "1")
    try:
        shapes = [parse_shape(s) for s in _split_shapes(args.shapes)]
    except ValueError as err:
        parser.error(f"argument --shapes: {err}")
    routings = [r for r in args.routings.split(",") if r]
    modes = [m for m in args.modes.split(",") if m]
    if not routings or any(r not in ("random", "skewed") for r in routings):
        parser.error(f"argument --routings: {args.routings!r}; allowed: random, skewed")
    if not modes or any(m not in MODES for m in modes):
        parser.error(f"argument --modes: {args.modes!r}; allowed: {', '.join(MODES)}")
    precisions = [q for q in args.precisions.split(",") if q]
    if not precisions or any(q not in PRECISIONS for q in precisions):
        parser.error(f"argument --precisions: {args.precisions!r}; allowed: {', '.join(PRECISIONS)}")
    if any(q != "bf16" for q in precisions):
        bad = [s.name for s in shapes if s.dim % 128 or s.hidden % 128]
        if bad:
            parser.error(f"argument --precisions: fp8 / fp8_bwd need dim and hidden multiples of 128 (blockwise "
                         f"scales); not so for {', '.join(bad)}")
    if args.tokens < 1 or args.iters < 1 or args.warmup < 0 or args.profile_iters < 0:
        parser.error("--tokens >= 1, --iters >= 1, --warmup >= 0, --profile-iters >= 0 are required")

    if device.type != "cpu" and not under_torchrun:
        parser.error("on GPUs run under torchrun --nproc_per_node R (R >= 2 GPUs: symmetric memory)")
    own_pg = False
    if under_torchrun and not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
            dist.init_process_group("nccl", device_id=device, timeout=datetime.timedelta(seconds=args.timeout_s))
        else:
            dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout_s))
        own_pg = True
    real = dist.is_initialized() and dist.get_world_size() > 1
    R = dist.get_world_size() if real else args.emulate_ranks
    rank = dist.get_rank() if real else 0
    if R < 2:
        parser.error(f"EP needs >= 2 ranks (got {R})")
    for s in shapes:
        if s.experts % R:
            parser.error(f"argument --shapes: {s.name} has {s.experts} experts, not divisible by EP={R}")
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)
    records = []
    hosts = _gather(os.uname().nodename, real)
    run, out = None, None
    if rank == 0:
        run = provenance(device=device, world_size=R if real else 1, dist_backend=dist.get_backend() if real
                         else None, hostnames=hosts, argv=argv, options=vars(args), module="compare.ep_overlap")
        run["emulated_ranks"] = None if real else R
        run["timer"] = "cuda-events" if device.type == "cuda" else "cpu-perf-counter"
        out = Path(args.out) if args.out else default_out_path(run["gpu"], device.type, R, theme="ep_overlap",
                                                               note="tiny" if args.tiny else None)
        out.parent.mkdir(parents=True, exist_ok=True)
    try:
        for shape in shapes:
            for routing in routings:
                drv = _setup(args, shape, args.tokens, routing, device, real, R, rank)
                for precision in precisions:
                    pdrv = None
                    for mode in modes:
                        base = dict(shape=shape.as_dict(), routing=routing, precision=precision, mode=mode, ep=R,
                                    tokens_per_rank=args.tokens)
                        if precision != "bf16" and mode not in FP8_MODES:
                            rec = dict(base, status="skipped", reason=f"FP8 EP has no overlap mode {mode} "
                                       f"(only {', '.join(FP8_MODES)})")
                        elif mode == "v1b" and precision != "fp8":
                            rec = dict(base, status="skipped", reason="v1b is precision fp8's bf16 x payload (the "
                                       f"forward of {precision} has one payload: bf16)")
                        else:
                            try:
                                if pdrv is None:
                                    pdrv = drv if precision == "bf16" else drv.for_fp8(precision)
                                rec = _measure(args, pdrv, shape, args.tokens, routing, mode, R)
                            except Exception as err:  # noqa: BLE001 - recorded; other ranks may hang in a barrier
                                import traceback

                                traceback.print_exc()
                                rec = dict(base, status="error", reason=f"{type(err).__name__}: {str(err)[:300]}")
                        records.append(rec)
                        if rank == 0:  # after every record: a run cut short by a time limit keeps what it measured
                            out.write_text(json.dumps({"schema": SCHEMA, "run": run, "records": records}, indent=1)
                                           + "\n")
                            if len(records) == 1:
                                print(HEAD + "\n|" + "---|" * (HEAD.count("|") - 1))
                            print(markdown([rec], header=False), flush=True)
                    del pdrv
                del drv
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        if rank == 0:
            print("\nall records:\n" + markdown(records, details=False))
            print(f"\nwrote {out}")
            sys.stdout.flush()
        if real:
            dist.barrier()
    finally:
        torch.set_num_threads(threads)
        if own_pg:
            dist.destroy_process_group()
    return 1 if any(r["status"] not in ("ok", "skipped") for r in records) else 0


def _split_shapes(s: str) -> list[str]:
    from compare.layer import _split_shapes as split

    return split(s)


if __name__ == "__main__":
    sys.exit(main())
