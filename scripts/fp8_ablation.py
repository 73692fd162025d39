"""One MoE layer, FP8 backward ablation: relative errors (norm-wise, vs the fp32 reference on the same
bf16-valued operands) of out, dx, dscores, dw1, dw2, dw3 for the triton bf16 path, "fp8", "fp8_bwd", and
"fp8_bwd" / "fp8" with the wgrad swapped (``fp8_backend._WGRAD``: "bf16" = the bf16 wgrad kernels on the
FP8 dgrad's dgate_up; "fp8_acc32" = the FP8 wgrad promoted to fp32 after every k32 wgmma). If swapping
the wgrad does not bring dw1..dw3 near the bf16 path's errors, or dx / dscores are far off too, the
wgrad alone does not explain the FP8 training gap (docs/NOTES.md, "FP8 wgrad on GPU: diagnosis").
The "bf16" swap also runs the Triton FP8 GEMM2 dgrad (only it writes the bf16 s * h rows the bf16 wgrad takes), where
the default is the Gluon one since session 36: set ``TITAN_MEGAMOE_WS_GEMM2_DGRAD_FP8=0`` to keep the dgrads equal.

Scenarios per shape: routing uniform / skewed (Zipf: hot experts and experts with few rows), inputs
Gaussian or "heavy" (per-token magnitudes log-normal, sigma 1.5: what 128x1 groups along the tokens
suffer from). Plus a kernel probe: the FP8 wgrad vs the fp32 math on its own dequantized operands,
with Triton's sm_90 accumulation (whole 128-row step in the wgmma accumulator) and with acc32.

    python scripts/fp8_ablation.py                       # shapes debug (D 256, F 768, E 64, T 8192) and 30b
    python scripts/fp8_ablation.py --shapes 30b --scenarios uniform:gauss
    TRITON_INTERPRET=1 python scripts/fp8_ablation.py --smoke   # CPU: tiny shape, checks the script

Prints a table and one JSON line (also written to --out).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

if "--smoke" not in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

#: name -> (T, D, F, E, K); debug = qwen3 debugmodel_moe (dim 256, moe_inter_dim 768, 64 experts, top-8)
#: at the debug training's local_batch_size 4 x seq_len 2048
SHAPES = {"debug": (8192, 256, 768, 64, 8), "30b": (16384, 2048, 768, 128, 8), "smoke": (64, 128, 128, 4, 2)}
#: (label, precision, wgrad switch)
VARIANTS = [
    ("bf16", "bf16", "fp8"),
    ("fp8", "fp8", "fp8"),
    ("fp8+wgrad_bf16", "fp8", "bf16"),
    ("fp8_bwd", "fp8_bwd", "fp8"),
    ("fp8_bwd+wgrad_bf16", "fp8_bwd", "bf16"),
    ("fp8_bwd+wgrad_acc32", "fp8_bwd", "fp8_acc32"),
]
SCENARIOS = [("uniform", "gauss"), ("skewed", "gauss"), ("uniform", "heavy")]
NAMES = ("out", "dx", "dscores", "dw1", "dw2", "dw3")


def _inputs(T, D, F, E, K, routing, data, dev, seed=0):
    from titan_megamoe.testing import make_routing

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g)
    dout = torch.randn(T, D, generator=g)
    if data == "heavy":  # per-token magnitudes spread over ~2 decades (128x1 groups span 128 tokens)
        x = x * torch.exp(1.5 * torch.randn(T, 1, generator=g))
        dout = dout * torch.exp(1.5 * torch.randn(T, 1, generator=g))
    w1 = (torch.randn(E, F, D, generator=g) / D**0.5).bfloat16()
    w3 = (torch.randn(E, F, D, generator=g) / D**0.5).bfloat16()
    w2 = (torch.randn(E, D, F, generator=g) / F**0.5).bfloat16()
    s = torch.softmax(torch.randn(T, K, generator=g), -1)
    ids = make_routing(routing, T, E, K, seed=seed)
    return [t.to(dev) for t in (x.bfloat16(), ids, s, w1, w2, w3, dout.bfloat16())]


def _fwd_bwd(precision, x, ids, s, w1, w2, w3, dout):
    from titan_megamoe.ops import mega_moe
    from titan_megamoe.ops.reference import mega_moe_ref

    leaves = [t.clone().requires_grad_() for t in (x, s, w1, w2, w3)]
    if precision == "reference":
        f32 = [t.float() for t in leaves]
        out = mega_moe_ref(f32[0], ids, f32[1], *f32[2:], num_experts=w1.shape[0])
    else:
        out = mega_moe(leaves[0], ids, leaves[1], *leaves[2:], num_experts=w1.shape[0], backend="triton",
                       precision=precision, layer_name="ablation")
    out.backward(dout.to(out.dtype))
    return [out.detach()] + [t.grad for t in leaves]


def _rel(a, b):
    from titan_megamoe.testing import rel_err

    return round(rel_err(a.float(), b.float()), 5)


def layer_ablation(shape: str, dev: str) -> list[dict]:
    from titan_megamoe.ops import fp8_backend

    T, D, F, E, K = SHAPES[shape]
    rows = []
    for routing, data in SCENARIOS:
        inputs = _inputs(T, D, F, E, K, routing, data, dev)
        counts = torch.bincount(inputs[1].reshape(-1), minlength=E)
        ref = _fwd_bwd("reference", *inputs)
        for label, precision, wgrad in VARIANTS:
            fp8_backend._WGRAD = wgrad
            try:
                got = _fwd_bwd(precision, *inputs)
            finally:
                fp8_backend._WGRAD = "fp8"
            errs = {n: _rel(a, b) for n, a, b in zip(NAMES, got, ref)}
            rows.append(dict(shape=shape, routing=routing, data=data, variant=label,
                             rows_per_expert_min=int(counts.min()), rows_per_expert_max=int(counts.max()), **errs))
            print(f"{shape:6s} {routing:8s} {data:6s} {label:22s} " + " ".join(f"{n} {errs[n]:.4f}" for n in NAMES),
                  flush=True)
        fp8_backend.NONFINITE.flush()
    return rows


def acc_probe(shape: str, dev: str) -> list[dict]:
    """FP8 wgrad (dw2 and dw1|dw3) vs the fp32 math on its own dequantized operands: Triton's sm_90
    default (128 products per wgmma accumulator) and acc32. The interpreter's dot is fp32 (both ~1e-7)."""
    from titan_megamoe.kernels.fp8_quant_bwd import quantize_gather_128x1_t
    from titan_megamoe.kernels.grouped_gemm_fp8_bwd import wgrad_fp8
    from titan_megamoe.kernels.routing import build_routing_layout
    from titan_megamoe.ops import fp8_reference as R

    T, D, F, E, K = SHAPES[shape]
    out = []
    for routing in ("uniform", "skewed"):
        x, ids, s, w1, w2, w3, dout = _inputs(T, D, F, E, K, routing, "gauss", dev)
        L = build_routing_layout(ids, E, 128)
        aT, aTs = quantize_gather_128x1_t(dout, L.row_pair, K)
        h = torch.randn(T, F, generator=torch.Generator().manual_seed(5)).bfloat16().to(dev)  # an (F, N_cap) operand
        bT, bTs = quantize_gather_128x1_t(h, L.row_pair, K)
        a = R.dequantize_act_128x1(aT.T.contiguous(), aTs)
        b = R.dequantize_act_128x1(bT.T.contiguous(), bTs)
        off = L.offsets.tolist()
        ref = torch.stack([a[off[e]:off[e + 1]].T @ b[off[e]:off[e + 1]] for e in range(E)])
        row = dict(shape=shape, routing=routing)
        for acc in (None, 32):
            (dw,) = wgrad_fp8(aT, aTs, bT, bTs, L, out_dtype=torch.float32, _max_imprecise_acc=acc)
            row[f"wgrad_vs_deq_acc{acc or 'default'}"] = float(f"{_rel_raw(dw, ref):.3e}")
        print(f"acc probe {shape} {routing}: {row}", flush=True)
        out.append(row)
    return out


def _rel_raw(a, b):
    from titan_megamoe.testing import rel_err

    return rel_err(a, b)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="debug,30b")
    p.add_argument("--scenarios", default=None, help="routing:data,... (default: all of SCENARIOS)")
    p.add_argument("--smoke", action="store_true", help="CPU interpreter, tiny shape (checks the script)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    global SCENARIOS
    if args.scenarios:
        SCENARIOS = [tuple(sc.split(":")) for sc in args.scenarios.split(",")]
    elif args.smoke:
        SCENARIOS = SCENARIOS[:1] + SCENARIOS[2:]
    dev = "cpu" if args.smoke else "cuda"
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 reference
    shapes = ["smoke"] if args.smoke else args.shapes.split(",")
    t0 = time.time()
    res = dict(acc_probe=[], layer=[])
    for sh in shapes:
        res["acc_probe"] += acc_probe(sh, dev)
        res["layer"] += layer_ablation(sh, dev)
        print(f"[{time.time() - t0:.0f} s] {sh} done", flush=True)
    res["git_rev"] = os.environ.get("TITAN_MEGAMOE_GIT_REV", "unknown")
    line = json.dumps(res)
    print(line)
    if args.out:
        Path(args.out).write_text(line + "\n")


if __name__ == "__main__":
    main()
