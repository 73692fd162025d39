"""Host glue of the blockwise-FP8 Triton backend: precision "fp8" (FP8 forward and backward) and
"fp8_bwd" (bf16 forward, FP8 backward). :func:`fp8_fwd` / :func:`fp8_bwd` run a layer at EP = 1; the
local expert compute they call (:func:`fp8_experts_fwd`, :func:`fp8_experts_bwd`: everything between
the routing layout and the per-token sums) also runs on the receive slab of the expert-parallel path
(``ops/ep_fp8_backend.py``). DeepSeek-V3's recipe (arXiv 2412.19437, section 3.3):
e4m3 everywhere, activations / gradients scaled per 1x128 tile, weights per 128x128 block, the
weight-gradient operands per 128x1 (128 rows of the reduction = tokens); fp32 accumulation with the
scale product applied per 128-wide K block. No autograd here (``ops/library.py``).

Shape legend: T tokens, D model dim, F expert hidden dim, E experts, K top_k, N_cap padded rows.

Forward (fp8): quantize x 1x128 -> FP8 GEMM1 (gather, SwiGLU; saves bf16 gate_up; h quantized 1x128 in
its epilogue, ``FUSE_H_QUANT``) -> FP8 GEMM2 (score, scatter) -> fp32 top-k sum. Forward (fp8_bwd): the bf16 kernels.
Backward (both): quantize dout 1x128 (GEMM2 dgrad's A) and, gathered into layout rows, 128x1
transposed (dw2's A) -> FP8 GEMM2 dgrad + SwiGLU bwd + d score + s*h quantized 128x1 in its epilogue
-> dgate_up quantized 1x128 and 128x1 in one pass
-> dw2, dw1 | dw3 (FP8 K-grouped wgrad; x gathered and quantized 128x1 in one pass) -> FP8 GEMM1 dgrad
-> fp32 per-token dx sum. Every quantization is
one pass reading the bf16 source once (``fp8_quant.py``, ``fp8_quant_bwd.py``).

Routing layout: BM = 128 in both modes (also under the interpreter), so each expert segment starts
on a 128-row boundary and the wgrad's 128-row scale groups never straddle two experts.

Weights: :class:`Fp8WeightCache` quantizes each expert weight once per optimizer step (128x128, and
transposed copies for the dgrad GEMMs, whose B operand must be K-major for Hopper's FP8 wgmma).

Non-finite scales (inf / NaN in x, h, dout, s*h, dgate_up or a weight): every quantization adds the
count of its non-finite groups to a device counter; :data:`NONFINITE` copies it to pinned host memory
without waiting, and the next fp8 op call (or ``MegaMoEConverter.post_optimizer_hook``, once per
step) raises :class:`~titan_megamoe.errors.NonFiniteError` naming the layer, for records that have
landed (``torch.cuda.Event.query``): no host sync per call; the error arrives a few layer calls
late, when the step's result is garbage anyway. ``NONFINITE.flush()`` waits (tests, debugging).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

import torch
from torch import Tensor

from titan_megamoe.config import MegaMoEConfigError
from titan_megamoe.kernels.jit import env_choice, env_flag
from titan_megamoe.kernels.routing import RoutingLayout, build_routing_layout

__all__ = ["FP8_BLOCK_M", "Fp8WeightCache", "NonfiniteMonitor", "NONFINITE", "check_fp8_supported",
           "fp8_fwd", "fp8_fwd_unchecked", "fp8_fwd_unchecked_ok", "fp8_bwd", "fp8_experts_fwd", "fp8_experts_bwd", "placed_token_rows", "prepare_weights",
           "prepare_weights_eager", "quantize_weights"]

#: Row block of the FP8 path's routing layout: one 128-row scale group (module docstring).
FP8_BLOCK_M = 128
#: Quantize h in GEMM1's epilogue (one pass less; BN = 128 at 16 warps) instead of a separate 1x128
#: pass over a bf16 h (BN = 64 at 8 warps). Neither measured on a GPU yet: scripts/bench_fp8.py times both.
FUSE_H_QUANT = True
#: The "fp8" forward's GEMM1 by the warp-specialized Gluon FP8 kernel (``kernels/ws_gemm_fp8.py``: bf16 h, then the
#: separate 1x128 pass) where it applies (sm_90, D and F multiples of 128), instead of the Triton kernel with the fp32
#: h quantized in its epilogue (h is then rounded to bf16 before its 1x128 quantization). On by default since session
#: 19 (same process: forward -0.29 / -0.31 ms at 30B / 235B on an H200, docs/NOTES.md); ``TITAN_MEGAMOE_WS_GEMM1_FP8=0``
#: turns it off. Read at import; a same-process switch.
WS_GEMM1_FP8 = env_flag("TITAN_MEGAMOE_WS_GEMM1_FP8", True)
#: The Gluon FP8 GEMM1 forward on 128 x 256 tiles (``ws_gemm_fp8.FP8_FWD_WIDE_CONFIG``: the gathered x rows of a stage
#: feed 128 gate and 128 up columns, a quarter fewer L2 -> SM bytes per FLOP; bitwise the default tiles) where h is
#: not quantized in the epilogue (``FP8_GEMM1_QUANT_H=0``; the default runs the wide tiles anyway). Opt-in
#: (``TITAN_MEGAMOE_FP8_FWD_WIDE=1``): alone it measured no faster (session 37). Read at import; a same-process switch.
FP8_FWD_WIDE = env_flag("TITAN_MEGAMOE_FP8_FWD_WIDE", False)

#: h quantized 1x128 in the Gluon FP8 GEMM1's epilogue (``ws_gemm1_fwd_fp8(quantize_h=True)``), not by a separate
#: pass over the bf16 h: one launch and one read / write of h fewer in the forward, the same bits. It runs on the wide
#: tiles (``FP8_FWD_WIDE_CONFIG``: a tile's 128 h columns are one group), whatever ``FP8_FWD_WIDE`` says. On by
#: default (``TITAN_MEGAMOE_FP8_GEMM1_QUANT_H=0`` gives the separate pass back). One H100: session 38, 30B layer in one
#: process 7.164 -> 6.925 ms from idle, device 6.525 -> 6.304 (``layer_1xh100_ep1_30b_fp8_quant_h_s38b_20261207.json``);
#: session 39, kernel A/B against GEMM1 + the 1x128 pass, bitwise, 30B 1.270 -> 1.019 ms, 235B 4.613 -> 3.620
#: (``ab_kernels_fp8_quant_h_prefetch_1xh100_s39a_20261207.json``), 235B layer device fwd+bwd 20.71 -> 19.99 ms
#: (``layer_1xh100_ep1_235b_fp8_quant_h_s39a_20261207.json``). Read at import; a same-process switch.
FP8_GEMM1_QUANT_H = env_flag("TITAN_MEGAMOE_FP8_GEMM1_QUANT_H", True)
#: The Gluon FP8 GEMM1 dgrad and GEMM2 forward on 128 x 256 tiles (``ws_gemm_fp8.DGRAD_FP8_WIDE_CONFIG``,
#: ``GEMM2_FP8_WIDE_CONFIG``: a stage's 128 A rows feed 256 output columns; bitwise the default tiles) where D is a
#: multiple of 256. On by default since session 37 (one H100, 8 rotated rounds: GEMM1 dgrad 0.971 -> 0.787 ms at 30B,
#: 3.727 -> 3.053 at 235B; GEMM2 0.593 -> 0.486, 2.068 -> 1.604; ``ab_kernels_wide_1xh100_s37a_20261207.json``);
#: ``TITAN_MEGAMOE_FP8_DGRAD_WIDE=0`` / ``TITAN_MEGAMOE_FP8_GEMM2_WIDE=0`` give the 128 x 128 tiles back. Read at
#: import; same-process switches.
FP8_DGRAD_WIDE = env_flag("TITAN_MEGAMOE_FP8_DGRAD_WIDE", True)
FP8_GEMM2_WIDE = env_flag("TITAN_MEGAMOE_FP8_GEMM2_WIDE", True)
#: The FP8 backward's GEMM1 dgrad by the warp-specialized Gluon kernel (``kernels/ws_gemm_fp8.ws_gemm1_dgrad_fp8``)
#: where it applies (sm_90, D and F multiples of 128) instead of the Triton one; bitwise the same dx rows. On by
#: default since session 19 (H200: kernel 1.244 -> 0.964 ms at 30B, 4.790 -> 3.609 at 235B; layer fwd+bwd -0.39 /
#: -0.99 ms); ``TITAN_MEGAMOE_WS_GEMM1_DGRAD_FP8=0`` turns it off. Read at import; a same-process switch.
WS_GEMM1_DGRAD_FP8 = env_flag("TITAN_MEGAMOE_WS_GEMM1_DGRAD_FP8", True)
#: The FP8 weight gradients (dw2, dw1 | dw3) by the warp-specialized Gluon kernel (``kernels/ws_wgrad_fp8.py``: one
#: TMA producer warp, two cooperative consumers, each tile's 128 columns as two halves in flight, the first scaled
#: under the second) instead of the Triton one; bitwise the same (GPU tests). On by default since session 21 (one H100,
#: 30B, same process: fp8 fwd+bwd 10.09 -> 8.90 ms, device 9.60 -> 8.47; session 20's "no gain" was a switches.override
#: leak, docs/NOTES.md); ``TITAN_MEGAMOE_WS_WGRAD_FP8=0`` turns it off. Read at import; a same-process switch.
WS_WGRAD_FP8 = env_flag("TITAN_MEGAMOE_WS_WGRAD_FP8", True)
#: The FP8 GEMM2 dgrad (SwiGLU backward, d score partials, 128x1 s * h) by the warp-specialized Gluon kernel
#: (``kernels/ws_gemm2_dgrad_fp8.py``) instead of the Triton one: the same dgate_up and s * h, d score partials per 64
#: columns (the Triton kernel's per BN columns: d score is the same sum, in another order where BN is 128).
#: ``TITAN_MEGAMOE_WS_GEMM2_DGRAD_FP8``: "auto" (default since session 36) the ping-pong kernel for model dims below
#: :data:`GEMM2_DGRAD_FP8_COOP_DIM`, the cooperative one from it; "0" the Triton kernel; "1" the cooperative Gluon
#: kernel; "pingpong" the ping-pong one. One H100, session 36 (``ab_kernels_g2d_fp8_1xh100_s36b_20261207.json``, 8
#: rotated rounds, the cooperative kernel's scale by the constant reciprocal): 30B Triton 1.140 ms, cooperative 1.036,
#: ping-pong **0.954-0.966**; 235B Triton 3.484, cooperative **2.998**, ping-pong 3.300-3.308. Read at import; a
#: same-process switch.
WS_GEMM2_DGRAD_FP8 = env_choice("TITAN_MEGAMOE_WS_GEMM2_DGRAD_FP8", "auto", ("auto", "0", "1", "pingpong"))
#: "auto": the cooperative Gluon GEMM2 dgrad from this model dim on (measured at D = 4096), the ping-pong one below
GEMM2_DGRAD_FP8_COOP_DIM = 4096
#: The "fp8" forward's GEMM2 by the warp-specialized Gluon kernel (``kernels/ws_gemm_fp8.ws_gemm2_fwd_fp8``: the FP8
#: GEMM1 dgrad's producer and consumers with one K segment and a scatter epilogue) where it applies (sm_90, D and F
#: multiples of 128, rows stored by pair) instead of the Triton one; bitwise the same y. On by default since session 23
#: (one H100, 30B: kernel 0.706 -> 0.598 ms, 235B 2.456 -> 2.032; same process, fp8 fwd+bwd 8.47 -> 8.25 ms, forward
#: 2.69 -> 2.48); ``TITAN_MEGAMOE_WS_GEMM2_FP8=0`` turns it off. Read at import; a same-process switch.
WS_GEMM2_FP8 = env_flag("TITAN_MEGAMOE_WS_GEMM2_FP8", True)

#: The expert weights' transposed FP8 copy (the dgrads' K-major operand) stored by the quantizing kernel
#: (``fp8_quant.quantize_weight_128x128_t``, session 40); ``TITAN_MEGAMOE_FP8_WEIGHT_T_KERNEL=0``: the 128x128
#: quantization, then PyTorch's strided copy of the e4m3 tensor (the path before; 4.1 of the 4.7 ms the 30B copies
#: took a layer step on an H100). The same bits. Read at import; a same-process switch.
FP8_WEIGHT_T_KERNEL = env_flag("TITAN_MEGAMOE_FP8_WEIGHT_T_KERNEL", True)
#: Smallest CUDA compute capability with FP8 tensor cores (Ada 8.9, Hopper 9.0).
MIN_FP8_CAPABILITY = (8, 9)
#: The weight gradients of the FP8 backward (default "fp8": the FP8 wgrad kernels). "bf16": dw1 / dw2 / dw3 from
#: the bf16 wgrad kernels (on sm_90 the Gluon K-grouped ones of the bf16 path) on bf16 dout, x, the FP8 dgrad's
#: bf16 dgate_up and bf16 s * h rows (the FP8 GEMM2 dgrad's ``hs_out``, not quantized): FP8 forward and dgrads,
#: high-precision weight gradients, as torchao's "rowwise_with_gw_hp" recipe; "fp8_acc32": the FP8 wgrad with fp32
#: promotion after every k32 wgmma instead of every 128 rows. The FP8 dgrads, dx and d scores are unchanged with
#: "fp8_acc32"; with "bf16" the GEMM2 dgrad is the Triton kernel (only it writes the bf16 s * h rows), so where the
#: default is the Gluon one (``WS_GEMM2_DGRAD_FP8``), dgate_up and dx agree to rounding and d score is summed in
#: another grouping. Read
#: from TITAN_MEGAMOE_FP8_WGRAD at import and at every backward from this attribute (``switches.py`` flips it in
#: one process; scripts/fp8_ablation.py sets it directly). Not yet a config option.
_WGRAD = os.environ.get("TITAN_MEGAMOE_FP8_WGRAD", "fp8")
_WGRAD_CHOICES = ("fp8", "bf16", "fp8_acc32")


# --------------------------------------------------------------------------------------------------
# Early checks
# --------------------------------------------------------------------------------------------------


def check_fp8_supported(device: torch.device, D: int, F: int, layer_name: str, precision: str) -> None:
    """Raise :class:`MegaMoEConfigError` if ``precision`` (fp8 / fp8_bwd) cannot run here.

    Checks: a CUDA device of compute capability >= 8.9 (FP8 tensor cores; CPU is accepted: the
    Triton interpreter, tests only), and D, F multiples of 128 (the scale block).
    """
    if D % 128 or F % 128:
        raise MegaMoEConfigError(
            f"{layer_name}: [megamoe] precision = '{precision}' needs the model dim and the MoE hidden dim to "
            f"be multiples of 128 (blockwise FP8 scales 128-channel groups); got dim={D}, moe hidden dim={F}. "
            "Set [megamoe] precision = 'bf16' for this model.")
    if device.type == "cuda":
        cap = torch.cuda.get_device_capability(device)
        if tuple(cap) < MIN_FP8_CAPABILITY:
            name = torch.cuda.get_device_name(device)
            raise MegaMoEConfigError(
                f"{layer_name}: [megamoe] precision = '{precision}' needs a GPU with FP8 tensor cores (compute "
                f"capability >= 8.9: Ada, Hopper or newer); {name} is sm_{cap[0]}{cap[1]}. Set [megamoe] "
                "precision = 'bf16'.")


# --------------------------------------------------------------------------------------------------
# Non-finite monitor
# --------------------------------------------------------------------------------------------------


class NonfiniteMonitor:
    """Pending (name, device count) records of non-finite FP8 scale groups, checked lazily."""

    def __init__(self) -> None:
        self._pending: list[tuple[str, Tensor, object]] = []

    def record(self, name: str, count: Tensor) -> None:
        """Queue the check of a (1,) int32 device counter (no wait)."""
        if count.is_cuda:
            if torch.cuda.is_current_stream_capturing():
                return  # inside a CUDA graph no host copy can be queued; the eager warm-up checked
            host = torch.empty(1, dtype=torch.int32, pin_memory=True)
            host.copy_(count, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host, event = count, None
        self._pending.append((name, host, event))

    def check(self, wait: bool = False) -> None:
        """Raise for the first landed nonzero record; keep the ones not landed yet.

        Raises:
            NonFiniteError: naming the layer / tensor and the number of bad groups.
        """
        from titan_megamoe.errors import NonFiniteError
        from titan_megamoe.ops.fp8_reference import nonfinite_message

        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return  # cudaEventQuery is not permitted while a CUDA graph is being captured (as CapacityMonitor)
        keep = []
        for name, host, event in self._pending:
            if event is not None and not wait and not event.query():
                keep.append((name, host, event))
                continue
            if event is not None:
                event.synchronize()  # landed already (query) or wait=True
            n = int(host[0])
            if n:
                self._pending = []
                raise NonFiniteError(nonfinite_message(name, n, where=" (FP8 path, found after the call)"))
        self._pending = keep

    def flush(self) -> None:
        """Wait for every pending record and check it."""
        self.check(wait=True)


#: Pending non-finite checks of this process (module docstring).
NONFINITE = NonfiniteMonitor()


# --------------------------------------------------------------------------------------------------
# Weight cache
# --------------------------------------------------------------------------------------------------


def quantize_weights(w: Tensor, *, transposed: bool, forward: bool, count: Tensor | None, name: str):
    """128x128 quantization of one (E, N, Kd) expert weight.

    Returns (q, s, qT, sT): q (E, N, Kd) e4m3 + s (E, N/128, Kd/128) fp32 when ``forward``, else None;
    qT (E, Kd, N) e4m3 + sT (E, Kd/128, N/128) when ``transposed``, else None. The transposed copy is
    the transpose of q (a 128x128 block's amax does not depend on the orientation, so it equals the
    quantization of w.transpose(1, 2) bitwise), stored transposed by the quantizing kernel itself
    (``fp8_quant.quantize_weight_128x128_t``): the K-major B operand of the dgrad.
    """
    from titan_megamoe.kernels.fp8_quant import quantize_weight_128x128, quantize_weight_128x128_t

    if transposed and FP8_WEIGHT_T_KERNEL:
        return quantize_weight_128x128_t(w.contiguous(), forward=forward, nonfinite_count=count, name=name)
    q, s = quantize_weight_128x128(w.contiguous(), nonfinite_count=count, name=name)
    qT = sT = None
    if transposed:
        qT, sT = q.transpose(1, 2).contiguous(), s.transpose(1, 2).contiguous()
    return (q, s, qT, sT) if forward else (None, None, qT, sT)


class Fp8WeightCache:
    """FP8 copies of one layer's expert weights, recomputed only when a weight changed.

    Key per weight: ``(data_ptr, _version, shape, stride, dtype, device)`` of the tensor handed to
    ``mega_moe`` (the parameter itself, before any dtype cast: a fresh cast would have a fresh
    version counter and possibly a recycled address). The optimizer's in-place update bumps
    ``_version``, so the first forward after each step re-quantizes and every later call of that step
    (forward, recomputation under activation checkpointing) hits. Writes that bypass the version
    counter (``p.data.copy_(...)``, a checkpoint load into ``.data``) are not seen:
    ``MegaMoEConverter.post_optimizer_hook`` calls :meth:`invalidate` after every step as well, and
    code that rewrites weights outside the optimizer should too. Under FSDP the unsharded weight is
    re-gathered every forward (a new version or address): the cache then re-quantizes each forward
    (correct, not faster) while keeping one FP8 copy per layer alive: memory E*F*D*3 bytes per copy.

    Memory: precision "fp8" keeps the forward copy and the transposed copy (2 x 3 x E*F*D bytes per
    layer, 1.2 GB at the Qwen3-30B-A3B layer shape); "fp8_bwd" only the transposed one.
    """

    def __init__(self) -> None:
        self._entries: dict[str, tuple[tuple, tuple]] = {}
        self.hits = 0
        self.misses = 0

    @staticmethod
    def key(w: Tensor) -> tuple:
        return (w.data_ptr(), w._version, tuple(w.shape), tuple(w.stride()), w.dtype, w.device)

    def get(self, name: str, w: Tensor, *, forward: bool, new_count: Callable[[], Tensor] | None = None) -> tuple:
        """(q, s, qT, sT) of ``w`` (see :func:`quantize_weights`); recomputed on a key change. ``new_count``: called
        on a miss for the (1,) int32 non-finite counter of that quantization (a hit quantizes nothing, needs none)."""
        key = self.key(w)
        ent = self._entries.get(name)
        if ent is not None and ent[0] == key and (ent[1][0] is not None or not forward):
            self.hits += 1
            return ent[1]
        self.misses += 1
        count = None if new_count is None else new_count()
        val = quantize_weights(w.detach(), transposed=True, forward=forward, count=count, name=name)
        self._entries[name] = (key, val)
        return val

    def invalidate(self) -> None:
        """Drop every cached copy (after an optimizer step, a weight load)."""
        self._entries.clear()


def prepare_weights_eager(w1: Tensor, w2: Tensor, w3: Tensor, *, fp8_forward: bool, cache: Fp8WeightCache | None,
                          layer_name: str) -> list[Tensor]:
    """The op's weight operand list: [w1t_q, w1t_s, w3t_q, w3t_s, w2t_q, w2t_s] (+ [w1_q, w1_s, w3_q,
    w3_s, w2_q, w2_s] when ``fp8_forward``), from the cache when given (else quantized now).

    For callers that never run under torch.compile (the fused eager node, ``ops/eager_layer_fp8.py``); others call
    :func:`prepare_weights`, the same function kept out of tracing, whose wrapper costs host time on every call
    (~5 us on the CPU machine) before GEMM1 is enqueued."""
    dev = w1.device
    counter: list[Tensor] = []  # made on the first quantization: a call served by the cache launches nothing

    def new_count() -> Tensor:
        if not counter:
            counter.append(torch.zeros(1, dtype=torch.int32, device=dev))
        return counter[0]

    out_bwd, out_fwd = [], []
    for nm, w in (("w1", w1), ("w3", w3), ("w2", w2)):
        name = f"{layer_name}.{nm}"
        if cache is not None:
            q, s, qT, sT = cache.get(name, w, forward=fp8_forward, new_count=new_count)
        else:
            q, s, qT, sT = quantize_weights(w.detach(), transposed=True, forward=fp8_forward, count=new_count(),
                                            name=name)
        out_bwd += [qT, sT]
        if fp8_forward:
            out_fwd += [q, s]
    if counter:
        NONFINITE.record(f"{layer_name} expert weights", counter[0])
    return out_bwd + out_fwd


#: :func:`prepare_weights_eager` kept out of torch.compile's tracing: it reads ``_version`` / ``data_ptr`` and
#: launches Triton directly.
prepare_weights = torch.compiler.disable(prepare_weights_eager)


# --------------------------------------------------------------------------------------------------
# Forward and backward
# --------------------------------------------------------------------------------------------------


def _no_mark(label: str) -> None:
    pass


def _interp() -> bool:
    from titan_megamoe.kernels.grouped_gemm import interpret_mode

    return interpret_mode()


def _live_rows(layout: RoutingLayout) -> Tensor:
    """(N_cap,) int32: the row itself where it holds a pair, -1 elsewhere (gather index of the h quant)."""
    rows = torch.arange(layout.n_cap, dtype=torch.int32, device=layout.row_pair.device)
    return torch.where(layout.row_pair >= 0, rows, -1)


def placed_token_rows(layout: RoutingLayout) -> Tensor:
    """(T',) int32: row t of the token-row source where at least one slot of t is placed in ``layout``,
    -1 elsewhere (T' = layout's pairs / top_k).

    The gather index of the 1x128 quantization of a token-row source that may hold rows nobody wrote:
    the expert-parallel receive slab (rows of tokens routed elsewhere keep another call's data, or the
    0xFF poison, a NaN in bf16). Quantizing such a row would count a non-finite group and raise a false
    ``NonFiniteError``; with this index it becomes a zero row, never read by the GEMMs. Device ops, no
    host sync.
    """
    K = layout.top_k
    placed = (layout.pair_row.view(-1, K) >= 0).any(1)
    rows = torch.arange(placed.shape[0], dtype=torch.int32, device=placed.device)
    return torch.where(placed, rows, -1)


def fp8_experts_fwd(x_rows: Tensor | None, scores: Tensor, layout: RoutingLayout, w1: Tensor, w2: Tensor, w3: Tensor,
                    wq: list[Tensor], fp8_forward: bool, layer_name: str, *, by_row: bool = False,
                    x_rows_index: Tensor | None = None, x_quantized: tuple[Tensor, Tensor] | None = None,
                    mark: Callable[[str], None] = _no_mark) -> tuple[Tensor, Tensor]:
    """Local expert compute of the forward on the rows of ``layout``: GEMM1 (+ SwiGLU) and GEMM2 (+ score),
    FP8 ("fp8") or bf16 ("fp8_bwd": ``fp8_forward`` False). Shared by EP = 1 (:func:`fp8_fwd`) and the
    expert-parallel path (``ops/ep_fp8_backend.py``, on the receive slab).

    Args:
        x_rows: (T', D) bf16 token rows the layout's pairs point into (pair p reads row p // K): the
            layer input at EP = 1, the receive slab (R * T_cap rows) under expert parallelism.
        scores: (T', K) fp32, the routing score of each pair (same row order).
        layout: routing layout of the T' * K pairs with ``block_m == FP8_BLOCK_M`` (128, also in the
            interpreter: the backward's 128-row scale groups must not straddle two experts).
        w1, w3: (E, F, D), w2: (E, D, F) weights of the layout's experts (any float dtype; read only
            by the bf16 forward); wq: from :func:`prepare_weights` (the forward copies when ``fp8_forward``).
        fp8_forward: True for precision "fp8", False for "fp8_bwd" (the bf16 kernels, BM = 128).
        layer_name: named in non-finite reports.
        by_row: GEMM2 stores row r of the layout at row r of an (N_cap, D) output (the EP combine reads
            them) instead of the pair's row of a (P, D) output.
        x_rows_index: optional (T',) int32 gather index of the 1x128 quantization of x (``fp8``): row t
            is quantized from x_rows[x_rows_index[t]], a zero row where it is -1
            (:func:`placed_token_rows` for the EP slab, whose unplaced rows may hold anything). None:
            every row of x_rows is quantized.
        x_quantized: optional (xq (T', D) float8_e4m3fn, xs (T', D // 128) fp32), contiguous: x already
            quantized 1x128 in the row order of ``scores`` ("fp8" only; the EP FP8 payload, received
            in the workspace's xq / xs slab, ``ep_comm.dispatch_push_fp8``). GEMM1 reads them as they
            are (only the rows of placed pairs: the others may hold anything) and the x quantization
            is skipped (no ``quant_x`` mark); ``x_rows`` and ``x_rows_index`` are then not read (x_rows
            may be None). Bitwise the same results as quantizing the bf16 rows here.
        mark: called on the host after each pass is launched, with ``quant_x, gemm1, gemm2`` ("fp8";
            ``quant_h`` after gemm1 when ``FUSE_H_QUANT`` is off or the Gluon GEMM1 ran (``WS_GEMM1_FP8``); no ``quant_x`` with ``x_quantized``) or
            ``gemm1, gemm2`` ("fp8_bwd"): the per-phase CUDA events of ``compare/ep_overlap.py``.
            Default: nothing (no effect on results).

    Returns:
        (y, gate_up): y (P, D) bf16 by pair (P = T' * K), or (N_cap, D) bf16 by layout row with
        ``by_row`` (padding rows unwritten); gate_up (N_cap, 2F) bf16, saved for the backward.

    Raises:
        ValueError: ``x_quantized`` with ``fp8_forward`` False; from the kernels' launchers (shapes,
            dtypes, a layout with another block_m).

    Host syncs: none. Non-finite x / h scales are counted on the device and reported lazily
    (:data:`NONFINITE`; with ``x_quantized``, x's groups were counted where they were quantized).
    """
    from titan_megamoe.kernels.configs import config_for
    from titan_megamoe.kernels.fp8_quant import quantize_act_1x128
    from titan_megamoe.kernels.grouped_gemm import gemm1_swiglu_fwd, gemm2_scatter_fwd
    from titan_megamoe.kernels.grouped_gemm_fp8 import (
        HOPPER_GEMM1_FP8_QH,
        fp8_config_for,
        gemm1_swiglu_fwd_fp8,
        gemm2_scatter_fwd_fp8,
    )
    from titan_megamoe.kernels import ws_gemm_fp8
    from titan_megamoe.kernels.ws_gemm_fp8 import (FP8_FWD_CONFIG, FP8_FWD_WIDE_CONFIG, ws_gemm1_fwd_fp8,
                                                   ws_gemm1_fwd_fp8_supported)

    E, F, D = w1.shape
    interp = _interp()
    bm = dict(block_m=FP8_BLOCK_M)
    if interp:  # the interpreter pays per program and per K step: 128-wide blocks (D, F multiples of 128)
        bm.update(block_n=128, block_k=128)
    scores = scores.contiguous()
    if x_quantized is not None and not fp8_forward:
        raise ValueError(f"{layer_name}: x_quantized is for the FP8 forward (precision 'fp8') only")
    if fp8_forward:
        w1q, w1s, w3q, w3s, w2q, w2s = wq[6:12]
        count = torch.zeros(1, dtype=torch.int32, device=scores.device)
        if x_quantized is not None:  # quantized where it was dispatched (EP FP8 payload)
            xq, xs = x_quantized
        elif x_rows_index is None:
            xq, xs = quantize_act_1x128(x_rows.contiguous(), nonfinite_count=count, name=f"{layer_name} x")
        else:
            xq, xs = quantize_act_1x128(x_rows.contiguous(), x_rows_index, 1, nonfinite_count=count,
                                        name=f"{layer_name} x")
        if x_quantized is None:
            mark("quant_x")
        if WS_GEMM1_FP8 and not interp and ws_gemm1_fwd_fp8_supported(xq, w1q) is None:
            g1_cfg = FP8_FWD_WIDE_CONFIG if FP8_FWD_WIDE else FP8_FWD_CONFIG
            if FP8_GEMM1_QUANT_H:
                gate_up, hq, hs = ws_gemm1_fwd_fp8(xq, xs, w1q, w1s, w3q, w3s, layout, cfg=FP8_FWD_WIDE_CONFIG,
                                                   quantize_h=True, nonfinite_count=count)
                mark("gemm1")
            else:
                gate_up, h = ws_gemm1_fwd_fp8(xq, xs, w1q, w1s, w3q, w3s, layout, cfg=g1_cfg)
                mark("gemm1")
                hq, hs = quantize_act_1x128(h, row_valid=layout.row_pair, nonfinite_count=count,
                                            name=f"{layer_name} h")
                mark("quant_h")
        elif FUSE_H_QUANT:  # h quantized 1x128 in GEMM1's epilogue (BN = 128, 16 warps on Hopper)
            c1 = HOPPER_GEMM1_FP8_QH if not interp else dataclasses.replace(fp8_config_for("gemm1", D, F, interp), **bm)
            gate_up, hq, hs = gemm1_swiglu_fwd_fp8(xq, xs, w1q, w1s, w3q, w3s, layout, config=c1, quantize_h=True,
                                                   nonfinite_count=count)
            mark("gemm1")
        else:  # bf16 h, then a 1x128 pass over the live rows
            c1 = dataclasses.replace(fp8_config_for("gemm1", D, F, interp), **bm)
            gate_up, h = gemm1_swiglu_fwd_fp8(xq, xs, w1q, w1s, w3q, w3s, layout, config=c1)
            mark("gemm1")
            hq, hs = quantize_act_1x128(h, row_valid=layout.row_pair, nonfinite_count=count, name=f"{layer_name} h")
            mark("quant_h")
        if (WS_GEMM2_FP8 and not interp and not by_row
                and ws_gemm_fp8.ws_gemm2_fwd_fp8_supported(hq, w2q) is None):
            y = ws_gemm_fp8.ws_gemm2_fwd_fp8(hq, hs, w2q, w2s, scores, layout, cfg=_gemm2_fp8_config(D))
        else:
            c2 = dataclasses.replace(fp8_config_for("gemm2", D, F, interp), **bm)
            y = gemm2_scatter_fwd_fp8(hq, hs, w2q, w2s, scores, layout, by_row=by_row, config=c2)
        mark("gemm2")
        NONFINITE.record(f"{layer_name} forward activations", count)
    else:
        bf = torch.bfloat16
        # Off the interpreter the default config already has BM 128; passing none lets GEMM1 take the Gluon
        # kernel of the bf16 path (bitwise the Triton kernel's output), which an explicit config turns off.
        c1 = dataclasses.replace(config_for("gemm1", D, F, interp), **bm) if interp else None
        gate_up, h = gemm1_swiglu_fwd(x_rows.contiguous(), w1.to(bf).contiguous(), w3.to(bf).contiguous(), layout,
                                      config=c1)
        mark("gemm1")  # includes the bf16 casts of w1 / w3 (no-ops for bf16 weights)
        c2 = dataclasses.replace(config_for("gemm2", D, F, interp), **bm)
        y = gemm2_scatter_fwd(h, w2.to(bf).contiguous(), scores, layout, config=c2, by_row=by_row)
        mark("gemm2")
    return y, gate_up


def fp8_fwd(x_TD: Tensor, topk_ids_TK: Tensor, topk_scores_TK: Tensor, w1: Tensor, w2: Tensor, w3: Tensor,
            wq: list[Tensor], fp8_forward: bool, layer_name: str, *, one_allocation: bool = False):
    """Forward at EP = 1: returns (out (T, D) bf16, gate_up (N_cap, 2F) bf16, layout). ``wq`` from
    :func:`prepare_weights`; w1..w3 (any float dtype) are read only by the bf16 forward (fp8_bwd).
    Routing layout (BM = 128) -> :func:`fp8_experts_fwd` -> fp32 top-k sum. ``one_allocation``: the layout's arrays
    as views of one allocation (``routing.build_routing_layout``; not for a custom op's outputs).

    Raises:
        NonFiniteError: an earlier call's FP8 scales held inf / nan (:data:`NONFINITE`, checked first)."""
    from titan_megamoe.kernels.grouped_gemm import combine_topk

    NONFINITE.check()  # records of earlier calls that have landed (no wait)
    T, K = topk_ids_TK.shape
    layout = build_routing_layout(topk_ids_TK, w1.shape[0], FP8_BLOCK_M, one_allocation=one_allocation)
    y, gate_up = fp8_experts_fwd(x_TD, topk_scores_TK, layout, w1, w2, w3, wq, fp8_forward, layer_name)
    return combine_topk(y, T, K), gate_up, layout


def fp8_fwd_unchecked_ok(x_TD: Tensor, wq: list[Tensor]) -> bool:
    """Whether :func:`fp8_fwd_unchecked` applies to x (T, D) and the FP8 weights ``wq`` (:func:`prepare_weights_eager`
    with ``fp8_forward``): the Gluon FP8 GEMM1 and GEMM2 are on and can take them (sm_90, D and F multiples of 128),
    off the interpreter. Otherwise :func:`fp8_fwd`."""
    from titan_megamoe.kernels import ws_gemm_fp8

    return (WS_GEMM1_FP8 and WS_GEMM2_FP8 and not _interp()
            and ws_gemm_fp8.ws_gemm1_fwd_fp8_supported(x_TD, wq[6]) is None
            and ws_gemm_fp8.ws_gemm2_fwd_fp8_supported(x_TD, wq[10]) is None)


def fp8_fwd_unchecked(x_TD: Tensor, topk_ids_TK: Tensor, topk_scores_TK: Tensor, wq: list[Tensor],
                      layer_name: str):
    """The "fp8" forward at EP = 1 (:func:`fp8_fwd` with ``fp8_forward=True``) through the kernels' launch halves,
    which skip the per-kernel checks, for a caller that has made them (``ops/eager_layer_fp8.py``, after
    ``layer.MegaMoE._fused_layer_operands`` and :func:`fp8_fwd_unchecked_ok`): x (T, D) bf16 contiguous, ids (T, K)
    int64 in [0, E) and scores (T, K) fp32 contiguous as the fused router writes them, ``wq`` from
    :func:`prepare_weights_eager`. Same launches and results as :func:`fp8_fwd`; the earlier calls' non-finite
    records are checked after the launches (before this call's is queued), so the host reaches GEMM1 sooner: the
    from-idle FP8 forward waits on the host until then (docs/NOTES.md, session 34).

    Returns (out (T, D) bf16, gate_up (N_cap, 2F) bf16, layout).

    Raises:
        NonFiniteError: an earlier call's FP8 scales held inf / nan (:data:`NONFINITE`).
    """
    from titan_megamoe.kernels.fp8_quant import launch_quant_act_1x128
    from titan_megamoe.kernels.grouped_gemm import launch_combine_topk
    from titan_megamoe.kernels.ws_gemm_fp8 import (FP8_FWD_CONFIG, FP8_FWD_WIDE_CONFIG, launch_gemm1_fwd_fp8,
                                                   launch_gemm2_fwd_fp8)

    w1q, w1s, w3q, w3s, w2q, w2s = wq[6:12]
    T, K = topk_ids_TK.shape
    E, F, D = w1q.shape
    dev = x_TD.device
    layout = build_routing_layout(topk_ids_TK, E, FP8_BLOCK_M, one_allocation=True)
    count = torch.zeros(1, dtype=torch.int32, device=dev)
    xq, xs = launch_quant_act_1x128(x_TD, count)
    gate_up = torch.empty((layout.n_cap, 2 * F), dtype=torch.bfloat16, device=dev)
    y = torch.empty((T * K, D), dtype=torch.bfloat16, device=dev)
    if layout.n_tiles_cap:
        if FP8_GEMM1_QUANT_H:
            hq = torch.empty((layout.n_cap, F), dtype=torch.float8_e4m3fn, device=dev)
            hs = torch.empty((layout.n_cap, F // 128), dtype=torch.float32, device=dev)
            launch_gemm1_fwd_fp8(xq, xs, w1q, w1s, w3q, w3s, layout, gate_up, hq, FP8_FWD_WIDE_CONFIG, None, hs, count)
        else:
            h = torch.empty((layout.n_cap, F), dtype=torch.bfloat16, device=dev)
            launch_gemm1_fwd_fp8(xq, xs, w1q, w1s, w3q, w3s, layout, gate_up, h,
                                 FP8_FWD_WIDE_CONFIG if FP8_FWD_WIDE else FP8_FWD_CONFIG)
            hq, hs = launch_quant_act_1x128(h, count, row_valid=layout.row_pair)
        if T * K:
            launch_gemm2_fwd_fp8(hq, hs, w2q, w2s, topk_scores_TK, layout, y, _gemm2_fp8_config(D))
    out = launch_combine_topk(y, T, K)
    NONFINITE.check()  # the earlier calls' records that have landed (this call's is not queued yet)
    NONFINITE.record(f"{layer_name} forward activations", count)
    return out, gate_up, layout


def fp8_experts_bwd(dout_rows: Tensor, x_rows: Tensor, scores: Tensor, wq_bwd: list[Tensor], gate_up: Tensor,
                    layout: RoutingLayout, w_dtype: torch.dtype, layer_name: str, *,
                    dout_rows_index: Tensor | None = None,
                    mark: Callable[[str], None] = _no_mark) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Local expert compute of the FP8 backward on the rows of ``layout`` (both precisions): GEMM2 dgrad +
    SwiGLU backward + d score partials, the three wgrads, GEMM1 dgrad. Shared by EP = 1
    (:func:`fp8_bwd`) and the expert-parallel path (``ops/ep_fp8_backend.py``, on the receive slab).

    Args:
        dout_rows: (T', D) bf16 output gradient, token rows in the order of ``x_rows`` (pair p reads row
            p // K): dout at EP = 1, the dy slab under expert parallelism.
        x_rows: (T', D) bf16 layer input rows (the forward's ``x_rows``).
        scores: (T', K) fp32 routing scores.
        wq_bwd: the transposed FP8 weights [w1t_q, w1t_s, w3t_q, w3t_s, w2t_q, w2t_s] (:func:`prepare_weights`).
        gate_up: (N_cap, 2F) bf16 saved by the forward; layout: its routing layout (BM = 128).
        w_dtype: dtype of dw1..dw3, bf16 or fp32 (fp32 master weights).
        layer_name: named in non-finite reports.
        dout_rows_index: optional (T',) int32 gather index of dout's 1x128 quantization (as
            ``x_rows_index`` of :func:`fp8_experts_fwd`; :func:`placed_token_rows` for the EP slab).
        mark: called on the host after each pass is launched, with ``quant_dout, gemm2_dgrad,
            quant_dgate_up, quant_dout_T, wgrad_w2, quant_x_T, wgrad_w13, gemm1_dgrad`` (the bf16 wgrad
            diagnosis ``_WGRAD == "bf16"``: ``wgrad_w2, wgrad_w13`` without the two transposed quants).
            Default: nothing (no effect on results).

    Returns:
        (dx_rows (N_cap, D) bf16 in layout-row order, zeros on padding rows; dscore_part (N_cap, NB) fp32
        per-column-block partials of d score (``reduce_dscore`` / ``ep_comm.dscore_push`` sum them in
        ascending order); dw1 (E, F, D), dw2 (E, D, F), dw3 (E, F, D) in ``w_dtype``, exact zeros for
        experts without rows).

    Raises:
        ValueError: ``_WGRAD`` (TITAN_MEGAMOE_FP8_WGRAD) not one of its choices; the launchers' checks.

    Host syncs: none (non-finite groups counted on the device, :data:`NONFINITE`).
    """
    from titan_megamoe.kernels.fp8_quant import quantize_act_1x128
    from titan_megamoe.kernels.fp8_quant_bwd import quantize_dual_1x128_128x1_t, quantize_gather_128x1_t
    from titan_megamoe.kernels.grouped_gemm_fp8_bwd import fp8_bwd_config_for

    w1tq, w1ts, w3tq, w3ts, w2tq, w2ts = wq_bwd[:6]
    K = layout.top_k
    F = gate_up.shape[1] // 2
    count = torch.zeros(1, dtype=torch.int32, device=dout_rows.device)
    dout = dout_rows.contiguous()
    if dout_rows_index is None:
        dq, ds = quantize_act_1x128(dout, nonfinite_count=count, name=f"{layer_name} dout")
    else:
        dq, ds = quantize_act_1x128(dout, dout_rows_index, 1, nonfinite_count=count, name=f"{layer_name} dout")
    mark("quant_dout")
    if _WGRAD not in _WGRAD_CHOICES:
        raise ValueError(f"TITAN_MEGAMOE_FP8_WGRAD / fp8_backend._WGRAD={_WGRAD!r}: choose one of {_WGRAD_CHOICES}")
    # the GPU's config; in the interpreter with the GPU's BN (its default, 64, is for the kernel tests): the d
    # score partials then come in the GPU's column groups
    c2 = fp8_bwd_config_for("gemm2_dgrad", dout.shape[1], F, False)
    if _interp():
        c2 = dataclasses.replace(fp8_bwd_config_for("gemm2_dgrad", dout.shape[1], F, True), block_n=c2.block_n)
    end = layout.offsets[-1:]  # rows past the last expert's segment: read by no FP8 GEMM
    # bf16 wgrads: the dgrad stores s * h as bf16 rows for the bf16 dw2 instead of quantizing it transposed
    hs = torch.empty((gate_up.shape[0], F), dtype=torch.bfloat16, device=gate_up.device) if _WGRAD == "bf16" else None
    dgu, part, hsT, hsTs = _gemm2_dgrad_fp8(dq, ds, w2tq, w2ts, gate_up, scores.contiguous(), layout, c2, count, hs)
    mark("gemm2_dgrad")
    dguq, dgus, dguTq, dguTs = quantize_dual_1x128_128x1_t(dgu, layout.row_pair >= 0, nonfinite_count=count,
                                                           end_row=end, name=f"{layer_name} dgate_up")
    mark("quant_dgate_up")
    if _WGRAD == "bf16":  # the bf16 wgrads (torchao's "rowwise_with_gw_hp" idea): on sm_90 the Gluon K-grouped
        # kernels of the bf16 path, fed the dgrad's bf16 s * h rows
        from titan_megamoe.kernels._bwd_common import default_bwd_config
        from titan_megamoe.kernels.grouped_gemm_wgrad import wgrad_w2, wgrad_w13

        bf, D = torch.bfloat16, dout.shape[1]
        cfg = {"wgrad_w2": None, "wgrad_w13": None}  # None: wgrad_impl picks (gluon on sm_90 for bf16 grads)
        if _interp():  # 16-wide interpreter defaults take minutes; D, F are multiples of 128 here
            cfg = {k: dataclasses.replace(default_bwd_config(k, layout, D, F), block_m=128, block_n=128, block_k=128)
                   for k in cfg}
        dw2 = wgrad_w2(dout.to(bf), gate_up, scores.contiguous(), layout, cfg["wgrad_w2"], hs_NF=hs, out_dtype=w_dtype)
        del hs  # N_cap x F bf16 back to the allocator before wgrad_w13
        mark("wgrad_w2")
        dw1, dw3 = wgrad_w13(dgu, x_rows.to(bf).contiguous(), layout, cfg["wgrad_w13"], out_dtype=w_dtype)
        mark("wgrad_w13")
    else:
        acc = 32 if _WGRAD == "fp8_acc32" else None
        doTq, doTs = quantize_gather_128x1_t(dout, layout.row_pair, K, name=f"{layer_name} dout",
                                             end_row=end)  # counted above
        mark("quant_dout_T")
        (dw2,) = _wgrad_fp8(doTq, doTs, hsT, hsTs, layout, None, w_dtype, acc)
        mark("wgrad_w2")
        xTq, xTs = quantize_gather_128x1_t(x_rows.contiguous(), layout.row_pair, K, nonfinite_count=count,
                                           end_row=end, name=f"{layer_name} x")
        mark("quant_x_T")
        dw1, dw3 = _wgrad_fp8(dguTq, dguTs, xTq, xTs, layout, F, w_dtype, acc)
        mark("wgrad_w13")
    dx_rows = _gemm1_dgrad_fp8_rows(dguq, dgus, w1tq, w1ts, w3tq, w3ts, layout)
    mark("gemm1_dgrad")
    NONFINITE.record(f"{layer_name} backward", count)
    return dx_rows, part, dw1, dw2, dw3


def _wgrad_fp8(aTq: Tensor, aTs: Tensor, bTq: Tensor, bTs: Tensor, layout: RoutingLayout, split: int | None,
               w_dtype: torch.dtype, acc: int | None) -> tuple[Tensor, ...]:
    """An FP8 weight gradient (``grouped_gemm_fp8_bwd.wgrad_fp8``'s contract): by the Gluon kernel where
    ``WS_WGRAD_FP8`` is on and the case allows it (``ws_wgrad_fp8.ws_wgrad_fp8_supported``; not with the
    ``fp8_acc32`` diagnosis), else by the Triton kernel."""
    from titan_megamoe.kernels import grouped_gemm_fp8_bwd, ws_wgrad_fp8

    if (WS_WGRAD_FP8 and acc is None and not _interp()
            and ws_wgrad_fp8.ws_wgrad_fp8_supported(aTq, aTq.shape[0], bTq.shape[0], split, layout) is None):
        return ws_wgrad_fp8.ws_wgrad_fp8(aTq, aTs, bTq, bTs, layout, split=split, out_dtype=w_dtype)
    return grouped_gemm_fp8_bwd.wgrad_fp8(aTq, aTs, bTq, bTs, layout, split=split, out_dtype=w_dtype,
                                          _max_imprecise_acc=acc)


def _gemm2_dgrad_fp8(dq: Tensor, ds: Tensor, w2tq: Tensor, w2ts: Tensor, gate_up: Tensor, scores: Tensor,
                     layout: RoutingLayout, cfg, count: Tensor, hs: Tensor | None) -> tuple:
    """The FP8 GEMM2 dgrad (``grouped_gemm_fp8_bwd.gemm2_dgrad_swiglu_bwd_fp8``'s contract): by the Gluon kernel where
    ``WS_GEMM2_DGRAD_FP8`` asks for it ("auto", "1" cooperative, "pingpong") and the case allows it
    (``ws_gemm2_dgrad_fp8.ws_gemm2_dgrad_fp8_supported``: not with ``hs_out``), else by the Triton kernel with ``cfg``."""
    from titan_megamoe.kernels import grouped_gemm_fp8_bwd, ws_gemm2_dgrad_fp8 as W

    if WS_GEMM2_DGRAD_FP8 != "0" and not _interp():
        pingpong = WS_GEMM2_DGRAD_FP8 == "pingpong" or (WS_GEMM2_DGRAD_FP8 == "auto"
                                                         and dq.shape[1] < GEMM2_DGRAD_FP8_COOP_DIM)
        g_cfg = W.GEMM2_DGRAD_FP8_PINGPONG if pingpong else W.GEMM2_DGRAD_FP8_CONFIG
        if W.ws_gemm2_dgrad_fp8_supported(dq, w2tq, hs, g_cfg) is None:
            return W.ws_gemm2_dgrad_fp8(dq, ds, w2tq, w2ts, gate_up, scores, layout, nonfinite_count=count, cfg=g_cfg)
    return grouped_gemm_fp8_bwd.gemm2_dgrad_swiglu_bwd_fp8(dq, ds, w2tq, w2ts, gate_up, scores, layout, cfg,
                                                           nonfinite_count=count, hs_out=hs)


def _gemm1_dgrad_fp8_rows(dguq: Tensor, dgus: Tensor, w1tq: Tensor, w1ts: Tensor, w3tq: Tensor, w3ts: Tensor,
                          layout: RoutingLayout) -> Tensor:
    """The FP8 GEMM1 dgrad's (N_cap, D) bf16 dx rows: by the Gluon kernel where ``WS_GEMM1_DGRAD_FP8`` is on and the
    case allows it (``ws_gemm_fp8.ws_gemm1_dgrad_fp8_supported``), else by the Triton kernel; the same result."""
    from titan_megamoe.kernels import grouped_gemm_fp8_bwd, ws_gemm_fp8

    if WS_GEMM1_DGRAD_FP8 and not _interp() and ws_gemm_fp8.ws_gemm1_dgrad_fp8_supported(dguq, w1tq) is None:
        wide = FP8_DGRAD_WIDE and w1tq.shape[1] % 256 == 0  # D: the wide tiles take 256 columns
        cfg = ws_gemm_fp8.DGRAD_FP8_WIDE_CONFIG if wide else ws_gemm_fp8.DGRAD_FP8_CONFIG
        return ws_gemm_fp8.ws_gemm1_dgrad_fp8(dguq, dgus, w1tq, w1ts, w3tq, w3ts, layout, cfg=cfg)
    return grouped_gemm_fp8_bwd.gemm1_dgrad_fp8(dguq, dgus, w1tq, w1ts, w3tq, w3ts, layout)


def _gemm2_fp8_config(D: int):
    """The Gluon FP8 GEMM2's config: the wide tiles where ``FP8_GEMM2_WIDE`` is on and D % 256 == 0, else the default."""
    from titan_megamoe.kernels import ws_gemm_fp8

    return ws_gemm_fp8.GEMM2_FP8_WIDE_CONFIG if FP8_GEMM2_WIDE and D % 256 == 0 else ws_gemm_fp8.GEMM2_FP8_CONFIG


def fp8_bwd(dout_TD: Tensor, x_TD: Tensor, topk_scores_TK: Tensor, wq_bwd: list[Tensor], gate_up: Tensor,
            layout: RoutingLayout, w_dtype: torch.dtype, layer_name: str):
    """FP8 backward at EP = 1: returns (dx (T, D) bf16, dscores (T, K) fp32, dw1, dw2, dw3 in ``w_dtype``
    (bf16 or fp32)). :func:`fp8_experts_bwd`, then the fixed-order d score and per-token dx sums."""
    from titan_megamoe.kernels.grouped_gemm_bwd import reduce_dscore, scatter_dx

    T, K = topk_scores_TK.shape
    dx_rows, part, dw1, dw2, dw3 = fp8_experts_bwd(dout_TD, x_TD, topk_scores_TK, wq_bwd, gate_up, layout, w_dtype,
                                                   layer_name)
    dscores = reduce_dscore(part, layout, T, K)
    dx = scatter_dx(dx_rows, layout, T, K)
    return dx, dscores, dw1, dw2, dw3
