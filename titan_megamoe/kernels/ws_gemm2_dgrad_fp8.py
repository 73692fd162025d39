"""Warp-specialized blockwise-FP8 GEMM2 dgrad fused with the SwiGLU backward, the routing-score gradient and the 128x1
quantization of s * h, for Hopper, in Gluon.

Why: the Triton kernel (``grouped_gemm_fp8_bwd._gemm2_dgrad_swiglu_bwd_fp8_kernel``) is the slowest FP8 GEMM of the
backward (1.33 ms at 30B on an H100, ~310 TF/s; docs/NOTES.md sessions 19-20): Triton 3.6 waits for every wgmma group
before the per-K-block promotion, so the tensor cores idle while each partial is scaled. The Gluon FP8 GEMM1 and GEMM1
dgrad (``ws_gemm_fp8.py``) overlap the promotion with the next MMA and run at 750-914 TF/s.

Design (the FP8 GEMM1's producer and consumer scheme, ``ws_gemm_fp8.py``):

* producer: ``ws_gemm._g1f_producer`` unchanged. Its 4 warps gather the e4m3 dout rows of a 128-row tile by cp.async
  (row r holds dout[row_pair[r] // K], padding rows zero-filled); its "w1" and "w3" TMA tiles are two 64-row tiles of
  w2 transposed (E, F, D): columns [64 n, 64 n + 64) and [F/2 + 64 n, F/2 + 64 n + 64) of g (the second through a
  descriptor whose base is F/2 rows further on). So a tile is 128 rows x two 64-column chunks of F, F / 128 tiles
  per row tile;
* two consumer warpgroups split the tile by **columns**, not rows: consumer c owns chunk c for all 128 rows, as two
  64-row halves whose MMAs are in flight together, the first half's partial scaled under the second's MMA. A
  consumer then holds whole 128-row columns, so the 128x1 quantization of s * h (an amax over the 128 rows of each
  column) needs no exchange between the consumers;
* epilogue: the consumer's gate and up tiles (128 x 64 bf16 each) come by TMA, issued when the tile starts, into
  two shared buffers that then stage the dgate and dup TMA stores. One pass per 64-row half: the SwiGLU backward
  writes dgate / dup over the gate / up it read and keeps s * h in registers (fp32); then the column amax over both
  halves, and the quantization (one reciprocal per column and Markstein's FMA correction, the quotient of
  ``div_rn``); the e4m3 tile leaves transposed by TMA.

Ping-pong (``GEMM2_DGRAD_FP8_PINGPONG``, session 36): the work unit is 128 rows x one 64-column chunk of F; consumer C
takes the program's units C, C + 2, ...; a stage holds the unit's 128 gathered dout rows and its one w2 tile
(``_g2d8_pp_producer``); two ``order`` mbarriers serialize the main loops (a consumer starts its unit's loop once the
other has waited on every stage of the unit before), so one consumer's epilogue runs under the other's main loop, and
every parity wait stays within one phase of its barrier (the ring is shared in order). Each unit is the cooperative
consumer's computation of that chunk: the same outputs bit for bit, d score partials included.

Math per row r (pair p = row_pair[r] >= 0, token t = p // K, expert e, score s = scores[p]) as the Triton kernel's:
``g = sum over K blocks kb of dot(dout_q[t, kb], w2t_q[e, :, kb]) * (dout_s[t, kb] * w2t_s[e, n // 128, kb])``,
sig = 1 / (1 + exp(-gate)), silu = gate sig, h = bf16(silu up), dh = s g, dgate = dh up sig (1 + gate (1 - sig)),
dup = dh silu, hs = silu up s, quantized per (128-row group, column). dgate_up and the quantized s * h equal the
Triton kernel's to fp32 rounding (the same partials and expressions; the compiler may contract differently).
**The d score partials differ in grouping**: one per 64-column chunk (``dscore_part`` has F / 64 columns, chunk j =
columns [64 j, 64 j + 64)) where the Triton kernel has one per 128 columns; ``reduce_dscore`` and
``ep_comm.dscore_push`` sum any number of partials in ascending order, so d score stays deterministic but is not
bitwise the Triton path's.

Preconditions (``ws_gemm2_dgrad_fp8_supported``): sm_90 GPU, Triton 3.6 with Gluon, D % 128 == 0, F % 128 == 0,
routing layout block 128, contiguous operands, the 128x1 s * h output (not ``hs_out``'s bf16 rows).

Status (one H100; docs/NOTES.md sessions 21-22, 36): correct in its GPU tests. Session 22: cooperative 30B 1.31 ms,
235B 3.59-3.63 against the Triton kernel's 1.26-1.28 / 3.38, the epilogue exposed (~16 us of a 29 us tile at 30B after
a 13 us main loop; tile timelines: ``launch_gemm2_dgrad_fp8(trace=...)``). Session 36: the s * h scale amax / 448 by
the constant reciprocal (16 fewer branchy ``div_rn`` per consumer thread and tile), and the ping-pong schedule; 8
rotated rounds in one process (``scripts/ab_kernels.py --groups gemm2_dgrad_fp8``): 30B Triton 1.140 ms, cooperative
1.036, ping-pong 0.954-0.966; 235B 3.484, **2.998**, 3.300-3.308. The default since session 36
(``ops/fp8_backend.WS_GEMM2_DGRAD_FP8`` "auto": ping-pong below D = 4096, cooperative from it); in the layer the
backward's device time drops less than the kernel A/B says (30B -0.06 ms, 235B -0.1 to -0.2). 32 bytes of stack at
the 216-register consumer budget (both schedules).
"""

from __future__ import annotations

import torch
from torch import Tensor

from titan_megamoe.kernels.fp8_quant_bwd import empty_transposed
from titan_megamoe.kernels.launch import launch
from titan_megamoe.kernels.ws_gemm import HAVE_GLUON, _desc, _platform_reason, _programs
from titan_megamoe.kernels.ws_gemm_fp8 import Fp8WsConfig
from titan_megamoe.ops.fp8_reference import AMAX_EPS

if HAVE_GLUON:
    import triton.language as tl
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

    from titan_megamoe.kernels.ws_gemm import _g1f_producer, _gathered_rows, _num_tiles, _tile_of

__all__ = ["GEMM2_DGRAD_FP8_CONFIG", "GEMM2_DGRAD_FP8_PINGPONG", "sm90_compile_args_gemm2_dgrad_fp8",
           "ws_gemm2_dgrad_fp8", "ws_gemm2_dgrad_fp8_supported"]

FP8 = torch.float8_e4m3fn
#: RN(1 / 448) in fp32 (exactly this float64 value): the e4m3 scale's constant reciprocal
RCP_448 = 0.0022321429569274187

#: 128-row tiles, two 64-column chunks of F each (one per consumer), 4 stages: the ring (4 x 32 KiB) plus each
#: consumer's gate / up tiles (2 x 16 KiB) and two 64 x 64 e4m3 s * h staging tiles fit 227 KiB; 5 stages do not.
GEMM2_DGRAD_FP8_CONFIG = Fp8WsConfig(block_n=64, stages=4, group_m=8, producer_regs=72, consumer_regs=216)

#: Ping-pong (session 36): each consumer takes whole 128 x 64 units (128 rows, one 64-column chunk of F) in turn, the
#: main loops serialized by two ``order`` mbarriers, so one consumer's epilogue (~16 us of a 29 us cooperative tile at
#: 30B on an H100: ``scripts/bench_ws_gemm.py trace-g2d-fp8``) runs under the other's main loop. A stage holds the
#: 128 dout rows and one 64-row w2 tile (24 KiB): 6 stages and the two consumers' epilogue buffers fit 227 KiB. Each
#: unit is computed as the cooperative kernel computes that chunk (same partials, same order): bitwise its outputs.
GEMM2_DGRAD_FP8_PINGPONG = Fp8WsConfig(block_n=64, stages=6, group_m=8, producer_regs=72, consumer_regs=216,
                                       pingpong=True)


def _smem_bytes(cfg: Fp8WsConfig) -> int:
    ring = cfg.stages * (cfg.block_m + (1 if cfg.pingpong else 2) * cfg.block_n) * cfg.block_k
    epilogue = 2 * (2 * cfg.block_m * cfg.block_n * 2 + 2 * (cfg.block_m // 2) * cfg.block_n)
    return ring + epilogue


if HAVE_GLUON:
    _RCP_448 = gl.constexpr(RCP_448)

    @gluon.jit
    def _stamp(trace_ptr, j, slot, C: gl.constexpr, TRACE: gl.constexpr):
        """Diagnosis only (``TRACE`` > 0): the global timer (ns) into trace[program, j, C, slot] for the first
        ``TRACE`` tiles of each program."""
        if TRACE > 0:
            if j < TRACE:
                t = gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=gl.int64, is_pure=False,
                                              pack=1)
                gl.store(trace_ptr + ((gl.program_id(0) * TRACE + j) * 2 + C) * 16 + slot, t)

    @gluon.jit
    def _silu_parts(gate):
        sig = 1.0 / (1.0 + gl.exp(-gate))  # as the Triton kernel writes it (not a sigmoid intrinsic)
        return sig, gate * sig

    @gluon.jit
    def _e4m3_t(y, scale_b, r):
        """y / scale as e4m3 (saturated at +-448), transposed for the (F, N) s * h layout. The quotient rounds as
        ``div_rn``'s, by the column's reciprocal r = RN(1 / scale) and Markstein's correction
        (``fp8_quant._div_by_group``)."""
        q = y * r
        q = gl.fma(gl.fma(-q, scale_b, y), r, q)
        sign = y.to(gl.int32, bitcast=True) & -2147483648  # -0.0 / s is -0.0
        q = ((q.to(gl.int32, bitcast=True) & 2147483647) | sign).to(gl.float32, bitcast=True)
        return gl.permute(gl.minimum(gl.maximum(q, -448.0), 448.0).to(gl.float8e4nv), (1, 0))

    @gluon.jit
    def _g2d8_half(g, sr, vf, rows, gate_s, up_s, part_ptr, col0, NBP: gl.constexpr, BH: gl.constexpr):
        """The SwiGLU backward of one (BM / 2, BH) half tile (one-pass epilogue): the d score partial to global
        memory, dgate / dup over the gate / up tiles they came from; returns s * h (fp32) for the quantization."""
        layout: gl.constexpr = g.type.layout
        gate = gate_s.load(layout).to(gl.float32)
        sig, silu = _silu_parts(gate)
        dsig = sig * (1.0 + gate * (1.0 - sig))  # d silu / d gate
        up = up_s.load(layout).to(gl.float32)
        t = silu * up
        h = t.to(gl.bfloat16).to(gl.float32)  # the bf16 h of the forward
        gl.store(part_ptr + rows.to(gl.int64) * NBP + col0 // BH, gl.sum(g * h * vf, axis=1))
        dh = g * sr
        gate_s.store((dh * up * dsig * vf).to(gl.bfloat16))
        up_s.store((dh * silu * vf).to(gl.bfloat16))
        return t * sr * vf

    @gluon.jit
    def _g2d8_pp_producer(dout_ptr, w2_desc, row_pair_ptr, tile_expert_ptr, offsets_ptr, E, a_bufs, b_bufs, ready_a,
                          ready_b, empty, D: gl.constexpr, F: gl.constexpr, TOPK: gl.constexpr, NUM_N: gl.constexpr,
                          GROUP_M: gl.constexpr, STAGES: gl.constexpr):
        """Ping-pong producer (4 warps): every unit of the program in order, D / BK ring steps each: the unit's 128
        gathered e4m3 dout rows by cp.async (padding rows zero-filled), its 64-row w2t tile by TMA."""
        BM: gl.constexpr = a_bufs.type.shape[1]
        BK: gl.constexpr = a_bufs.type.shape[2]
        BN: gl.constexpr = w2_desc.block_type.shape[0]
        KT: gl.constexpr = D // BK
        n_live, count = _num_tiles(offsets_ptr, E, BM, NUM_N)
        idx = 0
        for j in range(count):
            pid_m, pid_n = _tile_of(j, n_live, NUM_N, GROUP_M)
            e = gl.load(tile_expert_ptr + pid_m)
            ptrs, mask = _gathered_rows(dout_ptr, row_pair_ptr, pid_m, D, TOPK, BM, BK)
            w_row = e * F + pid_n * BN
            for k in range(KT):
                s = idx % STAGES
                mbarrier.wait(empty.index(s), ((idx // STAGES) & 1) ^ 1)
                async_copy.async_copy_global_to_shared(a_bufs.index(s), ptrs + k * BK, mask=mask)
                async_copy.mbarrier_arrive(ready_a.index(s), increment_count=False)  # one arrival per thread
                bar = ready_b.index(s)
                mbarrier.expect(bar, w2_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(w2_desc, [w_row, k * BK], bar, b_bufs.index(s))
                idx += 1

    @gluon.jit
    def _g2d8_producer(dout_ptr, w2t_lo_desc, w2t_hi_desc, row_pair_ptr, tile_expert_ptr, offsets_ptr, E, a_bufs,
                       b0_bufs, b1_bufs, ready_a, ready_b, empty, D: gl.constexpr, F: gl.constexpr, TOPK: gl.constexpr,
                       NUM_N: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr, PINGPONG: gl.constexpr):
        """The producer partition of either schedule: one w2 tile per stage (ping-pong), or the FP8 GEMM1's producer
        with its two weight tiles (cooperative: the chunks of both consumers)."""
        if PINGPONG:
            _g2d8_pp_producer(dout_ptr, w2t_lo_desc, row_pair_ptr, tile_expert_ptr, offsets_ptr, E, a_bufs, b0_bufs,
                              ready_a, ready_b, empty, D, F, TOPK, NUM_N, GROUP_M, STAGES)
        else:
            _g1f_producer(dout_ptr, w2t_lo_desc, w2t_hi_desc, row_pair_ptr, tile_expert_ptr, offsets_ptr, E, a_bufs,
                          b0_bufs, b1_bufs, ready_a, ready_b, empty, D, F, TOPK, NUM_N, GROUP_M, STAGES)

    @gluon.jit
    def _g2d8_consumer(gu_desc, dgu_desc, hsT_desc, douts_ptr, w2ts_ptr, scores_ptr, part_ptr, hsTs_ptr, count_ptr,
                       row_pair_ptr, tile_expert_ptr, offsets_ptr, E, a_bufs, b_bufs, ready_a, ready_b, empty, g_smem,
                       u_smem, q0_smem, q1_smem, epi_bar, order, C: gl.constexpr, D: gl.constexpr, F: gl.constexpr,
                       TOPK: gl.constexpr, NUM_N: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                       CHECK: gl.constexpr, EPS: gl.constexpr, PINGPONG: gl.constexpr, trace_ptr,
                       TRACE: gl.constexpr):
        # cooperative: consumer C owns columns [C F/2 + BH pid_n, + BH) of g for all BM rows, as two BM / 2 row halves;
        # ping-pong: consumer C takes units C, C + 2, ..., columns [BH pid_n, + BH) for all BM rows, the same way
        BM: gl.constexpr = a_bufs.type.shape[1]
        BK: gl.constexpr = a_bufs.type.shape[2]
        BH: gl.constexpr = b_bufs.type.shape[1]
        HM: gl.constexpr = BM // 2
        KT: gl.constexpr = D // BK  # K blocks = dout scale columns
        NBF: gl.constexpr = F // BK  # weight scale blocks along F
        NBP: gl.constexpr = F // BH  # d score partial columns
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, BH, 32])
        row_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
        col_layout: gl.constexpr = gl.SliceLayout(0, mma_layout)
        n_live, count = _num_tiles(offsets_ptr, E, BM, NUM_N)
        first: gl.constexpr = C if PINGPONG else 0
        step: gl.constexpr = 2 if PINGPONG else 1
        for j in range(first, count, step):
            pid_m, pid_n = _tile_of(j, n_live, NUM_N, GROUP_M)
            row0 = pid_m * BM
            col0 = pid_n * BH if PINGPONG else C * (F // 2) + pid_n * BH
            _stamp(trace_ptr, j, 0, C, TRACE)
            # this tile's gate / up under its main loop; the buffers staged the previous tile's stores
            tma.store_wait(pendings=0)
            _stamp(trace_ptr, j, 1, C, TRACE)
            mbarrier.expect(epi_bar, 2 * gu_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(gu_desc, [row0, col0], epi_bar, g_smem)
            tma.async_copy_global_to_shared(gu_desc, [row0, F + col0], epi_bar, u_smem)
            rows0 = row0 + gl.arange(0, HM, layout=row_layout)
            rows1 = rows0 + HM
            pair0 = gl.load(row_pair_ptr + rows0)
            pair1 = gl.load(row_pair_ptr + rows1)
            ok0 = pair0 >= 0
            ok1 = pair1 >= 0
            ds0 = douts_ptr + gl.where(ok0, pair0 // TOPK, 0).to(gl.int64) * KT
            ds1 = douts_ptr + gl.where(ok1, pair1 // TOPK, 0).to(gl.int64) * KT
            e = gl.load(tile_expert_ptr + pid_m)
            ws_off = (e * NBF + col0 // BK) * KT
            acc0 = gl.zeros((HM, BH), dtype=gl.float32, layout=mma_layout)
            acc1 = gl.zeros((HM, BH), dtype=gl.float32, layout=mma_layout)
            p0 = gl.zeros((HM, BH), dtype=gl.float32, layout=mma_layout)
            p1 = gl.zeros((HM, BH), dtype=gl.float32, layout=mma_layout)
            idx0 = j * KT
            if PINGPONG:
                if j > 0:  # the other consumer has waited on every stage of unit j - 1: ours may start (this order also
                    mbarrier.wait(order.index(C), ((j - 2 + C) // 2) & 1)  # keeps each parity wait within one phase)
            for k in range(KT):
                idx = idx0 + k
                s = idx % STAGES
                ph = (idx // STAGES) & 1
                wsk = gl.load(w2ts_ptr + ws_off + k)
                sc0 = gl.load(ds0 + k, mask=ok0, other=0.0) * wsk
                sc1 = gl.load(ds1 + k, mask=ok1, other=0.0) * wsk
                mbarrier.wait(ready_a.index(s), ph)
                mbarrier.wait(ready_b.index(s), ph)
                fence_async_shared()  # the rows came by cp.async (generic proxy); wgmma reads via the async one
                a = a_bufs.index(s)
                b = b_bufs.index(s).permute((1, 0))
                p0 = warpgroup_mma(a.slice(0, HM, dim=0), b, p0, use_acc=False, is_async=True)
                p1 = warpgroup_mma(a.slice(HM, HM, dim=0), b, p1, use_acc=False, is_async=True)
                p0 = warpgroup_mma_wait(num_outstanding=1, deps=(p0,))
                acc0 += p0 * gl.expand_dims(sc0, 1)  # scaled under the other half's MMA
                p1 = warpgroup_mma_wait(num_outstanding=0, deps=(p1,))
                mbarrier.arrive(empty.index(s), count=1)
                acc1 += p1 * gl.expand_dims(sc1, 1)
            if PINGPONG:
                mbarrier.arrive(order.index(1 - C), count=1)  # the other consumer's next main loop may start
            _stamp(trace_ptr, j, 2, C, TRACE)

            # epilogue. Padding rows: g = 0 (zero-filled rows), s = 0, gate = up = 0 (GEMM1 wrote zeros); the
            # multiplies by vf keep every padding output at zero without a select (see ws_gemm.py)
            mbarrier.wait(epi_bar, (j // step) & 1)
            _stamp(trace_ptr, j, 3, C, TRACE)
            s0 = gl.expand_dims(gl.load(scores_ptr + pair0, mask=ok0, other=0.0), 1)
            s1 = gl.expand_dims(gl.load(scores_ptr + pair1, mask=ok1, other=0.0), 1)
            vf0 = gl.expand_dims(ok0.to(gl.float32), 1)
            vf1 = gl.expand_dims(ok1.to(gl.float32), 1)
            _stamp(trace_ptr, j, 4, C, TRACE)
            # one pass: each half's s * h kept in registers (y0, y1) while its dgate / dup replace gate / up in
            # shared memory, then the column amax over both halves and the quantization
            y0 = _g2d8_half(acc0, s0, vf0, rows0, g_smem.slice(0, HM, dim=0), u_smem.slice(0, HM, dim=0),
                            part_ptr, col0, NBP, BH)
            _stamp(trace_ptr, j, 5, C, TRACE)
            y1 = _g2d8_half(acc1, s1, vf1, rows1, g_smem.slice(HM, HM, dim=0), u_smem.slice(HM, HM, dim=0),
                            part_ptr, col0, NBP, BH)
            _stamp(trace_ptr, j, 6, C, TRACE)
            bits = gl.max(gl.maximum(gl.abs(y0).to(gl.int32, bitcast=True),
                                     gl.abs(y1).to(gl.int32, bitcast=True)), axis=0)
            amax = gl.maximum(bits.to(gl.float32, bitcast=True), EPS, propagate_nan=tl.PropagateNan.ALL)
            # amax / 448 as div_rn rounds it, by the constant reciprocal and Markstein's correction (the quotient of
            # _e4m3_t; tests/test_fp8_quant.py checks the divisor 448): three FMAs for a branchy division per column
            # (inf / NaN amax: the quotient itself, inf / NaN as div_rn gives them; the correction would make inf NaN)
            r448 = gl.full(amax.shape, _RCP_448, gl.float32, layout=col_layout)
            q448 = amax * r448
            fixed = gl.fma(gl.fma(-q448, gl.full(amax.shape, 448.0, gl.float32, layout=col_layout), amax), r448, q448)
            scale = gl.where(q448 < float("inf"), fixed, q448)
            scale_b = gl.expand_dims(scale, 0)
            rcp_b = gl.expand_dims(gl.div_rn(gl.full(scale.shape, 1.0, gl.float32, layout=col_layout), scale), 0)
            _stamp(trace_ptr, j, 7, C, TRACE)
            q0_smem.store(_e4m3_t(y0, scale_b, rcp_b))
            q1_smem.store(_e4m3_t(y1, scale_b, rcp_b))
            fence_async_shared()
            tma.async_copy_shared_to_global(dgu_desc, [row0, col0], g_smem)
            tma.async_copy_shared_to_global(dgu_desc, [row0, F + col0], u_smem)
            tma.async_copy_shared_to_global(hsT_desc, [col0, row0], q0_smem)
            tma.async_copy_shared_to_global(hsT_desc, [col0, row0 + HM], q1_smem)
            gl.store(hsTs_ptr + pid_m.to(gl.int64) * F + col0 + gl.arange(0, BH, layout=col_layout), scale)
            if CHECK:
                n_bad = gl.sum((~(scale < float("inf"))).to(gl.int32), axis=0)  # NaN < inf is False
                gl.atomic_add(count_ptr, n_bad, mask=n_bad > 0)
            _stamp(trace_ptr, j, 8, C, TRACE)
        tma.store_wait(pendings=0)

    @gluon.jit
    def _gemm2_dgrad_fp8_ws_kernel(dout_ptr, douts_ptr, w2t_lo_desc, w2t_hi_desc, w2ts_ptr, gu_desc, dgu_desc, hsT_desc,
                                   scores_ptr, part_ptr, hsTs_ptr, count_ptr, row_pair_ptr, tile_expert_ptr,
                                   offsets_ptr, E, D: gl.constexpr, F: gl.constexpr, TOPK: gl.constexpr,
                                   NUM_N: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                                   BM: gl.constexpr, BK: gl.constexpr, CHECK: gl.constexpr, EPS: gl.constexpr,
                                   PRODUCER_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                                   trace_ptr, TRACE: gl.constexpr, PINGPONG: gl.constexpr = False):
        """Blockwise-FP8 dgate_up, d score partials and 128x1 s * h of every live row tile (module docstring).
        Grid: (programs,)."""
        a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, BK], gl.float8e4nv)
        a_bufs = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BM, BK], a_layout)
        b0_bufs = gl.allocate_shared_memory(w2t_lo_desc.dtype, [STAGES] + w2t_lo_desc.block_type.shape,
                                            w2t_lo_desc.layout)
        if PINGPONG:  # one w2 tile per stage, read by the consumer of its unit
            b1_bufs = b0_bufs
        else:
            b1_bufs = gl.allocate_shared_memory(w2t_hi_desc.dtype, [STAGES] + w2t_hi_desc.block_type.shape,
                                                w2t_hi_desc.layout)
        g0 = gl.allocate_shared_memory(gu_desc.dtype, gu_desc.block_type.shape, gu_desc.layout)
        u0 = gl.allocate_shared_memory(gu_desc.dtype, gu_desc.block_type.shape, gu_desc.layout)
        g1 = gl.allocate_shared_memory(gu_desc.dtype, gu_desc.block_type.shape, gu_desc.layout)
        u1 = gl.allocate_shared_memory(gu_desc.dtype, gu_desc.block_type.shape, gu_desc.layout)
        q00 = gl.allocate_shared_memory(hsT_desc.dtype, hsT_desc.block_type.shape, hsT_desc.layout)
        q01 = gl.allocate_shared_memory(hsT_desc.dtype, hsT_desc.block_type.shape, hsT_desc.layout)
        q10 = gl.allocate_shared_memory(hsT_desc.dtype, hsT_desc.block_type.shape, hsT_desc.layout)
        q11 = gl.allocate_shared_memory(hsT_desc.dtype, hsT_desc.block_type.shape, hsT_desc.layout)
        ready_a = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        ready_b = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        epi = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        order = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready_a.index(i), count=128)  # one cp.async arrival per producer thread (4 warps)
            mbarrier.init(ready_b.index(i), count=1)
            mbarrier.init(empty.index(i), count=1 if PINGPONG else 2)  # cooperative: both consumers read every buffer
        for i in gl.static_range(2):
            mbarrier.init(epi.index(i), count=1)
            mbarrier.init(order.index(i), count=1)
        gl.warp_specialize([
            (_g2d8_consumer, (gu_desc, dgu_desc, hsT_desc, douts_ptr, w2ts_ptr, scores_ptr, part_ptr, hsTs_ptr,
                              count_ptr, row_pair_ptr, tile_expert_ptr, offsets_ptr, E, a_bufs, b0_bufs, ready_a,
                              ready_b, empty, g0, u0, q00, q01, epi.index(0), order, 0, D, F, TOPK, NUM_N,
                              GROUP_M, STAGES, CHECK, EPS, PINGPONG, trace_ptr, TRACE)),
            (_g2d8_consumer, (gu_desc, dgu_desc, hsT_desc, douts_ptr, w2ts_ptr, scores_ptr, part_ptr, hsTs_ptr,
                              count_ptr, row_pair_ptr, tile_expert_ptr, offsets_ptr, E, a_bufs, b1_bufs, ready_a,
                              ready_b, empty, g1, u1, q10, q11, epi.index(1), order, 1, D, F, TOPK, NUM_N,
                              GROUP_M, STAGES, CHECK, EPS, PINGPONG, trace_ptr, TRACE)),
            (_g2d8_producer, (dout_ptr, w2t_lo_desc, w2t_hi_desc, row_pair_ptr, tile_expert_ptr, offsets_ptr, E, a_bufs,
                              b0_bufs, b1_bufs, ready_a, ready_b, empty, D, F, TOPK, NUM_N, GROUP_M, STAGES, PINGPONG)),
        ], [4, 4], [CONSUMER_REGS, PRODUCER_REGS])


def ws_gemm2_dgrad_fp8_supported(dout_q: Tensor, w2t_q: Tensor, hs_out: Tensor | None = None,
                                 cfg: Fp8WsConfig = GEMM2_DGRAD_FP8_CONFIG) -> str | None:
    """None if the warp-specialized FP8 GEMM2 dgrad can take this case, else why not."""
    reason = _platform_reason(dout_q)
    if reason:
        return reason
    if hs_out is not None:
        return "writes s * h quantized 128x1 only (hs_out's bf16 rows: the Triton kernel)"
    E, F, D = w2t_q.shape
    if F % cfg.block_k or D % cfg.block_k or cfg.block_n != cfg.block_k // 2:
        return (f"needs F % {cfg.block_k} == 0, D % {cfg.block_k} == 0 and block_n == {cfg.block_k // 2} "
                f"(F={F}, D={D}, block_n={cfg.block_n})")
    return None


def _check(name: str, t: Tensor, shape: tuple[int, ...], dtype: torch.dtype, dev: torch.device) -> None:
    if tuple(t.shape) != shape or t.dtype != dtype or not t.is_contiguous() or t.device != dev:
        raise ValueError(f"ws_gemm2_dgrad_fp8: {name} must be a contiguous {dtype} tensor of shape {shape} on {dev}; "
                         f"got {t.dtype} {tuple(t.shape)} {'contiguous' if t.is_contiguous() else 'strided'} on "
                         f"{t.device}")


def ws_gemm2_dgrad_fp8(dout_q: Tensor, dout_s: Tensor, w2t_q: Tensor, w2t_s: Tensor, gate_up: Tensor,
                       scores_TK: Tensor, layout, *, nonfinite_count: Tensor | None = None,
                       cfg: Fp8WsConfig = GEMM2_DGRAD_FP8_CONFIG,
                       programs: int | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """FP8 GEMM2 dgrad with the SwiGLU backward, the d score partials and the 128x1 quantization of s * h, by the
    warp-specialized Gluon kernel (module docstring).

    Same contract as ``grouped_gemm_fp8_bwd.gemm2_dgrad_swiglu_bwd_fp8`` without ``hs_out``, except the d score
    partials: one per 64 columns of F.

    Args:
        dout_q: (T, D) float8_e4m3fn, dout quantized 1x128; dout_s: (T, D // 128) fp32.
        w2t_q: (E, F, D) float8_e4m3fn, w2 transposed; w2t_s: (E, F // 128, D // 128) fp32.
        gate_up: (N_cap, 2F) bf16 saved by the forward (zeros on padding rows); scores_TK: (T, K) fp32.
        layout: the routing layout (block_m 128).
        nonfinite_count: optional (1,) int32 device counter, += the s * h columns whose scale is not finite.
        programs: persistent grid size (default: the SM count).

    Returns:
        dgate_up (N_cap, 2F) bf16 (zeros on padding rows), dscore_part (N_cap, F // 64) fp32, hsT_q (F, N_cap)
        float8_e4m3fn (row stride ``fp8_quant_bwd.transposed_ld(N_cap)``), hsT_s (N_cap // 128, F) fp32. Rows from
        ``layout.offsets[-1]`` on are left unwritten in every output.

    Raises:
        ValueError: an unsupported case (``ws_gemm2_dgrad_fp8_supported``'s reason), a layout with another block_m,
            or an operand of another shape, dtype, layout or device.
    """
    reason = ws_gemm2_dgrad_fp8_supported(dout_q, w2t_q, None, cfg)
    if reason:
        raise ValueError(f"ws_gemm2_dgrad_fp8: {reason}")
    E, F, D = w2t_q.shape
    T, dev, bk = dout_q.shape[0], dout_q.device, cfg.block_k
    K = layout.top_k
    if layout.block_m != cfg.block_m:
        raise ValueError(f"ws_gemm2_dgrad_fp8: layout.block_m={layout.block_m} != cfg.block_m={cfg.block_m} (build "
                         f"the routing layout with block_m {cfg.block_m})")
    n_cap = layout.n_cap
    _check("dout_q", dout_q, (T, D), FP8, dev)
    _check("dout_s", dout_s, (T, D // bk), torch.float32, dev)
    _check("w2t_q", w2t_q, (layout.num_experts, F, D), FP8, dev)
    _check("w2t_s", w2t_s, (E, F // bk, D // bk), torch.float32, dev)
    _check("gate_up", gate_up, (n_cap, 2 * F), torch.bfloat16, dev)
    _check("scores_TK", scores_TK, (T, K), torch.float32, dev)
    if layout.pair_row.shape[0] != T * K:
        raise ValueError(f"ws_gemm2_dgrad_fp8: layout was built for {layout.pair_row.shape[0]} pairs, dout / scores "
                         f"give T*K={T * K}")
    if nonfinite_count is not None:
        _check("nonfinite_count", nonfinite_count, (1,), torch.int32, dev)
    dgu = torch.empty((n_cap, 2 * F), dtype=torch.bfloat16, device=dev)
    part = torch.empty((n_cap, F // cfg.block_n), dtype=torch.float32, device=dev)
    hsT = empty_transposed(F, n_cap, dev)
    hsTs = torch.empty((n_cap // bk, F), dtype=torch.float32, device=dev)
    if layout.n_tiles_cap:
        launch_gemm2_dgrad_fp8(dout_q, dout_s, w2t_q, w2t_s, gate_up, scores_TK, layout, dgu, part, hsT, hsTs,
                               nonfinite_count, cfg, programs)
    return dgu, part, hsT, hsTs


def _check_trace(trace: Tensor, programs: int, dev: torch.device) -> None:
    """The stamps land at trace[program, j, consumer, point]: a smaller tensor would be written out of bounds."""
    ok = (trace.dtype == torch.int64 and trace.dim() == 4 and trace.shape[0] >= programs and trace.shape[1] >= 1
          and tuple(trace.shape[2:]) == (2, 16) and trace.is_contiguous() and trace.device == dev)
    if not ok:
        raise ValueError(f"launch_gemm2_dgrad_fp8: trace must be a contiguous int64 tensor of shape (>= {programs} "
                         f"programs, J >= 1 tiles, 2, 16) on {dev}; got {trace.dtype} {tuple(trace.shape)} on "
                         f"{trace.device}")


def launch_gemm2_dgrad_fp8(dout_q, dout_s, w2t_q, w2t_s, gate_up, scores_TK, layout, dgu, part, hsT, hsTs,
                           nonfinite_count=None, cfg: Fp8WsConfig = GEMM2_DGRAD_FP8_CONFIG,
                           programs: int | None = None, trace: Tensor | None = None) -> None:
    """``ws_gemm2_dgrad_fp8`` without its checks, into the caller's outputs. ``trace``: diagnosis only, an int64
    (programs, J, 2, 16) tensor that receives the global timer (ns) at the points of each consumer's first J tiles
    that ``scripts/bench_ws_gemm.py trace-g2d-fp8`` names."""
    E, F, D = w2t_q.shape
    n_cap, dev = layout.n_cap, dout_q.device
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    w2 = w2t_q.view(E * F, D)
    lo = _desc(w2, (E * F, D), (bn, bk))
    hi = _desc(w2[F // 2:], (E * F - F // 2, D), (bn, bk))  # row e F + 64 n here is row e F + F/2 + 64 n of w2t
    gu_desc = _desc(gate_up, (n_cap, 2 * F), (bm, bn))
    dgu_desc = _desc(dgu, (n_cap, 2 * F), (bm, bn))
    ld = hsT.stride(0)
    hsT_desc = _desc(hsT.as_strided((F, ld), (ld, 1)), (F, ld), (bn, bm // 2))
    num_n = F // bn if cfg.pingpong else F // (2 * bn)  # units per row tile: one 64-column chunk, or two (cooperative)
    programs = _programs(dev, layout.n_tiles_cap * num_n, programs)
    if trace is not None:
        _check_trace(trace, programs, dev)
    check = nonfinite_count is not None
    launch(_gemm2_dgrad_fp8_ws_kernel, (programs,),
           dout_q, dout_s, lo, hi, w2t_s, gu_desc, dgu_desc, hsT_desc, scores_TK, part, hsTs,
           nonfinite_count if check else hsTs, layout.row_pair, layout.tile_expert, layout.offsets, E, D, F,
           layout.top_k, num_n, cfg.group_m, cfg.stages, bm, bk, check, AMAX_EPS, cfg.producer_regs,
           cfg.consumer_regs, trace if trace is not None else hsTs, 0 if trace is None else trace.shape[1],
           cfg.pingpong, num_warps=4, maxnreg=cfg.maxnreg)


def sm90_compile_args_gemm2_dgrad_fp8(cfg: Fp8WsConfig, D: int, F: int, top_k: int = 8,
                                      check: bool = True) -> tuple[dict, dict]:
    """(signature, constexprs) of ``_gemm2_dgrad_fp8_ws_kernel`` for ``sm90_check.compile_sm90`` (CPU build checks)."""
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k

    def desc(block, dtype, name):
        layout = gl.NVMMASharedLayout.get_default_for(block, dtype)
        return f"tensordesc<{name}[{block[0]}, {block[1]}],{layout!r}>"

    fp8 = lambda block: desc(block, gl.float8e4nv, "fp8e4nv")  # noqa: E731
    sig = {"dout_ptr": "*fp8e4nv", "douts_ptr": "*fp32", "w2t_lo_desc": fp8([bn, bk]), "w2t_hi_desc": fp8([bn, bk]),
           "w2ts_ptr": "*fp32", "gu_desc": desc([bm, bn], gl.bfloat16, "bf16"),
           "dgu_desc": desc([bm, bn], gl.bfloat16, "bf16"), "hsT_desc": fp8([bn, bm // 2]), "scores_ptr": "*fp32",
           "part_ptr": "*fp32", "hsTs_ptr": "*fp32", "count_ptr": "*i32", "row_pair_ptr": "*i32",
           "tile_expert_ptr": "*i32", "offsets_ptr": "*i32", "E": "i32", "trace_ptr": "*i64"}
    cx = dict(D=D, F=F, TOPK=top_k, NUM_N=F // bn if cfg.pingpong else F // (2 * bn), GROUP_M=cfg.group_m,
              STAGES=cfg.stages, BM=bm, BK=bk, CHECK=check, EPS=AMAX_EPS, PRODUCER_REGS=cfg.producer_regs,
              CONSUMER_REGS=cfg.consumer_regs, TRACE=0, PINGPONG=cfg.pingpong)
    return sig, cx
