"""FP8 quantizers of the backward's operands (DeepSeek-V3 recipe, arXiv 2412.19437, section 3.3):
one fused pass per operand that reads the bf16 source once and writes e4m3 values + fp32 scales
straight in the layout the FP8 backward GEMMs read (no bf16 gathered copy, no transpose pass).

Shape legend:
    T   tokens      D   model dim      F   expert hidden dim      K   top_k
    N_cap  rows of the padded expert-major layout (``routing.py``), a multiple of 128 here
    C   columns of the quantized tensor      G = 128 (group edge)

Why these layouts. The weight gradients reduce over the rows of each expert's segment
(dW[e] = A_e^T B_e), so both operands are scaled per (128 consecutive rows, column) ("128x1",
the transposed activation scaling of DeepSeek-V3), and Hopper's FP8 wgmma wants both operands
K-major, i.e. contiguous along the rows: the 128x1 operands are stored *transposed*, (C, N_cap).
Scale groups must not straddle two experts: the FP8 path builds its routing layout with BM = 128
(``ops/fp8_backend.py``), so every expert segment starts on a multiple of 128 and the global
128-row groups are per-expert groups (the choice "BM = 128 segments"; the alternative,
per-segment group origins with any BM, would need per-expert scale offsets in every kernel).

    quantize_gather_128x1_t(x (T, C), row_index (N_cap,), K)
        -> xT_q (C, N_cap) e4m3, scale (N_cap // 128, C) fp32
        row r of the (virtual) gathered tensor is x[row_index[r] // K] (zero where row_index < 0):
        x for dw1/dw3 and dout for dw2, gathered into layout rows inside the pass.
    quantize_dual_1x128_128x1_t(x (M, C), row_valid (M,))
        -> x_q (M, C) e4m3 + scale (M, C // 128)        (1x128: GEMM1 dgrad's A operand)
           xT_q (C, M) e4m3 + scale (M // 128, C)       (128x1, transposed: dw1/dw3's A operand)
        both from one DRAM read of each 128 x 128 tile (dgate_up; the second pass hits L1 / L2).

Math per group exactly as ``ops/fp8_reference.py`` (amax floored at 1e-12, scale = amax / 448, IEEE
divisions, round to nearest even; the interpreter's inexact fp8 cast is bypassed by EXACT_ROUND as
in ``fp8_quant.py``), so the results equal the reference bitwise:
``quantize_gather_128x1_t == quantize_act_128x1(gathered x).T`` and the dual's two halves equal
``quantize_act_1x128(x)`` and ``quantize_act_128x1(x, row_valid).T`` (invalid rows read as 0).

Leading dimension of the transposed outputs. ``(C, M)`` with row stride exactly M puts every column
of a 128-row group at the same offset modulo M; at EP = 2 M is the receive capacity 2 x T x K
= 2^18, a power of two, and the 128-byte column pieces of one program all land in one DRAM channel
(partition camping: measured 3.99 ms for the dual pass vs 0.80 at EP = 1's M = 9 x 2^14,
``ep_overlap_2xh200_fp8_20261130``). The transposed buffers are therefore allocated ``(C, ld)`` with
``ld = transposed_ld(M)``, an odd multiple of 128 >= M, and returned as the ``(C, M)`` view; every
consumer takes the row stride from the tensor (``wgrad_fp8``).

Kernels. On sm_90 with bf16 input both launchers run the Gluon kernels of ``gl_quant_bwd.py`` (explicit layouts;
by default the persistent load-pipelined ones, ``TITAN_MEGAMOE_FP8_QUANT_PIPE``; the same bits for finite input,
``TITAN_MEGAMOE_FP8_QUANT_GLUON=0`` turns them off); the
Triton kernels below run everywhere else (the CPU interpreter included) and define the results.

Non-finite groups are counted into an optional (1,) int32 device counter (``nonfinite_count``, as
``fp8_quant.py``): no host sync. Dims are constexpr; row counts runtime; offsets int64.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from titan_megamoe.kernels import gl_quant_bwd
from titan_megamoe.kernels.configs import _sm_count
from titan_megamoe.kernels.ws_gemm import _programs
from titan_megamoe.kernels.fp8_quant import (
    _INPUT_DTYPES,
    _amax,
    _check_tensor,
    _count_arg,
    _out_buffer,
    _scale_of,
    _to_e4m3,
)
from titan_megamoe.kernels.grouped_gemm import interpret_mode
from titan_megamoe.kernels.jit import cdiv
from titan_megamoe.kernels.launch import launch
from titan_megamoe.ops.fp8_reference import AMAX_EPS, FP8_DTYPE, GROUP, check_group_dim

__all__ = ["quantize_gather_128x1_t", "quantize_dual_1x128_128x1_t", "transposed_ld", "empty_transposed"]

_T_BLOCK_C = {False: 64, True: 128}  # columns per program of the 128x1 gather pass
# 8 warps: 0.428 vs 0.455 ms at 4 (30B, H100, bitwise; sweep_fp8_bwd_30b_1xh100_s20c_20261206.json)
_WARPS = 8
_DUAL_WARPS = 8  # two 64-column halves (a whole 128 x 128 fp32 tile at once spilled at 8 and 16 warps)
# both passes by the Gluon kernels of gl_quant_bwd.py where they can run (sm_90, bf16 input; the same bits for finite
# input): H100, 30B, dual 0.733 -> 0.557 ms, gathered 0.403 -> 0.351 (bench_quant_bwd_1xh100_s23d_20261206.json);
# TITAN_MEGAMOE_FP8_QUANT_GLUON=0: the Triton kernels everywhere
QUANT_GLUON = os.environ.get("TITAN_MEGAMOE_FP8_QUANT_GLUON", "1") == "1"
# with QUANT_GLUON, the persistent load-pipelined Gluon kernels (gl_quant_bwd.PIPE_CONFIG; the same bits; the gathered
# pass where C is a multiple of 128): H100, 30B, dual 0.557 -> 0.511 ms, gathered 0.351 -> 0.344; 235B 1.261 -> 1.148,
# 0.694 -> 0.676 (bench_quant_bwd_1xh100_s25b_20261206.json); TITAN_MEGAMOE_FP8_QUANT_PIPE=0: the kernels above
QUANT_PIPE = os.environ.get("TITAN_MEGAMOE_FP8_QUANT_PIPE", "1") == "1"
# TITAN_MEGAMOE_FP8_T_LD=exact: row stride M (the layout before the padding; benchmarks compare both)
_ODD_LD = os.environ.get("TITAN_MEGAMOE_FP8_T_LD", "odd") != "exact"


def transposed_ld(m: int) -> int:
    """Row stride of a transposed (C, m) FP8 operand: the smallest odd multiple of 128 that is >= m
    (module docstring: a power-of-two stride camps on one DRAM channel). 16-byte aligned rows."""
    if not _ODD_LD:
        return m
    ld = -(-m // GROUP) * GROUP
    return ld + GROUP if (ld // GROUP) % 2 == 0 else ld


def empty_transposed(c: int, m: int, device, dtype=FP8_DTYPE) -> Tensor:
    """An uninitialized (c, m) tensor with row stride ``transposed_ld(m)`` (a view of (c, ld))."""
    return torch.empty((c, transposed_ld(m)), dtype=dtype, device=device)[:, :m]


def _check_transposed(fn: str, what: str, t: Tensor, shape: tuple, device) -> None:
    """A (C, M) transposed operand: unit column stride, row stride >= M and a multiple of 16 bytes."""
    ok = (tuple(t.shape) == shape and t.dtype == FP8_DTYPE and t.device == device and t.stride(1) == 1
          and t.stride(0) >= shape[1] and t.stride(0) % 16 == 0)
    if not ok:
        raise ValueError(f"{fn}: {what} must be a {FP8_DTYPE} tensor of shape {shape} on {device} with unit "
                         f"column stride and a row stride >= {shape[1]}, a multiple of 16 (empty_transposed), "
                         f"got {t.dtype} {tuple(t.shape)} strides {t.stride()} on {t.device}")


@triton.jit
def _quant_gather_128x1_t_kernel(
    x_ptr,  # (T, C) fp32 / bf16, source rows
    row_index_ptr,  # (M,) int32, source index (// TOP_K) of each output row, < 0 -> zero row
    yT_ptr,  # (C, M) fp8e4nv out, transposed, row stride LD
    scale_ptr,  # (cdiv(M, 128), C) fp32 out
    count_ptr,  # (1,) int32, += non-finite groups; CHECK only
    end_ptr,  # (1,) int32, rows from this one on are not needed (left unwritten); HAS_END only
    M,  # i32, output rows (N_cap)
    LD,  # i32, row stride of yT (>= M)
    C: tl.constexpr,
    TOP_K: tl.constexpr,
    CHECK: tl.constexpr,
    EXACT_ROUND: tl.constexpr,
    EPS: tl.constexpr,
    BLOCK_C: tl.constexpr,
    HAS_END: tl.constexpr,
):
    """Gathered 128x1 quantization with a transposed store.

    Grid: (cdiv(M, 128), cdiv(C, BLOCK_C)); program (b, j) owns output rows [128 b, 128 b + 128) x
    columns [j BC, (j+1) BC): it gathers those rows of x, takes the per-column amax over the 128 rows,
    stores the e4m3 values at yT[col, row] and scale[b, col].
    """
    G: tl.constexpr = 128
    b = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < C
    if HAS_END:
        # One test per block (end is a multiple of 128), and the whole block skipped: masked loads
        # alone left the IEEE divisions running on zeros (a dead block cost as much as a live one,
        # ep_overlap_2xh200_fp8_s5d_20261130.json); a per-row mask against the loaded end turned the
        # stores into byte stores (2.2x slower, bench_fp8_quant_ep_30b_1xh200_20261130.json).
        if b * G >= tl.load(end_ptr):  # past the last expert: only the (finite) scales
            tl.store(scale_ptr + b.to(tl.int64) * C + cols, _scale_of(tl.zeros((BLOCK_C,), tl.float32), EPS),
                     mask=col_ok)
            return
    rows = b * G + tl.arange(0, G)
    row_ok = rows < M
    idx = tl.load(row_index_ptr + rows, mask=row_ok, other=-1)
    live = idx >= 0
    src = tl.where(live, idx // TOP_K, 0).to(tl.int64)  # int64: src * C can pass 2^31
    x = tl.load(x_ptr + src[:, None] * C + cols[None, :], mask=live[:, None] & col_ok[None, :],
                other=0.0).to(tl.float32)
    scale_1C = _scale_of(_amax(x, 0), EPS)  # (1, BC)
    q = _to_e4m3(x, scale_1C, EXACT_ROUND)
    scale = tl.reshape(scale_1C, (BLOCK_C,))
    # int64: col * LD passes 2^31 at full shapes (2048 x 147k)
    tl.store(yT_ptr + cols.to(tl.int64)[None, :] * LD + rows[:, None], q, mask=row_ok[:, None] & col_ok[None, :])
    tl.store(scale_ptr + b.to(tl.int64) * C + cols, scale, mask=col_ok)
    if CHECK:
        n_bad = tl.sum((col_ok & ~(scale < float("inf"))).to(tl.int32))  # NaN < inf is False
        tl.atomic_add(count_ptr, n_bad, mask=n_bad > 0)


@triton.jit
def _quant_dual_kernel(
    x_ptr,  # (M, C) fp32 / bf16
    valid_ptr,  # (M,) uint8, nonzero = valid row
    y_ptr,  # (M, C) fp8e4nv out, 1x128
    s_ptr,  # (M, C // 128) fp32 out
    yT_ptr,  # (C, M) fp8e4nv out, 128x1 transposed, row stride LD
    sT_ptr,  # (cdiv(M, 128), C) fp32 out
    count_ptr,  # (1,) int32; CHECK only
    end_ptr,  # (1,) int32, rows from this one on are not needed (left unwritten); HAS_END only
    M,  # i32 rows
    LD,  # i32, row stride of yT (>= M)
    C: tl.constexpr,  # a multiple of 128
    CHECK: tl.constexpr,
    EXACT_ROUND: tl.constexpr,
    EPS: tl.constexpr,
    HAS_END: tl.constexpr,
):
    """One 128 x 128 tile: 1x128 (row) and 128x1 (column) quantization.

    Grid: (cdiv(M, 128), C // 128); program (b, g) owns rows [128 b, 128 b + 128) x columns
    [128 g, 128 g + 128) of both outputs, s[rows, g] and sT[b, cols]. Invalid rows read as 0.
    The tile is handled in two 64-column halves (a whole fp32 tile plus its pointer tiles spilled):
    pass 1 quantizes each half's columns and takes the row amax; pass 2 re-reads the halves (from L1 /
    L2: DRAM reads the tile once) and quantizes the rows with the now complete row scale.
    """
    G: tl.constexpr = 128
    H: tl.constexpr = 64
    b = tl.program_id(0)
    g = tl.program_id(1)
    if HAS_END:  # as in _quant_gather_128x1_t_kernel: a block past the last expert writes its scales only
        if b * G >= tl.load(end_ptr):
            tl.store(sT_ptr + b.to(tl.int64) * C + g * G + tl.arange(0, G),
                     _scale_of(tl.zeros((G,), tl.float32), EPS))
            return
    rows = b * G + tl.arange(0, G)
    row_ok = rows < M
    live = row_ok & (tl.load(valid_ptr + rows, mask=row_ok, other=0) != 0)
    rows64 = rows.to(tl.int64)
    amax_M1 = tl.zeros((G, 1), dtype=tl.float32)
    n_bad = 0
    for half in tl.static_range(2):
        cols = g * G + half * H + tl.arange(0, H)
        x = tl.load(x_ptr + rows64[:, None] * C + cols[None, :], mask=live[:, None], other=0.0).to(tl.float32)
        amax_M1 = tl.maximum(amax_M1, _amax(x, 1), propagate_nan=tl.PropagateNan.ALL)
        s_1H = _scale_of(_amax(x, 0), EPS)  # (1, 64)
        qT = _to_e4m3(x, s_1H, EXACT_ROUND)
        tl.store(yT_ptr + cols.to(tl.int64)[None, :] * LD + rows[:, None], qT, mask=row_ok[:, None])
        s_col = tl.reshape(s_1H, (H,))
        tl.store(sT_ptr + b.to(tl.int64) * C + cols, s_col)
        if CHECK:
            n_bad += tl.sum((~(s_col < float("inf"))).to(tl.int32))  # NaN < inf is False
    s_M1 = _scale_of(amax_M1, EPS)  # (128, 1)
    for half in tl.static_range(2):
        cols = g * G + half * H + tl.arange(0, H)
        x = tl.load(x_ptr + rows64[:, None] * C + cols[None, :], mask=live[:, None], other=0.0).to(tl.float32)
        q = _to_e4m3(x, s_M1, EXACT_ROUND)
        tl.store(y_ptr + rows64[:, None] * C + cols[None, :], q, mask=row_ok[:, None])
    s_row = tl.reshape(s_M1, (G,))
    tl.store(s_ptr + rows64 * (C // G) + g, s_row, mask=row_ok)
    if CHECK:
        n_bad += tl.sum((row_ok & ~(s_row < float("inf"))).to(tl.int32))
        tl.atomic_add(count_ptr, n_bad, mask=n_bad > 0)


_VARIANTS = (None, "v1", "gluon", "gluon_pipe")


def _gluon_kind(variant: str | None, fn: str, x: Tensor, interpret: bool) -> str | None:
    """Which Gluon kernel a pass runs: "gluon", "pipe" (the persistent pipelined one) or None (the Triton kernel):
    as asked (``variant``, else ``QUANT_GLUON`` / ``QUANT_PIPE``) where possible (compiled mode on an sm_90 GPU with
    Gluon, bf16 input; the pipelined kernels also need C a multiple of 128, else "gluon")."""
    if variant not in _VARIANTS:
        raise ValueError(f"{fn}: variant must be one of {_VARIANTS[1:]}, got {variant!r}")
    want = QUANT_GLUON if variant is None else variant != "v1"
    if not (want and not interpret and x.dtype == torch.bfloat16 and gl_quant_bwd.HAVE_GLUON and x.is_cuda
            and _is_sm90(x.device.index if x.device.index is not None else torch.cuda.current_device())):
        return None
    pipe = QUANT_PIPE if variant is None else variant == "gluon_pipe"
    return "pipe" if pipe and x.shape[1] % GROUP == 0 else "gluon"


def _pipe_programs(x: Tensor, tiles: int) -> int:
    """Persistent grid of a pipelined kernel: PIPE_CONFIG's programs per SM, at most one per tile."""
    dev = x.device
    sms = _sm_count(dev.index if dev.index is not None else torch.cuda.current_device())
    return _programs(dev, tiles, sms * gl_quant_bwd.PIPE_CONFIG["PER_SM"])


@functools.lru_cache(maxsize=None)
def _is_sm90(index: int) -> bool:  # once per device: the launchers sit on the FP8 backward's host path
    return torch.cuda.get_device_capability(index) == (9, 0)


def _check_end_row(fn: str, end_row: Tensor | None, dev) -> None:
    if end_row is not None:
        _check_tensor(fn, "end_row", end_row, 1, (torch.int32,), dev)
        if end_row.shape[0] != 1:
            raise ValueError(f"{fn}: end_row must have shape (1,), got {tuple(end_row.shape)}")


def quantize_gather_128x1_t(
    x: Tensor,
    row_index: Tensor,
    top_k: int,
    *,
    nonfinite_count: Tensor | None = None,
    out: Tensor | None = None,
    scale_out: Tensor | None = None,
    name: str | None = None,
    end_row: Tensor | None = None,
    variant: str | None = None,
) -> tuple[Tensor, Tensor]:
    """Gather token rows into layout order and quantize them 128x1, stored transposed.

    Virtual source ``xg[r] = x[row_index[r] // top_k]`` (zero row where ``row_index[r] < 0``); result
    equals ``fp8_reference.quantize_act_128x1(xg)`` transposed, bitwise.

    Grid: (cdiv(M, 128), cdiv(C, BC)); one program per 128 output rows x BC columns.

    Args:
        x: (T, C) fp32 / bf16 / fp16 contiguous (x, or dout).
        row_index: (M,) int32 contiguous, e.g. ``layout.row_pair`` with ``top_k = K``; indices are not
            checked on the host (no sync): the caller guarantees row_index // top_k < T.
        top_k: divisor of row_index (>= 1).
        nonfinite_count: optional (1,) int32 device counter (+= groups with a non-finite scale).
        out: optional (C, M) float8_e4m3fn buffer, unit column stride, row stride >= M and a multiple
            of 16 (``empty_transposed``); scale_out: optional (cdiv(M, 128), C) fp32 contiguous buffer.
        name: named in error messages.
        end_row: optional (1,) int32 device tensor, **a multiple of 128** (``layout.offsets[-1:]`` of a
            BM = 128 layout; checked per 128-row block, not per row): output rows from it on are not
            needed by any consumer and are left unwritten (their scales are written finite); saves the
            pass over the spare capacity rows (half of N_cap at EP = 2).
        variant: "v1" (the Triton kernel), "gluon" (``gl_quant_bwd``: sm_90, bf16 x; elsewhere v1 runs) or
            "gluon_pipe" (its persistent pipelined kernel; "gluon" where C is not a multiple of 128); None:
            "gluon_pipe" unless ``TITAN_MEGAMOE_FP8_QUANT_GLUON=0`` ("v1") or ``TITAN_MEGAMOE_FP8_QUANT_PIPE=0``
            ("gluon").
            The same bits for finite input.

    Returns:
        (xT_fp8 (C, M) float8_e4m3fn with row stride ``transposed_ld(M)`` (or ``out``'s), scale
        (cdiv(M, 128), C) fp32): ``xg[r, c] ~= xT_fp8[c, r] * scale[r // 128, c]``.

    Raises:
        ValueError: wrong dtype / shape / device / contiguity, top_k < 1, an unknown variant.

    Host syncs: none.
    """
    fn = "quantize_gather_128x1_t"
    _check_tensor(fn, name or "x", x, 2, _INPUT_DTYPES)
    _check_tensor(fn, "row_index", row_index, 1, (torch.int32,), x.device)
    if top_k < 1:
        raise ValueError(f"{fn}: top_k={top_k} must be >= 1")
    C = x.shape[1]
    M = row_index.shape[0]
    dev = x.device
    count, check = _count_arg(fn, nonfinite_count, dev)
    if out is None:
        out = empty_transposed(C, M, dev)
    else:
        _check_transposed(fn, "out", out, (C, M), dev)
    scale_out = _out_buffer(fn, "scale_out", scale_out, (cdiv(M, GROUP), C), torch.float32, dev)
    if M == 0 or C == 0:
        return out, scale_out
    interpret = interpret_mode()
    _check_end_row(fn, end_row, dev)
    args = (x, row_index, out, scale_out, count if check else scale_out, row_index if end_row is None else end_row, M,
            out.stride(0))
    kind = _gluon_kind(variant, fn, x, interpret)
    if kind == "pipe":
        launch(gl_quant_bwd._gl_quant_gather_pipe_kernel, (_pipe_programs(x, cdiv(M, GROUP) * (C // GROUP)),), *args,
               C=C, TOP_K=top_k, CHECK=check, EPS=AMAX_EPS, HAS_END=end_row is not None,
               **gl_quant_bwd.pipe_launch_options())
        return out, scale_out
    if kind == "gluon":
        opts = gl_quant_bwd.launch_options("gather")
        launch(gl_quant_bwd._gl_quant_gather_128x1_t_kernel, (cdiv(M, GROUP), cdiv(C, opts["BC"])), *args, C=C,
               TOP_K=top_k, CHECK=check, EPS=AMAX_EPS, HAS_END=end_row is not None, **opts)
        return out, scale_out
    bc = _T_BLOCK_C[interpret]
    launch(_quant_gather_128x1_t_kernel, (cdiv(M, GROUP), cdiv(C, bc)), *args, C=C, TOP_K=top_k, CHECK=check,
           EXACT_ROUND=interpret, EPS=AMAX_EPS, BLOCK_C=bc, HAS_END=end_row is not None, num_warps=_WARPS)
    return out, scale_out


def quantize_dual_1x128_128x1_t(
    x: Tensor,
    row_valid: Tensor,
    *,
    nonfinite_count: Tensor | None = None,
    name: str | None = None,
    end_row: Tensor | None = None,
    variant: str | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """1x128 and transposed 128x1 quantization of one tensor, each 128 x 128 tile read once from DRAM.

    Equal bitwise to ``fp8_reference.quantize_act_1x128(xv)`` and ``quantize_act_128x1(xv).T`` with
    ``xv = where(row_valid, x, 0)``.

    Grid: (cdiv(M, 128), C // 128); one program per 128 x 128 tile.

    Args:
        x: (M, C) fp32 / bf16 / fp16 contiguous, C a multiple of 128 (dgate_up: C = 2F).
        row_valid: (M,) bool / uint8 contiguous mask (``layout.row_pair >= 0``); invalid rows read as
            zero in both outputs (rows past the last expert may hold anything).
        nonfinite_count: optional (1,) int32 device counter.
        name: named in error messages.
        end_row: as in :func:`quantize_gather_128x1_t`: rows from it on are left unwritten in x_fp8,
            scale and xT_fp8.
        variant: as in :func:`quantize_gather_128x1_t`.

    Returns:
        (x_fp8 (M, C), scale (M, C // 128), xT_fp8 (C, M) with row stride ``transposed_ld(M)``,
        scaleT (cdiv(M, 128), C)).

    Raises:
        ValueError: C not a multiple of 128 (use precision = 'bf16'), wrong dtype / shape / device, an unknown
            variant.

    Host syncs: none.
    """
    fn = "quantize_dual_1x128_128x1_t"
    _check_tensor(fn, name or "x", x, 2, _INPUT_DTYPES)
    M, C = x.shape
    check_group_dim(C, "channel dim (last dim)", fn, name)
    dev = x.device
    if row_valid.dtype == torch.bool:
        row_valid = row_valid.view(torch.uint8)
    _check_tensor(fn, "row_valid", row_valid, 1, (torch.uint8,), dev)
    if row_valid.shape[0] != M:
        raise ValueError(f"{fn}: row_valid must have shape ({M},), got {tuple(row_valid.shape)}")
    count, check = _count_arg(fn, nonfinite_count, dev)
    Mb = cdiv(M, GROUP)
    y = torch.empty((M, C), dtype=FP8_DTYPE, device=dev)
    s = torch.empty((M, C // GROUP), dtype=torch.float32, device=dev)
    yT = empty_transposed(C, M, dev)
    sT = torch.empty((Mb, C), dtype=torch.float32, device=dev)
    if M == 0:
        return y, s, yT, sT
    interpret = interpret_mode()
    _check_end_row(fn, end_row, dev)
    args = (x, row_valid, y, s, yT, sT, count if check else s, row_valid if end_row is None else end_row, M,
            yT.stride(0))
    kind = _gluon_kind(variant, fn, x, interpret)
    if kind == "pipe":
        launch(gl_quant_bwd._gl_quant_dual_pipe_kernel, (_pipe_programs(x, Mb * (C // GROUP)),), *args, C=C,
               CHECK=check, EPS=AMAX_EPS, HAS_END=end_row is not None, **gl_quant_bwd.pipe_launch_options())
    elif kind == "gluon":
        launch(gl_quant_bwd._gl_quant_dual_kernel, (Mb, C // GROUP), *args, C=C, CHECK=check, EPS=AMAX_EPS,
               HAS_END=end_row is not None, **gl_quant_bwd.launch_options("dual"))
    else:
        launch(_quant_dual_kernel, (Mb, C // GROUP), *args, C=C, CHECK=check, EXACT_ROUND=interpret, EPS=AMAX_EPS,
               HAS_END=end_row is not None, num_warps=_DUAL_WARPS)
    return y, s, yT, sT
