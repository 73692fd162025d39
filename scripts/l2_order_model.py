"""A CPU model of the DRAM bytes a grouped GEMM's tile order costs: an LRU L2 fed by the operand tiles of
persistent programs that drift apart (or of a grid whose programs start in tile order).

    python scripts/l2_order_model.py [--kernel gemm1_dgrad|gemm1_fwd] [--shape 235b|30b] [--l2-mb 50 25]
                                     [--jitter 0.05] [--seed 0] [--out f.json]

Why: Nsight Compute measured ~11 GB of DRAM reads in the 235B bf16 GEMM1 dgrad against a 5.1 GB minimum (docs/NOTES.md,
session 27), and session 30 built two opt-in orders against it (``WS_GEMM1_EXPERT_ORDER``, ``WS_GEMM1_GRID``) that
have not run on a GPU. This model says how much each order could save if L2 capacity is the cause; a GPU run
(``scripts/ab_kernels.py``, Nsight) decides.

Model: the routing layout of 16,384 tokens, top-8, 128 experts, uniform router (``testing.make_routing``, as
``scripts/ab_kernels.py``); 132 programs; the tile order of ``ws_gemm._tile_of`` / ``_tile_in_expert``. Each K step of
a tile touches its A tile (BM x BK) and B tile (BK x BN) as whole objects of an LRU cache of ``--l2-mb``; a miss
costs the object's bytes. A K step takes one time unit times (1 + ``--jitter`` x a normal draw per program and
tile), so persistent programs drift apart as real ones do; ``grid`` hands the next tile to the program that frees
first (the hardware's in-order block dispatch, and equally the persistent programs of ``WS_GEMM1_DYNAMIC``,
which take tickets from one counter as they free up). Output writes (dx / gate_up, h) are not counted.
What it leaves out: L2's two partitions (an SM's far-partition hits; try ``--l2-mb 25``), sector granularity,
the row gather's cross-expert reuse of x rows (forward), prefetch and write-back traffic.
"""

from __future__ import annotations

import argparse
import heapq
import json
import os
import sys
import time
from collections import OrderedDict

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

SHAPES = {"30b": (2048, 768), "235b": (4096, 1536)}
#: (BN, BK, K steps as a function of D, F, N columns as a function of D, F, B bytes per K step) per kernel,
#: as the default configs: GEMM1 dgrad coop 128 x 256 tiles, K = 2F; forward 128 x 128 (gate and up tiles), K = D.
KERNELS = {
    "gemm1_dgrad": dict(bn=256, bk=64, k=lambda D, F: 2 * F, n=lambda D, F: D, b_tiles=1),
    "gemm1_fwd": dict(bn=128, bk=64, k=lambda D, F: D, n=lambda D, F: F, b_tiles=2),
    # GEMM2 forward (Triton default and the Gluon ws_gemm2): 128 x 256 tiles of h @ w2[e]^T, K = F, group_m 8
    "gemm2_fwd": dict(bn=256, bk=64, k=lambda D, F: F, n=lambda D, F: D, b_tiles=1),
}


def tile_orders(offsets: list[int], tile_expert: list[int], bm: int, num_n: int) -> dict[str, list[tuple[int, int]]]:
    """{order: [(row tile, column block)] in the order the programs take them}: ``_tile_of`` with group_m 1 and 8, and
    ``_tile_in_expert``'s expert order (group_m 0)."""
    E = len(offsets) - 1
    n_live = offsets[E] // bm
    out = {}
    for gm in (1, 8):
        seq = []
        for t in range(n_live * num_n):
            width = gm * num_n
            first_m = (t // width) * gm
            group = min(n_live - first_m, gm)
            seq.append((first_m + (t % width) % group, (t % width) // group))
        out[f"group_m {gm}"] = seq
    seq = []
    for t in range(n_live * num_n):
        e = tile_expert[t // num_n]
        first = offsets[e] // bm
        rows = offsets[e + 1] // bm - first
        local = t - first * num_n
        seq.append((first + local % rows, local // rows))
    out["expert order"] = seq
    return out


def simulate(seq, tile_expert, k_steps: int, a_bytes: int, b_bytes: int, b_tiles: int, cap: int, programs: int,
             jitter: float, grid: bool, seed: int) -> float:
    """DRAM bytes read (GB) for tiles ``seq`` on ``programs`` programs with an LRU cache of ``cap`` bytes."""
    import random

    rng = random.Random(seed)
    cache: OrderedDict = OrderedDict()
    used = 0
    missed = 0

    def touch(key, size):
        nonlocal used, missed
        if key in cache:
            cache.move_to_end(key)
            return
        missed += size
        cache[key] = size
        used += size
        while used > cap:
            _, s = cache.popitem(last=False)
            used -= s

    # per program: its tile list (persistent: grid-strided) or a shared queue (grid)
    queues = None if grid else [seq[p::programs] for p in range(programs)]
    nxt = programs  # grid: the next tile to hand out
    heap = []  # (time, program, tile index in its list or seq, k step, step duration)
    for p in range(min(programs, len(seq))):
        heap.append((0.0, p, p if grid else 0, 0, 1.0 + jitter * rng.gauss(0, 1)))
    heapq.heapify(heap)
    while heap:
        t, p, i, k, dur = heapq.heappop(heap)
        m, n = seq[i] if grid else queues[p][i]
        e = tile_expert[m]
        touch(("a", m, k), a_bytes)
        for q in range(b_tiles):
            touch(("b", e, k, n, q), b_bytes)
        if k + 1 < k_steps:
            heapq.heappush(heap, (t + max(dur, 0.2), p, i, k + 1, dur))
            continue
        if grid:
            if nxt < len(seq):
                heapq.heappush(heap, (t + max(dur, 0.2), p, nxt, 0, 1.0 + jitter * rng.gauss(0, 1)))
                nxt += 1
        elif i + 1 < len(queues[p]):
            heapq.heappush(heap, (t + max(dur, 0.2), p, i + 1, 0, 1.0 + jitter * rng.gauss(0, 1)))
    return missed / 1e9


def _git_rev() -> str | None:
    import subprocess

    out = subprocess.run(["git", "-C", os.path.dirname(os.path.abspath(__file__)), "rev-parse", "--short", "HEAD"],
                         capture_output=True, text=True)
    return out.stdout.strip() or None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kernel", default="gemm1_dgrad", choices=sorted(KERNELS))
    ap.add_argument("--shape", default="235b", choices=sorted(SHAPES))
    ap.add_argument("--l2-mb", type=float, nargs="+", default=[50.0, 25.0])
    ap.add_argument("--jitter", type=float, default=0.05,
                    help="relative spread of a K step's time per program and tile")
    ap.add_argument("--programs", type=int, default=132)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)

    from titan_megamoe.kernels.routing import build_routing_layout_torch
    from titan_megamoe.testing import make_routing

    D, F = SHAPES[a.shape]
    kern = KERNELS[a.kernel]
    bm, bn, bk = 128, kern["bn"], kern["bk"]
    lay = build_routing_layout_torch(make_routing("uniform", 16384, 128, 8, seed=0), 128, bm)
    offsets, tile_expert = lay.offsets.tolist(), lay.tile_expert.tolist()
    num_n = kern["n"](D, F) // bn
    k_steps = kern["k"](D, F) // bk
    a_bytes, b_bytes = bm * bk * 2, bk * bn * 2
    n_live = offsets[-1] // bm
    minimum = (n_live * bm * kern["k"](D, F) * 2 + 128 * kern["k"](D, F) * kern["n"](D, F) * 2 * kern["b_tiles"]) / 1e9
    print(f"{a.kernel} {a.shape}: {n_live} row tiles x {num_n} column blocks, {k_steps} K steps; operands read once: "
          f"{minimum:.2f} GB (A {n_live * bm * kern['k'](D, F) * 2 / 1e9:.2f}, weights "
          f"{128 * kern['k'](D, F) * kern['n'](D, F) * 2 * kern['b_tiles'] / 1e9:.2f})", flush=True)
    rows = []
    for cap_mb in a.l2_mb:
        for name, seq in tile_orders(offsets, tile_expert, bm, num_n).items():
            for grid in (False, True):
                gb = simulate(seq, tile_expert, k_steps, a_bytes, b_bytes, kern["b_tiles"], int(cap_mb * 2**20),
                              a.programs, a.jitter, grid, a.seed)
                rows.append(dict(l2_mb=cap_mb, order=name, grid=grid, dram_read_gb=gb, x_minimum=gb / minimum))
                print(f"  L2 {cap_mb:4.0f} MB  {name:12s} {'grid      ' if grid else 'persistent'}  {gb:6.2f} GB "
                      f"({gb / minimum:.2f}x the minimum)", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(script="scripts/l2_order_model.py", command=" ".join(sys.argv),
                           date=time.strftime("%Y-%m-%d"),
                           git_rev=_git_rev(), machine="CPU (a model, no GPU)", kernel=a.kernel, shape=a.shape,
                           jitter=a.jitter,
                           programs=a.programs, seed=a.seed, minimum_gb=minimum, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
