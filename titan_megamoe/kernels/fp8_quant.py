"""Blockwise FP8 (e4m3) quantization kernels: 1x128 activations (optionally of gathered rows), 128x1
activations for the weight gradient, 128x128 weight blocks.

Shape legend:
    M   output rows        M_in  rows of x (gather variant)      D   channels
    E   experts            N     weight output rows              Kd  weight reduction dim (last)
    G = 128 (group edge)   BM / BD  rows / columns per program

Math and layouts: exactly those of ``titan_megamoe/ops/fp8_reference.py`` (the oracle; its docstring has
the formula, the epsilon and the API contract), and the CPU tests check it bit for bit, values and
scales. Per group: ``amax = max(max|x|, AMAX_EPS)``, ``scale = amax / 448``, ``q = e4m3(clamp(x / scale,
-448, 448))``, all in fp32. How the kernels stay bitwise equal to torch:

* Both divisions round to nearest as IEEE's: ``tl.math.div_rn``, or for ``x / scale`` in the weight quantization
  and the GEMM epilogues one reciprocal per group and Markstein's FMA correction (``_to_e4m3_rcp``: the same
  quotient, without ``div.rn``'s branch per element). A plain ``/`` on fp32 compiles to ``div.full.f32`` on
  NVIDIA, an approximation (2 ulp): it would not match torch on GPU.
* The max over the group propagates NaN, as ``torch.amax`` does (``_amax``: an integer max over the
  bits of |x|; then ``PropagateNan.ALL`` for the epsilon clamp). ``tl.max`` on floats does not (maxnum
  ignores NaN), so a NaN group would get a finite scale and slip past the check.
* The fp32 -> e4m3 cast: compiled, ``.to(tl.float8e4nv)`` is ``cvt.rn.satfinite.e4m3x2.f32`` (round to
  nearest even, the same as torch's cast; the clamp before it makes saturation moot; the compile test
  checks the instruction). The **interpreter's cast is not** round-to-nearest-even (triton 3.6,
  ``_convert_float``; seen in ``tests/test_fp8_quant.py::test_interpreter_cast_quirk``): it adds one to
  the kept mantissa when the first dropped bit is set (ties round away from zero: 1.0625 -> 1.125,
  torch 1.0), ORs a mantissa carry into the exponent field instead of adding it (0.0312 -> 0.015625,
  torch 0.03125), and truncates values in e4m3's subnormal range (3 * 2^-10 -> 2^-9, torch 2^-8). So under
  ``TRITON_INTERPRET=1`` the launchers set ``EXACT_ROUND``: the kernel first rounds the clamped value
  to the e4m3 grid in fp32 with torch's own recipe (normal range: add 0x7FFFF plus the lowest kept
  mantissa bit to the fp32 bits, clear the 20 dropped bits; subnormal range |y| < 2^-6: (|y| + 2^14)
  - 2^14, which rounds to a multiple of 2^-9 in fp32 round-to-nearest-even), so the interpreter's
  cast only ever sees exactly representable values, which it converts correctly. Compiled kernels
  skip it (the hardware cast already rounds correctly).

Non-finite input (inf / NaN) without a host sync: pass ``nonfinite_count``, a (1,) int32 device tensor
that the caller zeroes once; every group whose scale is not finite adds 1 to it (a masked atomic add
that only fires for such groups; counts from several launches accumulate). The values of such a group
are unspecified. The op reads the counter lazily, as ``titan_megamoe/comm/capacity.py`` does for the
receive capacity: copy it to pinned host memory with ``non_blocking=True`` and an event, and on a later
call (or at the end of the step) raise ``ValueError(nonfinite_message(layer, n))`` for a nonzero count.
An inf / NaN input poisons the step's result anyway, so learning of it a few layer calls later loses
nothing. ``check_nonfinite_count`` is the synchronous version (tests, debugging).

Dims are constexpr (one compile per layer shape, as in ``grouped_gemm.py``); row counts are runtime.
Offsets are int64 where row * D can pass 2^31. No host syncs, no atomics on the normal path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from titan_megamoe.kernels.grouped_gemm import interpret_mode
from titan_megamoe.kernels.jit import cdiv
from titan_megamoe.kernels.launch import launch
from titan_megamoe.ops.fp8_reference import (
    AMAX_EPS,
    FP8_DTYPE,
    FP8_MAX,
    GROUP,
    check_group_dim,
    nonfinite_message,
)

__all__ = [
    "launch_quant_act_1x128",
    "quantize_act_1x128",
    "quantize_act_128x1",
    "quantize_weight_128x128",
    "quantize_weight_128x128_t",
    "new_nonfinite_count",
    "check_nonfinite_count",
]

# Launch shapes. Compiled (Hopper): memory-bound kernels; ~32-64 fp32 values per thread, no spills
# (sm_90a compile test). Interpreter: bigger tiles, since every program costs a fixed Python overhead.
_ACT_BLOCK_M = {False: 32, True: 128}  # rows per program, 1x128
_ACT_WARPS = 4
_COL_BLOCK_D = {False: 64, True: 128}  # columns per program, 128x1 (each program: 128 rows)
_COL_WARPS = 4
_W_WARPS = 8  # 128x128 block per program


# --------------------------------------------------------------------------------------------------
# Device helpers
# --------------------------------------------------------------------------------------------------


@triton.jit
def _amax(x, AXIS: tl.constexpr):
    """max |x| along AXIS (kept as a size-1 dim), NaN if any element is NaN (torch.amax semantics).

    Taken over the int32 bits of |x|: for non-negative floats the integer order is the float order,
    and every NaN's bits are above +inf's, so a plain integer max propagates NaN. (``tl.max`` on floats
    ignores NaN: maxnum on GPU, ``np.nanmax`` in the interpreter; a reduction with a custom NaN-keeping
    combine function is correct but runs element by element in the interpreter.)
    """
    bits = tl.abs(x).to(tl.int32, bitcast=True)
    return tl.max(bits, AXIS, keep_dims=True).to(tl.float32, bitcast=True)


@triton.jit
def _round_e4m3_rne(y):
    """Round fp32 ``y`` (finite, |y| <= 448) to the nearest e4m3 value, ties to even; result in fp32.

    Torch's cast recipe (c10 ``fp8e4m3fn_from_fp32_value``), written in fp32 / int32 arithmetic so the
    interpreter's inexact fp8 cast only sees representable values. The sign is taken from the bits, so
    -0.0 and negative values that round to zero stay -0.0 (torch gives 0x80 there too).
    """
    a = tl.abs(y)
    ab = a.to(tl.int32, bitcast=True)
    # normal e4m3 range (|y| >= 2^-6): keep 3 of 23 mantissa bits, round half to even; a carry moves
    # into the exponent, and 448 (the clamp) stays 448.
    rn = (ab + 0x7FFFF + ((ab >> 20) & 1)) & -1048576  # -1048576 = 0xFFF00000: clear the 20 low bits
    normal = rn.to(tl.float32, bitcast=True)
    # subnormal range: multiples of 2^-9; adding 2^14 (whose fp32 ulp is 2^-9) rounds to nearest even
    sub = (a + 16384.0) - 16384.0
    r = tl.where(a >= 0.015625, normal, sub)
    # sign by bits: Triton's unary minus is 0 - r, which turns -(+0.0) into +0.0
    sign = y.to(tl.int32, bitcast=True) & -2147483648  # 0x80000000
    return (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _scale_of(amax, EPS: tl.constexpr):
    """scale = max(amax, EPS) / 448 (IEEE division, NaN kept), same shape as amax."""
    amax = tl.maximum(amax, EPS, propagate_nan=tl.PropagateNan.ALL)
    return tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32))


@triton.jit
def _div_by_group(x, b):
    """x / b rounded to the nearest fp32, as ``div_rn``, with one reciprocal per group instead of one IEEE division
    per element; ``b`` (> 0, one value per group) broadcastable to ``x``.

    Markstein's correction (P. Markstein, "Computation of elementary functions on the IBM RISC System/6000
    processor", IBM J. Res. Dev. 34(1), 1990): with y = RN(1/b), q = RN(x y) and the remainder r = RN(x - b q) (one
    FMA), RN(q + r y) (one FMA) is RN(x / b); ``tests/test_fp8_quant.py`` checks it in exact rational arithmetic.
    The ``div.rn`` the compiler emits is the same sequence (with a refined hardware reciprocal) behind a range check
    and a branch per element (MUFU.RCP, FCHK, five FFMA, BSSY / BSYNC: no overlap between elements); this is one
    FMUL and two FFMA.
    Exact for finite x with no fp32 underflow of the quotient; below that the e4m3 cast gives (signed) zero either
    way, the sign copied from x as the division gives it. Non-finite b (a group with inf / NaN, counted by the
    kernels' check) gives unspecified values, as before.
    """
    y = tl.math.div_rn(tl.full(b.shape, 1.0, tl.float32), b)
    q = x * y
    q = tl.fma(tl.fma(-q, b, x), y, q)
    sign = x.to(tl.int32, bitcast=True) & -2147483648  # 0x80000000: -0.0 / b is -0.0
    return ((q.to(tl.int32, bitcast=True) & 2147483647) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _to_e4m3(x, scale, EXACT_ROUND: tl.constexpr):
    """e4m3(clamp(x / scale, -448, 448)) by ``div_rn`` per element; x fp32, scale fp32 with one value per group,
    broadcastable to x ((BM, 1), (1, BD), (1, 1))."""
    y = tl.math.div_rn(x, tl.broadcast_to(scale, x.shape))
    return _e4m3_of(y, EXACT_ROUND)


@triton.jit
def _to_e4m3_rcp(x, scale, EXACT_ROUND: tl.constexpr):
    """``_to_e4m3`` with the quotient by one reciprocal per group (``_div_by_group``): the same bits. Faster where
    the quantization sits in a GEMM's epilogue or the weight quantization (``scripts/bench_fp8.py``, H100, 30B:
    weights 0.72 -> 0.61 ms, GEMM1 + h 1.28 -> 1.22, FP8 GEMM2 dgrad 1.30 -> 1.26); slower in the standalone
    activation passes (dual 0.81 -> 0.98, gathered 128x1 0.43 -> 0.56: two more live values per thread in kernels
    bound by memory latency), which keep ``_to_e4m3``."""
    if EXACT_ROUND:
        # interpreter: its fma is a multiply and an add (two roundings), so the correction would not be exact
        y = tl.math.div_rn(x, tl.broadcast_to(scale, x.shape))
    else:
        y = _div_by_group(x, scale)
    return _e4m3_of(y, EXACT_ROUND)


@triton.jit
def _e4m3_of(y, EXACT_ROUND: tl.constexpr):
    y = tl.minimum(tl.maximum(y, -448.0), 448.0)
    if EXACT_ROUND:  # interpreter only: its fp32 -> fp8 cast is not round-to-nearest-even
        y = _round_e4m3_rne(y)
    return y.to(tl.float8e4nv)


# --------------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------------


@triton.jit
def _quant_act_1x128_kernel(
    x_ptr,  # (M_in, D) fp32 / bf16 / fp16, source rows
    row_index_ptr,  # (M,) int32, source index of each output row (// TOP_K), < 0 -> zero row; GATHER only
    # (with SELF_ROWS: row r reads x[r] where row_index[r] >= 0, a zero row elsewhere)
    y_ptr,  # (M, D) fp8e4nv out
    scale_ptr,  # (M, D // 128) fp32 out
    count_ptr,  # (1,) int32, += number of non-finite groups; CHECK only
    M,  # i32, output rows
    D: tl.constexpr,  # channels, a multiple of 128
    TOP_K: tl.constexpr,  # divisor of row_index (GATHER)
    GATHER: tl.constexpr,
    CHECK: tl.constexpr,
    EXACT_ROUND: tl.constexpr,  # interpreter: round to the e4m3 grid before the cast
    EPS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    SELF_ROWS: tl.constexpr = False,
):
    """1x128 quantization of BLOCK_M output rows x one 128-channel group.

    Grid: (cdiv(M, BLOCK_M), D // 128); program (i, g) owns rows [i*BM, (i+1)*BM) of columns
    [128 g, 128 g + 128) of y and column g of scale. Output row r reads x[row_index[r] // TOP_K]
    (GATHER) or x[r]; a negative index gives a zero row (scale EPS / 448, values 0).
    Preconditions: contiguous tensors, 0 <= row_index // TOP_K < M_in where row_index >= 0.
    """
    G: tl.constexpr = 128
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    if GATHER:
        idx = tl.load(row_index_ptr + rows, mask=row_ok, other=-1)
        live = idx >= 0
        if SELF_ROWS:
            src = tl.where(live, rows, 0).to(tl.int64)
        else:
            src = tl.where(live, idx // TOP_K, 0).to(tl.int64)  # int64: src * D can pass 2^31
    else:
        live = row_ok
        src = rows.to(tl.int64)
    g = tl.program_id(1)
    cols = g * G + tl.arange(0, G)
    x = tl.load(x_ptr + src[:, None] * D + cols[None, :], mask=live[:, None], other=0.0).to(tl.float32)

    scale_M1 = _scale_of(_amax(x, 1), EPS)  # (BM, 1)
    q = _to_e4m3(x, scale_M1, EXACT_ROUND)
    scale = tl.reshape(scale_M1, (BLOCK_M,))

    rows64 = rows.to(tl.int64)
    tl.store(y_ptr + rows64[:, None] * D + cols[None, :], q, mask=row_ok[:, None])
    tl.store(scale_ptr + rows64 * (D // G) + g, scale, mask=row_ok)
    if CHECK:
        n_bad = tl.sum((row_ok & ~(scale < float("inf"))).to(tl.int32))  # NaN < inf is False
        tl.atomic_add(count_ptr, n_bad, mask=n_bad > 0)


@triton.jit
def _quant_act_128x1_kernel(
    x_ptr,  # (M, D) fp32 / bf16 / fp16
    valid_ptr,  # (M,) uint8 / int32, nonzero = valid row; HAS_VALID only
    y_ptr,  # (M, D) fp8e4nv out
    scale_ptr,  # (cdiv(M, 128), D) fp32 out
    count_ptr,  # (1,) int32, += number of non-finite groups; CHECK only
    M,  # i32, rows
    D: tl.constexpr,  # columns (any)
    HAS_VALID: tl.constexpr,
    CHECK: tl.constexpr,
    EXACT_ROUND: tl.constexpr,
    EPS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """128x1 quantization of one 128-row block x BLOCK_D columns.

    Grid: (cdiv(M, 128), cdiv(D, BLOCK_D)); program (b, j) owns rows [128 b, 128 b + 128) (cut at M)
    of columns [j*BD, (j+1)*BD) of y and row b of those scale columns. Rows past M and invalid rows
    read as 0 (left out of the max; invalid rows are stored as 0).
    """
    G: tl.constexpr = 128
    b = tl.program_id(0)
    rows = b * G + tl.arange(0, G)
    row_ok = rows < M
    live = row_ok
    if HAS_VALID:
        live = live & (tl.load(valid_ptr + rows, mask=row_ok, other=0) != 0)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_ok = cols < D
    rows64 = rows.to(tl.int64)  # int64: row * D can pass 2^31
    offs = rows64[:, None] * D + cols[None, :]
    x = tl.load(x_ptr + offs, mask=live[:, None] & col_ok[None, :], other=0.0).to(tl.float32)

    scale_1D = _scale_of(_amax(x, 0), EPS)  # (1, BD)
    q = _to_e4m3(x, scale_1D, EXACT_ROUND)
    scale = tl.reshape(scale_1D, (BLOCK_D,))

    tl.store(y_ptr + offs, q, mask=row_ok[:, None] & col_ok[None, :])
    tl.store(scale_ptr + b.to(tl.int64) * D + cols, scale, mask=col_ok)
    if CHECK:
        n_bad = tl.sum((col_ok & ~(scale < float("inf"))).to(tl.int32))
        tl.atomic_add(count_ptr, n_bad, mask=n_bad > 0)


@triton.jit
def _quant_weight_128x128_kernel(
    w_ptr,  # (E, N, Kd) fp32 / bf16 / fp16
    y_ptr,  # (E, N, Kd) fp8e4nv out; FORWARD only
    scale_ptr,  # (E, cdiv(N, 128), Kd // 128) fp32 out; FORWARD only
    count_ptr,  # (1,) int32, += number of non-finite blocks; CHECK only
    yt_ptr,  # (E, Kd, N) fp8e4nv out: the transposed copy; TRANSPOSED only
    scale_t_ptr,  # (E, Kd // 128, cdiv(N, 128)) fp32 out; TRANSPOSED only
    N: tl.constexpr,  # rows per expert (any)
    Kd: tl.constexpr,  # reduction dim, a multiple of 128
    CHECK: tl.constexpr,
    EXACT_ROUND: tl.constexpr,
    EPS: tl.constexpr,
    FORWARD: tl.constexpr = True,
    TRANSPOSED: tl.constexpr = False,
):
    """128x128 quantization of one weight block, stored as it lies (FORWARD) and / or transposed (TRANSPOSED: the
    K-major copy the FP8 dgrads read; a block's amax does not depend on its orientation, so it is the transpose of
    the FORWARD result bit for bit).

    Grid: (cdiv(N, 128), Kd // 128, E); program (bn, bk, e) owns rows [128 bn, 128 bn + 128) (cut at N)
    x columns [128 bk, 128 bk + 128) of expert e, and scale[e, bn, bk] (scale_t[e, bk, bn]).
    """
    G: tl.constexpr = 128
    NB: tl.constexpr = (N + G - 1) // G
    bn = tl.program_id(0)
    bk = tl.program_id(1)
    e = tl.program_id(2).to(tl.int64)  # int64: e * N * Kd passes 2^31 for large layers
    rows = bn * G + tl.arange(0, G)
    row_ok = rows < N
    cols = bk * G + tl.arange(0, G)
    offs = (e * N + rows)[:, None] * Kd + cols[None, :]
    x = tl.load(w_ptr + offs, mask=row_ok[:, None], other=0.0).to(tl.float32)

    bits = tl.abs(x).to(tl.int32, bitcast=True)  # NaN-propagating max over int bits, as in _amax
    amax_11 = tl.max(tl.max(bits, 1, keep_dims=True), 0, keep_dims=True).to(tl.float32, bitcast=True)
    scale_11 = _scale_of(amax_11, EPS)  # (1, 1)
    q = _to_e4m3_rcp(x, scale_11, EXACT_ROUND)

    if FORWARD:
        tl.store(y_ptr + offs, q, mask=row_ok[:, None])
        s_off = (e * NB + bn) * (Kd // G) + bk
        tl.store(scale_ptr + s_off + tl.zeros((1, 1), tl.int64), scale_11)
    if TRANSPOSED:  # rows of the transposed block are columns of w: stores contiguous along N
        offs_t = (e * Kd + cols)[:, None] * N + rows[None, :]
        tl.store(yt_ptr + offs_t, tl.trans(q), mask=row_ok[None, :])
        st_off = (e * (Kd // G) + bk) * NB + bn
        tl.store(scale_t_ptr + st_off + tl.zeros((1, 1), tl.int64), scale_11)
    if CHECK:
        n_bad = tl.sum(tl.sum((~(scale_11 < float("inf"))).to(tl.int32), 1), 0)
        tl.atomic_add(count_ptr, n_bad, mask=n_bad > 0)


# --------------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------------

_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_tensor(fn: str, what: str, t: Tensor, ndim: int, dtypes: tuple, device=None) -> None:
    if t.dim() != ndim:
        raise ValueError(f"{fn}: {what} must have {ndim} dims, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise ValueError(f"{fn}: {what} must be one of {[str(d) for d in dtypes]}, got {t.dtype}")
    if not t.is_contiguous():
        raise ValueError(f"{fn}: {what} must be contiguous (strides {t.stride()})")
    if device is not None and t.device != device:
        raise ValueError(f"{fn}: {what} is on {t.device}, expected {device}")


def _out_buffer(fn: str, what: str, t: Tensor | None, shape: tuple, dtype, device) -> Tensor:
    """The ``_out`` convention: a caller buffer is checked and written in place; None allocates."""
    if t is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if tuple(t.shape) != shape or t.dtype != dtype or not t.is_contiguous() or t.device != device:
        raise ValueError(f"{fn}: {what} must be a contiguous {dtype} tensor of shape {shape} on {device}, "
                         f"got {t.dtype} {tuple(t.shape)} on {t.device}")
    return t


def _count_arg(fn: str, count: Tensor | None, device) -> tuple[Tensor | None, bool]:
    if count is None:
        return None, False
    if count.shape != (1,) or count.dtype != torch.int32 or count.device != device:
        raise ValueError(f"{fn}: nonfinite_count must be a (1,) int32 tensor on {device}, got "
                         f"{count.dtype} {tuple(count.shape)} on {count.device}")
    return count, True


def new_nonfinite_count(device) -> Tensor:
    """A zeroed (1,) int32 counter for the launchers' ``nonfinite_count`` argument."""
    return torch.zeros(1, dtype=torch.int32, device=device)


def check_nonfinite_count(count: Tensor, name: str | None = None) -> None:
    """Synchronous check of a counter (host sync: tests and debugging; the op checks lazily).

    Raises:
        ValueError: the counter is nonzero (``nonfinite_message``, naming ``name``).
    """
    n = int(count.item())  # host sync
    if n:
        raise ValueError(nonfinite_message(name, n))


def quantize_act_1x128(
    x: Tensor,
    row_index: Tensor | None = None,
    top_k: int = 1,
    *,
    nonfinite_count: Tensor | None = None,
    out: Tensor | None = None,
    scale_out: Tensor | None = None,
    name: str | None = None,
    row_valid: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Per-(row, 128 channels) FP8 quantization, optionally of gathered rows (dispatch layout order).

    Same math and result as ``fp8_reference.quantize_act_1x128`` (bitwise).

    Grid: (cdiv(M, BM), D // 128), one program per BM rows x 128 channels (``_quant_act_1x128_kernel``).

    Args:
        x: (M_in, D) fp32 / bf16 / fp16 contiguous; D a multiple of 128.
        row_index: optional (M,) int32 contiguous: output row i = x[row_index[i] // top_k], a zero row
            where row_index[i] < 0. E.g. ``layout.row_pair`` with ``top_k = K`` quantizes token rows
            straight into the expert-major layout (padding rows -> zeros). Indices are not checked
            on the host (that would sync): the caller guarantees row_index // top_k < M_in.
        top_k: divisor of row_index (>= 1).
        nonfinite_count: optional (1,) int32 device counter; += the number of groups with a
            non-finite scale (inf / NaN input). Never reset here. None: no check.
        out, scale_out: optional (M, D) float8_e4m3fn / (M, D // 128) fp32 contiguous buffers.
        name: tensor / layer named in error messages.
        row_valid: optional (M_in,) int32 contiguous, instead of ``row_index``: output row i = x[i] where
            row_valid[i] >= 0, a zero row elsewhere (e.g. ``layout.row_pair`` for h, whose padding rows and rows
            past the last expert GEMM1 may leave unwritten). One index read, no gather index to build.

    Returns:
        (x_fp8 (M, D) float8_e4m3fn, scale (M, D // 128) fp32 row-major).

    Raises:
        ValueError: D not a multiple of 128 (use precision = 'bf16'), wrong dtype / shape / device /
            contiguity, top_k < 1, both ``row_index`` and ``row_valid``.

    Host syncs: none. Example (``test_worked_example``): x rows [896, 0, ...] and [1, 0, ...], row_index
    [1, -1, 0] -> scales [1/448, 1e-12/448, 2], x_fp8 rows [448, 0, ...], zeros, [448, 0, ...].
    """
    fn = "quantize_act_1x128"
    _check_tensor(fn, name or "x", x, 2, _INPUT_DTYPES)
    M_in, D = x.shape
    check_group_dim(D, "channel dim D (last dim)", fn, name)
    dev = x.device
    if row_valid is not None:
        if row_index is not None:
            raise ValueError(f"{fn}: give row_index (a gather) or row_valid (rows in place), not both")
        _check_tensor(fn, "row_valid", row_valid, 1, (torch.int32,), dev)
        if row_valid.shape[0] != M_in:
            raise ValueError(f"{fn}: row_valid has {row_valid.shape[0]} entries, x has {M_in} rows")
        row_index, top_k = row_valid, 1
    gather = row_index is not None
    if gather and row_valid is None:
        _check_tensor(fn, "row_index", row_index, 1, (torch.int32,), dev)
        if top_k < 1:
            raise ValueError(f"{fn}: top_k={top_k} must be >= 1")
        M = row_index.shape[0]
    else:
        M = M_in
    count, check = _count_arg(fn, nonfinite_count, dev)
    out = _out_buffer(fn, "out", out, (M, D), FP8_DTYPE, dev)
    scale_out = _out_buffer(fn, "scale_out", scale_out, (M, D // GROUP), torch.float32, dev)
    _launch_act_1x128(x, row_index if gather else None, top_k, count if check else None, out, scale_out,
                      row_valid is not None)
    return out, scale_out


def launch_quant_act_1x128(x: Tensor, nonfinite_count: Tensor, row_valid: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """:func:`quantize_act_1x128` of every row of ``x`` (or, with ``row_valid``, in place by it) into new buffers,
    without its checks, for a caller that has made them: x (M, D) bf16 contiguous with D a multiple of 128,
    ``nonfinite_count`` a (1,) int32 counter and ``row_valid`` (M,) int32 contiguous, all on x's device
    (``ops/fp8_backend.fp8_fwd_unchecked``: the from-idle FP8 forward is host-bound until GEMM1 is enqueued).
    Same launch, same results. Returns (x_fp8 (M, D) float8_e4m3fn, scale (M, D // 128) fp32)."""
    M, D = x.shape
    out = torch.empty((M, D), dtype=FP8_DTYPE, device=x.device)
    scale_out = torch.empty((M, D // GROUP), dtype=torch.float32, device=x.device)
    _launch_act_1x128(x, row_valid, 1, nonfinite_count, out, scale_out, row_valid is not None)
    return out, scale_out


def _launch_act_1x128(x, row_index, top_k, count, out, scale_out, self_rows) -> None:
    """The launch half of :func:`quantize_act_1x128` (row_index None: no gather; count None: no check)."""
    M, D = out.shape
    if M == 0:
        return
    interpret = interpret_mode()
    bm = _ACT_BLOCK_M[interpret]
    gather = row_index is not None
    launch(_quant_act_1x128_kernel, (cdiv(M, bm), D // GROUP),
        x, row_index if gather else x, out, scale_out, count if count is not None else scale_out, M,
        D=D, TOP_K=top_k if gather else 1, GATHER=gather, CHECK=count is not None, EXACT_ROUND=interpret,
        EPS=AMAX_EPS, BLOCK_M=bm, SELF_ROWS=self_rows, num_warps=_ACT_WARPS,
    )


def quantize_act_128x1(
    x: Tensor,
    row_valid: Tensor | None = None,
    *,
    nonfinite_count: Tensor | None = None,
    out: Tensor | None = None,
    scale_out: Tensor | None = None,
    name: str | None = None,
) -> tuple[Tensor, Tensor]:
    """Per-(128 consecutive rows, column) FP8 quantization: the weight-gradient operand layout.

    Same math and result as ``fp8_reference.quantize_act_128x1`` (bitwise). Rows past M and rows
    with ``row_valid == 0`` count as zero (left out of the max, stored as 0).

    Grid: (cdiv(M, 128), cdiv(D, BD)); one program per 128-row block x BD columns.

    Args:
        x: (M, D) fp32 / bf16 / fp16 contiguous, any D >= 1.
        row_valid: optional (M,) bool / uint8 / int32 contiguous mask (nonzero = valid), e.g.
            ``layout.row_pair >= 0``. Bool is read through a free uint8 view.
        nonfinite_count, out, scale_out, name: as in ``quantize_act_1x128``; shapes (M, D) and
            (cdiv(M, 128), D).

    Returns:
        (x_fp8 (M, D) float8_e4m3fn row-major, scale (cdiv(M, 128), D) fp32).

    Raises:
        ValueError: wrong dtype / shape / device / contiguity.

    Host syncs: none.
    """
    fn = "quantize_act_128x1"
    _check_tensor(fn, name or "x", x, 2, _INPUT_DTYPES)
    M, D = x.shape
    dev = x.device
    has_valid = row_valid is not None
    if has_valid:
        if row_valid.dtype == torch.bool:
            row_valid = row_valid.view(torch.uint8)  # same bytes, no copy
        _check_tensor(fn, "row_valid", row_valid, 1, (torch.uint8, torch.int32), dev)
        if row_valid.shape[0] != M:
            raise ValueError(f"{fn}: row_valid must have shape ({M},), got {tuple(row_valid.shape)}")
    count, check = _count_arg(fn, nonfinite_count, dev)
    Mb = cdiv(M, GROUP)
    out = _out_buffer(fn, "out", out, (M, D), FP8_DTYPE, dev)
    scale_out = _out_buffer(fn, "scale_out", scale_out, (Mb, D), torch.float32, dev)
    if M == 0 or D == 0:
        return out, scale_out
    interpret = interpret_mode()
    bd = _COL_BLOCK_D[interpret]
    grid = (Mb, cdiv(D, bd))
    launch(_quant_act_128x1_kernel, grid,
        x, row_valid if has_valid else x, out, scale_out, count if check else scale_out, M,
        D=D, HAS_VALID=has_valid, CHECK=check, EXACT_ROUND=interpret, EPS=AMAX_EPS, BLOCK_D=bd,
        num_warps=_COL_WARPS,
    )
    return out, scale_out


def quantize_weight_128x128(
    w: Tensor,
    *,
    nonfinite_count: Tensor | None = None,
    out: Tensor | None = None,
    scale_out: Tensor | None = None,
    name: str | None = None,
) -> tuple[Tensor, Tensor]:
    """Per-128x128-block FP8 quantization of expert weights (w1 / w3 (E, F, D), w2 (E, D, F)).

    Same math and result as ``fp8_reference.quantize_weight_128x128`` (bitwise).

    Grid: (cdiv(N, 128), Kd // 128, E); one program per block.

    Args:
        w: (E, N, Kd) fp32 / bf16 / fp16 contiguous; Kd a multiple of 128, any N.
        nonfinite_count, out, scale_out, name: as in ``quantize_act_1x128``; shapes (E, N, Kd) and
            (E, cdiv(N, 128), Kd // 128).

    Returns:
        (w_fp8 (E, N, Kd) float8_e4m3fn, scale (E, cdiv(N, 128), Kd // 128) fp32).

    Raises:
        ValueError: Kd not a multiple of 128 (use precision = 'bf16'), wrong dtype / shape / device /
            contiguity.

    Host syncs: none.
    """
    fn = "quantize_weight_128x128"
    E, N, Kd, count = _weight_args(fn, w, nonfinite_count, name)
    out = _out_buffer(fn, "out", out, (E, N, Kd), FP8_DTYPE, w.device)
    scale_out = _out_buffer(fn, "scale_out", scale_out, (E, cdiv(N, GROUP), Kd // GROUP), torch.float32, w.device)
    _launch_weight(w, out, scale_out, None, None, count)
    return out, scale_out


def _weight_args(fn: str, w: Tensor, nonfinite_count: Tensor | None, name: str | None):
    """The weight quantizers' checks: (E, N, Kd, the count or None). Raises ValueError naming ``fn``."""
    _check_tensor(fn, name or "w", w, 3, _INPUT_DTYPES)
    E, N, Kd = w.shape
    check_group_dim(Kd, "reduction dim Kd (last dim)", fn, name)
    count, _ = _count_arg(fn, nonfinite_count, w.device)
    if E > 65535 or Kd // GROUP > 65535:
        raise ValueError(f"{fn}: E={E} and Kd/128={Kd // GROUP} must be <= 65535 (CUDA grid limit)")
    return E, N, Kd, count


def _launch_weight(w: Tensor, q: Tensor | None, s: Tensor | None, qt: Tensor | None, st: Tensor | None,
                   count: Tensor | None) -> None:
    """One program per 128x128 block of w (E, N, Kd): q / s as it lies and / or qt / st transposed (None: not
    stored; an unused pointer gets another output tensor, never written)."""
    E, N, Kd = w.shape
    if E == 0 or N == 0:
        return
    some = q if q is not None else qt
    some_s = s if s is not None else st
    launch(_quant_weight_128x128_kernel, (cdiv(N, GROUP), Kd // GROUP, E),
        w, some, some_s, some_s if count is None else count, qt if qt is not None else some,
        st if st is not None else some_s,
        N=N, Kd=Kd, CHECK=count is not None, EXACT_ROUND=interpret_mode(), EPS=AMAX_EPS, FORWARD=q is not None,
        TRANSPOSED=qt is not None, num_warps=_W_WARPS,
    )


def quantize_weight_128x128_t(
    w: Tensor,
    *,
    forward: bool = True,
    nonfinite_count: Tensor | None = None,
    name: str | None = None,
) -> tuple[Tensor | None, Tensor | None, Tensor, Tensor]:
    """128x128 FP8 quantization of expert weights and of their transpose, in one pass over ``w``.

    The transposed copy is the K-major B operand of the FP8 dgrads (FP8 wgmma reads K-major operands only). It is
    stored from the block the program quantized, so it equals ``quantize_weight_128x128(w)`` transposed and, where N
    is a multiple of 128, ``fp8_reference.quantize_weight_128x128(w.transpose(1, 2))``, bit for bit (a 128x128
    block's amax does not depend on its orientation). Why: ``q.transpose(1, 2).contiguous()`` of a 1-byte tensor was
    PyTorch's strided copy, 4.1 of the 4.7 ms the three 30B expert weights took per optimizer step on an H100
    (``bench_fp8_30b_s22e_1xh100_20261206``, ``quant_weights_fwd_and_t`` against ``quant_weights_128x128_only``).

    Grid: (cdiv(N, 128), Kd // 128, E); one program per block.

    Args:
        w: (E, N, Kd) fp32 / bf16 / fp16 contiguous; Kd a multiple of 128, any N.
        forward: also return the block-quantized w as it lies (precision "fp8"'s forward operand); False
            ("fp8_bwd"): only the transposed copy is written.
        nonfinite_count, name: as in ``quantize_act_1x128`` (each non-finite block counted once).

    Returns:
        (w_fp8 (E, N, Kd), scale (E, cdiv(N, 128), Kd // 128)) or (None, None) without ``forward``, then
        (wT_fp8 (E, Kd, N) float8_e4m3fn, scale_t (E, Kd // 128, cdiv(N, 128)) fp32).

    Raises:
        ValueError: Kd not a multiple of 128 (use precision = 'bf16'), wrong dtype / shape / device / contiguity.

    Host syncs: none.
    """
    fn = "quantize_weight_128x128_t"
    E, N, Kd, count = _weight_args(fn, w, nonfinite_count, name)
    dev, Nb = w.device, cdiv(N, GROUP)
    wt = torch.empty((E, Kd, N), dtype=FP8_DTYPE, device=dev)
    st = torch.empty((E, Kd // GROUP, Nb), dtype=torch.float32, device=dev)
    q = torch.empty((E, N, Kd), dtype=FP8_DTYPE, device=dev) if forward else None
    s = torch.empty((E, Nb, Kd // GROUP), dtype=torch.float32, device=dev) if forward else None
    _launch_weight(w, q, s, wt, st, count)
    return q, s, wt, st


assert FP8_MAX == 448.0  # the kernels spell 448 out as a literal
