"""Blockwise-FP8 forward grouped GEMMs (DeepSeek-V3 style, Hopper): gather + GEMM1 + SwiGLU, and
GEMM2 + routing score + scatter, on e4m3 operands with fp32 block scales.

``torch._scaled_grouped_mm`` on sm90 is rowwise-scaled only, so the blockwise grouped GEMMs are ours.
Same row layout, row coverage and epilogues as the bf16 kernels of ``grouped_gemm.py``; only the main
loop differs.

Shape legend:
    T   tokens                  D   model dim                F    expert hidden dim
    E   experts                 K   top_k                    P    = T*K (token, slot) pairs, p = t*K + k
    BM  row block (= layout.block_m)                         N_cap rows of the padded expert-major layout
    BN / BK column / reduction block (BK = 128 = the scale block)
    KB  = Kd // 128 scale blocks along a reduction dim Kd    NB = ceil(N / 128) along an output dim N

Input contract (what ``fp8_quant.py`` produces; the tests carry their own tiny quantizer with it):
    * dtype ``torch.float8_e4m3fn`` (max 448), scales fp32, all contiguous.
    * activations (M, Kd) e4m3 with scales (M, Kd // 128): one per row per 128 channels,
      ``a[m, c] = a_fp8[m, c] * a_scale[m, c // 128]``.
    * weights (E, N, Kd) e4m3 with scales (E, ceil(N / 128), Kd // 128): one per 128 x 128 block,
      ``w[e, n, c] = w_fp8[e, n, c] * w_scale[e, n // 128, c // 128]``.
    * reduction dims (D for GEMM1, F for GEMM2) multiples of 128; output dims multiples of 16.

Math of the main loop (DeepSeek-V3's per-K-block scale application; BK = 128, so one activation scale
per row and one weight scale per program for each K step):

    for kb in range(Kd // 128):
        partial = dot(a_fp8[:, kb-block], b_fp8[kb-block, :])            (BM, BN) fp32, fresh each step
        acc    += partial * (a_scale[rows, kb] * b_scale[e, n_block, kb])[:, None]

The tensor-core dot of each 128-wide K block runs in its own fp32 partial (e4m3 products are exact in
fp32), and the scaled partials are accumulated in fp32, so the result equals the fp32 GEMM of the
dequantized operands up to fp32 rounding. BN handling: BN is a power of two <= 128, so it divides 128
and the BN columns of a program lie in one 128-row weight scale block, n_block = (pid_n * BN) // 128;
BN > 128 (two weight scales per tile) is refused with a ValueError. BK must be 128.

Data flow and written rows: as ``grouped_gemm.py`` (rows of the padded expert-major layout of
``routing.py``; row r holds pair p = row_pair[r], token t = p // K, expert e = tile_expert[r // BM]):

    gemm1_swiglu_fwd_fp8:  gate_up[r] = [xq[t] @ w1q[e].T | xq[t] @ w3q[e].T]  (N_cap, 2F), saved for bwd
                           h[r]       = silu(gate) * up                          (N_cap, F)
    gemm2_scatter_fwd_fp8: y[p]       = score[p] * (hq[r] @ w2q[e].T)             (P, D), or (N_cap, D) by_row

    (xq, w1q, ... the dequantized operands). GEMM1 writes every row of every tile whose expert is >= 0
    (padding rows get exact zeros: their gathered x rows and scales are masked to 0); tiles with expert
    -1 are skipped and left as allocated. GEMM2 writes each pair row exactly once (no atomics); padding
    rows of h (and of h_scale) may hold anything, NaN included: a row's output reads only that row.

Outputs are bf16 by default; ``out_dtype=torch.float32`` keeps the fp32 accumulators (the tests use it
to check the main loop to fp32 rounding). The FP8 quantization of h between the GEMMs is either a
separate pass (``fp8_quant.py``) or GEMM1's epilogue (``quantize_h=True``: BN = 128 so one program
owns whole 1 x 128 groups of h; 16 warps, ``HOPPER_GEMM1_FP8_QH``, because BN = 128 spills at 8).

Launch configs (``GemmConfig`` of ``configs.py``; ``fp8_config_for`` picks one). Why the Hopper
defaults, reasoned from the bf16 ones (128 x 128 x 64, 8 warps, 4 stages = 48 KiB per stage for GEMM1;
128 x 256 x 64 for GEMM2) and the 227 KiB shared-memory limit:

* FP8 halves the bytes of a K step, so BK = 128 (also the scale block; 128 B rows = the 128 B swizzle)
  costs the bytes BK = 64 cost in bf16: an x / h tile 128 x 128 e4m3 = 16 KiB, a 128-row weight tile
  16 KiB.
* Registers are the constraint, not shared memory: per-K-block scaling keeps a fresh fp32 partial
  next to each accumulator. 128 x 128 fp32 over 8 warps (256 threads) = 64 registers per thread.
  GEMM2 (one accumulator + one partial) at 128 x 128: 128 registers, fits. GEMM1 (gate and up: two
  accumulators + two partials) at BN = 128 would need 256 registers before any address or operand:
  spills; so GEMM1 runs BN = 64 per operand (gate 64 + up 64 = 128 output columns per program, 128
  accumulator registers), the same output footprint as one 128 x 128 tile. (BN = 256 for GEMM2, as in
  bf16, is out twice over: two weight scales per tile and 256 accumulator registers.) The sm_90a
  build (triton 3.6, ``tests/test_kernels_fp8.py``) confirms it: GEMM1 BN = 64 185 registers, no
  spills; GEMM1 BN = 128 255 registers + 96 B of stack (spills); GEMM2 128 x 128 173-177, no spills.
* Shared memory per stage: GEMM1 x 16 KiB + w1 8 KiB + w3 8 KiB = 32 KiB; GEMM2 h 16 + w2 16 = 32 KiB
  (+ 512 B of row scales). 4 stages = 128 KiB, well under 227 KiB; 5-6 stages fit too (a sweep item:
  the bf16 sweep moved 2-10 % with stages).
* 8 warps = two Hopper warpgroups (each 64 rows of the 128-row tile), group_m 1 / 8 as the bf16
  GEMM1 / GEMM2 defaults (measured there). Pointer loads (cp.async) for every operand: the gathered
  x rows need them, and the bf16 sweep found TMA no faster for the weights; TMA is not implemented
  here (``use_tma=True`` raises).

What the build shows and what it costs: every dot is an e4m3 wgmma (m64n64k32 for GEMM1, m64n128k32
for GEMM2; B K-major in shared memory, no transpose, no mma.sync fallback), but because each K block's
partial is consumed at once, Triton waits for the wgmma group (``wgmma.wait_group 0``) every K step:
the tensor cores idle while the two warpgroups (in lockstep) scale and add the partial (~128 FFMA
cycles against ~740 cycles of wgmma per 128 x 128 x 128 step at the H200's 1349 TF/s dense fp8).
Expected ~550-700 TF/s (DESIGN.md section 6 quotes 400-870 TF/s for Triton blockwise FP8 on H100);
overlapping the promotion with the next wgmma (ping-pong warpgroups on two tiles, as DeepGEMM, or
warp specialization) is the known next step. Not measured on a GPU yet:
``python tests/test_kernels_fp8.py bench [30b|235b]`` times both kernels next to the bf16 ones.

Interpreter (``TRITON_INTERPRET=1``, read at launch time as in ``grouped_gemm.py``): fp8 ``tl.dot``
works there (unlike bf16), so the same kernel body runs in both modes, with no upcast flag; the
fp32 -> bf16 output casts truncate there instead of rounding.

Dims are constexpr (one compile per layer shape), as in ``grouped_gemm.py``.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from titan_megamoe.kernels.jit import cdiv, grouped_tile, live_tile_range
from titan_megamoe.kernels.configs import PERSISTENT_GEMM2_FP8, GemmConfig, _pow2_at_most, persistent_programs
from titan_megamoe.kernels.fp8_quant import _amax, _scale_of, _to_e4m3_rcp
from titan_megamoe.kernels.grouped_gemm import _check_layout, interpret_mode
from titan_megamoe.kernels.launch import launch
from titan_megamoe.kernels.routing import RoutingLayout

__all__ = [
    "FP8_DTYPE",
    "FP8_MAX",
    "SCALE_BLOCK",
    "HOPPER_GEMM1_FP8",
    "HOPPER_GEMM2_FP8",
    "fp8_interpreter_config",
    "fp8_config_for",
    "gemm1_swiglu_fwd_fp8",
    "gemm2_scatter_fwd_fp8",
]

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
SCALE_BLOCK = 128  # channels per activation scale, rows / columns per weight scale block

#: Hopper defaults (module docstring: registers bound GEMM1 to BN = 64 per operand).
HOPPER_GEMM1_FP8 = GemmConfig(block_m=128, block_n=64, block_k=128, num_warps=8, num_stages=4, group_m=1)
HOPPER_GEMM2_FP8 = GemmConfig(block_m=128, block_n=128, block_k=128, num_warps=8, num_stages=4, group_m=8)
#: FP8 GEMM2 persistent (``GemmConfig.persistent``; the default, TITAN_MEGAMOE_PERSISTENT_GEMM2_FP8=0 turns it
#: off, ``configs.PERSISTENT_GEMM2_FP8``): 3 stages, the flattened loop holds one more buffer (sm_90a build, 30B and
#: 235B shapes: 225 registers, 128 KiB; by_row 247; 4 stages 242 / 253, 5 stages spill with by_row).
HOPPER_GEMM2_FP8_PERSISTENT = GemmConfig(block_m=128, block_n=128, block_k=128, num_warps=8, num_stages=3, group_m=8,
                                         persistent=True)
#: GEMM1 with h quantized in its epilogue (``quantize_h=True``): BN = 128 per operand owns whole 1 x 128
#: groups of h; 16 warps keep the two accumulators + partials at 128 registers, no spills (sm_90a build).
HOPPER_GEMM1_FP8_QH = GemmConfig(block_m=128, block_n=128, block_k=128, num_warps=16, num_stages=4, group_m=1)

_OUT_DTYPES = (torch.bfloat16, torch.float32)


# --------------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------------


@triton.jit
def _gemm1_swiglu_fwd_fp8_kernel(
    x_ptr,  # (T, D) e4m3, token rows; gathered by row_pair // K
    xs_ptr,  # (T, D // 128) fp32, x scale per token per 128 channels
    w1_ptr,  # (E, F, D) e4m3, gate projection
    w1s_ptr,  # (E, NB_F, D // 128) fp32, w1 scale per 128 x 128 block
    w3_ptr,  # (E, F, D) e4m3, up projection
    w3s_ptr,  # (E, NB_F, D // 128) fp32
    row_pair_ptr,  # (N_cap,) int32, pair t*K + k of each padded row, -1 for padding
    tile_expert_ptr,  # (n_tiles_cap,) int32, expert of each BM-row tile, -1 past the last expert
    gate_up_ptr,  # (N_cap, 2F) bf16 | fp32 out, [gate | up] pre-activations
    h_ptr,  # (N_cap, F) bf16 | fp32 out, silu(gate) * up; QUANT_H: (N_cap, F) e4m3 out
    hs_ptr,  # QUANT_H: (N_cap, F // 128) fp32 out, h's 1x128 scales
    count_ptr,  # QUANT_H: (1,) int32, += non-finite h groups
    F: tl.constexpr,  # expert hidden dim (output columns)
    D: tl.constexpr,  # model dim (reduction), a multiple of 128
    K: tl.constexpr,  # top_k
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,  # power of two <= 128: the tile's columns share one weight scale block
    BLOCK_K: tl.constexpr,  # 128 = the scale block
    GROUP_M: tl.constexpr,
    EVEN_N: tl.constexpr,  # F % BLOCK_N == 0: no column mask
    QUANT_H: tl.constexpr = False,  # h quantized 1x128 in the epilogue (BLOCK_N == 128, F % 128 == 0)
    EXACT_ROUND: tl.constexpr = False,  # QUANT_H in the interpreter (fp8_quant.py)
):
    """Gathered blockwise-FP8 grouped GEMM1 (gate and up) with SwiGLU in the epilogue.

    Grid: (n_tiles_cap, cdiv(F, BLOCK_N)), launch ids remapped to the grouped order of the bf16 kernel;
    each program owns rows [m*BM, (m+1)*BM) x columns [n*BN, (n+1)*BN) of gate, up and h. Tiles with
    expert -1 return at once. Per 128-wide K block: two fp32 partial dots, each scaled by
    x_scale[token, kb] * w_scale[e, (n*BN) // 128, kb] and added to its accumulator.
    Preconditions (checked by the launcher): D % 128 == 0, F % 16 == 0, BN <= 128, BK == 128,
    N_cap a multiple of BM, contiguous tensors. No host sync, no atomics.
    """
    KB: tl.constexpr = D // BLOCK_K  # scale blocks along D
    NB: tl.constexpr = (F + BLOCK_K - 1) // BLOCK_K  # weight scale blocks along F
    # ---- tile order: grouped, as _gemm1_swiglu_fwd_kernel ------------------------------------------
    num_pid_m = tl.num_programs(0)
    num_pid_n = tl.num_programs(1)
    pid = tl.program_id(0) + tl.program_id(1) * num_pid_m  # hardware launch order: axis 0 fastest
    pid_m, pid_n = grouped_tile(pid, num_pid_m, num_pid_n, GROUP_M)

    expert = tl.load(tile_expert_ptr + pid_m)
    if expert < 0:  # tile past the last expert's rows: nothing to compute, nothing written
        return

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)

    # ---- prologue: row gather (x rows and their scale rows) -----------------------------------------
    pair_M = tl.load(row_pair_ptr + offs_m)
    row_ok_M = pair_M >= 0
    # int64: token * D overflows int32 once T*D > 2^31 (large receive buffers).
    tok_M = tl.where(row_ok_M, pair_M // K, 0).to(tl.int64)
    x_ptrs = x_ptr + tok_M[:, None] * D + offs_k[None, :]  # (BM, BK) gathered e4m3 rows
    xs_ptrs = xs_ptr + tok_M * KB  # (BM,) scale row of each gathered token

    # (BK, BN) weight tiles read K-major from the (E*F, D) view: the layout Hopper's fp8 wgmma needs
    # for its B operand (K contiguous), so no transpose in shared memory.
    # int64: expert * F * D overflows int32 for large layers.
    w_off = (expert * F + pid_n * BLOCK_N).to(tl.int64) * D + tl.arange(0, BLOCK_N)[None, :] * D + offs_k[:, None]
    w1_ptrs = w1_ptr + w_off
    w3_ptrs = w3_ptr + w_off
    ws_off = (expert * NB + (pid_n * BLOCK_N) // BLOCK_K) * KB  # this program's weight scale row
    if not EVEN_N:
        b_mask = (offs_n < F)[None, :]

    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, KB):
        a = tl.load(x_ptrs, mask=row_ok_M[:, None], other=0.0)
        a_s = tl.load(xs_ptrs + kb, mask=row_ok_M, other=0.0)  # padding rows: 0 (their a rows are 0)
        if EVEN_N:
            b1 = tl.load(w1_ptrs)
            b3 = tl.load(w3_ptrs)
        else:
            b1 = tl.load(w1_ptrs, mask=b_mask, other=0.0)
            b3 = tl.load(w3_ptrs, mask=b_mask, other=0.0)
        s1 = tl.load(w1s_ptr + ws_off + kb)
        s3 = tl.load(w3s_ptr + ws_off + kb)
        # fresh fp32 partial per K block, scaled, then accumulated (DeepSeek-V3 promotion)
        acc_gate += tl.dot(a, b1) * (a_s * s1)[:, None]
        acc_up += tl.dot(a, b3) * (a_s * s3)[:, None]
        x_ptrs += BLOCK_K
        w1_ptrs += BLOCK_K
        w3_ptrs += BLOCK_K

    # ---- epilogue: SwiGLU in fp32 (silu written out: see grouped_gemm.py), store gate | up and h ----
    h = acc_gate / (1.0 + tl.exp(-acc_gate)) * acc_up  # padding rows: 0 / 2 * 0 = 0
    rows64 = offs_m.to(tl.int64)  # int64: row * 2F overflows int32 for N_cap * 2F > 2^31
    gu_ptrs = gate_up_ptr + rows64[:, None] * (2 * F) + offs_n[None, :]
    h_ptrs = h_ptr + rows64[:, None] * F + offs_n[None, :]
    out_ty = gate_up_ptr.dtype.element_ty
    if QUANT_H:  # the program owns whole 1 x 128 groups of h: quantize the fp32 h, no bf16 h written
        tl.store(gu_ptrs, acc_gate.to(out_ty))
        tl.store(gu_ptrs + F, acc_up.to(out_ty))
        s_M1 = _scale_of(_amax(h, 1), 1e-12)  # (BM, 1), AMAX_EPS of fp8_reference
        tl.store(h_ptrs, _to_e4m3_rcp(h, s_M1, EXACT_ROUND))
        sc = tl.reshape(s_M1, (BLOCK_M,))
        tl.store(hs_ptr + rows64 * (F // BLOCK_N) + pid_n, sc)
        n_bad = tl.sum((~(sc < float("inf"))).to(tl.int32))  # NaN < inf is False
        tl.atomic_add(count_ptr, n_bad, mask=n_bad > 0)
    elif EVEN_N:
        tl.store(gu_ptrs, acc_gate.to(out_ty))
        tl.store(gu_ptrs + F, acc_up.to(out_ty))
        tl.store(h_ptrs, h.to(out_ty))
    else:
        st_mask = (offs_n < F)[None, :]  # every row of a live tile is written (padding rows: zeros)
        tl.store(gu_ptrs, acc_gate.to(out_ty), mask=st_mask)
        tl.store(gu_ptrs + F, acc_up.to(out_ty), mask=st_mask)
        tl.store(h_ptrs, h.to(out_ty), mask=st_mask)


@triton.jit
def _gemm2_fp8_tile(h_ptr, hs_ptr, w2_ptr, w2s_ptr, scores_ptr, row_pair_ptr, out_ptr, pid_m, pid_n, expert,
                    F: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, EVEN_N: tl.constexpr, BY_ROW: tl.constexpr,
                    EPILOGUE_FIRST: tl.constexpr):
    """One (row tile pid_m of ``expert``, column block pid_n) of the FP8 GEMM2 (kernel docstring below).
    ``EPILOGUE_FIRST``: the tile's pairs and scores are loaded before the K loop (persistent kernel)."""
    KB: tl.constexpr = F // BLOCK_K
    NB: tl.constexpr = (D + BLOCK_K - 1) // BLOCK_K
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    rows64 = offs_m.to(tl.int64)  # int64: row * F and row * D overflow int32 for large layers
    if EPILOGUE_FIRST:
        pair_M = tl.load(row_pair_ptr + offs_m)
        row_ok_M = pair_M >= 0
        score_M = tl.load(scores_ptr + pair_M, mask=row_ok_M, other=0.0)
    a_ptrs = h_ptr + rows64[:, None] * F + offs_k[None, :]
    as_ptrs = hs_ptr + rows64 * KB
    w_ptrs = w2_ptr + (expert * D + pid_n * BLOCK_N).to(tl.int64) * F + tl.arange(0, BLOCK_N)[None, :] * F \
        + offs_k[:, None]  # (BK, BN), K-major (fp8 wgmma's B layout)
    ws_off = (expert * NB + (pid_n * BLOCK_N) // BLOCK_K) * KB
    if not EVEN_N:
        b_mask = (offs_n < D)[None, :]

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, KB):
        a = tl.load(a_ptrs)
        a_s = tl.load(as_ptrs + kb)
        if EVEN_N:
            b = tl.load(w_ptrs)
        else:
            b = tl.load(w_ptrs, mask=b_mask, other=0.0)
        b_s = tl.load(w2s_ptr + ws_off + kb)
        acc += tl.dot(a, b) * (a_s * b_s)[:, None]  # fresh fp32 partial per K block, scaled
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K

    # ---- epilogue: routing score (fp32), then the scatter to token-major pair rows ------------------
    if not EPILOGUE_FIRST:
        pair_M = tl.load(row_pair_ptr + offs_m)
        row_ok_M = pair_M >= 0
        score_M = tl.load(scores_ptr + pair_M, mask=row_ok_M, other=0.0)
    y = (acc * score_M[:, None]).to(out_ptr.dtype.element_ty)
    dst_M = offs_m if BY_ROW else pair_M
    dst_ptrs = out_ptr + dst_M.to(tl.int64)[:, None] * D + offs_n[None, :]  # int64: pair * D > 2^31
    if EVEN_N:
        tl.store(dst_ptrs, y, mask=row_ok_M[:, None])
    else:
        tl.store(dst_ptrs, y, mask=row_ok_M[:, None] & (offs_n < D)[None, :])


@triton.jit
def _gemm2_scatter_fwd_fp8_kernel(
    h_ptr,  # (N_cap, F) e4m3, SwiGLU output rows in the padded layout
    hs_ptr,  # (N_cap, F // 128) fp32, h scale per row per 128 channels
    w2_ptr,  # (E, D, F) e4m3, down projection
    w2s_ptr,  # (E, NB_D, F // 128) fp32, w2 scale per 128 x 128 block
    scores_ptr,  # (P,) fp32, routing score of pair p = t*K + k
    row_pair_ptr,  # (N_cap,) int32, pair of each padded row, -1 for padding
    tile_expert_ptr,  # (n_tiles_cap,) int32, expert of each BM-row tile, -1 past the last expert
    out_ptr,  # (P, D) or, BY_ROW, (N_cap, D) bf16 | fp32 out
    offsets_ptr,  # (E + 1,) int32 expert offsets (PERSISTENT: live row tiles = offsets[E] // BM)
    E,  # i32, experts
    F: tl.constexpr,  # expert hidden dim (reduction), a multiple of 128
    D: tl.constexpr,  # model dim (output columns)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,  # power of two <= 128
    BLOCK_K: tl.constexpr,  # 128
    GROUP_M: tl.constexpr,
    EVEN_N: tl.constexpr,  # D % BLOCK_N == 0
    BY_ROW: tl.constexpr,  # store at the layout row instead of the pair
    PERSISTENT: tl.constexpr = False,  # NUM_PROGS programs loop over the live tiles (flattened loop)
    NUM_PROGS: tl.constexpr = 1,  # PERSISTENT: the grid size
    INTERPRET: tl.constexpr = False,  # PERSISTENT in the interpreter (its range() bound)
):
    """Blockwise-FP8 grouped GEMM2 with the routing score and the token-major scatter in the epilogue.

    Grid: (n_tiles_cap, cdiv(D, BLOCK_N)), grouped order as GEMM1. Each program computes the scaled
    product for BM rows x BN columns and stores columns [n*BN, (n+1)*BN) of y[p] (or y[r] with BY_ROW)
    for every row of the tile with pair p >= 0: each output element written exactly once, no atomics.
    Tiles with expert -1 return at once. Padding rows of h / h_scale are read but never stored.
    Preconditions (checked by the launcher): F % 128 == 0, D % 16 == 0, BN <= 128, BK == 128.

    PERSISTENT (grid (NUM_PROGS,)): as the bf16 kernel's (``grouped_gemm._gemm2_scatter_fwd_kernel``):
    the live tiles in one loop that Triton flattens with each tile's K loop, so the next tile's operands
    load under this one's last K blocks and epilogue — FP8 GEMM2's K loop is F / 128 = 6 steps at the
    30B shape, as long as the pipeline fill. Bitwise the non-persistent result.
    """
    if PERSISTENT:
        num_n: tl.constexpr = (D + BLOCK_N - 1) // BLOCK_N
        first, n_tiles, n_live = live_tile_range(offsets_ptr, E, BLOCK_M, num_n, INTERPRET)
        for tile in tl.range(first, n_tiles, NUM_PROGS, flatten=True):
            pid_m, pid_n = grouped_tile(tile, n_live, num_n, GROUP_M)
            expert = tl.load(tile_expert_ptr + pid_m)
            _gemm2_fp8_tile(h_ptr, hs_ptr, w2_ptr, w2s_ptr, scores_ptr, row_pair_ptr, out_ptr, pid_m, pid_n, expert,
                            F, D, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_N, BY_ROW, True)
    else:
        num_pid_m = tl.num_programs(0)
        num_pid_n = tl.num_programs(1)
        pid = tl.program_id(0) + tl.program_id(1) * num_pid_m
        pid_m, pid_n = grouped_tile(pid, num_pid_m, num_pid_n, GROUP_M)

        expert = tl.load(tile_expert_ptr + pid_m)
        if expert < 0:
            return
        _gemm2_fp8_tile(h_ptr, hs_ptr, w2_ptr, w2s_ptr, scores_ptr, row_pair_ptr, out_ptr, pid_m, pid_n, expert,
                        F, D, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_N, BY_ROW, False)


# --------------------------------------------------------------------------------------------------
# Configs
# --------------------------------------------------------------------------------------------------


def fp8_interpreter_config() -> GemmConfig:
    """The one fixed config for the Triton interpreter on CPU.

    BM = 16 as ``configs.interpreter_config`` (one layout for bf16 and fp8 tests), BK = 128 (the scale
    block; bigger numpy ops cost the interpreter little), BN = 32 (< 128: several programs share one
    weight scale block, exercised by the CPU tests), group_m 2 (exercises the tile remap).
    """
    return GemmConfig(block_m=16, block_n=32, block_k=SCALE_BLOCK, num_warps=1, num_stages=1, group_m=2)


@functools.lru_cache(maxsize=None)  # asked on every launch; fixed per (kind, D, F)
def fp8_config_for(kind: str, D: int, F: int, interpret: bool) -> GemmConfig:
    """Launch config of ``kind`` ("gemm1" or "gemm2") for a layer with dims D and F.

    BM = 128 for both (the layout of the bf16 path, ``configs.config_for``, is reused as is); BN
    shrinks to the output dim for tiny layers (a power of two <= 128 either way).
    """
    if kind not in ("gemm1", "gemm2"):
        raise ValueError(f"fp8_config_for: unknown kind {kind!r}; choose 'gemm1' or 'gemm2'")
    if interpret:
        return fp8_interpreter_config()
    if kind == "gemm1":
        base = HOPPER_GEMM1_FP8
    else:
        base = HOPPER_GEMM2_FP8_PERSISTENT if PERSISTENT_GEMM2_FP8 else HOPPER_GEMM2_FP8
    n_dim = F if kind == "gemm1" else D
    return dataclasses.replace(base, block_n=_pow2_at_most(n_dim, base.block_n))


def _check_config(cfg: GemmConfig, kind: str) -> None:
    if cfg.block_k != SCALE_BLOCK:
        raise ValueError(f"{kind} fp8: config.block_k={cfg.block_k} must be {SCALE_BLOCK} (one scale per K step)")
    if cfg.block_n > SCALE_BLOCK:
        raise ValueError(
            f"{kind} fp8: config.block_n={cfg.block_n} must be <= {SCALE_BLOCK} so that a program's columns "
            "share one weight scale block"
        )
    if cfg.use_tma:
        raise ValueError(f"{kind} fp8: use_tma=True is not implemented for the fp8 kernels (pointer loads only)")


# --------------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------------


def _check_tensor(name: str, t: Tensor, shape: tuple[int, ...], dtype: torch.dtype, device) -> None:
    if t.dtype != dtype:
        hint = " (quantize with fp8_quant: e4m3 values + fp32 scales)" if dtype == FP8_DTYPE else ""
        raise ValueError(f"{name} must be {dtype}, got {t.dtype}{hint}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (strides {t.stride()})")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")


def _check_reduction_dim(name: str, value: int, what: str) -> None:
    if value % SCALE_BLOCK:
        raise ValueError(
            f"{name}={value} ({what}) is not a multiple of {SCALE_BLOCK}: blockwise FP8 scales every "
            f"{SCALE_BLOCK} channels of the reduction; run this layer with [megamoe] precision = 'bf16'"
        )


def _check_output_dim(name: str, value: int, what: str) -> None:
    if value % 16:  # 16-byte aligned bf16 rows for the stores; tl.dot's minimum tile
        raise ValueError(
            f"{name}={value} ({what}) must be a multiple of 16 for the fp8 kernels; run this layer with "
            "[megamoe] precision = 'bf16'"
        )


def _check_out_dtype(out_dtype: torch.dtype) -> None:
    if out_dtype not in _OUT_DTYPES:
        raise ValueError(f"out_dtype must be one of {_OUT_DTYPES}, got {out_dtype}")


def _nb(n: int) -> int:
    return -(-n // SCALE_BLOCK)


def gemm1_swiglu_fwd_fp8(
    x_fp8: Tensor,
    x_scale: Tensor,
    w1_fp8: Tensor,
    w1_scale: Tensor,
    w3_fp8: Tensor,
    w3_scale: Tensor,
    layout: RoutingLayout,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    gate_up_out: Tensor | None = None,
    h_out: Tensor | None = None,
    config: GemmConfig | None = None,
    quantize_h: bool = False,
    nonfinite_count: Tensor | None = None,
) -> tuple[Tensor, ...]:
    """Fused row gather + blockwise-FP8 GEMM1 (gate and up) + SwiGLU, in the padded expert-major layout.

    With ``quantize_h=True`` the epilogue quantizes the fp32 h 1x128 (``fp8_reference`` math, bitwise)
    and returns ``(gate_up, h_fp8 (N_cap, F) e4m3, h_scale (N_cap, F // 128) fp32)`` instead of a bf16
    h: GEMM2's operands without a separate pass. Needs BN = 128 (default config
    ``HOPPER_GEMM1_FP8_QH`` on GPU) and F % 128 == 0; ``nonfinite_count`` (optional (1,) int32) counts
    non-finite h groups. Rows of tiles with expert -1 are left unwritten (GEMM2 skips those tiles).

    Math, for each padded row r with pair p = row_pair[r] >= 0, t = p // K, e = tile_expert[r // BM],
    with xq, w1q, w3q the dequantized operands (module docstring):
    ``gate_up[r] = [xq[t] @ w1q[e].T | xq[t] @ w3q[e].T]``, ``h[r] = silu(gate) * up`` (fp32, then
    out_dtype); each 128-wide K block is a separate fp32 partial, scaled then accumulated in fp32.

    Grid: (n_tiles_cap, cdiv(F, BN)); each program owns a BM x BN tile of gate, up and h. Written rows:
    all rows of tiles with expert >= 0 (padding rows inside them are exact zeros); rows of tiles with
    expert -1 (>= offsets[E]) are not written. BN <= 128 (one weight scale block per program), BK = 128.

    Args:
        x_fp8: (T, D) float8_e4m3fn token rows; x_scale: (T, D // 128) fp32.
        w1_fp8, w3_fp8: (E, F, D) float8_e4m3fn gate / up weights; w1_scale, w3_scale:
            (E, ceil(F / 128), D // 128) fp32, one per 128 x 128 block.
        layout: routing layout for these T, K, E with ``block_m == config.block_m``.
        out_dtype: torch.bfloat16 (default) or torch.float32, the dtype of gate_up and h.
        gate_up_out, h_out: optional (N_cap, 2F) / (N_cap, F) contiguous out_dtype buffers (written in
            place and returned); ``torch.empty`` when None.
        config: launch config; default ``fp8_config_for("gemm1", D, F, interpret)``.

    Returns:
        (gate_up_N2F, h_NF).

    Raises:
        ValueError: wrong dtype / shape / contiguity / device; D not a multiple of 128 or F not a
            multiple of 16 (the message names the dim and suggests precision = 'bf16'); a config with
            BK != 128 or BN > 128; a layout built for other T, K, E or block_m.

    Host syncs: none. Example (``test_worked_example_scales``): D = 256, one token of ones with scales
    [2, 3], expert 0's w1 all ones with block scales [5, 7] -> gate = 128*2*5 + 128*3*7 = 3968.
    """
    if x_fp8.dim() != 2 or w1_fp8.dim() != 3:
        raise ValueError(f"x must be (T, D) and w1 (E, F, D); got {tuple(x_fp8.shape)}, {tuple(w1_fp8.shape)}")
    T, D = x_fp8.shape
    E, F, _ = w1_fp8.shape
    dev = x_fp8.device
    interpret = interpret_mode()
    _check_reduction_dim("D", D, "model dim, GEMM1's reduction")
    _check_output_dim("F", F, "expert hidden dim, GEMM1's output columns")
    _check_out_dtype(out_dtype)
    if config is not None:
        cfg = config
    elif quantize_h and not interpret:
        cfg = HOPPER_GEMM1_FP8_QH
    else:
        cfg = fp8_config_for("gemm1", D, F, interpret)
        cfg = dataclasses.replace(cfg, block_n=SCALE_BLOCK, block_m=layout.block_m) if quantize_h else cfg
    _check_config(cfg, "gemm1")
    if quantize_h:
        _check_reduction_dim("F", F, "expert hidden dim, quantized 1x128 in GEMM1's epilogue")
        if cfg.block_n != SCALE_BLOCK:
            raise ValueError(f"gemm1 fp8 quantize_h: config.block_n={cfg.block_n} must be {SCALE_BLOCK} (one program "
                             "per 1 x 128 group of h)")
    KB, NB = D // SCALE_BLOCK, _nb(F)
    _check_tensor("x_fp8", x_fp8, (T, D), FP8_DTYPE, dev)
    _check_tensor("x_scale", x_scale, (T, KB), torch.float32, dev)
    for name, w, s in (("w1", w1_fp8, w1_scale), ("w3", w3_fp8, w3_scale)):
        _check_tensor(f"{name}_fp8", w, (E, F, D), FP8_DTYPE, dev)
        _check_tensor(f"{name}_scale", s, (E, NB, KB), torch.float32, dev)
    _check_layout(layout, T, E, cfg, dev)
    N = layout.n_cap
    if gate_up_out is None:
        gate_up_out = torch.empty((N, 2 * F), dtype=out_dtype, device=dev)
    h_dtype = FP8_DTYPE if quantize_h else out_dtype
    if h_out is None:
        h_out = torch.empty((N, F), dtype=h_dtype, device=dev)
    _check_tensor("gate_up_out", gate_up_out, (N, 2 * F), out_dtype, dev)
    _check_tensor("h_out", h_out, (N, F), h_dtype, dev)
    hs = torch.empty((N, F // SCALE_BLOCK), dtype=torch.float32, device=dev) if quantize_h else h_out
    if nonfinite_count is None:
        nonfinite_count = torch.zeros(1, dtype=torch.int32, device=dev) if quantize_h else h_out
    res = (gate_up_out, h_out, hs) if quantize_h else (gate_up_out, h_out)
    if layout.n_tiles_cap == 0:
        return res

    grid = (layout.n_tiles_cap, cdiv(F, cfg.block_n))
    launch(_gemm1_swiglu_fwd_fp8_kernel, grid,
        x_fp8, x_scale, w1_fp8, w1_scale, w3_fp8, w3_scale, layout.row_pair, layout.tile_expert,
        gate_up_out, h_out, hs, nonfinite_count,
        F=F, D=D, K=layout.top_k, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m, EVEN_N=F % cfg.block_n == 0, QUANT_H=quantize_h, EXACT_ROUND=interpret,
        **cfg.compile_options(),
    )
    return res


def gemm2_scatter_fwd_fp8(
    h_fp8: Tensor,
    h_scale: Tensor,
    w2_fp8: Tensor,
    w2_scale: Tensor,
    scores_TK: Tensor,
    layout: RoutingLayout,
    *,
    by_row: bool = False,
    out: Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    config: GemmConfig | None = None,
) -> Tensor:
    """Blockwise-FP8 grouped GEMM2 + routing score + scatter to token-major (token, slot) rows.

    Math, for each padded row r with pair p = row_pair[r] >= 0 and e = tile_expert[r // BM], with hq,
    w2q the dequantized operands: ``y[p] = out_dtype(scores.view(-1)[p] * (hq[r] @ w2q[e].T))`` (fp32
    partial per 128-wide K block, scaled, accumulated in fp32; fp32 score).

    Grid: (n_tiles_cap, cdiv(D, BN)); each program owns BM rows x BN columns of the output, and every
    element of the (P, D) result is written exactly once (no atomics, deterministic).

    Args:
        h_fp8: (N_cap, F) float8_e4m3fn, GEMM1's h quantized per row per 128 channels; h_scale:
            (N_cap, F // 128) fp32. Padding rows may hold anything (NaN included).
        w2_fp8: (E, D, F) float8_e4m3fn down weights; w2_scale: (E, ceil(D / 128), F // 128) fp32.
        scores_TK: (T, K) fp32 contiguous routing scores.
        layout: the same routing layout as GEMM1 (``block_m == config.block_m``).
        by_row: store row r of the layout at row r of an (N_cap, D) output instead (padding rows
            unwritten): the expert-parallel path.
        out: optional (P, D) (or (N_cap, D) with ``by_row``) contiguous out_dtype buffer.
        out_dtype: torch.bfloat16 (default) or torch.float32 (used when ``out`` is None, checked
            against it otherwise).
        config: launch config; default ``fp8_config_for("gemm2", D, F, interpret)``.

    Returns:
        y: (P, D), row p = t*K + k; with ``by_row``, (N_cap, D) in layout-row order.

    Raises:
        ValueError: wrong dtype / shape / contiguity / device; F not a multiple of 128 or D not a
            multiple of 16 (named, suggesting precision = 'bf16'); config with BK != 128 or BN > 128;
            scores not fp32 (T, K) for the layout's top_k; a layout built for other T, K, E, block_m.

    Host syncs: none.
    """
    if h_fp8.dim() != 2 or w2_fp8.dim() != 3 or scores_TK.dim() != 2:
        raise ValueError(
            f"h must be (N_cap, F), w2 (E, D, F), scores (T, K); got {tuple(h_fp8.shape)}, "
            f"{tuple(w2_fp8.shape)}, {tuple(scores_TK.shape)}"
        )
    E, D, F = w2_fp8.shape
    T, K = scores_TK.shape
    dev = h_fp8.device
    interpret = interpret_mode()
    _check_reduction_dim("F", F, "expert hidden dim, GEMM2's reduction")
    _check_output_dim("D", D, "model dim, GEMM2's output columns")
    _check_out_dtype(out_dtype)
    cfg = config if config is not None else fp8_config_for("gemm2", D, F, interpret)
    _check_config(cfg, "gemm2")
    if K != layout.top_k:
        raise ValueError(f"scores have K={K} slots, layout was built for top_k={layout.top_k}")
    _check_tensor("scores", scores_TK, (T, K), torch.float32, dev)
    _check_layout(layout, T, E, cfg, dev)
    N, P = layout.n_cap, T * K
    KB = F // SCALE_BLOCK
    _check_tensor("h_fp8", h_fp8, (N, F), FP8_DTYPE, dev)
    _check_tensor("h_scale", h_scale, (N, KB), torch.float32, dev)
    _check_tensor("w2_fp8", w2_fp8, (E, D, F), FP8_DTYPE, dev)
    _check_tensor("w2_scale", w2_scale, (E, _nb(D), KB), torch.float32, dev)
    rows_out = N if by_row else P
    if out is None:
        out = torch.empty((rows_out, D), dtype=out_dtype, device=dev)
    _check_tensor("out", out, (rows_out, D), out_dtype, dev)
    if layout.n_tiles_cap == 0:
        return out

    num_n = cdiv(D, cfg.block_n)
    grid = (persistent_programs(dev, layout.n_tiles_cap * num_n, interpret),) if cfg.persistent else \
        (layout.n_tiles_cap, num_n)
    launch(_gemm2_scatter_fwd_fp8_kernel, grid,
        h_fp8, h_scale, w2_fp8, w2_scale, scores_TK, layout.row_pair, layout.tile_expert, out, layout.offsets, E,
        F=F, D=D, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        EVEN_N=D % cfg.block_n == 0, BY_ROW=by_row, PERSISTENT=cfg.persistent,
        NUM_PROGS=grid[0] if cfg.persistent else 1, INTERPRET=interpret,
        **cfg.compile_options(),
    )
    return out
