"""Forward kernels of the fused MoE experts (EP = 1): gather + GEMM1 + SwiGLU, GEMM2 + weighted
scatter, and the fixed-order top-k combine.

Shape legend:
    T   tokens                  D   model dim                F    expert hidden dim
    E   experts                 K   top_k                    P    = T*K (token, slot) pairs, p = t*K + k
    BM  row block (= layout.block_m)                         N_cap rows of the padded expert-major layout
    n_tiles_cap = N_cap // BM row tiles                      BN / BK column / reduction block

Data flow (rows in the padded expert-major layout of ``routing.py``; row r holds pair
p = row_pair[r], token t = p // K, expert e = tile_expert[r // BM]):

    gemm1_swiglu_fwd:  gate_up[r] = [x[t] @ w1[e].T | x[t] @ w3[e].T]   (N_cap, 2F) bf16, saved for bwd
                       h[r]       = silu(gate) * up                     (N_cap, F)  bf16
    gemm2_scatter_fwd: y[p]       = score[p] * (h[r] @ w2[e].T)          (P, D) bf16, token-major
    combine_topk:      out[t]     = sum_{k=0..K-1} y[t*K + k]  (fp32, fixed order) -> (T, D) bf16

Which rows get written (tests poison outputs with NaN and check this):
    * GEMM1 writes every row of every tile whose expert is >= 0, i.e. rows [0, offsets[E]); padding
      rows inside those tiles (pair -1) get exact zeros (their gathered x rows are masked to 0, so both
      accumulators are 0 and silu(0) * 0 = 0): later kernels may read them. Tiles whose expert is -1
      (rows >= offsets[E]) are skipped and left as allocated; no kernel reads them.
    * GEMM2 writes every pair row p in [0, P) exactly once (each pair has exactly one layout row), no
      atomics. Padding rows store nothing.
    * combine_topk writes every token row.

Interpreter (``TRITON_INTERPRET=1``, CPU tests): read from the environment at *launch* time, not at
import time (``kernels/launch.py``), so importing this module early does not fix the mode. In that mode
operands are upcast to fp32 before ``tl.dot`` (bf16 dot returns garbage in the interpreter, DESIGN 7);
the fp32 -> bf16 output casts truncate there instead of rounding (still within bf16 tolerance).

Dims are constexpr: D and F are kernel constants (one compile per layer shape, which a model has
anyway). Besides letting the compiler fold strides and masks, this keeps ``range(0, D, BLOCK_K)``
working in the interpreter: with numpy 2.4 (seen on the CPU machine) a runtime int argument there
fails (the interpreter calls ``int()`` on a 1-element array).

Weight tiles (and GEMM2's h tiles): plain pointer loads, pipelined through cp.async (the default:
measured 2-5 % faster on H200, see configs.py), or TMA tensor descriptors (``tl.make_tensor_descriptor``,
``GemmConfig.use_tma=True`` -> constexpr ``USE_TMA``; needs a Triton allocator on GPU, installed on
first use if the caller set none). Gathered x rows always use pointer loads (TMA gather is
Blackwell-only).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from titan_megamoe.comm.signals import wait_flags
from titan_megamoe.kernels.jit import cdiv, env_flag, flavor, grouped_tile, interpreting, live_tile_range, next_pow2
from titan_megamoe.kernels.launch import launch
from titan_megamoe.kernels.configs import GemmConfig, config_for, persistent_programs
from titan_megamoe.kernels.routing import RoutingLayout, layout_caps
from titan_megamoe.kernels import ws_gemm, ws_gemm2

__all__ = ["gemm1_swiglu_fwd", "gemm2_scatter_fwd", "combine_topk", "interpret_mode", "launch_gemm1_swiglu_fwd",
           "launch_gemm2_scatter_fwd", "launch_combine_topk"]

#: GEMM1 by the warp-specialized Gluon kernel (``kernels/ws_gemm.py``: x rows gathered by cp.async in 4 producer
#: warps, weights by TMA, two cooperative consumer warpgroups) where it applies (sm_90, BM 128, D >= 2048,
#: F % 128 == 0, no EP arrival wait); else the Triton kernel. On by default (``TITAN_MEGAMOE_WS_GEMM1=0``: off)
#: since the single-GPU GPU suite passed with it (logs/tests_gpu_ws_gemm1_s11a_1xh200_20261202.log: graph
#: capture, no host sync, real-shape reference); bitwise the Triton kernel's output in every case checked;
#: layer forward 3.189 -> 2.929 ms from idle at 30B (layer_1xh200_ep1_s10e_20261202.json). Read at import; a
#: same-process switch (``switches.py``).
WS_GEMM1 = env_flag("TITAN_MEGAMOE_WS_GEMM1", True)
#: GEMM2 by the warp-specialized Gluon kernel (``kernels/ws_gemm2.py``: h and w2 by TMA, two cooperative consumers,
#: rows scattered from registers) where it applies (sm_90, BM 128, D >= 2048, D % 256 == 0, token-major output, the
#: default config); else the Triton kernel. On by default (``TITAN_MEGAMOE_WS_GEMM2=0``: off) since session 32 (one
#: H100: GPU tests bitwise the Triton kernel; 235B 2.761 -> 2.650 ms, 30B 0.787 -> 0.743,
#: ab_kernels_new_1xh100_s32a_20261207.json; 30B layer fwd+bwd with the expert order 7.282 -> 7.101 ms,
#: layer_1xh100_ep1_30b_s32c_20261207.json). Read at import; a same-process switch (``switches.py``).
WS_GEMM2 = env_flag("TITAN_MEGAMOE_WS_GEMM2", True)


# --------------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------------


@triton.jit
def _gemm1_swiglu_fwd_kernel(
    x_ptr,  # (T, D) bf16, token rows; gathered by row_pair // K
    w1_ptr,  # (E, F, D) bf16, gate projection
    w3_ptr,  # (E, F, D) bf16, up projection
    row_pair_ptr,  # (N_cap,) int32, pair t*K + k of each padded row, -1 for padding
    tile_expert_ptr,  # (n_tiles_cap,) int32, expert of each BM-row tile, -1 past the last expert
    gate_up_ptr,  # (N_cap, 2F) bf16 out, [gate | up] pre-activations
    h_ptr,  # (N_cap, F) bf16 out, silu(gate) * up
    E,  # i32, experts
    F: tl.constexpr,  # expert hidden dim (constexpr: see "Dims are constexpr" in the module doc)
    D: tl.constexpr,  # model dim
    K: tl.constexpr,  # top_k
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,  # D % BLOCK_K == 0: no reduction-dim mask
    USE_TMA: tl.constexpr,  # weight tiles through TMA descriptors (else pointer loads)
    UPCAST_FP32: tl.constexpr,  # interpreter: fp32 operands for tl.dot
    flags_ptr=None,  # (R*NB,) int32 v2 arrival flags of the slab's token blocks (WAIT only)
    epoch_ptr=None,  # (1,) int32 this rank's epoch (WAIT only)
    status_ptr=None,  # (4,) int32 wait status (WAIT only, comm/signals.py)
    max_polls=0,  # i32 poll bound (WAIT only)
    timeout_ns=0,  # i64 wait bound (WAIT only)
    WAIT: tl.constexpr = False,  # EP overlap v2: wait for the flag blocks of the gathered rows
    T_CAP: tl.constexpr = 1,  # slab rows per source (WAIT only)
    FB: tl.constexpr = 1,  # tokens per flag block (WAIT only)
    NB: tl.constexpr = 1,  # flag blocks per source (WAIT only)
    SITE: tl.constexpr = 0,  # wait site code for the status (WAIT only)
    USE_TIMER: tl.constexpr = False,  # bound the wait by globaltimer (GPUs) besides max_polls
):
    """Gathered grouped GEMM1 with both projections and SwiGLU in the epilogue.

    With WAIT (EP overlap v2, x_ptr = the receive slab, row j = src * T_CAP + t): before loading
    any row, the program waits (``comm/signals.wait_flags``: acquire polls, bounded) until every
    flag block from the lowest to the highest of its rows' blocks (src * NB + t // FB) holds this
    call's epoch. Rows of a tile ascend in j, so the range is short and covers every needed block.

    Grid: (n_tiles_cap, cdiv(F, BLOCK_N)). Launch ids are remapped to a grouped order (GROUP_M row
    tiles sweep all column blocks before the next group) so that each program owns exactly one
    (row tile m, column block n) pair: rows [m*BM, (m+1)*BM) x columns [n*BN, (n+1)*BN) of gate, of
    up (gate_up columns F + ...) and of h. Tiles with expert -1 return at once.
    Preconditions: N_cap a multiple of BM (layout_caps guarantees it), D and F multiples of 16,
    all tensors contiguous; no host sync, no atomics.
    """
    # ---- tile order: grouped for L2 reuse of the gathered x rows and the expert's weight columns ----
    num_pid_m = tl.num_programs(0)
    num_pid_n = tl.num_programs(1)
    pid = tl.program_id(0) + tl.program_id(1) * num_pid_m  # hardware launch order: axis 0 fastest
    pid_m, pid_n = grouped_tile(pid, num_pid_m, num_pid_n, GROUP_M)

    expert = tl.load(tile_expert_ptr + pid_m)
    if expert < 0:  # tile past the last expert's rows: nothing to compute, nothing written
        return

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # padded rows of this tile (< N_cap)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # gate / up / h columns
    offs_k = tl.arange(0, BLOCK_K)

    # ---- prologue: row gather. EP dispatch will read remote token rows here. ----------------------
    pair_M = tl.load(row_pair_ptr + offs_m)
    row_ok_M = pair_M >= 0
    # int64: token * D overflows int32 once T*D > 2^31 (large receive buffers).
    tok_M = tl.where(row_ok_M, pair_M // K, 0).to(tl.int64)
    x_ptrs = x_ptr + tok_M[:, None] * D + offs_k[None, :]  # (BM, BK) gathered row pointers
    if WAIT:
        blk_M = ((tok_M // T_CAP) * NB + (tok_M % T_CAP) // FB).to(tl.int32)
        g_lo = tl.min(tl.where(row_ok_M, blk_M, 2147483647))
        g_hi = tl.max(tl.where(row_ok_M, blk_M, -1))
        wait_flags(flags_ptr, epoch_ptr, status_ptr, g_lo, g_hi, max_polls, timeout_ns, NB, SITE, USE_TIMER)
    # ---- end of row gather -----------------------------------------------------------------------

    w_row0 = expert * F + pid_n * BLOCK_N  # first weight row of this column block in the (E*F, D) view
    if USE_TMA:
        # 2D view (E*F, D): a block past F reads the next expert's rows (in bounds) or TMA zero fill;
        # those columns are never stored, so their values do not matter.
        w1_desc = tl.make_tensor_descriptor(w1_ptr, shape=[E * F, D], strides=[D, 1], block_shape=[BLOCK_N, BLOCK_K])
        w3_desc = tl.make_tensor_descriptor(w3_ptr, shape=[E * F, D], strides=[D, 1], block_shape=[BLOCK_N, BLOCK_K])
    else:
        n_ok_N = offs_n < F
        # int64: expert * F * D overflows int32 for large layers (128 x 1536 x 4096 = 0.8e9, close to 2^31).
        w_off = w_row0.to(tl.int64) * D + tl.arange(0, BLOCK_N)[None, :] * D + offs_k[:, None]  # (BK, BN)
        w1_ptrs = w1_ptr + w_off
        w3_ptrs = w3_ptr + w_off

    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):
        if EVEN_K:
            a = tl.load(x_ptrs, mask=row_ok_M[:, None], other=0.0)
        else:
            a = tl.load(x_ptrs, mask=row_ok_M[:, None] & (k0 + offs_k[None, :] < D), other=0.0)
        if USE_TMA:
            b1 = w1_desc.load([w_row0, k0]).T  # (BK, BN)
            b3 = w3_desc.load([w_row0, k0]).T
        else:
            if EVEN_K:
                b_mask = n_ok_N[None, :]
            else:
                b_mask = n_ok_N[None, :] & (k0 + offs_k[:, None] < D)
            b1 = tl.load(w1_ptrs, mask=b_mask, other=0.0)
            b3 = tl.load(w3_ptrs, mask=b_mask, other=0.0)
            w1_ptrs += BLOCK_K
            w3_ptrs += BLOCK_K
        if UPCAST_FP32:
            a32 = a.to(tl.float32)
            acc_gate = tl.dot(a32, b1.to(tl.float32), acc_gate, input_precision="ieee")
            acc_up = tl.dot(a32, b3.to(tl.float32), acc_up, input_precision="ieee")
        else:
            acc_gate = tl.dot(a, b1, acc_gate)
            acc_up = tl.dot(a, b3, acc_up)
        x_ptrs += BLOCK_K

    # ---- epilogue: SwiGLU in fp32, store gate | up (for the backward) and h --------------------------
    # silu written out: tl.sigmoid is a jit library function, which under TRITON_INTERPRET=1 becomes
    # an InterpretedFunction whose call leaves triton.language patched (breaks later compiles).
    h = acc_gate / (1.0 + tl.exp(-acc_gate)) * acc_up  # padding rows: 0 / 2 * 0 = 0
    # int64: row * 2F overflows int32 for N_cap * 2F > 2^31.
    rows64 = offs_m.to(tl.int64)
    st_mask = (offs_n < F)[None, :]  # every row of a live tile is written (padding rows get zeros)
    gu_ptrs = gate_up_ptr + rows64[:, None] * (2 * F) + offs_n[None, :]
    tl.store(gu_ptrs, acc_gate.to(tl.bfloat16), mask=st_mask)
    tl.store(gu_ptrs + F, acc_up.to(tl.bfloat16), mask=st_mask)
    tl.store(h_ptr + rows64[:, None] * F + offs_n[None, :], h.to(tl.bfloat16), mask=st_mask)


@triton.jit
def _gemm2_tile(h_ptr, w2_ptr, scores_ptr, row_pair_ptr, out_pairs_ptr, N_cap, E, pid_m, pid_n, expert,
                F: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, USE_TMA: tl.constexpr, UPCAST_FP32: tl.constexpr,
                BY_ROW: tl.constexpr, EPILOGUE_FIRST: tl.constexpr):
    """One (row tile pid_m of ``expert``, column block pid_n) of GEMM2: h[rows] @ w2[e][cols].T, times the
    routing score, stored by pair (or layout row). ``EPILOGUE_FIRST`` loads the tile's pairs and scores
    before the K loop (the persistent kernel: in its flattened loop they would otherwise wait in the
    epilogue; same values, same results)."""
    row0 = pid_m * BLOCK_M
    offs_m = row0 + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    w_row0 = expert * D + pid_n * BLOCK_N  # first weight row in the (E*D, F) view
    if EPILOGUE_FIRST:
        pair_M = tl.load(row_pair_ptr + offs_m)
        row_ok_M = pair_M >= 0
        score_M = tl.load(scores_ptr + pair_M, mask=row_ok_M, other=0.0)

    if USE_TMA:
        h_desc = tl.make_tensor_descriptor(h_ptr, shape=[N_cap, F], strides=[F, 1], block_shape=[BLOCK_M, BLOCK_K])
        w2_desc = tl.make_tensor_descriptor(w2_ptr, shape=[E * D, F], strides=[F, 1], block_shape=[BLOCK_N, BLOCK_K])
    else:
        n_ok_N = offs_n < D
        # int64: row * F and expert * D * F overflow int32 for large layers.
        a_ptrs = h_ptr + offs_m.to(tl.int64)[:, None] * F + offs_k[None, :]
        w_ptrs = w2_ptr + w_row0.to(tl.int64) * F + tl.arange(0, BLOCK_N)[None, :] * F + offs_k[:, None]

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, F, BLOCK_K):
        if USE_TMA:
            a = h_desc.load([row0, k0])
            b = w2_desc.load([w_row0, k0]).T  # (BK, BN)
        else:
            if EVEN_K:
                a = tl.load(a_ptrs)
                b = tl.load(w_ptrs, mask=n_ok_N[None, :], other=0.0)
            else:
                k_ok = k0 + offs_k < F
                a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
                b = tl.load(w_ptrs, mask=n_ok_N[None, :] & k_ok[:, None], other=0.0)
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        if UPCAST_FP32:
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)

    # ---- epilogue: routing score (fp32), then the scatter to token-major pair rows ------------------
    if not EPILOGUE_FIRST:
        pair_M = tl.load(row_pair_ptr + offs_m)
        row_ok_M = pair_M >= 0
        score_M = tl.load(scores_ptr + pair_M, mask=row_ok_M, other=0.0)
    y = (acc * score_M[:, None]).to(tl.bfloat16)
    # ---- scatter store. EP combine will push these rows to the source GPU here. -------------------
    # int64: pair * D overflows int32 once P*D > 2^31.
    dst_M = offs_m if BY_ROW else pair_M
    dst_ptrs = out_pairs_ptr + dst_M.to(tl.int64)[:, None] * D + offs_n[None, :]
    tl.store(dst_ptrs, y, mask=row_ok_M[:, None] & (offs_n < D)[None, :])
    # ---- end of scatter store --------------------------------------------------------------------


@triton.jit
def _gemm2_scatter_fwd_kernel(
    h_ptr,  # (N_cap, F) bf16, SwiGLU output rows in the padded layout
    w2_ptr,  # (E, D, F) bf16, down projection
    scores_ptr,  # (P,) fp32, routing score of pair p = t*K + k
    row_pair_ptr,  # (N_cap,) int32, pair of each padded row, -1 for padding
    tile_expert_ptr,  # (n_tiles_cap,) int32, expert of each BM-row tile, -1 past the last expert
    out_pairs_ptr,  # (P, D) bf16 out, token-major weighted expert outputs
    offsets_ptr,  # (E + 1,) int32 expert offsets (PERSISTENT: live row tiles = offsets[E] // BM)
    N_cap,  # i32, rows of the padded layout
    E,  # i32, experts
    F: tl.constexpr,  # expert hidden dim (reduction)
    D: tl.constexpr,  # model dim (output columns)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,  # F % BLOCK_K == 0
    USE_TMA: tl.constexpr,  # h and weight tiles through TMA descriptors (else pointer loads)
    UPCAST_FP32: tl.constexpr,  # interpreter: fp32 operands for tl.dot
    BY_ROW: tl.constexpr = False,  # store at the layout row (N_cap, D) instead of the pair (P, D)
    PERSISTENT: tl.constexpr = False,  # NUM_PROGS programs loop over the live tiles (flattened loop)
    NUM_PROGS: tl.constexpr = 1,  # PERSISTENT: the grid size
):
    """Grouped GEMM2 with the routing score and the token-major scatter in the epilogue.

    Grid: (n_tiles_cap, cdiv(D, BLOCK_N)), launch ids remapped to the same grouped order as GEMM1.
    Each program owns one (row tile m, column block n): it computes h[rows] @ w2[e][cols].T and stores
    columns [n*BN, (n+1)*BN) of out_pairs[p] for every row of the tile with pair p >= 0. Every pair
    has exactly one layout row, so each output element is written exactly once (no atomics).
    Tiles with expert -1 return at once. h's padding rows are never stored, whatever they hold.
    Preconditions: N_cap a multiple of BM, D and F multiples of 16, contiguous tensors; no host sync.

    PERSISTENT (grid (NUM_PROGS,), pointer loads only): program i takes tiles i, i + NUM_PROGS, ... of the
    offsets[E] // BM live row tiles x the column blocks, in the same grouped order, in one loop that
    Triton flattens with each tile's K loop (``tl.range(..., flatten=True)``): the next tile's first K
    blocks load while this tile finishes and stores (GEMM2's K loop is short: F / BK = 12 steps at the
    30B shape, so a non-persistent program waits for its operands at every start). Tiles past the live
    ones are never visited (no expert -1 test inside the loop, which would stop the flattening). Same
    tiles, same arithmetic per tile: bitwise the output of the non-persistent grid.
    """
    if PERSISTENT:
        num_n: tl.constexpr = (D + BLOCK_N - 1) // BLOCK_N
        first, n_tiles, n_live = live_tile_range(offsets_ptr, E, BLOCK_M, num_n, UPCAST_FP32)
        for tile in tl.range(first, n_tiles, NUM_PROGS, flatten=True):
            pid_m, pid_n = grouped_tile(tile, n_live, num_n, GROUP_M)
            expert = tl.load(tile_expert_ptr + pid_m)
            _gemm2_tile(h_ptr, w2_ptr, scores_ptr, row_pair_ptr, out_pairs_ptr, N_cap, E, pid_m, pid_n, expert,
                        F, D, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, USE_TMA, UPCAST_FP32, BY_ROW, True)
    else:
        num_pid_m = tl.num_programs(0)
        num_pid_n = tl.num_programs(1)
        pid = tl.program_id(0) + tl.program_id(1) * num_pid_m  # hardware launch order: axis 0 fastest
        pid_m, pid_n = grouped_tile(pid, num_pid_m, num_pid_n, GROUP_M)

        expert = tl.load(tile_expert_ptr + pid_m)
        if expert < 0:
            return
        _gemm2_tile(h_ptr, w2_ptr, scores_ptr, row_pair_ptr, out_pairs_ptr, N_cap, E, pid_m, pid_n, expert,
                    F, D, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, USE_TMA, UPCAST_FP32, BY_ROW, False)


@triton.jit
def _combine_topk_fwd_kernel(
    y_ptr,  # (P, D) bf16, weighted expert outputs, row p = t*K + k
    out_ptr,  # (T, D) bf16 out
    D: tl.constexpr,  # model dim
    K: tl.constexpr,  # top_k
    BLOCK_D: tl.constexpr,
):
    """out[t, cols] = bf16(sum_{k=0..K-1} fp32(y[t*K + k, cols])), k in fixed ascending order.

    Grid: (T, cdiv(D, BLOCK_D)); program (t, j) owns columns [j*BD, (j+1)*BD) of token row t.
    Deterministic: the order of the K additions is fixed, no atomics.
    """
    t = tl.program_id(0).to(tl.int64)  # int64: t * K * D overflows int32 once P*D > 2^31
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    ok = cols < D
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for k in tl.static_range(K):
        acc += tl.load(y_ptr + (t * K + k) * D + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * D + cols, acc.to(tl.bfloat16), mask=ok)


# --------------------------------------------------------------------------------------------------
# Launch-time mode selection
# --------------------------------------------------------------------------------------------------


#: True when kernels run in the Triton interpreter, read at call time (``kernels/jit.py``).
interpret_mode = interpreting


#: The kernel in the interpreted or compiled flavor (``kernels/jit.py``); the sm_90a compile tests and
#: scripts ask for the compiled one with it.
_kernel_variant = flavor


def _tma_alloc(size: int, alignment: int, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _ensure_tma_allocator() -> None:
    """Device-side ``tl.make_tensor_descriptor`` needs a global scratch allocator (128 B per program).

    Only installed when none is set (never overrides the caller's); a ContextVar in Triton, so the
    setting is local to the current context.
    """
    from triton.runtime import _allocation

    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_tma_alloc)


# --------------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------------


def _check_bf16_2d_or_3d(name: str, t: Tensor, shape: tuple[int, ...], device) -> None:
    if t.dtype != torch.bfloat16:
        raise ValueError(f"{name} must be bf16, got {t.dtype}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (strides {t.stride()})")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")


def _check_layout(layout: RoutingLayout, T: int, E: int, cfg: GemmConfig, device) -> None:
    if layout.block_m != cfg.block_m:
        raise ValueError(
            f"config block_m={cfg.block_m} differs from the routing layout's block_m={layout.block_m}: "
            "build the layout with config.block_m"
        )
    if layout.num_experts != E:
        raise ValueError(f"layout built for {layout.num_experts} experts, weights have E={E}")
    n_cap, n_tiles = layout_caps(T, layout.top_k, E, layout.block_m, layout.max_rows)
    if layout.n_cap != n_cap or layout.n_tiles_cap != n_tiles or layout.pair_row.shape[0] != T * layout.top_k:
        raise ValueError(
            f"layout (N_cap={layout.n_cap}, n_tiles_cap={layout.n_tiles_cap}, P={layout.pair_row.shape[0]}) "
            f"was not built for T={T}, K={layout.top_k}, E={E}, block_m={layout.block_m} "
            f"(expected N_cap={n_cap}, n_tiles_cap={n_tiles}, P={T * layout.top_k})"
        )
    for name in ("row_pair", "tile_expert"):
        t = getattr(layout, name)
        if t.dtype != torch.int32 or not t.is_contiguous() or t.device != device:
            raise ValueError(f"layout.{name} must be a contiguous int32 tensor on {device}")


def _tma_usable(cfg: GemmConfig, *tensors: Tensor) -> bool:
    """TMA descriptors need 16-byte aligned base addresses (row strides are, by ``_check_dims``)."""
    return cfg.use_tma and all(t.data_ptr() % 16 == 0 for t in tensors)


def _check_dims(D: int, F: int) -> None:
    # Multiples of 16: tl.dot / wgmma reduce in steps of 16, and TMA needs 16-byte row strides.
    if D % 16 or F % 16:
        raise ValueError(f"D={D} and F={F} must be multiples of 16")


def _resolve_config(config: GemmConfig | None, kind: str, D: int, F: int, interpret: bool) -> GemmConfig:
    return config if config is not None else config_for(kind, D, F, interpret)


def gemm1_swiglu_fwd(
    x_TD: Tensor,
    w1_EFD: Tensor,
    w3_EFD: Tensor,
    layout: RoutingLayout,
    *,
    gate_up_out: Tensor | None = None,
    h_out: Tensor | None = None,
    config: GemmConfig | None = None,
    wait=None,
) -> tuple[Tensor, Tensor]:
    """Fused row gather + GEMM1 (gate and up) + SwiGLU, in the padded expert-major layout.

    Math, for each padded row r with pair p = row_pair[r] >= 0, t = p // K, e = tile_expert[r // BM]:
    ``gate_up[r] = [x[t] @ w1[e].T | x[t] @ w3[e].T]``, ``h[r] = silu(gate) * up`` (fp32, then bf16).

    Grid: (n_tiles_cap, cdiv(F, BN)); each program owns a BM x BN tile of gate, up and h (see
    ``_gemm1_swiglu_fwd_kernel``). Written rows: all rows of tiles with expert >= 0 (padding rows
    inside them are exact zeros); rows of tiles with expert -1 (>= offsets[E]) are not written.

    Args:
        x_TD: (T, D) bf16 contiguous token rows.
        w1_EFD, w3_EFD: (E, F, D) bf16 contiguous gate / up weights.
        layout: routing layout built by ``build_routing_layout`` for these T, K, E with
            ``block_m == config.block_m``.
        gate_up_out, h_out: optional (N_cap, 2F) / (N_cap, F) bf16 contiguous output buffers (``_out``
            convention: written in place and returned); allocated with ``torch.empty`` when None.
        config: launch config; default ``config_for("gemm1", D, F, interpret)``.
        wait: optional ``comm.signals.RowArrival`` (EP overlap v2): x_TD is the receive slab
            (T = R * T_cap) and each program first waits for the arrival flags of its rows' token
            blocks (bounded; a timeout goes to ``wait.status``, the host raises later).

    Returns:
        (gate_up_N2F, h_NF).

    Raises:
        ValueError: wrong dtype / shape / contiguity / device, D or F not a multiple of 16, or a
            layout built for other T, K, E or block_m.

    With ``WS_GEMM1`` on (the default; ``TITAN_MEGAMOE_WS_GEMM1=0`` off), no ``config`` / ``wait``, sm_90 and D >= 2048, the
    warp-specialized Gluon kernel (``ws_gemm.ws_gemm1_fwd``) computes the same outputs, bit for bit.

    Host syncs: none. Example (``test_worked_example_layout_rows``): T=2, K=2, E=3, BM=16, ids
    [[2, 0], [0, 1]] -> tile_expert [0, 1, 2, -1], N_cap 64: rows 0 and 1 = x[0] and x[1] through
    expert 0, row 16 = x[1] through expert 1, row 32 = x[0] through expert 2; rows 2-15, 17-31,
    33-47 = zeros (padding); rows 48-63 (tile of expert -1) not written.
    """
    if x_TD.dim() != 2 or w1_EFD.dim() != 3:
        raise ValueError(f"x must be (T, D) and w1 (E, F, D); got {tuple(x_TD.shape)}, {tuple(w1_EFD.shape)}")
    T, D = x_TD.shape
    E, F, _ = w1_EFD.shape
    dev = x_TD.device
    interpret = interpret_mode()
    cfg = _resolve_config(config, "gemm1", D, F, interpret)
    _check_bf16_2d_or_3d("x", x_TD, (T, D), dev)
    _check_bf16_2d_or_3d("w1", w1_EFD, (E, F, D), dev)
    _check_bf16_2d_or_3d("w3", w3_EFD, (E, F, D), dev)
    _check_dims(D, F)
    _check_layout(layout, T, E, cfg, dev)
    N = layout.n_cap
    if gate_up_out is None:
        gate_up_out = torch.empty((N, 2 * F), dtype=torch.bfloat16, device=dev)
    if h_out is None:
        h_out = torch.empty((N, F), dtype=torch.bfloat16, device=dev)
    _check_bf16_2d_or_3d("gate_up_out", gate_up_out, (N, 2 * F), dev)
    _check_bf16_2d_or_3d("h_out", h_out, (N, F), dev)
    if layout.n_tiles_cap == 0:
        return gate_up_out, h_out
    return _launch_gemm1(x_TD, w1_EFD, w3_EFD, layout, gate_up_out, h_out, cfg, config is None, wait, interpret)


def launch_gemm1_swiglu_fwd(x_TD: Tensor, w1_EFD: Tensor, w3_EFD: Tensor,
                            layout: RoutingLayout) -> tuple[Tensor, Tensor]:
    """:func:`gemm1_swiglu_fwd` with the default config and new outputs, without its checks, for a caller that
    has made them (``ops/triton_backend.triton_fwd_unchecked``: x (T, D), w1 / w3 (E, F, D) bf16 contiguous on
    one device, D and F multiples of 16, a layout it has just built for them). The forward is host-bound until
    GEMM1 is enqueued. Returns (gate_up, h)."""
    E, F, D = w1_EFD.shape
    dev = x_TD.device
    N = layout.n_cap
    gate_up = torch.empty((N, 2 * F), dtype=torch.bfloat16, device=dev)
    h = torch.empty((N, F), dtype=torch.bfloat16, device=dev)
    if layout.n_tiles_cap == 0:
        return gate_up, h
    interpret = interpret_mode()
    return _launch_gemm1(x_TD, w1_EFD, w3_EFD, layout, gate_up, h, config_for("gemm1", D, F, interpret), True, None,
                         interpret)


def _launch_gemm1(x_TD, w1_EFD, w3_EFD, layout, gate_up_out, h_out, cfg, default_config, wait, interpret):
    """The launch half of :func:`gemm1_swiglu_fwd` (operands, outputs and layout checked)."""
    T, D = x_TD.shape
    E, F, _ = w1_EFD.shape
    if WS_GEMM1 and default_config and wait is None and layout.block_m == 128 and D >= 2048:
        if ws_gemm.ws_gemm1_fwd_supported(x_TD, w1_EFD) is None:  # operands, outputs and layout checked above
            return ws_gemm.launch_gemm1_fwd(x_TD, w1_EFD, w3_EFD, layout, gate_up_out, h_out)
    use_tma = _tma_usable(cfg, w1_EFD, w3_EFD)  # else the pointer path (same results)
    if use_tma and not interpret:
        _ensure_tma_allocator()

    grid = (layout.n_tiles_cap, cdiv(F, cfg.block_n))
    extra = {}
    if wait is not None:
        if T != wait.t_cap * (wait.flags.numel() // wait.n_blocks):
            raise ValueError(f"wait: x has {T} rows, the slab of the arrival flags has "
                             f"{wait.t_cap * (wait.flags.numel() // wait.n_blocks)}")
        extra = dict(flags_ptr=wait.flags, epoch_ptr=wait.epoch, status_ptr=wait.status, max_polls=wait.max_polls,
                     timeout_ns=wait.timeout_ns, WAIT=True, T_CAP=wait.t_cap, FB=wait.flag_block,
                     NB=wait.n_blocks, SITE=wait.site, USE_TIMER=wait.use_timer)
    launch(_gemm1_swiglu_fwd_kernel, grid,
        x_TD, w1_EFD, w3_EFD, layout.row_pair, layout.tile_expert, gate_up_out, h_out,
        E, F, D,
        K=layout.top_k, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m, EVEN_K=D % cfg.block_k == 0, USE_TMA=use_tma, UPCAST_FP32=interpret,
        **cfg.compile_options(), **extra,
    )
    return gate_up_out, h_out


def gemm2_scatter_fwd(
    h_NF: Tensor,
    w2_EDF: Tensor,
    scores_TK: Tensor,
    layout: RoutingLayout,
    *,
    out_pairs: Tensor | None = None,
    config: GemmConfig | None = None,
    by_row: bool = False,
) -> Tensor:
    """Grouped GEMM2 + routing score + scatter to token-major (token, slot) rows.

    Math, for each padded row r with pair p = row_pair[r] >= 0 and e = tile_expert[r // BM]:
    ``y[p] = bf16(scores.view(-1)[p] * (h[r] @ w2[e].T))`` (fp32 accumulate, fp32 score).

    Grid: (n_tiles_cap, cdiv(D, BN)); each program owns BM rows x BN columns of the output, and every
    element of the (P, D) result is written exactly once (no atomics, deterministic).

    Args:
        h_NF: (N_cap, F) bf16 contiguous, the GEMM1 output (padding rows may hold anything).
        w2_EDF: (E, D, F) bf16 contiguous down weights.
        scores_TK: (T, K) fp32 contiguous routing scores.
        layout: the same routing layout as GEMM1 (``block_m == config.block_m``).
        out_pairs: optional (P, D) bf16 contiguous output buffer; ``torch.empty`` when None.
        config: launch config; default ``config_for("gemm2", D, F, interpret)``.
        by_row: store row r of the layout at row r of an (N_cap, D) output instead (padding rows
            unwritten): the expert-parallel path, whose receive side has P >> placed pairs.

    Returns:
        y_PD: (P, D) bf16, row p = t*K + k; with ``by_row``, (N_cap, D) in layout-row order.

    Raises:
        ValueError: wrong dtype / shape / contiguity / device, D or F not a multiple of 16, or a
            layout built for other T, K, E or block_m.

    With ``WS_GEMM2`` on (the default; ``TITAN_MEGAMOE_WS_GEMM2=0`` off), no ``config``, not ``by_row``, sm_90, D >= 2048 and
    D % 256 == 0, the warp-specialized Gluon kernel (``ws_gemm2.ws_gemm2_fwd``) computes the same output.

    Host syncs: none.
    """
    if h_NF.dim() != 2 or w2_EDF.dim() != 3 or scores_TK.dim() != 2:
        raise ValueError(
            f"h must be (N_cap, F), w2 (E, D, F), scores (T, K); got {tuple(h_NF.shape)}, "
            f"{tuple(w2_EDF.shape)}, {tuple(scores_TK.shape)}"
        )
    E, D, F = w2_EDF.shape
    T, K = scores_TK.shape
    dev = h_NF.device
    interpret = interpret_mode()
    cfg = _resolve_config(config, "gemm2", D, F, interpret)
    if K != layout.top_k:
        raise ValueError(f"scores have K={K} slots, layout was built for top_k={layout.top_k}")
    if scores_TK.dtype != torch.float32 or not scores_TK.is_contiguous() or scores_TK.device != dev:
        raise ValueError(f"scores must be a contiguous fp32 tensor on {dev}, got {scores_TK.dtype}")
    _check_dims(D, F)
    _check_layout(layout, T, E, cfg, dev)
    N, P = layout.n_cap, T * K
    _check_bf16_2d_or_3d("h", h_NF, (N, F), dev)
    _check_bf16_2d_or_3d("w2", w2_EDF, (E, D, F), dev)
    rows_out = N if by_row else P
    if out_pairs is None:
        out_pairs = torch.empty((rows_out, D), dtype=torch.bfloat16, device=dev)
    _check_bf16_2d_or_3d("out_pairs", out_pairs, (rows_out, D), dev)
    if layout.n_tiles_cap == 0:
        return out_pairs
    return _launch_gemm2(h_NF, w2_EDF, scores_TK, layout, out_pairs, cfg, by_row, interpret, config is None)


def launch_gemm2_scatter_fwd(h_NF: Tensor, w2_EDF: Tensor, scores_TK: Tensor, layout: RoutingLayout) -> Tensor:
    """:func:`gemm2_scatter_fwd` with the default config, a new (P, D) output and token-major rows, without its
    checks, for a caller that has made them (``ops/triton_backend.triton_fwd_unchecked``: h from
    :func:`launch_gemm1_swiglu_fwd` on the same layout, w2 (E, D, F) bf16 contiguous, scores (T, K) fp32
    contiguous, all on one device). Returns y_PD."""
    E, D, F = w2_EDF.shape
    T, K = scores_TK.shape
    out_pairs = torch.empty((T * K, D), dtype=torch.bfloat16, device=h_NF.device)
    if layout.n_tiles_cap == 0:
        return out_pairs
    interpret = interpret_mode()
    return _launch_gemm2(h_NF, w2_EDF, scores_TK, layout, out_pairs, config_for("gemm2", D, F, interpret), False,
                         interpret, True)


def _launch_gemm2(h_NF, w2_EDF, scores_TK, layout, out_pairs, cfg, by_row, interpret, default_config):
    """The launch half of :func:`gemm2_scatter_fwd` (operands, output and layout checked)."""
    E, D, F = w2_EDF.shape
    if WS_GEMM2 and default_config and not by_row and layout.block_m == 128 and D >= 2048:
        if ws_gemm2.ws_gemm2_fwd_supported(h_NF, w2_EDF) is None:  # operands, output and layout checked above
            return ws_gemm2.launch_gemm2_fwd(h_NF, w2_EDF, scores_TK, layout, out_pairs)
    N, dev = layout.n_cap, h_NF.device
    use_tma = _tma_usable(cfg, h_NF, w2_EDF)  # else the pointer path (same results)
    if use_tma and not interpret:
        _ensure_tma_allocator()

    num_n = cdiv(D, cfg.block_n)
    if cfg.persistent:
        grid = (persistent_programs(dev, layout.n_tiles_cap * num_n, interpret),)
    else:
        grid = (layout.n_tiles_cap, num_n)
    launch(_gemm2_scatter_fwd_kernel, grid,
        h_NF, w2_EDF, scores_TK, layout.row_pair, layout.tile_expert, out_pairs, layout.offsets,
        N, E, F, D,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        EVEN_K=F % cfg.block_k == 0, USE_TMA=use_tma, UPCAST_FP32=interpret, BY_ROW=by_row,
        PERSISTENT=cfg.persistent, NUM_PROGS=grid[0] if cfg.persistent else 1,
        **cfg.compile_options(),
    )
    return out_pairs


def combine_topk(y_PD: Tensor, T: int, K: int) -> Tensor:
    """Sum each token's K weighted expert rows in fp32, slots in order k = 0..K-1, cast to bf16.

    Grid: (T, cdiv(D, BD)); program (t, j) owns a BD-column chunk of out[t]. Deterministic (fixed
    order, no atomics), no host sync.

    Args:
        y_PD: (T*K, D) bf16 contiguous, row p = t*K + k (``gemm2_scatter_fwd``'s output).
        T, K: tokens and top_k.

    Returns:
        out_TD: (T, D) bf16, newly allocated.

    Example: K=2, y rows [1, 2] and [3, 4] for token 0 -> out[0] = [4, 6].
    """
    if y_PD.dim() != 2 or y_PD.shape[0] != T * K:
        raise ValueError(f"y must be (T*K={T * K}, D), got {tuple(y_PD.shape)}")
    if y_PD.dtype != torch.bfloat16 or not y_PD.is_contiguous():
        raise ValueError(f"y must be a contiguous bf16 tensor, got {y_PD.dtype}, strides {y_PD.stride()}")
    if K < 1:
        raise ValueError(f"K={K} must be >= 1")
    return launch_combine_topk(y_PD, T, K)


def launch_combine_topk(y_PD: Tensor, T: int, K: int) -> Tensor:
    """:func:`combine_topk` without its checks, for a caller that has made them (y (T*K, D) bf16 contiguous,
    K >= 1)."""
    D = y_PD.shape[1]
    out_TD = torch.empty((T, D), dtype=torch.bfloat16, device=y_PD.device)
    if T == 0 or D == 0:
        return out_TD
    interpret = interpret_mode()
    block_d = 64 if interpret else min(1024, next_pow2(D))
    grid = (T, cdiv(D, block_d))
    launch(_combine_topk_fwd_kernel, grid,
        y_PD, out_TD, D, K=K, BLOCK_D=block_d, num_warps=1 if interpret else 4,
    )
    return out_TD
