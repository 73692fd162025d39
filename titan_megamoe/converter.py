"""The ``megamoe`` TorchTitan model converter.

``[model] converters = ["megamoe"]`` swaps every TorchTitan ``MoE`` layer (including DeepEP's
``DeepEPMoE``) for :class:`~titan_megamoe.layer.MegaMoE`. It runs on the meta-device model, after
the device meshes exist and before TorchTitan's parallelize function, and checks the job config and
parallelism up front so an unsupported combination fails before anything is allocated.
"""

from __future__ import annotations


import torch
from torch import nn

from torchtitan.models.moe.moe import GroupedExperts, MoE
from torchtitan.tools.logging import logger

from titan_megamoe.config import MegaMoEConfig, MegaMoEConfigError
from titan_megamoe.errors import UnsupportedModelError
from titan_megamoe.layer import MegaMoE
from titan_megamoe.parallelize import register_sac_save_ops

__all__ = ["MegaMoEConverter", "convert_moe_layers", "check_converters", "check_parallelism", "check_fp8_setup",
           "check_fp8_dims"]


def check_parallelism(parallel_dims) -> None:
    """Refuse parallelism combinations the fused operator does not support (yet).

    Raises:
        UnsupportedModelError: tensor parallel, expert tensor parallel or pipeline parallel enabled.
    """
    problems = []
    if getattr(parallel_dims, "tp", 1) > 1:
        problems.append(
            f"tensor_parallel_degree={parallel_dims.tp} (megamoe shards experts over EP only; "
            "set parallelism.tensor_parallel_degree = 1)"
        )
    if getattr(parallel_dims, "etp", 1) > 1:
        problems.append(
            f"expert_tensor_parallel_degree={parallel_dims.etp} (set it to 1: megamoe keeps whole experts per rank)"
        )
    if getattr(parallel_dims, "pp", 1) > 1:
        problems.append(
            f"pipeline_parallel_degree={parallel_dims.pp} (not tested with megamoe yet; set it to 1)"
        )
    if problems:
        raise UnsupportedModelError("megamoe cannot run with " + "; ".join(problems))


def check_converters(converters) -> None:
    """Refuse model converters that cannot run beside megamoe.

    Raises:
        UnsupportedModelError: a converter that quantizes the MoE grouped GEMMs (``quantize.grouped_mm.*``:
            TorchTitan's float8 / mx expert GEMMs), which megamoe replaces.
    """
    grouped = [c for c in converters if c != "megamoe" and "grouped_mm" in c]
    if grouped:
        raise UnsupportedModelError(
            f"converters {grouped} quantize the MoE grouped GEMMs, which megamoe replaces; use "
            "[megamoe] precision instead and remove them from [model] converters"
        )


def convert_moe_layers(
    model: nn.Module, config: MegaMoEConfig, *, max_tokens_per_rank: int = 0
) -> list[str]:
    """Replace every TorchTitan ``MoE`` in ``model`` by ``MegaMoE`` in place; return their FQNs.

    Raises:
        UnsupportedModelError: an MoE layer whose experts are not TorchTitan's plain SwiGLU
            ``GroupedExperts`` (for example gpt-oss's biased, clamped experts), a layer that scales the
            experts' input by the score (``score_before_experts``, Llama4) with backend "triton" (the
            fused kernels apply the score after the experts), or no MoE layer at all.
    """
    converted = []
    for fqn, module in list(model.named_modules()):
        if not isinstance(module, MoE) or isinstance(module, MegaMoE):
            continue
        if type(module.experts) is not GroupedExperts:
            raise UnsupportedModelError(
                f"layer '{fqn}' ({type(module).__name__}) has experts of type "
                f"{type(module.experts).__name__}, which megamoe cannot express (it fuses bias-free "
                "SwiGLU experts w1/w2/w3 only). Remove 'megamoe' from [model] converters for this model."
            )
        if config.backend == "triton" and module.score_before_experts:
            raise UnsupportedModelError(
                f"layer '{fqn}' scales the experts' input by the routing score (score_before_experts, as "
                "Llama4 does); the triton backend applies it after the experts (Qwen3 / DeepSeek-V3 style). "
                "Set [megamoe] backend = \"reference\" for this model."
            )
        new = MegaMoE.from_moe(module, config=config, max_tokens_per_rank=max_tokens_per_rank, layer_name=fqn)
        parent_name, _, child = fqn.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, new)
        converted.append(fqn)
    if not converted:
        raise UnsupportedModelError(
            f"megamoe found no TorchTitan MoE layer in {type(model).__name__}; it applies to MoE "
            "models (qwen3 *_moe / A3B / A22B flavors, deepseek_v3, llama4). Remove 'megamoe' from "
            "[model] converters."
        )
    return converted


FP8_PRECISIONS = ("fp8", "fp8_bwd")


def check_fp8_setup(config: MegaMoEConfig, ep: int) -> None:
    """Refuse FP8 where it cannot run, before the model is built.

    FP8 runs at any EP size on the triton backend (EP > 1: ``ops/ep_fp8_backend.py``); ``ep`` is
    accepted for the callers' symmetry and checks nothing today.

    Raises:
        MegaMoEConfigError: a visible GPU without FP8 tensor cores (compute capability < 8.9). Dims
            are checked per layer in ``convert``.
    """
    if config.precision not in FP8_PRECISIONS:
        return
    if torch.cuda.is_available():
        from titan_megamoe.ops.fp8_backend import check_fp8_supported

        dev = torch.device("cuda", torch.cuda.current_device())
        check_fp8_supported(dev, 128, 128, "megamoe", config.precision)  # dims: per layer in convert()


def check_fp8_dims(model: nn.Module, config: MegaMoEConfig) -> None:
    """Raise MegaMoEConfigError naming the first MoE layer whose dims are not multiples of 128 (FP8)."""
    if config.precision not in FP8_PRECISIONS:
        return
    for fqn, module in model.named_modules():
        if isinstance(module, MoE):
            E, F, D = module.experts.w1.shape
            if D % 128 or F % 128:
                from titan_megamoe.ops.fp8_backend import check_fp8_supported

                check_fp8_supported(torch.device("meta"), D, F, fqn, config.precision)


class MegaMoEConverter:
    """TorchTitan ``ModelConverter`` registered as "megamoe".

    Raises (at construction, i.e. before the model is built on device):
        MegaMoEConfigError: a bad ``[megamoe]`` value.
        NotImplementedError: a backend / precision that is not built yet.
        UnsupportedModelError: unsupported parallelism or a conflicting converter.
    """

    def __init__(self, job_config, parallel_dims):
        config = getattr(job_config, "megamoe", None)
        if config is None:
            logger.warning(
                "megamoe: no [megamoe] table in the job config (set [job] custom_config_module = "
                "\"titan_megamoe.config\" to configure it); using defaults"
            )
            config = MegaMoEConfig()
        config.validate()
        config.check_available()
        check_parallelism(parallel_dims)
        check_fp8_setup(config, getattr(parallel_dims, "ep", 1))
        check_converters(job_config.model.converters)
        if config.backend == "reference":
            logger.warning(
                "megamoe: backend \"reference\" is the pure-PyTorch oracle (correct, but 0.2-0.4x stock TorchTitan); "
                "set [megamoe] backend = \"triton\" for the fused kernels"
            )
        self.config = config
        tokens = job_config.training.local_batch_size * job_config.training.seq_len
        cp = getattr(parallel_dims, "cp", 1)
        self.max_tokens_per_rank = config.max_tokens_per_rank or max(1, tokens // max(cp, 1))
        self.ep = getattr(parallel_dims, "ep", 1)

    def convert(self, model: nn.Module) -> None:
        """Swap every MoE layer of the (meta-device) model in place."""
        check_fp8_dims(model, self.config)
        converted = convert_moe_layers(model, self.config, max_tokens_per_rank=self.max_tokens_per_rank)
        if self.config.backend == "triton":
            register_sac_save_ops()
        logger.info(
            f"megamoe: converted {len(converted)} MoE layers (backend={self.config.backend}, "
            f"precision={self.config.precision}, EP={self.ep}, max_tokens_per_rank={self.max_tokens_per_rank})"
        )

    def post_optimizer_hook(self, model) -> None:
        """After each optimizer step (FP8 only): drop the FP8 weight caches (the weights changed; the
        caches would notice through ``_version`` too, except for writes that bypass it) and raise for
        non-finite FP8 scales whose counters have landed (``ops/fp8_backend.py``, no wait)."""
        if self.config.precision not in FP8_PRECISIONS:
            return None
        from titan_megamoe.ops.fp8_backend import NONFINITE

        models = model if isinstance(model, (list, tuple)) else [model]
        for m in models:
            for module in m.modules():
                cache = getattr(module, "fp8_cache", None)
                if cache is not None:
                    cache.invalidate()
        NONFINITE.check()
        return None
