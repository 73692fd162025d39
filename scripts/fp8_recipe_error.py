"""Per-expert error of the blockwise-FP8 backward recipe against fp32, in pure PyTorch (CPU, no kernels).

    python scripts/fp8_recipe_error.py [--shape debug|30b] [--tokens 8192] [--routing uniform|zipf]
        [--zipf-exponent 1.0] [--dout normal|student] [--seed 0] [--out f.json]

Why (docs/NOTES.md, session 39): the debug model's fp8_bwd runs had grad-norm spikes that bf16 runs did not. This
asks whether the recipe itself (not a kernel) gives some experts much larger weight-gradient errors than others: by
expert load (an expert with few tokens has few 128-row groups, most of them padding) and by heavy-tailed output
gradients (a few large rows set a 128x1 group's scale and flush the small ones to zero).

What it computes, per expert e with its n_e routed rows (in the layout's expert-major order, padded to 128 rows as
the kernels' 128x1 groups are): the exact fp32 dw2 = dout^T (s h), dh = s (dout w2), dgate / dup from the bf16
gate_up, dw1 = dgate^T x, dw3 = dup^T x; and the same through the recipe of ``ops/fp8_backend.fp8_experts_bwd``
(``ops/fp8_reference.py``'s quantizers: dout 1x128 for the dgrad and 128x1 for dw2, w2 128x128, s h and dgate_up
128x1, x 128x1; dgate_up rounded to bf16 as the dgrad stores it); and a bf16-operand baseline (fp32 accumulation) for
scale, and the FP8 dgrads with bf16 weight gradients (``TITAN_MEGAMOE_FP8_WGRAD=bf16``). Reports per-expert relative Frobenius errors: min / median / max over experts and the worst experts' loads.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

SHAPES = {"debug": (256, 768, 64, 8), "30b": (2048, 768, 128, 8)}  # D, F, E, top_k


def _pad128(t: torch.Tensor) -> torch.Tensor:
    n = t.shape[0]
    return torch.cat([t, t.new_zeros((-n) % 128, *t.shape[1:])]) if n % 128 else t


def _q_cols(t: torch.Tensor) -> torch.Tensor:
    """t (n, C) through 128x1 quantization (groups of 128 rows per column, zero-padded) and back, fp32."""
    from titan_megamoe.ops import fp8_reference as R

    q, s = R.quantize_act_128x1(_pad128(t.float()))
    return R.dequantize_act_128x1(q, s)[: t.shape[0]]


def _q_rows(t: torch.Tensor) -> torch.Tensor:
    from titan_megamoe.ops import fp8_reference as R

    return R.dequantize_act_1x128(*R.quantize_act_1x128(t.float()))


def expert_errors(D: int, F: int, E: int, K: int, T: int, routing: str, dout_kind: str, seed: int,
                  zipf_exponent: float = 1.0) -> list[dict]:
    """One dict per expert with rows: n (routed rows), and rel errors of dw1, dw2, dw3 for "fp8" and "bf16"."""
    from titan_megamoe.ops import fp8_reference as R
    from titan_megamoe.testing import rel_err

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g).bfloat16()
    if routing == "zipf":  # expert popularity ~ rank^-a: a few hot experts, a long tail with a handful of rows
        p = torch.arange(1, E + 1, dtype=torch.float64) ** -zipf_exponent
        ids = torch.multinomial((p / p.sum()).expand(T, E), K, replacement=False, generator=g)
    else:
        ids = torch.rand(T, E, generator=g).argsort(dim=1)[:, :K]
    s = torch.rand(T, K, generator=g) / K
    if dout_kind == "student":  # heavy tails (Student-t, 2 degrees of freedom: z / sqrt(-ln u)), from the seed
        z, u = torch.randn(T, D, generator=g), torch.rand(T, D, generator=g).clamp_min(1e-12)
        dout = (z / (-u.log()).sqrt() * 1e-3).bfloat16()
    else:
        dout = (torch.randn(T, D, generator=g) * 1e-3).bfloat16()
    w1 = (torch.randn(E, F, D, generator=g) * D ** -0.5).bfloat16()
    w3 = (torch.randn(E, F, D, generator=g) * D ** -0.5).bfloat16()
    w2 = (torch.randn(E, D, F, generator=g) * F ** -0.5).bfloat16()
    w2t_deq = R.dequantize_weight_128x128(*R.quantize_weight_128x128(w2.transpose(1, 2).contiguous()))  # (E, F, D)
    out = []
    for e in range(E):
        tok, slot = (ids == e).nonzero(as_tuple=True)
        n = int(tok.numel())
        if n == 0:
            continue
        xe, de, se = x[tok].float(), dout[tok].float(), s[tok, slot].float()[:, None]
        gate, up = (xe @ w1[e].float().T).bfloat16().float(), (xe @ w3[e].float().T).bfloat16().float()
        sig = torch.sigmoid(gate)
        h = (gate * sig * up).bfloat16().float()
        res = dict(expert=e, n=n)

        def grads(dh, dgu_round):
            dgate = dh * up * sig * (1 + gate * (1 - sig))
            dup = dh * gate * sig
            if dgu_round:
                dgate, dup = dgate.bfloat16().float(), dup.bfloat16().float()
            return dgate, dup

        # exact fp32
        dh = se * (de @ w2[e].float())
        dg, du = grads(dh, False)
        ex = dict(dw2=de.T @ (se * h), dw1=dg.T @ xe, dw3=du.T @ xe)
        # FP8 recipe (fp8_experts_bwd): dgrad from dout 1x128 x w2t 128x128; dgate_up stored bf16; wgrads 128x1
        dh8 = se * (_q_rows(de) @ w2t_deq[e].T)
        dg8, du8 = grads(dh8, True)
        xq = _q_cols(xe)
        f8 = dict(dw2=_q_cols(de).T @ _q_cols(se * h), dw1=_q_cols(dg8).T @ xq, dw3=_q_cols(du8).T @ xq)
        # bf16 operands, fp32 accumulation (the bf16 path's rounding) for scale
        dgb, dub = grads(dh, True)
        bf = dict(dw2=de.T @ (se * h).bfloat16().float(), dw1=dgb.T @ xe, dw3=dub.T @ xe)
        # FP8 dgrads, bf16 weight gradients (TITAN_MEGAMOE_FP8_WGRAD=bf16: the dgrad's dgate_up and s h as bf16)
        hw = dict(dw2=de.T @ (se * h).bfloat16().float(), dw1=dg8.T @ xe, dw3=du8.T @ xe)
        for k in ("dw1", "dw2", "dw3"):
            res[f"fp8_{k}"], res[f"bf16_{k}"] = rel_err(f8[k], ex[k]), rel_err(bf[k], ex[k])
            res[f"fp8_bf16wgrad_{k}"] = rel_err(hw[k], ex[k])
        out.append(res)
    return out


def summarize(rows: list[dict]) -> dict:
    """min / median / max over experts of each error, and the three worst experts (by fp8 dw1) with their loads."""
    s = {}
    for k in ("fp8_dw1", "fp8_dw2", "fp8_dw3", "fp8_bf16wgrad_dw1", "fp8_bf16wgrad_dw2", "fp8_bf16wgrad_dw3",
              "bf16_dw1", "bf16_dw2", "bf16_dw3"):
        v = [r[k] for r in rows]
        s[k] = dict(min=min(v), median=statistics.median(v), max=max(v))
    worst = sorted(rows, key=lambda r: -r["fp8_dw1"])[:3]
    s["worst_fp8_dw1"] = [dict(expert=r["expert"], n=r["n"], fp8_dw1=r["fp8_dw1"], fp8_dw2=r["fp8_dw2"]) for r in worst]
    s["rows_min_median_max"] = [min(r["n"] for r in rows), statistics.median(r["n"] for r in rows),
                                max(r["n"] for r in rows)]
    return s


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="debug")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--routing", choices=("uniform", "zipf"), default="uniform")
    p.add_argument("--zipf-exponent", type=float, default=1.0, help="--routing zipf: popularity ~ rank^-a")
    p.add_argument("--dout", choices=("normal", "student"), default="normal")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out")
    a = p.parse_args(argv)
    D, F, E, K = SHAPES[a.shape]
    rows = expert_errors(D, F, E, K, a.tokens, a.routing, a.dout, a.seed, a.zipf_exponent)
    summ = summarize(rows)
    for k, v in summ.items():
        print(k, v)
    if a.out:
        import datetime

        from compare.records import git_revision

        rec = dict(date_utc=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   git_rev=git_revision()[0], machine="CPU (pure PyTorch, no kernels)",
                   command="python scripts/fp8_recipe_error.py " + " ".join(sys.argv[1:] if argv is None else argv),
                   args=vars(a), summary=summ, experts=rows)
        with open(a.out, "w") as f:
            json.dump(rec, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
