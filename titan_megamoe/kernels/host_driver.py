"""A Triton driver that compiles for sm_90a and launches nothing: the host side of kernel launches on
a machine without a GPU.

With it active, ``kernel[grid](...)`` (and ``kernels/launch.py``) run Triton's whole compiled-mode
launch path — argument specialization, the kernel cache, compilation to a real sm_90a cubin by
Triton's bundled ptxas, the launcher call — except the C launcher, which is replaced by a recorder.
Two uses (CPU machines, CI):

* measuring the host time of the launchers and of the op (``scripts/host_overhead_cpu.py``): the
  launch path's Python is real, the device work is not there at all;
* checking that two ways of launching make the same launcher call (kernel, grid, arguments): the
  fast path of ``kernels/launch.py`` against ``JITFunction.run`` (tests/test_launch.py).

Tensors are CPU tensors (only their addresses and dtypes matter to a launch). Nothing runs, so
outputs keep whatever they held. Not for numerics.

Usage::

    with host_only_driver() as calls:
        launch(kernel, grid, *args, **kwargs)
    calls[-1]  # LaunchCall(kernel name, grid, args)
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

__all__ = ["LaunchCall", "host_only_driver"]

_SM90_PROPS = {"max_shared_mem": 232448, "multiprocessor_count": 132, "max_num_regs": 65536, "warpSize": 32,
               "sm_clock_rate": 1980000, "mem_clock_rate": 2619000, "mem_bus_width": 6144}


@dataclass
class LaunchCall:
    """One recorded launcher call: the kernel's name, the compiled kernel's identity, the grid, the
    argument values in parameter order (constexprs included, as Triton passes them)."""

    name: str
    kernel_id: int
    grid: tuple[int, int, int]
    args: tuple


def _make_driver(calls: list | None):
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.backends.driver import DriverBase

    class _Utils:
        def load_binary(self, name, kernel, shared, device):
            return 1, 1, 0, 0, 1024  # module, function, n_regs, n_spills, max threads

        def get_device_properties(self, device):
            return dict(_SM90_PROPS)

    class _Launcher:
        """Stands in for the C launcher: calls the launch hooks (when not None) around the launch and
        reads each pointer argument's address, as it does."""

        def __init__(self, src, metadata):
            self.name = getattr(getattr(src, "fn", None), "__name__", "?")

        def __call__(self, gx, gy, gz, stream, function, packed, meta, enter, exit_, *args):
            if enter is not None:
                enter(meta)
            for a in args:
                if hasattr(a, "data_ptr"):
                    a.data_ptr()
            if calls is not None:
                calls.append(LaunchCall(self.name, id(self), (gx, gy, gz), args))
            if exit_ is not None:
                exit_(meta)

    class HostOnlyDriver(DriverBase):
        def __init__(self):
            self.utils = _Utils()
            self.launcher_cls = _Launcher
            self.get_current_device = lambda: 0
            self.set_current_device = lambda device: None
            self.get_current_stream = lambda device=None: 0
            self.get_device_capability = lambda device=None: (9, 0)

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_active_torch_device(self):
            return torch.device("cpu")

        def get_device_interface(self):
            return torch.cuda

        @staticmethod
        def is_active():
            return True

        def map_python_to_cpp_type(self, ty: str) -> str:
            from triton.backends.nvidia.driver import ty_to_cpp

            return ty_to_cpp(ty)

        def get_benchmarker(self):
            raise RuntimeError("host_only_driver: nothing runs, nothing to benchmark")

        def get_empty_cache_for_benchmark(self):
            return torch.empty(1)

        def clear_cache(self, cache):
            pass

    return HostOnlyDriver()


@contextlib.contextmanager
def host_only_driver(record: bool = True):
    """Make a host-only sm_90a driver Triton's active one for the block; yields the list the launcher
    calls are appended to (None with ``record=False``: nothing kept, for timing).

    Needs Triton's NVIDIA backend with its bundled ptxas (``sm90_check.nvidia_backend_reason``) and
    ``TRITON_INTERPRET`` unset or 0 for the kernels launched inside. Restores the previous driver and
    empties ``kernels/launch.py``'s cache on the way in and out.

    Raises:
        RuntimeError: a CUDA device is visible (the fake compiled kernels would be cached where real
            launches find them).
    """
    import torch
    from triton.runtime.driver import driver

    try:
        from titan_megamoe.kernels import launch
    except ImportError:  # scripts/host_overhead_cpu.py --baseline-tree: an older tree, without the fast path
        launch = None
    if torch.cuda.is_available():  # its fake handles would land in the kernel caches real launches use
        raise RuntimeError("host_only_driver is for machines without a GPU (a CUDA device is visible)")
    calls: list | None = [] if record else None
    previous = driver._active
    driver.set_active(_make_driver(calls))
    pointer_device = getattr(launch, "POINTER_DEVICE_TYPE", None)
    if launch is not None:
        launch._CACHES.clear()
        if pointer_device is not None:  # this driver's "device" tensors are CPU tensors
            launch.POINTER_DEVICE_TYPE = "cpu"
    try:
        yield calls
    finally:
        driver._active = previous
        if launch is not None:
            launch._CACHES.clear()
            if pointer_device is not None:
                launch.POINTER_DEVICE_TYPE = pointer_device
