"""MegaMoE: a TorchTitan 0.2.2 ``MoE`` layer whose routed-expert path is one fused operator.

Same parameters, buffers and FQNs as TorchTitan's ``MoE`` (``router.gate.weight``,
``experts.w1/w2/w3``, ``shared_experts.*``, ``expert_bias``, ``tokens_per_expert``), same router
semantics and init, so checkpoints are interchangeable. Subclassing ``MoE`` keeps TorchTitan's
``apply_compile`` / ``apply_fsdp`` / load-balancing code treating it as an MoE layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn import Parameter
from torch.nn.modules import module as _nn_module

from torchtitan.models.moe.moe import MoE, MoEArgs, TokenChoiceTopKRouter

from titan_megamoe.config import MegaMoEConfig
from titan_megamoe.experts import MegaMoEExperts
from titan_megamoe.kernels import jit
from titan_megamoe.kernels import router as fused_router
from titan_megamoe.ops import eager_layer
from titan_megamoe.ops import triton_backend as tb
from titan_megamoe.parallelize import strip_torchtitan_ep_hooks

__all__ = ["MegaMoE", "MegaMoERouter", "moe_args_of"]


def _has_global_module_hooks() -> bool:
    """Any ``torch.nn.modules.module.register_module_forward_*`` / backward hook installed (they must see
    the router and experts modules called)."""
    m = _nn_module
    return bool(m._global_forward_hooks or m._global_forward_pre_hooks or m._global_backward_hooks
                or m._global_backward_pre_hooks)


_BF16, _FP32 = torch.bfloat16, torch.float32
_PLAIN = (Parameter, Tensor)  # not subclasses such as DTensor
#: Precisions the fused eager node takes (bf16: ``ops/eager_layer.py``; fp8 / fp8_bwd: ``ops/eager_layer_fp8.py``).
_FUSED_PRECISIONS = ("bf16", "fp8", "fp8_bwd")
_FP8_OK: dict = {}  # (device, D, F) -> whether fp8_backend.check_fp8_supported passes (it reads the device once)


def _fp8_ok(device: torch.device, D: int, F: int) -> bool:
    key = (device, D, F)
    ok = _FP8_OK.get(key)
    if ok is None:
        from titan_megamoe.errors import MegaMoEConfigError
        from titan_megamoe.ops.fp8_backend import check_fp8_supported

        try:
            check_fp8_supported(device, D, F, "", "fp8")
            ok = True
        except MegaMoEConfigError:
            ok = False
        _FP8_OK[key] = ok
    return ok


class MegaMoERouter(TokenChoiceTopKRouter):
    """TorchTitan's token-choice top-k router (softmax / sigmoid, expert_bias for selection only,
    node-limited groups, route_norm, route_scale), with the per-expert counts taken by a
    ``scatter_add_`` of ones (exact integer counts in fp32, so deterministic; no host sync, unlike
    ``torch.bincount``; runs on CPU, where ``histc`` of int64 does not).

    Fused path (default; ``TITAN_MEGAMOE_FUSED_ROUTER=0``, read every call, turns it off; measured on an
    H200 in docs/NOTES.md, session 8):
    in eager mode everything after the gate linear is one Triton launch (``kernels/router.py``, with
    its own backward; the counts added into ``counts_into`` when given, else one ``torch.zeros``)
    instead of ~12 torch ops, when all hold: the switch on, not under ``torch.compile`` (Inductor
    fuses the torch code), no node-limited groups, no ``_debug_force_load_balance``, the gate output
    (and expert_bias) plain tensors (not DTensors) on CUDA, or on CPU under ``TRITON_INTERPRET=1``, with
    at most ``kernels.router.MAX_EXPERTS`` experts and 1 <= top_k <= E.
    Otherwise the torch code below runs (it is the reference). Same return contract either way; the
    fused path orders each token's slots by descending choice value with ties to the lowest expert
    id, where ``torch.topk(sorted=False)``'s slot order is unspecified (the layer ignores slot order).
    """

    def _fused_ok(self, logits: Tensor, expert_bias: Tensor | None) -> bool:
        """Whether ``forward`` takes the fused path for this gate output (class docstring)."""
        if torch.compiler.is_compiling() or self.num_expert_groups is not None or self._debug_force_load_balance:
            return False
        if fused_router.triton is None or self.score_func not in fused_router.SCORE_FUNCS:
            return False
        if type(logits) is not Tensor or not (expert_bias is None or type(expert_bias) is Tensor):
            return False
        if not 1 <= self.top_k <= self.num_experts <= fused_router.MAX_EXPERTS:
            return False
        if not (logits.is_cuda or (logits.device.type == "cpu" and jit.interpreting())):
            return False
        return jit.env_flag("TITAN_MEGAMOE_FUSED_ROUTER", True)

    def forward(self, x: Tensor, expert_bias: Tensor | None = None, counts_into: Tensor | None = None):
        """x (T, D) -> top_scores (T, K) fp32, selected_experts_indices (T, K) int64,
        num_tokens_per_expert (E,) fp32.

        ``counts_into`` (the layer's ``tokens_per_expert``, fp32 (E,)): the fused path adds the counts
        into it in its kernel and returns None for them (two host-side ops fewer); the torch path
        ignores it and returns the counts (the caller adds them).
        """
        scores = self.gate(x)
        if self._fused_ok(scores, expert_bias):
            if counts_into is not None and (type(counts_into) is not Tensor or counts_into.dtype != torch.float32
                                            or counts_into.device != scores.device
                                            or not counts_into.is_contiguous()):
                counts_into = None
            return fused_router.topk_route_differentiable(
                scores, self.top_k, score_func=self.score_func, expert_bias=expert_bias,
                route_norm=self.route_norm, route_scale=self.route_scale, counts_into=counts_into)
        if self.score_func == "sigmoid":
            scores = torch.sigmoid(scores.to(torch.float32))
        elif self.score_func == "softmax":
            scores = F.softmax(scores.to(torch.float32), dim=1)
        else:
            raise NotImplementedError(f"Unknown score function {self.score_func}")
        scores_for_choice = scores if expert_bias is None else scores + expert_bias
        if self.num_expert_groups is not None:
            scores_for_choice = self._get_node_limited_routing_scores(scores_for_choice)
        _, selected = torch.topk(scores_for_choice, k=self.top_k, dim=-1, sorted=False)
        top_scores = scores.gather(dim=1, index=selected)
        if self._debug_force_load_balance:
            selected, top_scores = self._debug_force_load_balance_routing(scores)
        if self.route_norm:
            top_scores = top_scores / (top_scores.sum(dim=-1, keepdim=True) + 1e-20)
        top_scores = top_scores * self.route_scale
        # scatter_add, not bincount: bincount reads max() back to the host (a sync every layer).
        ids = selected.reshape(-1)
        counts = torch.zeros(self.num_experts, dtype=torch.float32, device=ids.device).scatter_add_(
            0, ids, torch.ones(ids.shape, dtype=torch.float32, device=ids.device))
        return top_scores, selected, counts


def moe_args_of(moe: MoE) -> tuple[MoEArgs, int, int]:
    """Recover (MoEArgs, dim, hidden_dim) from a built TorchTitan ``MoE`` layer."""
    r, ex = moe.router, moe.experts
    num_experts, hidden_dim, dim = ex.w1.shape
    shared = 0
    if moe.shared_experts is not None:
        shared = moe.shared_experts.w1.weight.shape[0] // hidden_dim
    args = MoEArgs(
        num_experts=num_experts,
        num_shared_experts=shared,
        score_func=r.score_func,
        route_norm=r.route_norm,
        route_scale=r.route_scale,
        gate_bias=r.gate.bias is not None,
        score_before_experts=moe.score_before_experts,
        top_k=r.top_k,
        num_expert_groups=r.num_expert_groups,
        num_limited_groups=r.num_limited_groups,
        use_grouped_mm=getattr(ex, "use_grouped_mm", True),
        load_balance_coeff=moe.load_balance_coeff,
        _debug_force_load_balance=r._debug_force_load_balance,
    )
    return args, dim, hidden_dim


class MegaMoE(MoE):
    """MoE layer: router -> fused expert-parallel experts (+ shared experts).

    Args:
        moe_args, dim, hidden_dim: as TorchTitan's ``MoE``.
        config: the ``[megamoe]`` settings (backend, precision, capacity).
        max_tokens_per_rank: tokens per call on one rank (0: unchecked).
        layer_name: FQN used in error messages.

    Input / output: (bs, slen, dim) in the model dtype.
    """

    def __init__(
        self,
        moe_args: MoEArgs,
        dim: int,
        hidden_dim: int,
        *,
        config: MegaMoEConfig | None = None,
        max_tokens_per_rank: int = 0,
        layer_name: str = "moe",
    ):
        super().__init__(moe_args, dim=dim, hidden_dim=hidden_dim)
        self.router = MegaMoERouter(
            dim=dim,
            num_experts=moe_args.num_experts,
            num_expert_groups=moe_args.num_expert_groups,
            num_limited_groups=moe_args.num_limited_groups,
            top_k=moe_args.top_k,
            score_func=moe_args.score_func,
            route_norm=moe_args.route_norm,
            route_scale=moe_args.route_scale,
            gate_bias=moe_args.gate_bias,
            _debug_force_load_balance=moe_args._debug_force_load_balance,
        )
        self.experts = MegaMoEExperts(
            dim=dim,
            hidden_dim=hidden_dim,
            num_experts=moe_args.num_experts,
            config=config,
            score_before_experts=moe_args.score_before_experts,
            top_k=moe_args.top_k,
            max_tokens_per_rank=max_tokens_per_rank,
            layer_name=layer_name,
        )
        self.reorderer = None  # the fused operator orders tokens itself
        self.layer_name = layer_name

    @classmethod
    def from_moe(
        cls,
        moe: MoE,
        *,
        config: MegaMoEConfig | None = None,
        max_tokens_per_rank: int = 0,
        layer_name: str = "moe",
    ) -> "MegaMoE":
        """Build a MegaMoE that takes over ``moe``'s parameters and buffers (same objects, so the
        dtype, device, values and any sharding are kept)."""
        args, dim, hidden_dim = moe_args_of(moe)
        with torch.device("meta"):
            new = cls(args, dim, hidden_dim, config=config,
                      max_tokens_per_rank=max_tokens_per_rank, layer_name=layer_name)
        new.router.gate = moe.router.gate
        new.shared_experts = moe.shared_experts
        for name in ("w1", "w2", "w3"):
            setattr(new.experts, name, getattr(moe.experts, name))
        new.expert_bias = moe.expert_bias
        new.tokens_per_expert = moe.tokens_per_expert
        new.train(moe.training)
        return new

    def _fused_layer_ok(self, x: Tensor) -> bool:
        """Whether ``forward`` runs the gate, router and experts as one autograd node (``ops/eager_layer.py``);
        see :meth:`_fused_layer_operands`."""
        return self._fused_layer_operands(x) is not None

    def _fused_layer_operands(self, x: Tensor):
        """(router, gate weight, expert_bias, tokens_per_expert, w1, w2, w3) when ``forward`` runs the gate, router
        and experts as one autograd node (``ops/eager_layer.py``), else None (the modular path runs).

        It runs when all hold: eager mode, ``TITAN_MEGAMOE_FUSED_LAYER`` on, the fused router's conditions, a gate
        without bias, the triton backend in bf16, fp8 or fp8_bwd (FP8: a GPU with FP8 tensor cores, D and F multiples of
        128) at EP = 1 with scores after the experts, x (T, D) and the gate,
        w1, w2, w3 weights (plain tensors, not DTensors) bf16, contiguous, of matching shapes on one device,
        tokens_per_expert a contiguous fp32 (E,) tensor there, expert_bias None or an (E,) floating tensor there,
        no module hooks on the layer's router, gate or experts (FSDP's all-gather, profilers) and no global ones,
        and the tokens within ``max_tokens_per_rank``. These are every precondition of the kernels' unchecked
        launch halves the node calls (the forward is host-bound until GEMM1 is enqueued, so nothing is checked
        twice); where one fails, the modular path's checked calls raise or run.

        Raises:
            ValueError: D or F not a multiple of 16 (the triton backend's requirement, as the modular path raises).
        """
        # _modules / _parameters / _buffers read directly (each nn.Module.__getattr__ is a Python call), no
        # generators: this runs before the first launch of a host-bound forward
        mods = self._modules
        router, experts = mods["router"], mods["experts"]
        if not (eager_layer.ENABLED and type(x) is Tensor and x.dtype is _BF16 and x.is_contiguous()
                and type(router) is MegaMoERouter and "forward" not in router.__dict__):
            return None
        cfg = experts.config
        if cfg.backend != "triton" or cfg.precision not in _FUSED_PRECISIONS or experts.score_before_experts:
            return None
        gate = router._modules["gate"]
        gp, ep = gate._parameters, experts._parameters
        gate_w, w1, w2, w3 = gp.get("weight"), ep.get("w1"), ep.get("w2"), ep.get("w3")
        # a bias, a missing weight, or DTensors (FSDP / EP sharding): the modular path
        if (gp.get("bias") is not None or type(gate_w) not in _PLAIN or type(w1) not in _PLAIN
                or type(w2) not in _PLAIN or type(w3) not in _PLAIN):
            return None
        if not (gate_w.dtype is _BF16 and w1.dtype is _BF16 and w2.dtype is _BF16 and w3.dtype is _BF16
                and gate_w.is_contiguous() and w1.is_contiguous() and w2.is_contiguous() and w3.is_contiguous()):
            return None
        T, D = x.shape
        E, F, D1 = w1.shape
        if D1 != D or w3.shape != w1.shape or gate_w.shape != (E, D) or w2.shape != (E, D, F):
            return None
        dev = x.get_device()
        if not (gate_w.get_device() == w1.get_device() == w2.get_device() == w3.get_device() == dev):
            return None
        bufs = self._buffers
        counts = bufs.get("tokens_per_expert")
        if (type(counts) is not Tensor or counts.dtype is not _FP32 or counts.get_device() != dev
                or counts.shape != (E,) or not counts.is_contiguous()):
            return None
        bias = bufs["expert_bias"] if "expert_bias" in bufs else self.expert_bias
        if bias is not None and (type(bias) is not Tensor or bias.shape != (E,) or not bias.dtype.is_floating_point
                                 or bias.get_device() != dev):
            return None
        if 0 < experts.max_tokens_per_rank < T:
            return None  # the modular path raises CapacityError
        if (router._forward_hooks or router._forward_pre_hooks or router._backward_hooks
                or router._backward_pre_hooks or gate._forward_hooks or gate._forward_pre_hooks
                or gate._backward_hooks or gate._backward_pre_hooks or experts._forward_hooks
                or experts._forward_pre_hooks or experts._backward_hooks or experts._backward_pre_hooks):
            return None
        if _has_global_module_hooks() or not router._fused_ok(x, bias):
            return None
        if D % 16 or F % 16:
            tb.check_triton_inputs(x, None, None, w1, w2, w3, self.layer_name)  # raises, naming the fix
        if cfg.precision != "bf16" and not _fp8_ok(x.device, D, F):
            return None  # the modular path raises MegaMoEConfigError, naming the fix
        return router, gate_w, bias, counts, w1, w2, w3

    def forward(self, x: Tensor) -> Tensor:
        """x (bs, slen, dim) -> (bs, slen, dim)."""
        bs, slen, dim = x.shape
        x = x.view(-1, dim)
        experts = self._modules["experts"]
        if experts._forward_pre_hooks or experts._forward_hooks:
            # TorchTitan's parallelize installs all-to-all hooks after conversion; drop them.
            strip_torchtitan_ep_hooks(experts)
        fused = self._fused_layer_operands(x)
        if fused is not None:
            r = fused[0]
            args = (x, *fused[1:], r.top_k, r.score_func, r.route_norm, r.route_scale)
            precision = experts.config.precision
            # the kernels first, then the autograd node: its host time after GEMM1 is enqueued
            if precision == "bf16":
                out = eager_layer.FusedLayerFunction.apply(*args, eager_layer.fused_forward(*args))
            else:
                from titan_megamoe.ops import eager_layer_fp8

                # the FP8 weights are taken inside the node's forward, where its host time waits least
                args += (experts.fp8_cache, precision == "fp8", experts.layer_name)
                out = eager_layer_fp8.FusedFp8LayerFunction.apply(*args, eager_layer_fp8.fused_forward_fp8(*args))
            if self.shared_experts is not None:
                out = self.shared_experts(x) + out
            return out.reshape(bs, slen, dim)
        if isinstance(self.router, MegaMoERouter) and "forward" not in vars(self.router):
            # the fused router adds the counts in its kernel (returns None for them)
            top_scores, selected, counts = self.router(x, self.expert_bias, counts_into=self.tokens_per_expert)
        else:  # a replaced router (compare.builders.inject_routing, tests): TorchTitan's signature
            top_scores, selected, counts = self.router(x, self.expert_bias)
        if counts is not None:
            with torch.no_grad():
                self.tokens_per_expert.add_(counts)
        out = self.experts(x, selected, top_scores)
        if self.shared_experts is not None:
            out = self.shared_experts(x) + out
        return out.reshape(bs, slen, dim)
