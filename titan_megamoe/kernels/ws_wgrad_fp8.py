"""Warp-specialized blockwise-FP8 weight gradients (dw2, dw1 | dw3) for Hopper, in Gluon.

Why: the Triton FP8 wgrad (``grouped_gemm_fp8_bwd._wgrad_fp8_kernel``) ran at 366 / 409 TF/s (dw2 / dw1 | dw3) at
the 30B shape on an H200 (``bench_fp8_persistent_1xh200_20261201.json``), below our bf16 wgrads (449 / 489): Triton
waits for every wgmma group before it scales the K block's partial (DeepSeek-V3's per-128 promotion), so the
tensor cores idle while the partials are scaled (``ws_gemm_fp8.py`` says why Triton cannot overlap it). The same
consumer scheme as ``ws_gemm_fp8.ws_gemm1_dgrad_fp8`` (856-914 TF/s against the Triton kernel's 663-689 on an H200):

* one TMA producer warp loads, per 128-row K step of expert e's segment [offsets[e], offsets[e+1]), the A tile
  aT[m0 : m0 + 128, r0 : r0 + 128] and the B tile bT[n0 : n0 + 128, r0 : r0 + 128] (both transposed, K-major,
  as the 128x1 quantizers of ``fp8_quant_bwd.py`` store them) into a ring of STAGES buffers;
* two cooperative consumer warpgroups, each on 64 output rows of the 128 x 128 tile, its 128 columns as two
  64-column halves whose MMAs are in flight together; per K step both partials start fresh (``use_acc=False``),
  the first is scaled under the second's MMA: acc += (partial * a_scale[row]) * b_scale[col], the scales of this
  step's 128-row group (the Triton kernel's expression, so the compiler contracts it the same way);
* persistent grid over E x (MA / 128) x (NC / 128) tiles in expert order (an expert's operands stay in L2 while its
  tiles run); experts without rows store zeros (empty K loop); bf16 or fp32 output tiles by TMA store.

Math per output element (dequantized operands): dW[e][m, n] = sum over the 128-row groups g of expert e of
(sum_{r in g} aT[m, r] bT[n, r]) * a_s[g, m] * b_s[g, n], in row order. The same as ``wgrad_fp8``'s (the tests
compare both on a GPU).

Status (sessions 20-21, one H100): bitwise the Triton wgrad in its GPU tests (tests/test_ws_wgrad_fp8.py); at 30B
dw2 1.415 -> 0.920 ms and dw1 | dw3 2.588 -> 1.915 (both timings with an output copy); in the fp8 layer 10.09 -> 8.90
ms fwd+bwd (session 21; session 20's "no gain" was a ``switches.override`` leak). On by default
(``ops/fp8_backend.WS_WGRAD_FP8``).

Session 24 (one H100, docs/NOTES.md): an ablation found the consumers' per-step global loads of the 128 + 128 scales
a quarter of the kernel (the TMA operand stream alone runs dw2 30B in 0.35 of its 0.66 ms); the producer now copies
each step's scale rows into the stage with its operands (``Fp8WgradConfig.smem_scales``): dw2 30B 0.671 -> 0.561 ms,
dw1 | dw3 1.421 -> 1.118, 235B 2.527 -> 2.268 and 5.643 -> 4.498, bitwise the same; fp8 layer 30B 8.72 -> 8.40 ms,
235B 26.51 -> 24.87 (same process). A consumer that takes the steps in pairs to keep an MMA in flight while the other
half is scaled was slower with the shared-memory scales (dw1 | dw3 30B 1.35 ms) and was removed.

Preconditions (``ws_wgrad_fp8_supported``): sm_90 GPU, Triton 3.6 with Gluon, MA, NC, split multiples of 128,
routing layout block 128 (a scale group never straddles two experts).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

from titan_megamoe.kernels.jit import env_choice
from titan_megamoe.kernels.launch import launch
from titan_megamoe.kernels.sm90_check import HOPPER_SMEM_BYTES
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

    from titan_megamoe.kernels.ws_wgrad import _wg_count, _wg_tile

__all__ = ["FP8_WGRAD_CONFIG", "FP8_WGRAD_EPI2_CONFIG", "FP8_WGRAD_N128_CONFIG", "Fp8WgradConfig",
           "sm90_compile_args_wgrad_fp8", "ws_wgrad_fp8", "ws_wgrad_fp8_supported"]

FP8 = torch.float8_e4m3fn
_G = 128  # scale group = K step = tile edge


@dataclass(frozen=True)
class Fp8WgradConfig:
    """Pipeline of the FP8 wgrad (tiles are 128 x 128, K steps 128 rows: the scale groups).

    Attributes:
        stages: operand buffers in the ring (two 128 x 128 e4m3 tiles each: 32 KiB).
        maxnreg, producer_regs, consumer_regs: the launch's register cap and ``setmaxnreg`` split (two consumer
            warpgroups with four 64 x 64 fp32 tiles each, 128 registers, and a one-warp TMA producer).
        smem_scales: the producer copies each step's 128 a scales and 128 b scales (one row of each scale tensor)
            into the stage with its operands by TMA, and the consumers read them from shared memory after the
            stage's barrier, instead of loading them from global memory every step (session 24, H100: dw2 30B
            0.671 -> 0.561 ms, dw1 | dw3 1.421 -> 1.118; 235B 2.527 -> 2.268, 5.643 -> 4.498). The same bits.
        epilogue_buffers: output staging tiles per consumer (1 or 2). With 2 the tile's second half is written
            while the first half's TMA store still reads its buffer (``store_wait(1)``, not 0): at ~8 K steps per
            tile the epilogue is a tenth of the kernel (session 24's ablation), and this is its wait. The same bits.
        mma_n: the N of each consumer's wgmma. 64 (the default): the tile's two 64-column halves in flight, the first
            scaled under the second's MMA. 128 (session 40, opt-in until measured): one m64n128 MMA per k32 over the
            tile's 128 columns, the partial scaled after it completes (the other consumer's MMAs run meanwhile, as in
            DeepGEMM's FP8 GEMM): each k32 reads the consumer's 64 x 32 A tile from shared memory once instead of
            twice (24 KiB of operand reads a K step instead of 32); staging tiles 64 x 128. The same bits expected
            (each element's K order is the same). Prior evidence is mixed: the bf16 GEMM2 dgrad's m64n128 consumer
            was 2 % faster than two m64n64 (session 28), the FP8 GEMM1's "cat" m64n128 variant slower (session 19).
    """

    stages: int = 5
    maxnreg: int = 168
    producer_regs: int = 40
    consumer_regs: int = 232
    smem_scales: bool = True
    epilogue_buffers: int = 1
    mma_n: int = 64

    def smem_bytes(self, out_dtype: torch.dtype = torch.bfloat16) -> int:
        """Shared memory of the operand ring (with the scale rows where ``smem_scales``; unused, the compiler drops
        them), its two mbarriers per stage and the two consumers' 64 x ``mma_n`` output staging tiles; the compiled
        kernel adds a few hundred bytes of alignment (``ws_wgrad_fp8`` leaves :data:`SMEM_SLACK` for them)."""
        staging = 2 * self.epilogue_buffers * 64 * self.mma_n * torch.empty((), dtype=out_dtype).element_size()
        scales = 2 * _G * 4 if self.smem_scales else 0
        return self.stages * (2 * _G * _G + scales + 2 * 8) + staging


#: Bytes the shared-memory check leaves for what ``Fp8WgradConfig.smem_bytes`` does not count (alignment: 250-290 bytes
#: in the sm_90a builds, session 40's review).
SMEM_SLACK = 1024

#: Default config (sm_90a builds at both Qwen3 shapes: tests/test_ws_wgrad_fp8.py).
FP8_WGRAD_CONFIG = Fp8WgradConfig()
#: Two output staging tiles per consumer (session 38; bf16 outputs: fp32 ones do not fit 5 stages). One H100
#: (``ab_kernels_wgrad_fp8_epi2_1xh100_s38a_20261207.json``, 8 rotated rounds, bitwise the default): dw2 30B 0.547 ->
#: 0.509 ms, 235B 2.195 -> 2.093; the split dw1 | dw3 slower, 1.069 -> 1.124 and 4.320 -> 4.459. So the default for
#: the unsplit (dw2) launches with bf16 outputs only (``ws_wgrad_fp8`` without ``cfg``).
FP8_WGRAD_EPI2_CONFIG = replace(FP8_WGRAD_CONFIG, epilogue_buffers=2)
#: One m64n128 MMA chain per consumer (session 40, opt-in until measured): ``Fp8WgradConfig.mma_n``. Five stages and
#: one 64 x 128 bf16 staging tile per consumer fit; two staging tiles need 4 stages.
FP8_WGRAD_N128_CONFIG = replace(FP8_WGRAD_CONFIG, mma_n=128)

#: ``TITAN_MEGAMOE_FP8_WGRAD_CONSUMER`` (default ``smem``): the consumer of a launch without ``cfg``: ``smem``, the scale
#: rows through shared memory (FP8_WGRAD_CONFIG); ``v1``, session 20's consumer (per-step global scale loads). Read at
#: import; a same-process switch.
CONSUMER = env_choice("TITAN_MEGAMOE_FP8_WGRAD_CONSUMER", "smem", ("smem", "v1"))


def consumer_config(consumer: str) -> Fp8WgradConfig:
    """FP8_WGRAD_CONFIG with the consumer named as in :data:`CONSUMER`."""
    return {"smem": FP8_WGRAD_CONFIG, "v1": replace(FP8_WGRAD_CONFIG, smem_scales=False)}[consumer]


if HAVE_GLUON:

    @gluon.jit
    def _wg8_producer(a_desc, b_desc, offsets_ptr, E, a_bufs, b_bufs, ready, empty, MT: gl.constexpr,
                      NT: gl.constexpr, STAGES: gl.constexpr, sa_desc, sb_desc, sa_bufs, sb_bufs,
                      SMEM_SCALES: gl.constexpr):
        # one warp: the A and B tiles of every 128-row step of the tile's expert, by TMA (and with SMEM_SCALES the
        # step's 128 a scales and 128 b scales, one row of each scale tensor)
        BM: gl.constexpr = a_desc.block_type.shape[0]
        BK: gl.constexpr = a_desc.block_type.shape[1]
        BN: gl.constexpr = b_desc.block_type.shape[0]
        if SMEM_SCALES:
            nbytes: gl.constexpr = (a_desc.block_type.nbytes + b_desc.block_type.nbytes + sa_desc.block_type.nbytes
                                    + sb_desc.block_type.nbytes)
        else:
            nbytes: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes
        idx = 0
        for j in range(_wg_count(E, MT, NT)):
            e, m, n = _wg_tile(j, MT, NT)
            start = gl.load(offsets_ptr + e)
            end = gl.load(offsets_ptr + e + 1)
            for r0 in range(start, end, BK):
                s = idx % STAGES
                mbarrier.wait(empty.index(s), ((idx // STAGES) & 1) ^ 1)  # first pass: free
                bar = ready.index(s)
                mbarrier.expect(bar, nbytes)
                tma.async_copy_global_to_shared(a_desc, [m * BM, r0], bar, a_bufs.index(s))
                tma.async_copy_global_to_shared(b_desc, [n * BN, r0], bar, b_bufs.index(s))
                if SMEM_SCALES:
                    tma.async_copy_global_to_shared(sa_desc, [r0 // BK, m * BM], bar, sa_bufs.index(s))
                    tma.async_copy_global_to_shared(sb_desc, [r0 // BK, n * BN], bar, sb_bufs.index(s))
                idx += 1

    @gluon.jit
    def _wg8_consumer(out0_desc, out1_desc, as_ptr, bs_ptr, offsets_ptr, E, a_bufs, b_bufs, ready, empty, c_smem,
                      C: gl.constexpr, MA: gl.constexpr, NC: gl.constexpr, M1: gl.constexpr, MT: gl.constexpr,
                      NT: gl.constexpr, STAGES: gl.constexpr, ABLATE: gl.constexpr, sa_bufs, sb_bufs,
                      SMEM_SCALES: gl.constexpr):
        # cooperative: both consumers take every tile, C its output rows [C * 64, C * 64 + 64); the tile's 128
        # columns as two 64-column halves, both MMAs of a K step in flight, the first scaled under the second
        BMC: gl.constexpr = out0_desc.block_type.shape[0]
        BH: gl.constexpr = out0_desc.block_type.shape[1]
        BK: gl.constexpr = a_bufs.type.shape[2]
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, BH, 32])
        row_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
        col_layout: gl.constexpr = gl.SliceLayout(0, mma_layout)
        sa_rows = sa_bufs  # (unused without SMEM_SCALES)
        sb_rows = sb_bufs
        if SMEM_SCALES:
            sa_rows, sb_rows = _wg8_scale_rows(sa_bufs, sb_bufs, STAGES, BMC, BH if BH == 64 else BH // 2)
        if BH == 128:  # Fp8WgradConfig.mma_n 128: one m64n128 MMA chain per k32, the staging tile 64 x 128
            _wg8_consumer_n128(out0_desc, out1_desc, as_ptr, bs_ptr, offsets_ptr, E, a_bufs, b_bufs, ready, empty,
                               c_smem, C, MA, NC, M1, MT, NT, STAGES, sa_rows, sb_rows, SMEM_SCALES)
            return
        idx = 0
        for j in range(_wg_count(E, MT, NT)):
            e, m, n = _wg_tile(j, MT, NT)
            start = gl.load(offsets_ptr + e)
            end = gl.load(offsets_ptr + e + 1)
            row0 = m * 2 * BMC + C * BMC
            col0 = n * 2 * BH
            rows = row0 + gl.arange(0, BMC, layout=row_layout)
            cols = col0 + gl.arange(0, BH, layout=col_layout)
            acc_lo = gl.zeros((BMC, BH), dtype=gl.float32, layout=mma_layout)
            acc_hi = gl.zeros((BMC, BH), dtype=gl.float32, layout=mma_layout)
            p_lo = gl.zeros((BMC, BH), dtype=gl.float32, layout=mma_layout)
            p_hi = gl.zeros((BMC, BH), dtype=gl.float32, layout=mma_layout)
            if ABLATE & 1:  # timing diagnosis: the tile's first scales for every step
                sa, sb_lo, sb_hi = _wg8_scales(as_ptr, bs_ptr, start // BK, rows, cols, MA, NC, BH)
            for r0 in range(start, end, BK):
                s = idx % STAGES
                g = r0 // BK  # this step's scale group
                if ABLATE & 3 == 0 and not SMEM_SCALES:
                    sa, sb_lo, sb_hi = _wg8_scales(as_ptr, bs_ptr, g, rows, cols, MA, NC, BH)
                mbarrier.wait(ready.index(s), (idx // STAGES) & 1)
                a = a_bufs.index(s).slice(C * BMC, BMC, dim=0)
                b = b_bufs.index(s)
                if ABLATE & 3 == 0 and SMEM_SCALES:  # the producer's copies of this step's scale rows
                    sa, sb_lo, sb_hi = _wg8_smem_scales(sa_rows, sb_rows, s, C, BMC, BH, row_layout, col_layout)
                if ABLATE & 8:  # no MMA: the operand stream alone
                    mbarrier.arrive(empty.index(s), count=1)
                elif ABLATE & 16:  # one accumulator chain, no per-step partials or scaling
                    acc_lo = warpgroup_mma(a, b.slice(0, BH, dim=0).permute((1, 0)), acc_lo, is_async=True)
                    acc_hi = warpgroup_mma(a, b.slice(BH, BH, dim=0).permute((1, 0)), acc_hi, is_async=True)
                    acc_lo = warpgroup_mma_wait(num_outstanding=1, deps=(acc_lo,))
                    acc_hi = warpgroup_mma_wait(num_outstanding=0, deps=(acc_hi,))
                    mbarrier.arrive(empty.index(s), count=1)
                else:
                    p_lo = warpgroup_mma(a, b.slice(0, BH, dim=0).permute((1, 0)), p_lo, use_acc=False,
                                         is_async=True)
                    p_hi = warpgroup_mma(a, b.slice(BH, BH, dim=0).permute((1, 0)), p_hi, use_acc=False,
                                         is_async=True)
                    p_lo = warpgroup_mma_wait(num_outstanding=1, deps=(p_lo,))
                    if ABLATE & 2:
                        acc_lo += p_lo
                    else:
                        acc_lo += (p_lo * sa) * sb_lo  # scaled under the other half's MMA
                    p_hi = warpgroup_mma_wait(num_outstanding=0, deps=(p_hi,))
                    mbarrier.arrive(empty.index(s), count=1)
                    if ABLATE & 2:
                        acc_hi += p_hi
                    else:
                        acc_hi += (p_hi * sa) * sb_hi
                idx += 1
            if ABLATE & 4 == 0:  # (bit 4: no output stores)
                # epilogue: the two halves through this consumer's staging tile, TMA stores into dW[e] (or the
                # second output past row M1: dw3 of the stacked dgate_up)
                dt: gl.constexpr = out0_desc.dtype
                NB: gl.constexpr = c_smem.type.shape[0]
                for half in gl.static_range(2):
                    buf = c_smem.index(half % NB)
                    tma.store_wait(pendings=NB - 1)  # the store issued NB stores ago has read buf
                    buf.store((acc_lo if half == 0 else acc_hi).to(dt))
                    fence_async_shared()
                    if row0 < M1:
                        tma.async_copy_shared_to_global(out0_desc, [e * M1 + row0, col0 + half * BH], buf)
                    else:
                        tma.async_copy_shared_to_global(out1_desc, [e * (MA - M1) + row0 - M1, col0 + half * BH],
                                                        buf)
        tma.store_wait(pendings=0)

    @gluon.jit
    def _wg8_consumer_n128(out0_desc, out1_desc, as_ptr, bs_ptr, offsets_ptr, E, a_bufs, b_bufs, ready, empty, c_smem,
                           C: gl.constexpr, MA: gl.constexpr, NC: gl.constexpr, M1: gl.constexpr, MT: gl.constexpr,
                           NT: gl.constexpr, STAGES: gl.constexpr, sa_rows, sb_rows, SMEM_SCALES: gl.constexpr):
        # Fp8WgradConfig.mma_n 128: consumer C's 64 output rows x the tile's 128 columns as one partial per K step
        # (m64n128 x 4 k32), scaled once it completes: acc += (partial * a_scale[row]) * b_scale[col], the default
        # consumer's expression per element
        BMC: gl.constexpr = out0_desc.block_type.shape[0]
        BN: gl.constexpr = out0_desc.block_type.shape[1]
        BK: gl.constexpr = a_bufs.type.shape[2]
        NB: gl.constexpr = c_smem.type.shape[0]
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, BN, 32])
        row_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
        col_layout: gl.constexpr = gl.SliceLayout(0, mma_layout)
        dt: gl.constexpr = out0_desc.dtype
        idx = 0
        for j in range(_wg_count(E, MT, NT)):
            e, m, n = _wg_tile(j, MT, NT)
            start = gl.load(offsets_ptr + e)
            end = gl.load(offsets_ptr + e + 1)
            row0 = m * 2 * BMC + C * BMC
            col0 = n * BN
            rows = row0 + gl.arange(0, BMC, layout=row_layout)
            cols = col0 + gl.arange(0, BN, layout=col_layout)
            acc = gl.zeros((BMC, BN), dtype=gl.float32, layout=mma_layout)
            p = gl.zeros((BMC, BN), dtype=gl.float32, layout=mma_layout)
            for r0 in range(start, end, BK):
                s = idx % STAGES
                mbarrier.wait(ready.index(s), (idx // STAGES) & 1)
                if SMEM_SCALES:
                    sa = gl.expand_dims(sa_rows.index(s).slice(C * BMC, BMC).load(row_layout), 1)
                    sb = gl.expand_dims(sb_rows.index(s).load(col_layout), 0)
                else:
                    g = r0 // BK
                    sa = gl.expand_dims(gl.load(as_ptr + g * MA + rows), 1)
                    sb = gl.expand_dims(gl.load(bs_ptr + g * NC + cols), 0)
                a = a_bufs.index(s).slice(C * BMC, BMC, dim=0)
                p = warpgroup_mma(a, b_bufs.index(s).permute((1, 0)), p, use_acc=False, is_async=True)
                p = warpgroup_mma_wait(num_outstanding=0, deps=(p,))
                mbarrier.arrive(empty.index(s), count=1)
                acc += (p * sa) * sb
                idx += 1
            buf = c_smem.index(j % NB)
            tma.store_wait(pendings=NB - 1)  # the store issued NB tiles ago has read buf
            buf.store(acc.to(dt))
            fence_async_shared()
            if row0 < M1:
                tma.async_copy_shared_to_global(out0_desc, [e * M1 + row0, col0], buf)
            else:
                tma.async_copy_shared_to_global(out1_desc, [e * (MA - M1) + row0 - M1, col0], buf)
        tma.store_wait(pendings=0)

    @gluon.jit
    def _wg8_scales(as_ptr, bs_ptr, g, rows, cols, MA: gl.constexpr, NC: gl.constexpr, BH: gl.constexpr):
        """(a_scale column, b_scale rows of the lo half, of the hi half) of scale group g, broadcastable to a half."""
        sa = gl.expand_dims(gl.load(as_ptr + g * MA + rows), 1)
        sb_lo = gl.expand_dims(gl.load(bs_ptr + g * NC + cols), 0)
        sb_hi = gl.expand_dims(gl.load(bs_ptr + g * NC + BH + cols), 0)
        return sa, sb_lo, sb_hi

    @gluon.jit
    def _wg8_scale_rows(sa_bufs, sb_bufs, STAGES: gl.constexpr, BMC: gl.constexpr, BH: gl.constexpr):
        """The [STAGES, 1, 2 BMC] / [STAGES, 1, 2 BH] (unswizzled) scale-row buffers as [STAGES, 2 BMC] / [STAGES,
        2 BH]: one row per stage, a 1-D view to slice."""
        flat: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1)
        return (sa_bufs._reinterpret(gl.float32, [STAGES, 2 * BMC], flat),
                sb_bufs._reinterpret(gl.float32, [STAGES, 2 * BH], flat))

    @gluon.jit
    def _wg8_smem_scales(sa_rows, sb_rows, s, C: gl.constexpr, BMC: gl.constexpr, BH: gl.constexpr,
                         row_layout: gl.constexpr, col_layout: gl.constexpr):
        """Stage s's (a_scale column of consumer C's rows, b_scale rows of the lo and hi halves), broadcastable to a
        half; read after the stage's ready barrier."""
        sa = gl.expand_dims(sa_rows.index(s).slice(C * BMC, BMC).load(row_layout), 1)
        sb_lo = gl.expand_dims(sb_rows.index(s).slice(0, BH).load(col_layout), 0)
        sb_hi = gl.expand_dims(sb_rows.index(s).slice(BH, BH).load(col_layout), 0)
        return sa, sb_lo, sb_hi

    @gluon.jit
    def _wgrad_fp8_ws_kernel(a_desc, b_desc, out0_desc, out1_desc, as_ptr, bs_ptr, offsets_ptr, E, sa_desc, sb_desc,
                             MA: gl.constexpr, NC: gl.constexpr, M1: gl.constexpr, STAGES: gl.constexpr,
                             PRODUCER_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr, ABLATE: gl.constexpr = 0,
                             SMEM_SCALES: gl.constexpr = True, EPI_BUFFERS: gl.constexpr = 1):
        """Blockwise-FP8 K-grouped dW[e] = aT[:, rows of e] @ bT[:, rows of e]^T (``ws_wgrad_fp8``). Grid: (programs,).
        SMEM_SCALES: the scale rows come with the operands into shared memory (else each consumer loads them from
        global memory every step). ABLATE (timing diagnosis, wrong results): bits leaving parts out
        (``ws_wgrad_fp8``'s ``_ablate``). EPI_BUFFERS: output staging tiles per consumer."""
        MT: gl.constexpr = MA // a_desc.block_type.shape[0]
        NT: gl.constexpr = NC // b_desc.block_type.shape[0]
        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
        b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
        c0 = gl.allocate_shared_memory(out0_desc.dtype, [EPI_BUFFERS] + out0_desc.block_type.shape, out0_desc.layout)
        c1 = gl.allocate_shared_memory(out0_desc.dtype, [EPI_BUFFERS] + out0_desc.block_type.shape, out0_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)  # both consumers read every buffer
        # the scale-row ring (1 KiB a stage): filled and read only with SMEM_SCALES (else the compiler drops it)
        sa_bufs = gl.allocate_shared_memory(sa_desc.dtype, [STAGES] + sa_desc.block_type.shape, sa_desc.layout)
        sb_bufs = gl.allocate_shared_memory(sb_desc.dtype, [STAGES] + sb_desc.block_type.shape, sb_desc.layout)
        gl.warp_specialize([
            (_wg8_consumer, (out0_desc, out1_desc, as_ptr, bs_ptr, offsets_ptr, E, a_bufs, b_bufs, ready, empty, c0,
                             0, MA, NC, M1, MT, NT, STAGES, ABLATE, sa_bufs, sb_bufs, SMEM_SCALES)),
            (_wg8_consumer, (out0_desc, out1_desc, as_ptr, bs_ptr, offsets_ptr, E, a_bufs, b_bufs, ready, empty, c1,
                             1, MA, NC, M1, MT, NT, STAGES, ABLATE, sa_bufs, sb_bufs, SMEM_SCALES)),
            (_wg8_producer, (a_desc, b_desc, offsets_ptr, E, a_bufs, b_bufs, ready, empty, MT, NT, STAGES, sa_desc,
                             sb_desc, sa_bufs, sb_bufs, SMEM_SCALES)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


def ws_wgrad_fp8_supported(aT_q: Tensor, MA: int, NC: int, split: int | None, layout) -> str | None:
    """None if the warp-specialized FP8 wgrad can take this case, else why not."""
    reason = _platform_reason(aT_q)
    if reason:
        return reason
    if MA % _G or NC % _G or (split is not None and split % _G):
        return f"needs MA, NC and split multiples of {_G} (MA={MA}, NC={NC}, split={split})"
    if layout.block_m != _G:
        return f"needs a routing layout with block_m {_G} (got {layout.block_m})"
    return None


def _k_major(t: Tensor) -> Tensor:
    """The (C, ld) storage behind a transposed (C, M) operand with row stride ld: TMA reads [C, ld] (the K loop stops
    at offsets[E] <= M, so the columns past M are never read)."""
    return t.as_strided((t.shape[0], t.stride(0)), (t.stride(0), 1))


def ws_wgrad_fp8(aT_q: Tensor, aT_s: Tensor, bT_q: Tensor, bT_s: Tensor, layout, *, split: int | None = None,
                 out_dtype: torch.dtype = torch.bfloat16, out: tuple[Tensor, ...] | None = None,
                 cfg: Fp8WgradConfig | None = None, programs: int | None = None,
                 _ablate: int = 0) -> tuple[Tensor, ...]:
    """Blockwise-FP8 K-grouped weight gradient by the warp-specialized Gluon kernel: dW[e] = sum over expert e's rows r
    of aT[:, r] outer bT[:, r], each 128-row group's fp32 partial scaled by a_s[g, m] * b_s[g, n].

    Same contract as ``grouped_gemm_fp8_bwd.wgrad_fp8`` (dw2 = ``ws_wgrad_fp8(doutT, doutT_s, hsT, hsT_s, layout)``;
    dw1, dw3 = ``ws_wgrad_fp8(dguT, dguT_s, xT, xT_s, layout, split=F)``).

    Args:
        aT_q: (MA, N_cap) float8_e4m3fn, unit column stride, row stride a multiple of 16 (the 128x1 quantizers'
            ``empty_transposed``); aT_s: (N_cap // 128, MA) fp32.
        bT_q: (NC, N_cap) float8_e4m3fn, as aT_q; bT_s: (N_cap // 128, NC) fp32.
        layout: routing layout with block_m = 128.
        split: None -> one (E, MA, NC) output; M1 -> rows [0, M1) and [M1, MA) as two outputs (a multiple of 128).
        out_dtype: bf16 or fp32.
        out: optional output buffers, contiguous ``out_dtype``: (dW,) of (E, MA, NC), or (dW_top, dW_bottom) of
            (E, split, NC) and (E, MA - split, NC).
        cfg: the pipeline (default: ``consumer_config(CONSUMER)``, with two output staging tiles for an unsplit
            launch with bf16 outputs: :data:`FP8_WGRAD_EPI2_CONFIG`).
        programs: persistent grid size (default: the SM count).
        _ablate: timing diagnosis only (wrong results): bits leaving parts out, 1 the
            per-step scale loads (the tile's first scales throughout), 2 the scaling (and its loads), 4 the output
            stores, 8 the MMAs (the operand stream alone), 16 the per-step partials (one accumulator chain).
            ``scripts/bench_wgrad_fp8.py --ablate`` times them.

    Returns:
        (dW,) or (dW_top, dW_bottom) in ``out_dtype``; experts without rows get zeros.

    Raises:
        ValueError: an unsupported case (``ws_wgrad_fp8_supported``'s reason) or an operand of another shape, dtype
            or device.
    """
    from titan_megamoe.kernels.fp8_quant_bwd import _check_transposed

    fn = "ws_wgrad_fp8"
    if cfg is None:
        cfg = consumer_config(CONSUMER)
        if split is None and out_dtype == torch.bfloat16 and cfg.smem_scales:  # FP8_WGRAD_EPI2_CONFIG's measurement
            cfg = replace(cfg, epilogue_buffers=2)
    MA, NC, n_cap, E, dev = aT_q.shape[0], bT_q.shape[0], layout.n_cap, layout.num_experts, aT_q.device
    reason = ws_wgrad_fp8_supported(aT_q, MA, NC, split, layout)
    if reason:
        raise ValueError(f"{fn}: {reason}")
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"{fn}: out_dtype must be bf16 or fp32, got {out_dtype}")
    _check_transposed(fn, "aT_q", aT_q, (MA, n_cap), dev)
    _check_transposed(fn, "bT_q", bT_q, (NC, n_cap), dev)
    for name, t, c in (("aT_s", aT_s, MA), ("bT_s", bT_s, NC)):
        if tuple(t.shape) != (n_cap // _G, c) or t.dtype != torch.float32 or not t.is_contiguous() or t.device != dev:
            raise ValueError(f"{fn}: {name} must be a contiguous fp32 tensor of shape {(n_cap // _G, c)} on {dev}, "
                             f"got {t.dtype} {tuple(t.shape)} on {t.device}")
    if cfg.mma_n not in (64, 128) or (cfg.mma_n == 128 and _ablate):
        raise ValueError(f"{fn}: cfg.mma_n must be 64 or 128 (128 without _ablate), got {cfg.mma_n}")
    if cfg.smem_bytes(out_dtype) > HOPPER_SMEM_BYTES - SMEM_SLACK:
        raise ValueError(f"{fn}: {cfg} needs {cfg.smem_bytes(out_dtype)} bytes of shared memory with {out_dtype} "
                         f"outputs (+ alignment), more than an sm_90 block has ({HOPPER_SMEM_BYTES}); use fewer "
                         f"stages or one staging tile")
    M1 = MA if split is None else split
    if not 0 < M1 <= MA or (split is not None and M1 == MA):
        raise ValueError(f"{fn}: split={split} must be in (0, {MA})")
    shapes = [(E, M1, NC)] + ([(E, MA - M1, NC)] if split is not None else [])
    if out is None:
        out = tuple(torch.empty(sh, dtype=out_dtype, device=dev) for sh in shapes)
    elif len(out) != len(shapes) or any(tuple(o.shape) != sh or o.dtype != out_dtype or not o.is_contiguous()
                                         or o.device != dev for o, sh in zip(out, shapes)):
        raise ValueError(f"{fn}: out must be {len(shapes)} contiguous {out_dtype} tensor(s) of shape(s) {shapes} on "
                         f"{dev}, got {[(o.dtype, tuple(o.shape)) for o in out]}")
    out1, out2 = out[0], out[-1]
    tiles = E * (MA // _G) * (NC // _G)
    if tiles == 0:
        return (out1,) if split is None else (out1, out2)
    a_desc = _desc(_k_major(aT_q), (MA, aT_q.stride(0)), (_G, _G))
    b_desc = _desc(_k_major(bT_q), (NC, bT_q.stride(0)), (_G, _G))
    o1 = _desc(out1, (E * M1, NC), (64, cfg.mma_n))  # the staging tile: the wide consumer's when mma_n is 128
    o2 = _desc(out2, (E * (MA - M1), NC), (64, cfg.mma_n)) if split is not None else o1
    sa_desc = _desc(aT_s, (n_cap // _G, MA), (1, _G))  # one scale row per step
    sb_desc = _desc(bT_s, (n_cap // _G, NC), (1, _G))
    launch(_wgrad_fp8_ws_kernel, (_programs(dev, tiles, programs),),
           a_desc, b_desc, o1, o2, aT_s, bT_s, layout.offsets, E, sa_desc, sb_desc, MA, NC, M1, cfg.stages,
           cfg.producer_regs,
           cfg.consumer_regs, _ablate, cfg.smem_scales, cfg.epilogue_buffers, num_warps=4, maxnreg=cfg.maxnreg)
    return (out1,) if split is None else (out1, out2)


def sm90_compile_args_wgrad_fp8(MA: int, NC: int, M1: int, out_dtype: torch.dtype = torch.bfloat16,
                                cfg: Fp8WgradConfig = FP8_WGRAD_CONFIG) -> tuple[dict, dict]:
    """(signature, constexprs) of ``_wgrad_fp8_ws_kernel`` for ``sm90_check.compile_sm90`` (CPU build checks)."""
    def desc(block, dtype, name):
        layout = gl.NVMMASharedLayout.get_default_for(block, dtype)
        return f"tensordesc<{name}[{block[0]}, {block[1]}],{layout!r}>"

    fp8 = desc([_G, _G], gl.float8e4nv, "fp8e4nv")
    out = (desc([64, cfg.mma_n], gl.bfloat16, "bf16") if out_dtype == torch.bfloat16
           else desc([64, cfg.mma_n], gl.float32, "fp32"))
    scale = desc([1, _G], gl.float32, "fp32")
    sig = {"a_desc": fp8, "b_desc": fp8, "out0_desc": out, "out1_desc": out, "as_ptr": "*fp32", "bs_ptr": "*fp32",
           "offsets_ptr": "*i32", "E": "i32", "sa_desc": scale, "sb_desc": scale}
    cx = dict(MA=MA, NC=NC, M1=M1, STAGES=cfg.stages, PRODUCER_REGS=cfg.producer_regs,
              CONSUMER_REGS=cfg.consumer_regs, ABLATE=0, SMEM_SCALES=cfg.smem_scales, EPI_BUFFERS=cfg.epilogue_buffers)
    return sig, cx
