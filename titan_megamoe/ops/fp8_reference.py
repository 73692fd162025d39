"""Blockwise FP8 (e4m3) quantization in pure PyTorch: the oracle of ``kernels/fp8_quant.py``.

DeepSeek-V3-style scaling for FP8 training on Hopper (DESIGN.md section 6): activations get one scale
per (row, 128 consecutive channels), weights one per 128 x 128 block, and the weight-gradient GEMM,
which reduces over rows, gets activations scaled per (128 consecutive rows, column).

Shape legend:
    M   rows (tokens, or rows of the expert-major layout)     D   channels (the 1x128 reduction dim)
    E   experts     N   weight output rows     Kd  weight reduction dim (last dim)
    G = 128, the group / block edge

API contract (other modules build on these exact layouts):
    quantize_act_1x128(x (M, D))         -> x_fp8 (M, D) e4m3fn, scale (M, D // G) fp32, row-major
    quantize_act_128x1(x (M, D))         -> x_fp8 (M, D) e4m3fn, scale (ceil(M / G), D) fp32
    quantize_weight_128x128(w (E, N, Kd)) -> w_fp8 (E, N, Kd) e4m3fn, scale (E, ceil(N / G), Kd // G) fp32
    dequantization: value ~= fp8.float() * scale of its group (``dequantize_*``).

Math, per group g (the same in every function and in the Triton kernels, bit for bit)::

    amax  = max(max_{i in g} |x_i|, AMAX_EPS)          # fp32; NaN in the group -> NaN
    scale = amax / 448                                  # fp32, IEEE division (round to nearest)
    q_i   = e4m3fn(clamp(x_i / scale, -448, 448))       # IEEE division, then round to nearest even

x is read as fp32 (bf16 -> fp32 is exact). The clamp makes the cast saturating: |x_i / scale| <= 448
holds mathematically, but the two roundings can land a hair above 448, and torch's e4m3fn cast is
not guaranteed to saturate (e4m3fn has no inf: an overflow is NaN). Dequantization multiplies back:
``q_i * scale`` (fp32). Rows past M (128x1) and rows past N (weights) are not part of any group's
max: a group at the edge covers only the rows that exist, exactly as if the tensor were zero-padded.

``AMAX_EPS = 1e-12`` (torchao's blockwise FP8 training kernels use the same; DeepGEMM's test helpers use
1e-4). It only matters for groups whose amax is below it, where it keeps the scale finite and nonzero
(an all-zero group gets scale 1e-12 / 448 ~ 2.2e-15 and quantizes to exact zeros). It is this small
because the same quantizer serves gradients (fp8_bwd): bf16 training without loss scaling has
gradient groups with amax around 1e-6..1e-9, and an epsilon of 1e-4 would map such a group's largest
value to 448 * amax / 1e-4 < 0.01, deep in e4m3's subnormals (step 2^-9), i.e. a few bits of
precision instead of e4m3's full 3-bit mantissa. 1e-12 keeps every scale a normal fp32 number (2.2e-15),
its reciprocal finite (2.2e-15^-1 ~ 4.5e14) and the product of an activation and a weight scale
normal too (~5e-30 > 1.2e-38), so the scaled GEMM's epilogue cannot underflow to zero or overflow.

Non-finite input: a group containing inf or NaN gets an inf or NaN scale (no finite input can give a
non-finite scale: amax <= 3.4e38 -> scale <= 7.6e35). These functions raise ``ValueError`` for it,
naming the tensor (``name=``), the number of such groups and the first one; pass
``check_finite=False`` to get the (garbage) result instead. The values q of such a group are not
specified (the Triton kernels may differ there; they report it through a device flag instead).

This module holds the shared constants and error texts; the Triton launchers import them, so the
kernels and the oracle cannot drift apart. Host syncs: the finiteness check (one ``.any()``), by
design of an oracle; the fused path never syncs.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "FP8_DTYPE",
    "FP8_MAX",
    "AMAX_EPS",
    "GROUP",
    "quantize_act_1x128",
    "quantize_act_128x1",
    "quantize_weight_128x128",
    "dequantize_act_1x128",
    "dequantize_act_128x1",
    "dequantize_weight_128x128",
    "check_group_dim",
    "nonfinite_message",
]

#: FP8 storage type of activations, weights and (fp8_bwd) gradients.
FP8_DTYPE = torch.float8_e4m3fn
#: Largest finite e4m3fn value (torch.finfo(torch.float8_e4m3fn).max).
FP8_MAX = 448.0
#: Lower clamp of each group's amax (see the module docstring for the choice).
AMAX_EPS = 1e-12
#: Edge of a scaling group / block.
GROUP = 128

_FLOAT_INPUTS = (torch.float32, torch.bfloat16, torch.float16)


# --------------------------------------------------------------------------------------------------
# Checks and messages shared with the Triton launchers
# --------------------------------------------------------------------------------------------------


def check_group_dim(size: int, dim_desc: str, fn: str, name: str | None) -> None:
    """Raise ``ValueError`` unless ``size`` is a positive multiple of 128.

    Args:
        size: the dim's length.
        dim_desc: what the dim is, e.g. "channel dim D (last dim)".
        fn: the calling function, for the message.
        name: the tensor / layer, for the message (None: "input").
    """
    if size > 0 and size % GROUP == 0:
        return
    raise ValueError(
        f"{fn}: {name or 'input'} has {dim_desc} = {size}, not a positive multiple of {GROUP}. Blockwise FP8 "
        f"scales groups of {GROUP} along it (1x{GROUP} activations, {GROUP}x{GROUP} weights), so FP8 "
        f"cannot run on this shape: use precision = 'bf16' for this model (or a model whose dims are "
        f"multiples of {GROUP})."
    )


def nonfinite_message(name: str | None, n_bad: int, n_groups: int | None = None, where: str = "") -> str:
    """Text of the non-finite-scale error (also used with the Triton launchers' device counter)."""
    of = f" of {n_groups}" if n_groups is not None else ""
    return (
        f"{name or 'input'}: {n_bad}{of} FP8 scaling groups have a non-finite amax (inf or NaN in "
        f"the input){where}, so their FP8 scale is inf/nan and the FP8 result would be garbage. The tensor "
        f"itself is broken (overflow or NaN upstream, e.g. a diverging loss), not the FP8 path: "
        f"precision = 'bf16' would propagate the same inf/nan."
    )


def _check_input(x: Tensor, ndim: int, fn: str, name: str | None) -> None:
    if x.dim() != ndim:
        raise ValueError(f"{fn}: {name or 'input'} must have {ndim} dims, got shape {tuple(x.shape)}")
    if x.dtype not in _FLOAT_INPUTS:
        raise ValueError(f"{fn}: {name or 'input'} must be fp32, bf16 or fp16, got {x.dtype}")


def _raise_if_nonfinite(scale: Tensor, name: str | None, index_names: tuple[str, ...]) -> None:
    bad = ~torch.isfinite(scale)
    if bool(bad.any()):  # host sync: fine for the oracle
        first = [int(i) for i in bad.nonzero()[0]]
        where = " (first at " + ", ".join(f"{k} {v}" for k, v in zip(index_names, first)) + ")"
        raise ValueError(nonfinite_message(name, int(bad.sum()), scale.numel(), where))


def _scale_of(amax: Tensor) -> Tensor:
    """scale = max(amax, eps) / 448 in fp32. Division by a tensor, not a Python scalar: CUDA's
    ``tensor / cpu_scalar`` is computed as a multiplication by the reciprocal, which can differ from
    the IEEE quotient in the last bit; a tensor divisor gives the IEEE quotient on every device."""
    amax = amax.clamp(min=AMAX_EPS)  # NaN stays NaN
    return amax / torch.full_like(amax, FP8_MAX)


def _quantize(xf: Tensor, scale: Tensor) -> Tensor:
    """e4m3fn(clamp(x / scale, -448, 448)), scale already broadcast to xf's shape."""
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


# --------------------------------------------------------------------------------------------------
# Quantization
# --------------------------------------------------------------------------------------------------


def quantize_act_1x128(
    x: Tensor,
    row_index: Tensor | None = None,
    top_k: int = 1,
    *,
    name: str | None = None,
    check_finite: bool = True,
) -> tuple[Tensor, Tensor]:
    """Per-(row, 128 channels) FP8 quantization of activations, optionally of gathered rows.

    Args:
        x: (M_in, D) fp32 / bf16 / fp16; D a multiple of 128.
        row_index: optional (M,) integer: output row i is ``x[row_index[i] // top_k]``, or a zero row
            where ``row_index[i] < 0`` (the dispatch quantizes straight into the expert-major layout:
            pass ``layout.row_pair`` and K). None: M = M_in, rows as they are.
        top_k: divisor of ``row_index`` (1: it holds source rows).
        name: tensor / layer named in error messages.
        check_finite: raise for inf/NaN input (host sync); False returns the garbage result.

    Returns:
        x_fp8: (M, D) float8_e4m3fn; scale: (M, D // 128) fp32, row-major, ``x ~= x_fp8 * scale``
        broadcast over each group's 128 columns. Zero rows (index -1, or zero input) get
        scale ``AMAX_EPS / 448`` and exact zeros.

    Raises:
        ValueError: D not a multiple of 128 (use precision = 'bf16'), wrong dims / dtype, or a
            non-finite scale (inf / NaN in x), naming ``name``.

    Example: a row of 128 values with max |x| = 448 has scale 1.0 and x_fp8 = e4m3fn(x); the row
    [896, 0, ..., 0] has scale 2.0 and x_fp8 [448, 0, ...].
    """
    fn = "quantize_act_1x128"
    _check_input(x, 2, fn, name)
    M_in, D = x.shape
    check_group_dim(D, "channel dim D (last dim)", fn, name)
    xf = x.float()
    if row_index is not None:
        if row_index.dim() != 1 or row_index.dtype.is_floating_point:
            raise ValueError(f"{fn}: row_index must be a 1-D integer tensor, got {row_index.dtype} "
                             f"{tuple(row_index.shape)}")
        if top_k < 1:
            raise ValueError(f"{fn}: top_k={top_k} must be >= 1")
        live = row_index >= 0
        src = torch.where(live, row_index.long() // top_k, 0)
        if M_in == 0:  # nothing to gather: only negative indices are valid
            xf = xf.new_zeros(row_index.shape[0], D)
        else:
            xf = torch.where(live[:, None], xf[src], 0.0)
    M = xf.shape[0]
    xg = xf.view(M, D // GROUP, GROUP)
    scale = _scale_of(xg.abs().amax(dim=2))  # (M, D // G)
    if check_finite:
        _raise_if_nonfinite(scale, name, ("row", "channel group"))
    x_fp8 = _quantize(xg, scale[:, :, None]).view(M, D)
    return x_fp8, scale


def quantize_act_128x1(
    x: Tensor,
    row_valid: Tensor | None = None,
    *,
    name: str | None = None,
    check_finite: bool = True,
) -> tuple[Tensor, Tensor]:
    """Per-(128 consecutive rows, column) FP8 quantization: the operand layout of the weight gradient.

    Rows [128*b, 128*b + 128) of column d form group (b, d). Rows past M, and rows with
    ``row_valid[i] == 0``, count as zero: they are left out of the group's max and quantize to 0.

    Args:
        x: (M, D) fp32 / bf16 / fp16, any D >= 1.
        row_valid: optional (M,) bool or integer mask (nonzero = valid), e.g. ``layout.row_pair >= 0``
            to ignore the padding rows of the expert-major layout.
        name, check_finite: as in ``quantize_act_1x128``.

    Returns:
        x_fp8: (M, D) float8_e4m3fn (row-major, like x); scale: (ceil(M / 128), D) fp32,
        ``x[i, d] ~= x_fp8[i, d] * scale[i // 128, d]``.

    Raises:
        ValueError: wrong dims / dtype, or a non-finite scale (inf / NaN in a valid row).
    """
    fn = "quantize_act_128x1"
    _check_input(x, 2, fn, name)
    M, D = x.shape
    xf = x.float()
    if row_valid is not None:
        if row_valid.shape != (M,) or row_valid.dtype.is_floating_point:
            raise ValueError(f"{fn}: row_valid must be a bool / integer tensor of shape ({M},), got "
                             f"{row_valid.dtype} {tuple(row_valid.shape)}")
        xf = torch.where(row_valid[:, None] != 0, xf, 0.0)
    Mb = -(-M // GROUP)
    xp = torch.zeros(Mb * GROUP, D, dtype=torch.float32, device=x.device)
    xp[:M] = xf
    xg = xp.view(Mb, GROUP, D)
    scale = _scale_of(xg.abs().amax(dim=1))  # (Mb, D)
    if check_finite:
        _raise_if_nonfinite(scale, name, ("row block", "column"))
    x_fp8 = _quantize(xg, scale[:, None, :]).view(Mb * GROUP, D)[:M]
    return x_fp8.contiguous(), scale


def quantize_weight_128x128(
    w: Tensor,
    *,
    name: str | None = None,
    check_finite: bool = True,
) -> tuple[Tensor, Tensor]:
    """Per-128x128-block FP8 quantization of expert weights.

    Block (e, bn, bk) covers rows [128*bn, 128*bn + 128) (cut at N) and columns [128*bk, 128*bk + 128)
    of expert e. w1 / w3 are (E, F, D) and w2 is (E, D, F): the reduction dim of the forward GEMM is
    the last one, which must be a multiple of 128; N may be anything (the last row block is partial).

    Args:
        w: (E, N, Kd) fp32 / bf16 / fp16; Kd a multiple of 128.
        name, check_finite: as in ``quantize_act_1x128``.

    Returns:
        w_fp8: (E, N, Kd) float8_e4m3fn; scale: (E, ceil(N / 128), Kd // 128) fp32,
        ``w[e, n, k] ~= w_fp8[e, n, k] * scale[e, n // 128, k // 128]``.

    Raises:
        ValueError: Kd not a multiple of 128 (use precision = 'bf16'), wrong dims / dtype, or a
            non-finite scale (inf / NaN in w), naming ``name``.
    """
    fn = "quantize_weight_128x128"
    _check_input(w, 3, fn, name)
    E, N, Kd = w.shape
    check_group_dim(Kd, "reduction dim Kd (last dim)", fn, name)
    Nb, Kb = -(-N // GROUP), Kd // GROUP
    wp = torch.zeros(E, Nb * GROUP, Kd, dtype=torch.float32, device=w.device)
    wp[:, :N] = w.float()
    wg = wp.view(E, Nb, GROUP, Kb, GROUP)
    scale = _scale_of(wg.abs().amax(dim=(2, 4)))  # (E, Nb, Kb)
    if check_finite:
        _raise_if_nonfinite(scale, name, ("expert", "row block", "column block"))
    w_fp8 = _quantize(wg, scale[:, :, None, :, None]).view(E, Nb * GROUP, Kd)[:, :N]
    return w_fp8.contiguous(), scale


# --------------------------------------------------------------------------------------------------
# Dequantization
# --------------------------------------------------------------------------------------------------


def dequantize_act_1x128(x_fp8: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """(M, D) e4m3fn and (M, D // 128) fp32 scales -> (M, D) ``x_fp8.float() * scale`` in ``dtype``."""
    M, D = x_fp8.shape
    if scale.shape != (M, D // GROUP):
        raise ValueError(f"scale must be ({M}, {D // GROUP}), got {tuple(scale.shape)}")
    out = x_fp8.float().view(M, D // GROUP, GROUP) * scale[:, :, None]
    return out.view(M, D).to(dtype)


def dequantize_act_128x1(x_fp8: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """(M, D) e4m3fn and (ceil(M / 128), D) fp32 scales -> (M, D) in ``dtype``."""
    M, D = x_fp8.shape
    if scale.shape != (-(-M // GROUP), D):
        raise ValueError(f"scale must be ({-(-M // GROUP)}, {D}), got {tuple(scale.shape)}")
    return (x_fp8.float() * scale.repeat_interleave(GROUP, dim=0)[:M]).to(dtype)


def dequantize_weight_128x128(w_fp8: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """(E, N, Kd) e4m3fn and (E, ceil(N / 128), Kd // 128) fp32 scales -> (E, N, Kd) in ``dtype``."""
    E, N, Kd = w_fp8.shape
    if scale.shape != (E, -(-N // GROUP), Kd // GROUP):
        raise ValueError(f"scale must be ({E}, {-(-N // GROUP)}, {Kd // GROUP}), got {tuple(scale.shape)}")
    full = scale.repeat_interleave(GROUP, dim=1)[:, :N].repeat_interleave(GROUP, dim=2)
    return (w_fp8.float() * full).to(dtype)
