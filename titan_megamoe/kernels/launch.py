"""The one way the kernel modules launch a Triton kernel: ``launch(kernel, grid, *args, **kwargs)``.

Interpreter (``TRITON_INTERPRET=1``, CPU tests): the kernel's interpreted flavor, as before.

Compiled: Triton's ``JITFunction.run`` does, on every launch, work whose result only changes when the
arguments' specialization changes: option parsing, a cache key made from ``str(options)``, a check of
the globals the kernel read, grid canonicalization, a ``LazyDict`` of launch metadata for the launch
hooks (built even when no hook is installed), then the compiled kernel's C launcher. On the H200
machines a kernel launch measured 150-220 us of host time, and the forward of the layer is host-bound
until GEMM1 starts (docs/NOTES.md, "host cost of the forward"). ``launch`` keeps what is needed:

1. Triton's own generated binder (``fn.device_caches[device][4]``, native argument specialization:
   dtype and 16-byte alignment of pointers, integer width and divisibility, constexpr values) gives
   (bound arguments, specialization, options);
2. ``(specialization, options)`` — the same data Triton's kernel cache is keyed by — finds the
   compiled kernel in our per-kernel cache; on a miss the launch goes through ``JITFunction.run``
   (which compiles or finds the kernel and launches it) and its compiled kernel is cached;
3. the compiled kernel's launcher is called directly with the bound arguments, exactly the call
   ``JITFunction.run`` makes; launch metadata and hooks only when a launch hook is installed
   (profilers such as proton).

So every launch runs the kernel Triton would have run, with the same arguments and grid (a CPU test
records both paths' launcher calls through ``kernels/host_driver.py`` and compares them).

4. Tensors on the launch device go to the launcher as their addresses (``POINTER_ARGS``). Triton's C
   launcher (``getPointer`` in ``backends/nvidia/driver.py``) takes an int as the device address as it is,
   but for a tensor it calls ``data_ptr()`` and then ``cuPointerGetAttribute`` to check that the address
   is device memory: one driver call per pointer argument per launch (GEMM1: 7). The binder has already
   read each tensor's dtype and alignment, and the launchers check devices before launching, so the
   kernel and its arguments are the same. ``TITAN_MEGAMOE_POINTER_ARGS=0`` passes the tensors (Triton's
   check runs again). Not
repeated on the fast path: the check that the globals a kernel read at compile time still hold
(ours read none that change) and ``pre_run_hooks`` (a kernel with any goes through Triton). Knobs
read once (``TRITON_DEBUG``, instrumentation mode) are assumed constant within a process.

``TITAN_MEGAMOE_FAST_LAUNCH=0`` (read at import) or ``launch.FAST_LAUNCH = False`` sends every launch
through ``JITFunction.run``. The fast path is used only with the Triton release it was written against
(3.6, the GPU machines': ``device_caches`` holding the binder, ``CompiledKernel.run`` taking the
packed metadata and the two hooks, hooks as ``HookChain``); any other release goes through
``JITFunction.run``, with the same results.
"""

from __future__ import annotations

import contextlib

from torch import Tensor as _Tensor

from titan_megamoe.kernels.jit import env_flag, flavor, interpreting
from titan_megamoe.kernels.sm90_check import VERIFIED_TRITON

__all__ = ["FAST_LAUNCH", "POINTER_ARGS", "launch", "fast_launch_supported", "cached_kernels", "record_launches",
           "kernel_configs"]

#: Launch compiled kernels through the cache of this module (module docstring); False: Triton's path.
FAST_LAUNCH = env_flag("TITAN_MEGAMOE_FAST_LAUNCH", True)
#: On the fast path, pass tensors on the launch device as their addresses (module docstring, item 4).
POINTER_ARGS = env_flag("TITAN_MEGAMOE_POINTER_ARGS", True)
#: The device type whose tensors are passed as addresses: "cuda"; ``kernels/host_driver.py`` sets "cpu"
#: while its host-only driver is active (its "device" tensors are CPU tensors).
POINTER_DEVICE_TYPE = "cuda"

_SUPPORTED: bool | None = None
_RECORD: list | None = None  # record_launches(): the launches' descriptions while active
_CACHES: dict = {}  # id(JITFunction) -> {(device, specialization, options): CompiledKernel}; the
# JITFunctions live as long as the process (jit.flavor keeps them), so their ids stay theirs
_driver = _runtime = None  # triton's driver config and knobs.runtime, bound once (an import statement
# inside the launch path costs ~1 us per launch)


def fast_launch_supported() -> bool:
    """True when this Triton is the release whose internals the fast path calls (checked once)."""
    global _SUPPORTED, _driver, _runtime
    if _SUPPORTED is None:
        try:
            import triton
            from triton import knobs
            from triton.runtime.driver import driver
            from triton.runtime.jit import JITFunction

            _driver, _runtime = driver, knobs.runtime
            _SUPPORTED = triton.__version__.startswith(VERIFIED_TRITON) and hasattr(JITFunction, "create_binder")
        except Exception:  # noqa: BLE001 - any other Triton layout: Triton's own path
            _SUPPORTED = False
    return _SUPPORTED


def launch(kernel, grid, *args, **kwargs):
    """Launch the ``@triton.jit`` ``kernel`` on ``grid`` (a tuple of 1-3 ints, or a function of the bound
    arguments returning one, as Triton takes) with ``args`` / ``kwargs``
    (constexprs and launch options such as ``num_warps`` by keyword, as for ``kernel[grid](...)``).

    Same semantics as ``kernel[grid](*args, **kwargs)`` in the mode ``TRITON_INTERPRET`` asks for at
    call time (``kernels/jit.py``), with less host time per compiled launch (module docstring).

    Returns:
        What Triton's launch returns (the compiled kernel; None in the interpreter).
    """
    if _RECORD is not None:
        _RECORD.append(_describe(kernel, grid, args, kwargs))
    if interpreting():
        return flavor(kernel, True)[grid](*args, **kwargs)
    fn = flavor(kernel, False)
    if not (FAST_LAUNCH and (_SUPPORTED or fast_launch_supported())) or fn.pre_run_hooks:
        return fn[grid](*args, **kwargs)
    return _launch_cached(fn, grid, args, kwargs)


def _launch_cached(fn, grid, args, kwargs):
    device = _driver.active.get_current_device()
    bound, specialization, options = fn.device_caches[device][4](*args, **kwargs)  # Triton's binder
    cache = _CACHES.get(id(fn))
    if cache is None:
        cache = _CACHES[id(fn)] = {}
    try:
        key = (device, tuple(specialization), tuple(options.items()))
        hit = cache.get(key)
    except TypeError:  # an unhashable constexpr: Triton's path
        return fn[grid](*args, **kwargs)
    if hit is None:
        kernel = fn.run(*args, grid=grid, warmup=False, **kwargs)  # compiles or finds it, and launches
        if kernel is not None and hasattr(kernel, "function"):
            # positions of the pointer arguments (specialized "*dtype"): the ones POINTER_ARGS passes as ints
            pointers = tuple(i for i, (ty, _) in enumerate(specialization) if isinstance(ty, str) and ty[:1] == "*")
            cache[key] = (kernel, pointers)
        return kernel
    kernel, pointers = hit
    if callable(grid):  # Triton's grid-function form: grid(bound arguments)
        grid = grid(bound)
    n = len(grid)
    stream = _driver.active.get_current_stream(device)
    enter, exit_ = _runtime.launch_enter_hook, _runtime.launch_exit_hook
    if _hook_set(enter) or _hook_set(exit_):  # a profiler's hooks: their metadata, as Triton builds it
        hooks = (kernel.launch_metadata(grid, stream, *bound.values()), enter, exit_)
    else:
        hooks = (None, None, None)
    values = _as_addresses(bound.values(), pointers) if POINTER_ARGS else bound.values()
    kernel.run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, stream, kernel.function,
               kernel.packed_metadata, *hooks, *values)
    return kernel


def _as_addresses(values, pointers: tuple[int, ...]) -> list:
    """The bound arguments with the tensor at each position of ``pointers`` replaced by its address (an
    int, which Triton's launcher takes without a ``cuPointerGetAttribute`` call) when it is on
    ``POINTER_DEVICE_TYPE``; other values as they are (a tensor on another device stays a tensor, so
    Triton's own check still names it)."""
    out = list(values)
    on_device = "is_" + POINTER_DEVICE_TYPE  # "is_cuda" (the host-only driver: "is_cpu")
    for i in pointers:
        v = out[i]
        if isinstance(v, _Tensor) and getattr(v, on_device):
            out[i] = v.data_ptr()
    return out


def _hook_set(hook) -> bool:
    """A launch hook to call: a non-empty ``HookChain`` (Triton 3.6's type) or any other callable."""
    return hook is not None and (bool(hook.calls) if hasattr(hook, "calls") else True)


def cached_kernels(kernel) -> int:
    """How many compiled variants of ``kernel`` the fast path holds (tests)."""
    fn = flavor(kernel, False)
    return len(_CACHES.get(id(fn), {}))


# --------------------------------------------------------------------------------------------------
# Which configs ran (compare.layer records them with each megamoe row)
# --------------------------------------------------------------------------------------------------

_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg")


@contextlib.contextmanager
def record_launches():
    """While active, every :func:`launch` appends a description of itself to the yielded list: {"kernel": name,
    "grid": [..] (or "callable"), "constexprs": {name: value}, "options": {num_warps, num_stages, maxnreg: ...}}.
    Tensors and runtime scalars are left out (what the config chose, not the data). Nests (the inner one
    records alone). Host-side only: one global read per launch when inactive."""
    global _RECORD
    prev, _RECORD = _RECORD, []
    try:
        yield _RECORD
    finally:
        _RECORD = prev


def _plain(v):
    """A constexpr's value as JSON can hold it (Triton dtypes and layouts by their text)."""
    return v if isinstance(v, (bool, int, float, str, type(None))) else str(v)


def _describe(kernel, grid, args, kwargs) -> dict:
    params = getattr(kernel, "params", None) or []
    constexpr = {p.name: p.is_constexpr for p in params}
    cx = {p.name: _plain(v) for p, v in zip(params, args) if p.is_constexpr}
    opts = {}
    for name, v in kwargs.items():
        if name in _OPTIONS:
            opts[name] = _plain(v)
        elif constexpr.get(name, not params and isinstance(v, (bool, int, float, str))):
            cx[name] = _plain(v)
    fn = getattr(kernel, "fn", kernel)
    return {"kernel": getattr(fn, "__name__", str(fn)), "grid": "callable" if callable(grid) else list(grid),
            "constexprs": cx, "options": opts}


def kernel_configs(launches: list[dict]) -> dict[str, list[dict]]:
    """{kernel name: its distinct configs, in launch order} from :func:`record_launches`'s list: each config its
    constexprs, launch options and grids (a kernel launched twice with one config lists both grids)."""
    out: dict[str, list[dict]] = {}
    for d in launches:
        configs = out.setdefault(d["kernel"], [])
        for c in configs:
            if c["constexprs"] == d["constexprs"] and c["options"] == d["options"]:
                if d["grid"] not in c["grids"]:
                    c["grids"].append(d["grid"])
                break
        else:
            configs.append({"constexprs": d["constexprs"], "options": d["options"], "grids": [d["grid"]]})
    return out
