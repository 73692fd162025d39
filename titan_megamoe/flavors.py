"""Reduced-layer Qwen3 MoE flavors with the real layer shapes, for 1-2 GPU comparisons.

Qwen3-30B-A3B needs ~490 GB for fp32 params + grads + Adam state, so on 2 GPUs we keep its exact
layer (dim 2048, 128 experts, top-8, moe_inter 768, 32 heads x 128, 4 KV heads, vocab 151936) and
cut the layer count. Names: "<size>-<layers>L", e.g. "30B-A3B-8L". Registered into TorchTitan's
``qwen3_args`` by importing titan_megamoe.
"""

from __future__ import annotations

import copy

__all__ = ["REDUCED_LAYERS", "register_flavors", "reduced_flavor_name"]

#: base flavor -> layer counts registered
REDUCED_LAYERS: dict[str, tuple[int, ...]] = {
    "30B-A3B": (2, 4, 8, 12, 16),
    "235B-A22B": (2, 4),
}
_MIN_SEQ = 16384  # the published comparisons run seq_len 16384


def reduced_flavor_name(base: str, n_layers: int) -> str:
    return f"{base}-{n_layers}L"


def register_flavors() -> list[str]:
    """Add the reduced flavors to ``torchtitan.models.qwen3.qwen3_args`` (idempotent)."""
    from torchtitan.models.qwen3 import qwen3_args

    added = []
    for base, counts in REDUCED_LAYERS.items():
        for n in counts:
            name = reduced_flavor_name(base, n)
            if name in qwen3_args:
                continue
            args = copy.deepcopy(qwen3_args[base])
            args.n_layers = n
            args.max_seq_len = max(args.max_seq_len, _MIN_SEQ)
            qwen3_args[name] = args
            added.append(name)
    return added
