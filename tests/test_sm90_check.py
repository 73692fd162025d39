"""kernels/sm90_check.compile_sm90 builds Gluon kernels for sm_90a too (the route for warp-specialized
Hopper GEMMs, docs/NOTES.md session 9), not only @triton.jit ones."""

import json
import sys

from _sm90 import sm90_result  # noqa: E402


def _compile_sm90_all() -> list[dict]:
    from _gluon_probe import gluon_copy_kernel
    from titan_megamoe.kernels.sm90_check import compile_sm90

    r = compile_sm90(gluon_copy_kernel, {"x_ptr": "*fp32", "y_ptr": "*fp32", "n": "i32"}, {"BLOCK": 512},
                     num_warps=4, num_stages=1)
    return [dict(label="gluon_copy", **r)]


def test_gluon_kernel_compiles_for_sm90a():
    r = sm90_result(__file__, "gluon_copy")
    assert r["target"], "PTX not built for sm_90a"
    assert r["wgmma"] == 0 and r["shared"] == 0  # a plain copy: no tensor cores, no shared memory
    assert "STACK:0" in r["usage"] or not r["usage"], r["usage"]


if __name__ == "__main__":
    if sys.argv[1:2] == ["compile-sm90"]:
        print(json.dumps(_compile_sm90_all()))
    else:
        raise SystemExit("usage: python tests/test_sm90_check.py compile-sm90")


def test_mma_loop_spills_counts_only_the_innermost_loops_that_issue_a_wgmma():
    """``sm90_check._mma_loop_spills`` on a hand-written SASS listing: an outer tile loop (spills in its prologue, not
    counted) around a K loop with a QGMMA and two spill instructions, then a loop without a wgmma (not reported)."""
    from titan_megamoe.kernels.sm90_check import _mma_loop_spills

    def ins(addr, text):
        return f"        /*{addr:04x}*/                   {text} ;   /* 0x000 */"

    sass = "\n".join([
        ins(0x0010, "MOV R1, c[0x0][0x28]"),
        ins(0x0020, "STL [R1], R0"),                        # tile prologue: outside the K loop
        ins(0x0030, "QGMMA.64x64x32.F32.E4M3.E4M3 R24, gdesc[UR24], RZ, !UPT"),
        ins(0x0040, "LDL.LU R5, [R1+0x4]"),                 # K loop body
        ins(0x0050, "STL [R1+0x4], R5"),
        ins(0x0060, "@P3 BRA 0x30"),                        # closes the K loop
        ins(0x0070, "LDL R8, [R1]"),                        # epilogue
        ins(0x0080, "@P0 BRA 0x20"),                        # closes the tile loop
        ins(0x0090, "STL [R1+0x8], R2"),
        ins(0x00a0, "@P1 BRA 0x90"),                        # a loop without a wgmma
    ])
    assert _mma_loop_spills(sass) == [2]
    assert _mma_loop_spills(sass.replace("LDL.LU R5, [R1+0x4]", "FADD R5, R5, R6")) == [1]
