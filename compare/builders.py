"""Layer builders for compare.layer: stock TorchTitan 0.2.2 MoE (eager / compiled, bf16 / fp8) and
MegaMoE (reference / triton), expert-parallel over all ranks, plus fixed-routing injection.

Shape legend: T tokens on this rank, D model dim, F expert hidden dim, E routed experts, K top_k,
R EP ranks (= world size), e = E // R local experts.

Both implementations start from the same TorchTitan ``MoE`` built with the same seed (Qwen3 router:
softmax, normalized top-k, scores applied after the experts, no shared expert), so "random" routing
is the same router with the same weights in both. The stock layer follows
``shared/probes/stock_layer_baseline.py``: torchao ``MoETrainingConfig`` (fp8 rowwise) through
``quantize_`` on ``experts``, ``parallelize_module(moe.experts, mesh, ExpertParallel())``, then
``torch.compile(moe.experts, fullgraph=False)``. MegaMoE is built by ``MegaMoE.from_moe`` and
sharded by TorchTitan's own ``apply_moe_ep_tp`` (weights ``Shard(0)`` on the "ep" mesh; the
all-to-all hooks it installs are stripped by MegaMoE on its first forward).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from compare.shapes import LayerShape

__all__ = [
    "IMPLS",
    "PRECISIONS",
    "ImplSpec",
    "skip_reason",
    "model_dtype",
    "build_layer",
    "inject_routing",
    "stock_layer_context",
    "LayerSteps",
    "layer_steps",
    "parse_impls",
]

#: Precision choices. "fp32" is a CPU/debug choice (fp32 model, fp32 GEMMs; megamoe runs its
#: reference with fp32 operands), not a training recipe.
PRECISIONS = ("bf16", "fp8", "fp8_bwd", "fp32")


@dataclass(frozen=True)
class ImplSpec:
    """One ``--impls`` choice."""

    name: str
    family: str  # "stock" | "megamoe"
    compile: bool = False
    backend: str | None = None  # megamoe backend
    about: str = ""


IMPLS: dict[str, ImplSpec] = {
    "tt-eager": ImplSpec("tt-eager", "stock", about="stock TorchTitan 0.2.2 MoE, eager"),
    "tt-compile": ImplSpec("tt-compile", "stock", compile=True,
                           about="stock TorchTitan MoE, torch.compile(moe.experts, fullgraph=False)"),
    "megamoe-reference": ImplSpec("megamoe-reference", "megamoe", backend="reference",
                                  about="MegaMoE, pure-PyTorch reference operator"),
    "megamoe-triton": ImplSpec("megamoe-triton", "megamoe", backend="triton",
                               about="MegaMoE, fused Triton kernels + symmetric memory"),
}


def model_dtype(precision: str) -> torch.dtype:
    """Parameter / activation dtype of the layer: fp32 for "fp32", bf16 otherwise (fp8 recipes keep
    bf16 master weights and activations and quantize inside the GEMMs)."""
    return torch.float32 if precision == "fp32" else torch.bfloat16


def _megamoe_precision(precision: str) -> str:
    # fp32 operands run the bf16-recipe reference in the operands' dtype (the reference computes in
    # the input dtype); the record carries dtype float32.
    return "bf16" if precision == "fp32" else precision


def skip_reason(impl: str, precision: str, device: torch.device) -> str | None:
    """Why (impl, precision) cannot run here, or None if it can. Never skip silently: the caller
    records and prints this reason."""
    spec = IMPLS[impl]
    if spec.family == "stock":
        if precision == "fp8_bwd":
            return ("fp8_bwd (bf16 forward, fp8 backward) is a megamoe recipe; stock TorchTitan has "
                    "no such variant")
        if precision == "fp8":
            if device.type != "cuda":
                return "fp8 rowwise grouped GEMM (torchao MoETrainingConfig) needs a CUDA GPU"
            if torch.cuda.get_device_capability(device) < (8, 9):
                return "fp8 rowwise grouped GEMM needs compute capability >= 8.9"
        return None
    from titan_megamoe.config import AVAILABLE

    mp = _megamoe_precision(precision)
    if mp not in AVAILABLE.get(spec.backend, ()):
        built = ", ".join(f"{b}/{p}" for b, ps in AVAILABLE.items() for p in ps) or "none"
        return (f"titan_megamoe.config.AVAILABLE has no {spec.backend}/{mp} yet "
                f"(available now: {built})")
    if spec.backend == "triton" and device.type != "cuda":
        return "the triton backend needs a CUDA GPU"
    return None


def _moe_args(shape: LayerShape, use_grouped_mm: bool):
    from torchtitan.models.moe.moe import MoEArgs

    # Qwen3 (TorchTitan 0.2.2 qwen3_args): softmax router, route_norm, no shared expert.
    return MoEArgs(num_experts=shape.experts, num_shared_experts=0, score_func="softmax",
                   route_norm=True, route_scale=1.0, score_before_experts=False,
                   top_k=shape.top_k, load_balance_coeff=1e-3, use_grouped_mm=use_grouped_mm)


def _stock_moe(shape: LayerShape, dtype: torch.dtype, device: torch.device, seed: int) -> nn.Module:
    """TorchTitan ``MoE`` with TorchTitan's init, full (unsharded) weights, same on every rank."""
    from torchtitan.models.moe.moe import MoE

    # Stock's grouped-mm path pads with a Triton GPU kernel (generate_permute_indices): for-loop on CPU.
    args = _moe_args(shape, use_grouped_mm=device.type == "cuda")
    with torch.device(device):
        moe = MoE(args, dim=shape.dim, hidden_dim=shape.hidden)
    torch.manual_seed(seed)
    with torch.no_grad():
        moe.init_weights(0.02, device)
    moe = moe.to(dtype)
    moe.expert_bias = moe.expert_bias.float()
    moe.tokens_per_expert = moe.tokens_per_expert.float()
    return moe


class _Block(nn.Module):
    def __init__(self, moe: nn.Module):
        super().__init__()
        self.moe, self.moe_enabled = moe, True


class _Model(nn.Module):
    """The minimum ``apply_moe_ep_tp`` walks: ``model.layers[i].moe`` with ``moe_enabled``."""

    def __init__(self, moe: nn.Module):
        super().__init__()
        self.layers = nn.ModuleDict({"0": _Block(moe)})


@dataclass
class BuiltLayer:
    """A layer ready to time, and what the record should say about it."""

    module: nn.Module
    dtype: torch.dtype
    notes: list[str] = field(default_factory=list)


def build_layer(impl: str, precision: str, shape: LayerShape, device: torch.device,
                mesh=None, seed: int = 0, max_tokens: int = 0) -> BuiltLayer:
    """Build one layer for (impl, precision) on ``device``; EP over ``mesh`` (1-D, "ep") if given.

    Call inside :func:`stock_layer_context` for stock layers (token-group alignment, CPU patches).
    ``max_tokens``: tokens per call on each rank (megamoe's ``max_tokens_per_rank``; 0 = unchecked);
    the triton backend at EP > 1 needs it (its workspace size), for every precision (bf16, fp8, fp8_bwd).
    """
    spec = IMPLS[impl]
    dtype = model_dtype(precision)
    moe = _stock_moe(shape, dtype, device, seed)
    notes: list[str] = []
    if spec.family == "stock":
        if precision == "fp8":
            from torchao.prototype.moe_training.conversion_utils import MoETrainingConfig
            from torchao.quantization.quant_api import quantize_

            quantize_(moe, config=MoETrainingConfig(), filter_fn=lambda m, fqn: "experts" in fqn)
            notes.append("torchao MoETrainingConfig (fp8 rowwise) on experts; token group alignment 16")
        if device.type == "cpu":
            notes.append("CPU: for-loop experts (use_grouped_mm=False), histc patched")
        if mesh is not None:
            from torch.distributed.tensor.parallel import parallelize_module
            from torchtitan.distributed.expert_parallel import ExpertParallel

            parallelize_module(moe.experts, mesh, ExpertParallel())
        if spec.compile:
            moe.experts = torch.compile(moe.experts, fullgraph=False)
        return BuiltLayer(moe, dtype, notes)

    from titan_megamoe.config import MegaMoEConfig
    from titan_megamoe.layer import MegaMoE

    cfg = MegaMoEConfig(backend=spec.backend, precision=_megamoe_precision(precision))
    mega = MegaMoE.from_moe(moe, config=cfg, max_tokens_per_rank=max_tokens)
    if spec.backend == "triton" and mesh is not None and mesh.size() > 1:
        notes.append("EP triton v1: symmetric-memory dispatch/combine, phases separated by barriers (no overlap yet)")
        if cfg.precision != "bf16":  # ops/ep_fp8_backend.py
            from titan_megamoe.ops import ep_fp8_backend

            fp8_x = cfg.precision == "fp8" and ep_fp8_backend.FP8_DISPATCH == "fp8"
            x = "e4m3 + scales, quantized on the source" if fp8_x else "bf16 rows, quantized on the receiving rank"
            notes.append(f"FP8 EP v1: forward x dispatched as {x}; backward x / dy as bf16 rows")
    if precision == "fp32":
        notes.append("fp32 operands through the reference (config precision bf16)")
    if mesh is not None:
        from torchtitan.models.llama4.infra.parallelize import apply_moe_ep_tp

        apply_moe_ep_tp(_Model(mega), tp_mesh=None, ep_mesh=mesh, etp_mesh=None, ep_etp_mesh=None)
    return BuiltLayer(mega, dtype, notes)


def inject_routing(moe: nn.Module, ids_TK: Tensor, counts_E: Tensor) -> None:
    """Make ``moe.router`` return the fixed expert ids ``ids_TK`` (T, K) for this rank's T tokens.

    The scores are still the router's own (softmax of ``gate(x)`` in fp32, gathered at the fixed
    ids, normalized like the router), so they require grad and the backward reaches the gate
    weight as in training; only the top-k selection is replaced. ``counts_E`` (E,) fp32 are the
    tokens per expert of ``ids_TK`` (the router's third output).
    """
    router = moe.router

    def forward(x: Tensor, expert_bias: Tensor | None = None):
        if x.shape[0] != ids_TK.shape[0]:
            raise ValueError(f"fixed routing holds {ids_TK.shape[0]} tokens, the layer got {x.shape[0]}")
        scores = router.gate(x)
        if router.score_func == "sigmoid":
            scores = torch.sigmoid(scores.to(torch.float32))
        else:
            scores = F.softmax(scores.to(torch.float32), dim=1)
        top_scores = scores.gather(dim=1, index=ids_TK)
        if router.route_norm:
            top_scores = top_scores / (top_scores.sum(dim=-1, keepdim=True) + 1e-20)
        return top_scores * router.route_scale, ids_TK, counts_E

    router.forward = forward  # instance attribute: nn.Module.__call__ finds it before the class's


@contextlib.contextmanager
def stock_layer_context(precision: str, device: torch.device):
    """Process-wide settings stock TorchTitan reads while building and running, restored on exit:

    * token group alignment 16 for fp8 (as TorchTitan's float8 converter sets), 8 otherwise;
    * on CPU: ``torch.histc`` on int ids (``titan_megamoe.testing.stock_histc_on_cpu``) and the CPU
      implementation of ``generate_permute_indices`` (the default one is a Triton GPU kernel, used by
      ``ExpertParallel``'s token permute).
    """
    from torchtitan.models.moe import utils as moe_utils

    from titan_megamoe.testing import stock_histc_on_cpu

    old_align = moe_utils.TOKEN_GROUP_ALIGN_SIZE_M
    old_gpi = moe_utils.generate_permute_indices
    moe_utils.set_token_group_alignment_size_m(16 if precision == "fp8" else 8)
    try:
        with contextlib.ExitStack() as stack:
            if device.type == "cpu":
                stack.enter_context(stock_histc_on_cpu())

                def gpi_cpu(*args, **kwargs):
                    kwargs["use_cpu"] = True
                    return old_gpi(*args, **kwargs)

                moe_utils.generate_permute_indices = gpi_cpu
            yield
    finally:
        moe_utils.generate_permute_indices = old_gpi
        moe_utils.TOKEN_GROUP_ALIGN_SIZE_M = old_align


@dataclass
class LayerSteps:
    """One built layer as ``compare.timing.time_fwd_bwd`` takes it: ``fwd()`` -> output, ``bwd(out)``, ``before()``
    (grads of the parameters and of x set to None), and ``context()``: the context to build, warm and time it in
    (``stock_layer_context`` for stock TorchTitan, a null context otherwise)."""

    fwd: object
    bwd: object
    before: object
    context: object


def layer_steps(impl: str, shape: LayerShape, device: torch.device, x: Tensor, grad: Tensor, *,
                precision: str = "bf16", seed: int = 0) -> LayerSteps:
    """Build ``impl`` at ``shape`` (``build_layer``) and the step callables of a training step on ``x`` (1, T, D)
    with output gradient ``grad``: the per-step protocol of compare.layer, for scripts that time several layers in
    one process (scripts/protocol_ab.py, scripts/dense_floor.py).

    Raises:
        KeyError: an unknown ``impl``; what ``build_layer`` raises.
    """
    stock = IMPLS[impl].family == "stock"

    def context():
        return stock_layer_context(precision, device) if stock else contextlib.nullcontext()

    with context():
        moe = build_layer(impl, precision, shape, device, seed=seed).module
    params = list(moe.parameters())

    def before():
        for p in params:
            p.grad = None
        x.grad = None

    return LayerSteps(fwd=lambda: moe(x), bwd=lambda y: y.backward(grad), before=before, context=context)


def parse_impls(text: str) -> list[str]:
    """Comma list of implementation names (``IMPLS`` keys), empty items dropped.

    Raises:
        ValueError: a name not in ``IMPLS``, naming it and the allowed ones.
    """
    impls = [i.strip() for i in text.split(",") if i.strip()]
    unknown = [i for i in impls if i not in IMPLS]
    if unknown:
        raise ValueError(f"unknown implementation(s) {unknown}; choose from {sorted(IMPLS)}")
    return impls
