"""Write the golden-output file of the tiny MoE case: ``tests/golden/moe_tiny_v1.pt``.

    python scripts/make_golden.py [--out tests/golden/moe_tiny_v1.pt] [--check]

The case: T=24 tokens, D=32, F=32, E=8 experts, top_k=2, the "skewed" routing of
``titan_megamoe.testing.make_routing`` (seed 0), inputs drawn in fp32 with a fixed seed and rounded
to bf16 (so the fp32 reference and the bf16 Triton backend see exactly the same values), a fixed
output gradient ``dout``. It runs forward + backward of

  (a) the reference operator ``mega_moe_ref`` in fp32, and
  (b) the Triton backend (``mega_moe(..., backend="triton")``) on the bf16 tensors, on CPU through
      Triton's interpreter (``TRITON_INTERPRET=1``, set here before triton is imported),

and saves inputs + outputs + all gradients (Triton results in their own dtypes: bf16, scores fp32).
``tests/test_golden.py`` recomputes both and compares against this file. Regenerate only when a
numerics change is intended, and say why in the commit message.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton (CPU machines)

import argparse  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

GOLDEN_PATH = REPO_ROOT / "tests" / "golden" / "moe_tiny_v1.pt"
VERSION = 1
CASE = dict(T=24, D=32, F=32, E=8, K=2, routing="skewed", routing_seed=0, seed=1234)
GRAD_NAMES = ("dx", "dscores", "dw1", "dw2", "dw3")


def make_inputs(case: dict = CASE) -> dict[str, torch.Tensor]:
    """Inputs of the case, all fp32 holding bf16-representable values (ids int64)."""
    from titan_megamoe.testing import make_routing

    T, D, F, E, K = (case[k] for k in ("T", "D", "F", "E", "K"))
    g = torch.Generator().manual_seed(case["seed"])

    def bf16_exact(t: torch.Tensor) -> torch.Tensor:
        return t.bfloat16().float()

    return dict(
        x=bf16_exact(torch.randn(T, D, generator=g)),
        scores=bf16_exact(torch.rand(T, K, generator=g)),
        w1=bf16_exact(torch.randn(E, F, D, generator=g) / D**0.5),
        w2=bf16_exact(torch.randn(E, D, F, generator=g) / F**0.5),
        w3=bf16_exact(torch.randn(E, F, D, generator=g) / D**0.5),
        dout=bf16_exact(torch.randn(T, D, generator=g)),
        ids=make_routing(case["routing"], T, E, K, seed=case["routing_seed"]),
    )


def _fwd_bwd(fn, inputs: dict, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    # scores stay fp32 in both backends (the router's dtype); everything else in `dtype`
    leaves = [inputs["x"].to(dtype), inputs["scores"].float(), inputs["w1"].to(dtype),
              inputs["w2"].to(dtype), inputs["w3"].to(dtype)]
    leaves = [t.clone().requires_grad_() for t in leaves]
    out = fn(leaves[0], inputs["ids"], *leaves[1:])
    out.backward(inputs["dout"].to(out.dtype))
    res = {"out": out.detach()}
    res.update({n: t.grad.detach() for n, t in zip(GRAD_NAMES, leaves)})
    return res


def run_reference(inputs: dict) -> dict[str, torch.Tensor]:
    """(a) ``mega_moe_ref`` forward + backward in fp32."""
    from titan_megamoe.ops.reference import mega_moe_ref

    E = inputs["w1"].shape[0]
    return _fwd_bwd(lambda x, ids, s, w1, w2, w3: mega_moe_ref(x, ids, s, w1, w2, w3, num_experts=E),
                    inputs, torch.float32)


def run_triton(inputs: dict) -> dict[str, torch.Tensor]:
    """(b) the Triton backend forward + backward on bf16 tensors (interpreter on CPU)."""
    from titan_megamoe.ops import mega_moe

    E = inputs["w1"].shape[0]
    return _fwd_bwd(
        lambda x, ids, s, w1, w2, w3: mega_moe(x, ids, s, w1, w2, w3, num_experts=E, backend="triton"),
        inputs, torch.bfloat16)


def build() -> dict:
    inputs = make_inputs()
    return dict(
        version=VERSION,
        case=dict(CASE),
        # inputs stored as bf16 (exact: they are bf16-representable) to keep the file small
        inputs={k: (v if k == "ids" else v.bfloat16()) for k, v in inputs.items()},
        reference=run_reference(inputs),
        triton=run_triton(inputs),
        meta=dict(torch=str(torch.__version__), triton=_triton_version(),
                  triton_interpret=os.environ.get("TRITON_INTERPRET")),
    )


def load_inputs(golden: dict) -> dict[str, torch.Tensor]:
    """Inputs of a loaded golden file back in fp32 (ids int64)."""
    return {k: (v if k == "ids" else v.float()) for k, v in golden["inputs"].items()}


def _triton_version() -> str | None:
    try:
        import triton

        return triton.__version__
    except ImportError:
        return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python scripts/make_golden.py", description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=GOLDEN_PATH)
    a = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        p.error("no CUDA device and TRITON_INTERPRET != 1: the Triton backend cannot run")
    golden = build()
    if os.environ.get("TRITON_INTERPRET") != "1":
        print("warning: Triton ran compiled (TRITON_INTERPRET != 1); the committed golden is made by the "
              "CPU interpreter", file=sys.stderr)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(golden, a.out)
    print(f"wrote {a.out} ({a.out.stat().st_size / 1024:.1f} KiB): case {golden['case']}, "
          f"torch {golden['meta']['torch']}, triton {golden['meta']['triton']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
