"""Warp-specialized K-grouped weight-gradient GEMMs for Hopper (sm_90a), in Gluon, with the token-row gather
in the producer: dw1 / dw3 and dw2 without a gathered copy of x or dout.

Why: the default sm_90 wgrads (``grouped_gemm_wgrad``, "grouped_mm") first copy the token-side operand into
the layout's row order (``gather_rows``: one read of T x D spread over the expert rows, one write and two
reads back of N_cap x D), then run ``torch._grouped_mm``. At the Qwen3-30B-A3B shape the two gathers take
0.41 ms of a ~5 ms backward and ~2 GB of HBM traffic under a power-capped clock (docs/NOTES.md, session 12).
Here the rows are gathered straight into shared memory by cp.async (TMA cannot gather rows on Hopper), as the
Gluon GEMM1 forward does (``ws_gemm``); the contiguous operand comes by TMA.

Both wgrads are one kernel: P[e] = A[rows of e]^T @ B[rows of e], a K-grouped GEMM whose reduction runs over
expert e's rows [offsets[e], offsets[e+1]) of the routing layout (the padded tail cut at BK granularity:
``WgradConfig.trim_k``), in row order (deterministic). A is always the gathered token side (M = D), B the
contiguous side by TMA:

* dw2 (``ws_wgrad_w2``): A = dout rows, B = s h (N_cap, F) stored by the GEMM2 dgrad; dw2[e] = P[e] (D x F);
* dw1 / dw3 (``ws_wgrad_w13``): A = x rows, B = dgate_up (N_cap, 2F); dw1[e] / dw3[e] = the two F-column halves
  of P[e] (D x 2F), transposed in the epilogue (stored through a permuted staging tile).

Why x is the gathered A and not dgate_up (v1 of this kernel, session 13): with x as the 256-wide gathered B,
the 4-warp producer issued 32 KB of cp.async per step against 16 KB by TMA, and dw1 / dw3 ran at 501 TF/s
against dw2's 564 (the same FLOPs per byte, the 16 KB gather on the other side).

Both operands sit in shared memory as [BK rows, width] row-major tiles: B is N-major as loaded, A is read
MN-major through a permuted view (wgmma takes either for bf16). Tiles of 128 x BN, cooperative (each consumer
warpgroup 64 rows of the tile, m64nBN wgmma), persistent grid over E x (D / 128) x (N / BN) tiles in expert
order (an expert's operands stay in L2 while its tiles run). Experts without rows get zeros (empty K loop).
Padding rows contribute nothing: the gathered side is zero-filled there and the TMA side holds zeros (the
kernels that write dgate_up and s h zero their padding rows).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from titan_megamoe.kernels.jit import env_flag
from titan_megamoe.kernels.launch import launch
from titan_megamoe.kernels.ws_gemm import HAVE_GLUON, _check_operands, _desc, _platform_reason, _programs

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        async_copy,
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

__all__ = ["SPLIT_CONFIG", "WGRAD_CONFIG", "WgradConfig", "ws_wgrad_supported", "ws_wgrad_w13", "ws_wgrad_w2",
           "wgrad_compile_args"]


@dataclass(frozen=True)
class WgradConfig:
    """Tile and pipeline of the warp-specialized wgrad.

    Attributes:
        block_n: BN output columns per tile (the tile is 128 x BN; each consumer holds 64 x BN fp32:
            BN 256 -> 128 registers per thread).
        block_k: BK token rows per reduction step (divides the routing layout's block_m, so a step never
            straddles two experts).
        stages: operand buffers in the ring (each (128 + BN) x BK bf16).
        maxnreg, producer_regs, consumer_regs: register cap and ``setmaxnreg`` split (12 warps: two consumer
            warpgroups and a 4-warp gather producer; 4 x 32 x 72 + 8 x 32 x 216 = 64512 of 65536).
        split_n: each consumer's 64 x BN accumulator as two BN / 2-column halves (two MMAs per step, on B tiles
            loaded as two halves), stored through one staging tile of half the size, so the epilogue takes half
            the shared memory and the ring a fourth stage (as ``ws_gemm.WsConfig.split_n``).
        trim_k: also on through ``WGRAD_TRIM_K`` (the default) or ``SKIP_PAD_BLOCKS``: end each expert's reduction
            at its last row rounded up to BK
            (``counts[e]``), not at its padded end ``offsets[e + 1]``: the layout pads experts to block_m = 128
            rows, so about half of them end in a BK = 64 step of padding rows only, zeros that add nothing
            (skipping them leaves the sums bitwise the same). ~2.9 % of the steps at 1,024 rows per expert.
    """

    block_n: int = 256
    block_k: int = 64
    stages: int = 3
    maxnreg: int = 168
    producer_regs: int = 72
    consumer_regs: int = 216
    split_n: bool = False
    trim_k: bool = False

    def smem_bytes(self) -> int:
        """Shared memory of the operand ring and the two consumers' epilogue tiles (bf16)."""
        return 2 * (self.stages * (128 + self.block_n) * self.block_k
                    + 128 * self.block_n // (2 if self.split_n else 1))


WGRAD_CONFIG = WgradConfig()
#: TITAN_MEGAMOE_SKIP_PAD_BLOCKS=1 (read at import): ``trim_k`` on in every launch (as ``ws_gemm.SKIP_PAD_BLOCKS``).
SKIP_PAD_BLOCKS = env_flag("TITAN_MEGAMOE_SKIP_PAD_BLOCKS", False)
#: TITAN_MEGAMOE_WGRAD_TRIM_K (read at import): ``trim_k`` alone, without the GEMM1 kernels' ``skip_empty`` (whose
#: forward lost 9-16 % at 235B in sessions 32-33's A/Bs while the trims gained 2-3 %). On by default since session 33
#: (one H100, bitwise: 235B layer 25.66 -> 25.46 ms fwd+bwd in one process); ``=0`` reduces over every padded row.
TRIM_K = env_flag("TITAN_MEGAMOE_WGRAD_TRIM_K", True)
#: The split-accumulator config (``split_n``, 4 stages): the default from model dim 4096 (faster at 235B, slower at
#: 30B on one H100; ``grouped_gemm_wgrad.WS_WGRAD_SPLIT``, "auto").
SPLIT_CONFIG = WgradConfig(stages=4, split_n=True)
_BM = 128  # tile rows (two consumers x 64)


if HAVE_GLUON:

    @gluon.jit
    def _wg_tile(j, MT: gl.constexpr, NT: gl.constexpr):
        """(expert, row tile, column block) of the program's j-th tile: grid-strided, expert-major."""
        t = gl.program_id(0) + j * gl.num_programs(0)
        e = t // (MT * NT)
        w = t % (MT * NT)
        return e, w // NT, w % NT

    @gluon.jit
    def _wg_count(E, MT: gl.constexpr, NT: gl.constexpr):
        pid = gl.program_id(0)
        nprog = gl.num_programs(0)
        return gl.maximum(E * MT * NT - pid + nprog - 1, 0) // nprog

    @gluon.jit
    def _k_rows(offsets_ptr, counts_ptr, e, BK: gl.constexpr, TRIM_K: gl.constexpr):
        """(first, end) of expert e's reduction rows: its padded rows, or (TRIM_K) up to its last row rounded up
        to BK (the layout's valid rows are a prefix of each expert's rows; the min keeps a clamped layout's end)."""
        start = gl.load(offsets_ptr + e)
        end = gl.load(offsets_ptr + e + 1)
        if TRIM_K:
            end = gl.minimum(end, start + (gl.load(counts_ptr + e) + BK - 1) // BK * BK)
        return start, end

    @gluon.jit
    def _gather_ptrs(src_ptr, row_pair_ptr, r0, col0, N_SRC: gl.constexpr, TOPK: gl.constexpr, BK: gl.constexpr,
                     W: gl.constexpr):
        """(pointers, mask) of columns [col0, col0 + W) of layout rows [r0, r0 + BK) of ``src`` (T, N_SRC) for a
        4-warp cp.async producer: row r holds src[row_pair[r] // TOPK], padding rows (pair -1) masked (zero-fill).
        16-byte chunks, W / 8 threads along a row."""
        TPC: gl.constexpr = W // 8
        gather: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TPC, TPC], [4, 1], [1, 0])
        pair = gl.load(row_pair_ptr + r0 + gl.arange(0, BK, layout=gl.SliceLayout(1, gather)))
        ok = pair >= 0
        tok = gl.where(ok, pair // TOPK, 0).to(gl.int64)  # int64: token * N_SRC overflows int32 for large T
        cols = col0 + gl.arange(0, W, layout=gl.SliceLayout(0, gather))
        ptrs = src_ptr + gl.expand_dims(tok * N_SRC, 1) + gl.expand_dims(cols, 0)
        return ptrs, gl.expand_dims(ok, 1) & gl.expand_dims(cols >= 0, 0)

    @gluon.jit
    def _wg_producer(a_ptr, b_desc, row_pair_ptr, offsets_ptr, counts_ptr, E, a0_bufs, a1_bufs, b_bufs, ready_t,
                     ready_c, empty, N_SRC: gl.constexpr, TOPK: gl.constexpr, MT: gl.constexpr, NT: gl.constexpr,
                     STAGES: gl.constexpr, SPLIT: gl.constexpr, TRIM_K: gl.constexpr):
        # SPLIT: B tiles as two column halves, b_bufs[2 s] and b_bufs[2 s + 1] (WgradConfig.split_n)
        BK: gl.constexpr = b_desc.block_type.shape[0]
        BH: gl.constexpr = b_desc.block_type.shape[1]
        NB: gl.constexpr = 2 if SPLIT else 1
        BN: gl.constexpr = NB * BH
        BMC: gl.constexpr = a0_bufs.type.shape[2]
        idx = 0
        for j in range(_wg_count(E, MT, NT)):
            e, m, n = _wg_tile(j, MT, NT)
            start, end = _k_rows(offsets_ptr, counts_ptr, e, BK, TRIM_K)
            m0 = m * 2 * BMC
            n0 = n * BN
            for r0 in range(start, end, BK):
                s = idx % STAGES
                mbarrier.wait(empty.index(s), ((idx // STAGES) & 1) ^ 1)  # first pass: free
                bar = ready_t.index(s)
                mbarrier.expect(bar, NB * b_desc.block_type.nbytes)
                for q in gl.static_range(NB):
                    tma.async_copy_global_to_shared(b_desc, [r0, n0 + q * BH], bar, b_bufs.index(NB * s + q))
                # token rows: two 64-column halves, one per consumer; padding rows zero-filled
                ptrs, mask = _gather_ptrs(a_ptr, row_pair_ptr, r0, m0, N_SRC, TOPK, BK, BMC)
                async_copy.async_copy_global_to_shared(a0_bufs.index(s), ptrs, mask=mask)
                async_copy.async_copy_global_to_shared(a1_bufs.index(s), ptrs + BMC, mask=mask)
                async_copy.mbarrier_arrive(ready_c.index(s), increment_count=False)  # one arrival per thread
                idx += 1

    @gluon.jit
    def _wg_store(acc, c_smem, out0_desc, out1_desc, e, row, col, TRANS_OUT: gl.constexpr, SPLIT: gl.constexpr):
        """One consumer's bf16 tile (64 x W) through its staging tile by TMA: dw2[e] rows, or (TRANS_OUT) transposed
        into dw1 / dw3 with the D x 2F product's columns split at SPLIT = F."""
        tma.store_wait(pendings=0)  # the previous store has read c_smem
        if TRANS_OUT:
            c_smem.permute((1, 0)).store(acc.to(gl.bfloat16))
            fence_async_shared()
            if col < SPLIT:
                tma.async_copy_shared_to_global(out0_desc, [e * SPLIT + col, row], c_smem)
            else:
                tma.async_copy_shared_to_global(out1_desc, [e * SPLIT + col - SPLIT, row], c_smem)
        else:
            c_smem.store(acc.to(gl.bfloat16))
            fence_async_shared()
            tma.async_copy_shared_to_global(out0_desc, [e * SPLIT + row, col], c_smem)

    @gluon.jit
    def _wg_consumer(out0_desc, out1_desc, offsets_ptr, counts_ptr, E, a_bufs, b_bufs, ready_t, ready_c, empty,
                     c_smem, C: gl.constexpr, TRANS_OUT: gl.constexpr, SPLIT: gl.constexpr, MT: gl.constexpr,
                     NT: gl.constexpr, STAGES: gl.constexpr, SPLIT_N: gl.constexpr, TRIM_K: gl.constexpr):
        # cooperative: both consumers take every tile, C its rows [C * 64, C * 64 + 64). SPLIT_N
        # (WgradConfig.split_n): the tile's columns as two BW halves, both MMAs of a step in flight, one staging
        # tile for the two stores; else one BW-column accumulator
        BK: gl.constexpr = b_bufs.type.shape[1]
        BW: gl.constexpr = b_bufs.type.shape[2]
        BMC: gl.constexpr = a_bufs.type.shape[2]
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, BW, 16])
        idx = 0
        for j in range(_wg_count(E, MT, NT)):
            e, m, n = _wg_tile(j, MT, NT)
            start, end = _k_rows(offsets_ptr, counts_ptr, e, BK, TRIM_K)
            if SPLIT_N:
                acc_lo = gl.zeros((BMC, BW), dtype=gl.float32, layout=mma_layout)
                acc_hi = gl.zeros((BMC, BW), dtype=gl.float32, layout=mma_layout)
            else:
                acc = gl.zeros((BMC, BW), dtype=gl.float32, layout=mma_layout)
            for r0 in range(start, end, BK):
                s = idx % STAGES
                ph = (idx // STAGES) & 1
                mbarrier.wait(ready_t.index(s), ph)
                mbarrier.wait(ready_c.index(s), ph)
                fence_async_shared()  # cp.async rows: generic proxy; wgmma reads through the async one
                a = a_bufs.index(s).permute((1, 0))
                if SPLIT_N:
                    acc_lo = warpgroup_mma(a, b_bufs.index(2 * s), acc_lo, is_async=True)
                    acc_hi = warpgroup_mma(a, b_bufs.index(2 * s + 1), acc_hi, is_async=True)
                    acc_lo, acc_hi = warpgroup_mma_wait(num_outstanding=2, deps=(acc_lo, acc_hi))
                else:
                    acc = warpgroup_mma(a, b_bufs.index(s), acc, is_async=True)
                    acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
                if r0 > start:  # the previous step's MMAs are done: its buffers may be refilled
                    mbarrier.arrive(empty.index((idx - 1) % STAGES), count=1)
                idx += 1
            if SPLIT_N:
                acc_lo, acc_hi = warpgroup_mma_wait(num_outstanding=0, deps=(acc_lo, acc_hi))
            else:
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            if end > start:
                mbarrier.arrive(empty.index((idx - 1) % STAGES), count=1)
            # epilogue: bf16 through this consumer's staging tile, TMA store (dw1 / dw3 (E, F, D) from the D x 2F
            # product: transposed, columns split at F; dw2 (E, D, F) as it is)
            row = m * 2 * BMC + C * BMC
            if SPLIT_N:
                col = n * 2 * BW
                _wg_store(acc_lo, c_smem, out0_desc, out1_desc, e, row, col, TRANS_OUT, SPLIT)
                _wg_store(acc_hi, c_smem, out0_desc, out1_desc, e, row, col + BW, TRANS_OUT, SPLIT)
            else:
                _wg_store(acc, c_smem, out0_desc, out1_desc, e, row, n * BW, TRANS_OUT, SPLIT)
        tma.store_wait(pendings=0)

    @gluon.jit
    def _wgrad_ws_kernel(a_ptr, b_desc, out0_desc, out1_desc, row_pair_ptr, offsets_ptr, counts_ptr, E,
                         TRANS_OUT: gl.constexpr, N_SRC: gl.constexpr, TOPK: gl.constexpr, SPLIT: gl.constexpr,
                         MT: gl.constexpr, NT: gl.constexpr, STAGES: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                         CONSUMER_REGS: gl.constexpr, SPLIT_N: gl.constexpr = False, TRIM_K: gl.constexpr = False):
        """P[e] = A[rows of e]^T @ B[rows of e] with A = token rows of ``a_ptr`` (T, N_SRC) gathered, B by TMA
        (module docstring); stored as dw2[e] = P[e] (TRANS_OUT False) or as dw1[e] / dw3[e] = P[e]^T split at
        column SPLIT = F (TRANS_OUT True). Grid: (programs,). SPLIT_N (``WgradConfig.split_n``): b_desc and the
        output descriptors have half the tile's columns."""
        dtype: gl.constexpr = b_desc.dtype
        BK: gl.constexpr = b_desc.block_type.shape[0]
        BW: gl.constexpr = b_desc.block_type.shape[1]
        NB: gl.constexpr = 2 if SPLIT_N else 1
        BMC: gl.constexpr = 64
        a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BK, BMC], gl.bfloat16)
        a0_bufs = gl.allocate_shared_memory(dtype, [STAGES, BK, BMC], a_layout)
        a1_bufs = gl.allocate_shared_memory(dtype, [STAGES, BK, BMC], a_layout)
        b_bufs = gl.allocate_shared_memory(dtype, [NB * STAGES, BK, BW], b_desc.layout)
        c0 = gl.allocate_shared_memory(dtype, out0_desc.block_type.shape, out0_desc.layout)
        c1 = gl.allocate_shared_memory(dtype, out0_desc.block_type.shape, out0_desc.layout)
        ready_t = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        ready_c = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready_t.index(i), count=1)
            mbarrier.init(ready_c.index(i), count=128)  # one cp.async arrival per producer thread (4 warps)
            mbarrier.init(empty.index(i), count=2)  # both consumers read every buffer
        gl.warp_specialize([
            (_wg_consumer, (out0_desc, out1_desc, offsets_ptr, counts_ptr, E, a0_bufs, b_bufs, ready_t, ready_c,
                            empty, c0, 0, TRANS_OUT, SPLIT, MT, NT, STAGES, SPLIT_N, TRIM_K)),
            (_wg_consumer, (out0_desc, out1_desc, offsets_ptr, counts_ptr, E, a1_bufs, b_bufs, ready_t, ready_c,
                            empty, c1, 1, TRANS_OUT, SPLIT, MT, NT, STAGES, SPLIT_N, TRIM_K)),
            (_wg_producer, (a_ptr, b_desc, row_pair_ptr, offsets_ptr, counts_ptr, E, a0_bufs, a1_bufs, b_bufs,
                            ready_t, ready_c, empty, N_SRC, TOPK, MT, NT, STAGES, SPLIT_N, TRIM_K)),
        ], [4, 4], [CONSUMER_REGS, PRODUCER_REGS])


def ws_wgrad_supported(D: int, F: int, layout, ref: Tensor, cfg: WgradConfig = WGRAD_CONFIG) -> str | None:
    """None if the warp-specialized wgrads can take the (D, F) shape, this layout and ``ref``'s device, else why
    not."""
    reason = _platform_reason(ref)
    if reason:
        return reason
    bn = cfg.block_n
    if D % _BM or F % bn:
        return f"needs D a multiple of {_BM} and F of block_n {bn} (D={D}, F={F})"
    if layout.block_m % cfg.block_k:
        return f"needs the routing layout's block_m ({layout.block_m}) a multiple of block_k {cfg.block_k}"
    return None


def _out(out: Tensor | None, shape, dev, name: str, fn: str) -> Tensor:
    if out is None:
        return torch.empty(shape, dtype=torch.bfloat16, device=dev)
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"{fn}: {name} must have shape {tuple(shape)}, got {tuple(out.shape)}")
    return out


def ws_wgrad_w13(dgate_up_N2F: Tensor, x_TD: Tensor, layout, *, out: tuple[Tensor, Tensor] | None = None,
                 cfg: WgradConfig = WGRAD_CONFIG, programs: int | None = None) -> tuple[Tensor, Tensor]:
    """dw1[e] = sum over expert e's rows r of dgate[r]^T x[t], dw3[e] likewise with dup, t = row_pair[r] // K.

    Same contract as ``grouped_gemm_wgrad.wgrad_w13`` (bf16 output, fp32 accumulation in row order), x rows
    gathered in the kernel's producer, the D x 2F product stored transposed.

    Args:
        dgate_up_N2F: (N_cap, 2F) bf16 contiguous, zeros on the layout's padding rows (as the GEMM2 dgrad
            writes it).
        x_TD: (T, D) bf16 contiguous layer input, T * K = the layout's pairs.
        layout: the routing layout (``routing.RoutingLayout``).
        out: optional (dw1, dw3) (E, F, D) bf16 contiguous buffers.
        programs: persistent grid size (default: the SM count).

    Returns:
        (dw1, dw3), each (E, F, D) bf16; experts without rows get zeros.

    Raises:
        ValueError: an operand of another dtype, strided or on another device; mismatched shapes; an
            unsupported case (``ws_wgrad_supported``'s reason).
    """
    fn = "ws_wgrad_w13"
    _check_operands(fn, dgate_up=dgate_up_N2F, x=x_TD, **({} if out is None else {"out[0]": out[0], "out[1]": out[1]}))
    T, D = x_TD.shape
    F = dgate_up_N2F.shape[1] // 2
    E, K, n_cap, dev = layout.num_experts, layout.top_k, layout.n_cap, x_TD.device
    if tuple(dgate_up_N2F.shape) != (n_cap, 2 * F) or layout.pair_row.shape[0] != T * K:
        raise ValueError(f"{fn}: dgate_up {tuple(dgate_up_N2F.shape)} / x {tuple(x_TD.shape)} do not match the "
                         f"layout (N_cap {n_cap}, {layout.pair_row.shape[0]} pairs, top_k {K})")
    reason = ws_wgrad_supported(D, F, layout, x_TD, cfg)
    if reason:
        raise ValueError(f"{fn}: {reason}")
    dw1 = _out(None if out is None else out[0], (E, F, D), dev, "out[0] (dw1)", fn)
    dw3 = _out(None if out is None else out[1], (E, F, D), dev, "out[1] (dw3)", fn)
    bn, bk = cfg.block_n, cfg.block_k
    bw = bn // 2 if cfg.split_n else bn  # split_n: B tiles and stores as column halves
    b_desc = _desc(dgate_up_N2F, (n_cap, 2 * F), (bk, bw))
    o1 = _desc(dw1, (E * F, D), (bw, _BM // 2))  # transposed stores: [BW rows of F, 64 columns of D]
    o3 = _desc(dw3, (E * F, D), (bw, _BM // 2))
    mt, nt = D // _BM, 2 * F // bn
    launch(_wgrad_ws_kernel, (_programs(dev, E * mt * nt, programs),),
           x_TD, b_desc, o1, o3, layout.row_pair, layout.offsets, layout.counts, E, True, D, K, F, mt, nt,
           cfg.stages, cfg.producer_regs, cfg.consumer_regs, cfg.split_n, cfg.trim_k or SKIP_PAD_BLOCKS or TRIM_K,
           num_warps=4, maxnreg=cfg.maxnreg)
    return dw1, dw3


def ws_wgrad_w2(dout_TD: Tensor, hs_NF: Tensor, layout, *, out: Tensor | None = None,
                cfg: WgradConfig = WGRAD_CONFIG, programs: int | None = None) -> Tensor:
    """dw2[e] = sum over expert e's rows r of dout[t]^T (s h)[r], t = row_pair[r] // K.

    Same contract as ``grouped_gemm_wgrad.wgrad_w2`` with ``hs_NF`` (bf16 output, fp32 accumulation in row
    order), dout rows gathered in the kernel's producer.

    Args:
        dout_TD: (T, D) bf16 contiguous gradient of the layer output.
        hs_NF: (N_cap, F) bf16 contiguous s * h rows from the GEMM2 dgrad (zeros on padding rows).
        layout: the routing layout.
        out: optional (E, D, F) bf16 contiguous buffer.
        programs: persistent grid size (default: the SM count).

    Returns:
        dw2 (E, D, F) bf16; experts without rows get zeros.

    Raises:
        ValueError: as ``ws_wgrad_w13``.
    """
    fn = "ws_wgrad_w2"
    _check_operands(fn, dout=dout_TD, hs=hs_NF, **({} if out is None else {"out": out}))
    T, D = dout_TD.shape
    F = hs_NF.shape[1]
    E, K, n_cap, dev = layout.num_experts, layout.top_k, layout.n_cap, dout_TD.device
    if hs_NF.shape[0] != n_cap or layout.pair_row.shape[0] != T * K:
        raise ValueError(f"{fn}: hs {tuple(hs_NF.shape)} / dout {tuple(dout_TD.shape)} do not match the layout "
                         f"(N_cap {n_cap}, {layout.pair_row.shape[0]} pairs, top_k {K})")
    reason = ws_wgrad_supported(D, F, layout, dout_TD, cfg)
    if reason:
        raise ValueError(f"{fn}: {reason}")
    dw2 = _out(out, (E, D, F), dev, "out (dw2)", fn)
    bn, bk = cfg.block_n, cfg.block_k
    bw = bn // 2 if cfg.split_n else bn
    b_desc = _desc(hs_NF, (n_cap, F), (bk, bw))
    o2 = _desc(dw2, (E * D, F), (_BM // 2, bw))
    mt, nt = D // _BM, F // bn
    launch(_wgrad_ws_kernel, (_programs(dev, E * mt * nt, programs),),
           dout_TD, b_desc, o2, o2, layout.row_pair, layout.offsets, layout.counts, E, False, D, K, D, mt, nt,
           cfg.stages, cfg.producer_regs, cfg.consumer_regs, cfg.split_n, cfg.trim_k or SKIP_PAD_BLOCKS or TRIM_K,
           num_warps=4, maxnreg=cfg.maxnreg)
    return dw2


def wgrad_compile_args(D: int, F: int, kind: str, cfg: WgradConfig = WGRAD_CONFIG, top_k: int = 8):
    """(signature, constexprs) of ``_wgrad_ws_kernel`` for ``sm90_check.compile_sm90``: ``kind`` "w13" (x gathered,
    dgate_up by TMA, transposed stores) or "w2" (dout gathered, s h by TMA)."""
    bn, bk = cfg.block_n, cfg.block_k
    bw = bn // 2 if cfg.split_n else bn

    def desc(block):
        layout = gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16)
        return f"tensordesc<bf16[{block[0]}, {block[1]}],{layout!r}>"

    if kind == "w13":
        out = desc([bw, _BM // 2])
        cx = dict(TRANS_OUT=True, N_SRC=D, TOPK=top_k, SPLIT=F, MT=D // _BM, NT=2 * F // bn)
    else:
        out = desc([_BM // 2, bw])
        cx = dict(TRANS_OUT=False, N_SRC=D, TOPK=top_k, SPLIT=D, MT=D // _BM, NT=F // bn)
    sig = {"a_ptr": "*bf16", "b_desc": desc([bk, bw]), "out0_desc": out, "out1_desc": out, "row_pair_ptr": "*i32",
           "offsets_ptr": "*i32", "counts_ptr": "*i32", "E": "i32"}
    cx.update(STAGES=cfg.stages, PRODUCER_REGS=cfg.producer_regs, CONSUMER_REGS=cfg.consumer_regs,
              SPLIT_N=cfg.split_n, TRIM_K=cfg.trim_k)
    return sig, cx
