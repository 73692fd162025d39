"""Expert-parallel dispatch and combine kernels: direct loads and stores into peers' workspaces.

Shape legend: R EP ranks, T tokens of this rank (T <= T_cap), K top_k, D model dim, E_l = E / R
local experts per rank, slab row j = src * T_cap + t (see ``comm/workspace.py``), P' = R * T_cap * K
received (slab row, slot) pairs, N_cap' the rows of the receive-side routing layout.

Every kernel takes ``peer_bases``: the device address of R uint64 workspace base addresses (symmetric
memory's ``buffer_ptrs_dev`` on GPUs, a CPU table in the interpreter) plus byte offsets of the
regions; a store through a peer's base is an NVLink write on GPUs (DeepGEMM Mega MoE / DESIGN.md
sections 6-7). Phases are separated by the caller's barriers (v1: no in-kernel waiting, so no
spin-waits to bound here); every element has one writer and every sum a fixed order: deterministic.

    dispatch_push  (source)       ids/scores of all T_cap rows -> every rank; x (and dy) rows -> each
                                  rank holding one of the token's experts, once per rank
    dispatch_push_fp8 (source)    as dispatch_push for x, but each row quantized 1x128 once in
                                  registers and pushed as e4m3 + fp32 scales (D + 4 D / 128 bytes
                                  instead of 2 D) into the destinations' xq / xs slab
    combine_push   (destination)  sum of a slab row's placed slot rows (fp32, k order) -> the source's
                                  comb[this rank, t]
    dscore_push    (destination)  d score of each placed slot -> the source's dscore[t, k]
    combine_sum    (source)       out[t] = sum over ranks r holding an expert of t (r order) of comb[r, t]
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from titan_megamoe.comm.workspace import WorkspaceLayout
from titan_megamoe.kernels.fp8_quant import _amax, _scale_of, _to_e4m3
from titan_megamoe.kernels.jit import interpreting as _interpreting
from titan_megamoe.kernels.jit import cdiv, next_pow2
from titan_megamoe.kernels.launch import launch
from titan_megamoe.kernels.routing import RoutingLayout

__all__ = ["dispatch_push", "dispatch_push_fp8", "dispatch_rows", "combine_push", "dscore_push", "combine_sum"]


@triton.jit
def _peer_base(peer_bases, r):
    return tl.load(peer_bases.to(tl.pointer_type(tl.uint64)) + r).to(tl.pointer_type(tl.int8))


@triton.jit
def _dispatch_kernel(
    x_TD, dy_TD, ids_TK, scores_TK,   # this rank's tokens; dy only read when HAS_DY
    peer_bases,                        # address of R uint64 workspace bases
    T, rank,                           # i32 tokens of this rank, this rank's index
    OFF_X, OFF_DY, OFF_IDS, OFF_SC,    # byte offsets of the regions
    T_CAP: tl.constexpr, D: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, E_LOCAL: tl.constexpr,
    HAS_DY: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, SEND_ROWS: tl.constexpr = True,
):
    """Grid (cdiv(T_cap, BT), R): program (i, d) sends tokens [i*BT, (i+1)*BT) to rank d: their slot
    ids local to d (-1 elsewhere, and for t >= T) and scores for every row < T_cap, and the x (dy)
    rows of the tokens with at least one expert on d (not with SEND_ROWS=False: v2 sends the rows
    with ``_dispatch_rows_kernel``)."""
    pid = tl.program_id(0)
    d = tl.program_id(1)
    tt = pid * BT + tl.arange(0, BT)
    in_cap = tt < T_CAP
    live = tt < T
    kk = tl.arange(0, KP)
    k_ok = kk < K
    m2 = live[:, None] & k_ok[None, :]
    tt64 = tt.to(tl.int64)
    ids = tl.load(ids_TK + tt64[:, None] * K + kk[None, :], mask=m2, other=-1)
    loc = ids - d * E_LOCAL
    mine = m2 & (ids >= 0) & (loc >= 0) & (loc < E_LOCAL)
    lid = tl.where(mine, loc, -1).to(tl.int32)
    sc = tl.load(scores_TK + tt64[:, None] * K + kk[None, :], mask=mine, other=0.0)
    base = _peer_base(peer_bases, d)
    slot = (rank * T_CAP + tt).to(tl.int64)
    m_st = in_cap[:, None] & k_ok[None, :]
    tl.store((base + OFF_IDS).to(tl.pointer_type(tl.int32)) + slot[:, None] * K + kk[None, :], lid, mask=m_st)
    tl.store((base + OFF_SC).to(tl.pointer_type(tl.float32)) + slot[:, None] * K + kk[None, :], sc, mask=m_st)
    if SEND_ROWS:
        routed = tl.max(mine.to(tl.int32), axis=1) > 0
        x_dst = (base + OFF_X).to(tl.pointer_type(tl.bfloat16))
        dy_dst = (base + OFF_DY).to(tl.pointer_type(tl.bfloat16))
        for d0 in range(0, D, BD):
            dd = d0 + tl.arange(0, BD)
            m = routed[:, None] & (dd < D)[None, :]
            v = tl.load(x_TD + tt64[:, None] * D + dd[None, :], mask=m, other=0.0)
            tl.store(x_dst + slot[:, None] * D + dd[None, :], v, mask=m)
            if HAS_DY:
                g = tl.load(dy_TD + tt64[:, None] * D + dd[None, :], mask=m, other=0.0)
                tl.store(dy_dst + slot[:, None] * D + dd[None, :], g, mask=m)


@triton.jit
def _dispatch_fp8_kernel(
    x_TD, ids_TK, scores_TK,           # (T, D) bf16 / fp32 this rank's tokens; (T, K) global ids; (T, K) fp32
    peer_bases,                        # address of R uint64 workspace bases
    count_ptr,                         # (1,) int32, += non-finite x groups; CHECK only
    T, rank,                           # i32 tokens of this rank, this rank's index
    OFF_XQ, OFF_XS, OFF_IDS, OFF_SC,   # byte offsets of the regions (xq / xs: inside dy, comm/workspace.py)
    T_CAP: tl.constexpr, D: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, E_LOCAL: tl.constexpr,
    R: tl.constexpr, BT: tl.constexpr, NGP: tl.constexpr,  # NGP = next_pow2(D // 128)
    CHECK: tl.constexpr, EXACT_ROUND: tl.constexpr, EPS: tl.constexpr,
):
    """Grid (cdiv(T_cap, BT),): program i owns tokens [i*BT, (i+1)*BT) and sends them to every rank d:
    the slot ids local to d (-1 elsewhere, and for t >= T) and scores of every row < T_cap, as
    ``_dispatch_kernel``; then, 128 channels at a time, it reads the bf16 x rows of the tokens with an
    expert on some rank **once**, quantizes them 1x128 in registers (``fp8_quant``'s helpers: the math of
    ``quantize_act_1x128``, bitwise) and stores the e4m3 group into xq[rank, t] of each rank d holding
    one of t's experts; the D / 128 scales of a row are kept in registers and stored once per
    destination row at the end (NG * 4 contiguous bytes). Rows t >= T and tokens routed nowhere are
    neither read nor stored. CHECK: the number of groups with a non-finite scale (inf / NaN in x) of
    the routed rows is added to ``count_ptr`` once per token (not per destination)."""
    G: tl.constexpr = 128
    NG: tl.constexpr = D // G
    pid = tl.program_id(0)
    tt = pid * BT + tl.arange(0, BT)
    in_cap = tt < T_CAP
    live = tt < T
    kk = tl.arange(0, KP)
    k_ok = kk < K
    m2 = live[:, None] & k_ok[None, :]
    m_st = in_cap[:, None] & k_ok[None, :]
    tt64 = tt.to(tl.int64)
    ids = tl.load(ids_TK + tt64[:, None] * K + kk[None, :], mask=m2, other=-1)
    slot = (rank * T_CAP + tt).to(tl.int64)
    for d in tl.static_range(R):  # metadata, as _dispatch_kernel
        loc = ids - d * E_LOCAL
        mine = m2 & (ids >= 0) & (loc >= 0) & (loc < E_LOCAL)
        lid = tl.where(mine, loc, -1).to(tl.int32)
        sc = tl.load(scores_TK + tt64[:, None] * K + kk[None, :], mask=mine, other=0.0)
        base = _peer_base(peer_bases, d)
        tl.store((base + OFF_IDS).to(tl.pointer_type(tl.int32)) + slot[:, None] * K + kk[None, :], lid, mask=m_st)
        tl.store((base + OFF_SC).to(tl.pointer_type(tl.float32)) + slot[:, None] * K + kk[None, :], sc, mask=m_st)
    # rank holding each slot's expert (-1: masked slot; where() first: integer // truncates toward 0)
    owner = tl.where(ids >= 0, ids // E_LOCAL, -1)
    routed_any = tl.max(((owner >= 0) & (owner < R)).to(tl.int32), axis=1) > 0
    cols = tl.arange(0, G)
    gg = tl.arange(0, NGP)
    s_acc = tl.zeros((BT, NGP), dtype=tl.float32)  # the row's scales, stored once per destination below
    for g in range(0, NG):
        cg = g * G + cols
        x = tl.load(x_TD + tt64[:, None] * D + cg[None, :], mask=routed_any[:, None], other=0.0).to(tl.float32)
        scale_M1 = _scale_of(_amax(x, 1), EPS)  # (BT, 1)
        q = _to_e4m3(x, scale_M1, EXACT_ROUND)
        s_acc = tl.where(gg[None, :] == g, scale_M1, s_acc)
        for d in tl.static_range(R):
            routed = tl.max((owner == d).to(tl.int32), axis=1) > 0
            xq_dst = (_peer_base(peer_bases, d) + OFF_XQ).to(tl.pointer_type(tl.float8e4nv))
            tl.store(xq_dst + slot[:, None] * D + cg[None, :], q, mask=routed[:, None])
    g_ok = gg < NG
    for d in tl.static_range(R):
        routed = tl.max((owner == d).to(tl.int32), axis=1) > 0
        xs_dst = (_peer_base(peer_bases, d) + OFF_XS).to(tl.pointer_type(tl.float32))
        tl.store(xs_dst + slot[:, None] * NG + gg[None, :], s_acc, mask=routed[:, None] & g_ok[None, :])
    if CHECK:
        bad = routed_any[:, None] & g_ok[None, :] & ~(s_acc < float("inf"))  # NaN < inf is False
        n_bad = tl.sum(tl.sum(bad.to(tl.int32), 1), 0)
        tl.atomic_add(count_ptr, n_bad, mask=n_bad > 0)


@triton.jit
def _dispatch_rows_kernel(
    x_TD, ids_TK,                      # this rank's tokens (T, D) bf16, global ids (T, K)
    peer_bases, epoch_ptr,             # R uint64 workspace bases; (1,) int32 this rank's epoch
    T, rank, OFF_X, OFF_FLAG,          # i32, i32, byte offsets of x and xflag
    T_CAP: tl.constexpr, D: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, E_LOCAL: tl.constexpr,
    R: tl.constexpr, FB: tl.constexpr, NB: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
    NPROG: tl.constexpr,               # grid size (constexpr: a runtime range() start fails in the interpreter)
):
    """Overlap v2. Persistent grid (P,), P <= the SM count: program i takes work items w = i, i + P,
    ... < NB * R in block-major order (b = w // R, d = w % R, so every destination gets block 0
    first): it stores the x rows of tokens [b*FB, (b+1)*FB) with an expert on d into d's slab rows
    rank * T_cap + t, then (``tl.debug_barrier()``: every thread's stores are issued before the
    flag, DESIGN.md section 7) sets d's xflag[rank, b] = epoch with a release atomic at system
    scope. The flag is set even when no row of the block goes to d (a waiting tile never stalls on
    an empty block). Never waits on anything: it cannot deadlock with waiting GEMM1 programs."""
    pid = tl.program_id(0)
    e = tl.load(epoch_ptr)
    kk = tl.arange(0, KP)
    for it in range(0, (NB * R + NPROG - 1) // NPROG):
        w = pid + it * NPROG
        if w < NB * R:
            b = w // R
            d = w % R
            base = _peer_base(peer_bases, d)
            x_dst = (base + OFF_X).to(tl.pointer_type(tl.bfloat16))
            for c0 in range(0, FB, BT):
                tt = b * FB + c0 + tl.arange(0, BT)
                live = (tt < T) & (c0 + tl.arange(0, BT) < FB)
                tt64 = tt.to(tl.int64)
                ids = tl.load(ids_TK + tt64[:, None] * K + kk[None, :], mask=live[:, None] & (kk < K)[None, :],
                              other=-1)
                loc = ids - d * E_LOCAL
                routed = tl.max(((ids >= 0) & (loc >= 0) & (loc < E_LOCAL)).to(tl.int32), axis=1) > 0
                slot = (rank * T_CAP + tt).to(tl.int64)
                for d0 in range(0, D, BD):
                    dd = d0 + tl.arange(0, BD)
                    m = routed[:, None] & (dd < D)[None, :]
                    v = tl.load(x_TD + tt64[:, None] * D + dd[None, :], mask=m, other=0.0)
                    tl.store(x_dst + slot[:, None] * D + dd[None, :], v, mask=m)
            tl.debug_barrier()
            flag = (base + OFF_FLAG).to(tl.pointer_type(tl.int32)) + rank * NB + b
            tl.atomic_xchg(flag, e, sem="release", scope="sys")


@triton.jit
def _combine_push_kernel(
    rows_ND,          # (N_cap', D) bf16, receive-side rows in layout order (GEMM2 out by row, or dx rows)
    pair_row_P,       # (P',) int32, layout row of each received pair, -1 if not placed here
    peer_bases, rank, OFF_COMB,
    T_CAP: tl.constexpr, D: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
    COMB_BF16: tl.constexpr = True,  # comb rows bf16 (comm/workspace.py COMBINE_DTYPE), else fp32
):
    """Grid (R, cdiv(T_cap, BT), cdiv(D, BD)): program (src, i, c) sums, for slab rows of source src,
    the rows of their placed slots in fp32 (k order) and stores the sum, rounded to the comb dtype, into
    src's comb[rank, t] (only for rows with a placed slot: the source knows which ranks to read)."""
    src = tl.program_id(0)
    tt = tl.program_id(1) * BT + tl.arange(0, BT)
    dd = tl.program_id(2) * BD + tl.arange(0, BD)
    t_ok = tt < T_CAP
    d_ok = dd < D
    j = (src * T_CAP + tt).to(tl.int64)
    acc = tl.zeros((BT, BD), dtype=tl.float32)
    hit = tl.zeros((BT,), dtype=tl.int32)
    for k in tl.static_range(K):
        row = tl.load(pair_row_P + j * K + k, mask=t_ok, other=-1)
        ok = row >= 0
        v = tl.load(rows_ND + row.to(tl.int64)[:, None] * D + dd[None, :], mask=ok[:, None] & d_ok[None, :], other=0.0)
        acc += v.to(tl.float32)
        hit = tl.maximum(hit, ok.to(tl.int32))
    base = _peer_base(peer_bases, src)
    row_off = (rank * T_CAP + tt).to(tl.int64)[:, None] * D + dd[None, :]
    if COMB_BF16:
        tl.store((base + OFF_COMB).to(tl.pointer_type(tl.bfloat16)) + row_off, acc.to(tl.bfloat16),
                 mask=(hit > 0)[:, None] & d_ok[None, :])
    else:
        tl.store((base + OFF_COMB).to(tl.pointer_type(tl.float32)) + row_off, acc,
                 mask=(hit > 0)[:, None] & d_ok[None, :])


@triton.jit
def _dscore_push_kernel(
    part_NB,          # (N_cap', NB) fp32 per-column-block partials of d score (gemm2_dgrad epilogue)
    pair_row_P,       # (P',) int32
    peer_bases, OFF_DS,
    T_CAP: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, NB: tl.constexpr, BT: tl.constexpr,
):
    """Grid (R, cdiv(T_cap, BT)): d score of each placed slot of source src's slab rows, the NB
    partials summed in ascending order (as ``reduce_dscore``), stored into src's dscore[t, k]."""
    src = tl.program_id(0)
    tt = tl.program_id(1) * BT + tl.arange(0, BT)
    kk = tl.arange(0, KP)
    m2 = (tt < T_CAP)[:, None] & (kk < K)[None, :]
    j = (src * T_CAP + tt).to(tl.int64)
    rows = tl.load(pair_row_P + j[:, None] * K + kk[None, :], mask=m2, other=-1)
    ok = rows >= 0
    r64 = tl.where(ok, rows, 0).to(tl.int64)
    acc = tl.zeros((BT, KP), dtype=tl.float32)
    for nb in range(0, NB):
        acc += tl.load(part_NB + r64 * NB + nb, mask=ok, other=0.0)
    base = _peer_base(peer_bases, src)
    dst = (base + OFF_DS).to(tl.pointer_type(tl.float32)) + tt.to(tl.int64)[:, None] * K + kk[None, :]
    tl.store(dst, acc, mask=ok)


@triton.jit
def _combine_sum_kernel(
    comb_RTD,         # (R, T_cap, D) bf16 | fp32, this rank's comb region
    ids_TK,           # (T, K) global expert ids of this rank's tokens
    out_TD,           # (T, D) out (bf16 or fp32)
    T,
    R: tl.constexpr, T_CAP: tl.constexpr, D: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
    E_LOCAL: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
):
    """Grid (cdiv(T, BT), cdiv(D, BD)): out[t] = sum over ranks r = 0..R-1 that hold one of t's
    experts of comb[r, t] (fp32, rank order), cast to out's dtype."""
    tt = tl.program_id(0) * BT + tl.arange(0, BT)
    dd = tl.program_id(1) * BD + tl.arange(0, BD)
    t_ok = tt < T
    d_ok = dd < D
    kk = tl.arange(0, KP)
    tt64 = tt.to(tl.int64)
    ids = tl.load(ids_TK + tt64[:, None] * K + kk[None, :], mask=t_ok[:, None] & (kk < K)[None, :], other=-1)
    owner = tl.where(ids >= 0, ids // E_LOCAL, -1)
    acc = tl.zeros((BT, BD), dtype=tl.float32)
    for r in tl.static_range(R):
        has = tl.max((owner == r).to(tl.int32), axis=1) > 0
        acc += tl.load(comb_RTD + (r * T_CAP + tt64)[:, None] * D + dd[None, :],
                       mask=(has & t_ok)[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    tl.store(out_TD + tt64[:, None] * D + dd[None, :], acc.to(out_TD.dtype.element_ty),
             mask=t_ok[:, None] & d_ok[None, :])


# --------------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------------

def _opts(num_warps: int = 4) -> dict:
    return {} if _interpreting() else {"num_warps": num_warps}


def _blocks(D: int) -> tuple[int, int]:
    """(BT, BD): token rows and columns per program."""
    if _interpreting():
        return 16, min(64, next_pow2(D))
    return 16, min(512, next_pow2(D))


def dispatch_push(x_TD: Tensor, dy_TD: Tensor | None, topk_ids_TK: Tensor, topk_scores_TK: Tensor,
                  ws: WorkspaceLayout, peer_bases: int, rank: int, experts_per_rank: int,
                  send_rows: bool = True) -> None:
    """Send this rank's routing metadata (all T_cap rows) and token rows to every rank (only the
    metadata with ``send_rows=False``: overlap v2 sends the x rows with ``dispatch_rows``).

    Args:
        x_TD: (T, D) bf16 layer input; dy_TD: optional (T, D) bf16 output gradient (backward).
        topk_ids_TK: (T, K) int32/int64 global expert ids; topk_scores_TK: (T, K) fp32.
        ws: the workspace layout (T <= ws.t_cap, D == ws.dim, K == ws.top_k).
        peer_bases: device address of the R workspace base addresses; rank: this rank.
        experts_per_rank: E_l (rank r owns experts [r*E_l, (r+1)*E_l)).
    """
    T, D = x_TD.shape
    K = topk_ids_TK.shape[1]
    bt, bd = _blocks(D)
    grid = (cdiv(ws.t_cap, bt), ws.world)
    launch(_dispatch_kernel, grid,
        x_TD, x_TD if dy_TD is None else dy_TD, topk_ids_TK, topk_scores_TK, peer_bases, T, rank,
        ws.offsets["x"], ws.offsets["dy"], ws.offsets["ids"], ws.offsets["scores"],
        T_CAP=ws.t_cap, D=D, K=K, KP=next_pow2(K), E_LOCAL=experts_per_rank,
        HAS_DY=dy_TD is not None, BT=bt, BD=bd, SEND_ROWS=send_rows, **_opts(),
    )


def _blocks_fp8() -> int:
    """BT, token rows per program of ``_dispatch_fp8_kernel`` (one 128-channel group at a time: BT * 128
    values in flight, 16 per thread at 4 warps). sm_90a, D = 2048 (tests/test_ep_triton.py compile
    check): BT = 16 takes 80 registers at EP = 2 and 168 at EP = 8 (the destination loop is unrolled);
    BT = 32 took 228 and spilled at EP = 8."""
    return 16


def dispatch_push_fp8(x_TD: Tensor, topk_ids_TK: Tensor, topk_scores_TK: Tensor, ws: WorkspaceLayout,
                      peer_bases: int, rank: int, experts_per_rank: int, *,
                      nonfinite_count: Tensor | None = None, name: str | None = None) -> None:
    """FP8 payload dispatch of the forward: this rank's routing metadata (all T_cap rows) to every rank,
    as :func:`dispatch_push`, and each x row quantized 1x128 on this rank **once** (in the push kernel's
    registers, no extra pass over x) and pushed as e4m3 values + fp32 scales to each rank holding one
    of its experts, once per (token, rank): slab row ``rank * T_cap + t`` of the destination's ``xq``
    (R, T_cap, D) float8_e4m3fn and ``xs`` (R, T_cap, D / 128) fp32 regions (``comm/workspace.py``;
    they share the dy region's bytes).

    The values and scales equal ``fp8_quant.quantize_act_1x128(x_TD)`` row for row, bitwise (same
    helpers, same math), so GEMM1 on the received rows equals GEMM1 on the bf16 slab quantized on the
    receiving rank (the v1 payload). Bytes per (token, destination) row: ``D + 4 D / 128`` (2112 at
    D = 2048) instead of ``2 D`` (4096).

    Grid: (cdiv(T_cap, BT),), one program per BT tokens, looping over the D / 128 groups and, inside,
    over the R destinations (``_dispatch_fp8_kernel``). No host sync.

    Args:
        x_TD: (T, D) bf16 (or fp32 / fp16) contiguous layer input, T <= ws.t_cap, D == ws.dim a
            multiple of 128.
        topk_ids_TK: (T, K) int32 / int64 global expert ids; topk_scores_TK: (T, K) fp32, K == ws.top_k.
        ws: the workspace layout; peer_bases: device address of the R workspace base addresses;
            rank: this rank; experts_per_rank: E_l (rank r owns experts [r*E_l, (r+1)*E_l)).
        nonfinite_count: optional (1,) int32 device counter: += the number of 1x128 groups of routed
            rows whose scale is not finite (inf / NaN in x), once per token (``fp8_backend.NONFINITE``
            reads it lazily). None: no check.
        name: named in error messages.

    Raises:
        ValueError: D not a multiple of 128, shapes / dtypes / contiguity not as above, T > T_cap.

    Caller contract: as :func:`dispatch_push` (a barrier before: every rank finished reading the
    previous call's slab, dy included; a barrier after, before GEMM1 reads xq / xs). Rows of the
    destination's xq / xs that no source wrote this call keep stale bytes (or the 0xFF poison, NaN in
    e4m3 and fp32): only rows with a placed slot may be read (GEMM1 gathers exactly those).

    Example (``tests/test_ep_fp8_dispatch.py::test_worked_example``): R = 2, E_l = 1, T_cap = 2,
    D = 128; rank 0's tokens x = [[896, 0, ...], [1, 0, ...]] with experts [[1], [0]]: rank 1's
    xq[0, 0] = [448, 0, ...], xs[0, 0] = [2]; rank 0's xq[0, 1] = [448, 0, ...], xs[0, 1] = [1/448].
    """
    from titan_megamoe.kernels.fp8_quant import _count_arg
    from titan_megamoe.ops.fp8_reference import AMAX_EPS, check_group_dim

    fn = "dispatch_push_fp8"
    if x_TD.dim() != 2 or not x_TD.is_contiguous() or x_TD.dtype not in (torch.bfloat16, torch.float32, torch.float16):
        raise ValueError(f"{fn}: x must be a contiguous (T, D) bf16 / fp32 / fp16 tensor, got {x_TD.dtype} "
                         f"{tuple(x_TD.shape)} (strides {x_TD.stride()})")
    T, D = x_TD.shape
    check_group_dim(D, "model dim D (last dim)", fn, name)
    K = topk_ids_TK.shape[1] if topk_ids_TK.dim() == 2 else -1
    if (D != ws.dim or T > ws.t_cap or K != ws.top_k or tuple(topk_ids_TK.shape) != (T, K)
            or tuple(topk_scores_TK.shape) != (T, K)):
        raise ValueError(f"{fn}: x {tuple(x_TD.shape)}, ids {tuple(topk_ids_TK.shape)}, scores "
                         f"{tuple(topk_scores_TK.shape)} do not fit the workspace (T <= T_cap={ws.t_cap}, D={ws.dim}, "
                         f"K={ws.top_k})")
    if not (topk_ids_TK.is_contiguous() and topk_scores_TK.is_contiguous()):
        raise ValueError(f"{fn}: topk_ids / topk_scores must be contiguous")
    count, check = _count_arg(fn, nonfinite_count, x_TD.device)
    bt = _blocks_fp8()
    grid = (cdiv(ws.t_cap, bt),)
    launch(_dispatch_fp8_kernel, grid,
        x_TD, topk_ids_TK, topk_scores_TK, peer_bases, count if check else x_TD, T, rank,
        ws.offsets["xq"], ws.offsets["xs"], ws.offsets["ids"], ws.offsets["scores"],
        T_CAP=ws.t_cap, D=D, K=K, KP=next_pow2(K), E_LOCAL=experts_per_rank, R=ws.world, BT=bt,
        NGP=next_pow2(D // 128), CHECK=check, EXACT_ROUND=_interpreting(), EPS=AMAX_EPS, **_opts(),
    )


def dispatch_rows(x_TD: Tensor, topk_ids_TK: Tensor, ws: WorkspaceLayout, peer_bases: int, rank: int,
                  experts_per_rank: int, epoch: Tensor, max_programs: int) -> None:
    """Overlap v2: push this rank's x rows (once per (token, rank holding one of its experts)) and
    set each destination's arrival flag xflag[rank, b] = epoch per FB-token block (release).

    Args:
        x_TD: (T, D) bf16; topk_ids_TK: (T, K) int32/int64 global expert ids.
        ws: workspace layout (FB = ws.flag_block); peer_bases, rank, experts_per_rank: as dispatch_push.
        epoch: (1,) int32 device tensor, this rank's barrier epoch (``peers.sync.epoch``): equal on
            every rank between two barriers, so the destination waits for flag == its own epoch.
        max_programs: grid bound (the SM count on GPUs: all programs resident at once, launched on a
            high-priority stream before GEMM1, so waiting GEMM1 programs cannot starve them).

    Caller contract: the destination's metadata barrier has passed (every rank finished reading
    the previous call's x slab), and the caller joins this kernel's stream before the next barrier.
    """
    T, D = x_TD.shape
    K = topk_ids_TK.shape[1]
    fb = ws.flag_block
    nb = -(-ws.t_cap // fb)
    bt, bd = _blocks(D)
    grid = (max(1, min(max_programs, nb * ws.world)),)
    launch(_dispatch_rows_kernel, grid,
        x_TD, topk_ids_TK, peer_bases, epoch, T, rank, ws.offsets["x"], ws.offsets["xflag"],
        T_CAP=ws.t_cap, D=D, K=K, KP=next_pow2(K), E_LOCAL=experts_per_rank, R=ws.world,
        FB=fb, NB=nb, BT=min(bt, next_pow2(fb)), BD=bd, NPROG=grid[0], **_opts(),
    )


def combine_push(rows_ND: Tensor, layout: RoutingLayout, ws: WorkspaceLayout, peer_bases: int, rank: int) -> None:
    """Push each received slab row's pre-summed (fp32, k order) placed rows to its source's comb, as
    ``ws.dtypes["comb"]`` (bf16 by default: ``comm/workspace.py``).

    Args:
        rows_ND: (N_cap', D) bf16 rows in the receive layout's order (GEMM2 ``by_row`` output, or the
            GEMM1-dgrad dx rows).
        layout: the receive-side layout (P' = R * T_cap * K pairs).
    """
    D = rows_ND.shape[1]
    bt, bd = _blocks(D)
    comb_bf16 = ws.dtypes["comb"] == torch.bfloat16
    # K unrolled row loads in flight: at 4 warps, 512 columns spill registers, and 256 with fp32 rows
    # (sm_90a build, tests/test_ep_triton.py: bf16 16 x 256 184 registers, fp32 16 x 256 8 bytes of stack)
    bd = min(bd, 256 if comb_bf16 else 128)
    grid = (ws.world, cdiv(ws.t_cap, bt), cdiv(D, bd))
    launch(_combine_push_kernel, grid,
        rows_ND, layout.pair_row, peer_bases, rank, ws.offsets["comb"],
        T_CAP=ws.t_cap, D=D, K=ws.top_k, BT=bt, BD=bd, COMB_BF16=comb_bf16, **_opts(),
    )


def dscore_push(dscore_part_NB: Tensor, layout: RoutingLayout, ws: WorkspaceLayout, peer_bases: int) -> None:
    """Push the d score of every placed received slot to its source's dscore[t, k] (the NB partials of
    ``gemm2_dgrad_swiglu_bwd`` summed in ascending order)."""
    bt = 32 if not _interpreting() else 16
    grid = (ws.world, cdiv(ws.t_cap, bt))
    launch(_dscore_push_kernel, grid,
        dscore_part_NB, layout.pair_row, peer_bases, ws.offsets["dscore"],
        T_CAP=ws.t_cap, K=ws.top_k, KP=next_pow2(ws.top_k), NB=dscore_part_NB.shape[1], BT=bt,
        **_opts(),
    )


def combine_sum(comb_RTD: Tensor, topk_ids_TK: Tensor, experts_per_rank: int, out_dtype: torch.dtype) -> Tensor:
    """out[t] = sum over the ranks holding one of t's experts, in rank order, of comb[r, t] (in fp32).

    Args:
        comb_RTD: (R, T_cap, D) bf16 or fp32, this rank's comb region (after the barrier that follows
            ``combine_push`` on every rank).
        topk_ids_TK: (T, K) global expert ids of this rank's tokens.
        experts_per_rank: E_l.
        out_dtype: bf16 (layer output / dx) or fp32.

    Returns:
        (T, D) tensor of ``out_dtype``, newly allocated.
    """
    R, t_cap, D = comb_RTD.shape
    T, K = topk_ids_TK.shape
    out = torch.empty((T, D), dtype=out_dtype, device=comb_RTD.device)
    if T == 0:
        return out
    bt, bd = _blocks(D)
    grid = (cdiv(T, bt), cdiv(D, bd))
    launch(_combine_sum_kernel, grid,
        comb_RTD, topk_ids_TK, out, T, R=R, T_CAP=t_cap, D=D, K=K, KP=next_pow2(K),
        E_LOCAL=experts_per_rank, BT=bt, BD=bd, **_opts(),
    )
    return out
