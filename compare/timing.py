"""Timing utilities: warm-up, L2 flush, CUDA events (CPU timer without CUDA), a barrier before each
timed step, median / p20 / p80, max over ranks, and the dense GEMM rate of the same run.

What one timed step measures (:func:`time_fwd_bwd`), per rank::

    (untimed) zero grads, flush L2, device sync, barrier over all ranks, device sync
    t0 | out = fwd() | t1 | bwd(out) | t2 | device sync
    fwd = t1 - t0,  bwd = t2 - t1,  fwdbwd = t2 - t0

With ``head_start_ms`` (compare.layer --device-time) a device sleep is queued before t0, so the host
enqueues the step while the device is busy and the events time the device's work alone; the host's
own enqueue times (``time.perf_counter`` around fwd and around the step) are returned either way.

So ``bwd`` is the backward of the forward graph saved in the same step, timed separately; fwd is
the training forward (autograd recording on), not an inference forward. The barrier at the start
of every step lines the ranks up, so step i on every rank is the same layer call; the reported
sample of step i is the maximum over ranks (the layer is as slow as its slowest rank), then the
median / p20 / p80 over steps. On CUDA the times come from CUDA events on the current stream; on
CPU from ``time.perf_counter`` (CPU execution is synchronous).
"""

from __future__ import annotations

import gc
import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist

__all__ = [
    "percentiles",
    "max_over_ranks",
    "time_fwd_bwd",
    "time_fn",
    "measure_gemm_tflops",
    "sync",
    "barrier",
    "flush_l2",
    "l2_flush_bytes",
]

_L2_FLUSH_BYTES = 256 * 2**20  # > H200's 50 MB L2 (and > B200's 126 MB)
_l2_buffer: dict[torch.device, torch.Tensor] = {}


def percentiles(samples: list[float]) -> dict[str, float]:
    """{"median", "p20", "p80"} of ``samples`` (linear interpolation between order statistics)."""
    if not samples:
        raise ValueError("no samples")
    xs = sorted(samples)

    def q(p: float) -> float:
        pos = p * (len(xs) - 1)
        lo = int(pos)
        hi = min(lo + 1, len(xs) - 1)
        return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)

    return {"median": statistics.median(xs), "p20": q(0.2), "p80": q(0.8)}


def max_over_ranks(per_rank: list[list[float]]) -> list[float]:
    """Elementwise max over ranks of per-step samples (all ranks ran the same number of steps)."""
    if len({len(s) for s in per_rank}) != 1:
        raise ValueError(f"ranks have different sample counts: {[len(s) for s in per_rank]}")
    return [max(vals) for vals in zip(*per_rank)]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def barrier(device: torch.device) -> None:
    """Device sync, then a barrier over the default group (if any), then device sync again."""
    sync(device)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
        sync(device)


def flush_l2(device: torch.device) -> None:
    """Overwrite a 256 MiB scratch buffer (allocated on first use) so no operand stays in L2."""
    if device.type != "cuda":
        return
    buf = _l2_buffer.get(device)
    if buf is None:
        buf = _l2_buffer[device] = torch.empty(_L2_FLUSH_BYTES, dtype=torch.uint8, device=device)
    buf.zero_()


def l2_flush_bytes(device: torch.device) -> int:
    """Bytes of the L2-flush scratch buffer held on ``device`` (subtract it from peak memory)."""
    buf = _l2_buffer.get(device)
    return 0 if buf is None else buf.numel()


class _Stamp:
    """A point in time on the device's stream (CUDA event) or on the host clock (CPU)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.event = torch.cuda.Event(enable_timing=True)
        self.t = 0.0

    def record(self) -> None:
        if self.cuda:
            self.event.record()
        else:
            self.t = time.perf_counter()

    def ms_since(self, start: "_Stamp") -> float:
        if self.cuda:
            return start.event.elapsed_time(self.event)
        return (self.t - start.t) * 1e3


def timer_name(device: torch.device) -> str:
    return "cuda-events" if device.type == "cuda" else "cpu-perf-counter"


def time_fwd_bwd(
    fwd: Callable[[], object],
    bwd: Callable[[object], None],
    *,
    device: torch.device,
    iters: int,
    warmup: int,
    before_step: Callable[[], None] | None = None,
    l2_flush: bool = True,
    head_start_ms: float = 0.0,
    cooldown_ms: float = 0.0,
    gc_off: bool = False,
) -> dict[str, list[float]]:
    """Time ``iters`` training steps of one layer after ``warmup`` untimed ones (warm-up also
    triggers torch.compile and any autotuning). See the module docstring for what is timed.

    ``head_start_ms`` > 0 (CUDA only): each step's stream first gets a ``torch.cuda._sleep`` of about
    that many ms, so the host enqueues the step while the device is still busy and the events time
    the device's work alone (the layer's *device time*), as long as the host's enqueue time (the
    ``host_*`` samples) stays below the head start. 0: the step starts from an idle device, as a
    layer called after a sync does, and any host time before a kernel shows up in the times.

    ``cooldown_ms`` > 0: the host sleeps that long after the barrier, before the step, with the device
    idle: the step still starts from an idle device, but the GPU's duty cycle drops, so a power-capped
    layer (lower SM clock in back-to-back steps, compare/power.py) runs at the clock it gets after a
    pause. Not a substitute for the default protocol: both are reported (compare.layer --cooldown-ms).

    ``gc_off``: Python's automatic garbage collection is disabled for the pass (a full collection first,
    the previous state restored after), as TorchTitan's trainer runs its steps (``tools/utils.py``
    ``GarbageCollection``: ``gc.disable()``, then a collection every ``training.gc_freq`` steps): a
    generation-0 collection inside a host-bound step otherwise lands in its time at random.

    Returns:
        this rank's per-step samples in ms: {"fwd": [...], "bwd": [...], "fwdbwd": [...],
        "host_fwd": [...], "host_fwdbwd": [...]} (host_*: ``time.perf_counter`` around the calls,
        the host's time to enqueue the forward and the whole step).
    """
    was_enabled = gc.isenabled()
    if gc_off:
        gc.collect()
        gc.disable()
    try:
        return _timed_steps(fwd, bwd, device, iters, warmup, before_step, l2_flush, head_start_ms, cooldown_ms)
    finally:
        if gc_off and was_enabled:
            gc.enable()


def _timed_steps(fwd, bwd, device, iters, warmup, before_step, l2_flush, head_start_ms, cooldown_ms):
    for _ in range(warmup):
        if before_step is not None:
            before_step()
        bwd(fwd())
    out: dict[str, list[float]] = {"fwd": [], "bwd": [], "fwdbwd": [], "host_fwd": [], "host_fwdbwd": []}
    t0, t1, t2 = _Stamp(device), _Stamp(device), _Stamp(device)
    cycles = _sleep_cycles(device, head_start_ms) if head_start_ms > 0 and device.type == "cuda" else 0
    for _ in range(iters):
        if before_step is not None:
            before_step()
        if l2_flush:
            flush_l2(device)
        barrier(device)
        if cooldown_ms > 0:
            time.sleep(cooldown_ms / 1e3)
        if cycles:
            torch.cuda._sleep(cycles)
        h0 = time.perf_counter()
        t0.record()
        y = fwd()
        t1.record()
        h1 = time.perf_counter()
        bwd(y)
        t2.record()
        h2 = time.perf_counter()
        sync(device)
        del y
        out["fwd"].append(t1.ms_since(t0))
        out["bwd"].append(t2.ms_since(t1))
        out["fwdbwd"].append(t2.ms_since(t0))
        out["host_fwd"].append((h1 - h0) * 1e3)
        out["host_fwdbwd"].append((h2 - h0) * 1e3)
    return out


_cycles_per_ms: dict[torch.device, float] = {}


def _sleep_cycles(device: torch.device, ms: float) -> int:
    """``torch.cuda._sleep`` argument for about ``ms`` of device time (calibrated once per device)."""
    rate = _cycles_per_ms.get(device)
    if rate is None:
        n = 10_000_000
        a, b = _Stamp(device), _Stamp(device)
        torch.cuda._sleep(n // 10)  # first call: module load
        sync(device)
        a.record()
        torch.cuda._sleep(n)
        b.record()
        sync(device)
        rate = _cycles_per_ms[device] = n / max(b.ms_since(a), 1e-3)
    return int(rate * ms)


def time_fn(fn: Callable[[], object], *, device: torch.device, iters: int, warmup: int) -> list[float]:
    """Per-call ms of ``fn`` (no barrier, no flush): for the local dense-GEMM rate."""
    for _ in range(warmup):
        fn()
    sync(device)
    a, b = _Stamp(device), _Stamp(device)
    samples = []
    for _ in range(iters):
        a.record()
        fn()
        b.record()
        sync(device)
        samples.append(b.ms_since(a))
    return samples


def measure_gemm_tflops(kind: str, device: torch.device, *, n: int | None = None,
                        iters: int = 10, warmup: int = 3) -> tuple[float | None, str]:
    """Dense GEMM rate (TFLOP/s, median) of this device for ``kind`` in {"bf16", "fp8", "fp32"}.

    CUDA: an n^3 (default 8192) ``torch.matmul`` for bf16 / fp32, ``torch._scaled_mm`` with
    rowwise scales (e4m3 operands, bf16 output) for fp8. CPU: a 256^3 matmul (so --tiny runs);
    fp8 has no CPU rate (None).

    Returns:
        (tflops or None, description of what was measured).
    """
    on_cuda = device.type == "cuda"
    n = n or (8192 if on_cuda else 256)
    gen = torch.Generator(device=device).manual_seed(0)
    if kind in ("bf16", "fp32"):
        dt = torch.bfloat16 if kind == "bf16" else torch.float32
        a = torch.randn(n, n, device=device, generator=gen).to(dt)
        b = torch.randn(n, n, device=device, generator=gen).to(dt)

        def fn():
            return torch.matmul(a, b)

        what = f"torch.matmul {n}x{n}x{n} {kind}"
    elif kind == "fp8":
        if not on_cuda:
            return None, "fp8 GEMM rate not measured on CPU"
        a = torch.randn(n, n, device=device, generator=gen).to(torch.float8_e4m3fn)
        b = torch.randn(n, n, device=device, generator=gen).to(torch.float8_e4m3fn).t()  # column-major
        sa = torch.ones(n, 1, device=device, dtype=torch.float32)  # rowwise scales
        sb = torch.ones(1, n, device=device, dtype=torch.float32)

        def fn():
            return torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)

        what = f"torch._scaled_mm rowwise {n}x{n}x{n} e4m3 -> bf16"
    else:
        raise ValueError(f"unknown GEMM kind {kind!r}; allowed: bf16, fp8, fp32")
    try:
        ms = percentiles(time_fn(fn, device=device, iters=iters, warmup=warmup))["median"]
    except RuntimeError as err:  # e.g. _scaled_mm unsupported on this GPU
        return None, f"{what}: failed ({str(err).splitlines()[0][:200]})"
    return 2 * n**3 / (ms * 1e-3) / 1e12, what
