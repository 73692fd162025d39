"""The interpreter / compiled switch shared by the kernel modules.

``triton.jit`` picks the interpreted or the compiled flavor of a kernel when its decorator runs
(import time), but tests set ``TRITON_INTERPRET`` per run: the launchers ask for the flavor at launch
time instead (``kernels/launch.py``), which re-wraps ``kernel.fn`` in the flavor the flag asks for now
(the kernels call only Triton's library functions and ``@triton.jit`` helpers such as ``grouped_tile``
below, whose flavor follows the flag at import: set it before importing, as tests/conftest.py does).
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

__all__ = ["env_flag", "env_choice", "interpreting", "flavor", "runnable", "cdiv", "next_pow2", "interp_int", "grouped_tile", "live_tile_range"]

_FLAVORS: dict = {}


def env_flag(name: str, default: bool) -> bool:
    """An on/off switch of the environment: unset -> ``default``; "1" on, "0" off.

    Raises:
        ValueError: any other value (``=true`` / ``=off`` would otherwise be read the wrong way).
    """
    if _ENV_BYTES is not None:  # read per call on the forward's host path: the byte store is ~25x faster
        raw = _ENV_BYTES.get(name.encode())
        if raw is None:
            return default
        if raw == b"1" or raw == b"0":
            return raw == b"1"
    value = os.environ.get(name)
    if value is None:
        return default
    if value not in ("0", "1"):
        raise ValueError(f"{name}={value!r}: set it to 1 (on) or 0 (off), or unset it (default: {int(default)})")
    return value == "1"


def env_choice(name: str, default: str, choices: tuple[str, ...]) -> str:
    """A switch of the environment taking one of ``choices``: unset -> ``default``.

    Raises:
        ValueError: any other value, naming the variable and the choices.
    """
    value = os.environ.get(name, default)
    if value not in choices:
        raise ValueError(f"{name}={value!r}: set it to one of {', '.join(choices)}, or unset it (default: {default})")
    return value


#: POSIX ``os.environ``'s own store (bytes -> bytes), which ``os.environ[...] = ...`` and ``del`` update: one dict
#: lookup (27 ns) instead of ``os.environ.get``'s encode / lookup / decode (0.7 us on the CPU machine); called
#: ~11 times per layer forward, which is host-bound until GEMM1 is enqueued. None elsewhere.
_ENV_BYTES = getattr(os.environ, "_data", None) if os.name == "posix" else None


def interpreting() -> bool:
    """True when kernels run in Triton's interpreter (``TRITON_INTERPRET=1``), read at call time."""
    if _ENV_BYTES is not None:
        return _ENV_BYTES.get(b"TRITON_INTERPRET") == b"1"
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def flavor(kernel, interpret: bool):
    """``kernel`` as an ``InterpretedFunction`` (``interpret``) or a compiled ``JITFunction``, one object
    per (function, flavor); the sm_90a compile tests ask for the compiled one while interpreting."""
    key = (kernel.fn, interpret)
    got = _FLAVORS.get(key)
    if got is None:  # imports here, not above the lookup: an import statement costs ~1 us per launch
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction

        if getattr(kernel, "is_gluon", lambda: False)():  # Gluon: compiled only (no interpreter flavor)
            if interpret:
                raise RuntimeError(f"{kernel.fn.__name__} is a Gluon kernel: Triton's interpreter cannot run it")
            got = _FLAVORS[key] = kernel
            return got
        want = InterpretedFunction if interpret else JITFunction
        got = _FLAVORS[key] = kernel if isinstance(kernel, want) else want(kernel.fn)
    return got


def runnable(kernel):
    """``kernel`` in the flavor ``TRITON_INTERPRET`` asks for now."""
    return flavor(kernel, interpreting())


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for host code: ``triton.cdiv`` is a constexpr function whose host call costs ~3 us
    (argument unwrapping), ~100x this, and launchers call it on every launch."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (0 for 0), ``triton.next_power_of_2`` without its host-call cost."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


@triton.constexpr_function
def interp_int(x):
    """Interpreter only: the Python int of a scalar tensor, for range() bounds read from memory.

    Called solely under interpreter-only ternaries (``interp_int(n) if INTERPRET else n``), so the compiler
    never evaluates it. The interpreter's ``__index__`` does ``int()`` of a 1-element numpy array, which
    numpy >= 2.3 refuses.
    """
    return int(x.handle.data.reshape(-1)[0])


@triton.jit
def grouped_tile(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of launch id ``pid`` in grouped order: GROUP_M row tiles sweep all column
    blocks before the next group starts (L2 reuse of the row tiles' operands; Triton's matmul
    tutorial). GROUP_M = 1: all column blocks of one row tile back to back."""
    width = GROUP_M * num_pid_n
    first_m = (pid // width) * GROUP_M
    group = tl.minimum(num_pid_m - first_m, GROUP_M)
    return first_m + (pid % width) % group, (pid % width) // group


@triton.jit
def live_tile_range(offsets_ptr, E, BLOCK_M: tl.constexpr, NUM_N: tl.constexpr, INTERPRET: tl.constexpr):
    """(first tile, tile count, live row tiles) of a persistent grouped-GEMM program: the live row tiles
    are offsets[E] // BLOCK_M (every one has an expert), times NUM_N column blocks; the program starts
    at its id and strides by the grid size. ``INTERPRET``: Python ints, for the interpreter's range()."""
    n_live = tl.load(offsets_ptr + E) // BLOCK_M
    n_tiles = n_live * NUM_N
    first = tl.program_id(0)
    if INTERPRET:
        first, n_tiles = interp_int(first), interp_int(n_tiles)
    return first, n_tiles, n_live
