"""Whether a compare.layer switch row computed what its default row computed.

A ``--switches`` row is an A/B of speed: the switch should change how the layer is computed, not what. compare.layer
keeps a fingerprint of one fwd + bwd step of each default megamoe row (strided samples of the output, dx and every
weight gradient) and compares each switch row's with it. A row whose relative error passes
:data:`FLAG_REL_ERR` is flagged in its record, its notes and the table. Session 38's first fused-quantization epilogue
wrote wrong h scales and its rows still read "ok": the timing was of wrong numerics.

The same fingerprints give each FP8 row's error against the same implementation's bf16 row (same weights, input and
routing): the recipe's accuracy at the benchmarked shape, measured in the run that times it (``numerics_vs_bf16``,
:func:`table`; reported, not flagged).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["FLAG_REL_ERR", "fingerprint", "flag", "rel_errs", "worst", "table"]

#: Relative error (||a - b|| / ||b|| over the sampled elements) above which a switch row is flagged. Rounding-level
#: differences (a different bf16 summation order, an fp32 accumulation of a router gradient) stay far below it;
#: wrong scales, a missed tile or a race do not.
FLAG_REL_ERR = 0.05

_MAX_SAMPLES = 1 << 20


def _nan_high(v: float) -> float:
    """Sort key: nan ranks above every number (a sample that went nan is the worst, not skipped)."""
    return math.inf if math.isnan(v) else v


def fingerprint(y: Tensor, x: Tensor, module: torch.nn.Module) -> dict[str, Tensor]:
    """Strided samples (fp32, CPU, at most ~1M elements each) of one step's output ``y``, input gradient ``x.grad``
    and every weight gradient of ``module`` (by parameter name; a DTensor's local shard)."""
    items = [("out", y), ("dx", x.grad)] + [(f"grad {n}", p.grad) for n, p in module.named_parameters()]
    out = {}
    for name, t in items:
        if t is None:
            continue
        if hasattr(t, "to_local"):
            t = t.to_local()
        flat = t.detach().reshape(-1)
        step = max(1, flat.numel() // _MAX_SAMPLES) | 1  # odd: no alignment with power-of-two row lengths
        out[name] = flat[::step].float().cpu()
    return out


def rel_errs(got: dict[str, Tensor], want: dict[str, Tensor]) -> dict[str, float]:
    """{name: ||got - want|| / ||want||} for every sample of ``want``; nan where ``got`` lacks it or has another
    shape, or holds non-finite values; 0 for two equal all-zero samples."""
    res = {}
    for name, w in want.items():
        g = got.get(name)
        if g is None or g.shape != w.shape:
            res[name] = math.nan
            continue
        num, den = (g - w).norm().item(), w.norm().item()
        res[name] = num / den if den > 0 else (0.0 if num == 0 else math.inf)
    return res


def flag(errs: dict[str, float], limit: float = FLAG_REL_ERR) -> str | None:
    """None if every error is at most ``limit``, else a short text naming the worst (nan counts as worst)."""
    bad = {k: v for k, v in errs.items() if not v <= limit}
    if not bad:
        return None
    name = max(bad, key=lambda k: _nan_high(bad[k]))
    return f"differs from the default row: {name} rel err {bad[name]:.3g} (> {limit:g})"


def worst(errs: list[dict[str, float]]) -> dict[str, float]:
    """Per name, the largest error over ranks' ``rel_errs`` results (nan counts as largest)."""
    return {k: max((e[k] for e in errs), key=_nan_high) for k in errs[0]}


def table(records: list[dict]) -> str:
    """Markdown rows of each record's ``numerics_vs_bf16``: output, dx, and the largest weight-gradient error with its
    parameter; "" when no record has one."""
    rows = [r for r in records if r.get("numerics_vs_bf16")]
    if not rows:
        return ""
    lines = ["| shape | implementation | precision | out rel err | dx rel err | worst weight grad rel err |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        e = r["numerics_vs_bf16"]
        grads = {k[len("grad "):]: v for k, v in e.items() if k.startswith("grad ")}
        g = max(grads, key=lambda k: _nan_high(grads[k])) if grads else None
        shape = r["shape"]["name"] if isinstance(r.get("shape"), dict) else r.get("shape")
        lines.append(f"| {shape} | {r['implementation']} | {r['precision']} | {e.get('out', math.nan):.3g} | "
                     f"{e.get('dx', math.nan):.3g} | " + (f"{grads[g]:.3g} ({g}) |" if g else "- |"))
    return "\n".join(lines)
