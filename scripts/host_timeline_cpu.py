"""The MegaMoE layer forward's launch timeline on a CPU machine: when, after the layer call, the host reaches
each kernel launch (the CPU counterpart of ``scripts/host_profile.py``'s timeline on the GPU machine).

    TRITON_INTERPRET=0 python scripts/host_timeline_cpu.py [--iters 300] [--rounds 5] [--baseline-tree DIR]
                                                         [--precision bf16|fp8|fp8_bwd]

The layer runs through the host-only sm_90a driver (``kernels/host_driver.py``): Triton binds, specializes and
calls the launcher of the real compiled kernels, which records nothing and launches nothing. The GPU machine's
dispatch is emulated: the Gluon warp-specialized kernels (GEMM1, GEMM1 dgrad, wgrads) are taken as on an
sm_90 GPU with 132 SMs, the fused router and the Triton routing layout as on CUDA tensors, so the launches are
the GPU path's (``_gate_topk_route_kernel``, ``_count_kernel``, ``_layout_kernel``, ``_gemm1_fwd_ws_kernel``, ...).

Protocol, as compare.layer times the forward: each timed forward follows the previous step's backward (also
host-only), so the forward starts with the caches the backward left, not with a hot loop of forwards. The
30B layer dims (D 2048, F 768, top-8) with few tokens and experts (T 64, E 8: CPU tensors stay small; the host
path does not depend on T or E).

``--precision fp8`` / ``fp8_bwd``: the FP8 layer (``[megamoe] precision``), its FP8 platform check passed as on an
H100 / H200 and its Gluon FP8 kernels taken as there; the FP8 layer does not take the fused eager path (bf16
only), so its forward goes through the router module, ``mega_moe``'s checks and the FP8 custom op.

``--baseline-tree DIR`` (a checkout of another revision, e.g. ``git worktree add /tmp/base REV``): the same
timeline of DIR's package, in subprocesses alternating with this tree's, rounds of ``--iters`` forwards each;
prints both, the medians over rounds and the least round (other processes on a shared machine only add time).

The microseconds are this CPU's; the GPU machine's host took ~3-7x longer per step from idle (docs/NOTES.md,
session 13). What carries over is which steps cost and the before / after of a host-side change.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

#: Run in a subprocess: argv = [tree, this tree's host_driver.py, iters, precision]; prints one JSON line.
_TIMER = r"""
import importlib.util, json, os, statistics, sys, time
os.environ["TRITON_INTERPRET"] = "0"
sys.path.insert(0, sys.argv[1])
spec = importlib.util.spec_from_file_location("host_driver", sys.argv[2])
hd = importlib.util.module_from_spec(spec); sys.modules["host_driver"] = hd; spec.loader.exec_module(hd)
import torch
torch.set_num_threads(1)
import titan_megamoe
from titan_megamoe.kernels import launch as L, routing
routing._use_triton = lambda ids, E: True
try:  # the Gluon kernels as on an sm_90 GPU with 132 SMs
    from titan_megamoe.kernels import ws_gemm
    ws_gemm._platform_reason = lambda t: None
    ws_gemm._sm_count = lambda index: 132
    torch.cuda.current_device = lambda: 0
except ImportError:
    pass
try:  # the Gluon GEMM2 forward (a tree without it: the Triton GEMM2)
    from titan_megamoe.kernels import ws_gemm2
    ws_gemm2._platform_reason = lambda t: None
except (ImportError, AttributeError):
    pass
precision = sys.argv[4]
if precision != "bf16":  # the FP8 platform check and the Gluon FP8 kernels (each module binds _platform_reason)
    import importlib
    from titan_megamoe.ops import fp8_backend
    fp8_backend.check_fp8_supported = lambda *a, **k: None
    for name in ("ws_gemm_fp8", "ws_wgrad", "ws_wgrad_fp8", "ws_gemm2_dgrad_fp8"):
        try:
            importlib.import_module("titan_megamoe.kernels." + name)._platform_reason = lambda t: None
        except ImportError:  # a baseline tree without that kernel
            pass
iters, warmup = int(sys.argv[3]), int(sys.argv[5])
T, K, E, D, F = 64, 8, 8, 2048, 768
from titan_megamoe.kernels import router as fr
_route_bwd = fr.topk_route_backward  # nothing runs, so the ids hold whatever was in memory: the backward's
fr.topk_route_backward = lambda logits, ids, *a: _route_bwd(logits, ids.clamp(0, E - 1), *a)  # torch ops index
with hd.host_only_driver(record=False):
    from torchtitan.models.moe.moe import MoEArgs
    from titan_megamoe.config import MegaMoEConfig
    from titan_megamoe.layer import MegaMoE
    layer = MegaMoE(MoEArgs(num_experts=E, top_k=K, score_func="softmax", route_norm=True, num_shared_experts=0,
                            score_before_experts=False), D, F,
                     config=MegaMoEConfig(backend="triton", precision=precision))
    with torch.no_grad():
        layer.init_weights(0.02, torch.device("cpu"))
    layer = layer.to(torch.bfloat16)
    layer.tokens_per_expert = layer.tokens_per_expert.float()  # .to(bf16) cast the fp32 buffer
    layer.router._fused_ok = lambda *args: True  # the fused router's CUDA-only condition
    x = torch.randn(1, T, D, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16).requires_grad_()
    dy = torch.randn_like(x)
    stamps = []
    real = L.launch
    def stamped(kernel, grid, *a, **k):
        stamps.append((getattr(getattr(kernel, "fn", kernel), "__name__", "?"), time.perf_counter()))
        return real(kernel, grid, *a, **k)
    for _ in range(warmup):
        layer(x).backward(dy)
    mods = [m for m in list(sys.modules.values())
            if getattr(m, "__name__", "").startswith("titan_megamoe.") and getattr(m, "launch", None) is real]
    for m in mods:
        m.launch = stamped
    fwd, per = [], {}
    params = list(layer.parameters())
    for _ in range(iters):
        for q in params:  # as compare.layer before each step (and no 25 MB grad accumulation on this CPU)
            q.grad = None
        x.grad = None
        stamps.clear()
        t0 = time.perf_counter()
        y = layer(x)
        fwd.append((time.perf_counter() - t0) * 1e6)
        for i, (n, t) in enumerate(stamps):
            per.setdefault(f"{i}:{n}", []).append((t - t0) * 1e6)
        y.backward(dy)
    seen = []  # one more forward, untimed: what each launch gets (tensors as dtype and shape)
    kept = []  # every tensor a launch got, alive to the end: no address is reused, so an address names one buffer
    def sig(v):  # tensors (and a TMA descriptor's base tensor) with their address: which buffer a launch reads
        if isinstance(v, torch.Tensor):
            kept.append(v)
            return [str(v.dtype), list(v.shape), v.data_ptr()]
        if isinstance(v, (int, float, bool, str, type(None))):
            return v
        base = getattr(v, "base", None)
        if isinstance(base, torch.Tensor):
            kept.append(base)
        return [type(v).__name__, list(getattr(v, "block_shape", [])),
                base.data_ptr() if isinstance(base, torch.Tensor) else None]
    def described(kernel, grid, *a, **k):
        seen.append([getattr(getattr(kernel, "fn", kernel), "__name__", "?"), list(grid), [sig(v) for v in a],
                     {n: sig(v) for n, v in sorted(k.items())}])
        return real(kernel, grid, *a, **k)
    for m in mods:
        m.launch = described
    paths = {}  # which FP8 forward ran (the checked one or the launch halves)
    if precision != "bf16":
        for name in ("fp8_fwd", "fp8_fwd_unchecked"):
            fn = getattr(fp8_backend, name, None)
            if fn is not None:
                setattr(fp8_backend, name, lambda *a, _fn=fn, _n=name, **k: paths.update({_n: 1}) or _fn(*a, **k))
    layer(x).backward(dy)
    for m in mods:
        m.launch = real
    named = {x.data_ptr(): "x", dy.data_ptr(): "dy"}  # buffers that outlive a step, by name (the rest are new)
    named.update({q.data_ptr(): n for n, q in layer.named_parameters()})
    for n, (_, val) in getattr(getattr(layer.experts, "fp8_cache", None), "_entries", {}).items():
        named.update({t.data_ptr(): f"{n}.{part}" for part, t in zip(("q", "s", "qT", "sT"), val) if t is not None})
print(json.dumps({"package": os.path.dirname(titan_megamoe.__file__), "fwd_us": statistics.median(fwd),
                  "launch_at_us": {k: statistics.median(v) for k, v in per.items()}, "launches": seen,
                  "paths": sorted(paths), "named": {str(k): v for k, v in named.items()}}))
"""


def _run(tree: str, iters: int, precision: str = "bf16", warmup: int = 50, env: dict | None = None) -> dict:
    """One subprocess of ``_TIMER`` on ``tree``: its median forward, launch times and the launches of one more step
    (``launches``: [kernel, grid, positional args, keyword args], tensors as [dtype, shape, address]; ``named``: the
    addresses of the buffers that outlive a step, x, dy, the parameters and the FP8 weight cache, by name). ``env``: more
    environment variables (switches) for the subprocess."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    drv = os.path.join(here, "titan_megamoe", "kernels", "host_driver.py")
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, **(env or {})}
    # keep the path entries that hold other packages (the GPU machine's wheels: torchtitan), not another tree's
    keep = [d for d in os.environ.get("PYTHONPATH", "").split(os.pathsep)
            if d and not os.path.isdir(os.path.join(d, "titan_megamoe"))]
    if keep:
        env["PYTHONPATH"] = os.pathsep.join(keep)
    env["CUDA_VISIBLE_DEVICES"] = ""  # the host-only driver refuses a visible GPU (a GPU machine runs this test too)
    out = subprocess.run([sys.executable, "-c", _TIMER, tree, drv, str(iters), precision, str(warmup)],
                         capture_output=True, text=True, env=env)
    if out.returncode:
        raise RuntimeError(f"timeline of {tree} failed:\n{out.stderr[-3000:]}")
    got = json.loads(out.stdout.strip().splitlines()[-1])
    if os.path.realpath(os.path.dirname(got["package"])) != os.path.realpath(tree):
        raise RuntimeError(f"the subprocess imported {got['package']}, not {tree}'s package")
    return got


def _tree_rev(tree: str) -> str | None:
    """The checkout's short git revision (None outside a git work tree, e.g. a ``git archive``)."""
    out = subprocess.run(["git", "-C", tree, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return out.stdout.strip() or None if out.returncode == 0 else None


def _summary(runs: list[dict]) -> dict:
    keys = runs[0]["launch_at_us"].keys()
    return {"fwd_us": round(statistics.median(r["fwd_us"] for r in runs), 1),
            "fwd_min_us": round(min(r["fwd_us"] for r in runs), 1),
            "launch_at_us": {k: round(statistics.median(r["launch_at_us"].get(k, float("nan")) for r in runs), 1)
                             for k in keys}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--baseline-tree", default=None)
    p.add_argument("--out", default=None)
    p.add_argument("--precision", default="bf16", choices=["bf16", "fp8", "fp8_bwd"])
    a = p.parse_args(argv)
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    trees = ([a.baseline_tree] if a.baseline_tree else []) + [here]
    runs: dict[str, list] = {t: [] for t in trees}
    for _ in range(a.rounds):
        for t in trees:
            runs[t].append(_run(t, a.iters, a.precision))
    result = {t: _summary(r) for t, r in runs.items()}
    for t, s in result.items():
        print(json.dumps({"tree": t, **s}))
    if a.baseline_tree:
        b, h = result[a.baseline_tree], result[here]
        print(json.dumps({"fwd_ratio": round(h["fwd_us"] / b["fwd_us"], 3),
                          "fwd_ratio_of_min": round(h["fwd_min_us"] / b["fwd_min_us"], 3)}))
    if a.out:
        import torch

        from compare.records import provenance

        revs = {t: _tree_rev(t) for t in trees}
        run = provenance(device=torch.device("cpu"), world_size=1, dist_backend=None, hostnames=[],
                         argv=sys.argv[1:], options=vars(a), module="scripts.host_timeline_cpu")
        with open(a.out, "w") as f:
            json.dump({"bench": "host_timeline_cpu", "run": run, "iters": a.iters, "rounds": a.rounds,
                       "tree_revs": revs, "trees": result}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
