"""Exceptions raised by titan-megamoe (each message names what was wrong and what to do)."""

from titan_megamoe.config import MegaMoEConfigError

__all__ = ["CapacityError", "MegaMoEConfigError", "NonFiniteError", "PeerTimeoutError", "UnsupportedModelError"]


class CapacityError(RuntimeError):
    """More tokens or routed rows than the configured capacity. Tokens are never dropped."""


class UnsupportedModelError(ValueError):
    """A model, layer or parallelism setting the fused operator cannot express."""


class PeerTimeoutError(RuntimeError):
    """An expert-parallel peer did not reach a cross-rank wait within the timeout (comm/signals.py):
    the message names the layer, the phase, this rank and the rank that never arrived."""


class NonFiniteError(ValueError):
    """An FP8 scaling group with a non-finite amax (inf / NaN in a tensor the FP8 path quantized).

    Raised lazily (a few layer calls after the bad call, see ``ops/fp8_backend.py``), naming the layer.
    """
