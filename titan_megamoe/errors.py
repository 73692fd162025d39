"""Exceptions raised by titan-megamoe (each message names what was wrong and what to do)."""

from titan_megamoe.config import MegaMoEConfigError

__all__ = ["CapacityError", "MegaMoEConfigError", "UnsupportedModelError"]


class CapacityError(RuntimeError):
    """More tokens or routed rows than the configured capacity. Tokens are never dropped."""


class UnsupportedModelError(ValueError):
    """A model, layer or parallelism setting the fused operator cannot express."""
