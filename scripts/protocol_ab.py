"""Does the timing harness perturb what it times? compare.layer's per-step protocol under four conditions,
interleaved in one process (GPU only).

Conditions (compare.layer options in brackets):

* ``thread+gc``: NVML sampled on a thread of this process, automatic garbage collection on (the protocol of
  every committed compare.layer run before 2026-12-05: ``--power-sampler thread --gc python``);
* ``none+gc``: no sampler, collection on;
* ``none+nogc``: no sampler, collection off (``gc.disable()``, as TorchTitan's trainer runs its steps);
* ``process+nogc``: NVML sampled from a child process, collection off (the new default).

Each implementation is built once; every round times each condition for ``--iters`` steps
(``compare.timing.time_fwd_bwd``: L2 flush, barrier, from-idle steps) in a rotated order, and the report is
the median over all rounds' steps of fwd and fwd+bwd, per implementation and condition, with the ratio of
the two implementations per condition (the first ``--impls`` entry over the second).

    python scripts/protocol_ab.py [--shape qwen3-30b-a3b] [--impls megamoe-triton,tt-compile] [--rounds 4]
        [--iters 20] [--out f.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from compare.builders import layer_steps, parse_impls  # noqa: E402
from compare.power import PowerSampler  # noqa: E402
from compare.records import git_revision  # noqa: E402
from compare.shapes import parse_shape  # noqa: E402
from compare.timing import time_fwd_bwd  # noqa: E402

#: name -> (power sampler mode or None, gc off during the pass)
CONDITIONS = {"thread+gc": ("thread", False), "none+gc": (None, False), "none+nogc": (None, True),
              "process+nogc": ("process", True)}


def rotated(names: list[str], r: int) -> list[str]:
    """``names`` rotated left by ``r`` (each round starts with another condition)."""
    r %= len(names)
    return names[r:] + names[:r]


def summarize(samples: dict[str, dict[str, dict[str, list[float]]]], impls: list[str]) -> dict:
    """{condition: {impl: {"fwd_ms", "fwdbwd_ms", "host_fwd_ms"} medians}, "ratio_fwd", "ratio_fwdbwd"}:
    ratio = impls[1]'s median over impls[0]'s (how much faster the first is)."""
    out = {}
    for cond, per_impl in samples.items():
        row = {impl: {f"{k}_ms": statistics.median(v[k]) for k in ("fwd", "fwdbwd", "host_fwd")}
               for impl, v in per_impl.items()}
        if len(impls) > 1 and all(i in row for i in impls[:2]):
            a, b = row[impls[0]], row[impls[1]]
            row["ratio_fwd"] = b["fwd_ms"] / a["fwd_ms"]
            row["ratio_fwdbwd"] = b["fwdbwd_ms"] / a["fwdbwd_ms"]
        out[cond] = row
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scripts/protocol_ab.py", description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen3-30b-a3b")
    p.add_argument("--impls", default="megamoe-triton,tt-compile")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    try:
        impls = parse_impls(args.impls)
    except ValueError as err:
        p.error(f"--impls: {err}")
    if not torch.cuda.is_available():
        print("protocol_ab.py: needs a GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    shape = parse_shape(args.shape)
    gen = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(1, args.tokens, shape.dim, device=device, generator=gen).to(torch.bfloat16).requires_grad_()
    g = torch.randn(1, args.tokens, shape.dim, device=device, generator=gen).to(torch.bfloat16)
    steps = {impl: layer_steps(impl, shape, device, x, g) for impl in impls}
    names = list(CONDITIONS)
    samples = {c: {i: {"fwd": [], "fwdbwd": [], "host_fwd": []} for i in impls} for c in names}
    clocks = {c: [] for c in names}
    for impl in impls:  # compile / autotune outside the timed rounds
        st = steps[impl]
        with st.context():
            time_fwd_bwd(st.fwd, st.bwd, device=device, iters=1, warmup=args.warmup, before_step=st.before)
    for r in range(args.rounds):
        for cond in rotated(names, r):
            mode, gc_off = CONDITIONS[cond]
            sampler = PowerSampler(0, mode=mode) if mode else None
            with sampler if sampler is not None else contextlib.nullcontext():
                for impl in (impls if r % 2 == 0 else impls[::-1]):
                    st = steps[impl]
                    with st.context():
                        s = time_fwd_bwd(st.fwd, st.bwd, device=device, iters=args.iters, warmup=1,
                                         before_step=st.before, gc_off=gc_off)
                    for k in ("fwd", "fwdbwd", "host_fwd"):
                        samples[cond][impl][k] += s[k]
                if sampler is not None and sampler.active:
                    clocks[cond] += [smp[1] for smp in sampler._read()]
        print(f"round {r + 1}/{args.rounds} done", flush=True)
    summary = summarize(samples, impls)
    print(f"\n{shape.name} T={args.tokens}: medians of {args.rounds} x {args.iters} from-idle steps per cell (ms)")
    print("| condition | " + " | ".join(f"{i} fwd | {i} fwd+bwd | {i} host fwd" for i in impls)
          + " | ratio fwd | ratio fwd+bwd | SM MHz median |")
    print("|---|" + "---:|" * (3 * len(impls) + 3))
    for cond in names:
        row = summary[cond]
        cells = " | ".join(f"{row[i]['fwd_ms']:.3f} | {row[i]['fwdbwd_ms']:.3f} | {row[i]['host_fwd_ms']:.3f}"
                           for i in impls)
        mhz = statistics.median(clocks[cond]) if clocks[cond] else float("nan")
        print(f"| {cond} | {cells} | {row.get('ratio_fwd', float('nan')):.3f} | "
              f"{row.get('ratio_fwdbwd', float('nan')):.3f} | {mhz:.0f} |")
    if args.out:
        rev, dirty = git_revision()
        rec = {"script": "scripts/protocol_ab.py", "argv": sys.argv[1:],
               "git_revision": os.environ.get("TITAN_MEGAMOE_GIT_REV", rev), "git_dirty": dirty,
               "device": torch.cuda.get_device_name(device), "torch": torch.__version__, "shape": shape.name,
               "tokens": args.tokens, "rounds": args.rounds, "iters": args.iters, "conditions": CONDITIONS,
               "summary": summary, "samples": samples,
               "sm_mhz_median": {c: (statistics.median(v) if v else None) for c, v in clocks.items()}}
        with open(args.out, "w") as f:
            json.dump(rec, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
