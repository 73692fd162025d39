"""Eager-mode autograd for the fused ops: the custom op's own forward, setup_context and backward
functions behind one ``torch.autograd.Function``, used when nothing is being compiled.

Why: a layer's forward is timed from an idle device and is host-bound until GEMM1 starts, and a
``torch.library`` custom op called with autograd on costs host time of its own (the dispatcher, the
generated autograd wrapper, schema checks): 132 vs 90 us for the whole bf16 forward on a CPU machine
(``scripts/host_overhead_cpu.py``, host-only driver), 1259 vs 825 us around 825 us of launches on an
H200 host (``benchmarks/results/host_overhead_30b_1xh200_20261201.json``, stages "custom op
(autograd)" and "triton_fwd (no op)"). Under ``torch.compile`` (``torch.compiler.is_compiling()``)
the custom ops are called as before: their fake implementations and registered autograd are what
Dynamo and AOTAutograd trace.

Both paths run the same functions on the same tensors, so results are bitwise equal
(``tests/test_eager_autograd.py``). ``TITAN_MEGAMOE_EAGER_AUTOGRAD=0`` (read at import; tests set
``ENABLED``) sends every call through the custom ops.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
from torch import Tensor

from titan_megamoe.kernels.jit import env_flag

__all__ = ["ENABLED", "OpFunctions", "call"]

#: Eager calls go through ``_EagerFunction`` (True) or the custom op (False).
ENABLED = env_flag("TITAN_MEGAMOE_EAGER_AUTOGRAD", True)


class OpFunctions(NamedTuple):
    """One fused op's Python functions, shared by its custom op and its eager path.

    forward(*inputs) -> tuple whose first element is the op's differentiable output (the rest is
    saved state); setup_context(ctx, inputs, output) as ``register_autograd``'s; backward(ctx, dout)
    -> one gradient per input (None or a list of None for inputs without one), calling the backward
    implementation directly when ``ctx.eager`` is set.
    """

    forward: Callable
    setup_context: Callable
    backward: Callable


class _EagerFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fns: OpFunctions, *inputs):
        output = fns.forward(*inputs)
        ctx.eager = True
        ctx.fns = fns
        fns.setup_context(ctx, inputs, output)
        return output[0]

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        grads = ctx.fns.backward(ctx, dout)
        # lists (the FP8 weight list's gradients) are not tensor inputs here: autograd wants None
        return (None, *(None if isinstance(g, list) else g for g in grads))


def call(op, fns: OpFunctions, *inputs) -> Tensor:
    """The op's first output for ``inputs``: through ``_EagerFunction`` in eager mode, through the
    custom op ``op`` (an ``OpOverloadPacket``) while compiling or when ``ENABLED`` is False."""
    if ENABLED and not torch.compiler.is_compiling():
        return _EagerFunction.apply(fns, *inputs)
    return op(*inputs)[0]
