"""A minimal Gluon kernel for the sm_90a compile check of ``kernels/sm90_check.py`` (imported only in the
compile subprocess: Gluon kernels are not run by the interpreter the CPU tests use)."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def gluon_copy_kernel(x_ptr, y_ptr, n, BLOCK: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout([4], [32], [4], [0])
    offs = gl.program_id(0) * BLOCK + gl.arange(0, BLOCK, layout=layout)
    ok = offs < n
    gl.store(y_ptr + offs, gl.load(x_ptr + offs, mask=ok), mask=ok)
