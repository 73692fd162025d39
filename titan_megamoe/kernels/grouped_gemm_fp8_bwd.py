"""Blockwise-FP8 backward grouped GEMMs of the fused SwiGLU MoE (DeepSeek-V3 recipe, arXiv 2412.19437
section 3.3, on Hopper): the same three steps and fusions as the bf16 backward
(``grouped_gemm_bwd.py`` / ``grouped_gemm_wgrad.py``), on e4m3 operands with fp32 block scales applied
per 128-wide K block (a fresh fp32 partial per K block, scaled, accumulated in fp32).

Shape legend:
    T   tokens        D   model dim        F   expert hidden dim        E   experts     K  top_k
    P = T*K pairs     N_cap rows of the padded expert-major layout, BM = 128 (see below)
    BN / BK  column / reduction block (BK = 128 = the scale block)     NB = cdiv(F, BN)

Operands (``fp8_quant.py``, ``fp8_quant_bwd.py`` and the weight cache of ``ops/fp8_backend.py`` produce them):

    1. ``gemm2_dgrad_swiglu_bwd_fp8``  g = dout[t] @ w2[e]            (reduction over D)
         A: dout_q (T, D) 1x128 (gathered by token in the prologue)
         B: w2t_q (E, F, D) = w2 transposed, 128x128 (its blocks are w2's blocks transposed, so the
            scales are w2's transposed: (E, F/128, D/128)); K-major, as Hopper's fp8 wgmma needs.
         epilogue (as the bf16 kernel): SwiGLU backward from the saved bf16 gate_up, d score partials
            <g, h> (h = bf16(silu(gate) * up), the bf16 h of the forward), dgate_up (N_cap, 2F) bf16;
            and s*h quantized 128x1 *in the epilogue* (the tile's 128 rows are one scale group),
            stored transposed: hsT_q (F, N_cap) + (N_cap/128, F) scales, the B operand of dw2. No
            bf16 s*h is written.
         (dgate_up's 1x128 / 128x1 quantization in this epilogue was built and measured slower, 3.12
            vs 2.15 ms at 30B on an H200, and removed: docs/NOTES.md, sessions 5-8.)
    2. ``gemm1_dgrad_fp8``  dx_rows[r] = dgate[r] @ w1[e] + dup[r] @ w3[e]   (reduction over 2F)
         A: dgate_up quantized 1x128 (N_cap, 2F); B: w1t_q, w3t_q (E, D, F) (transposed, K-major).
    3. ``wgrad_fp8``  dW[e] = sum_{rows r of e} aT[:, r] outer bT[:, r]   (reduction over the rows)
         dw2: aT = dout gathered + 128x1, transposed (D, N_cap); bT = hsT (F, N_cap) -> (E, D, F)
         dw1 | dw3: aT = dgate_up 128x1 transposed (2F, N_cap), bT = x gathered 128x1 transposed
         (D, N_cap) -> rows [0, F) of aT go to dw1, rows [F, 2F) to dw3 (``split=F``).
         Per K step (128 rows = one scale group of both operands): acc += dot * a_s[:, None] * b_s[None, :].

Scale groups along the rows never straddle two experts because the layout of the FP8 path has
BM = 128: every expert segment starts on a multiple of 128 and is padded to one (``routing.py``);
padding rows are exact zeros in every quantized operand. The launchers check ``layout.block_m == 128``.

What is exact: in the interpreter each kernel equals the fp32 math on the dequantized operands up to
fp32 rounding (tests/test_kernels_fp8_bwd.py checks it with the kernels' own quantized operands),
except the fused hs quantization, which is bitwise the 128x1 quantization of the fp32 s * h values.

Accumulation precision (compiled, sm_90): ``tl.dot`` of two fp8 operands keeps all 128 products of a
K step in the wgmma accumulator (Triton's ``max_num_imprecise_acc`` default on sm_90 is 2^30; the PTX
chains the four k32 wgmmas of a step), which on Hopper keeps ~13-14 mantissa bits and truncates
(DeepSeek-V3 section 3.3.2); the promotion to fp32 happens once per 128 (the scaled partial added to
the fp32 accumulator), exactly the DeepSeek-V3 recipe (N_C = 128). So against the fp32 math the
compiled kernels are ~1e-4 off (a model of that accumulator: 5e-5 .. 7e-4 on the test cases), not
fp32-exact: the most likely reason the wgrad tests' former fp32 bound (2e-5) failed on the H200
(hypothesis; scripts/gpu_fp8_debug.sh measures it, with and without the promotion below).
``wgrad_fp8(..., _max_imprecise_acc=32)`` promotes after every k32 wgmma (diagnosis only).

Deterministic (no atomics except the non-finite counter, fixed orders), no host sync. Dims are
constexpr; the interpreter (``TRITON_INTERPRET=1``) runs fp8 ``tl.dot`` natively, and the in-epilogue
quantization rounds to the e4m3 grid first (``EXACT_ROUND``, as ``fp8_quant.py``).

Launch configs (Hopper, reasoned as in ``grouped_gemm_fp8.py``; not measured yet): 128 x 128 x 128,
8 warps, 4 stages (32 KiB of operands per stage) for all three; the sm_90a compile test checks e4m3
wgmma, no mma.sync fallback and no spills (GEMM2 dgrad: 217 registers; with the dgate_up quantization
255 and no spills at both the 30B and 235B shapes: at the limit; its speed is not measured yet).
Predicted speed: as the FP8 forward (wgmma.wait_group 0 per K block while the partial is scaled):
~550-700 TF/s vs ~450-520 for the bf16 backward kernels.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from titan_megamoe.kernels._bwd_common import _check, _check_layout
from titan_megamoe.kernels.configs import GemmConfig, _pow2_at_most
from titan_megamoe.kernels.fp8_quant import _amax, _scale_of, _to_e4m3_rcp
from titan_megamoe.kernels.fp8_quant_bwd import _check_transposed, empty_transposed
from titan_megamoe.kernels.grouped_gemm import interpret_mode
from titan_megamoe.kernels.launch import launch
from titan_megamoe.kernels.jit import cdiv, env_choice, env_flag, grouped_tile
from titan_megamoe.kernels.jit import interp_int as _interp_int
from titan_megamoe.kernels.routing import RoutingLayout
from titan_megamoe.ops.fp8_reference import AMAX_EPS, FP8_DTYPE, GROUP

__all__ = [
    "HOPPER_GEMM2_DGRAD_FP8", "HOPPER_GEMM2_DGRAD_FP8_2CTA", "HOPPER_GEMM1_DGRAD_FP8", "HOPPER_WGRAD_FP8",
    "fp8_bwd_config_for",
    "gemm2_dgrad_swiglu_bwd_fp8", "gemm1_dgrad_fp8", "wgrad_fp8",
]

HOPPER_GEMM2_DGRAD_FP8 = GemmConfig(block_m=128, block_n=128, block_k=128, num_warps=8, num_stages=4, group_m=1)
HOPPER_GEMM1_DGRAD_FP8 = GemmConfig(block_m=128, block_n=128, block_k=128, num_warps=8, num_stages=4, group_m=8)
HOPPER_WGRAD_FP8 = GemmConfig(block_m=128, block_n=128, block_k=128, num_warps=8, num_stages=4, group_m=1)
#: The GEMM2 dgrad at two programs per SM (BN 64, 128 registers, 3 stages: ~72 KiB), so one program's per-K-block
#: promotion and epilogue run under the other's MMAs (as the bf16 ``configs.HOPPER_GEMM2_DGRAD_2CTA``). One H100, 30B:
#: 1.129 ms against 1.197 for the one-per-SM default (``sweep_g2d_fp8_1xh100_s26b_20261206.json``).
HOPPER_GEMM2_DGRAD_FP8_2CTA = GemmConfig(block_m=128, block_n=64, block_k=128, num_warps=8, num_stages=3, group_m=1,
                                         maxnreg=128)
#: ``TITAN_MEGAMOE_GEMM2_DGRAD_FP8_2CTA`` (read at import; a same-process switch, ``fp8_bwd_config_for`` is cleared
#: with it): "auto" (default) takes HOPPER_GEMM2_DGRAD_FP8_2CTA for model dims in [GEMM2_DGRAD_FP8_2CTA_DIMS), "1"
#: for every dim, "0" never. Layer on one H100, same process (``layer_1xh100_ep1_{30b,235b}_s26c_20261206.json``,
#: ``..._fp8_s26d_...``): 30B (D = 2048) fp8 7.138 -> 7.017 and 7.186 -> 7.118 ms, 235B (D = 4096) 22.84 -> 23.14 and
#: 22.59 -> 23.31: at D = 4096 the K loop is twice as long, so the epilogue weighs less, and BN 64 reads the gathered
#: dout rows twice as often. Other dims were not measured, so "auto" keeps the one-per-SM config there.
GEMM2_DGRAD_FP8_2CTA = env_choice("TITAN_MEGAMOE_GEMM2_DGRAD_FP8_2CTA", "auto", ("auto", "1", "0"))
GEMM2_DGRAD_FP8_2CTA_DIMS = (2048, 4096)


# --------------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------------


@triton.jit
def _gemm2_dgrad_swiglu_bwd_fp8_kernel(
    dout_ptr,  # (T, D) e4m3, gathered by token
    douts_ptr,  # (T, D // 128) fp32
    w2t_ptr,  # (E, F, D) e4m3, w2 transposed (K-major B)
    w2ts_ptr,  # (E, NB_F, D // 128) fp32
    gate_up_ptr,  # (N_cap, 2F) bf16, saved pre-activations
    scores_ptr,  # (P,) fp32
    row_pair_ptr,  # (N_cap,) int32
    tile_expert_ptr,  # (n_tiles,) int32
    dgate_up_ptr,  # (N_cap, 2F) bf16 out
    dscore_part_ptr,  # (N_cap, NB) fp32 out
    hsT_ptr,  # (F, N_cap) e4m3 out, (s * h) transposed, 128x1 scaled, row stride LD_HS; HS_ROWS: (N_cap, F) bf16
    hsTs_ptr,  # (N_cap // 128, F) fp32 out (not written with HS_ROWS)
    count_ptr,  # (1,) int32, += non-finite hs groups (CHECK)
    n_tiles,  # i32
    LD_HS,  # i32, row stride of hsT (fp8_quant_bwd.transposed_ld)
    D: tl.constexpr, F: tl.constexpr, K: tl.constexpr, NB: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    CHECK: tl.constexpr, EXACT_ROUND: tl.constexpr, EPS: tl.constexpr,
    HS_ROWS: tl.constexpr = False,  # s * h as bf16 rows for the bf16 wgrads instead of 128x1-quantized, transposed
):
    """FP8 g = dout[t] @ w2[e]; SwiGLU backward, d score partials, fused 128x1 quantization of s * h.

    Grid: (n_tiles * NB,), grouped order. The program of (row tile m, column block n) owns
    dgate_up[m*BM:(m+1)*BM, n*BN:(n+1)*BN] (and + F), dscore_part[rows, n], hsT[cols, rows] and
    hsTs[m, cols]. BM = 128 = one row scale group. Tiles of expert -1 are left unwritten.
    """
    KB: tl.constexpr = D // BK
    NBW: tl.constexpr = (F + BK - 1) // BK  # weight scale blocks along F
    pid = tl.program_id(0)
    pid_m, pid_n = grouped_tile(pid, n_tiles, NB, GROUP_M)
    rows = pid_m * BM + tl.arange(0, BM)
    rows64 = rows.to(tl.int64)  # int64: N_cap * 2F can pass 2^31
    cols = pid_n * BN + tl.arange(0, BN)
    e = tl.load(tile_expert_ptr + pid_m)
    if e < 0:  # tile past the last expert: read by no consumer (end_row, expert segments); at EP = 2
        return  # half the receive capacity's tiles (2.08 ms there vs 1.32 at EP = 1 with their zeros)
    pair = tl.load(row_pair_ptr + rows)
    valid = pair >= 0
    offs_k = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    if e >= 0:
        tok64 = tl.where(valid, pair // K, 0).to(tl.int64)  # int64: T * D can pass 2^31
        a_ptrs = dout_ptr + tok64[:, None] * D + offs_k[None, :]
        as_ptrs = douts_ptr + tok64 * KB
        # (BK, BN) K-major tile of w2t[e] (int64: E * F * D passes 2^31 at 235B shapes)
        b_ptrs = w2t_ptr + (e * F + pid_n * BN).to(tl.int64) * D + tl.arange(0, BN)[None, :] * D + offs_k[:, None]
        b_mask = (cols < F)[None, :]
        ws_off = (e * NBW + (pid_n * BN) // BK) * KB
        for kb in range(0, KB):
            a = tl.load(a_ptrs, mask=valid[:, None], other=0.0)
            a_s = tl.load(as_ptrs + kb, mask=valid, other=0.0)
            b = tl.load(b_ptrs, mask=b_mask, other=0.0)
            b_s = tl.load(w2ts_ptr + ws_off + kb)
            acc += tl.dot(a, b) * (a_s * b_s)[:, None]  # fresh fp32 partial per K block, scaled
            a_ptrs += BK
            b_ptrs += BK

    # Epilogue in two column halves (as the bf16 kernel: halves the live fp32 tiles)
    s = tl.load(scores_ptr + pair, mask=valid, other=0.0)
    g_lo, g_hi = tl.split(tl.permute(tl.reshape(acc, (BM, 2, BN // 2)), (0, 2, 1)))
    dscore = tl.zeros((BM,), dtype=tl.float32)
    for half in tl.static_range(2):
        g = g_lo if half == 0 else g_hi
        hc = pid_n * BN + half * (BN // 2) + tl.arange(0, BN // 2)
        hc_ok = hc < F
        keep = valid[:, None] & hc_ok[None, :]
        off = rows64[:, None] * (2 * F) + hc[None, :]
        gate = tl.load(gate_up_ptr + off, mask=keep, other=0.0).to(tl.float32)
        up = tl.load(gate_up_ptr + off + F, mask=keep, other=0.0).to(tl.float32)
        sig = 1.0 / (1.0 + tl.exp(-gate))  # not tl.sigmoid (interpreter pitfall, grouped_gemm_bwd.py)
        silu = gate * sig
        h = (silu * up).to(tl.bfloat16).to(tl.float32)  # the bf16 h of the forward
        dscore += tl.sum(tl.where(keep, g * h, 0.0), axis=1)  # fixed order: lower half first
        dh = g * s[:, None]
        dgate = dh * up * (sig * (1.0 + gate * (1.0 - sig)))
        tl.store(dgate_up_ptr + off, tl.where(keep, dgate, 0.0).to(tl.bfloat16), mask=hc_ok[None, :])
        tl.store(dgate_up_ptr + off + F, tl.where(keep, dh * silu, 0.0).to(tl.bfloat16), mask=hc_ok[None, :])
        hs = tl.where(keep, silu * up * s[:, None], 0.0)
        if HS_ROWS:  # bf16 rows, the bf16 GEMM2 dgrad's hs_out (same formula and rounding): B of the bf16 dw2
            tl.store(hsT_ptr + rows64[:, None] * F + hc[None, :], hs.to(hsT_ptr.dtype.element_ty), mask=hc_ok[None, :])
        else:  # quantized per (these 128 rows, column): the B operand of the FP8 dw2, transposed
            sc_1C = _scale_of(_amax(hs, 0), EPS)  # (1, BN/2)
            q = _to_e4m3_rcp(hs, sc_1C, EXACT_ROUND)
            # int64: col * LD_HS passes 2^31 at full shapes
            tl.store(hsT_ptr + hc.to(tl.int64)[None, :] * LD_HS + rows64[:, None], q, mask=hc_ok[None, :])
            sc = tl.reshape(sc_1C, (BN // 2,))
            tl.store(hsTs_ptr + pid_m.to(tl.int64) * F + hc, sc, mask=hc_ok)
            if CHECK:
                n_bad = tl.sum((hc_ok & ~(sc < float("inf"))).to(tl.int32))
                tl.atomic_add(count_ptr, n_bad, mask=n_bad > 0)
    tl.store(dscore_part_ptr + rows64 * NB + pid_n, dscore)


@triton.jit
def _gemm1_dgrad_fp8_kernel(
    dgu_ptr,  # (N_cap, 2F) e4m3, dgate_up 1x128
    dgus_ptr,  # (N_cap, 2F // 128) fp32
    w1t_ptr,  # (E, D, F) e4m3, w1 transposed (K-major B)
    w1ts_ptr,  # (E, NB_D, F // 128) fp32
    w3t_ptr,  # (E, D, F) e4m3
    w3ts_ptr,  # (E, NB_D, F // 128) fp32
    row_pair_ptr,  # (N_cap,) int32
    tile_expert_ptr,  # (n_tiles,) int32
    dx_rows_ptr,  # (N_cap, D) bf16 out
    n_tiles,  # i32
    D: tl.constexpr, F: tl.constexpr, NBD: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
):
    """FP8 dx_rows[r] = dgate[r] @ w1[e] + dup[r] @ w3[e], one fp32 accumulator over 2F.

    Grid: (n_tiles * NBD,), NBD = cdiv(D, BN), grouped order; program (m, n) owns
    dx_rows[m*BM:(m+1)*BM, n*BN:(n+1)*BN]; padding rows get zeros, tiles of expert -1 are left unwritten.
    """
    KBF: tl.constexpr = F // BK
    NBW: tl.constexpr = (D + BK - 1) // BK  # weight scale blocks along D
    pid = tl.program_id(0)
    pid_m, pid_n = grouped_tile(pid, n_tiles, NBD, GROUP_M)
    rows = pid_m * BM + tl.arange(0, BM)
    rows64 = rows.to(tl.int64)  # int64: N_cap * 2F and N_cap * D can pass 2^31
    cols = pid_n * BN + tl.arange(0, BN)
    col_ok = cols < D
    e = tl.load(tile_expert_ptr + pid_m)
    if e < 0:  # tile past the last expert: read by no consumer (dx is gathered by pair_row)
        return
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    if e >= 0:
        offs_k = tl.arange(0, BK)
        b_off = (e * D + pid_n * BN).to(tl.int64) * F + tl.arange(0, BN)[None, :] * F + offs_k[:, None]
        ws_off = (e * NBW + (pid_n * BN) // BK) * KBF
        for half in tl.static_range(2):  # half 0: dgate x w1, half 1: dup x w3
            a_ptrs = dgu_ptr + rows64[:, None] * (2 * F) + half * F + offs_k[None, :]
            as_ptrs = dgus_ptr + rows64 * (2 * KBF) + half * KBF
            for kb in range(0, KBF):
                a = tl.load(a_ptrs)
                a_s = tl.load(as_ptrs + kb)
                if half == 0:
                    b = tl.load(w1t_ptr + b_off + kb * BK, mask=col_ok[None, :], other=0.0)
                    b_s = tl.load(w1ts_ptr + ws_off + kb)
                else:
                    b = tl.load(w3t_ptr + b_off + kb * BK, mask=col_ok[None, :], other=0.0)
                    b_s = tl.load(w3ts_ptr + ws_off + kb)
                acc += tl.dot(a, b) * (a_s * b_s)[:, None]
                a_ptrs += BK
    valid = tl.load(row_pair_ptr + rows) >= 0
    tl.store(dx_rows_ptr + rows64[:, None] * D + cols[None, :], tl.where(valid[:, None], acc, 0.0).to(tl.bfloat16),
             mask=col_ok[None, :])


@triton.jit
def _wgrad_fp8_kernel(
    aT_ptr,  # (MA, N_cap) e4m3, 128x1 scaled, transposed (K-major), row stride LDA
    as_ptr,  # (N_cap // 128, MA) fp32
    bT_ptr,  # (NC, N_cap) e4m3, 128x1 scaled, transposed (K-major), row stride LDB
    bs_ptr,  # (N_cap // 128, NC) fp32
    offsets_ptr,  # (E + 1,) int32, first row of each expert (multiples of 128)
    out1_ptr,  # (E, M1, NC) bf16 | fp32 out: rows [0, M1) of the product
    out2_ptr,  # (E, MA - M1, NC) bf16 | fp32 out: rows [M1, MA) (unused when M1 == MA)
    LDA,  # i32, row strides of aT / bT (>= N_cap, multiples of 16)
    LDB,
    MA: tl.constexpr, M1: tl.constexpr, NC: tl.constexpr, NBM: tl.constexpr, NBN: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, INTERPRET: tl.constexpr,
    MAX_IMPRECISE: tl.constexpr,
):
    """dW[e][m, n] = sum_{r in e} aT[m, r] bT[n, r] with 128x1 scales, K-grouped over the expert's rows.

    Grid: (NBM * NBN, E), grouped order within an expert; program (m, n, e) owns one BM x BN tile of
    out1[e] (m*BM < M1) or out2[e] and loops over rows offsets[e]..offsets[e+1] in 128-row steps (one
    scale group each; bounds read on device, no host sync); no rows -> zeros.
    """
    pid = tl.program_id(0)
    e = tl.program_id(1)
    pid_m, pid_n = grouped_tile(pid, NBM, NBN, GROUP_M)
    mm = pid_m * BM + tl.arange(0, BM)
    nn = pid_n * BN + tl.arange(0, BN)
    m_ok = mm < MA
    n_ok = nn < NC
    offs_k = tl.arange(0, BK)
    # multiples of 128 (BM = 128 layout): telling the compiler lets it pipeline 16-byte cp.async loads
    start = tl.multiple_of(tl.load(offsets_ptr + e), 128)
    end = tl.multiple_of(tl.load(offsets_ptr + e + 1), 128)
    a_base = aT_ptr + mm.to(tl.int64)[:, None] * LDA + offs_k[None, :]  # int64: MA * LDA
    b_base = bT_ptr + nn.to(tl.int64)[None, :] * LDB + offs_k[:, None]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    # Interpreter: range() over a runtime scalar fails with numpy >= 2.3 (see grouped_gemm_wgrad.py).
    for r0 in range(_interp_int(start) if INTERPRET else start, _interp_int(end) if INTERPRET else end, BK):
        a = tl.load(a_base + r0, mask=m_ok[:, None], other=0.0)
        b = tl.load(b_base + r0, mask=n_ok[None, :], other=0.0)
        g = r0 // BK  # the scale group of these 128 rows (N_cap / 128 * MA < 2^31: int32 is enough)
        a_s = tl.load(as_ptr + g * MA + mm, mask=m_ok, other=0.0)
        b_s = tl.load(bs_ptr + g * NC + nn, mask=n_ok, other=0.0)
        # MAX_IMPRECISE None: sm_90's default, all 128 products of the step in the wgmma accumulator
        # (~13-bit mantissa, not fp32: module docstring "Accumulation precision"); 32: fp32 promotion
        # after every k32 wgmma (diagnosis only, scripts/fp8_ablation.py)
        acc += (tl.dot(a, b, max_num_imprecise_acc=MAX_IMPRECISE) * a_s[:, None]) * b_s[None, :]
    msk = m_ok[:, None] & n_ok[None, :]
    if pid_m * BM < M1:
        o = out1_ptr + (e.to(tl.int64) * M1 + mm[:, None]) * NC + nn[None, :]  # int64: E * M1 * NC
        tl.store(o, acc.to(out1_ptr.dtype.element_ty), mask=msk)
    else:
        o = out2_ptr + (e.to(tl.int64) * (MA - M1) + (mm[:, None] - M1)) * NC + nn[None, :]
        tl.store(o, acc.to(out2_ptr.dtype.element_ty), mask=msk)


# --------------------------------------------------------------------------------------------------
# Configs and launchers
# --------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)  # asked on every launch; fixed per (kind, D, F)
def fp8_bwd_config_for(kind: str, D: int, F: int, interpret: bool) -> GemmConfig:
    """Launch config of ``kind`` ("gemm2_dgrad", "gemm1_dgrad", "wgrad_w2", "wgrad_w13").

    BM = 128 for the dgrad kernels (the layout's block = one row scale group); BK = 128 (the scale
    block). Interpreter: BN = 32 (several programs per weight scale block), wgrad 64 x 64.
    """
    if kind not in ("gemm2_dgrad", "gemm1_dgrad", "wgrad_w2", "wgrad_w13"):
        raise ValueError(f"fp8_bwd_config_for: unknown kind {kind!r}; choose gemm2_dgrad, gemm1_dgrad, "
                         "wgrad_w2 or wgrad_w13")
    wgrad = kind.startswith("wgrad")
    if interpret:
        if wgrad:
            return GemmConfig(block_m=GROUP, block_n=GROUP, block_k=GROUP, num_warps=1, num_stages=1, group_m=2)
        return GemmConfig(block_m=GROUP, block_n=64, block_k=GROUP, num_warps=1, num_stages=1, group_m=2)
    if kind == "gemm2_dgrad":
        lo, hi = GEMM2_DGRAD_FP8_2CTA_DIMS
        if F % 64 == 0 and (GEMM2_DGRAD_FP8_2CTA == "1" or (GEMM2_DGRAD_FP8_2CTA == "auto" and lo <= D < hi)):
            return HOPPER_GEMM2_DGRAD_FP8_2CTA
        return dataclasses.replace(HOPPER_GEMM2_DGRAD_FP8, block_n=_pow2_at_most(F, 128))
    if kind == "gemm1_dgrad":
        return dataclasses.replace(HOPPER_GEMM1_DGRAD_FP8, block_n=_pow2_at_most(D, 128))
    m_dim, n_dim = (D, F) if kind == "wgrad_w2" else (2 * F, D)
    return dataclasses.replace(HOPPER_WGRAD_FP8, block_m=_pow2_at_most(m_dim, 128), block_n=_pow2_at_most(n_dim, 128))


def _check_bwd_config(cfg: GemmConfig, kind: str, layout: RoutingLayout | None = None) -> None:
    if cfg.block_k != GROUP:
        raise ValueError(f"{kind} fp8: config.block_k={cfg.block_k} must be {GROUP} (one scale per K step)")
    if cfg.block_n > GROUP:
        raise ValueError(f"{kind} fp8: config.block_n={cfg.block_n} must be <= {GROUP}")
    if layout is not None and cfg.block_m != layout.block_m:
        raise ValueError(f"{kind} fp8: config.block_m={cfg.block_m} must equal layout.block_m={layout.block_m}")


def _check_fp8_layout(layout: RoutingLayout, device) -> None:
    _check_layout(layout, device)
    if layout.block_m != GROUP:
        raise ValueError(
            f"the FP8 backward needs a routing layout with block_m = {GROUP} (got {layout.block_m}): its "
            "128-row scale groups must not straddle two experts' segments")


def _dims(name: str, value: int) -> None:
    if value % GROUP:
        raise ValueError(f"{name}={value} is not a multiple of {GROUP}: blockwise FP8 needs it; use "
                         "[megamoe] precision = 'bf16'")


def gemm2_dgrad_swiglu_bwd_fp8(
    dout_q: Tensor, dout_s: Tensor, w2t_q: Tensor, w2t_s: Tensor, gate_up: Tensor, scores_TK: Tensor,
    layout: RoutingLayout, config: GemmConfig | None = None, *, nonfinite_count: Tensor | None = None,
    hs_out: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
    """FP8 GEMM2 dgrad fused with the SwiGLU backward, the routing-score gradient and the 128x1
    quantization of s * h (the B operand of dw2), or with ``hs_out`` s * h as bf16 rows (the B operand of the
    bf16 dw2 of ``fp8_backend``'s bf16-wgrad mode).

    Per padded row r (pair p >= 0, token t, expert e), with dequantized operands:
    g = dout[t] @ w2[e] (fp32), dh = s[p] g, dgate = dh * up * silu'(gate), dup = dh * silu(gate),
    dscore_partial[r, j] = sum over columns j*BN..(j+1)*BN of g * bf16(silu(gate) * up).

    Args:
        dout_q: (T, D) float8_e4m3fn, dout quantized 1x128; dout_s: (T, D // 128) fp32.
        w2t_q: (E, F, D) float8_e4m3fn, w2 transposed; w2t_s: (E, cdiv(F, 128), D // 128) fp32.
        gate_up: (N_cap, 2F) bf16 saved by the forward; scores_TK: (T, K) fp32.
        layout: routing layout with block_m = 128.
        config: default ``fp8_bwd_config_for("gemm2_dgrad", ...)``.
        nonfinite_count: optional (1,) int32 device counter for the s * h scales.
        hs_out: optional (N_cap, F) bf16 buffer: written with bf16(s[p] silu(gate) up) (zeros on padding rows;
            bitwise ``grouped_gemm_bwd.gemm2_dgrad_swiglu_bwd``'s ``hs_out``, which does not depend on the GEMM)
            instead of the quantized transposed s * h; hsT_q and hsT_s are then None.

    Returns:
        dgate_up (N_cap, 2F) bf16 (zeros on padding rows; tiles of expert -1, i.e. rows from
        ``layout.offsets[-1]`` on, are left unwritten in every output), dscore_partial
        (N_cap, NB) fp32 (reduce with ``grouped_gemm_bwd.reduce_dscore``), hsT_q (F, N_cap)
        float8_e4m3fn (row stride ``fp8_quant_bwd.transposed_ld(N_cap)``) and hsT_s (N_cap // 128, F)
        fp32 (128x1 s * h, transposed).

    Grid: n_tiles * cdiv(F, BN) programs. No host sync, no atomics (but the counter).

    Raises:
        ValueError: wrong shapes / dtypes / devices, D or F not multiples of 128, layout block_m != 128.
    """
    dev = dout_q.device
    T, D = dout_q.shape
    E, F, _ = w2t_q.shape
    K = layout.top_k
    _check_fp8_layout(layout, dev)
    _dims("D", D)
    _dims("F", F)
    cfg = config or fp8_bwd_config_for("gemm2_dgrad", D, F, interpret_mode())
    _check_bwd_config(cfg, "gemm2_dgrad", layout)
    _check(dout_q, "dout_q", (T, D), FP8_DTYPE, dev)
    _check(dout_s, "dout_s", (T, D // GROUP), torch.float32, dev)
    _check(w2t_q, "w2t_q", (layout.num_experts, F, D), FP8_DTYPE, dev)
    _check(w2t_s, "w2t_s", (E, -(-F // GROUP), D // GROUP), torch.float32, dev)
    _check(gate_up, "gate_up", (layout.n_cap, 2 * F), torch.bfloat16, dev)
    _check(scores_TK, "topk_scores", (T, K), torch.float32, dev)
    if layout.pair_row.shape[0] != T * K:
        raise ValueError(f"layout was built for {layout.pair_row.shape[0]} pairs, dout/scores give T*K={T * K}")
    N, nb, n_tiles = layout.n_cap, cdiv(F, cfg.block_n), layout.n_tiles_cap
    dgu = torch.empty((N, 2 * F), dtype=torch.bfloat16, device=dev)
    part = torch.empty((N, nb), dtype=torch.float32, device=dev)
    if hs_out is not None:
        _check(hs_out, "hs_out", (N, F), torch.bfloat16, dev)
        hsT, hsTs, ld = None, None, F
    else:
        hsT = empty_transposed(F, N, dev)
        hsTs = torch.empty((N // GROUP, F), dtype=torch.float32, device=dev)
        ld = hsT.stride(0)
    interpret = interpret_mode()
    if n_tiles * nb:
        hs_arg = hs_out if hs_out is not None else hsT
        scale_arg = part if hs_out is not None else hsTs  # not written with HS_ROWS
        launch(_gemm2_dgrad_swiglu_bwd_fp8_kernel, (n_tiles * nb,),
            dout_q, dout_s, w2t_q, w2t_s, gate_up, scores_TK, layout.row_pair, layout.tile_expert,
            dgu, part, hs_arg, scale_arg, nonfinite_count if nonfinite_count is not None else scale_arg, n_tiles, ld,
            D=D, F=F, K=K, NB=nb, BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k, GROUP_M=cfg.group_m,
            CHECK=nonfinite_count is not None and hs_out is None, EXACT_ROUND=interpret, EPS=AMAX_EPS,
            HS_ROWS=hs_out is not None, **cfg.compile_options(),
        )
    return dgu, part, hsT, hsTs


def gemm1_dgrad_fp8(
    dgu_q: Tensor, dgu_s: Tensor, w1t_q: Tensor, w1t_s: Tensor, w3t_q: Tensor, w3t_s: Tensor,
    layout: RoutingLayout, config: GemmConfig | None = None,
) -> Tensor:
    """FP8 GEMM1 dgrad: dx_rows[r] = dgate[r] @ w1[e] + dup[r] @ w3[e] (dequantized operands; fp32
    partial per 128-wide K block, scaled, accumulated over 2F in fp32).

    Args:
        dgu_q: (N_cap, 2F) float8_e4m3fn, dgate_up quantized 1x128; dgu_s: (N_cap, 2F // 128) fp32.
        w1t_q, w3t_q: (E, D, F) float8_e4m3fn, w1 / w3 transposed; w1t_s, w3t_s: (E, cdiv(D, 128),
            F // 128) fp32.
        layout: routing layout with block_m = 128. config: default ``fp8_bwd_config_for("gemm1_dgrad")``.

    Returns:
        dx_rows (N_cap, D) bf16, zeros on padding rows, rows from ``layout.offsets[-1]`` on unwritten;
        ``scatter_dx`` sums the placed rows.

    Grid: n_tiles * cdiv(D, BN) programs (grouped order). No host sync.

    Raises:
        ValueError: wrong shapes / dtypes, D or F not multiples of 128, layout block_m != 128.
    """
    dev = dgu_q.device
    E, D, F = w1t_q.shape
    _check_fp8_layout(layout, dev)
    _dims("D", D)
    _dims("F", F)
    cfg = config or fp8_bwd_config_for("gemm1_dgrad", D, F, interpret_mode())
    _check_bwd_config(cfg, "gemm1_dgrad", layout)
    _check(dgu_q, "dgu_q", (layout.n_cap, 2 * F), FP8_DTYPE, dev)
    _check(dgu_s, "dgu_s", (layout.n_cap, 2 * F // GROUP), torch.float32, dev)
    for n, q, s in (("w1t", w1t_q, w1t_s), ("w3t", w3t_q, w3t_s)):
        _check(q, f"{n}_q", (layout.num_experts, D, F), FP8_DTYPE, dev)
        _check(s, f"{n}_s", (E, -(-D // GROUP), F // GROUP), torch.float32, dev)
    dx_rows = torch.empty((layout.n_cap, D), dtype=torch.bfloat16, device=dev)
    nbd, n_tiles = cdiv(D, cfg.block_n), layout.n_tiles_cap
    if n_tiles * nbd:
        launch(_gemm1_dgrad_fp8_kernel, (n_tiles * nbd,),
            dgu_q, dgu_s, w1t_q, w1t_s, w3t_q, w3t_s, layout.row_pair, layout.tile_expert, dx_rows, n_tiles,
            D=D, F=F, NBD=nbd, BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k, GROUP_M=cfg.group_m,
            **cfg.compile_options(),
        )
    return dx_rows


def wgrad_fp8(
    aT_q: Tensor, aT_s: Tensor, bT_q: Tensor, bT_s: Tensor, layout: RoutingLayout, *, split: int | None = None,
    out_dtype: torch.dtype = torch.bfloat16, config: GemmConfig | None = None, _max_imprecise_acc: int | None = None,
) -> tuple[Tensor, ...]:
    """FP8 weight gradient, K-grouped over each expert's rows: dW[e] = sum_{r in e} aT[:, r] outer bT[:, r].

    dw2 = ``wgrad_fp8(doutT, doutT_s, hsT, hsT_s, layout)``; dw1, dw3 = ``wgrad_fp8(dguT, dguT_s, xT,
    xT_s, layout, split=F)``. Both operands 128x1 scaled and stored transposed (``fp8_quant_bwd.py``).

    Args:
        aT_q: (MA, N_cap) float8_e4m3fn; aT_s: (N_cap // 128, MA) fp32.
        bT_q: (NC, N_cap) float8_e4m3fn; bT_s: (N_cap // 128, NC) fp32.
            The e4m3 operands need unit column stride; their row stride may exceed N_cap (a multiple
            of 16: ``fp8_quant_bwd.empty_transposed``, as the quantizers return them).
        layout: routing layout with block_m = 128 (expert segments on 128-row boundaries).
        split: None -> one (E, MA, NC) output; M1 -> two outputs, rows [0, M1) and [M1, MA) (a
            multiple of the config's BM; dw1 / dw3 from the stacked dgate_up).
        out_dtype: bf16 or fp32 (fp32 master gradients); accumulation is fp32 either way.
        config: default ``fp8_bwd_config_for("wgrad_w2" or "wgrad_w13", ...)``.
        _max_imprecise_acc: diagnosis only: ``tl.dot``'s ``max_num_imprecise_acc`` (None = Triton's
            sm_90 default, the whole 128-row step in the wgmma accumulator; 32 = fp32 promotion after
            each k32 wgmma; ignored by the interpreter, whose dot is fp32).

    Returns:
        (dW,) or (dW_top, dW_bottom); experts without rows get exact zeros.

    Grid: (cdiv(MA, BM) * cdiv(NC, BN), E). Deterministic (row order), no host sync.
    """
    dev = aT_q.device
    MA, N = aT_q.shape
    NC = bT_q.shape[0]
    E = layout.num_experts
    _check_fp8_layout(layout, dev)
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"out_dtype must be bf16 or fp32, got {out_dtype}")
    kind = "wgrad_w2" if split is None else "wgrad_w13"
    D, F = (MA, NC) if split is None else (NC, MA // 2)
    cfg = config or fp8_bwd_config_for(kind, D, F, interpret_mode())
    _check_bwd_config(cfg, kind)
    _check_transposed("wgrad_fp8", "aT_q", aT_q, (MA, layout.n_cap), dev)
    _check(aT_s, "aT_s", (layout.n_cap // GROUP, MA), torch.float32, dev)
    _check_transposed("wgrad_fp8", "bT_q", bT_q, (NC, layout.n_cap), dev)
    _check(bT_s, "bT_s", (layout.n_cap // GROUP, NC), torch.float32, dev)
    M1 = MA if split is None else split
    if split is not None and (M1 % cfg.block_m or not 0 < M1 < MA):
        raise ValueError(f"split={split} must be in (0, {MA}) and a multiple of block_m={cfg.block_m}")
    out1 = torch.empty((E, M1, NC), dtype=out_dtype, device=dev)
    out2 = torch.empty((E, MA - M1, NC), dtype=out_dtype, device=dev) if split is not None else out1
    nbm, nbn = cdiv(MA, cfg.block_m), cdiv(NC, cfg.block_n)
    interpret = interpret_mode()
    if E * nbm * nbn:
        launch(_wgrad_fp8_kernel, (nbm * nbn, E),
            aT_q, aT_s, bT_q, bT_s, layout.offsets, out1, out2, aT_q.stride(0), bT_q.stride(0),
            MA=MA, M1=M1, NC=NC, NBM=nbm, NBN=nbn, BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k,
            GROUP_M=cfg.group_m, INTERPRET=interpret, MAX_IMPRECISE=_max_imprecise_acc, **cfg.compile_options(),
        )
    return (out1,) if split is None else (out1, out2)
