"""Named MoE layer shapes: the single registry used by compare.layer, the tests and the docs.

Shape legend: D model dim, F expert hidden dim (``moe_inter_dim``), E routed experts, K top_k.
The presets are the layer shapes of TorchTitan 0.2.2's Qwen3 flavors (see DESIGN.md section 4).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

__all__ = ["LayerShape", "SHAPES", "CUSTOM_SYNTAX", "parse_shape", "shape_choices"]


@dataclass(frozen=True)
class LayerShape:
    """One MoE layer's dimensions. ``name`` is the preset name or ``custom:D,F,E,K``."""

    name: str
    dim: int  # D
    hidden: int  # F
    experts: int  # E
    top_k: int  # K

    def as_dict(self) -> dict:
        return asdict(self)


SHAPES: dict[str, LayerShape] = {
    # Qwen3-30B-A3B: 48 layers, 128 experts, top 8, moe_inter_dim 768
    "qwen3-30b-a3b": LayerShape("qwen3-30b-a3b", 2048, 768, 128, 8),
    # Qwen3-235B-A22B: 94 layers, 128 experts, top 8, moe_inter_dim 1536
    "qwen3-235b-a22b": LayerShape("qwen3-235b-a22b", 4096, 1536, 128, 8),
    # Qwen3 debugmodel_moe: dim 256, 64 experts, top 8, moe_inter_dim 768
    "debug": LayerShape("debug", 256, 768, 64, 8),
}

CUSTOM_SYNTAX = "custom:DIM,HIDDEN,EXPERTS,TOPK"


def shape_choices() -> str:
    """The allowed values of ``--shapes``, for error messages and help."""
    return ", ".join([*SHAPES, CUSTOM_SYNTAX])


def parse_shape(spec: str) -> LayerShape:
    """A preset name or ``custom:D,F,E,K`` -> :class:`LayerShape`.

    Raises:
        ValueError: unknown name, malformed custom spec, non-positive sizes, or top_k > experts;
            the message names the allowed values.
    """
    spec = spec.strip()
    if spec in SHAPES:
        return SHAPES[spec]
    if spec.startswith("custom:"):
        parts = spec[len("custom:"):].split(",")
        try:
            dims = [int(p) for p in parts]
        except ValueError:
            dims = []
        if len(dims) != 4:
            raise ValueError(f"malformed shape {spec!r}: expected {CUSTOM_SYNTAX} with 4 integers")
        if min(dims) <= 0:
            raise ValueError(f"shape {spec!r}: every size must be > 0")
        d, f, e, k = dims
        if k > e:
            raise ValueError(f"shape {spec!r}: top_k={k} > experts={e}")
        return LayerShape(f"custom:{d},{f},{e},{k}", d, f, e, k)
    raise ValueError(f"unknown shape {spec!r}; allowed: {shape_choices()}")
