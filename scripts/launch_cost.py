"""Host cost of one kernel launch and of the driver calls inside it, on this machine (GPU only).

Why: on the H200 machines a Triton launch measured 150-220 us of host time against 15-22 us for a
torch op (docs/NOTES.md, session 4), and the layer's forward is host-bound until GEMM1 starts. Triton's
C launcher calls ``cuPointerGetAttribute`` once per tensor argument; ``kernels/launch.py`` passes the
addresses instead (``POINTER_ARGS``). This script times, with the device kept busy so nothing waits:

* single driver calls through ctypes (``cuPointerGetAttribute``, ``cuCtxGetCurrent``);
* torch.empty, one torch elementwise op;
* a trivial Triton kernel with 1 and 8 pointer arguments: ``kernel[grid]``, the fast path with tensors
  (``POINTER_ARGS`` off) and with addresses (on);
* the package's GEMM1 launcher and routing layout, and the megamoe layer's forward, off and on.

    python scripts/launch_cost.py [--iters 200] [--out launch_cost.json]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _touch1(a_ptr):
    tl.store(a_ptr + tl.program_id(0), 1.0)


@triton.jit
def _touch8(a, b, c, d, e, f, g, h):
    i = tl.program_id(0)
    tl.store(a + i, tl.load(b + i) + tl.load(c + i) + tl.load(d + i) + tl.load(e + i) + tl.load(f + i)
             + tl.load(g + i) + tl.load(h + i))


def _host_us(fn, iters: int, inner: int = 1) -> float:
    """Median host microseconds of one ``fn()`` (``inner`` calls per sample) while the device is busy."""
    samples = []
    for _ in range(iters):
        torch.cuda._sleep(2_000_000)  # ~1 ms of device work queued ahead: no launch waits
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        samples.append((time.perf_counter() - t0) * 1e6 / inner)
        torch.cuda.synchronize()
    return statistics.median(samples)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--shape", default="qwen3-30b-a3b")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("launch_cost: needs a CUDA GPU", file=sys.stderr)
        return 2
    from titan_megamoe.kernels import launch as L

    dev = torch.device("cuda")
    rows: list[dict] = []

    def rec(stage, fn, inner=1, **extra):
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        rows.append(dict(stage=stage, host_us=round(_host_us(fn, a.iters, inner), 2), **extra))
        print(json.dumps(rows[-1]), flush=True)

    cuda = ctypes.CDLL("libcuda.so.1")
    buf = torch.empty(1 << 20, device=dev)
    out_ptr = ctypes.c_uint64()
    ctx = ctypes.c_void_p()
    rec("driver: cuPointerGetAttribute", lambda: cuda.cuPointerGetAttribute(
        ctypes.byref(out_ptr), 3, ctypes.c_uint64(buf.data_ptr())), inner=20)  # 3: DEVICE_POINTER
    rec("driver: cuCtxGetCurrent", lambda: cuda.cuCtxGetCurrent(ctypes.byref(ctx)), inner=20)
    rec("torch: empty", lambda: torch.empty(4096, device=dev), inner=20)
    rec("torch: one elementwise op", lambda: buf.mul_(1.0), inner=20)
    rec("torch: current_stream", lambda: torch.cuda.current_stream(), inner=20)

    args8 = [torch.zeros(1024, device=dev) for _ in range(8)]
    for name, kern, args in (("1 pointer", _touch1, args8[:1]), ("8 pointers", _touch8, args8)):
        rec(f"triton {name}: kernel[grid]", lambda: kern[(1,)](*args), inner=10)
        for on in (False, True):
            L.POINTER_ARGS = on
            rec(f"triton {name}: fast path, POINTER_ARGS={int(on)}", lambda: L.launch(kern, (1,), *args), inner=10)
    L.POINTER_ARGS = True

    from compare.builders import build_layer, stock_layer_context
    from compare.shapes import parse_shape
    from titan_megamoe.kernels.grouped_gemm import gemm1_swiglu_fwd
    from titan_megamoe.kernels.routing import build_routing_layout
    from titan_megamoe.testing import make_routing

    shape = parse_shape(a.shape)
    T, E, K = a.tokens, shape.experts, shape.top_k
    ids = make_routing("uniform", T, E, K, seed=0).to(dev)
    with stock_layer_context("bf16", dev):
        moe = build_layer("megamoe-triton", "bf16", shape, dev).module
    x = torch.randn(1, T, shape.dim, device=dev, dtype=torch.bfloat16, requires_grad=True)
    w1, w3 = moe.experts.w1.detach(), moe.experts.w3.detach()
    with torch.no_grad():
        lay = build_routing_layout(ids, E, 128)
        gu, h = gemm1_swiglu_fwd(x.view(T, -1), w1, w3, lay)
    for on in (False, True):
        L.POINTER_ARGS = on
        with torch.no_grad():
            rec(f"megamoe: routing layout, POINTER_ARGS={int(on)}", lambda: build_routing_layout(ids, E, 128))
            rec(f"megamoe: gemm1 launch, POINTER_ARGS={int(on)}",
                lambda: gemm1_swiglu_fwd(x.view(T, -1), w1, w3, lay, gate_up_out=gu, h_out=h))
        rec(f"megamoe: layer forward, POINTER_ARGS={int(on)}", lambda: moe(x), inner=1)
    L.POINTER_ARGS = True
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"script": "scripts/launch_cost.py", "argv": sys.argv[1:], "iters": a.iters,
                       "torch": torch.__version__, "triton": triton.__version__, "gpu": torch.cuda.get_device_name(),
                       "git_rev": os.environ.get("TITAN_MEGAMOE_GIT_REV"),
                       "date": time.strftime("%Y-%m-%d"), "stages": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
