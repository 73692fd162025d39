"""Warp-specialized blockwise-FP8 GEMM1 (row gather + gate / up + SwiGLU) and GEMM1 dgrad for Hopper, in Gluon.

Why: the Triton FP8 GEMM1 (``grouped_gemm_fp8._gemm1_swiglu_fwd_fp8_kernel``) runs at 584 TF/s at the 30B shape on
an H200 against 959 for ``torch._scaled_grouped_mm`` rowwise (``bench_fp8_1xh200_20261130.json``). Its per-K-block
scale (DeepSeek-V3's promotion: a fresh fp32 partial per 128-wide K block, scaled, then added) makes Triton wait
for every wgmma group before the next (``wgmma.wait_group 0`` each K step, both warpgroups in lockstep), so the
tensor cores idle while the partials are scaled. Triton 3.6 keeps that wait even when the loop is software
pipelined by hand (two partial sets: checked on the sm_90a build, docs/NOTES.md session 19).

Design (DeepGEMM's FP8 GEMMs, in our own words, on the bf16 Gluon GEMM1 of ``ws_gemm.py``):

* the same producer as the bf16 kernel (``ws_gemm._g1f_producer``): 4 warps gather the e4m3 x rows by cp.async
  (128 bytes a row, zero-filled padding rows), one TMA issue per weight tile, ring of ``STAGES`` buffers;
* two cooperative consumer warpgroups, each on 64 rows of every 128-row tile. Per K block of 128 a consumer
  issues the gate and the up wgmma into fresh fp32 partials (``use_acc=False``), waits for the gate one only
  (``num_outstanding=1``) and scales it into its accumulator while the up one still runs, then the up one.
  The two warpgroups wait on their own wgmma groups, so while one scales, the other's MMAs keep the tensor
  cores busy;
* scales: each consumer loads its 64 rows' x scales (gathered by token) and the tile's two weight scales
  (one 128 x 128 block each: BN divides 128) for step k before it waits for step k's operands;
* SwiGLU epilogue and TMA stores as the bf16 kernel (gate, up and h as bf16; padding rows zero by a multiply).

Math per row r (pair p = row_pair[r] >= 0, token t = p // K, expert e), identical to the Triton kernel's:
``acc += dot(xq[t, kb], wq[e, :, kb]) * (x_scale[t, kb] * w_scale[e, n // 128, kb])`` over the K blocks kb,
then gate_up[r] = [acc_gate | acc_up], h[r] = silu(gate) * up. The result matches the Triton kernel to fp32
rounding (same partials; whether the compiler contracts the scale-add into an FMA may differ).

Preconditions (``ws_gemm1_fwd_fp8_supported``): sm_90 GPU, Triton 3.6 with Gluon, D % 128 == 0, F % 128 == 0,
routing layout block 128, contiguous operands. h leaves as bf16: the 1x128 quantization of h for GEMM2 is a
separate pass (a 64-column tile does not own a whole 128-column group).

Status (session 19): both kernels bitwise the Triton kernels' outputs on an H100 and an H200 (GPU tests in
tests/test_ws_gemm_fp8.py). GEMM1 750 vs 586 TF/s at 30B (H100), GEMM1 dgrad 856 vs 663 TF/s at 30B and 914 vs 689 at
235B (H200); both on by default (``ops/fp8_backend.WS_GEMM1_FP8``, ``WS_GEMM1_DGRAD_FP8``; docs/NOTES.md, session 19).

The GEMM1 dgrad (``ws_gemm1_dgrad_fp8``) uses the same consumer scheme on contiguous operands: one TMA producer warp
(dgate_up rows and the transposed e4m3 weights, K-major), each consumer's 128 columns as two 64-column halves whose
MMAs are in flight together.

The GEMM2 (``ws_gemm2_fwd_fp8``, session 23) is that dgrad kernel with one K segment (h x w2: w2 (E, D, F) is already
K-major, like w1 / w3 transposed) and a scatter epilogue: each row times its routing score, rounded to bf16, stored from
registers at its pair's row of y. Bitwise the Triton kernel's y on an H100; 30B 0.706 -> 0.582 ms, 235B 2.456 -> 1.983
(``bench_ws_gemm2_fp8_1xh100_s23i_20261206.json``); on by default (``ops/fp8_backend.WS_GEMM2_FP8``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from titan_megamoe.kernels.jit import env_flag
from titan_megamoe.kernels.launch import launch
from titan_megamoe.kernels.ws_gemm import HAVE_GLUON, _desc, _platform_reason, _programs

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    from titan_megamoe.kernels.gl_quant_bwd import _amax_bits, _e4m3, _scale_rcp
    from titan_megamoe.kernels.ws_gemm import (_g1f_producer, _num_tiles, _staged_store, _store_halves, _swiglu_store,
                                               _tile_of)

__all__ = ["DGRAD_FP8_CONFIG", "DGRAD_FP8_WIDE_CONFIG", "FP8_FWD_CONFIG", "FP8_FWD_WIDE_CONFIG", "Fp8WsConfig",
           "GEMM2_FP8_CONFIG", "GEMM2_FP8_WIDE_CONFIG", "sm90_compile_args_dgrad_fp8",
           "sm90_compile_args_fp8", "sm90_compile_args_gemm2_fp8", "ws_gemm1_dgrad_fp8", "ws_gemm1_dgrad_fp8_supported",
           "ws_gemm1_fwd_fp8", "ws_gemm1_fwd_fp8_supported", "ws_gemm2_fwd_fp8", "ws_gemm2_fwd_fp8_supported"]

FP8 = torch.float8_e4m3fn


@dataclass(frozen=True)
class Fp8WsConfig:
    """Tile and pipeline of the FP8 GEMM1 (cooperative consumers; ``ws_gemm.WsConfig`` for the register budget).

    Attributes:
        block_m: BM rows per tile (= the routing layout's block_m); each consumer holds BM / 2 of them.
        block_n: BN columns of gate and BN of up per tile (divides 128: one weight scale block per tile).
            Each consumer holds four (BM / 2) x BN fp32 tiles (two accumulators, two partials): 128 registers per
            thread at BN = 64.
        stages: operand buffers in the ring: BM x 128 e4m3 rows + two BN x 128 weight tiles each (32 KiB at BN 64).
        group_m: row tiles per L2 group of the tile order.
        maxnreg, producer_regs, consumer_regs: the launch's register cap and ``setmaxnreg`` split.
        ordered: the two consumers issue each K step's MMAs in turn (consumer 0, then 1; :func:`_turn_wait`), so one
            scales its partials while the other's MMAs run; None: :data:`ORDERED_MMA` decides at launch.
        pingpong: the Gluon FP8 GEMM2 dgrad only (``ws_gemm2_dgrad_fp8``): each consumer takes whole BM x BN units in
            turn, main loops serialized, so one consumer's epilogue runs under the other's main loop; False there:
            both consumers on every tile (one BN-column chunk each). The other kernels ignore it.
        wide: two BN-column chunks of gate and of up per tile in the FP8 GEMM1 forward, so the gathered x rows of a
            stage feed twice the MMAs (the weight tiles are 2 BN rows); 2 BN output columns per tile (four BN / 2
            chunks) in the FP8 GEMM1 dgrad and GEMM2 forward. The GEMM2 dgrad ignores it.
    """

    block_m: int = 128
    block_n: int = 64
    stages: int = 5
    group_m: int = 1
    maxnreg: int = 168
    producer_regs: int = 72
    consumer_regs: int = 216
    block_k: int = 128  # = the scale block; not a tunable
    ordered: bool | None = None
    pingpong: bool = False
    wide: bool = False

    def smem_bytes(self) -> int:
        """Shared memory of the FP8 GEMM1 forward's operand ring and its two bf16 epilogue tiles."""
        ring = self.stages * (self.block_m + (4 if self.wide else 2) * self.block_n) * self.block_k
        return ring + 2 * (self.block_m // 2) * self.block_n * 2


#: Default config (sm_90a build, both Qwen3 shapes: see tests/test_ws_gemm_fp8.py for registers and shared memory).
FP8_FWD_CONFIG = Fp8WsConfig()

#: The FP8 GEMM1 forward on 128 x (2 x 128) tiles (session 36, opt-in, not yet measured): each stage's 128 gathered x
#: rows (16 KiB) feed 128 gate and 128 up columns (two 128-row weight tiles, 32 KiB), so a stage carries 48 KiB per
#: 128 x 256 outputs against 32 KiB per 128 x 128: a quarter fewer L2 -> SM bytes per FLOP, which is what session 36
#: found bounding the gathered-row main loops (~5-7 TB/s). Per consumer four 64 x 64 accumulators and two partials:
#: at 232 consumer registers (48 for the gathering producer) consumer 0's K loop has no spill and consumer 1's 10
#: spill instructions; at 216 / 72, 34 in each K loop (session 37's SASS).
FP8_FWD_WIDE_CONFIG = Fp8WsConfig(stages=4, wide=True, consumer_regs=232, producer_regs=48)

#: ``TITAN_MEGAMOE_FP8_ORDERED_MMA`` (default off): the ordered consumers (``Fp8WsConfig.ordered``) in the FP8 GEMM1,
#: GEMM1 dgrad and GEMM2 launched with a config whose ``ordered`` is None. Read at import; a same-process switch.
ORDERED_MMA = env_flag("TITAN_MEGAMOE_FP8_ORDERED_MMA", False)


def _ordered(cfg) -> bool:
    """The ``ordered`` constexpr of a launch with ``cfg``: its own choice, or :data:`ORDERED_MMA` where None."""
    return ORDERED_MMA if cfg.ordered is None else bool(cfg.ordered)


if HAVE_GLUON:

    # ---------------------------------------------------------------------------------------------
    # Ordered consumers. Why: both cooperative consumers wait for the same stage and issue their MMAs together, so
    # both scale their partials (DeepSeek-V3's per-128 promotion) at the same time and the tensor cores idle
    # meanwhile. With the issue order fixed to consumer 0, consumer 1, consumer 0, ... the MMAs of one run while the
    # other scales. Two mbarriers (count 1): consumer C waits on turns[C] before it issues step idx and arrives on
    # turns[1 - C] right after; consumer 0 goes first (the parity of a fresh barrier's previous phase passes at
    # once). A consumer is at most one phase ahead of the other's waits, so parities never alias. The results do not
    # change: the same partials, added in the same order. Measured on an H100 (session 26): mixed, -4 % to +4 % per
    # kernel, and slower in the FP8 wgrad (removed there); off by default.
    # ---------------------------------------------------------------------------------------------

    @gluon.jit
    def _turns_init(turns):
        """Initialise the two turn barriers ([2, 1] int64 in shared memory) of the ordered consumers."""
        mbarrier.init(turns.index(0), count=1)
        mbarrier.init(turns.index(1), count=1)

    @gluon.jit
    def _turn_wait(turns, C: gl.constexpr, idx, ORDERED: gl.constexpr):
        """Consumer C waits for its turn to issue the MMAs of its idx-th K step (nothing unless ORDERED)."""
        if ORDERED:
            mbarrier.wait(turns.index(C), (idx & 1) ^ (1 - C))

    @gluon.jit
    def _turn_pass(turns, C: gl.constexpr, ORDERED: gl.constexpr):
        """Consumer C has issued its MMAs: the other consumer's turn (nothing unless ORDERED)."""
        if ORDERED:
            mbarrier.arrive(turns.index(1 - C), count=1)


    @gluon.jit
    def _g1f8_wide_epilogue_q(g0, u0, g1, u1, gu_desc, h_desc, c_smem, row0, col0, F: gl.constexpr, hs_ptr,
                              count_ptr):
        """The wide tile's epilogue with h quantized 1x128 (``QUANT_H``): its two BN-column chunks are one 128-column
        group of h. gate and up as bf16 through the staging tile (as ``_swiglu_store``), h rounded to bf16 (the bits
        ``_swiglu_store`` writes), the group's amax over both chunks, e4m3 values (``_e4m3``: the quotient of
        ``fp8_quant.quantize_act_1x128``) by TMA through the staging tile reinterpreted as two e4m3 chunk tiles, the
        scales to hs[row, col0 / 128], non-finite scales counted into count_ptr."""
        BMC: gl.constexpr = h_desc.block_type.shape[0]
        BN: gl.constexpr = h_desc.block_type.shape[1]
        _staged_store(g0, gu_desc, c_smem, row0, col0)
        h0 = (g0 / (1.0 + gl.exp(-g0)) * u0).to(gl.bfloat16)
        _staged_store(u0, gu_desc, c_smem, row0, F + col0)
        _staged_store(g1, gu_desc, c_smem, row0, col0 + BN)
        h1 = (g1 / (1.0 + gl.exp(-g1)) * u1).to(gl.bfloat16)
        _staged_store(u1, gu_desc, c_smem, row0, F + col0 + BN)
        scale, rcp = _scale_rcp(gl.maximum(_amax_bits(h0, 1), _amax_bits(h1, 1)), 1e-12)  # AMAX_EPS of fp8_quant
        ns, rc = gl.expand_dims(-scale, 1), gl.expand_dims(rcp, 1)
        q0 = _e4m3(h0.to(gl.float32), ns, rc)
        q1 = _e4m3(h1.to(gl.float32), ns, rc)
        rows = row0 + gl.arange(0, BMC, layout=scale.type.layout)
        gl.store(hs_ptr + rows.to(gl.int64) * (F // (2 * BN)) + col0 // (2 * BN), scale)
        n_bad = gl.sum((~(scale < float("inf"))).to(gl.int32), axis=0)  # NaN < inf is False
        if n_bad > 0:
            gl.atomic_add(count_ptr, n_bad)
        tma.store_wait(pendings=0)
        q_smem = c_smem._reinterpret(gl.float8e4nv, [2, BMC, BN], h_desc.layout)  # the same 8 KiB
        q_smem.index(0).store(q0)
        q_smem.index(1).store(q1)
        fence_async_shared()
        tma.async_copy_shared_to_global(h_desc, [row0, col0], q_smem.index(0))
        tma.async_copy_shared_to_global(h_desc, [row0, col0 + BN], q_smem.index(1))

    @gluon.jit
    def _g1f8_wide_tiles(gu_desc, h_desc, xs_ptr, w1s_ptr, w3s_ptr, row_pair_ptr, tile_expert_ptr, n_live, count,
                         a_bufs, b1_bufs, b3_bufs, ready_a, ready_b, empty, c_smem, C: gl.constexpr, D: gl.constexpr,
                         F: gl.constexpr, TOPK: gl.constexpr, NUM_N: gl.constexpr, GROUP_M: gl.constexpr,
                         STAGES: gl.constexpr, turns, ORDERED: gl.constexpr, hs_ptr, count_ptr,
                         QUANT_H: gl.constexpr):
        """The wide tiles of consumer C (``Fp8WsConfig.wide``): rows [C BM / 2, (C + 1) BM / 2) of each tile, two
        BN-column chunks of gate and up. Per K step: both gate chunks' MMAs, each partial scaled under the next MMA (the
        up chunks' MMAs issued as the gate partials are consumed), so an MMA is in flight at every promotion but the last.
        Each accumulator sums the same partials in the same order as the BN-wide kernel's: the same bits."""
        BMC: gl.constexpr = h_desc.block_type.shape[0]
        BN: gl.constexpr = h_desc.block_type.shape[1]
        BM: gl.constexpr = a_bufs.type.shape[1]
        BK: gl.constexpr = a_bufs.type.shape[2]
        KT: gl.constexpr = D // BK
        NB: gl.constexpr = F // BK
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, BN, 32])
        row_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
        for j in range(count):
            pid_m, pid_n = _tile_of(j, n_live, NUM_N, GROUP_M)
            row0 = pid_m * BM + C * BMC
            col0 = pid_n * 2 * BN
            pair = gl.load(row_pair_ptr + row0 + gl.arange(0, BMC, layout=row_layout))
            ok = pair >= 0
            xs_row = xs_ptr + gl.where(ok, pair // TOPK, 0).to(gl.int64) * KT
            e = gl.load(tile_expert_ptr + pid_m)
            ws_off = (e * NB + col0 // BK) * KT  # both chunks lie in one 128-column weight scale block
            acc_g0 = gl.zeros((BMC, BN), dtype=gl.float32, layout=mma_layout)
            acc_g1 = gl.zeros((BMC, BN), dtype=gl.float32, layout=mma_layout)
            acc_u0 = gl.zeros((BMC, BN), dtype=gl.float32, layout=mma_layout)
            acc_u1 = gl.zeros((BMC, BN), dtype=gl.float32, layout=mma_layout)
            p0 = gl.zeros((BMC, BN), dtype=gl.float32, layout=mma_layout)
            p1 = gl.zeros((BMC, BN), dtype=gl.float32, layout=mma_layout)
            idx0 = j * KT
            for k in range(KT):
                idx = idx0 + k
                s = idx % STAGES
                ph = (idx // STAGES) & 1
                a_s = gl.load(xs_row + k, mask=ok, other=0.0)
                sg = gl.expand_dims(a_s * gl.load(w1s_ptr + ws_off + k), 1)
                su = gl.expand_dims(a_s * gl.load(w3s_ptr + ws_off + k), 1)
                mbarrier.wait(ready_a.index(s), ph)
                mbarrier.wait(ready_b.index(s), ph)
                fence_async_shared()  # the rows came by cp.async (generic proxy); wgmma reads via the async one
                a = a_bufs.index(s).slice(C * BMC, BMC, dim=0)
                b1 = b1_bufs.index(s)
                b3 = b3_bufs.index(s)
                _turn_wait(turns, C, idx, ORDERED)
                p0 = warpgroup_mma(a, b1.slice(0, BN, dim=0).permute((1, 0)), p0, use_acc=False, is_async=True)
                p1 = warpgroup_mma(a, b1.slice(BN, BN, dim=0).permute((1, 0)), p1, use_acc=False, is_async=True)
                p0 = warpgroup_mma_wait(num_outstanding=1, deps=(p0,))
                acc_g0 += p0 * sg  # under the second gate chunk's MMA
                p0 = warpgroup_mma(a, b3.slice(0, BN, dim=0).permute((1, 0)), p0, use_acc=False, is_async=True)
                p1 = warpgroup_mma_wait(num_outstanding=1, deps=(p1,))
                acc_g1 += p1 * sg  # under the first up chunk's MMA
                p1 = warpgroup_mma(a, b3.slice(BN, BN, dim=0).permute((1, 0)), p1, use_acc=False, is_async=True)
                _turn_pass(turns, C, ORDERED)
                p0 = warpgroup_mma_wait(num_outstanding=1, deps=(p0,))
                acc_u0 += p0 * su  # under the second up chunk's MMA
                p1 = warpgroup_mma_wait(num_outstanding=0, deps=(p1,))
                mbarrier.arrive(empty.index(s), count=1)  # the step's four MMAs done: its buffers may be refilled
                acc_u1 += p1 * su
            vf = gl.expand_dims(ok.to(gl.float32), 1)
            if QUANT_H:
                _g1f8_wide_epilogue_q(acc_g0 * vf, acc_u0 * vf, acc_g1 * vf, acc_u1 * vf, gu_desc, h_desc, c_smem,
                                      row0, col0, F, hs_ptr, count_ptr)
            else:
                _swiglu_store(acc_g0 * vf, acc_u0 * vf, gu_desc, h_desc, c_smem, row0, col0, F)
                _swiglu_store(acc_g1 * vf, acc_u1 * vf, gu_desc, h_desc, c_smem, row0, col0 + BN, F)

    @gluon.jit
    def _g1f8_consumer(gu_desc, h_desc, xs_ptr, w1s_ptr, w3s_ptr, row_pair_ptr, tile_expert_ptr, offsets_ptr, E,
                       a_bufs, b1_bufs, b3_bufs, ready_a, ready_b, empty, c_smem, C: gl.constexpr, D: gl.constexpr,
                       F: gl.constexpr, TOPK: gl.constexpr, NUM_N: gl.constexpr, GROUP_M: gl.constexpr,
                       STAGES: gl.constexpr, turns, ORDERED: gl.constexpr, WIDE: gl.constexpr, hs_ptr, count_ptr,
                       QUANT_H: gl.constexpr):
        # cooperative: both consumers take every tile, C the rows [C * BM / 2, (C + 1) * BM / 2); WIDE: the tile has
        # two BN-column chunks of gate and up (the weight tiles are 2 BN rows), each computed as its own tile would be
        BMC: gl.constexpr = h_desc.block_type.shape[0]
        BN: gl.constexpr = h_desc.block_type.shape[1]
        BM: gl.constexpr = a_bufs.type.shape[1]
        BK: gl.constexpr = a_bufs.type.shape[2]
        KT: gl.constexpr = D // BK  # K blocks = x scale columns
        NB: gl.constexpr = F // BK  # weight scale blocks along F
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, BN, 32])
        row_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
        n_live, count = _num_tiles(offsets_ptr, E, BM, NUM_N)
        if WIDE:
            _g1f8_wide_tiles(gu_desc, h_desc, xs_ptr, w1s_ptr, w3s_ptr, row_pair_ptr, tile_expert_ptr, n_live, count,
                             a_bufs, b1_bufs, b3_bufs, ready_a, ready_b, empty, c_smem, C, D, F, TOPK, NUM_N, GROUP_M,
                             STAGES, turns, ORDERED, hs_ptr, count_ptr, QUANT_H)
        else:
            for j in range(count):
                pid_m, pid_n = _tile_of(j, n_live, NUM_N, GROUP_M)
                row0 = pid_m * BM + C * BMC
                col0 = pid_n * BN
                pair = gl.load(row_pair_ptr + row0 + gl.arange(0, BMC, layout=row_layout))
                ok = pair >= 0
                # x scale row of each gathered token; padding rows read none (their partials are 0 x 0)
                xs_row = xs_ptr + gl.where(ok, pair // TOPK, 0).to(gl.int64) * KT
                e = gl.load(tile_expert_ptr + pid_m)
                ws_off = (e * NB + col0 // BK) * KT
                acc_g = gl.zeros((BMC, BN), dtype=gl.float32, layout=mma_layout)
                acc_u = gl.zeros((BMC, BN), dtype=gl.float32, layout=mma_layout)
                p_g = gl.zeros((BMC, BN), dtype=gl.float32, layout=mma_layout)
                p_u = gl.zeros((BMC, BN), dtype=gl.float32, layout=mma_layout)
                idx0 = j * KT
                for k in range(KT):
                    idx = idx0 + k
                    s = idx % STAGES
                    ph = (idx // STAGES) & 1
                    a_s = gl.load(xs_row + k, mask=ok, other=0.0)
                    s1 = gl.load(w1s_ptr + ws_off + k)
                    s3 = gl.load(w3s_ptr + ws_off + k)
                    mbarrier.wait(ready_a.index(s), ph)
                    mbarrier.wait(ready_b.index(s), ph)
                    fence_async_shared()  # the rows came by cp.async (generic proxy); wgmma reads via the async one
                    a = a_bufs.index(s).slice(C * BMC, BMC, dim=0)
                    _turn_wait(turns, C, idx, ORDERED)
                    p_g = warpgroup_mma(a, b1_bufs.index(s).permute((1, 0)), p_g, use_acc=False, is_async=True)
                    p_u = warpgroup_mma(a, b3_bufs.index(s).permute((1, 0)), p_u, use_acc=False, is_async=True)
                    _turn_pass(turns, C, ORDERED)
                    p_g = warpgroup_mma_wait(num_outstanding=1, deps=(p_g,))
                    acc_g += p_g * gl.expand_dims(a_s * s1, 1)  # scaled under the up MMA
                    p_u = warpgroup_mma_wait(num_outstanding=0, deps=(p_u,))
                    mbarrier.arrive(empty.index(s), count=1)  # both MMAs of step k done: its buffers may be refilled
                    acc_u += p_u * gl.expand_dims(a_s * s3, 1)
                # epilogue: zeros on padding rows (a multiply: a select makes ptxas serialize the wgmmas), SwiGLU in
                # fp32 as the Triton kernel writes it, then gate, up, h through one staging tile
                vf = gl.expand_dims(ok.to(gl.float32), 1)
                _swiglu_store(acc_g * vf, acc_u * vf, gu_desc, h_desc, c_smem, row0, col0, F)
        tma.store_wait(pendings=0)

    @gluon.jit
    def _gemm1_fwd_fp8_ws_kernel(x_ptr, xs_ptr, w1_desc, w3_desc, w1s_ptr, w3s_ptr, gu_desc, h_desc, row_pair_ptr,
                                 tile_expert_ptr, offsets_ptr, E, D: gl.constexpr, F: gl.constexpr,
                                 TOPK: gl.constexpr, NUM_N: gl.constexpr, GROUP_M: gl.constexpr,
                                 STAGES: gl.constexpr, BM: gl.constexpr, BK: gl.constexpr,
                                 PRODUCER_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                                 ORDERED: gl.constexpr = False, WIDE: gl.constexpr = False,
                                 hs_ptr=None, count_ptr=None, QUANT_H: gl.constexpr = False):
        """Blockwise-FP8 gate_up / h of every live row tile (module docstring). Grid: (programs,). ORDERED: the
        consumers issue their MMAs in turn (``_turn_wait``). WIDE: two BN-column chunks per tile (``Fp8WsConfig.wide``;
        the weight descriptors' tiles are 2 BN rows, NUM_N = F / (2 BN)). QUANT_H (WIDE only: a tile's 2 BN = 128 h
        columns are one 1x128 group): h_desc is e4m3 and h is quantized in the epilogue (scales to hs_ptr, non-finite
        groups counted into count_ptr; ``_g1f8_wide_epilogue_q``)."""
        gl.static_assert(WIDE or not QUANT_H, "QUANT_H needs the wide tiles (a 128-column h group per tile)")
        a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, BK], gl.float8e4nv)
        a_bufs = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BM, BK], a_layout)
        b1_bufs = gl.allocate_shared_memory(w1_desc.dtype, [STAGES] + w1_desc.block_type.shape, w1_desc.layout)
        b3_bufs = gl.allocate_shared_memory(w3_desc.dtype, [STAGES] + w3_desc.block_type.shape, w3_desc.layout)
        c0 = gl.allocate_shared_memory(gu_desc.dtype, gu_desc.block_type.shape, gu_desc.layout)
        c1 = gl.allocate_shared_memory(gu_desc.dtype, gu_desc.block_type.shape, gu_desc.layout)
        ready_a = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        ready_b = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready_a.index(i), count=128)  # one cp.async arrival per producer thread (4 warps)
            mbarrier.init(ready_b.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)  # both consumers read every buffer
        turns = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        _turns_init(turns)
        gl.warp_specialize([
            (_g1f8_consumer, (gu_desc, h_desc, xs_ptr, w1s_ptr, w3s_ptr, row_pair_ptr, tile_expert_ptr, offsets_ptr,
                              E, a_bufs, b1_bufs, b3_bufs, ready_a, ready_b, empty, c0, 0, D, F, TOPK, NUM_N, GROUP_M,
                              STAGES, turns, ORDERED, WIDE, hs_ptr, count_ptr, QUANT_H)),
            (_g1f8_consumer, (gu_desc, h_desc, xs_ptr, w1s_ptr, w3s_ptr, row_pair_ptr, tile_expert_ptr, offsets_ptr,
                              E, a_bufs, b1_bufs, b3_bufs, ready_a, ready_b, empty, c1, 1, D, F, TOPK, NUM_N, GROUP_M,
                              STAGES, turns, ORDERED, WIDE, hs_ptr, count_ptr, QUANT_H)),
            (_g1f_producer, (x_ptr, w1_desc, w3_desc, row_pair_ptr, tile_expert_ptr, offsets_ptr, E, a_bufs, b1_bufs,
                             b3_bufs, ready_a, ready_b, empty, D, F, TOPK, NUM_N, GROUP_M, STAGES)),
        ], [4, 4], [CONSUMER_REGS, PRODUCER_REGS])


if HAVE_GLUON:

    # ---------------------------------------------------------------------------------------------
    # GEMM1 dgrad: dx_rows[r] = dgate[r] @ w1[e] + dup[r] @ w3[e], e4m3 operands, both by TMA
    # ---------------------------------------------------------------------------------------------

    @gluon.jit
    def _g1d8_producer(a_desc, w1t_desc, w3t_desc, tile_expert_ptr, offsets_ptr, E, a_bufs, b_bufs, ready, empty,
                       D: gl.constexpr, F: gl.constexpr, NUM_N: gl.constexpr, GROUP_M: gl.constexpr,
                       STAGES: gl.constexpr, HALVES: gl.constexpr = 2):
        # one warp: the A row tile (dgate_up, or h for GEMM2: HALVES = 1) and the K-major weight tile (w1 / w3
        # transposed, or w2) of every K step, by TMA
        BM: gl.constexpr = a_desc.block_type.shape[0]
        BK: gl.constexpr = a_desc.block_type.shape[1]
        BN: gl.constexpr = w1t_desc.block_type.shape[0]
        KH: gl.constexpr = F // BK  # K steps per half (dgate x w1, then dup x w3)
        nbytes: gl.constexpr = a_desc.block_type.nbytes + w1t_desc.block_type.nbytes
        n_live, count = _num_tiles(offsets_ptr, E, BM, NUM_N)
        idx = 0
        for j in range(count):
            pid_m, pid_n = _tile_of(j, n_live, NUM_N, GROUP_M)
            e = gl.load(tile_expert_ptr + pid_m)
            for half in gl.static_range(HALVES):
                for k in range(KH):
                    s = idx % STAGES
                    mbarrier.wait(empty.index(s), ((idx // STAGES) & 1) ^ 1)  # first pass: free
                    bar = ready.index(s)
                    mbarrier.expect(bar, nbytes)
                    tma.async_copy_global_to_shared(a_desc, [pid_m * BM, half * F + k * BK], bar, a_bufs.index(s))
                    if half == 0:
                        tma.async_copy_global_to_shared(w1t_desc, [e * D + pid_n * BN, k * BK], bar, b_bufs.index(s))
                    else:
                        tma.async_copy_global_to_shared(w3t_desc, [e * D + pid_n * BN, k * BK], bar, b_bufs.index(s))
                    idx += 1

    @gluon.jit
    def _g1d8_wide_scales(as_row, ok, w1ts_ptr, w3ts_ptr, ws_off, kk, KH: gl.constexpr, HALVES: gl.constexpr):
        """(A rows' 1x128 scales, weight scale of chunks 0-1, of chunks 2-3) of K step kk of a wide tile. HALVES 2:
        dgate x w1 steps, then dup x w3 steps, through one selected weight-scale pointer (two masked loads per block,
        or two unrolled loops, spill accumulators in the K loop)."""
        a_s = gl.load(as_row + kk, mask=ok, other=0.0)
        if HALVES == 2:
            lo = kk < KH
            ws_ptr = gl.where(lo, w1ts_ptr, w3ts_ptr) + ws_off + gl.where(lo, kk, kk - KH)
        else:
            ws_ptr = w1ts_ptr + ws_off + kk
        return a_s, gl.load(ws_ptr), gl.load(ws_ptr + KH)

    @gluon.jit
    def _g1d8_wide_tiles(dx_desc, as_ptr, w1ts_ptr, w3ts_ptr, row_pair_ptr, tile_expert_ptr, n_live, count, a_bufs,
                         b_bufs, ready, empty, c_smem, C: gl.constexpr, D: gl.constexpr, F: gl.constexpr,
                         NUM_N: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr, HALVES: gl.constexpr,
                         scores_ptr, out_ptr, SCATTER: gl.constexpr, turns, ORDERED: gl.constexpr):
        """The wide tiles of consumer C (``Fp8WsConfig.wide``, GEMM1 dgrad and GEMM2): rows [C BM / 2, (C + 1) BM / 2)
        of each tile, 4 BH columns (two 128-column weight scale blocks) as four BH-column chunks. Per K step the MMAs of
        chunks 0 and 1, then each partial scaled under the next MMA (chunks 2 and 3 issued as 0 and 1 are consumed),
        as ``_g1f8_wide_tiles``. Each chunk sums the same partials in the same order as the 128-column kernel's."""
        BMC: gl.constexpr = dx_desc.block_type.shape[0]
        BH: gl.constexpr = dx_desc.block_type.shape[1]
        BM: gl.constexpr = a_bufs.type.shape[1]
        BK: gl.constexpr = a_bufs.type.shape[2]
        KH: gl.constexpr = F // BK
        NBW: gl.constexpr = D // BK
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, BH, 32])
        row_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
        for j in range(count):
            pid_m, pid_n = _tile_of(j, n_live, NUM_N, GROUP_M)
            row0 = pid_m * BM + C * BMC
            col0 = pid_n * 4 * BH
            rows = row0 + gl.arange(0, BMC, layout=row_layout)
            pair = gl.load(row_pair_ptr + rows)
            ok = pair >= 0
            as_row = as_ptr + rows.to(gl.int64) * (HALVES * KH)
            e = gl.load(tile_expert_ptr + pid_m)
            ws_off = (e * NBW + col0 // BK) * KH  # chunks 0, 1; chunks 2, 3 lie in the next block (+ KH)
            acc0 = gl.zeros((BMC, BH), dtype=gl.float32, layout=mma_layout)
            acc1 = gl.zeros((BMC, BH), dtype=gl.float32, layout=mma_layout)
            acc2 = gl.zeros((BMC, BH), dtype=gl.float32, layout=mma_layout)
            acc3 = gl.zeros((BMC, BH), dtype=gl.float32, layout=mma_layout)
            p0 = gl.zeros((BMC, BH), dtype=gl.float32, layout=mma_layout)
            p1 = gl.zeros((BMC, BH), dtype=gl.float32, layout=mma_layout)
            idx0 = j * HALVES * KH
            # one loop over both halves of K (dgate x w1, then dup x w3): two unrolled loops spill in the main loop
            for kk in range(HALVES * KH):
                idx = idx0 + kk
                s = idx % STAGES
                a_s, wa, wb = _g1d8_wide_scales(as_row, ok, w1ts_ptr, w3ts_ptr, ws_off, kk, KH, HALVES)
                sa = gl.expand_dims(a_s * wa, 1)
                sb = gl.expand_dims(a_s * wb, 1)
                mbarrier.wait(ready.index(s), (idx // STAGES) & 1)
                a = a_bufs.index(s).slice(C * BMC, BMC, dim=0)
                b = b_bufs.index(s)
                _turn_wait(turns, C, idx, ORDERED)
                p0 = warpgroup_mma(a, b.slice(0, BH, dim=0).permute((1, 0)), p0, use_acc=False, is_async=True)
                p1 = warpgroup_mma(a, b.slice(BH, BH, dim=0).permute((1, 0)), p1, use_acc=False, is_async=True)
                p0 = warpgroup_mma_wait(num_outstanding=1, deps=(p0,))
                acc0 += p0 * sa  # under chunk 1's MMA
                p0 = warpgroup_mma(a, b.slice(2 * BH, BH, dim=0).permute((1, 0)), p0, use_acc=False, is_async=True)
                p1 = warpgroup_mma_wait(num_outstanding=1, deps=(p1,))
                acc1 += p1 * sa  # under chunk 2's
                p1 = warpgroup_mma(a, b.slice(3 * BH, BH, dim=0).permute((1, 0)), p1, use_acc=False, is_async=True)
                _turn_pass(turns, C, ORDERED)
                p0 = warpgroup_mma_wait(num_outstanding=1, deps=(p0,))
                acc2 += p0 * sb  # under chunk 3's
                p1 = warpgroup_mma_wait(num_outstanding=0, deps=(p1,))
                mbarrier.arrive(empty.index(s), count=1)  # the step's four MMAs done: its buffers may be refilled
                acc3 += p1 * sb
            if SCATTER:
                srow = gl.expand_dims(gl.load(scores_ptr + pair, mask=ok, other=0.0), 1)
                _scatter_rows((acc0 * srow).to(gl.bfloat16), pair, out_ptr, col0, D)
                _scatter_rows((acc1 * srow).to(gl.bfloat16), pair, out_ptr, col0 + BH, D)
                _scatter_rows((acc2 * srow).to(gl.bfloat16), pair, out_ptr, col0 + 2 * BH, D)
                _scatter_rows((acc3 * srow).to(gl.bfloat16), pair, out_ptr, col0 + 3 * BH, D)
            else:
                vf = gl.expand_dims(ok.to(gl.float32), 1)
                _store_halves(acc0 * vf, acc1 * vf, dx_desc, c_smem, row0, col0)
                _store_halves(acc2 * vf, acc3 * vf, dx_desc, c_smem, row0, col0 + 2 * BH)

    @gluon.jit
    def _g1d8_consumer(dx_desc, as_ptr, w1ts_ptr, w3ts_ptr, row_pair_ptr, tile_expert_ptr, offsets_ptr, E, a_bufs,
                       b_bufs, ready, empty, c_smem, C: gl.constexpr, D: gl.constexpr, F: gl.constexpr,
                       NUM_N: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr, HALVES: gl.constexpr = 2,
                       scores_ptr=None, out_ptr=None, SCATTER: gl.constexpr = False, turns=None,
                       ORDERED: gl.constexpr = False, WIDE: gl.constexpr = False):
        # cooperative: both consumers take every tile, C the rows [C * BM / 2, (C + 1) * BM / 2); the tile's BN
        # columns as two BN / 2 halves, both MMAs of a K step in flight, the first scaled under the second.
        # SCATTER (GEMM2, HALVES = 1): rows scaled by their routing score and stored at their pair's row of out.
        # WIDE: 2 BN columns per tile as four BN / 2 chunks (``_g1d8_wide_tiles``)
        BMC: gl.constexpr = dx_desc.block_type.shape[0]
        BH: gl.constexpr = dx_desc.block_type.shape[1]
        BM: gl.constexpr = a_bufs.type.shape[1]
        BK: gl.constexpr = a_bufs.type.shape[2]
        KH: gl.constexpr = F // BK
        NBW: gl.constexpr = D // BK  # weight scale blocks along D
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, BH, 32])
        row_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
        n_live, count = _num_tiles(offsets_ptr, E, BM, NUM_N)
        if WIDE:
            _g1d8_wide_tiles(dx_desc, as_ptr, w1ts_ptr, w3ts_ptr, row_pair_ptr, tile_expert_ptr, n_live, count,
                             a_bufs, b_bufs, ready, empty, c_smem, C, D, F, NUM_N, GROUP_M, STAGES, HALVES,
                             scores_ptr, out_ptr, SCATTER, turns, ORDERED)
        else:
            for j in range(count):
                pid_m, pid_n = _tile_of(j, n_live, NUM_N, GROUP_M)
                row0 = pid_m * BM + C * BMC
                col0 = pid_n * 2 * BH
                rows = row0 + gl.arange(0, BMC, layout=row_layout)
                pair = gl.load(row_pair_ptr + rows)
                ok = pair >= 0
                as_row = as_ptr + rows.to(gl.int64) * (HALVES * KH)  # A's 1x128 scales of each row
                e = gl.load(tile_expert_ptr + pid_m)
                ws_off = (e * NBW + col0 // BK) * KH
                acc_lo = gl.zeros((BMC, BH), dtype=gl.float32, layout=mma_layout)
                acc_hi = gl.zeros((BMC, BH), dtype=gl.float32, layout=mma_layout)
                p_lo = gl.zeros((BMC, BH), dtype=gl.float32, layout=mma_layout)
                p_hi = gl.zeros((BMC, BH), dtype=gl.float32, layout=mma_layout)
                idx0 = j * HALVES * KH
                for half in gl.static_range(HALVES):
                    ws_ptr = w1ts_ptr if half == 0 else w3ts_ptr
                    for k in range(KH):
                        idx = idx0 + half * KH + k
                        s = idx % STAGES
                        sc = gl.load(as_row + half * KH + k, mask=ok, other=0.0) * gl.load(ws_ptr + ws_off + k)
                        mbarrier.wait(ready.index(s), (idx // STAGES) & 1)
                        a = a_bufs.index(s).slice(C * BMC, BMC, dim=0)
                        b = b_bufs.index(s)
                        _turn_wait(turns, C, idx, ORDERED)
                        p_lo = warpgroup_mma(a, b.slice(0, BH, dim=0).permute((1, 0)), p_lo, use_acc=False,
                                             is_async=True)
                        p_hi = warpgroup_mma(a, b.slice(BH, BH, dim=0).permute((1, 0)), p_hi, use_acc=False,
                                             is_async=True)
                        _turn_pass(turns, C, ORDERED)
                        p_lo = warpgroup_mma_wait(num_outstanding=1, deps=(p_lo,))
                        acc_lo += p_lo * gl.expand_dims(sc, 1)  # scaled under the other half's MMA
                        p_hi = warpgroup_mma_wait(num_outstanding=0, deps=(p_hi,))
                        mbarrier.arrive(empty.index(s), count=1)
                        acc_hi += p_hi * gl.expand_dims(sc, 1)
                if SCATTER:  # y[pair] = score * acc (bf16), padding rows not stored
                    srow = gl.expand_dims(gl.load(scores_ptr + pair, mask=ok, other=0.0), 1)
                    _scatter_rows((acc_lo * srow).to(gl.bfloat16), pair, out_ptr, col0, D)
                    _scatter_rows((acc_hi * srow).to(gl.bfloat16), pair, out_ptr, col0 + BH, D)
                else:
                    # epilogue: zeros on padding rows (a multiply, not a select: see ws_gemm.py), bf16, TMA
                    # store per half
                    vf = gl.expand_dims(ok.to(gl.float32), 1)
                    _store_halves(acc_lo * vf, acc_hi * vf, dx_desc, c_smem, row0, col0)
        if not SCATTER:
            tma.store_wait(pendings=0)

    @gluon.jit
    def _scatter_rows(y, pair, out_ptr, col0, D: gl.constexpr):
        """Rows of the (BMC, BH) bf16 tile y to out[pair, col0 : col0 + BH] (pair < 0: not stored), through a
        layout of 16-byte row pieces (the MMA layout holds 4-byte pieces)."""
        BH: gl.constexpr = y.type.shape[1]
        L: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (BH // 8), BH // 8], [4, 1], [1, 0])
        yb = gl.convert_layout(y, L)
        pr = gl.convert_layout(pair, gl.SliceLayout(1, L))
        cols = col0 + gl.arange(0, BH, layout=gl.SliceLayout(0, L))
        gl.store(out_ptr + gl.expand_dims(pr.to(gl.int64), 1) * D + gl.expand_dims(cols, 0), yb,
                 mask=gl.expand_dims(pr >= 0, 1))

    @gluon.jit
    def _gemm1_dgrad_fp8_ws_kernel(a_desc, w1t_desc, w3t_desc, dx_desc, as_ptr, w1ts_ptr, w3ts_ptr, row_pair_ptr,
                                   tile_expert_ptr, offsets_ptr, E, D: gl.constexpr, F: gl.constexpr,
                                   NUM_N: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                                   PRODUCER_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                                   ORDERED: gl.constexpr = False, WIDE: gl.constexpr = False):
        """Blockwise-FP8 dx_rows of every live row tile (``ws_gemm1_dgrad_fp8``). Grid: (programs,). ORDERED: the
        consumers issue their MMAs in turn (``_turn_wait``). WIDE: the weight tiles are 2 BN rows, four BN / 2 column
        chunks per tile (``Fp8WsConfig.wide``; NUM_N = D / (2 BN))."""
        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
        b_bufs = gl.allocate_shared_memory(w1t_desc.dtype, [STAGES] + w1t_desc.block_type.shape, w1t_desc.layout)
        c0 = gl.allocate_shared_memory(dx_desc.dtype, dx_desc.block_type.shape, dx_desc.layout)
        c1 = gl.allocate_shared_memory(dx_desc.dtype, dx_desc.block_type.shape, dx_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)  # both consumers read every buffer
        turns = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        _turns_init(turns)
        gl.warp_specialize([
            (_g1d8_consumer, (dx_desc, as_ptr, w1ts_ptr, w3ts_ptr, row_pair_ptr, tile_expert_ptr, offsets_ptr, E,
                              a_bufs, b_bufs, ready, empty, c0, 0, D, F, NUM_N, GROUP_M, STAGES, 2, None, None, False,
                              turns, ORDERED, WIDE)),
            (_g1d8_consumer, (dx_desc, as_ptr, w1ts_ptr, w3ts_ptr, row_pair_ptr, tile_expert_ptr, offsets_ptr, E,
                              a_bufs, b_bufs, ready, empty, c1, 1, D, F, NUM_N, GROUP_M, STAGES, 2, None, None, False,
                              turns, ORDERED, WIDE)),
            (_g1d8_producer, (a_desc, w1t_desc, w3t_desc, tile_expert_ptr, offsets_ptr, E, a_bufs, b_bufs, ready,
                              empty, D, F, NUM_N, GROUP_M, STAGES)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


    # ---------------------------------------------------------------------------------------------
    # GEMM2: y[pair] = score * (h[r] @ w2[e]^T), e4m3 operands by TMA, rows scattered to pair order
    # ---------------------------------------------------------------------------------------------

    @gluon.jit
    def _gemm2_fwd_fp8_ws_kernel(a_desc, w2_desc, y_desc, as_ptr, w2s_ptr, scores_ptr, out_ptr, row_pair_ptr,
                                 tile_expert_ptr, offsets_ptr, E, D: gl.constexpr, F: gl.constexpr,
                                 NUM_N: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                                 PRODUCER_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                                 ORDERED: gl.constexpr = False, WIDE: gl.constexpr = False):
        """Blockwise-FP8 GEMM2 of every live row tile (``ws_gemm2_fwd_fp8``): the GEMM1 dgrad's producer and consumers
        with one K segment (h x w2) and a scatter epilogue. ``y_desc`` only gives the consumers' tile shape.
        Grid: (programs,). ORDERED: the consumers issue their MMAs in turn (``_turn_wait``). WIDE: as the dgrad's."""
        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
        b_bufs = gl.allocate_shared_memory(w2_desc.dtype, [STAGES] + w2_desc.block_type.shape, w2_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)  # both consumers read every buffer
        turns = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        _turns_init(turns)
        gl.warp_specialize([
            (_g1d8_consumer, (y_desc, as_ptr, w2s_ptr, w2s_ptr, row_pair_ptr, tile_expert_ptr, offsets_ptr, E, a_bufs,
                              b_bufs, ready, empty, a_bufs, 0, D, F, NUM_N, GROUP_M, STAGES, 1, scores_ptr, out_ptr,
                              True, turns, ORDERED, WIDE)),
            (_g1d8_consumer, (y_desc, as_ptr, w2s_ptr, w2s_ptr, row_pair_ptr, tile_expert_ptr, offsets_ptr, E, a_bufs,
                              b_bufs, ready, empty, a_bufs, 1, D, F, NUM_N, GROUP_M, STAGES, 1, scores_ptr, out_ptr,
                              True, turns, ORDERED, WIDE)),
            (_g1d8_producer, (a_desc, w2_desc, w2_desc, tile_expert_ptr, offsets_ptr, E, a_bufs, b_bufs, ready, empty,
                              D, F, NUM_N, GROUP_M, STAGES, 1)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


def ws_gemm1_fwd_fp8_supported(x_fp8: Tensor, w1_fp8: Tensor, cfg: Fp8WsConfig = FP8_FWD_CONFIG) -> str | None:
    """None if the warp-specialized FP8 GEMM1 can take these operands, else why not."""
    reason = _platform_reason(x_fp8)
    if reason:
        return reason
    E, F, D = w1_fp8.shape
    if F % cfg.block_k or D % cfg.block_k or cfg.block_k % (2 * cfg.block_n if cfg.wide else cfg.block_n):
        return (f"needs F % {cfg.block_k} == 0, D % {cfg.block_k} == 0 and block_n dividing {cfg.block_k} "
                f"(F={F}, D={D}, block_n={cfg.block_n})")
    return None


def _check(name: str, t: Tensor, shape: tuple[int, ...], dtype: torch.dtype, dev: torch.device,
           fn: str = "ws_gemm1_fwd_fp8") -> None:
    if tuple(t.shape) != shape or t.dtype != dtype or not t.is_contiguous() or t.device != dev:
        raise ValueError(f"{fn}: {name} must be a contiguous {dtype} tensor of shape {shape} on {dev}; got "
                         f"{t.dtype} {tuple(t.shape)} {'contiguous' if t.is_contiguous() else 'strided'} on {t.device}")


def ws_gemm1_fwd_fp8(x_fp8: Tensor, x_scale: Tensor, w1_fp8: Tensor, w1_scale: Tensor, w3_fp8: Tensor,
                     w3_scale: Tensor, layout, *, gate_up_out: Tensor | None = None, h_out: Tensor | None = None,
                     cfg: Fp8WsConfig = FP8_FWD_CONFIG, programs: int | None = None,
                     quantize_h: bool = False, nonfinite_count: Tensor | None = None) -> tuple[Tensor, ...]:
    """Blockwise-FP8 GEMM1 (gate and up) with the row gather and SwiGLU, by the warp-specialized Gluon kernel.

    Same contract as ``grouped_gemm_fp8.gemm1_swiglu_fwd_fp8`` with bf16 outputs and ``quantize_h=False``: for each
    padded row r with pair p = row_pair[r] >= 0, t = p // K, e = tile_expert[r // BM], with the dequantized
    operands, gate_up[r] = [xq[t] @ w1q[e].T | xq[t] @ w3q[e].T] and h[r] = silu(gate) * up (fp32, then bf16); each
    128-wide K block a separate fp32 partial, scaled, accumulated in fp32 (DeepSeek-V3's recipe). Padding rows of
    live tiles are zeros; tiles past offsets[E] are not written.

    Args:
        x_fp8: (T, D) float8_e4m3fn token rows; x_scale: (T, D // 128) fp32, one per token per 128 channels.
        w1_fp8, w3_fp8: (E, F, D) float8_e4m3fn; w1_scale, w3_scale: (E, F // 128, D // 128) fp32, one per
            128 x 128 block.
        layout: the routing layout of these T, K, E (block_m 128).
        gate_up_out, h_out: optional (N_cap, 2F) / (N_cap, F) bf16 contiguous outputs (h_out e4m3 with
            ``quantize_h``).
        programs: persistent grid size (default: the SM count).
        quantize_h: h quantized 1x128 in the epilogue instead of written as bf16 (one pass over h fewer before the
            GEMM2): the bits of ``fp8_quant.quantize_act_1x128(h, row_valid=layout.row_pair)`` on the rows of live
            tiles (padding rows: values 0, scale 1e-12 / 448; rows past the live tiles unwritten). Needs the wide
            tiles (``cfg.wide`` with 2 block_n = 128: a tile holds whole 128-column groups of h).
        nonfinite_count: with ``quantize_h``, a (1,) int32 counter that gets += the number of non-finite h groups
            (``quantize_act_1x128``'s ``nonfinite_count``); a new zero counter if None.

    Returns:
        (gate_up (N_cap, 2F) bf16, h (N_cap, F) bf16), or with ``quantize_h`` (gate_up, h (N_cap, F) e4m3,
        h_scale (N_cap, F // 128) fp32).

    Raises:
        ValueError: an unsupported case (``ws_gemm1_fwd_fp8_supported``'s reason: no sm_90 GPU, dims not multiples
            of 128), a layout with another block_m, or an operand of another shape, dtype, layout or device.
    """
    reason = ws_gemm1_fwd_fp8_supported(x_fp8, w1_fp8, cfg)
    if reason:
        raise ValueError(f"ws_gemm1_fwd_fp8: {reason}")
    E, F, D = w1_fp8.shape
    T, dev, bk = x_fp8.shape[0], x_fp8.device, cfg.block_k
    _check("x_fp8", x_fp8, (T, D), FP8, dev)
    _check("x_scale", x_scale, (T, D // bk), torch.float32, dev)
    for name, w, s in (("w1", w1_fp8, w1_scale), ("w3", w3_fp8, w3_scale)):
        _check(f"{name}_fp8", w, (E, F, D), FP8, dev)
        _check(f"{name}_scale", s, (E, F // bk, D // bk), torch.float32, dev)
    if layout.block_m != cfg.block_m:
        raise ValueError(f"ws_gemm1_fwd_fp8: layout.block_m={layout.block_m} != cfg.block_m={cfg.block_m} (build "
                         f"the routing layout with block_m {cfg.block_m})")
    if quantize_h and not (cfg.wide and 2 * cfg.block_n == bk):
        raise ValueError(f"ws_gemm1_fwd_fp8: quantize_h needs the wide tiles with 2 * block_n == {bk} (one 1x128 group "
                         f"of h per tile), got wide={cfg.wide}, block_n={cfg.block_n}; pass cfg=FP8_FWD_WIDE_CONFIG")
    n_cap = layout.n_cap
    h_dtype = FP8 if quantize_h else torch.bfloat16
    gu = torch.empty((n_cap, 2 * F), dtype=torch.bfloat16, device=dev) if gate_up_out is None else gate_up_out
    h = torch.empty((n_cap, F), dtype=h_dtype, device=dev) if h_out is None else h_out
    _check("gate_up_out", gu, (n_cap, 2 * F), torch.bfloat16, dev)
    _check("h_out", h, (n_cap, F), h_dtype, dev)
    hs = count = None
    if quantize_h:
        hs = torch.empty((n_cap, F // bk), dtype=torch.float32, device=dev)
        count = torch.zeros(1, dtype=torch.int32, device=dev) if nonfinite_count is None else nonfinite_count
        _check("nonfinite_count", count, (1,), torch.int32, dev)
    if layout.n_tiles_cap:
        launch_gemm1_fwd_fp8(x_fp8, x_scale, w1_fp8, w1_scale, w3_fp8, w3_scale, layout, gu, h, cfg, programs, hs,
                             count)
    return (gu, h, hs) if quantize_h else (gu, h)


def launch_gemm1_fwd_fp8(x_fp8: Tensor, x_scale: Tensor, w1_fp8: Tensor, w1_scale: Tensor, w3_fp8: Tensor,
                         w3_scale: Tensor, layout, gu: Tensor, h: Tensor, cfg: Fp8WsConfig = FP8_FWD_CONFIG,
                         programs: int | None = None, h_scale: Tensor | None = None,
                         nonfinite_count: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``ws_gemm1_fwd_fp8`` without its checks, for a caller that has made them; returns (gu, h). With ``h_scale``
    ((N_cap, F // 128) fp32) and ``nonfinite_count`` ((1,) int32), h is (N_cap, F) e4m3 and quantized 1x128 in the
    epilogue (``ws_gemm1_fwd_fp8``'s ``quantize_h``)."""
    E, F, D = w1_fp8.shape
    n_cap, dev = layout.n_cap, x_fp8.device
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    wn = 2 * bn if cfg.wide else bn  # weight tile rows (= output columns of gate, and of up, per tile)
    w1_desc = _desc(w1_fp8, (E * F, D), (wn, bk))
    w3_desc = _desc(w3_fp8, (E * F, D), (wn, bk))
    gu_desc = _desc(gu, (n_cap, 2 * F), (bm // 2, bn))
    h_desc = _desc(h, (n_cap, F), (bm // 2, bn))
    num_n = F // wn
    programs = _programs(dev, layout.n_tiles_cap * num_n, programs)
    quant_h = h_scale is not None
    launch(_gemm1_fwd_fp8_ws_kernel, (programs,),
           x_fp8, x_scale, w1_desc, w3_desc, w1_scale, w3_scale, gu_desc, h_desc, layout.row_pair, layout.tile_expert,
           layout.offsets, E, D, F, layout.top_k, num_n, cfg.group_m, cfg.stages, bm, bk, cfg.producer_regs,
           cfg.consumer_regs, _ordered(cfg), cfg.wide, h_scale, nonfinite_count, quant_h, num_warps=4,
           maxnreg=cfg.maxnreg)
    return gu, h


def _sig_desc(block, fp8: bool = True) -> str:
    """The compile signature string of an e4m3 (or bf16) TMA descriptor argument with tiles ``block``
    (``sm90_compile_args_*``)."""
    dtype, name = (gl.float8e4nv, "fp8e4nv") if fp8 else (gl.bfloat16, "bf16")
    layout = gl.NVMMASharedLayout.get_default_for(block, dtype)
    return f"tensordesc<{name}[{block[0]}, {block[1]}],{layout!r}>"


def sm90_compile_args_fp8(cfg: Fp8WsConfig, D: int, F: int, top_k: int = 8,
                          quant_h: bool = False) -> tuple[dict, dict]:
    """(signature, constexprs) of ``_gemm1_fwd_fp8_ws_kernel`` for ``sm90_check.compile_sm90`` (CPU build checks);
    ``quant_h``: h quantized in the epilogue."""
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    wn = 2 * bn if cfg.wide else bn

    sig = {"x_ptr": "*fp8e4nv", "xs_ptr": "*fp32", "w1_desc": _sig_desc([wn, bk]), "w3_desc": _sig_desc([wn, bk]),
           "w1s_ptr": "*fp32", "w3s_ptr": "*fp32", "gu_desc": _sig_desc([bm // 2, bn], fp8=False),
           "h_desc": _sig_desc([bm // 2, bn], fp8=quant_h),
           "row_pair_ptr": "*i32", "tile_expert_ptr": "*i32", "offsets_ptr": "*i32", "E": "i32"}
    cx = dict(D=D, F=F, TOPK=top_k, NUM_N=F // wn, GROUP_M=cfg.group_m, STAGES=cfg.stages, BM=bm, BK=bk,
              PRODUCER_REGS=cfg.producer_regs, CONSUMER_REGS=cfg.consumer_regs, ORDERED=_ordered(cfg), WIDE=cfg.wide,
              QUANT_H=quant_h)
    if quant_h:
        sig.update(hs_ptr="*fp32", count_ptr="*i32")
    else:
        cx.update(hs_ptr=None, count_ptr=None)
    return sig, cx


#: Config of the FP8 GEMM1 dgrad: 128 x 128 tiles (each consumer two 64 x 64 halves), one TMA producer warp.
DGRAD_FP8_CONFIG = Fp8WsConfig(block_n=128, stages=5, group_m=8, producer_regs=40, consumer_regs=232)

#: The FP8 GEMM1 dgrad on 128 x 256 tiles (session 37, opt-in, not yet measured): the forward's wide-tile argument
#: (``FP8_FWD_WIDE_CONFIG``) for the dgrad: a stage's 128 dgate_up rows (16 KiB) feed 256 dx columns (a 256-row weight
#: tile, 32 KiB), 48 KiB per 128 x 256 outputs against 32 KiB per 128 x 128. 4 stages (192 KiB) and two 64 x 64 bf16
#: staging tiles fit.
DGRAD_FP8_WIDE_CONFIG = Fp8WsConfig(block_n=128, stages=4, group_m=8, producer_regs=40, consumer_regs=232, wide=True)


def ws_gemm1_dgrad_fp8_supported(dgu_fp8: Tensor, w1t_fp8: Tensor, cfg: Fp8WsConfig = DGRAD_FP8_CONFIG) -> str | None:
    """None if the warp-specialized FP8 GEMM1 dgrad can take these operands, else why not."""
    reason = _platform_reason(dgu_fp8)
    if reason:
        return reason
    E, D, F = w1t_fp8.shape
    wn = _tile_cols(cfg)
    if F % cfg.block_k or D % wn or cfg.block_n != cfg.block_k:
        return (f"needs F % {cfg.block_k} == 0, D % {wn} == 0 and block_n == {cfg.block_k} "
                f"(F={F}, D={D}, block_n={cfg.block_n}, wide={cfg.wide})")
    return None


def _tile_cols(cfg: Fp8WsConfig) -> int:
    """Output columns per tile of the GEMM1 dgrad / GEMM2 (= their weight tile's rows): block_n, twice that if wide."""
    return 2 * cfg.block_n if cfg.wide else cfg.block_n


def _check_k_major_call(fn: str, a_fp8: Tensor, w_fp8: Tensor, layout, cfg: Fp8WsConfig) -> tuple[int, int, int]:
    """The checks the GEMM1 dgrad and GEMM2 launchers share (operands of the same forms: A rows with 1x128 scales, a
    K-major (E, D, F) weight): the case is supported and the layout's block is the config's; returns (E, D, F).

    Raises:
        ValueError: naming ``fn`` and what to change.
    """
    reason = ws_gemm1_dgrad_fp8_supported(a_fp8, w_fp8, cfg)
    if reason:
        raise ValueError(f"{fn}: {reason}")
    if layout.block_m != cfg.block_m:
        raise ValueError(f"{fn}: layout.block_m={layout.block_m} != cfg.block_m={cfg.block_m} (build the routing "
                         f"layout with block_m {cfg.block_m})")
    return tuple(w_fp8.shape)


def ws_gemm1_dgrad_fp8(dgu_fp8: Tensor, dgu_scale: Tensor, w1t_fp8: Tensor, w1t_scale: Tensor, w3t_fp8: Tensor,
                       w3t_scale: Tensor, layout, *, out: Tensor | None = None, cfg: Fp8WsConfig = DGRAD_FP8_CONFIG,
                       programs: int | None = None) -> Tensor:
    """Blockwise-FP8 GEMM1 dgrad by the warp-specialized Gluon kernel: dx_rows[r] = dgate[r] @ w1[e] + dup[r] @ w3[e].

    Same contract and result as ``grouped_gemm_fp8_bwd.gemm1_dgrad_fp8``: the dequantized operands, a fresh fp32
    partial per 128-wide K block, scaled (dgate_up's 1x128 scale of the row times the weight's 128 x 128 block scale)
    and accumulated in fp32 over 2F (dgate x w1 first, then dup x w3).

    Args:
        dgu_fp8: (N_cap, 2F) float8_e4m3fn, dgate_up quantized 1x128; dgu_scale: (N_cap, 2F // 128) fp32.
        w1t_fp8, w3t_fp8: (E, D, F) float8_e4m3fn, w1 / w3 transposed; w1t_scale, w3t_scale: (E, D // 128, F // 128).
        layout: the routing layout (block_m 128).
        out: optional (N_cap, D) bf16 output. programs: persistent grid size (default: the SM count).

    Returns:
        dx_rows (N_cap, D) bf16: rows [0, offsets[E]) written (zeros on padding rows), the rest untouched.

    Raises:
        ValueError: an unsupported case (``ws_gemm1_dgrad_fp8_supported``'s reason), a layout with another block_m,
            or an operand of another shape, dtype, layout or device.
    """
    E, D, F = _check_k_major_call("ws_gemm1_dgrad_fp8", dgu_fp8, w1t_fp8, layout, cfg)
    n_cap, dev, bk = layout.n_cap, dgu_fp8.device, cfg.block_k
    _check("dgu_fp8", dgu_fp8, (n_cap, 2 * F), FP8, dev, "ws_gemm1_dgrad_fp8")
    _check("dgu_scale", dgu_scale, (n_cap, 2 * F // bk), torch.float32, dev, "ws_gemm1_dgrad_fp8")
    for name, w, s in (("w1t", w1t_fp8, w1t_scale), ("w3t", w3t_fp8, w3t_scale)):
        _check(f"{name}_fp8", w, (E, D, F), FP8, dev, "ws_gemm1_dgrad_fp8")
        _check(f"{name}_scale", s, (E, D // bk, F // bk), torch.float32, dev, "ws_gemm1_dgrad_fp8")
    dx = torch.empty((n_cap, D), dtype=torch.bfloat16, device=dev) if out is None else out
    _check("out", dx, (n_cap, D), torch.bfloat16, dev, "ws_gemm1_dgrad_fp8")
    if layout.n_tiles_cap == 0:
        return dx
    return launch_gemm1_dgrad_fp8(dgu_fp8, dgu_scale, w1t_fp8, w1t_scale, w3t_fp8, w3t_scale, layout, dx, cfg,
                                  programs)


def launch_gemm1_dgrad_fp8(dgu_fp8, dgu_scale, w1t_fp8, w1t_scale, w3t_fp8, w3t_scale, layout, dx: Tensor,
                           cfg: Fp8WsConfig = DGRAD_FP8_CONFIG, programs: int | None = None) -> Tensor:
    """``ws_gemm1_dgrad_fp8`` without its checks, for a caller that has made them; returns dx."""
    E, D, F = w1t_fp8.shape
    n_cap, dev = layout.n_cap, dgu_fp8.device
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    wn = _tile_cols(cfg)
    a_desc = _desc(dgu_fp8, (n_cap, 2 * F), (bm, bk))
    w1t_desc = _desc(w1t_fp8, (E * D, F), (wn, bk))
    w3t_desc = _desc(w3t_fp8, (E * D, F), (wn, bk))
    dx_desc = _desc(dx, (n_cap, D), (bm // 2, bn // 2))
    num_n = D // wn
    programs = _programs(dev, layout.n_tiles_cap * num_n, programs)
    launch(_gemm1_dgrad_fp8_ws_kernel, (programs,),
           a_desc, w1t_desc, w3t_desc, dx_desc, dgu_scale, w1t_scale, w3t_scale, layout.row_pair, layout.tile_expert,
           layout.offsets, E, D, F, num_n, cfg.group_m, cfg.stages, cfg.producer_regs, cfg.consumer_regs,
           _ordered(cfg), cfg.wide, num_warps=4, maxnreg=cfg.maxnreg)
    return dx


def sm90_compile_args_dgrad_fp8(cfg: Fp8WsConfig, D: int, F: int) -> tuple[dict, dict]:
    """(signature, constexprs) of ``_gemm1_dgrad_fp8_ws_kernel`` for ``sm90_check.compile_sm90``."""
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k

    wn = _tile_cols(cfg)
    sig = {"a_desc": _sig_desc([bm, bk]), "w1t_desc": _sig_desc([wn, bk]), "w3t_desc": _sig_desc([wn, bk]),
           "dx_desc": _sig_desc([bm // 2, bn // 2], fp8=False), "as_ptr": "*fp32", "w1ts_ptr": "*fp32",
           "w3ts_ptr": "*fp32", "row_pair_ptr": "*i32", "tile_expert_ptr": "*i32", "offsets_ptr": "*i32", "E": "i32"}
    cx = dict(D=D, F=F, NUM_N=D // wn, GROUP_M=cfg.group_m, STAGES=cfg.stages, PRODUCER_REGS=cfg.producer_regs,
              CONSUMER_REGS=cfg.consumer_regs, ORDERED=_ordered(cfg), WIDE=cfg.wide)
    return sig, cx


#: Config of the FP8 GEMM2: the GEMM1 dgrad's 128 x 128 tiles at 4 stages (no epilogue buffers: rows are stored from
#: registers). One H100, 30B / 235B: 0.582 / 1.983 ms at 4 stages, 0.598 / 2.032 at 5, group_m 1 and 16 no better;
#: the Triton kernel 0.706 / 2.456 (bench_ws_gemm2_fp8_1xh100_s23i_20261206.json, all bitwise the Triton output).
GEMM2_FP8_CONFIG = Fp8WsConfig(block_n=128, stages=4, group_m=8, producer_regs=40, consumer_regs=232)

#: The FP8 GEMM2 on 128 x 256 tiles (session 37, opt-in, not yet measured): ``DGRAD_FP8_WIDE_CONFIG``'s tiles with the
#: scatter epilogue; 4 stages (192 KiB, no staging tiles).
GEMM2_FP8_WIDE_CONFIG = Fp8WsConfig(block_n=128, stages=4, group_m=8, producer_regs=40, consumer_regs=232, wide=True)


def ws_gemm2_fwd_fp8_supported(h_fp8: Tensor, w2_fp8: Tensor, cfg: Fp8WsConfig = GEMM2_FP8_CONFIG) -> str | None:
    """None if the warp-specialized FP8 GEMM2 can take these operands, else why not: the GEMM1 dgrad's conditions
    (its operands have the same forms: A rows with 1x128 scales, a K-major (E, D, F) weight)."""
    return ws_gemm1_dgrad_fp8_supported(h_fp8, w2_fp8, cfg)


def ws_gemm2_fwd_fp8(h_fp8: Tensor, h_scale: Tensor, w2_fp8: Tensor, w2_scale: Tensor, scores: Tensor, layout, *,
                     out: Tensor | None = None, cfg: Fp8WsConfig = GEMM2_FP8_CONFIG,
                     programs: int | None = None) -> Tensor:
    """Blockwise-FP8 GEMM2 by the warp-specialized Gluon kernel: y[p] = scores[p] * (h[r] @ w2[e]^T) for every layout
    row r with pair p = row_pair[r] >= 0, in pair (token-major) order.

    Same contract and result as ``grouped_gemm_fp8.gemm2_scatter_fwd_fp8`` (``by_row=False``): a fresh fp32 partial per
    128-wide K block, scaled (h's 1x128 scale of the row times w2's 128 x 128 block scale) and accumulated in fp32 over
    F, times the score, rounded to bf16. The kernel is ``ws_gemm1_dgrad_fp8``'s producer and consumers (one K segment
    instead of two) with a scatter epilogue.

    Args:
        h_fp8: (N_cap, F) float8_e4m3fn, h quantized 1x128; h_scale: (N_cap, F // 128) fp32.
        w2_fp8: (E, D, F) float8_e4m3fn; w2_scale: (E, D // 128, F // 128) fp32.
        scores: (T, top_k) fp32 contiguous routing scores; pair p = t * top_k + k, P = T * top_k.
        layout: the routing layout (block_m 128).
        out: optional (P, D) bf16 output. programs: persistent grid size (default: the SM count).

    Returns:
        y (P, D) bf16: every pair placed in the layout written once; pairs without a row (dropped ids) untouched.

    Raises:
        ValueError: an unsupported case (``ws_gemm2_fwd_fp8_supported``'s reason), a layout with another block_m or
            built for other pairs / experts, or an operand of another shape, dtype, layout or device.
    """
    fn = "ws_gemm2_fwd_fp8"
    E, D, F = _check_k_major_call(fn, h_fp8, w2_fp8, layout, cfg)
    n_cap, dev, bk = layout.n_cap, h_fp8.device, cfg.block_k
    _check("h_fp8", h_fp8, (n_cap, F), FP8, dev, fn)
    _check("h_scale", h_scale, (n_cap, F // bk), torch.float32, dev, fn)
    _check("w2_fp8", w2_fp8, (E, D, F), FP8, dev, fn)
    _check("w2_scale", w2_scale, (E, D // bk, F // bk), torch.float32, dev, fn)
    if (scores.dim() != 2 or scores.shape[1] != layout.top_k or scores.dtype != torch.float32 or scores.device != dev
            or not scores.is_contiguous()):
        raise ValueError(f"{fn}: scores must be a contiguous (T, {layout.top_k}) fp32 tensor on {dev} (the layout's "
                         f"top_k), got {scores.dtype} {tuple(scores.shape)} on {scores.device}")
    P = scores.numel()
    if layout.pair_row.shape[0] != P or layout.num_experts != E:
        raise ValueError(f"{fn}: the layout was built for {layout.pair_row.shape[0]} pairs and {layout.num_experts} "
                         f"experts, the scores hold {P} pairs and w2 {E} experts (build the layout from these ids)")
    y = torch.empty((P, D), dtype=torch.bfloat16, device=dev) if out is None else out
    _check("out", y, (P, D), torch.bfloat16, dev, fn)
    if layout.n_tiles_cap == 0 or P == 0:
        return y
    return launch_gemm2_fwd_fp8(h_fp8, h_scale, w2_fp8, w2_scale, scores, layout, y, cfg, programs)


def launch_gemm2_fwd_fp8(h_fp8, h_scale, w2_fp8, w2_scale, scores, layout, y: Tensor,
                         cfg: Fp8WsConfig = GEMM2_FP8_CONFIG, programs: int | None = None) -> Tensor:
    """``ws_gemm2_fwd_fp8`` without its checks, for a caller that has made them; returns y."""
    E, D, F = w2_fp8.shape
    n_cap, dev = layout.n_cap, h_fp8.device
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    wn = _tile_cols(cfg)
    a_desc = _desc(h_fp8, (n_cap, F), (bm, bk))
    w2_desc = _desc(w2_fp8, (E * D, F), (wn, bk))
    y_desc = _desc(y, (y.shape[0], D), (bm // 2, bn // 2))  # the consumers' tile shape only: rows are scattered
    num_n = D // wn
    programs = _programs(dev, layout.n_tiles_cap * num_n, programs)
    launch(_gemm2_fwd_fp8_ws_kernel, (programs,),
           a_desc, w2_desc, y_desc, h_scale, w2_scale, scores, y, layout.row_pair, layout.tile_expert, layout.offsets,
           E, D, F, num_n, cfg.group_m, cfg.stages, cfg.producer_regs, cfg.consumer_regs, _ordered(cfg), cfg.wide,
           num_warps=4, maxnreg=cfg.maxnreg)
    return y


def sm90_compile_args_gemm2_fp8(cfg: Fp8WsConfig, D: int, F: int) -> tuple[dict, dict]:
    """(signature, constexprs) of ``_gemm2_fwd_fp8_ws_kernel`` for ``sm90_check.compile_sm90``."""
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k

    wn = _tile_cols(cfg)
    sig = {"a_desc": _sig_desc([bm, bk]), "w2_desc": _sig_desc([wn, bk]),
           "y_desc": _sig_desc([bm // 2, bn // 2], fp8=False),
           "as_ptr": "*fp32", "w2s_ptr": "*fp32", "scores_ptr": "*fp32", "out_ptr": "*bf16", "row_pair_ptr": "*i32",
           "tile_expert_ptr": "*i32", "offsets_ptr": "*i32", "E": "i32"}
    cx = dict(D=D, F=F, NUM_N=D // wn, GROUP_M=cfg.group_m, STAGES=cfg.stages, PRODUCER_REGS=cfg.producer_regs,
              CONSUMER_REGS=cfg.consumer_regs, ORDERED=_ordered(cfg), WIDE=cfg.wide)
    return sig, cx
