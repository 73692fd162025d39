"""Expert parallelism for converted layers, on top of TorchTitan 0.2.2's own parallelize functions.

TorchTitan's ``apply_moe_ep_tp`` applies ``ExpertParallel`` (or ``DeepEPExpertParallel``) to every
``block.moe.experts``. That does two things: it shards w1/w2/w3 ``Shard(0)`` on the ``ep`` mesh
(which is what the fused operator wants: rank r owns experts [r*e, (r+1)*e)), and it installs forward
hooks that run an all-to-all with a host sync around the experts. The fused operator does its own
dispatch and combine, so :func:`strip_torchtitan_ep_hooks` removes those hooks (keeping the
sharding) the first time a converted layer runs, after TorchTitan's parallelize function returns.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from titan_megamoe.errors import UnsupportedModelError

__all__ = ["strip_torchtitan_ep_hooks", "local_expert_weights"]


def _ep_style_classes() -> tuple[type, ...]:
    from torchtitan.distributed.expert_parallel import BaseExpertParallel

    return (BaseExpertParallel,)


def _is_torchtitan_ep_hook(fn: object) -> bool:
    # distribute_module registers lambdas closing over the style's bound _token_dispatch /
    # _token_combine methods: the style instance identifies them.
    classes = _ep_style_classes()
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            obj = cell.cell_contents
        except ValueError:  # empty cell
            continue
        owner = getattr(obj, "__self__", None)
        if isinstance(owner, classes) or isinstance(obj, classes):
            return True
    return False


def strip_torchtitan_ep_hooks(experts: nn.Module) -> int:
    """Remove TorchTitan's expert-parallel dispatch/combine hooks from ``experts``.

    Keeps every other hook (FSDP's unshard/reshard hooks among them) and the ``Shard(0)`` placement
    of the weights. Idempotent. Returns the number of hooks removed.
    """
    removed = 0
    for hooks, kw in (
        (experts._forward_pre_hooks, experts._forward_pre_hooks_with_kwargs),
        (experts._forward_hooks, experts._forward_hooks_with_kwargs),
    ):
        for hid, fn in list(hooks.items()):
            if _is_torchtitan_ep_hook(fn):
                del hooks[hid]
                kw.pop(hid, None)
                experts._forward_hooks_always_called.pop(hid, None)
                removed += 1
    return removed


def local_expert_weights(experts: nn.Module, layer_name: str):
    """This rank's expert weights and the EP process group.

    Returns:
        (w1 (e, F, D), w2 (e, D, F), w3 (e, F, D), ep_group or None). Plain tensors: DTensor
        parameters sharded ``Shard(0)`` on a mesh with an "ep" dimension are unwrapped with
        ``to_local()`` (autograd flows back to the DTensor).

    Raises:
        UnsupportedModelError: weights sharded in any other way (for example expert tensor
        parallelism), which the fused operator cannot express.
    """
    w1, w2, w3 = experts.w1, experts.w2, experts.w3
    if not isinstance(w1, DTensor):
        return w1, w2, w3, None
    mesh = w1.device_mesh
    names = mesh.mesh_dim_names or ()
    if names != ("ep",) or any(
        not isinstance(w, DTensor) or tuple(w.placements) != (Shard(0),) for w in (w1, w2, w3)
    ):
        raise UnsupportedModelError(
            f"{layer_name}: expert weights are sharded as {tuple(w1.placements)} on mesh dims {names}; "
            "megamoe needs Shard(0) on the 'ep' mesh only (no expert tensor parallelism). "
            "Set parallelism.expert_tensor_parallel_degree = 1 and tensor_parallel_degree = 1."
        )
    group = mesh.get_group("ep")
    if dist.get_world_size(group) == 1:
        group = None
    return w1.to_local(), w2.to_local(), w3.to_local(), group


def register_sac_save_ops() -> None:
    """Add the fused forward op to TorchTitan's selective-AC save lists (qwen3, llama4, deepseek_v3).

    Its outputs (the layer output, gate_up and the routing layout) cost one grouped GEMM pass to
    recompute and ~0.45 GiB per layer to keep at the Qwen3-30B-A3B shape: keeping them is cheaper,
    as TorchTitan does for mm and attention. Idempotent; imports the op lazily.
    """
    import importlib

    import torch

    import titan_megamoe.ops.ep_library  # noqa: F401  registers torch.ops.megamoe (EP > 1)
    import titan_megamoe.ops.library  # noqa: F401  registers torch.ops.megamoe (EP = 1)

    # the EP op too: recomputing it in the backward would repeat its dispatch and combine over NVLink
    ops = (torch.ops.megamoe.bf16_mega_moe_fwd.default, torch.ops.megamoe.bf16_mega_moe_ep_fwd.default,
           torch.ops.megamoe.fp8_mega_moe_fwd.default, torch.ops.megamoe.fp8_mega_moe_ep_fwd.default)
    for mod in ("torchtitan.models.qwen3.infra.parallelize", "torchtitan.models.llama4.infra.parallelize",
                "torchtitan.models.deepseek_v3.infra.parallelize"):
        save_list = getattr(importlib.import_module(mod), "_op_sac_save_list", None)
        if save_list is not None:
            save_list.update(ops)
