"""The interpreter / compiled switch shared by the kernel modules.

``triton.jit`` picks the interpreted or the compiled flavor of a kernel when its decorator runs
(import time), but tests set ``TRITON_INTERPRET`` per run: the launchers ask ``runnable(kernel)`` at
launch time instead, which re-wraps ``kernel.fn`` in the flavor the flag asks for now (the kernels
call only Triton's library functions and ``@triton.jit`` helpers such as ``grouped_tile`` below, whose
flavor follows the flag at import: set it before importing, as tests/conftest.py does).
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

__all__ = ["interpreting", "runnable", "grouped_tile"]

_FLAVORS: dict = {}


def interpreting() -> bool:
    """True when kernels run in Triton's interpreter (``TRITON_INTERPRET=1``), read at call time."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def runnable(kernel):
    """``kernel`` as an ``InterpretedFunction`` or a compiled ``JITFunction``, as the flag says now."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    interp = interpreting()
    key = (kernel.fn, interp)
    if key not in _FLAVORS:
        want = InterpretedFunction if interp else JITFunction
        _FLAVORS[key] = kernel if isinstance(kernel, want) else want(kernel.fn)
    return _FLAVORS[key]


@triton.jit
def grouped_tile(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of launch id ``pid`` in grouped order: GROUP_M row tiles sweep all column
    blocks before the next group starts (L2 reuse of the row tiles' operands; Triton's matmul
    tutorial). GROUP_M = 1: all column blocks of one row tile back to back."""
    width = GROUP_M * num_pid_n
    first_m = (pid // width) * GROUP_M
    group = tl.minimum(num_pid_m - first_m, GROUP_M)
    return first_m + (pid % width) % group, (pid % width) // group
