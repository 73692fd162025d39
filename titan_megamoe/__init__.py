"""titan-megamoe: a fused, trainable expert-parallel MoE operator for TorchTitan.

Importing the package registers (and does nothing else: no CUDA work, no compilation):
  * the model converter "megamoe" (``[model] converters = ["megamoe"]``),
  * reduced-layer Qwen3 flavors with the real 30B-A3B / 235B-A22B layer shapes,
  * the "python_stdlib" dataset (the embedded default corpus).
"""

from torchtitan.protocols.model_converter import _registry_model_converter_cls, register_model_converter

from titan_megamoe.config import MegaMoEConfig
from titan_megamoe.converter import MegaMoEConverter
from titan_megamoe.layer import MegaMoE
from titan_megamoe.ops import mega_moe

__all__ = ["MegaMoE", "MegaMoEConfig", "MegaMoEConverter", "mega_moe"]
__version__ = "0.1.0"

if "megamoe" not in _registry_model_converter_cls:
    register_model_converter(MegaMoEConverter, "megamoe")


def _register() -> None:
    from titan_megamoe.data import register_datasets
    from titan_megamoe.flavors import register_flavors

    register_flavors()
    register_datasets()


_register()
