"""Where the host time of one MegaMoE layer forward (and backward) goes, on the GPU machine.

compare.layer times the forward from an idle device, so every microsecond the host spends before
GEMM1 is enqueued is device idle time. This script answers *which* microseconds:

1. the launch timeline: ``kernels/launch.launch`` is wrapped to stamp ``time.perf_counter`` at each
   kernel launch, relative to the start of the layer call (median over ``--iters`` calls, the device
   kept busy by a queued ``torch.cuda._sleep`` so no launch waits);
2. a cProfile of ``--iters`` forwards (and backwards): the functions with the most own time, and the
   callees of the layer's and the op's forward.

    python scripts/host_profile.py [--shape qwen3-30b-a3b] [--tokens 16384] [--iters 50] [--out f.json]

GPU only (the CPU machine's counterpart is ``scripts/host_overhead_cpu.py``).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3-30b-a3b")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("host_profile.py needs a GPU (scripts/host_overhead_cpu.py is the CPU counterpart)")

    from compare.builders import build_layer
    from compare.records import provenance
    from compare.shapes import parse_shape
    from titan_megamoe.kernels import launch as L

    dev = torch.device("cuda")
    shape = parse_shape(a.shape)
    layer = build_layer("megamoe-triton", "bf16", shape, dev).module
    x = torch.randn(1, a.tokens, shape.dim, device=dev, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)

    stamps: list[tuple[str, float]] = []
    real_launch = L.launch

    def stamped(kernel, grid, *args, **kwargs):
        stamps.append((getattr(getattr(kernel, "fn", kernel), "__name__", "?"), time.perf_counter()))
        return real_launch(kernel, grid, *args, **kwargs)

    def step(backward: bool):
        y = layer(x)
        if backward:
            y.backward(dy)
        return y

    for _ in range(5):
        step(True)
    torch.cuda.synchronize()

    # 1. launch timeline of the forward, device busy: every module's ``launch`` name, and the router's gate
    patched = [m for m in list(sys.modules.values())
               if getattr(m, "__name__", "").startswith("titan_megamoe.") and getattr(m, "launch", None) is real_launch]
    for m in patched:
        m.launch = stamped
    gate = getattr(getattr(layer, "router", None), "gate", None)
    hooks = []
    from titan_megamoe.ops import eager_layer

    # the gate's module hooks would turn the fused eager layer off (it runs only without module hooks), so they
    # stamp the gate linear only where the modular path runs anyway (session 13: before this, the timeline of
    # a default run was the modular path's)
    if gate is not None and not eager_layer.ENABLED:
        hooks.append(gate.register_forward_pre_hook(lambda *a: stamps.append(("gate_linear_start", time.perf_counter()))))
        hooks.append(gate.register_forward_hook(lambda *a: stamps.append(("gate_linear_end", time.perf_counter()))))
    fwd_us, per_kernel = [], {}
    try:
        for _ in range(a.iters):
            torch.cuda._sleep(40_000_000)
            stamps.clear()
            t0 = time.perf_counter()
            y = layer(x)
            t1 = time.perf_counter()
            fwd_us.append((t1 - t0) * 1e6)
            for i, (name, t) in enumerate(stamps):
                per_kernel.setdefault(f"{i}:{name}", []).append((t - t0) * 1e6)
            y.backward(dy)
            torch.cuda.synchronize()
    finally:
        for m in patched:
            m.launch = real_launch
        for h in hooks:
            h.remove()
    timeline = {k: round(statistics.median(v), 1) for k, v in per_kernel.items()}
    print(json.dumps({"fwd_host_us": round(statistics.median(fwd_us), 1), "launch_at_us": timeline}))

    # 2. cProfile, forward and backward separately
    prof = {}
    for what in ("fwd", "bwd"):
        pr = cProfile.Profile()
        for _ in range(a.iters):
            torch.cuda._sleep(40_000_000)
            if what == "fwd":
                pr.enable()
                y = layer(x)
                pr.disable()
                y.backward(dy)
            else:
                y = layer(x)
                pr.enable()
                y.backward(dy)
                pr.disable()
            torch.cuda.synchronize()
        s = io.StringIO()
        st = pstats.Stats(pr, stream=s)
        st.sort_stats("tottime").print_stats(40)
        st.sort_stats("cumtime").print_stats(60)
        prof[what] = s.getvalue()
        print(f"===== cProfile {what} ({a.iters} calls) =====\n{prof[what]}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"run": provenance(device=dev, world_size=1, dist_backend=None, hostnames=[], argv=sys.argv[1:],
                                              options=vars(a), module="scripts.host_profile"), "shape": a.shape, "tokens": a.tokens, "iters": a.iters,
                       "fwd_host_us": round(statistics.median(fwd_us), 1), "launch_at_us": timeline,
                       "cprofile": prof}, f, indent=1)


if __name__ == "__main__":
    main()
