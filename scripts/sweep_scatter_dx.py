"""Time ``scatter_dx`` (the backward's gather-sum of dx rows into token order, optionally with the router's dx)
over program tiles at the Qwen3 layer shapes (GPU only).

    python scripts/sweep_scatter_dx.py [--shapes 30b,235b] [--out f.json]

16384 tokens, top-8, 128 experts, near-uniform random routing; each tile (BT tokens, BD columns, warps) with and
without the router's dx, checked bitwise against the default tile (``grouped_gemm_bwd.SCATTER_DX_TILE``), then
timed by ``triton.testing.do_bench`` (median, L2 flushed between calls); GB/s counts the K rows read per token,
dx written, and with the router its (T, E) d logits and (E, D) gate weight once.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

SHAPES = {"30b": 2048, "235b": 4096}
TILES = [(32, 128, 4), (16, 256, 4), (16, 256, 8), (32, 256, 8), (16, 512, 8), (8, 512, 4), (8, 1024, 8),
         (64, 128, 8), (32, 512, 8)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="30b,235b")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("sweep_scatter_dx.py: needs a GPU", file=sys.stderr)
        return 2
    import triton

    from titan_megamoe.kernels import grouped_gemm_bwd as B
    from titan_megamoe.kernels.routing import build_routing_layout
    from titan_megamoe.testing import make_routing

    T, E, K = 16384, 128, 8
    rows_out, bad = [], 0
    for name in a.shapes.split(","):
        D = SHAPES[name]
        g = torch.Generator(device="cuda").manual_seed(0)
        lay = build_routing_layout(make_routing("uniform", T, E, K, seed=0).cuda(), E, 128)
        rows = torch.randn(lay.n_cap, D, device="cuda", generator=g).to(torch.bfloat16)
        dl = (torch.randn(T, E, device="cuda", generator=g) * 0.01).to(torch.bfloat16)
        gw = (torch.randn(E, D, device="cuda", generator=g) / E ** 0.5).to(torch.bfloat16)
        for router in (False, True):
            kw = dict(router_dlogits=dl, gate_w=gw) if router else {}
            ref = B.scatter_dx(rows, lay, T, K, **kw)
            for tile in TILES:
                if router and tile[0] < 16:
                    continue
                try:
                    got = B.scatter_dx(rows, lay, T, K, tile=tile, **kw)
                except Exception as e:  # noqa: BLE001 - a tile that does not compile: reported, not fatal
                    print(f"{name} router={router} tile={tile}: {type(e).__name__}: {str(e)[:200]}")
                    continue
                same = torch.equal(got, ref)
                close = (got.float() - ref.float()).abs().max().item()
                bad += not same and close > 1e-2 * ref.float().abs().max().item()
                ms = triton.testing.do_bench(lambda: B.scatter_dx(rows, lay, T, K, tile=tile, **kw), warmup=25,
                                             rep=100, return_mode="median")
                nbytes = (T * K * D + T * D + (T * E + E * D if router else 0)) * 2
                r = dict(shape=name, D=D, router=router, tile=list(tile), ms=ms, gbps=nbytes / ms / 1e6,
                         bitwise_default=same, max_abs_diff=close)
                rows_out.append(r)
                print(f"{name} router={int(router)} BT={tile[0]:3d} BD={tile[1]:5d} warps={tile[2]} {ms * 1e3:8.1f} us "
                      f"{r['gbps']:7.0f} GB/s bitwise={same}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"script": "scripts/sweep_scatter_dx.py", "gpu": torch.cuda.get_device_name(),
                       "torch": torch.__version__, "triton": triton.__version__, "date": time.strftime("%Y-%m-%d"),
                       "git_rev": os.environ.get("TITAN_MEGAMOE_GIT_REV"), "tokens": T, "top_k": K, "experts": E,
                       "default_tile": list(B.SCATTER_DX_TILE), "rows": rows_out}, f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
