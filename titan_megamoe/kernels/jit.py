"""The interpreter / compiled switch shared by the kernel modules.

``triton.jit`` picks the interpreted or the compiled flavor of a kernel when its decorator runs
(import time), but tests set ``TRITON_INTERPRET`` per run: the launchers ask ``runnable(kernel)`` at
launch time instead, which re-wraps ``kernel.fn`` in the flavor the flag asks for now (the kernels
call only Triton's own library functions and their own module's ``@triton.jit`` helpers, which the
interpreter resolves the same way).
"""

from __future__ import annotations

import os

__all__ = ["interpreting", "runnable"]

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
