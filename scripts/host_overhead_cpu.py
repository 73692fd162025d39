"""Host time of the kernel launchers and of the op's host steps, on a CPU machine, with the fast launch
path of kernels/launch.py off and on, side by side in one process.

    TRITON_INTERPRET=0 python scripts/host_overhead_cpu.py [--iters 400] [--rounds 5] [--out host.json]

Runs the package's launchers in compiled mode through the host-only sm_90a driver
(``kernels/host_driver.py``): Triton specializes, finds the compiled kernel and calls the launcher,
which here records nothing and launches nothing; the device work is absent, so what is timed is the
host's part of a launch (our launcher: checks, configs, allocations; Triton's: binder, cache key,
launch path). Tensors are CPU tensors at the Qwen3-30B-A3B layer dims (D 2048, F 768, top-8) with few
tokens and experts (T 64, E 8) so CPU allocations stay small.

For each stage the two modes alternate within every round (``--rounds`` rounds of ``--iters`` calls
each, median per round, then the median over rounds; the least round too, since other processes on
a shared machine only ever add time), so drift of this machine's clock hits both.
This CPU is not the GPU machines' host (a torch op took 22 us there, benchmarks/results/
host_overhead_30b_1xh200_20261130.json): the ratios carry over, the microseconds do not.
``scripts/host_overhead.py`` measures on the GPU machine.

Prints one JSON line per stage {"stage", "triton_path_us", "fast_path_us", "ratio"}; writes them with
provenance to ``--out``.

``--baseline-tree DIR`` (a checkout of an earlier revision, e.g. ``git worktree add /tmp/base REV``)
also times the op's forward and backward host steps (EP = 1, and EP = 2 with two emulated ranks in
lockstep, per rank) with DIR's package, in subprocesses alternating with this tree's, through this
tree's host-only driver: the before / after of a host-side change.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone

os.environ["TRITON_INTERPRET"] = "0"
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402


def _median_us(fn, iters: int) -> float:
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e6


def _stages():
    from titan_megamoe.kernels import fp8_quant as q8
    from titan_megamoe.kernels import grouped_gemm as gg
    from titan_megamoe.kernels import grouped_gemm_bwd as gb
    from titan_megamoe.kernels import grouped_gemm_fp8 as g8
    from titan_megamoe.kernels import routing
    from titan_megamoe.ops import triton_backend as tb

    routing._use_triton = lambda ids, E: True  # CPU tensors: the Triton layout, as on a GPU
    v = {"torch": torch}
    exec(_INPUTS, v)  # the op's inputs, the same code as the --baseline-tree subprocesses run
    T, K, E, D, F, bf = (v[n] for n in ("T", "K", "E", "D", "F", "bf"))
    ids, x, w1, w3, w2, scores, dout = (v[n] for n in ("ids", "x", "w1", "w3", "w2", "s", "dout"))
    lay = routing.build_routing_layout(ids, E, 128)
    gu = torch.zeros(lay.n_cap, 2 * F, dtype=bf)
    h = torch.zeros(lay.n_cap, F, dtype=bf)
    y = torch.zeros(T * K, D, dtype=bf)
    hs = torch.zeros(lay.n_cap, F, dtype=bf)
    f8 = torch.float8_e4m3fn
    xq, xs = torch.zeros(T, D, dtype=f8), torch.ones(T, D // 128)
    w1q, w3q = torch.zeros(E, F, D, dtype=f8), torch.zeros(E, F, D, dtype=f8)
    w1s, w3s = torch.ones(E, F // 128, D // 128), torch.ones(E, F // 128, D // 128)
    w2q, w2s = torch.zeros(E, D, F, dtype=f8), torch.ones(E, D // 128, F // 128)
    hq, hsc = torch.zeros(lay.n_cap, F, dtype=f8), torch.ones(lay.n_cap, F // 128)
    dgu, _ = gb.gemm2_dgrad_swiglu_bwd(dout, w2, gu, scores, lay, hs_out=hs)
    return {
        "routing layout (2 launches)": lambda: routing.build_routing_layout(ids, E, 128),
        "gemm1 launch": lambda: gg.gemm1_swiglu_fwd(x, w1, w3, lay, gate_up_out=gu, h_out=h),
        "gemm2 launch": lambda: gg.gemm2_scatter_fwd(h, w2, scores, lay, out_pairs=y),
        "combine launch": lambda: gg.combine_topk(y, T, K),
        "gemm2_dgrad launch": lambda: gb.gemm2_dgrad_swiglu_bwd(dout, w2, gu, scores, lay, hs_out=hs),
        "gemm1_dgrad launch": lambda: gb.gemm1_dgrad(dgu, w1, w3, lay),
        "fp8 quant 1x128 launch": lambda: q8.quantize_act_1x128(x),
        "fp8 gemm1 launch": lambda: g8.gemm1_swiglu_fwd_fp8(xq, xs, w1q, w1s, w3q, w3s, lay),
        "fp8 gemm2 launch": lambda: g8.gemm2_scatter_fwd_fp8(hq, hsc, w2q, w2s, scores, lay),
        "bf16 forward host steps (triton_fwd)": lambda: tb.triton_fwd(x, ids, scores, w1, w2, w3),
        "bf16 backward host steps (triton_bwd)": lambda: tb.triton_bwd(dout, x, scores, w1, w2, w3, gu, lay),
    }


#: The op's inputs (CPU tensors at the 30B dims, few tokens and experts), run by exec in this process and
#: in the --baseline-tree subprocesses, so both time the same call.
_INPUTS = """
g = torch.Generator().manual_seed(0)
T, K, E, D, F = 64, 8, 8, 2048, 768
bf = torch.bfloat16
ids = torch.randint(0, E, (T, K), generator=g, dtype=torch.int64)
x = torch.randn(T, D, generator=g).to(bf)
w1, w3 = torch.randn(E, F, D, generator=g).to(bf), torch.randn(E, F, D, generator=g).to(bf)
w2 = torch.randn(E, D, F, generator=g).to(bf)
s, dout = torch.rand(T, K, generator=g), torch.randn(T, D, generator=g).to(bf)
"""

_OP_TIMER = r"""
import importlib.util, json, os, statistics, sys, time
os.environ["TRITON_INTERPRET"] = "0"
sys.path.insert(0, sys.argv[1])
spec = importlib.util.spec_from_file_location("host_driver", sys.argv[2])
hd = importlib.util.module_from_spec(spec); sys.modules["host_driver"] = hd; spec.loader.exec_module(hd)
import torch
torch.set_num_threads(1)  # the few real CPU ops here (the router's gate linear) must not wait on a thread pool
import titan_megamoe
from titan_megamoe.kernels import routing
from titan_megamoe.ops import triton_backend as tb
routing._use_triton = lambda ids, E: True
iters = int(sys.argv[3])
exec(sys.argv[4])  # _INPUTS
def med(fn):
    for _ in range(max(50, iters // 2)):  # a fresh process: allocator and interpreter warm-up
        fn()
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter(); fn(); ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e6
from titan_megamoe.comm.peers import emulated_group
from titan_megamoe.comm.workspace import WorkspaceLayout
from titan_megamoe.ops.ep_backend import EPRank, ep_backward_steps, ep_forward_steps, run_lockstep
with hd.host_only_driver(record=False):
    out, gu, lay = tb.triton_fwd(x, ids, s, w1, w2, w3)
    # EP = 2, two emulated ranks in lockstep (their barriers launch nothing; on GPUs each is a kernel)
    R, El = 2, E // 2
    ws = WorkspaceLayout.build(R, T, D, K)
    peers = emulated_group(R, ws.nbytes, "cpu")
    ctxs = [EPRank(peers[r], ws, El, R * T * K, 128) for r in range(R)]
    loc = [tuple(w[r * El:(r + 1) * El] for w in (w1, w2, w3)) for r in range(R)]
    ep_fwd = lambda: run_lockstep([ep_forward_steps(ctxs[r], x, ids, s, *loc[r]) for r in range(R)])
    f = ep_fwd()
    ep_bwd = lambda: run_lockstep([ep_backward_steps(ctxs[r], dout, x, ids, s, *loc[r], f[r][1], f[r][2])
                                   for r in range(R)])
    # the public op with autograd recording (what MegaMoEExperts calls), and the whole MegaMoE layer
    from titan_megamoe.ops import mega_moe
    leaves = [t.clone().requires_grad_() for t in (x, s, w1, w2, w3)]
    op_fwd = lambda: mega_moe(leaves[0], ids, leaves[1], *leaves[2:], num_experts=E, backend="triton")
    from torchtitan.models.moe.moe import MoEArgs
    from titan_megamoe.config import MegaMoEConfig
    from titan_megamoe.layer import MegaMoE
    layer = MegaMoE(MoEArgs(num_experts=E, top_k=K, score_func="softmax", route_norm=True, num_shared_experts=0,
                            score_before_experts=False),
                    D, F, config=MegaMoEConfig(backend="triton"))
    with torch.no_grad():
        layer.init_weights(0.02, torch.device("cpu"))
    layer = layer.to(torch.bfloat16)
    if hasattr(layer.router, "_fused_ok"):  # the fused router's GPU path (CPU tensors here, no interpreter)
        layer.router._fused_ok = lambda *args: True
    xl = x.view(1, T, D).clone().requires_grad_()
    layer_fwd = lambda: layer(xl)
    print(json.dumps({"package": os.path.dirname(titan_megamoe.__file__),
                      "op_fwd": med(op_fwd), "layer_fwd": med(layer_fwd),
                      "fwd": med(lambda: tb.triton_fwd(x, ids, s, w1, w2, w3)),
                      "bwd": med(lambda: tb.triton_bwd(dout, x, s, w1, w2, w3, gu, lay)),
                      "ep_fwd": med(ep_fwd) / R, "ep_bwd": med(ep_bwd) / R}))
"""


def _baseline_rows(base_tree: str, iters: int, rounds: int) -> list[dict]:
    """Op forward / backward host us of ``base_tree``'s package against this tree's, same driver."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    drv = os.path.join(here, "titan_megamoe", "kernels", "host_driver.py")
    per = {base_tree: [], here: []}
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    for _ in range(rounds):
        for tree in (base_tree, here):
            out = subprocess.run([sys.executable, "-c", _OP_TIMER, tree, drv, str(iters), _INPUTS], capture_output=True,
                                 text=True, env=env, check=True).stdout
            got = json.loads(out.strip().splitlines()[-1])
            if os.path.realpath(os.path.dirname(got["package"])) != os.path.realpath(tree):
                raise RuntimeError(f"--baseline-tree: the subprocess imported {got['package']}, not {tree}'s package "
                                   "(an editable install's finder shadows it?)")
            per[tree].append(got)
    rows = []
    for k, name in (("op_fwd", "bf16 op forward, autograd on (ops.mega_moe)"),
                    ("layer_fwd", "bf16 MegaMoE layer forward, router + experts, autograd on"),
                    ("fwd", "bf16 forward host steps (triton_fwd)"), ("bwd", "bf16 backward host steps (triton_bwd)"),
                    ("ep_fwd", "bf16 EP 2 forward host steps per rank (ep_forward_steps, 2 emulated ranks)"),
                    ("ep_bwd", "bf16 EP 2 backward host steps per rank (ep_backward_steps, 2 emulated ranks)")):
        old = [r[k] for r in per[base_tree]]
        new = [r[k] for r in per[here]]
        # median over rounds, and the least round: other processes on this machine only ever add time
        rows.append({"stage": f"{name}, baseline tree vs this tree", "baseline_us": round(statistics.median(old), 2),
                     "this_tree_us": round(statistics.median(new), 2),
                     "ratio": round(statistics.median(new) / statistics.median(old), 3),
                     "baseline_min_us": round(min(old), 2), "this_tree_min_us": round(min(new), 2),
                     "ratio_of_min": round(min(new) / min(old), 3), "rounds": rounds})
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--iters", type=int, default=400)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default=None)
    p.add_argument("--baseline-tree", default=None, help="checkout of an earlier revision to compare with")
    a = p.parse_args(argv)
    from titan_megamoe.kernels import launch as L
    from titan_megamoe.kernels.host_driver import host_only_driver

    rows = []
    with host_only_driver(record=False):
        stages = _stages()
        for fn in stages.values():  # compile every specialization once, both paths warm
            for mode in (False, True, True):
                L.FAST_LAUNCH = mode
                fn()
        for stage, fn in stages.items():
            per = {False: [], True: []}
            for _ in range(a.rounds):
                for mode in (False, True):
                    L.FAST_LAUNCH = mode
                    per[mode].append(_median_us(fn, a.iters))
            slow, fast = statistics.median(per[False]), statistics.median(per[True])
            rows.append({"stage": stage, "triton_path_us": round(slow, 2), "fast_path_us": round(fast, 2),
                         "ratio": round(fast / slow, 3), "triton_path_min_us": round(min(per[False]), 2),
                         "fast_path_min_us": round(min(per[True]), 2),
                         "ratio_of_min": round(min(per[True]) / min(per[False]), 3)})
            print(json.dumps(rows[-1]), flush=True)
        L.FAST_LAUNCH = True
    if a.baseline_tree:
        base_rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                  cwd=a.baseline_tree).stdout.strip()
        for row in _baseline_rows(a.baseline_tree, a.iters, a.rounds):
            row["baseline_rev"] = base_rev
            rows.append(row)
            print(json.dumps(row), flush=True)
    ref = {"torch.empty (64, 2048) bf16": lambda: torch.empty((64, 2048), dtype=torch.bfloat16),
           "torch elementwise (64, 2048) bf16": lambda: torch.ones(64, 2048, dtype=torch.bfloat16).mul_(2)}
    for stage, fn in ref.items():
        rows.append({"stage": stage, "host_us": round(statistics.median(_median_us(fn, a.iters)
                                                                          for _ in range(a.rounds)), 2)})
        print(json.dumps(rows[-1]), flush=True)
    if a.out:
        import triton

        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
        cpu = platform.processor() or platform.machine()
        try:
            with open("/proc/cpuinfo") as f:
                cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
        except OSError:
            pass
        with open(a.out, "w") as f:
            json.dump({"bench": "host_overhead_cpu", "machine": f"CPU only ({cpu}, {os.cpu_count()} cores)",
                       "driver": "kernels/host_driver.py (sm_90a compile, no launch)",
                       "shape": {"T": 64, "E": 8, "D": 2048, "F": 768, "K": 8},
                       "python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__,
                       "git_rev": rev, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                       "command": "TRITON_INTERPRET=0 python scripts/host_overhead_cpu.py "
                                  + " ".join(argv or sys.argv[1:]),
                       "iters": a.iters, "rounds": a.rounds, "stages": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
