"""GEMM2 dgrad with the SwiGLU backward, warp-specialized in Gluon on a ping-pong schedule (sm_90a).

Why another schedule: the GEMM2 dgrad's epilogue moves more bytes than any other of the layer (it reads gate
and up and writes dgate, dup and s h: 10 bytes per output element against a K = D main loop), and the
cooperative Gluon kernel (``ws_gemm.ws_gemm2_dgrad``, session 11) left it exposed: both consumer warpgroups ran
it while the tensor cores idled (1.11 ms against the Triton kernel's 0.92 at the Qwen3-30B-A3B shape). Here
(CUTLASS's ping-pong order, in our words) each consumer warpgroup owns whole 128 x 128 tiles, alternately:
consumer C takes tiles C, C + 2, ...; the main loops run one after the other (``order`` mbarriers), so one
consumer's epilogue runs under the other's main loop.

* producer (4 warps, shared with the cooperative kernel: ``ws_gemm._g2d_producer``): dout rows gathered by
  cp.async ([128, BK] per stage), w2 tiles [BK, 128] by TMA;
* consumer: a 128 x 128 fp32 accumulator (two m64n128 wgmma per k16 step, 128 registers per thread); the
  epilogue stores it to this consumer's fp32 staging tile in shared memory, then works through it in 64 x 64
  pieces in a blocked layout (what the registers allow beside gate, up and the SwiGLU terms), with the Triton
  kernel's formulas (``grouped_gemm_bwd._gemm2_dgrad_swiglu_bwd_kernel``): g = dout[t] @ w2[e] in fp32,
  dh = s g, dgate = dh up silu'(gate), dup = dh silu(gate), s h, and the d score partial sum of g h over the
  tile's 128 columns (h = bf16(silu(gate) up), as GEMM2 consumed it). Direct global stores (16-byte vectors).

Shared memory: a ring of 5 stages of (128 + 128) x 64 bf16 (160 KB) and one 64 KB fp32 staging tile, handed from
one consumer's epilogue to the other's by an mbarrier (epilogues run in tile order). v1 (session 13) had one staging
tile per consumer and room for 3 stages: bitwise the Triton kernel but 1.46 ms against its 0.91 at the 30B shape.
Why, as far as the numbers go: a stage is 0.4 us of MMA for one consumer, so 3 stages hide ~1.2 us of the dout row
gather's latency, less than a random-row read from HBM takes under load (the cooperative kernel gained 6 % from
4 to 5 stages).
Same contract and preconditions as ``ws_gemm.ws_gemm2_dgrad``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from titan_megamoe.kernels.configs import _sm_count
from titan_megamoe.kernels.launch import launch
from titan_megamoe.kernels.ws_gemm import HAVE_GLUON, WsConfig, _desc

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, warpgroup_mma, warpgroup_mma_wait

    from titan_megamoe.kernels.ws_gemm import _g2d_producer, _num_tiles, _tile_of

__all__ = ["PP_CONFIG", "launch_gemm2_dgrad_pingpong", "pingpong_compile_args"]

#: Ping-pong GEMM2 dgrad: 128 x 128 tiles per consumer, 5 stages beside the 64 KB fp32 staging tile.
PP_CONFIG = WsConfig(block_n=128, stages=5, group_m=1, coop=False, consumer_regs=216, producer_regs=72)


if HAVE_GLUON:

    @gluon.jit
    def _g2p_consumer(gate_up_ptr, scores_ptr, dscore_ptr, dgu_ptr, hs_ptr, row_pair_ptr, offsets_ptr, E, a_bufs,
                      b_bufs, ready_a, ready_b, empty, order, g_smem, g_free, C: gl.constexpr, D: gl.constexpr,
                      F: gl.constexpr, NUM_N: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr):
        BM: gl.constexpr = a_bufs.type.shape[1]
        BK: gl.constexpr = a_bufs.type.shape[2]
        BN: gl.constexpr = b_bufs.type.shape[2]
        KT: gl.constexpr = D // BK
        P: gl.constexpr = 64  # epilogue piece: P x P
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, BN, 16])
        ep: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])  # 16 rows x 64 columns per pass
        row_l: gl.constexpr = gl.SliceLayout(1, ep)
        col_l: gl.constexpr = gl.SliceLayout(0, ep)
        n_live, count = _num_tiles(offsets_ptr, E, BM, NUM_N)
        for j in range(C, count, 2):
            pid_m, pid_n = _tile_of(j, n_live, NUM_N, GROUP_M)
            if j > 0:  # the other consumer has issued tile j - 1's main loop: ours may start
                mbarrier.wait(order.index(C), ((j - 2 + C) // 2) & 1)
            acc = gl.zeros((BM, BN), dtype=gl.float32, layout=mma_layout)
            idx0 = j * KT
            for k in range(KT):
                idx = idx0 + k
                s = idx % STAGES
                ph = (idx // STAGES) & 1
                mbarrier.wait(ready_a.index(s), ph)
                mbarrier.wait(ready_b.index(s), ph)
                fence_async_shared()  # the rows came by cp.async (generic proxy); wgmma reads via the async one
                acc = warpgroup_mma(a_bufs.index(s), b_bufs.index(s), acc, is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
                if k > 0:  # step k - 1's MMA is done: its buffers may be refilled
                    mbarrier.arrive(empty.index((idx - 1) % STAGES), count=1)
            mbarrier.arrive(order.index(1 - C), count=1)  # the other consumer's next main loop may start
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            mbarrier.arrive(empty.index((idx0 + KT - 1) % STAGES), count=1)
            # epilogue (under the other consumer's main loop): g to the staging tile, then P x P pieces. The
            # staging tile is shared: tile j's epilogue waits for tile j - 1's (the other consumer's) to release it.
            if j > 0:
                mbarrier.wait(g_free, (j - 1) & 1)
            g_smem.store(acc)
            row0 = pid_m * BM
            for rp in gl.static_range(BM // P):
                rows = row0 + rp * P + gl.arange(0, P, layout=row_l)
                rows64 = rows.to(gl.int64)
                pair = gl.load(row_pair_ptr + rows)
                ok = pair >= 0
                okf = ok.to(gl.float32)
                vf = gl.expand_dims(okf, 1)
                sc = gl.expand_dims(gl.load(scores_ptr + gl.where(ok, pair, 0)) * okf, 1)
                dscore = gl.zeros([P], dtype=gl.float32, layout=row_l)
                for cp in gl.static_range(BN // P):
                    g = g_smem.slice(rp * P, P, dim=0).slice(cp * P, P, dim=1).load(ep) * vf
                    cols = pid_n * BN + cp * P + gl.arange(0, P, layout=col_l)
                    off = gl.expand_dims(rows64 * (2 * F), 1) + gl.expand_dims(cols, 0)
                    gate = gl.load(gate_up_ptr + off).to(gl.float32) * vf
                    up = gl.load(gate_up_ptr + off + F).to(gl.float32) * vf
                    sig = 1.0 / (1.0 + gl.exp(-gate))
                    silu = gate * sig
                    dscore += gl.sum(g * (silu * up).to(gl.bfloat16).to(gl.float32), axis=1)  # h as GEMM2 used it
                    dh = g * sc
                    gl.store(dgu_ptr + off, (dh * up * (sig * (1.0 + gate * (1.0 - sig)))).to(gl.bfloat16))
                    gl.store(dgu_ptr + off + F, (dh * silu).to(gl.bfloat16))
                    hs_off = gl.expand_dims(rows64 * F, 1) + gl.expand_dims(cols, 0)
                    gl.store(hs_ptr + hs_off, (silu * up * sc).to(gl.bfloat16))
                gl.store(dscore_ptr + rows64 * NUM_N + pid_n, dscore)
            gl.thread_barrier()  # every warp of this consumer has read the staging tile
            mbarrier.arrive(g_free, count=1)

    @gluon.jit
    def _gemm2_dgrad_pp_kernel(dout_ptr, w2_desc, dgu_ptr, hs_ptr, gate_up_ptr, scores_ptr, dscore_ptr, row_pair_ptr,
                               tile_expert_ptr, offsets_ptr, E, D: gl.constexpr, F: gl.constexpr, TOPK: gl.constexpr,
                               NUM_N: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr, BM: gl.constexpr,
                               BK: gl.constexpr, PRODUCER_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr):
        """GEMM2 dgrad + SwiGLU backward, ping-pong (module docstring). Grid: (programs,)."""
        dtype: gl.constexpr = w2_desc.dtype
        BN: gl.constexpr = w2_desc.block_type.shape[1]
        a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, BK], gl.bfloat16)
        g_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, BN], gl.float32)
        a_bufs = gl.allocate_shared_memory(dtype, [STAGES, BM, BK], a_layout)
        b_bufs = gl.allocate_shared_memory(dtype, [STAGES] + w2_desc.block_type.shape, w2_desc.layout)
        g_smem = gl.allocate_shared_memory(gl.float32, [BM, BN], g_layout)
        ready_a = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        ready_b = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        order = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        g_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(g_free, count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(ready_a.index(i), count=128)  # one cp.async arrival per producer thread (4 warps)
            mbarrier.init(ready_b.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)  # one consumer reads each buffer
        for i in gl.static_range(2):
            mbarrier.init(order.index(i), count=1)
        gl.warp_specialize([
            (_g2p_consumer, (gate_up_ptr, scores_ptr, dscore_ptr, dgu_ptr, hs_ptr, row_pair_ptr, offsets_ptr, E,
                             a_bufs, b_bufs, ready_a, ready_b, empty, order, g_smem, g_free, 0, D, F, NUM_N, GROUP_M, STAGES)),
            (_g2p_consumer, (gate_up_ptr, scores_ptr, dscore_ptr, dgu_ptr, hs_ptr, row_pair_ptr, offsets_ptr, E,
                             a_bufs, b_bufs, ready_a, ready_b, empty, order, g_smem, g_free, 1, D, F, NUM_N, GROUP_M, STAGES)),
            (_g2d_producer, (dout_ptr, w2_desc, row_pair_ptr, tile_expert_ptr, offsets_ptr, E, a_bufs, b_bufs,
                             ready_a, ready_b, empty, D, TOPK, NUM_N, GROUP_M, STAGES)),
        ], [4, 4], [CONSUMER_REGS, PRODUCER_REGS])


def launch_gemm2_dgrad_pingpong(dout_TD: Tensor, w2_EDF: Tensor, gate_up_N2F: Tensor, scores_TK: Tensor, layout,
                                dgate_up: Tensor, dscore_part: Tensor, hs: Tensor, cfg: WsConfig = PP_CONFIG,
                                programs: int | None = None):
    """The ping-pong kernel with ``ws_gemm.launch_gemm2_dgrad``'s contract (the caller,
    ``grouped_gemm_bwd.gemm2_dgrad_swiglu_bwd``, has checked operands, outputs and ``ws_gemm2_dgrad_supported``);
    returns (dgate_up, dscore_part)."""
    E, D, F = w2_EDF.shape
    dev = dout_TD.device
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    w2_desc = _desc(w2_EDF, (E * D, F), (bk, bn))
    num_n = F // bn
    if programs is None:
        programs = _sm_count(dev.index if dev.index is not None else torch.cuda.current_device())
    programs = max(1, min(programs, layout.n_tiles_cap * num_n))
    launch(_gemm2_dgrad_pp_kernel, (programs,),
           dout_TD, w2_desc, dgate_up, hs, gate_up_N2F, scores_TK, dscore_part, layout.row_pair, layout.tile_expert,
           layout.offsets, E, D, F, layout.top_k, num_n, cfg.group_m, cfg.stages, bm, bk, cfg.producer_regs,
           cfg.consumer_regs, num_warps=4, maxnreg=cfg.maxnreg)
    return dgate_up, dscore_part


def pingpong_compile_args(D: int, F: int, cfg: WsConfig = PP_CONFIG, top_k: int = 8) -> tuple[dict, dict]:
    """(signature, constexprs) of ``_gemm2_dgrad_pp_kernel`` for ``sm90_check.compile_sm90``."""
    bn, bk = cfg.block_n, cfg.block_k
    layout = gl.NVMMASharedLayout.get_default_for([bk, bn], gl.bfloat16)
    sig = {"dout_ptr": "*bf16", "w2_desc": f"tensordesc<bf16[{bk}, {bn}],{layout!r}>", "dgu_ptr": "*bf16",
           "hs_ptr": "*bf16", "gate_up_ptr": "*bf16", "scores_ptr": "*fp32", "dscore_ptr": "*fp32",
           "row_pair_ptr": "*i32", "tile_expert_ptr": "*i32", "offsets_ptr": "*i32", "E": "i32"}
    cx = dict(D=D, F=F, TOPK=top_k, NUM_N=F // bn, GROUP_M=cfg.group_m, STAGES=cfg.stages, BM=cfg.block_m, BK=bk,
              PRODUCER_REGS=cfg.producer_regs, CONSUMER_REGS=cfg.consumer_regs)
    return sig, cx
