"""GPU clock, power and clock-event reasons sampled while a layer is timed (NVML, via nvidia-ml-py).

Why: an H200 at its 700 W limit lowers its SM clock in back-to-back steps (clock-event reason
``sw_power_cap``), so the same kernels take longer than they do behind an idle gap. Session 12's
``scripts/power_probe.py`` found MegaMoE's 235B step at a median 1515 MHz from idle back to back
against 1905 MHz with a 40 ms cool-down before each step (27.9 vs 25.0 ms). compare.layer records
what the clock did during each timing pass so a reader can tell a slower kernel from a capped one.

:class:`PowerSampler` polls NVML every ``period_ms`` (NVML's own counters, no ``nvidia-smi``) from a
child process by default: a sampling thread in the timed process takes the GIL back from the thread
that enqueues the layer's kernels after each NVML call, which delays the launches of a host-bound
layer (docs/NOTES.md session 18); ``mode="thread"`` keeps the old in-process thread for comparison.
:meth:`PowerSampler.window` summarizes the samples of a wall-clock window. Where NVML is missing
(CPU machines, no ``pynvml`` module) the sampler is inactive and every window is ``None``;
``PowerSampler.unavailable`` says why.

The child is ``python -m compare.power --nvml-index I --period-ms P --out FILE``: it appends one line
per sample (``time_s sm_mhz power_w temp_c reasons``) to FILE and flushes it, until terminated.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

__all__ = ["MODES", "REASON_BITS", "PowerSampler", "decode_reasons", "read_samples", "summarize"]

#: Where the samples are taken: a child process (default), a thread of this process, or nowhere.
MODES = ("process", "thread", "off")

#: NVML clock-event reason bits (``nvmlClocksEventReason*``, nvml.h) -> names used in the records.
REASON_BITS = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}


def decode_reasons(mask: int) -> list[str]:
    """Names of the set bits of an NVML clock-event reason mask, low bit first (unknown bits as hex)."""
    names = [name for bit, name in REASON_BITS.items() if mask & bit]
    rest = mask & ~sum(REASON_BITS)
    return names + ([hex(rest)] if rest else [])


def summarize(samples: list[tuple[float, float, float, float, int]]) -> dict | None:
    """Summary of (time_s, sm_mhz, power_w, temp_c, reasons) samples; None when there are none.

    Returns {"samples", "sm_mhz_median", "sm_mhz_min", "power_w_median", "power_w_max", "temp_c_max",
    "reasons"}: reasons is the union over the samples, as names (:func:`decode_reasons`).
    """
    if not samples:
        return None
    mask = 0
    for s in samples:
        mask |= s[4]
    return {"samples": len(samples), "sm_mhz_median": statistics.median(s[1] for s in samples),
            "sm_mhz_min": min(s[1] for s in samples), "power_w_median": statistics.median(s[2] for s in samples),
            "power_w_max": max(s[2] for s in samples), "temp_c_max": max(s[3] for s in samples),
            "reasons": decode_reasons(mask)}


class PowerSampler:
    """NVML sampling of one GPU while layers are timed: SM clock (MHz), board power (W), temperature (C),
    clock-event reasons.

    Use as a context manager around the timing passes; ``window(t0, t1)`` (``time.time()`` seconds)
    summarizes the samples taken between t0 and t1 (:func:`summarize`). Inactive (``window`` returns
    None) when NVML cannot be used or ``mode`` is "off"; ``unavailable`` holds the reason.

    Args:
        device_index: CUDA device ordinal; mapped to the NVML index through ``CUDA_VISIBLE_DEVICES``
            when that lists plain integers, else used as is.
        period_ms: sampling period (20 ms: the granularity nvidia-smi's ``-lms`` offers too).
        mode: "process" (a child process samples: nothing runs in the timed process), "thread" (a daemon
            thread of this process, the harness's protocol before session 18), or "off".

    Raises:
        ValueError: an unknown ``mode``.
    """

    def __init__(self, device_index: int = 0, period_ms: float = 20.0, mode: str = "process"):
        if mode not in MODES:
            raise ValueError(f"power sampler mode {mode!r}: choose one of {MODES}")
        self.mode = mode
        self.period_s = period_ms / 1e3
        self.samples: list[tuple[float, float, float, float, int]] = []
        self.unavailable: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._child: subprocess.Popen | None = None
        self._file: str | None = None
        self._nvml = None
        self._handle = None
        self._index = _nvml_index(device_index)
        if mode == "off":
            self.unavailable = "off (--power-sampler off)"
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(self._index)
        except Exception as err:  # no module, no driver, no GPU: the harness runs without power data
            self.unavailable = f"{type(err).__name__}: {err}"[:200]

    @property
    def active(self) -> bool:
        return self._handle is not None

    def describe(self) -> str:
        """How the samples were taken, for a run's provenance."""
        if not self.active:
            return f"unavailable: {self.unavailable}"
        where = "in a child process" if self.mode == "process" else "on a thread of the timed process"
        return f"nvml every {self.period_s * 1e3:g} ms, {where}"

    def _sample(self) -> tuple[float, float, float, float, int]:
        return _nvml_sample(self._nvml, self._handle)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.samples.append(self._sample())
            except Exception as err:  # a driver error mid-run ends sampling, not the benchmark
                self.unavailable = f"sampling stopped: {type(err).__name__}: {err}"[:200]
                return
            self._stop.wait(self.period_s)

    def __enter__(self) -> "PowerSampler":
        if not self.active:
            return self
        if self.mode == "thread":
            self._thread = threading.Thread(target=self._run, name="titan-megamoe-power", daemon=True)
            self._thread.start()
        else:
            fd, self._file = tempfile.mkstemp(prefix="titan_megamoe_power_", suffix=".txt")
            os.close(fd)
            self._child = subprocess.Popen(
                [sys.executable, "-m", "compare.power", "--nvml-index", str(self._index),
                 "--period-ms", str(self.period_s * 1e3), "--out", self._file, "--parent-pid", str(os.getpid())],
                cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), stdin=subprocess.DEVNULL)
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        if self._child is not None:
            self.samples = self._read()
            self._child.terminate()
            try:
                self._child.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                self._child.kill()
            self._child = None
        if self._file is not None:
            try:
                os.unlink(self._file)
            except OSError:
                pass
            self._file = None
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except Exception:
                pass

    def _read(self) -> list[tuple[float, float, float, float, int]]:
        if self._file is None:
            return list(self.samples)
        if self._child is not None and self._child.poll() not in (None, 0) and self.unavailable is None:
            self.unavailable = f"sampling process exited with status {self._child.returncode}"
        return read_samples(self._file)

    def window(self, t0: float, t1: float) -> dict | None:
        """Summary of the samples with t0 <= time <= t1 (``time.time()`` seconds); None if inactive."""
        if not self.active:
            return None
        return summarize([s for s in self._read() if t0 <= s[0] <= t1])

    def power_limit_w(self) -> float | None:
        """The enforced board power limit in W (None when unknown)."""
        if not self.active:
            return None
        try:
            return self._nvml.nvmlDeviceGetEnforcedPowerLimit(self._handle) / 1e3
        except Exception:
            return None


def _nvml_sample(nv, h) -> tuple[float, float, float, float, int]:
    try:
        reasons = nv.nvmlDeviceGetCurrentClocksEventReasons(h)
    except AttributeError:  # nvidia-ml-py before the "event" rename
        reasons = nv.nvmlDeviceGetCurrentClocksThrottleReasons(h)
    return (time.time(), float(nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM)),
            nv.nvmlDeviceGetPowerUsage(h) / 1e3, float(nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU)),
            int(reasons))


def read_samples(path: str) -> list[tuple[float, float, float, float, int]]:
    """The samples a sampling process wrote to ``path`` (complete lines only: the last may be mid-write)."""
    out = []
    try:
        with open(path) as f:
            for line in f:
                parts = line.split()
                if len(parts) == 5 and line.endswith("\n"):
                    out.append((float(parts[0]), float(parts[1]), float(parts[2]), float(parts[3]), int(parts[4])))
    except FileNotFoundError:
        pass
    return out


def sample_loop(sample, out_path: str, period_s: float, max_samples: int | None = None,
                parent_pid: int | None = None) -> int:
    """Append ``sample()``'s tuples to ``out_path`` every ``period_s`` (the child process's loop; returns the
    number written when ``max_samples`` is reached, or when this process's parent is no longer ``parent_pid``:
    a timed process killed without its ``__exit__`` leaves no sampler running; a failing ``sample`` ends the
    loop with its error)."""
    n = 0
    with open(out_path, "a") as f:
        while max_samples is None or n < max_samples:
            if parent_pid is not None and os.getppid() != parent_pid:
                break
            t, mhz, w, c, reasons = sample()
            f.write(f"{t:.6f} {mhz:g} {w:.3f} {c:g} {int(reasons)}\n")
            f.flush()
            n += 1
            time.sleep(period_s)
    return n


def _nvml_index(device_index: int) -> int:
    import os

    vis = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    parts = [p.strip() for p in vis.split(",") if p.strip()]
    if parts and all(p.isdigit() for p in parts) and device_index < len(parts):
        return int(parts[device_index])
    return device_index


def main(argv: list[str] | None = None) -> int:
    """The sampling process of ``PowerSampler(mode="process")``."""
    p = argparse.ArgumentParser(prog="python -m compare.power", description="NVML sampling process")
    p.add_argument("--nvml-index", type=int, required=True)
    p.add_argument("--period-ms", type=float, default=20.0)
    p.add_argument("--out", required=True)
    p.add_argument("--parent-pid", type=int, default=None, help="exit once this process is no longer the parent")
    args = p.parse_args(argv)
    import pynvml

    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(args.nvml_index)
    sample_loop(lambda: _nvml_sample(pynvml, handle), args.out, args.period_ms / 1e3, parent_pid=args.parent_pid)
    return 0


if __name__ == "__main__":
    sys.exit(main())
