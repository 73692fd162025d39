"""Compile Triton kernels for Hopper (sm_90a) on a machine without a GPU, and read what came out.

Used by the kernel tests as a cheap CI check that kernels still build, use wgmma and fit shared
memory (DESIGN.md section 7). ``triton.compile`` must run with TRITON_INTERPRET=0: with the
interpreter on, triton's own jit library functions are interpreted, so the tests compile in a
subprocess (:func:`compile_in_subprocess`).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

__all__ = ["VERIFIED_TRITON", "HOPPER_SMEM_BYTES", "compile_sm90", "compile_in_subprocess", "nvidia_backend_reason"]

#: Triton release the GPU machines run (DESIGN.md section 3); the compile checks assume it.
VERIFIED_TRITON = "3.6"

#: Shared memory a block can opt into on H100/H200 (227 KiB).
HOPPER_SMEM_BYTES = 232448


def nvidia_backend_reason() -> str | None:
    """None if Triton can build sm_90a cubins here, else why not (for a pytest skip reason)."""
    try:
        import triton
        from triton.backends import backends
    except Exception as e:  # pragma: no cover - triton missing entirely
        return f"triton not importable: {e}"
    if "nvidia" not in backends:
        return "triton has no nvidia backend installed"
    if not triton.__version__.startswith(VERIFIED_TRITON):
        return (f"the sm_90a compile checks are calibrated to triton {VERIFIED_TRITON}.x, the GPU machines' "
                f"version (register counts and spills differ between releases); found {triton.__version__}: "
                f"pip install 'triton=={VERIFIED_TRITON}.0' to run them")
    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        return "triton's bundled ptxas is missing (needed to build the cubin)"
    return None


def compile_sm90(fn, signature: dict, constexprs: dict, *, num_warps: int, num_stages: int,
                 divisible: tuple[str, ...] = (), maxnreg: int | None = None) -> dict:
    """Compile one @triton.jit or @gluon.jit kernel for sm_90a; return what the PTX and cubin show.

    Args:
        fn: the JITFunction (compiled-mode variant), or a Gluon kernel (``GluonJITFunction``: built
            from a ``GluonASTSource``, Gluon's explicit-layout front end).
        signature: {arg name: type string} for the runtime arguments ("*bf16", "i32", tensordesc...).
        constexprs: {arg name: value}; added to the signature as "constexpr".
        divisible: int arguments known to be multiples of 16 (pointers always are: torch allocations
            are 16-byte aligned and the JIT specializes on that at launch).
        maxnreg: register cap per thread passed to ptxas (None: ptxas decides), as a launch's
            ``maxnreg`` option does.

    Returns:
        dict(target (PTX built for sm_90a), wgmma (count of wgmma.mma_async), tma (bulk tensor copies),
        cp_async, atomics (``atom.`` instructions), mbarrier_arrive (mbarrier.arrive instructions), shared (bytes), usage (cuobjdump register line
        or ""), loops (``scf.for`` ops in the TTGIR: a flattened persistent kernel has one), wgmma_waits (the pending counts of the PTX's
        ``wgmma.wait_group`` instructions, in order, as strings), wgmma_serialized (ptxas's C7514 / C7515 notes,
        "" if none: ptxas then waits for every wgmma before the next, whatever the kernel asked), mma_loop_spills
        (spill instructions in each innermost loop that issues a wgmma, from the SASS; None without cuobjdump or
        wgmma)).

    Triton does not apply a kernel's defaults here: give every constexpr in ``constexprs`` (a left-out
    one is not its default: a ``COMB_BF16=True`` default compiled as its False branch).
    """
    import triton
    from triton.backends.compiler import GPUTarget

    sig = dict(signature)
    sig.update({k: "constexpr" for k in constexprs})
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n, t in sig.items()
             if t.startswith("*") or n in divisible}
    source = triton.compiler.ASTSource
    try:
        from triton.experimental.gluon._runtime import GluonASTSource, GluonJITFunction

        if isinstance(fn, GluonJITFunction):
            source = GluonASTSource
    except ImportError:  # a Triton without Gluon: only @triton.jit kernels
        pass
    src = source(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    options = dict(num_warps=num_warps, num_stages=num_stages)
    if maxnreg is not None:
        options["maxnreg"] = maxnreg
    ck = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    ptx = ck.asm["ptx"]
    usage, sass = "", ""
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if cuobjdump.exists():
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(ck.asm["cubin"])
            f.flush()
            usage = subprocess.run([str(cuobjdump), "--dump-resource-usage", f.name], capture_output=True,
                                   text=True).stdout
            if "wgmma.mma_async" in ptx:
                sass = subprocess.run([str(cuobjdump), "-sass", f.name], capture_output=True, text=True).stdout
    regs = [ln.strip() for ln in usage.splitlines() if "REG:" in ln]
    return dict(target=".target sm_90a" in ptx, wgmma=ptx.count("wgmma.mma_async"),
                tma=ptx.count("cp.async.bulk.tensor"), cp_async=ptx.count("cp.async.cg"), atomics=ptx.count("atom."),
                mbarrier_arrive=len(re.findall(r"mbarrier\.arrive\b", ptx)),
                shared=ck.metadata.shared, usage=regs[0] if regs else "", loops=ck.asm["ttgir"].count("scf.for "),
                wgmma_waits=re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", ptx),
                wgmma_serialized=_wgmma_serialized(ptx, maxnreg) if ptx.count("wgmma.mma_async") else "",
                mma_loop_spills=_mma_loop_spills(sass) if sass else None)


def _mma_loop_spills(sass: str) -> list[int]:
    """Local-memory spill instructions (STL / LDL) inside each innermost SASS loop that issues a wgmma (HGMMA /
    QGMMA), in code order: the spills that cost every K step. A loop is a backward branch; innermost: no other
    backward branch inside it. A spill outside these (a tile's prologue or epilogue) costs once per tile."""
    ins = []
    for ln in sass.splitlines():
        m = re.search(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", ln)
        if m:
            ins.append((int(m.group(1), 16), m.group(2)))
    back = []  # (target, address) of the backward branches
    for a, text in ins:
        m = re.search(r"\bBRA (0x[0-9a-f]+)", text)
        if m and int(m.group(1), 16) < a:
            back.append((int(m.group(1), 16), a))
    out = []
    for lo, hi in back:
        if any(lo <= b_lo and b_hi < hi for b_lo, b_hi in back if (b_lo, b_hi) != (lo, hi)):
            continue  # an outer loop
        body = [t for a, t in ins if lo <= a <= hi]
        if any("GMMA" in t for t in body):
            out.append(sum(1 for t in body if re.search(r"\b(STL|LDL)", t)))
    return out


def _wgmma_serialized(ptx: str, maxnreg: int | None) -> str:
    """ptxas's performance notes C7514 / C7515 for this PTX ("" if none): when it cannot keep a wgmma's
    accumulator registers untouched until the matching wait, ptxas waits for every wgmma of the kernel
    before issuing the next (seen with a select on the accumulator in a Gluon epilogue). Triton's own
    ptxas run does not show them, so this re-assembles the PTX with ``-v``."""
    import triton

    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "k.ptx"
        src.write_text(ptx)
        cmd = [str(ptxas), "-arch=sm_90a", "-v", str(src), "-o", str(Path(d) / "k.cubin")]
        if maxnreg is not None:
            cmd[2:2] = ["--maxrregcount", str(maxnreg)]
        out = subprocess.run(cmd, capture_output=True, text=True)
    return " | ".join(ln.strip() for ln in (out.stdout + out.stderr).splitlines() if "C7514" in ln or "C7515" in ln)


def compile_in_subprocess(script: str | os.PathLike, *args: str, timeout_s: float = 300) -> dict[str, dict]:
    """Run ``python script compile-sm90 *args`` with TRITON_INTERPRET=0; the script prints a JSON list
    of result dicts (each with a "label") as its last line. Returns {label: result}.

    Raises:
        AssertionError: the subprocess failed (its stderr tail is in the message).
    """
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    root = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, str(script), "compile-sm90", *args], capture_output=True, text=True,
                          env=env, timeout=timeout_s)
    if proc.returncode != 0:
        raise AssertionError(f"sm_90a compile subprocess failed:\n{proc.stderr[-4000:]}")
    return {r["label"]: r for r in json.loads(proc.stdout.strip().splitlines()[-1])}
