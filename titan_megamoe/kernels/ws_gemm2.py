"""Warp-specialized bf16 GEMM2 forward for Hopper (sm_90a), in Gluon: y[pair] = score * (h[r] @ w2[e]^T).

Why: the Triton GEMM2 (``grouped_gemm._gemm2_scatter_fwd_kernel``, persistent, 128 x 256 x 64 tiles, 8 warps) is
the one bf16 forward GEMM still in Triton; it ran at ~581 TF/s at the 235B shape on an H100 (2.84 ms, docs/NOTES.md
session 27), where the Gluon GEMM1 forward ran ~625. Triton 3.6 does not warp-specialize Hopper kernels, so each
tile's first loads and its scatter epilogue stall the tensor cores; the blockwise-FP8 GEMM2 gained 19 % from the same
move (``ws_gemm_fp8.ws_gemm2_fwd_fp8``, session 23).

Design: the FP8 GEMM2's scheme with bf16 operands and no scales.

* producer: one warp issuing TMA for both operands (``ws_gemm_fp8._g1d8_producer`` with one K segment; it is
  dtype-agnostic): A = h rows (N_cap, F), contiguous in the routing layout; B = w2 viewed (E * D, F), K-major
  [BN, BK] tiles read through a permuted view, as the GEMM1 forward reads w1 / w3;
* two cooperative consumer warpgroups, each on 64 rows of every 128-row tile, its BN columns as two BN / 2 halves
  (two m64n(BN/2) wgmmas per k16 step in flight together); K order as the Triton kernel's, so the same bits;
* epilogue: each row times its fp32 routing score, rounded to bf16, stored from registers at its pair's row of y
  through a 16-byte-per-thread layout (``ws_gemm_fp8._scatter_rows``); padding rows not stored;
* persistent grid over the live tiles in the grouped order (``group_m`` 8, as the Triton kernel).

Opt-in (``grouped_gemm.WS_GEMM2``, switch ``TITAN_MEGAMOE_WS_GEMM2``) until measured on a GPU; token-major output only
(the expert-parallel path's ``by_row`` output keeps the Triton kernel).
"""

from __future__ import annotations

import torch
from torch import Tensor

from titan_megamoe.kernels.launch import launch
from titan_megamoe.kernels.ws_gemm import HAVE_GLUON, WsConfig, _check_operands, _desc, _platform_reason, _programs

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait

    from titan_megamoe.kernels.ws_gemm import _num_tiles, _tile_of
    from titan_megamoe.kernels.ws_gemm_fp8 import _g1d8_producer, _scatter_rows

__all__ = ["GEMM2_CONFIG", "sm90_compile_args_gemm2", "ws_gemm2_fwd", "ws_gemm2_fwd_supported"]

#: Config of the bf16 GEMM2: the Triton kernel's 128 x 256 x 64 tiles and group_m 8; 4 stages of 48 KB, no epilogue
#: tiles (rows are stored from registers; the layout conversion of a 64 x 128 half takes 16 KB of scratch).
GEMM2_CONFIG = WsConfig(block_n=256, stages=4, group_m=8, coop=True)


if HAVE_GLUON:

    @gluon.jit
    def _g2f_consumer(scores_ptr, out_ptr, row_pair_ptr, offsets_ptr, E, a_bufs, b_bufs, ready, empty,
                      C: gl.constexpr, D: gl.constexpr, F: gl.constexpr, NUM_N: gl.constexpr, GROUP_M: gl.constexpr,
                      STAGES: gl.constexpr):
        # cooperative: both consumers take every tile, C the rows [C * BM / 2, (C + 1) * BM / 2), its BN columns as
        # two BH halves whose MMAs are in flight together
        BM: gl.constexpr = a_bufs.type.shape[1]
        BK: gl.constexpr = a_bufs.type.shape[2]
        BN: gl.constexpr = b_bufs.type.shape[1]
        BMC: gl.constexpr = BM // 2
        BH: gl.constexpr = BN // 2
        KT: gl.constexpr = F // BK
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, BH, 16])
        row_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
        n_live, count = _num_tiles(offsets_ptr, E, BM, NUM_N)
        for j in range(count):
            pid_m, pid_n = _tile_of(j, n_live, NUM_N, GROUP_M)
            acc_lo = gl.zeros((BMC, BH), dtype=gl.float32, layout=mma_layout)
            acc_hi = gl.zeros((BMC, BH), dtype=gl.float32, layout=mma_layout)
            idx0 = j * KT
            for k in range(KT):
                idx = idx0 + k
                s = idx % STAGES
                mbarrier.wait(ready.index(s), (idx // STAGES) & 1)
                a = a_bufs.index(s).slice(C * BMC, BMC, dim=0)
                b = b_bufs.index(s)
                acc_lo = warpgroup_mma(a, b.slice(0, BH, dim=0).permute((1, 0)), acc_lo, is_async=True)
                acc_hi = warpgroup_mma(a, b.slice(BH, BH, dim=0).permute((1, 0)), acc_hi, is_async=True)
                acc_lo, acc_hi = warpgroup_mma_wait(num_outstanding=2, deps=(acc_lo, acc_hi))
                if k > 0:  # step k - 1's MMAs are done: its buffers may be refilled
                    mbarrier.arrive(empty.index((idx - 1) % STAGES), count=1)
            acc_lo, acc_hi = warpgroup_mma_wait(num_outstanding=0, deps=(acc_lo, acc_hi))
            mbarrier.arrive(empty.index((idx0 + KT - 1) % STAGES), count=1)
            # epilogue: y[pair] = bf16(score * acc), as the Triton kernel rounds it; padding rows (pair -1) not stored
            pair = gl.load(row_pair_ptr + pid_m * BM + C * BMC + gl.arange(0, BMC, layout=row_layout))
            srow = gl.expand_dims(gl.load(scores_ptr + pair, mask=pair >= 0, other=0.0), 1)
            _scatter_rows((acc_lo * srow).to(gl.bfloat16), pair, out_ptr, pid_n * BN, D)
            _scatter_rows((acc_hi * srow).to(gl.bfloat16), pair, out_ptr, pid_n * BN + BH, D)

    @gluon.jit
    def _gemm2_fwd_ws_kernel(a_desc, w2_desc, scores_ptr, out_ptr, row_pair_ptr, tile_expert_ptr, offsets_ptr, E,
                             D: gl.constexpr, F: gl.constexpr, NUM_N: gl.constexpr, GROUP_M: gl.constexpr,
                             STAGES: gl.constexpr, PRODUCER_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr):
        """y[pair] = score * (h[r] @ w2[e]^T) for every live row tile (``ws_gemm2_fwd``). Grid: (programs,)."""
        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
        b_bufs = gl.allocate_shared_memory(w2_desc.dtype, [STAGES] + w2_desc.block_type.shape, w2_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)  # both consumers read every buffer
        gl.warp_specialize([
            (_g2f_consumer, (scores_ptr, out_ptr, row_pair_ptr, offsets_ptr, E, a_bufs, b_bufs, ready, empty, 0, D, F,
                             NUM_N, GROUP_M, STAGES)),
            (_g2f_consumer, (scores_ptr, out_ptr, row_pair_ptr, offsets_ptr, E, a_bufs, b_bufs, ready, empty, 1, D, F,
                             NUM_N, GROUP_M, STAGES)),
            (_g1d8_producer, (a_desc, w2_desc, w2_desc, tile_expert_ptr, offsets_ptr, E, a_bufs, b_bufs, ready, empty,
                              D, F, NUM_N, GROUP_M, STAGES, 1)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


def ws_gemm2_fwd_supported(h_NF: Tensor, w2_EDF: Tensor, cfg: WsConfig = GEMM2_CONFIG) -> str | None:
    """None if the warp-specialized bf16 GEMM2 can take these operands, else why not."""
    reason = _platform_reason(h_NF)
    if reason:
        return reason
    E, D, F = w2_EDF.shape
    if F % cfg.block_k or D % cfg.block_n:
        return f"needs F % {cfg.block_k} == 0 and D % {cfg.block_n} == 0 (F={F}, D={D})"
    return None


def ws_gemm2_fwd(h_NF: Tensor, w2_EDF: Tensor, scores_TK: Tensor, layout, *, out: Tensor | None = None,
                 cfg: WsConfig = GEMM2_CONFIG, programs: int | None = None) -> Tensor:
    """GEMM2 (down projection) with the routing score and the scatter to token-major rows, by the Gluon kernel.

    Same contract and result as ``grouped_gemm.gemm2_scatter_fwd`` (``by_row=False``): for every layout row r with
    pair p = row_pair[r] >= 0 and e = tile_expert[r // BM], y[p] = bf16(scores.view(-1)[p] * (h[r] @ w2[e].T)),
    fp32 accumulation in the Triton kernel's K order (the same bits).

    Args:
        h_NF: (N_cap, F) bf16 contiguous, the GEMM1 output rows (padding rows may hold anything).
        w2_EDF: (E, D, F) bf16 contiguous.
        scores_TK: (T, top_k) fp32 contiguous routing scores; pair p = t * top_k + k.
        layout: the routing layout of these pairs (block_m 128).
        out: optional (T * top_k, D) bf16 output. programs: persistent grid size (default: the SM count).

    Returns:
        y (T * top_k, D) bf16: every pair placed in the layout written once; pairs without a row untouched.

    Raises:
        ValueError: an unsupported case (``ws_gemm2_fwd_supported``'s reason), a layout with another block_m or
            built for other pairs / experts, or an operand of another shape, dtype, layout or device.
    """
    fn = "ws_gemm2_fwd"
    _check_operands(fn, ("scores",), h=h_NF, w2=w2_EDF, scores=scores_TK, **({} if out is None else {"out": out}))
    reason = ws_gemm2_fwd_supported(h_NF, w2_EDF, cfg)
    if reason:
        raise ValueError(f"{fn}: {reason}")
    E, D, F = w2_EDF.shape
    P = scores_TK.numel()
    if layout.block_m != cfg.block_m:
        raise ValueError(f"{fn}: layout.block_m={layout.block_m} != cfg.block_m={cfg.block_m} (build the routing "
                         f"layout with block_m {cfg.block_m})")
    if (tuple(h_NF.shape) != (layout.n_cap, F) or scores_TK.dim() != 2 or scores_TK.shape[1] != layout.top_k
            or layout.pair_row.shape[0] != P or layout.num_experts != E):
        raise ValueError(f"{fn}: h {tuple(h_NF.shape)}, scores {tuple(scores_TK.shape)} and w2 {tuple(w2_EDF.shape)} "
                         f"do not match the layout ((N_cap, F) = ({layout.n_cap}, {F}), top_k {layout.top_k}, "
                         f"{layout.pair_row.shape[0]} pairs, {layout.num_experts} experts)")
    y = torch.empty((P, D), dtype=torch.bfloat16, device=h_NF.device) if out is None else out
    if tuple(y.shape) != (P, D):
        raise ValueError(f"{fn}: out must be ({P}, {D}), got {tuple(y.shape)}")
    if layout.n_tiles_cap == 0 or P == 0:
        return y
    return launch_gemm2_fwd(h_NF, w2_EDF, scores_TK, layout, y, cfg, programs)


def launch_gemm2_fwd(h_NF: Tensor, w2_EDF: Tensor, scores_TK: Tensor, layout, y: Tensor,
                     cfg: WsConfig = GEMM2_CONFIG, programs: int | None = None) -> Tensor:
    """``ws_gemm2_fwd`` without its checks, for a caller that has made them (``grouped_gemm._launch_gemm2``:
    operands, output, layout, and ``ws_gemm2_fwd_supported``); returns y."""
    E, D, F = w2_EDF.shape
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    a_desc = _desc(h_NF, (layout.n_cap, F), (bm, bk))
    w2_desc = _desc(w2_EDF, (E * D, F), (bn, bk))
    num_n = D // bn
    programs = _programs(h_NF.device, layout.n_tiles_cap * num_n, programs)
    launch(_gemm2_fwd_ws_kernel, (programs,),
           a_desc, w2_desc, scores_TK, y, layout.row_pair, layout.tile_expert, layout.offsets, E,
           D, F, num_n, cfg.group_m, cfg.stages, cfg.producer_regs, cfg.consumer_regs, num_warps=4,
           maxnreg=cfg.maxnreg)
    return y


def sm90_compile_args_gemm2(cfg: WsConfig, D: int, F: int) -> tuple[dict, dict]:
    """(signature, constexprs) of ``_gemm2_fwd_ws_kernel`` for ``sm90_check.compile_sm90`` (CPU build checks)."""
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k

    def desc(block):
        layout = gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16)
        return f"tensordesc<bf16[{block[0]}, {block[1]}],{layout!r}>"

    sig = {"a_desc": desc([bm, bk]), "w2_desc": desc([bn, bk]), "scores_ptr": "*fp32", "out_ptr": "*bf16",
           "row_pair_ptr": "*i32", "tile_expert_ptr": "*i32", "offsets_ptr": "*i32", "E": "i32"}
    cx = dict(D=D, F=F, NUM_N=D // bn, GROUP_M=cfg.group_m, STAGES=cfg.stages, PRODUCER_REGS=cfg.producer_regs,
              CONSUMER_REGS=cfg.consumer_regs)
    return sig, cx
