"""Host (CPU) time to enqueue one MoE layer forward, and its parts (GPU only).

compare.layer times a forward from an idle device, so the host's enqueue time before GEMM1 shows up
as device idle time (docs/NOTES.md, v2 profile: 1.2 ms host vs 3.2 ms device span at the 30B shape).
This script measures where the host time goes: the device is first given a long ``torch.cuda._sleep``
so no launch ever waits, then each stage is timed with ``time.perf_counter`` (median of ``--iters``).

    python scripts/host_overhead.py [--shape qwen3-30b-a3b] [--iters 50] [--out host.json]

Each stage is timed with the fast launch path of ``kernels/launch.py`` off ("host_us", Triton's
``JITFunction.run``) and on ("fast_launch_host_us"). The megamoe layer stages run with
TITAN_MEGAMOE_FUSED_ROUTER=1 (layer.py's fused router, the default since session 8), except those named with
FUSED_ROUTER=0 / EAGER_AUTOGRAD=0 (ops/eager.py), which run with those switches off. The megamoe layer runs
its own router (random init); until session 8 it ran an injected one (compare.builders.inject_routing),
so the router stages of ``host_overhead_30b_1xh200_s8_20261201.json`` and earlier timed the same torch ops
whatever the switch (their spread there, 273-880 us for one code path, is that host's noise). Prints one JSON line per stage; writes them all
to ``--out`` if given. ``scripts/host_overhead_cpu.py`` is the CPU-machine counterpart.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402


def _host_us(fn, iters: int) -> float:
    """Median host microseconds of ``fn()`` while the device is kept busy (no launch blocks)."""
    samples = []
    for _ in range(iters):
        torch.cuda._sleep(20_000_000)  # ~10 ms of device time queued ahead of fn's launches
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize()
    return statistics.median(samples)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="qwen3-30b-a3b")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("host_overhead: needs a CUDA GPU", file=sys.stderr)
        return 2

    from compare.builders import build_layer, inject_routing, stock_layer_context
    from compare.shapes import parse_shape
    from titan_megamoe.kernels.grouped_gemm import combine_topk, gemm1_swiglu_fwd, gemm2_scatter_fwd
    from titan_megamoe.kernels.routing import build_routing_layout
    from titan_megamoe.ops.library import mega_moe_triton
    from titan_megamoe.ops import triton_backend as tb
    from titan_megamoe.testing import make_routing

    dev = torch.device("cuda")
    shape = parse_shape(a.shape)
    T, E, K = a.tokens, shape.experts, shape.top_k
    ids = make_routing("uniform", T, E, K, seed=0).to(dev)
    counts = torch.bincount(ids.view(-1), minlength=E).float()
    x = torch.randn(T, shape.dim, device=dev, dtype=torch.bfloat16, requires_grad=True)
    rows = []

    from titan_megamoe.kernels import launch as L

    def record(stage, fn):
        """Host us of ``fn`` with kernels/launch.py's fast path off, then on (same process, same inputs)."""
        row = {"stage": stage}
        for mode in (False, True):
            L.FAST_LAUNCH = mode
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            row["fast_launch_host_us" if mode else "host_us"] = round(_host_us(fn, a.iters), 1)
        rows.append(row)
        print(json.dumps(rows[-1]), flush=True)

    os.environ["TITAN_MEGAMOE_FUSED_ROUTER"] = "1"  # the default, set in case the caller set 0: timed on, then off below
    for impl in ("megamoe-triton", "tt-compile"):
        with stock_layer_context("bf16", dev):
            built = build_layer(impl, "bf16", shape, dev)
            moe = built.module
            if impl != "megamoe-triton":
                # stock: fixed routing as before. megamoe keeps its own router (random init, near uniform):
                # an injected router replaces the fused one, whose host time is what the router stages time
                inject_routing(moe, ids, counts)
            xb = x.view(1, T, shape.dim)
            record(f"{impl}: layer forward", lambda: moe(xb))
            record(f"{impl}: router", lambda: moe.router(x, moe.expert_bias))
            if impl == "megamoe-triton":  # session 7's switches off: the router's torch ops, the custom op
                from titan_megamoe.ops import eager

                os.environ["TITAN_MEGAMOE_FUSED_ROUTER"] = "0"
                record(f"{impl}: router, TITAN_MEGAMOE_FUSED_ROUTER=0", lambda: moe.router(x, moe.expert_bias))
                eager.ENABLED = False
                record(f"{impl}: layer forward, FUSED_ROUTER=0 and EAGER_AUTOGRAD=0", lambda: moe(xb))
                eager.ENABLED = True
                os.environ["TITAN_MEGAMOE_FUSED_ROUTER"] = "1"
    moe = None
    built = build_layer("megamoe-triton", "bf16", shape, dev)
    ex = built.module.experts
    scores = torch.rand(T, K, device=dev).softmax(-1).requires_grad_()
    record("megamoe: experts module", lambda: ex(x, ids, scores))
    w1, w2, w3 = ex.w1, ex.w2, ex.w3
    record("megamoe: mega_moe_triton (autograd, eager Function)", lambda: mega_moe_triton(x, ids, scores, w1, w2, w3))
    from titan_megamoe.ops import eager

    eager.ENABLED = False
    record("megamoe: mega_moe_triton (autograd, custom op: EAGER_AUTOGRAD=0)",
           lambda: mega_moe_triton(x, ids, scores, w1, w2, w3))
    eager.ENABLED = True
    with torch.no_grad():
        record("megamoe: custom op (no grad)", lambda: mega_moe_triton(x, ids, scores, w1, w2, w3))
        record("megamoe: triton_fwd (no op)", lambda: tb.triton_fwd(x, ids, scores, w1, w2, w3))
        lay = build_routing_layout(ids, E, 128)
        record("megamoe: routing layout (2 launches)", lambda: build_routing_layout(ids, E, 128))
        gu, h = gemm1_swiglu_fwd(x, w1, w3, lay)
        record("megamoe: gemm1 launch", lambda: gemm1_swiglu_fwd(x, w1, w3, lay, gate_up_out=gu, h_out=h))
        y = gemm2_scatter_fwd(h, w2, scores.detach(), lay)
        record("megamoe: gemm2 launch", lambda: gemm2_scatter_fwd(h, w2, scores.detach(), lay))
        record("megamoe: combine launch", lambda: combine_topk(y, T, K))
        record("torch: one elementwise op", lambda: x.detach().mul(2))
        record("torch: empty", lambda: torch.empty((T, shape.dim), device=dev))
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"shape": a.shape, "tokens": T, "iters": a.iters, "torch": torch.__version__,
                       "gpu": torch.cuda.get_device_name(), "git_rev": os.environ.get("TITAN_MEGAMOE_GIT_REV"),
                       "stages": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
