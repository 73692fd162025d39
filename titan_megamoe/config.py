"""The ``[megamoe]`` TOML table.

Enable it in a TorchTitan 0.2.2 config with::

    [job]
    custom_config_module = "titan_megamoe.config"

    [experimental]
    custom_import = "titan_megamoe"

    [model]
    converters = ["megamoe"]

    [megamoe]
    backend = "triton"
    precision = "bf16"

TorchTitan merges :class:`JobConfig` below into its own, field by field; values are checked
when the table is parsed (``MegaMoEConfig.__post_init__``), so a typo fails before any model is
built, with the key and the allowed values in the message.
"""

# No `from __future__ import annotations`: TorchTitan merges this JobConfig with
# dataclasses.make_dataclass and tyro needs real (not string) field types.
import math
from dataclasses import dataclass, field
from typing import Literal, get_args

Backend = Literal["reference", "triton"]
Precision = Literal["bf16", "fp8", "fp8_bwd"]

#: What each backend can run today. Anything else raises "not available yet" (no silent fallback).
AVAILABLE: dict[str, tuple[str, ...]] = {
    "reference": ("bf16",),
    "triton": ("bf16", "fp8", "fp8_bwd"),  # at any EP size (EP > 1: inside the operator)
}


class MegaMoEConfigError(ValueError):
    """A ``[megamoe]`` value (or a parallelism setting it depends on) is invalid."""


@dataclass
class MegaMoEConfig:
    """Settings of the fused MoE operator (``[megamoe]`` table)."""

    backend: Backend = "triton"
    """Implementation of the fused operator. "reference": pure PyTorch (all-to-all dispatch with one
    copy per (token, destination rank), per-rank partial sums, fp32 combine); the oracle every
    kernel is tested against, 0.2-0.4x stock TorchTitan. "triton" (the default): fused Triton grouped-GEMM
    kernels, forward and backward,
    scores applied after the experts (Qwen3); bf16, fp8 and fp8_bwd at any EP size that divides the
    expert count (EP > 1: dispatch / combine through PyTorch symmetric memory inside the operator; FP8
    at EP > 1 runs the FP8 GEMMs on the receiving rank; "fp8" dispatches the forward's x as e4m3 rows
    + scales quantized on the source, everything else as bf16 rows; 2-GPU test:
    benchmarks/results/ep_triton_v3_fp8_2xh200_20261130.json)."""

    precision: Precision = "bf16"
    """Arithmetic of the expert GEMMs. "bf16"; "fp8": blockwise FP8 forward and backward (1x128
    activation tiles, 128x128 weight blocks); "fp8_bwd": BF16 forward, FP8 backward. Only the
    combinations listed in ``titan_megamoe.config.AVAILABLE`` run today."""

    max_tokens_per_rank: int = 0
    """Largest number of tokens one rank feeds into one MoE layer per call (batch x sequence on
    that rank). 0 means ``training.local_batch_size * training.seq_len``. A call with more tokens
    raises (the symmetric buffers of the fused backends are sized from it)."""

    capacity_factor: float = 2.0
    """Receive capacity per rank as a multiple of the balanced load: a rank accepts up to
    ``ceil(capacity_factor * max_tokens_per_rank * top_k)`` routed (token, expert) rows, clamped to
    the worst case ``max_tokens_per_rank * ep * min(top_k, local_experts)``. Routing that exceeds it
    raises an error naming the layer and the count; tokens are never dropped. Must be >= 1."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field; raises :class:`MegaMoEConfigError` naming the key and allowed values."""
        _check_choice("megamoe.backend", self.backend, Backend)
        _check_choice("megamoe.precision", self.precision, Precision)
        if isinstance(self.max_tokens_per_rank, bool) or not isinstance(self.max_tokens_per_rank, int):
            raise MegaMoEConfigError(
                f"megamoe.max_tokens_per_rank must be an integer >= 0 (0 = local_batch_size * seq_len), "
                f"got {self.max_tokens_per_rank!r}"
            )
        if self.max_tokens_per_rank < 0:
            raise MegaMoEConfigError(
                f"megamoe.max_tokens_per_rank must be >= 0 (0 = local_batch_size * seq_len), "
                f"got {self.max_tokens_per_rank}"
            )
        cf = self.capacity_factor
        if isinstance(cf, bool) or not isinstance(cf, (int, float)) or not math.isfinite(cf) or cf < 1.0:
            raise MegaMoEConfigError(
                f"megamoe.capacity_factor must be a finite number >= 1.0, got {cf!r}"
            )

    def check_available(self) -> None:
        """Raise if this (backend, precision) pair is not built yet."""
        if self.precision not in AVAILABLE[self.backend]:
            built = [f"{b}/{p}" for b, ps in AVAILABLE.items() for p in ps]
            raise NotImplementedError(
                f"megamoe: backend={self.backend!r} with precision={self.precision!r} is not available "
                f"yet in titan-megamoe; available now: {', '.join(built)}. Set [megamoe] backend / "
                "precision to one of those."
            )

    def recv_capacity(self, max_tokens: int, top_k: int, ep: int, local_experts: int) -> int:
        """Routed (token, expert) rows one rank may receive per call (see ``capacity_factor``)."""
        worst = max_tokens * ep * min(top_k, local_experts)
        return min(worst, math.ceil(self.capacity_factor * max_tokens * top_k))


def _check_choice(key: str, value: object, literal: object) -> None:
    allowed = get_args(literal)
    if value not in allowed:
        raise MegaMoEConfigError(
            f"{key} = {value!r} is not valid; allowed values: {', '.join(repr(a) for a in allowed)}"
        )


@dataclass
class JobConfig:
    """Extension merged into TorchTitan's JobConfig via ``[job] custom_config_module``."""

    megamoe: MegaMoEConfig = field(default_factory=MegaMoEConfig)
