"""The FP8 backward's two standalone quantization passes: the Triton kernels (v1) against the Gluon ones
(``gl_quant_bwd.py``) in several launch configurations (warps, register cap; the persistent pipelined kernels' warps,
stages and programs per SM), in one process. Prints one JSON line.

    python scripts/bench_quant_bwd.py                  # 30B and 235B shapes, T = 16384, on a GPU
    TRITON_INTERPRET=1 python scripts/bench_quant_bwd.py --smoke   # CPU: v1 once at a tiny shape (checks the script)
    ncu --clock-control none -k regex:_quant_ python scripts/bench_quant_bwd.py --shapes 30b --ncu
        # v1 and the default Gluon variant of each pass, each launched twice, not timed (for a profiler)

Operands as in the FP8 backward at EP = 1: dgate_up (N_cap, 2F) bf16 for the dual 1x128 + 128x1 pass (rows past
the last expert's end left out, ``end_row``), x and dout (T, D) bf16 gathered into the layout for the 128x1 pass.
Every variant's outputs are compared bitwise with v1's before timing (``bitwise_v1``; rows past end_row are
unwritten by both). Timing: ``triton.testing.do_bench`` medians (L2 cleared between runs); ``gbs`` counts the bytes a
pass must move (bf16 reads of the live rows, e4m3 + fp32 writes) over its time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

if "--smoke" not in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "0")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

SHAPES = {"30b": (2048, 768), "235b": (4096, 1536), "smoke": (256, 128)}
E, K = 128, 8
# Gluon launch configurations per pass (gl_quant_bwd.DUAL_CONFIG / GATHER_CONFIG; the first is the default):
# sm_90a builds (30B) give registers per thread, programs per SM follow (65536 registers)
DUAL = [
    ("gluon8w_slab32_r80", dict(NW=8, maxnreg=80, SLAB=32)),  # 80 registers: three programs per SM
    ("gluon16w_slab32", dict(NW=16, maxnreg=None, SLAB=32)),  # 64: two programs of 16 warps
    ("gluon8w_slab32_r64", dict(NW=8, maxnreg=64, SLAB=32)),  # 64 + 56 B of spills: four
]
# the persistent pipelined kernels (gl_quant_bwd.PIPE_CONFIG, session 25; variant "gluon_pipe"): NW warps, STAGES
# tiles in flight per program, PER_SM programs per SM (grid), SLAB columns of the 128x1 work
PIPE = [
    ("pipe8w_s3_x2", dict(NW=8, STAGES=3, PER_SM=2, SLAB=32, COLS="cta")),  # dual 127 / gather 80 registers, 97 KiB
    ("pipe8w_s4_x1", dict(NW=8, STAGES=4, PER_SM=1, SLAB=32, COLS="cta")),  # 129 KiB: one per SM, four tiles in flight
    # COLS="warp" (session 26): warp-owned columns, swizzled buffers; dual and gather 128 registers
    ("pipe8w_s3_x2_warp", dict(NW=8, STAGES=3, PER_SM=2, SLAB=32, COLS="warp")),  # two per SM
    ("pipe8w_s4_x1_warp", dict(NW=8, STAGES=4, PER_SM=1, SLAB=32, COLS="warp")),
    ("pipe8w_s2_x2_warp", dict(NW=8, STAGES=2, PER_SM=2, SLAB=32, COLS="warp")),
    ("pipe4w_s3_x3_warp", dict(NW=4, STAGES=3, PER_SM=3, SLAB=32, COLS="warp")),  # 32-column slabs, 4 warps
]
GATHER = [
    ("gluon4w_bc32", dict(NW=4, maxnreg=None, BC=32)),  # 79 registers: six programs per SM
    ("gluon8w_bc32_r40", dict(NW=8, maxnreg=40, BC=32)),  # 40, no spills: six
    ("gluon4w_bc32_r64", dict(NW=4, maxnreg=64, BC=32)),  # 64 + 32 B of spills: eight
    ("gluon8w_bc32", dict(NW=8, maxnreg=None, BC=32)),  # 47: five
    ("gluon8w_bc64", dict(NW=8, maxnreg=None, BC=64)),  # 79: three
]


def _same(a, b, end: int) -> bool:
    """Bitwise equality of two quantizer outputs on the rows both write (< end): the dual's (y, s, yT, sT) or the
    gathered pass's (yT, sT); yT is (C, M) transposed, sT has one row per 128 rows."""
    cut = {4: ("rows", "rows", "cols", "blocks"), 2: ("cols", "blocks")}[len(a)]

    def part(t, how):
        t = t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
        return {"rows": t[:end], "cols": t[:, :end], "blocks": t[: end // 128]}[how]
    return all(torch.equal(part(x, c), part(y, c)) for x, y, c in zip(a, b, cut))


def _bench_shape(name: str, T: int, smoke: bool, once: bool = False) -> dict:
    import triton

    from titan_megamoe.kernels import gl_quant_bwd as GQ
    from titan_megamoe.kernels.fp8_quant_bwd import quantize_dual_1x128_128x1_t, quantize_gather_128x1_t
    from titan_megamoe.kernels.routing import build_routing_layout

    D, F = SHAPES[name]
    e, k = (4, 2) if smoke else (E, K)
    dev = "cpu" if smoke else "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(T, D, device=dev, generator=g).bfloat16()
    dout = torch.randn(T, D, device=dev, generator=g).bfloat16()
    ids = torch.rand(T, e, device=dev, generator=g).topk(k, dim=1).indices
    L = build_routing_layout(ids, e, 128)
    N = L.n_cap
    valid = L.row_pair >= 0
    dgu = torch.randn(N, 2 * F, device=dev, generator=g).bfloat16()
    end_row = L.offsets[-1:]
    end = int(end_row)
    live = int(valid.sum())

    def time_ms(fn):
        if smoke or once:
            fn()
            return None
        fn()
        torch.cuda.synchronize()
        return round(triton.testing.do_bench(fn, warmup=25, rep=200), 4)

    rows = []
    # bytes a pass must move: the dual reads 2F bf16 per live row and writes 2 x 2F e4m3 + scales; the gathered
    # pass reads D bf16 per live row (L2 hits not subtracted) and writes D e4m3 + scales
    dual_bytes = end * 2 * F * (2 + 2) + end * (2 * F // 128) * 4 + (end // 128) * 2 * F * 4
    gath_bytes = end * D * (2 + 1) + (end // 128) * D * 4
    dual0, gather0, pipe0 = dict(GQ.DUAL_CONFIG), dict(GQ.GATHER_CONFIG), dict(GQ.PIPE_CONFIG)
    def run(label, pass_, fn, ref, nbytes, cfg):
        if cfg is not None:  # the defaults first: a variant names only what it changes
            for t, t0 in ((GQ.PIPE_CONFIG, pipe0), (GQ.DUAL_CONFIG, dual0), (GQ.GATHER_CONFIG, gather0)):
                t.clear(), t.update(t0)
            table = GQ.PIPE_CONFIG if "STAGES" in cfg else GQ.DUAL_CONFIG if pass_ == "dual" else GQ.GATHER_CONFIG
            table.update(cfg)
        try:
            same = _same(fn(), ref, end)
            ms = time_ms(fn)
            rows.append(dict(pass_=pass_, variant=label, config=cfg, ms=ms, bitwise_v1=same,
                             gbs=round(nbytes / ms / 1e6, 1) if ms else None))
        except Exception as exc:  # one failing variant must not hide the others
            rows.append(dict(pass_=pass_, variant=label, config=cfg, error=repr(exc)[:300]))
        print(f"[bench_quant_bwd] {name} {rows[-1]}", file=sys.stderr, flush=True)

    def variants(table):
        return [("v1", None)] + ([] if smoke else table[: 1 if once else None] + PIPE[: 1 if once else None])

    def kind_of(cfg):
        return "v1" if cfg is None else "gluon_pipe" if "STAGES" in cfg else "gluon"

    ref = quantize_dual_1x128_128x1_t(dgu, valid, end_row=end_row, variant="v1")
    for label, cfg in variants(DUAL):
        kind = kind_of(cfg)
        run(label, "dual", lambda kind=kind: quantize_dual_1x128_128x1_t(dgu, valid, end_row=end_row, variant=kind),
            ref, dual_bytes, cfg)
    for src_name, src in (("x", x), ("dout", dout)):
        ref = quantize_gather_128x1_t(src, L.row_pair, k, end_row=end_row, variant="v1")
        for label, cfg in variants(GATHER):
            kind = kind_of(cfg)
            run(label, f"gather_128x1_{src_name}",
                lambda kind=kind, src=src: quantize_gather_128x1_t(src, L.row_pair, k, end_row=end_row, variant=kind),
                ref, gath_bytes, cfg)
    GQ.DUAL_CONFIG.clear(), GQ.DUAL_CONFIG.update(dual0)
    GQ.GATHER_CONFIG.clear(), GQ.GATHER_CONFIG.update(gather0)
    GQ.PIPE_CONFIG.clear(), GQ.PIPE_CONFIG.update(pipe0)
    return {"shape": name, "T": T, "D": D, "F": F, "E": e, "K": k, "rows_padded": N, "end_row": end,
            "live_rows": live, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    import datetime

    import triton

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="30b,235b")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--smoke", action="store_true", help="CPU + interpreter, tiny shape, v1 once")
    p.add_argument("--ncu", action="store_true", help="v1 and the default Gluon variant only, not timed")
    a = p.parse_args(argv)
    if a.smoke:
        a.shapes, a.tokens = "smoke", 200
    elif not torch.cuda.is_available():
        raise SystemExit("bench_quant_bwd needs a CUDA GPU (or --smoke with TRITON_INTERPRET=1)")
    rec = {"bench": "quant_bwd", "gpu": None if a.smoke else torch.cuda.get_device_name(), "torch": torch.__version__,
           "triton": triton.__version__, "git_rev": os.environ.get("TITAN_MEGAMOE_GIT_REV"),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "command": " ".join(["python"] + sys.argv),
           "shapes": [_bench_shape(s, a.tokens, a.smoke, a.ncu) for s in a.shapes.split(",")]}
    print(json.dumps(rec))
    return 0


if __name__ == "__main__":
    sys.exit(main())
