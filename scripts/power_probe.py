"""Why a layer step is slower from an idle device than its device time: host gaps, or the clock?

compare.layer reports each step twice: from an idle device (``fwd_ms``: what a caller after a sync sees)
and with a 40 ms head start (``*_device_ms``: the device's work alone). At the Qwen3-235B-A22B shape the
two differed by 3.9 ms in session 11 (28.1 against 24.2 ms), though the host enqueues the whole step in
4.7 ms and the forward alone keeps the device busy 7.6 ms: so either the host leaves the device idle
(a hidden wait), or the same kernels run slower when steps follow each other (power or clock limits).

This script times the same layer in three modes, side by side in one process, while ``nvidia-smi``
samples the SM clock, power draw, temperature and the active clock-event reasons every 20 ms:

* ``idle``: compare.layer's from-idle steps, back to back (sync, L2 flush, step);
* ``head``: each step behind a 40 ms ``torch.cuda._sleep`` (compare.layer's device-time pass);
* ``idle_cool``: from idle, but the host sleeps 40 ms before each step (the device idles then), so the
  duty cycle is ``head``'s while nothing is queued ahead of the step.

If ``idle_cool`` matches ``head``, the from-idle excess is the duty cycle (power / clocks), not host
gaps. Then one profiled from-idle step gives the device's idle gaps inside the step directly.
Also the host time of the router's gate GEMM (``torch.mm``, cuBLAS) with the device busy.

    python scripts/power_probe.py [--shapes qwen3-235b-a22b,qwen3-30b-a3b] [--impls megamoe-triton,tt-compile]
                                  [--iters 30] [--out power_probe.json]

GPU only. Writes one JSON record per (shape, impl, mode) with the step times and the nvidia-smi
samples taken during that mode (median SM clock, power, max temperature, OR of the reason masks).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

SMI_FIELDS = ["timestamp", "clocks.sm", "power.draw", "temperature.gpu"]
REASON_FIELDS = ["clocks_event_reasons.active", "clocks_throttle_reasons.active"]


def _start_smi(path: str):
    """nvidia-smi sampling every 20 ms into ``path``; returns (process, fields) or (None, [])."""
    for reason in REASON_FIELDS + [None]:
        fields = SMI_FIELDS + ([reason] if reason else [])
        probe = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"],
                               capture_output=True, text=True)
        if probe.returncode == 0 and "Field" not in probe.stdout:
            f = open(path, "w")
            p = subprocess.Popen(["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits",
                                  "-lms", "20"], stdout=f, stderr=subprocess.DEVNULL)
            return p, fields
    return None, []


def _read_smi(path: str, fields: list[str]) -> list[dict]:
    rows = []
    for line in open(path):
        parts = [s.strip() for s in line.split(",")]
        if len(parts) != len(fields):
            continue
        try:
            t = datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
            row = {"t": t, "sm_mhz": float(parts[1]), "power_w": float(parts[2]), "temp_c": float(parts[3])}
            if len(parts) > 4:
                row["reasons"] = int(parts[4], 16)
            rows.append(row)
        except ValueError:
            continue
    return rows


def _window(rows: list[dict], t0: float, t1: float) -> dict:
    w = [r for r in rows if t0 <= r["t"] <= t1]
    if not w:
        return {"samples": 0}
    out = {"samples": len(w), "sm_mhz_median": statistics.median(r["sm_mhz"] for r in w),
           "sm_mhz_min": min(r["sm_mhz"] for r in w), "power_w_median": statistics.median(r["power_w"] for r in w),
           "power_w_max": max(r["power_w"] for r in w), "temp_c_max": max(r["temp_c"] for r in w)}
    if "reasons" in w[0]:
        mask = 0
        for r in w:
            mask |= r["reasons"]
        out["reasons_or"] = hex(mask)
    return out


def _gaps(prof, t_lo: float | None = None) -> dict:
    """Device idle time inside the profiled steps: kernels' union against their span."""
    ev = [e for e in prof.events() if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA
          and e.time_range.elapsed_us() > 0]
    iv = sorted((e.time_range.start, e.time_range.end, e.name) for e in ev)
    if not iv:
        return {}
    busy, gaps, cur_s, cur_e, prev_name = 0.0, [], iv[0][0], iv[0][1], iv[0][2]
    for s, e, name in iv[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            gaps.append((s - cur_e, prev_name[:60], name[:60]))
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
        prev_name = name
    busy += cur_e - cur_s
    gaps.sort(reverse=True)
    return {"span_us": iv[-1][1] - iv[0][0], "busy_us": busy,
            "largest_gaps_us": [{"us": round(g, 1), "after": a, "before": b} for g, a, b in gaps[:12]]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="qwen3-235b-a22b,qwen3-30b-a3b")
    ap.add_argument("--impls", default="megamoe-triton,tt-compile")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("power_probe.py needs a GPU")
    from compare.builders import IMPLS, build_layer, stock_layer_context
    from compare.records import provenance
    from compare.shapes import parse_shape
    from compare.timing import time_fwd_bwd

    dev = torch.device("cuda")
    smi_path = os.path.join(tempfile.mkdtemp(), "smi.csv")
    smi, fields = _start_smi(smi_path)
    records = []
    # host time of the gate GEMM (cuBLAS) with the device busy, both shapes' dims
    for name in a.shapes.split(","):
        shape = parse_shape(name)
        x = torch.randn(a.tokens, shape.dim, device=dev, dtype=torch.bfloat16)
        wg = torch.randn(shape.experts, shape.dim, device=dev, dtype=torch.bfloat16)
        ts = []
        for i in range(220):
            torch.cuda._sleep(2_000_000)
            t0 = time.perf_counter()
            torch.mm(x, wg.t())
            ts.append(time.perf_counter() - t0)
            torch.cuda.synchronize()
        records.append({"probe": "gate_mm_host_us", "shape": name, "median_us": statistics.median(ts[20:]) * 1e6,
                        "min_us": min(ts[20:]) * 1e6})
        print(json.dumps(records[-1]), flush=True)

    for name in a.shapes.split(","):
        shape = parse_shape(name)
        for impl in a.impls.split(","):
            stock = IMPLS[impl].family == "stock"
            with stock_layer_context("bf16", dev) if stock else contextlib.nullcontext():
                moe = build_layer(impl, "bf16", shape, dev).module
                x = torch.randn(1, a.tokens, shape.dim, device=dev, dtype=torch.bfloat16, requires_grad=True)
                g = torch.randn_like(x)
                params = list(moe.parameters())

                def before(cool: float = 0.0):
                    for p in params:
                        p.grad = None
                    x.grad = None
                    if cool:
                        torch.cuda.synchronize()
                        time.sleep(cool)

                def fwd():
                    return moe(x)

                def bwd(y):
                    y.backward(g)

                time_fwd_bwd(fwd, bwd, device=dev, iters=2, warmup=5, before_step=before)
                for mode, head, cool in (("idle", 0.0, 0.0), ("head", 40.0, 0.0), ("idle_cool", 0.0, 0.040),
                                         ("idle", 0.0, 0.0)):
                    w0 = time.time()
                    s = time_fwd_bwd(fwd, bwd, device=dev, iters=a.iters, warmup=1, head_start_ms=head,
                                     before_step=lambda c=cool: before(c))
                    w1 = time.time()
                    rec = {"shape": name, "impl": impl, "mode": mode, "wall": [w0, w1]}
                    for k in ("fwd", "bwd", "fwdbwd", "host_fwd", "host_fwdbwd"):
                        rec[f"{k}_ms"] = statistics.median(s[k])
                    rec["fwdbwd_first5_ms"] = s["fwdbwd"][:5]
                    rec["fwdbwd_last5_ms"] = s["fwdbwd"][-5:]
                    records.append(rec)
                    print(json.dumps({k: v for k, v in rec.items() if k != "wall"}), flush=True)
                # one profiled from-idle step after a few: where the device idles inside it
                from torch.profiler import ProfilerActivity, profile

                time_fwd_bwd(fwd, bwd, device=dev, iters=3, warmup=0, before_step=before)
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    time_fwd_bwd(fwd, bwd, device=dev, iters=1, warmup=0, before_step=before, l2_flush=False)
                rec = {"shape": name, "impl": impl, "mode": "profiled_idle_step", **_gaps(prof)}
                records.append(rec)
                print(json.dumps(rec)[:1500], flush=True)
                del moe, x, g, params
                if IMPLS[impl].compile:
                    torch._dynamo.reset()
                torch.cuda.empty_cache()
    if smi is not None:
        time.sleep(0.2)
        smi.terminate()
        smi.wait()
        rows = _read_smi(smi_path, fields)
        for r in records:
            if "wall" in r:
                r["smi"] = _window(rows, *r["wall"])
                print(r["shape"], r["impl"], r["mode"], json.dumps(r["smi"]), flush=True)
        records.append({"probe": "smi_fields", "fields": fields, "samples_total": len(rows)})
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"run": provenance(device=dev, world_size=1, dist_backend=None, hostnames=[], argv=sys.argv[1:],
                                                 options=vars(a), module="scripts.power_probe"), "records": records}, f, indent=1)


if __name__ == "__main__":
    main()
