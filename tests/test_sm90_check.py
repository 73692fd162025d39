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
