"""Where the counter schedule (``WS_GEMM1_DYNAMIC``, fenced since session 32) hangs: one GEMM1 dgrad launch with a
given grid, in its own process, so the caller can kill it after a few seconds (``timeout -s KILL 25``).

    python scripts/probe_dynamic.py --programs 1 [--expert-order] [--shape T,E,K,D,F]

Prints one JSON line: the grid, the live tiles, whether the launch returned, the counter after it, and whether the
output has the static schedule's bits. ``--programs 1`` isolates the hand-off inside one program (no other program
takes tickets); larger grids bring in the counter's cross-program use.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--programs", type=int, default=0, help="grid size (0: the SM count)")
    ap.add_argument("--expert-order", action="store_true", help="group_m 0 (the default order since session 32)")
    ap.add_argument("--shape", default="1000,8,1,256,128", help="T,E,K,D,F")
    args = ap.parse_args()

    from titan_megamoe.kernels import ws_gemm
    from titan_megamoe.kernels.routing import build_routing_layout
    from titan_megamoe.testing import make_routing

    ws_gemm.DYNAMIC_FENCED = False
    T, E, K, D, F = (int(v) for v in args.shape.split(","))
    g = torch.Generator(device="cuda").manual_seed(13)
    lay = build_routing_layout(make_routing("uniform", T, E, K, seed=13).cuda(), E, 128)
    dgu = torch.randn(lay.n_cap, 2 * F, device="cuda", generator=g).bfloat16()
    w1 = (torch.randn(E, F, D, device="cuda", generator=g) / F ** 0.5).bfloat16()
    w3 = (torch.randn(E, F, D, device="cuda", generator=g) / F ** 0.5).bfloat16()
    cfg = ws_gemm.CONFIGS["coop"]
    if args.expert_order:
        cfg = dataclasses.replace(cfg, group_m=0)
    ref = ws_gemm.ws_gemm1_dgrad(dgu, w1, w3, lay, cfg=cfg)
    torch.cuda.synchronize()
    n = int(lay.offsets[-1])
    live = n // 128 * -(-D // cfg.block_n)
    out = torch.full_like(ref, float("nan"))
    programs = args.programs or None
    rec = dict(programs=programs, live_tiles=live, shape=args.shape, expert_order=args.expert_order)
    print(json.dumps(dict(rec, stage="launching")), flush=True)
    t0 = time.perf_counter()
    ws_gemm.ws_gemm1_dgrad(dgu, w1, w3, lay, out=out, cfg=dataclasses.replace(cfg, dynamic=True), programs=programs)
    torch.cuda.synchronize()
    rec.update(stage="returned", seconds=round(time.perf_counter() - t0, 3),
               counter=int(ws_gemm._tile_counter(out.device, "gemm1_dgrad").item()),
               bitwise=bool(torch.equal(out[:n], ref[:n])), nan_rows=int(torch.isnan(out[:n]).any(1).sum()))
    print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
