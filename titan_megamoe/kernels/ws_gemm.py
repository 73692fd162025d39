"""Warp-specialized grouped GEMMs for Hopper (sm_90a), written in Gluon: GEMM1 dgrad and GEMM1.

Why: every Triton GEMM of the layer ran at 600-640 TF/s on an H200 against ~790 for cuBLAS's dense
GEMM (docs/NOTES.md, session 9). Triton 3.6 does not warp-specialize Hopper kernels, so a tile's
epilogue (fp32 -> bf16, stores) and the wait for its first operands stall the tensor cores. Gluon, the
explicit-layout front end shipped in the same Triton, has the pieces: ``warp_specialize``, TMA with
mbarriers, asynchronous ``warpgroup_mma``. Design after CUTLASS's Hopper warp-specialized kernels, in our
own words; measurements and the bugs paid for in docs/NOTES.md, session 10.

Structure:

* a producer partition issues the loads of every tile of the program through a ring of ``STAGES``
  operand buffers (``ready`` mbarriers completed by the copies, ``empty`` ones arrived by the consumers
  that read a buffer): one warp issuing TMA for contiguous operands; four warps issuing cp.async for
  gathered token rows (TMA cannot gather rows on Hopper), one ``noinc`` arrival per thread;
* two consumer warpgroups: "cooperative" (both on every tile, half of its rows each: 128 x 256 tiles,
  m64n256 wgmma; the default) or "ping-pong" (tile j to consumer j % 2, main loops serialized by two
  ``order`` mbarriers so one consumer's epilogue runs under the other's main loop; this order also keeps
  every parity wait within one phase of its barrier);
* persistent grid: one program per SM over the live tiles (offsets[E] // BM row tiles x column blocks,
  read on the device), in the grouped order of ``jit.grouped_tile``;
* epilogues mask padding rows by a multiply, never a select on the accumulator: with the select, ptxas
  serializes every wgmma of the kernel (note C7514; ``sm90_check.compile_sm90`` reports it).

Kernels:

* GEMM1 dgrad, dx_rows[r] = dgate[r] @ w1[e] + dup[r] @ w3[e] (the Triton kernel is
  ``grouped_gemm_bwd._gemm1_dgrad_kernel``; same output bit for bit, zeros on padding rows). A = dgate_up
  rows (N_cap, 2F), B = w1 / w3 viewed (E*F, D), both by TMA; the 2F reduction is F / BK steps over
  (dgate, w1) then F / BK over (dup, w3), in the Triton kernel's order.
* GEMM1 forward, gate_up[r] = [x[t] @ w1[e].T | x[t] @ w3[e].T], h[r] = silu(gate) * up (the Triton kernel
  is ``grouped_gemm._gemm1_swiglu_fwd_kernel``; same output bit for bit): x rows gathered by cp.async,
  w1 / w3 tiles by TMA, gate and up accumulated side by side, SwiGLU in the epilogue. Its producer also feeds the
  blockwise-FP8 GEMM1 of ``ws_gemm_fp8.py`` (e4m3 rows, BK = 128: the same 16-byte chunks per thread).

Preconditions (``ws_gemm1_dgrad_supported`` / ``ws_gemm1_fwd_supported``): sm_90 GPU, Triton 3.6 with
Gluon, a K block never straddling two experts' weight rows (F % BK == 0 for the dgrad, F % BN == 0 and
D % BK == 0 for the forward), 16-byte TMA row strides, contiguous tensors, routing layout block 128.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from titan_megamoe.kernels.configs import _sm_count
from titan_megamoe.kernels.jit import env_flag
from titan_megamoe.kernels.launch import launch

try:
    import triton
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
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    HAVE_GLUON = True
except ImportError:  # pragma: no cover - a Triton without Gluon's Hopper API
    HAVE_GLUON = False

__all__ = ["HAVE_GLUON", "CONFIGS", "FWD_CONFIG", "G2D_CONFIG", "G2D_SPLIT_CONFIG", "WsConfig", "sm90_compile_args",
           "ws_gemm1_dgrad", "ws_gemm1_dgrad_supported", "ws_gemm1_fwd", "ws_gemm1_fwd_supported", "ws_gemm2_dgrad",
           "ws_gemm2_dgrad_supported"]


@dataclass(frozen=True, repr=False)  # frozen: CONFIGS / FWD_CONFIG are shared module-level objects
class WsConfig:
    """Tile and pipeline of the warp-specialized kernels.

    Attributes:
        block_m: BM rows per tile (= the routing layout's block_m; one consumer warpgroup holds the
            BM x BN fp32 accumulator: 128 x 128 -> 128 registers per thread).
        block_n: BN output columns per tile.
        block_k: BK reduction step.
        stages: operand buffers in the ring (each (BM + BN) x BK bf16).
        group_m: row tiles per L2 group of the tile order (``jit.grouped_tile``); 0 (bf16 GEMM1 forward and dgrad):
            expert by expert, each expert's row tiles column block by column block (``_tile_in_expert``).
        coop: False: ping-pong, each consumer warpgroup owns whole BM x BN tiles, alternately (one
            tile's epilogue under the other's main loop); True: cooperative, both consumers work on
            every tile, each on BM / 2 of its rows (BN = 256 fits: 64 x 256 fp32 = 128 registers per
            thread; wider tiles, half the operand traffic per FLOP of 128 x 128, epilogue exposed).
        maxnreg: register cap of the launch: 12 warps (two consumer warpgroups and the producer's
            warpgroup) x 32 threads x 168 = 64512 of the SM's 65536; the producer gets 40 per thread,
            the consumers the rest (232 each).
        producer_regs, consumer_regs: registers per thread of the producer partition and of each consumer
            warpgroup (``setmaxnreg``), within ``maxnreg``'s budget.
        split_n: cooperative GEMM1 dgrad only: each consumer's BM / 2 x BN accumulator as two BN / 2-column
            halves (two MMAs per K step, on B tiles loaded as two halves) stored through one BM / 2 x BN / 2
            staging tile, so the epilogue takes half the shared memory and the ring a fourth stage.
        skip_empty: opt-in (or ``SKIP_PAD_BLOCKS``), cooperative kernels (bf16 GEMM1 forward and dgrad): a consumer
            whose BM / 2 rows of a tile are all padding (an expert's last tile with at most BM / 2 rows: about half
            the experts, ~2.9 % of the rows at 1,024 rows per expert) issues no MMA for it: it waits for and
            releases the tile's buffers and stores zeros, which its MMAs on the zero-weighted padding rows would
            have given (bitwise the same outputs).
        dynamic: opt-in (or ``GEMM1_DYNAMIC``), cooperative bf16 GEMM1 forward and dgrad: the persistent programs take
            their tiles in order from a per-launch atomic counter instead of grid-strided (``_take_tile``), so the
            tiles in flight stay within a few experts however the programs drift.
    """

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    stages: int = 4
    group_m: int = 8
    coop: bool = False
    maxnreg: int = 168
    producer_regs: int = 40
    consumer_regs: int = 232
    split_n: bool = False
    skip_empty: bool = False
    dynamic: bool = False

    def smem_bytes(self) -> int:
        """Shared memory of the operand ring and the two epilogue tiles (bf16)."""
        epilogue = self.block_m * self.block_n * (1 if self.coop else 2) // (2 if self.split_n else 1)
        return 2 * (self.stages * (self.block_m + self.block_n) * self.block_k + epilogue)

    def __repr__(self) -> str:
        return (f"WsConfig(BM={self.block_m}, BN={self.block_n}, BK={self.block_k}, stages={self.stages}, "
                f"group_m={self.group_m}, {'coop' if self.coop else 'pingpong'}{', split_n' if self.split_n else ''}"
                f"{', dynamic' if self.dynamic else ''}, maxnreg={self.maxnreg})")


#: TITAN_MEGAMOE_SKIP_PAD_BLOCKS=1 (read at import): ``skip_empty`` (here) and ``trim_k`` (``ws_wgrad``) on in every
#: launch. Opt-in until the skips have run on a GPU (built and checked on the CPU only, docs/NOTES.md session 29).
SKIP_PAD_BLOCKS = env_flag("TITAN_MEGAMOE_SKIP_PAD_BLOCKS", False)
#: TITAN_MEGAMOE_WS_GEMM1_GRID=1 (read at import): the cooperative bf16 GEMM1 forward and dgrad launch one program per
#: tile, not one per SM. Why try it: persistent programs walk their tiles grid-strided and drift apart, so the tiles
#: in flight may span more experts' weights than L2 holds (the 235B dgrad read ~11 GB from DRAM for 5.1 GB of
#: operands, docs/NOTES.md session 27); the hardware starts a grid's programs in order as SMs free up. Cost: a tile's
#: barrier set-up and first loads no longer run under the previous tile's epilogue. Opt-in until measured.
GEMM1_GRID = env_flag("TITAN_MEGAMOE_WS_GEMM1_GRID", False)
#: The bf16 GEMM1 forward and dgrad walk their tiles expert by expert, column block by column block (``group_m`` 0):
#: the tiles reading one weight tile run back to back, so one expert's weights need not stay in L2 across a whole wave
#: (same aim as GEMM1_GRID). On by default (``TITAN_MEGAMOE_WS_GEMM1_EXPERT_ORDER=0``: the configs' group_m; read at
#: import) since session 32 (one H100, bitwise the default order in the GPU tests): 235B dgrad 5.93 -> 4.83 ms,
#: forward 5.91 -> 5.37 (ab_kernels_1xh100_s32a_20261207.json); 30B within 1 %; 235B layer fwd+bwd 26.68 -> 25.58 ms
#: (layer_1xh100_ep1_235b_s32b_20261207.json).
GEMM1_EXPERT_ORDER = env_flag("TITAN_MEGAMOE_WS_GEMM1_EXPERT_ORDER", True)
#: TITAN_MEGAMOE_WS_GEMM1_DYNAMIC=1 (read at import): the cooperative bf16 GEMM1 forward and dgrad stay persistent
#: (one program per SM) but take their tiles in order from a per-launch atomic counter, as a grid's programs start
#: (GEMM1_GRID's order without its per-tile launch cost: the next tile's loads still run under the epilogue). The
#: producer takes the ticket and hands it to both consumers through a 2-slot shared-memory ring. Disabled
#: (``DYNAMIC_FENCED``: no gain measured); asking for it raises.
GEMM1_DYNAMIC = env_flag("TITAN_MEGAMOE_WS_GEMM1_DYNAMIC", False)

DEFAULT = WsConfig()
#: The configs ``grouped_gemm_bwd.gemm1_dgrad`` picks by ``TITAN_MEGAMOE_WS_GEMM1_DGRAD``. Measured on one H200
#: (scripts/bench_ws_gemm.py bench, do_bench, 16384 tokens, top-8, 128 experts; every variant bitwise equal to
#: the Triton kernel; benchmarks/results/bench_ws_gemm_s10b_1xh200_20261202.json), ms at the 30B / 235B shapes:
#: Triton GEMM1 dgrad 1.535 / 5.789; ping-pong 128 x 128, 4 stages 1.403 / 5.513 (5 stages 1.355 / 5.648);
#: cooperative 128 x 256, 3 stages, group_m 1 1.256 / 5.324 (group_m 8: 1.327 / 5.324; 128 x 128, 5 stages:
#: 1.388 / 5.437). The 128 x 128 tiles of ping-pong read twice the operand bytes per FLOP of 128 x 256.
CONFIGS = {"pingpong": WsConfig(block_n=128, stages=4, group_m=8),
           "coop": WsConfig(block_n=256, stages=3, group_m=1, coop=True),
           "split": WsConfig(block_n=256, stages=4, group_m=1, coop=True, split_n=True)}


if HAVE_GLUON:

    @gluon.jit
    def _grouped_tile(tile, n_live, NUM_N: gl.constexpr, GROUP_M: gl.constexpr):
        """(row tile, column block) of linear tile index ``tile`` in the grouped order (``jit.grouped_tile``)."""
        width = GROUP_M * NUM_N
        first_m = (tile // width) * GROUP_M
        group = gl.minimum(n_live - first_m, GROUP_M)
        return first_m + (tile % width) % group, (tile % width) // group

    @gluon.jit
    def _tile_of(j, n_live, NUM_N: gl.constexpr, GROUP_M: gl.constexpr):
        """(row tile, column block) of the program's j-th tile (grid-strided, grouped order)."""
        return _grouped_tile(gl.program_id(0) + j * gl.num_programs(0), n_live, NUM_N, GROUP_M)

    @gluon.jit
    def _tile_coords(tile, n_live, tile_expert_ptr, offsets_ptr, BM: gl.constexpr, NUM_N: gl.constexpr,
                     GROUP_M: gl.constexpr):
        """(row tile, column block) of linear tile index ``tile``: with GROUP_M 0 expert by expert and in each expert
        column block by column block (the row tiles that read one weight tile come back to back; in row order they
        are NUM_N tiles apart, and the drift of persistent programs can spread one expert's weight reads over two
        waves), else the grouped order of ``_grouped_tile``."""
        if GROUP_M == 0:
            e = gl.load(tile_expert_ptr + tile // NUM_N)  # tile // NUM_N is a row tile of the expert (BM-aligned)
            first = gl.load(offsets_ptr + e) // BM
            rows = gl.load(offsets_ptr + e + 1) // BM - first
            local = tile - first * NUM_N
            pid_m = first + local % rows
            pid_n = local // rows
        else:
            pid_m, pid_n = _grouped_tile(tile, n_live, NUM_N, GROUP_M)
        return pid_m, pid_n

    @gluon.jit
    def _tile_in_expert(j, n_live, tile_expert_ptr, offsets_ptr, BM: gl.constexpr, NUM_N: gl.constexpr,
                        GROUP_M: gl.constexpr):
        """``_tile_coords`` of the program's j-th tile, grid-strided."""
        return _tile_coords(gl.program_id(0) + j * gl.num_programs(0), n_live, tile_expert_ptr, offsets_ptr, BM, NUM_N,
                            GROUP_M)

    @gluon.jit
    def _take_tile(counter_ptr, total):
        """The launch's next linear tile index, in order (``GEMM1_DYNAMIC``); >= total: none left. Every program takes
        exactly one index >= total, so the one that takes total + programs - 1 is the counter's last user: it zeroes
        the counter for the next launch (no memset launch, CUDA-graph safe).

        Every thread of the partition issues the atomic (thread 0 adds 1, the others 0) and the ticket is thread 0's
        old value, summed across the partition: no predicated atomic and no shared-memory broadcast. A scalar
        ``atomic_add`` (session 31's form) is issued by lane 0 alone and broadcast through shared memory; ptxas
        expanded that predicated atomic into a branch with no reconvergence before the broadcast's load (the
        ``bar.warp.sync`` between became a NOP; sm_90a SASS of the first take, docs/NOTES.md session 33), so the
        other lanes could read the slot before lane 0 wrote its ticket: the likely cause of the hang."""
        NW: gl.constexpr = gl.num_warps()
        i = gl.arange(0, 32 * NW, layout=gl.BlockedLayout([1], [32], [NW], [0]))
        old = gl.atomic_add(counter_ptr + i * 0, (i == 0).to(gl.int32), sem="relaxed")
        t = gl.sum(gl.where(i == 0, old, 0), axis=0)
        if t == total + gl.num_programs(0) - 1:
            gl.store(counter_ptr, 0)
        return t

    @gluon.jit
    def _post_tile(tiles, tile_ready, tile_empty, j, t):
        """Producer: hand the program's j-th tile index ``t`` (-1: no more) to both consumers through a 2-slot ring."""
        s = j % 2
        mbarrier.wait(tile_empty.index(s), ((j // 2) & 1) ^ 1)  # first pass: free
        tiles.index(s).store(gl.full([1], t, gl.int32, gl.BlockedLayout([1], [32], [gl.num_warps()], [0])))
        mbarrier.arrive(tile_ready.index(s), count=1)

    @gluon.jit
    def _wait_tile(tiles, tile_ready, tile_empty, j):
        """Consumer: the program's j-th tile index from ``_post_tile`` (-1: no more)."""
        s = j % 2
        mbarrier.wait(tile_ready.index(s), (j // 2) & 1)
        t = gl.max(tiles.index(s).load(gl.BlockedLayout([1], [32], [gl.num_warps()], [0])), axis=0)
        mbarrier.arrive(tile_empty.index(s), count=1)
        return t

    @gluon.jit
    def _tile_ring(DYNAMIC: gl.constexpr, unused):
        """(tile slots, tile_ready, tile_empty) of the 2-slot ring of ``_post_tile`` / ``_wait_tile`` (DYNAMIC), else
        ``unused`` three times (a static schedule allocates nothing)."""
        if DYNAMIC:
            tiles = gl.allocate_shared_memory(gl.int32, [2, 1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
            tile_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
            tile_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
            for i in gl.static_range(2):
                mbarrier.init(tile_ready.index(i), count=1)
                mbarrier.init(tile_empty.index(i), count=2)  # both consumers read every slot
            return tiles, tile_ready, tile_empty
        else:
            return unused, unused, unused

    @gluon.jit
    def _rows_live(row_pair_ptr, row0, SKIP_EMPTY: gl.constexpr):
        """False if the consumer's rows from ``row0`` are all padding (SKIP_EMPTY; an expert's valid rows are a
        prefix of its rows, so the first row tells), else True."""
        if SKIP_EMPTY:
            return gl.load(row_pair_ptr + row0) >= 0
        else:
            return True

    @gluon.jit
    def _release_steps(ready, empty, idx0, KT: gl.constexpr, STAGES: gl.constexpr):
        """A consumer that skips a tile's MMAs: wait for each of its KT ring steps and release it at once."""
        for k in range(KT):
            idx = idx0 + k
            mbarrier.wait(ready.index(idx % STAGES), (idx // STAGES) & 1)
            mbarrier.arrive(empty.index(idx % STAGES), count=1)

    @gluon.jit
    def _num_tiles(offsets_ptr, E, BM: gl.constexpr, NUM_N: gl.constexpr):
        """(live row tiles, this program's tile count)."""
        n_live = gl.load(offsets_ptr + E) // BM
        total = n_live * NUM_N
        pid = gl.program_id(0)
        nprog = gl.num_programs(0)
        return n_live, gl.maximum(total - pid + nprog - 1, 0) // nprog

    @gluon.jit
    def _gathered_rows(src_ptr, row_pair_ptr, pid_m, D: gl.constexpr, TOPK: gl.constexpr, BM: gl.constexpr,
                       BK: gl.constexpr):
        """(pointers, mask) of the first BK columns of row tile ``pid_m``'s token rows of ``src`` (T, D), for a
        4-warp cp.async producer: row r holds src[row_pair[r] // TOPK], padding rows (pair -1) masked. 16-byte
        chunks, 8 threads per row (BK = 64 bf16 or BK = 128 e4m3: BK / 8 elements of 16 bytes per thread), 4
        rows per warp x 4 warps."""
        gather: gl.constexpr = gl.BlockedLayout([1, BK // 8], [4, 8], [4, 1], [1, 0])
        pair = gl.load(row_pair_ptr + pid_m * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, gather)))
        ok = pair >= 0
        tok = gl.where(ok, pair // TOPK, 0).to(gl.int64)  # int64: token * D overflows int32 for large token counts
        cols = gl.arange(0, BK, layout=gl.SliceLayout(0, gather))
        ptrs = src_ptr + gl.expand_dims(tok * D, 1) + gl.expand_dims(cols, 0)
        return ptrs, gl.expand_dims(ok, 1) & gl.expand_dims(cols < BK, 0)

    @gluon.jit
    def _g1d_load_tile(a_desc, w1_desc, w3_desc, tile_expert_ptr, a_bufs, b_bufs, ready, empty, pid_m, pid_n, idx,
                       F: gl.constexpr, STAGES: gl.constexpr, SPLIT: gl.constexpr):
        """Producer: issue the TMA loads of one tile's 2F / BK ring steps from ring step ``idx``; returns the next."""
        BM: gl.constexpr = a_desc.block_type.shape[0]
        BK: gl.constexpr = a_desc.block_type.shape[1]
        BH: gl.constexpr = w1_desc.block_type.shape[1]
        NB: gl.constexpr = 2 if SPLIT else 1
        BN: gl.constexpr = NB * BH
        KH: gl.constexpr = F // BK  # steps per half (dgate x w1, then dup x w3)
        nbytes: gl.constexpr = a_desc.block_type.nbytes + NB * w1_desc.block_type.nbytes
        e = gl.load(tile_expert_ptr + pid_m)
        row0 = pid_m * BM
        col0 = pid_n * BN
        for half in gl.static_range(2):
            for k in range(KH):
                s = idx % STAGES
                mbarrier.wait(empty.index(s), ((idx // STAGES) & 1) ^ 1)  # first pass: free
                bar = ready.index(s)
                mbarrier.expect(bar, nbytes)
                tma.async_copy_global_to_shared(a_desc, [row0, half * F + k * BK], bar, a_bufs.index(s))
                for q in gl.static_range(NB):
                    if half == 0:
                        tma.async_copy_global_to_shared(w1_desc, [e * F + k * BK, col0 + q * BH], bar,
                                                        b_bufs.index(NB * s + q))
                    else:
                        tma.async_copy_global_to_shared(w3_desc, [e * F + k * BK, col0 + q * BH], bar,
                                                        b_bufs.index(NB * s + q))
                idx += 1
        return idx

    @gluon.jit
    def _g1d_producer(a_desc, w1_desc, w3_desc, tile_expert_ptr, offsets_ptr, counter_ptr, E, a_bufs, b_bufs, ready,
                      empty, tiles, tile_ready, tile_empty, F: gl.constexpr, NUM_N: gl.constexpr,
                      GROUP_M: gl.constexpr, STAGES: gl.constexpr, SPLIT: gl.constexpr, DYNAMIC: gl.constexpr):
        # SPLIT: B tiles as two column halves, b_bufs[2 s] and b_bufs[2 s + 1] (WsConfig.split_n). DYNAMIC: tiles
        # taken in order from the launch's counter and handed to the consumers (GEMM1_DYNAMIC), else grid-strided.
        BM: gl.constexpr = a_desc.block_type.shape[0]
        n_live, count = _num_tiles(offsets_ptr, E, BM, NUM_N)
        idx = 0
        if DYNAMIC:
            total = n_live * NUM_N
            j = 0
            t = _take_tile(counter_ptr, total)
            while t < total:
                _post_tile(tiles, tile_ready, tile_empty, j, t)
                pid_m, pid_n = _tile_coords(t, n_live, tile_expert_ptr, offsets_ptr, BM, NUM_N, GROUP_M)
                idx = _g1d_load_tile(a_desc, w1_desc, w3_desc, tile_expert_ptr, a_bufs, b_bufs, ready, empty, pid_m,
                                     pid_n, idx, F, STAGES, SPLIT)
                j += 1
                t = _take_tile(counter_ptr, total)
            _post_tile(tiles, tile_ready, tile_empty, j, -1)
        else:
            for j in range(count):
                pid_m, pid_n = _tile_in_expert(j, n_live, tile_expert_ptr, offsets_ptr, BM, NUM_N, GROUP_M)
                idx = _g1d_load_tile(a_desc, w1_desc, w3_desc, tile_expert_ptr, a_bufs, b_bufs, ready, empty, pid_m,
                                     pid_n, idx, F, STAGES, SPLIT)

    @gluon.jit
    def _store_halves(lo, hi, desc, c_smem, row0, col0):
        """Two fp32 (rows, W) halves of a tile as bf16 at columns col0 and col0 + W of ``desc``'s tensor, through one
        (rows, W) staging tile: TMA store, wait until it has read the tile, second half (bf16 and FP8 GEMM1 dgrads)."""
        W: gl.constexpr = c_smem.type.shape[1]
        tma.store_wait(pendings=0)  # the previous store has read c_smem
        c_smem.store(lo.to(gl.bfloat16))
        fence_async_shared()
        tma.async_copy_shared_to_global(desc, [row0, col0], c_smem)
        tma.store_wait(pendings=0)
        c_smem.store(hi.to(gl.bfloat16))
        fence_async_shared()
        tma.async_copy_shared_to_global(desc, [row0, col0 + W], c_smem)

    @gluon.jit
    def _g1d_split_tile(dx_desc, row_pair_ptr, a_bufs, b_bufs, ready, empty, c_smem, j, pid_m, pid_n, C: gl.constexpr,
                        F: gl.constexpr, STAGES: gl.constexpr, SKIP_EMPTY: gl.constexpr):
        # cooperative, the tile's BN columns as two BH halves (WsConfig.split_n): both MMAs of a K step in flight,
        # one BMC x BH staging tile for the two stores
        BMC: gl.constexpr = dx_desc.block_type.shape[0]
        BH: gl.constexpr = dx_desc.block_type.shape[1]
        BM: gl.constexpr = a_bufs.type.shape[1]
        BK: gl.constexpr = a_bufs.type.shape[2]
        KT: gl.constexpr = 2 * F // BK
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, BH, 16])
        row_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
        acc_lo = gl.zeros((BMC, BH), dtype=gl.float32, layout=mma_layout)
        acc_hi = gl.zeros((BMC, BH), dtype=gl.float32, layout=mma_layout)
        idx0 = j * KT
        row0 = pid_m * BM + C * BMC
        if _rows_live(row_pair_ptr, row0, SKIP_EMPTY):
            for k in range(KT):
                idx = idx0 + k
                s = idx % STAGES
                mbarrier.wait(ready.index(s), (idx // STAGES) & 1)
                a = a_bufs.index(s).slice(C * BMC, BMC, dim=0)
                acc_lo = warpgroup_mma(a, b_bufs.index(2 * s), acc_lo, is_async=True)
                acc_hi = warpgroup_mma(a, b_bufs.index(2 * s + 1), acc_hi, is_async=True)
                acc_lo, acc_hi = warpgroup_mma_wait(num_outstanding=2, deps=(acc_lo, acc_hi))
                if k > 0:  # step k - 1's MMAs are done: its buffers may be refilled
                    mbarrier.arrive(empty.index((idx - 1) % STAGES), count=1)
            acc_lo, acc_hi = warpgroup_mma_wait(num_outstanding=0, deps=(acc_lo, acc_hi))
            mbarrier.arrive(empty.index((idx0 + KT - 1) % STAGES), count=1)
        else:  # all padding rows (WsConfig.skip_empty): no MMA, zeros stored
            _release_steps(ready, empty, idx0, KT, STAGES)
        # epilogue: zeros on padding rows (a multiply: see _g1d_tile), bf16, one TMA store per half
        vf = gl.expand_dims((gl.load(row_pair_ptr + row0 + gl.arange(0, BMC, layout=row_layout)) >= 0)
                            .to(gl.float32), 1)
        _store_halves(acc_lo * vf, acc_hi * vf, dx_desc, c_smem, row0, pid_n * 2 * BH)

    @gluon.jit
    def _g1d_tile(dx_desc, row_pair_ptr, a_bufs, b_bufs, ready, empty, order, c_smem, j, pid_m, pid_n,
                  C: gl.constexpr, F: gl.constexpr, STAGES: gl.constexpr, COOP: gl.constexpr,
                  SKIP_EMPTY: gl.constexpr):
        # ping-pong (COOP False): consumer C takes tiles C, C + 2, ..., the whole BM x BN tile each.
        # cooperative (COOP True): both consumers take every tile, C the rows [C * BM / 2, (C + 1) * BM / 2).
        BMC: gl.constexpr = dx_desc.block_type.shape[0]  # rows this consumer owns in a tile
        BN: gl.constexpr = dx_desc.block_type.shape[1]
        BM: gl.constexpr = a_bufs.type.shape[1]
        BK: gl.constexpr = a_bufs.type.shape[2]
        KT: gl.constexpr = 2 * F // BK
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, BN, 16])
        row_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
        m_off: gl.constexpr = C * BMC if COOP else 0
        if not COOP:
            if j > 0:  # the other consumer has issued tile j - 1's main loop: ours may start
                mbarrier.wait(order.index(C), ((j - 2 + C) // 2) & 1)
        acc = gl.zeros((BMC, BN), dtype=gl.float32, layout=mma_layout)
        idx0 = j * KT
        row0 = pid_m * BM + m_off
        if _rows_live(row_pair_ptr, row0, COOP and SKIP_EMPTY):
            for k in range(KT):
                idx = idx0 + k
                s = idx % STAGES
                mbarrier.wait(ready.index(s), (idx // STAGES) & 1)
                a = a_bufs.index(s)
                if COOP:
                    a = a.slice(m_off, BMC, dim=0)
                acc = warpgroup_mma(a, b_bufs.index(s), acc, is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
                if k > 0:  # step k - 1's MMA is done: its buffers may be refilled
                    mbarrier.arrive(empty.index((idx - 1) % STAGES), count=1)
            if not COOP:
                mbarrier.arrive(order.index(1 - C), count=1)  # the other consumer's next main loop may start
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            mbarrier.arrive(empty.index((idx0 + KT - 1) % STAGES), count=1)
        else:  # cooperative, all padding rows (WsConfig.skip_empty): no MMA, zeros stored
            _release_steps(ready, empty, idx0, KT, STAGES)
        # epilogue (ping-pong: under the other consumer's main loop): zeros on padding rows, bf16,
        # TMA store. The mask is a multiply, not a select: with a select on the accumulator, ptxas
        # serializes every wgmma of the kernel (C7514, checked with ptxas -v).
        valid = gl.load(row_pair_ptr + row0 + gl.arange(0, BMC, layout=row_layout)) >= 0
        out = (acc * gl.expand_dims(valid.to(gl.float32), 1)).to(gl.bfloat16)
        tma.store_wait(pendings=0)  # the previous tile's store has read c_smem
        c_smem.store(out)
        fence_async_shared()
        tma.async_copy_shared_to_global(dx_desc, [row0, pid_n * BN], c_smem)

    @gluon.jit
    def _g1d_any_tile(dx_desc, row_pair_ptr, a_bufs, b_bufs, ready, empty, order, c_smem, j, pid_m, pid_n,
                      C: gl.constexpr, F: gl.constexpr, STAGES: gl.constexpr, COOP: gl.constexpr,
                      SKIP_EMPTY: gl.constexpr, SPLIT: gl.constexpr):
        # one tile of consumer C by _g1d_split_tile (SPLIT) or _g1d_tile
        if SPLIT:
            _g1d_split_tile(dx_desc, row_pair_ptr, a_bufs, b_bufs, ready, empty, c_smem, j, pid_m, pid_n, C, F, STAGES,
                            SKIP_EMPTY)
        else:
            _g1d_tile(dx_desc, row_pair_ptr, a_bufs, b_bufs, ready, empty, order, c_smem, j, pid_m, pid_n, C, F, STAGES,
                      COOP, SKIP_EMPTY)

    @gluon.jit
    def _g1d_consumer(dx_desc, row_pair_ptr, tile_expert_ptr, offsets_ptr, E, a_bufs, b_bufs, ready, empty, order,
                      tiles, tile_ready, tile_empty, c_smem, C: gl.constexpr, F: gl.constexpr, NUM_N: gl.constexpr,
                      GROUP_M: gl.constexpr, STAGES: gl.constexpr, COOP: gl.constexpr, SKIP_EMPTY: gl.constexpr,
                      SPLIT: gl.constexpr, DYNAMIC: gl.constexpr):
        # the tiles of consumer C: grid-strided (ping-pong: every other one), or (DYNAMIC, cooperative only) as
        # the producer hands them over; each by _g1d_any_tile
        BM: gl.constexpr = a_bufs.type.shape[1]
        n_live, count = _num_tiles(offsets_ptr, E, BM, NUM_N)
        if DYNAMIC:
            gl.static_assert(COOP, "dynamic tile scheduling needs the cooperative schedule")
            j = 0
            t = _wait_tile(tiles, tile_ready, tile_empty, 0)
            while t >= 0:
                pid_m, pid_n = _tile_coords(t, n_live, tile_expert_ptr, offsets_ptr, BM, NUM_N, GROUP_M)
                _g1d_any_tile(dx_desc, row_pair_ptr, a_bufs, b_bufs, ready, empty, order, c_smem, j, pid_m, pid_n, C, F,
                              STAGES, COOP, SKIP_EMPTY, SPLIT)
                j += 1
                t = _wait_tile(tiles, tile_ready, tile_empty, j)
        else:
            first: gl.constexpr = 0 if COOP else C
            step: gl.constexpr = 1 if COOP else 2
            for j in range(first, count, step):
                pid_m, pid_n = _tile_in_expert(j, n_live, tile_expert_ptr, offsets_ptr, BM, NUM_N, GROUP_M)
                _g1d_any_tile(dx_desc, row_pair_ptr, a_bufs, b_bufs, ready, empty, order, c_smem, j, pid_m, pid_n, C, F,
                              STAGES, COOP, SKIP_EMPTY, SPLIT)
        tma.store_wait(pendings=0)

    @gluon.jit
    def _gemm1_dgrad_ws_kernel(a_desc, w1_desc, w3_desc, dx_desc, row_pair_ptr, tile_expert_ptr, offsets_ptr,
                               counter_ptr, E, F: gl.constexpr, NUM_N: gl.constexpr, GROUP_M: gl.constexpr,
                               STAGES: gl.constexpr, COOP: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                               CONSUMER_REGS: gl.constexpr, SPLIT: gl.constexpr = False,
                               SKIP_EMPTY: gl.constexpr = False, DYNAMIC: gl.constexpr = False):
        """dx_rows = [dgate | dup] @ [w1[e]; w3[e]] per row tile (module docstring). Grid: (programs,). SPLIT
        (cooperative only, ``WsConfig.split_n``): w1_desc / w3_desc / dx_desc have half the tile's columns. DYNAMIC
        (cooperative only, ``GEMM1_DYNAMIC``): tiles in order from the int32 counter at ``counter_ptr`` (zero
        before the launch, zero again after it), else ``counter_ptr`` is not read."""
        dtype: gl.constexpr = a_desc.dtype
        NB: gl.constexpr = 2 if SPLIT else 1
        a_bufs = gl.allocate_shared_memory(dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
        b_bufs = gl.allocate_shared_memory(dtype, [NB * STAGES] + w1_desc.block_type.shape, w1_desc.layout)
        c0 = gl.allocate_shared_memory(dtype, dx_desc.block_type.shape, dx_desc.layout)
        c1 = gl.allocate_shared_memory(dtype, dx_desc.block_type.shape, dx_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        order = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2 if COOP else 1)  # COOP: both consumers read every buffer
        for i in gl.static_range(2):
            mbarrier.init(order.index(i), count=1)
        tiles, tile_ready, tile_empty = _tile_ring(DYNAMIC, order)
        gl.warp_specialize([
            (_g1d_consumer, (dx_desc, row_pair_ptr, tile_expert_ptr, offsets_ptr, E, a_bufs, b_bufs, ready, empty,
                             order, tiles, tile_ready, tile_empty, c0, 0, F, NUM_N, GROUP_M, STAGES, COOP, SKIP_EMPTY,
                             SPLIT, DYNAMIC)),
            (_g1d_consumer, (dx_desc, row_pair_ptr, tile_expert_ptr, offsets_ptr, E, a_bufs, b_bufs, ready, empty,
                             order, tiles, tile_ready, tile_empty, c1, 1, F, NUM_N, GROUP_M, STAGES, COOP, SKIP_EMPTY,
                             SPLIT, DYNAMIC)),
            (_g1d_producer, (a_desc, w1_desc, w3_desc, tile_expert_ptr, offsets_ptr, counter_ptr, E, a_bufs, b_bufs,
                             ready, empty, tiles, tile_ready, tile_empty, F, NUM_N, GROUP_M, STAGES, SPLIT, DYNAMIC)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


    # ---------------------------------------------------------------------------------------------
    # GEMM1 forward: gathered x rows (cp.async, 4 producer warps) x w1 / w3 (TMA), SwiGLU epilogue
    # ---------------------------------------------------------------------------------------------

    @gluon.jit
    def _g1f_load_tile(x_ptr, w1_desc, w3_desc, row_pair_ptr, tile_expert_ptr, a_bufs, b1_bufs, b3_bufs, ready_a,
                       ready_b, empty, pid_m, pid_n, idx, D: gl.constexpr, F: gl.constexpr, TOPK: gl.constexpr,
                       STAGES: gl.constexpr):
        """Producer (4 warps): one tile's D / BK ring steps from ring step ``idx`` (x rows by cp.async, w1 / w3 tiles
        by TMA); returns the next step."""
        BM: gl.constexpr = a_bufs.type.shape[1]
        BK: gl.constexpr = a_bufs.type.shape[2]
        BN: gl.constexpr = w1_desc.block_type.shape[0]
        KT: gl.constexpr = D // BK
        nbytes: gl.constexpr = 2 * w1_desc.block_type.nbytes
        e = gl.load(tile_expert_ptr + pid_m)
        ptrs, mask = _gathered_rows(x_ptr, row_pair_ptr, pid_m, D, TOPK, BM, BK)
        w_row = e * F + pid_n * BN
        for k in range(KT):
            s = idx % STAGES
            mbarrier.wait(empty.index(s), ((idx // STAGES) & 1) ^ 1)
            # padding rows (pair -1) are masked: cp.async zero-fills them
            async_copy.async_copy_global_to_shared(a_bufs.index(s), ptrs + k * BK, mask=mask)
            async_copy.mbarrier_arrive(ready_a.index(s), increment_count=False)  # one arrival per thread
            bar = ready_b.index(s)
            mbarrier.expect(bar, nbytes)
            tma.async_copy_global_to_shared(w1_desc, [w_row, k * BK], bar, b1_bufs.index(s))
            tma.async_copy_global_to_shared(w3_desc, [w_row, k * BK], bar, b3_bufs.index(s))
            idx += 1
        return idx

    @gluon.jit
    def _g1f_producer(x_ptr, w1_desc, w3_desc, row_pair_ptr, tile_expert_ptr, offsets_ptr, E, a_bufs, b1_bufs,
                      b3_bufs, ready_a, ready_b, empty, D: gl.constexpr, F: gl.constexpr, TOPK: gl.constexpr,
                      NUM_N: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr):
        BM: gl.constexpr = a_bufs.type.shape[1]
        n_live, count = _num_tiles(offsets_ptr, E, BM, NUM_N)
        idx = 0
        for j in range(count):
            pid_m, pid_n = _tile_in_expert(j, n_live, tile_expert_ptr, offsets_ptr, BM, NUM_N, GROUP_M)
            idx = _g1f_load_tile(x_ptr, w1_desc, w3_desc, row_pair_ptr, tile_expert_ptr, a_bufs, b1_bufs, b3_bufs,
                                 ready_a, ready_b, empty, pid_m, pid_n, idx, D, F, TOPK, STAGES)

    @gluon.jit
    def _g1f_producer_dynamic(x_ptr, w1_desc, w3_desc, row_pair_ptr, tile_expert_ptr, offsets_ptr, counter_ptr, E,
                              a_bufs, b1_bufs, b3_bufs, ready_a, ready_b, empty, tiles, tile_ready, tile_empty,
                              D: gl.constexpr, F: gl.constexpr, TOPK: gl.constexpr, NUM_N: gl.constexpr,
                              GROUP_M: gl.constexpr, STAGES: gl.constexpr):
        # _g1f_producer with tiles taken in order from the launch's counter and handed to the consumers
        BM: gl.constexpr = a_bufs.type.shape[1]
        n_live, count = _num_tiles(offsets_ptr, E, BM, NUM_N)
        total = n_live * NUM_N
        idx = 0
        j = 0
        t = _take_tile(counter_ptr, total)
        while t < total:
            _post_tile(tiles, tile_ready, tile_empty, j, t)
            pid_m, pid_n = _tile_coords(t, n_live, tile_expert_ptr, offsets_ptr, BM, NUM_N, GROUP_M)
            idx = _g1f_load_tile(x_ptr, w1_desc, w3_desc, row_pair_ptr, tile_expert_ptr, a_bufs, b1_bufs, b3_bufs,
                                 ready_a, ready_b, empty, pid_m, pid_n, idx, D, F, TOPK, STAGES)
            j += 1
            t = _take_tile(counter_ptr, total)
        _post_tile(tiles, tile_ready, tile_empty, j, -1)

    @gluon.jit
    def _staged_store(t, desc, c_smem, row, col):
        """t as bf16 to desc[row, col] by TMA through the staging tile c_smem, once its previous store has read it."""
        tma.store_wait(pendings=0)
        c_smem.store(t.to(gl.bfloat16))
        fence_async_shared()
        tma.async_copy_shared_to_global(desc, [row, col], c_smem)

    @gluon.jit
    def _swiglu_store(gate, up, gu_desc, h_desc, c_smem, row0, col0, F: gl.constexpr):
        """GEMM1 forward epilogue (bf16 and FP8 kernels): SwiGLU in fp32 as the Triton kernel writes it, then gate, up
        and h as bf16 through one staging tile and TMA stores (padding rows already zero in gate / up)."""
        _staged_store(gate, gu_desc, c_smem, row0, col0)
        h = gate / (1.0 + gl.exp(-gate)) * up
        _staged_store(up, gu_desc, c_smem, row0, F + col0)
        _staged_store(h, h_desc, c_smem, row0, col0)

    @gluon.jit
    def _g1f_tile(gu_desc, h_desc, row_pair_ptr, a_bufs, b1_bufs, b3_bufs, ready_a, ready_b, empty, c_smem, j, pid_m,
                  pid_n, C: gl.constexpr, D: gl.constexpr, F: gl.constexpr, STAGES: gl.constexpr,
                  SKIP_EMPTY: gl.constexpr):
        # cooperative: both consumers take every tile, C the rows [C * BM / 2, (C + 1) * BM / 2)
        BMC: gl.constexpr = h_desc.block_type.shape[0]
        BN: gl.constexpr = h_desc.block_type.shape[1]
        BM: gl.constexpr = a_bufs.type.shape[1]
        BK: gl.constexpr = a_bufs.type.shape[2]
        KT: gl.constexpr = D // BK
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, BN, 16])
        row_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
        acc_g = gl.zeros((BMC, BN), dtype=gl.float32, layout=mma_layout)
        acc_u = gl.zeros((BMC, BN), dtype=gl.float32, layout=mma_layout)
        idx0 = j * KT
        row0 = pid_m * BM + C * BMC
        if _rows_live(row_pair_ptr, row0, SKIP_EMPTY):
            for k in range(KT):
                idx = idx0 + k
                s = idx % STAGES
                ph = (idx // STAGES) & 1
                mbarrier.wait(ready_a.index(s), ph)
                mbarrier.wait(ready_b.index(s), ph)
                fence_async_shared()  # the rows came by cp.async (generic proxy); wgmma reads via the async one
                a = a_bufs.index(s).slice(C * BMC, BMC, dim=0)
                acc_g = warpgroup_mma(a, b1_bufs.index(s).permute((1, 0)), acc_g, is_async=True)
                acc_u = warpgroup_mma(a, b3_bufs.index(s).permute((1, 0)), acc_u, is_async=True)
                acc_g, acc_u = warpgroup_mma_wait(num_outstanding=2, deps=(acc_g, acc_u))
                if k > 0:  # step k - 1's MMAs are done: its buffers may be refilled
                    mbarrier.arrive(empty.index((idx - 1) % STAGES), count=1)
            acc_g, acc_u = warpgroup_mma_wait(num_outstanding=0, deps=(acc_g, acc_u))
            mbarrier.arrive(empty.index((idx0 + KT - 1) % STAGES), count=1)
        else:  # all padding rows (WsConfig.skip_empty): no MMA, zeros stored
            for k in range(KT):
                idx = idx0 + k
                s = idx % STAGES
                ph = (idx // STAGES) & 1
                mbarrier.wait(ready_a.index(s), ph)  # both parts landed before the release
                mbarrier.wait(ready_b.index(s), ph)
                mbarrier.arrive(empty.index(s), count=1)
        # epilogue: zeros on padding rows (a multiply: a select makes ptxas serialize the wgmmas),
        # SwiGLU in fp32 as the Triton kernel writes it, then gate, up, h through one staging tile
        col0 = pid_n * BN
        valid = gl.load(row_pair_ptr + row0 + gl.arange(0, BMC, layout=row_layout)) >= 0
        vf = gl.expand_dims(valid.to(gl.float32), 1)
        _swiglu_store(acc_g * vf, acc_u * vf, gu_desc, h_desc, c_smem, row0, col0, F)

    @gluon.jit
    def _g1f_consumer(gu_desc, h_desc, row_pair_ptr, tile_expert_ptr, offsets_ptr, E, a_bufs, b1_bufs, b3_bufs,
                      ready_a, ready_b, empty, tiles, tile_ready, tile_empty, c_smem, C: gl.constexpr,
                      D: gl.constexpr, F: gl.constexpr, NUM_N: gl.constexpr, GROUP_M: gl.constexpr,
                      STAGES: gl.constexpr, SKIP_EMPTY: gl.constexpr, DYNAMIC: gl.constexpr):
        # every tile (grid-strided, or DYNAMIC: as the producer hands them over) by _g1f_tile
        BM: gl.constexpr = a_bufs.type.shape[1]
        n_live, count = _num_tiles(offsets_ptr, E, BM, NUM_N)
        if DYNAMIC:
            j = 0
            t = _wait_tile(tiles, tile_ready, tile_empty, 0)
            while t >= 0:
                pid_m, pid_n = _tile_coords(t, n_live, tile_expert_ptr, offsets_ptr, BM, NUM_N, GROUP_M)
                _g1f_tile(gu_desc, h_desc, row_pair_ptr, a_bufs, b1_bufs, b3_bufs, ready_a, ready_b, empty, c_smem, j,
                          pid_m, pid_n, C, D, F, STAGES, SKIP_EMPTY)
                j += 1
                t = _wait_tile(tiles, tile_ready, tile_empty, j)
        else:
            for j in range(count):
                pid_m, pid_n = _tile_in_expert(j, n_live, tile_expert_ptr, offsets_ptr, BM, NUM_N, GROUP_M)
                _g1f_tile(gu_desc, h_desc, row_pair_ptr, a_bufs, b1_bufs, b3_bufs, ready_a, ready_b, empty, c_smem, j,
                          pid_m, pid_n, C, D, F, STAGES, SKIP_EMPTY)
        tma.store_wait(pendings=0)

    @gluon.jit
    def _gemm1_fwd_ws_kernel(x_ptr, w1_desc, w3_desc, gu_desc, h_desc, row_pair_ptr, tile_expert_ptr, offsets_ptr,
                             counter_ptr, E, D: gl.constexpr, F: gl.constexpr, TOPK: gl.constexpr,
                             NUM_N: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr, BM: gl.constexpr,
                             BK: gl.constexpr, PRODUCER_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                             SKIP_EMPTY: gl.constexpr = False, DYNAMIC: gl.constexpr = False):
        """gate_up[r] = [x[t] @ w1[e].T | x[t] @ w3[e].T], h[r] = silu(gate) * up per row tile, t = row_pair[r]
        // TOPK (the Triton kernel is ``grouped_gemm._gemm1_swiglu_fwd_kernel``). Grid: (programs,). DYNAMIC
        (``GEMM1_DYNAMIC``): tiles in order from the int32 counter at ``counter_ptr`` (zero before the launch, zero
        again after it), else ``counter_ptr`` is not read."""
        dtype: gl.constexpr = w1_desc.dtype
        a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, BK], gl.bfloat16)
        a_bufs = gl.allocate_shared_memory(dtype, [STAGES, BM, BK], a_layout)
        b1_bufs = gl.allocate_shared_memory(dtype, [STAGES] + w1_desc.block_type.shape, w1_desc.layout)
        b3_bufs = gl.allocate_shared_memory(dtype, [STAGES] + w3_desc.block_type.shape, w3_desc.layout)
        c0 = gl.allocate_shared_memory(dtype, h_desc.block_type.shape, h_desc.layout)
        c1 = gl.allocate_shared_memory(dtype, h_desc.block_type.shape, h_desc.layout)
        ready_a = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        ready_b = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready_a.index(i), count=128)  # one cp.async arrival per producer thread (4 warps)
            mbarrier.init(ready_b.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)  # both consumers read every buffer
        tiles, tile_ready, tile_empty = _tile_ring(DYNAMIC, empty)
        if DYNAMIC:
            gl.warp_specialize([
                (_g1f_consumer, (gu_desc, h_desc, row_pair_ptr, tile_expert_ptr, offsets_ptr, E, a_bufs, b1_bufs,
                                 b3_bufs, ready_a, ready_b, empty, tiles, tile_ready, tile_empty, c0, 0, D, F, NUM_N,
                                 GROUP_M, STAGES, SKIP_EMPTY, DYNAMIC)),
                (_g1f_consumer, (gu_desc, h_desc, row_pair_ptr, tile_expert_ptr, offsets_ptr, E, a_bufs, b1_bufs,
                                 b3_bufs, ready_a, ready_b, empty, tiles, tile_ready, tile_empty, c1, 1, D, F, NUM_N,
                                 GROUP_M, STAGES, SKIP_EMPTY, DYNAMIC)),
                (_g1f_producer_dynamic, (x_ptr, w1_desc, w3_desc, row_pair_ptr, tile_expert_ptr, offsets_ptr,
                                         counter_ptr, E, a_bufs, b1_bufs, b3_bufs, ready_a, ready_b, empty, tiles,
                                         tile_ready, tile_empty, D, F, TOPK, NUM_N, GROUP_M, STAGES)),
            ], [4, 4], [CONSUMER_REGS, PRODUCER_REGS])
        else:
            gl.warp_specialize([
                (_g1f_consumer, (gu_desc, h_desc, row_pair_ptr, tile_expert_ptr, offsets_ptr, E, a_bufs, b1_bufs,
                                 b3_bufs, ready_a, ready_b, empty, tiles, tile_ready, tile_empty, c0, 0, D, F, NUM_N,
                                 GROUP_M, STAGES, SKIP_EMPTY, DYNAMIC)),
                (_g1f_consumer, (gu_desc, h_desc, row_pair_ptr, tile_expert_ptr, offsets_ptr, E, a_bufs, b1_bufs,
                                 b3_bufs, ready_a, ready_b, empty, tiles, tile_ready, tile_empty, c1, 1, D, F, NUM_N,
                                 GROUP_M, STAGES, SKIP_EMPTY, DYNAMIC)),
                (_g1f_producer, (x_ptr, w1_desc, w3_desc, row_pair_ptr, tile_expert_ptr, offsets_ptr, E, a_bufs,
                                 b1_bufs, b3_bufs, ready_a, ready_b, empty, D, F, TOPK, NUM_N, GROUP_M, STAGES)),
            ], [4, 4], [CONSUMER_REGS, PRODUCER_REGS])


    # ---------------------------------------------------------------------------------------------
    # GEMM2 dgrad: gathered dout rows (cp.async) x w2 (TMA), SwiGLU-backward epilogue
    # ---------------------------------------------------------------------------------------------

    @gluon.jit
    def _g2d_producer(dout_ptr, w2_desc, gu_desc, row_pair_ptr, tile_expert_ptr, offsets_ptr, E, a_bufs, b_bufs,
                      gu_bufs, ready_a, ready_b, empty, epi_ready, epi_empty, D: gl.constexpr, F: gl.constexpr,
                      TOPK: gl.constexpr, NUM_N: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr):
        BM: gl.constexpr = a_bufs.type.shape[1]
        BK: gl.constexpr = a_bufs.type.shape[2]
        BN: gl.constexpr = w2_desc.block_type.shape[1]
        KT: gl.constexpr = D // BK
        nbytes: gl.constexpr = w2_desc.block_type.nbytes
        gu_nbytes: gl.constexpr = 2 * gu_desc.block_type.nbytes
        # The epilogue's gate / up tiles (one buffer) load once the ring holds this tile's first STAGES steps: the
        # wait for the consumers to free them (end of the previous tile's epilogue) then costs no operand prefetch.
        PREF: gl.constexpr = STAGES - 1 if STAGES - 1 < KT else KT - 1
        n_live, count = _num_tiles(offsets_ptr, E, BM, NUM_N)
        idx = 0
        for j in range(count):
            pid_m, pid_n = _tile_of(j, n_live, NUM_N, GROUP_M)
            e = gl.load(tile_expert_ptr + pid_m)
            ptrs, mask = _gathered_rows(dout_ptr, row_pair_ptr, pid_m, D, TOPK, BM, BK)
            for k in range(KT):
                s = idx % STAGES
                mbarrier.wait(empty.index(s), ((idx // STAGES) & 1) ^ 1)
                async_copy.async_copy_global_to_shared(a_bufs.index(s), ptrs + k * BK, mask=mask)  # padding: zeros
                async_copy.mbarrier_arrive(ready_a.index(s), increment_count=False)
                bar = ready_b.index(s)
                mbarrier.expect(bar, nbytes)
                tma.async_copy_global_to_shared(w2_desc, [e * D + k * BK, pid_n * BN], bar, b_bufs.index(s))
                idx += 1
                if k == PREF:
                    mbarrier.wait(epi_empty, (j & 1) ^ 1)  # first tile: free
                    mbarrier.expect(epi_ready, gu_nbytes)
                    tma.async_copy_global_to_shared(gu_desc, [pid_m * BM, pid_n * BN], epi_ready, gu_bufs.index(0))
                    tma.async_copy_global_to_shared(gu_desc, [pid_m * BM, F + pid_n * BN], epi_ready, gu_bufs.index(1))

    @gluon.jit
    def _g2d_epilogue(g, dgu_desc, hs_desc, gate_s, up_s, vf, sc, row0, col0, c_x, c_y, F: gl.constexpr):
        """SwiGLU backward of one BMC x BH column block (g = the fp32 GEMM result; the Triton kernel's formulas), with
        its gate / up tiles from shared memory (``gate_s`` / ``up_s``, loaded by the producer's TMA under the main
        loop): writes dgate, dup and hs through the staging tiles ``c_x``, ``c_y``, ``c_x`` (TMA stores; a tile is
        rewritten once the store before the last has read it), returns the block's row sums of g h."""
        gate = gate_s.load(g.type.layout).to(gl.float32) * vf
        up = up_s.load(g.type.layout).to(gl.float32) * vf
        sig = 1.0 / (1.0 + gl.exp(-gate))
        silu = gate * sig
        g = g * vf
        dscore = gl.sum(g * (silu * up).to(gl.bfloat16).to(gl.float32), axis=1)  # h as GEMM2 consumed it
        dh = g * sc
        tma.store_wait(pendings=1)
        c_x.store((dh * up * (sig * (1.0 + gate * (1.0 - sig)))).to(gl.bfloat16))  # silu' = sig (1 + x (1 - sig))
        fence_async_shared()
        tma.async_copy_shared_to_global(dgu_desc, [row0, col0], c_x)
        tma.store_wait(pendings=1)
        c_y.store((dh * silu).to(gl.bfloat16))
        fence_async_shared()
        tma.async_copy_shared_to_global(dgu_desc, [row0, F + col0], c_y)
        tma.store_wait(pendings=1)
        c_x.store((silu * up * sc).to(gl.bfloat16))
        fence_async_shared()
        tma.async_copy_shared_to_global(hs_desc, [row0, col0], c_x)
        return dscore

    @gluon.jit
    def _g2d_consumer(dgu_desc, hs_desc, scores_ptr, dscore_ptr, row_pair_ptr, offsets_ptr, E, a_bufs, b_bufs,
                      gu_bufs, ready_a, ready_b, empty, epi_ready, epi_empty, c_smem, C: gl.constexpr, D: gl.constexpr,
                      F: gl.constexpr, NUM_N: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                      SPLIT: gl.constexpr):
        # cooperative: both consumers take every tile, C the rows [C * BM / 2, (C + 1) * BM / 2). The epilogue runs
        # per BN / 2 column half (the fp32 tiles of a whole m64n128 spilled 200 bytes). SPLIT: two m64n64
        # accumulators (two wgmma per k16 step, each re-reading the A tile from shared memory); else one m64n128,
        # split in registers after the main loop (its layout's halves are the m64n64 layout: no data movement).
        BMC: gl.constexpr = hs_desc.block_type.shape[0]
        BH: gl.constexpr = hs_desc.block_type.shape[1]
        BM: gl.constexpr = a_bufs.type.shape[1]
        BK: gl.constexpr = a_bufs.type.shape[2]
        KT: gl.constexpr = D // BK
        half_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                              instr_shape=[16, BH, 16])
        wide_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                              instr_shape=[16, 2 * BH, 16])
        row_layout: gl.constexpr = gl.SliceLayout(1, half_layout)
        n_live, count = _num_tiles(offsets_ptr, E, BM, NUM_N)
        for j in range(count):
            pid_m, pid_n = _tile_of(j, n_live, NUM_N, GROUP_M)
            idx0 = j * KT
            if SPLIT:
                acc0 = gl.zeros((BMC, BH), dtype=gl.float32, layout=half_layout)
                acc1 = gl.zeros((BMC, BH), dtype=gl.float32, layout=half_layout)
            else:
                acc = gl.zeros((BMC, 2 * BH), dtype=gl.float32, layout=wide_layout)
            for k in range(KT):
                idx = idx0 + k
                s = idx % STAGES
                ph = (idx // STAGES) & 1
                mbarrier.wait(ready_a.index(s), ph)
                mbarrier.wait(ready_b.index(s), ph)
                fence_async_shared()  # the rows came by cp.async (generic proxy); wgmma reads via the async one
                a = a_bufs.index(s).slice(C * BMC, BMC, dim=0)
                b = b_bufs.index(s)
                if SPLIT:
                    acc0 = warpgroup_mma(a, b.slice(0, BH, dim=1), acc0, is_async=True)
                    acc1 = warpgroup_mma(a, b.slice(BH, BH, dim=1), acc1, is_async=True)
                    acc0, acc1 = warpgroup_mma_wait(num_outstanding=2, deps=(acc0, acc1))
                else:
                    acc = warpgroup_mma(a, b, acc, is_async=True)
                    acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
                if k > 0:  # step k - 1's MMAs are done: its buffers may be refilled
                    mbarrier.arrive(empty.index((idx - 1) % STAGES), count=1)
            if SPLIT:
                acc0, acc1 = warpgroup_mma_wait(num_outstanding=0, deps=(acc0, acc1))
            else:
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                acc0, acc1 = gl.split(gl.permute(gl.reshape(acc, [BMC, 2, BH]), [0, 2, 1]))
                acc0 = gl.convert_layout(acc0, half_layout)
                acc1 = gl.convert_layout(acc1, half_layout)
            mbarrier.arrive(empty.index((idx0 + KT - 1) % STAGES), count=1)
            # epilogue; padding rows masked by multiplies (a select on the accumulator serializes the wgmmas)
            row0 = pid_m * BM + C * BMC
            rows = row0 + gl.arange(0, BMC, layout=row_layout)
            pair = gl.load(row_pair_ptr + rows)
            ok = pair >= 0
            vf = gl.expand_dims(ok.to(gl.float32), 1)
            sc = gl.expand_dims(gl.load(scores_ptr + gl.where(ok, pair, 0)) * ok.to(gl.float32), 1)
            col0 = pid_n * 2 * BH
            mbarrier.wait(epi_ready, j & 1)  # this tile's gate / up tiles are in gu_bufs
            gate = gu_bufs.index(0).slice(C * BMC, BMC, dim=0)
            up = gu_bufs.index(1).slice(C * BMC, BMC, dim=0)
            # the staging tiles alternate: x y x for the first half, y x y for the second
            dscore = _g2d_epilogue(acc0, dgu_desc, hs_desc, gate.slice(0, BH, dim=1), up.slice(0, BH, dim=1), vf, sc,
                                   row0, col0, c_smem.index(0), c_smem.index(1), F)
            dscore += _g2d_epilogue(acc1, dgu_desc, hs_desc, gate.slice(BH, BH, dim=1), up.slice(BH, BH, dim=1), vf,
                                    sc, row0, col0 + BH, c_smem.index(1), c_smem.index(0), F)
            mbarrier.arrive(epi_empty, count=1)  # both consumers: the producer may load the next tile's gate / up
            gl.store(dscore_ptr + rows.to(gl.int64) * NUM_N + pid_n, dscore)
        tma.store_wait(pendings=0)

    @gluon.jit
    def _gemm2_dgrad_ws_kernel(dout_ptr, w2_desc, dgu_desc, hs_desc, gu_desc, scores_ptr, dscore_ptr, row_pair_ptr,
                               tile_expert_ptr, offsets_ptr, E, D: gl.constexpr, F: gl.constexpr, TOPK: gl.constexpr,
                               NUM_N: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr, BM: gl.constexpr,
                               BK: gl.constexpr, PRODUCER_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                               SPLIT: gl.constexpr):
        """g = dout[t] @ w2[e] per row tile, then the SwiGLU backward: dgate_up, hs = s h and the d score
        partials (the Triton kernel is ``grouped_gemm_bwd._gemm2_dgrad_swiglu_bwd_kernel``). Grid: (programs,).

        The epilogue's saved gate / up tiles (BM x BN each, ``gu_desc`` over gate_up) come by TMA into one shared
        buffer, issued by the producer under the tile's main loop (``epi_ready`` / ``epi_empty`` mbarriers): the
        epilogue reads shared memory instead of waiting on global loads after the last MMA."""
        dtype: gl.constexpr = w2_desc.dtype
        a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, BK], gl.bfloat16)
        a_bufs = gl.allocate_shared_memory(dtype, [STAGES, BM, BK], a_layout)
        b_bufs = gl.allocate_shared_memory(dtype, [STAGES] + w2_desc.block_type.shape, w2_desc.layout)
        gu_bufs = gl.allocate_shared_memory(dtype, [2] + gu_desc.block_type.shape, gu_desc.layout)
        # two staging tiles per consumer: an epilogue store waits for the one before the last, not the last
        c0 = gl.allocate_shared_memory(dtype, [2] + hs_desc.block_type.shape, hs_desc.layout)
        c1 = gl.allocate_shared_memory(dtype, [2] + hs_desc.block_type.shape, hs_desc.layout)
        ready_a = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        ready_b = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        epi_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        epi_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready_a.index(i), count=128)  # one cp.async arrival per producer thread (4 warps)
            mbarrier.init(ready_b.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)  # both consumers read every buffer
        mbarrier.init(epi_ready, count=1)
        mbarrier.init(epi_empty, count=2)
        gl.warp_specialize([
            (_g2d_consumer, (dgu_desc, hs_desc, scores_ptr, dscore_ptr, row_pair_ptr, offsets_ptr, E, a_bufs, b_bufs,
                             gu_bufs, ready_a, ready_b, empty, epi_ready, epi_empty, c0, 0, D, F, NUM_N, GROUP_M,
                             STAGES, SPLIT)),
            (_g2d_consumer, (dgu_desc, hs_desc, scores_ptr, dscore_ptr, row_pair_ptr, offsets_ptr, E, a_bufs, b_bufs,
                             gu_bufs, ready_a, ready_b, empty, epi_ready, epi_empty, c1, 1, D, F, NUM_N, GROUP_M,
                             STAGES, SPLIT)),
            (_g2d_producer, (dout_ptr, w2_desc, gu_desc, row_pair_ptr, tile_expert_ptr, offsets_ptr, E, a_bufs, b_bufs,
                             gu_bufs, ready_a, ready_b, empty, epi_ready, epi_empty, D, F, TOPK, NUM_N, GROUP_M,
                             STAGES)),
        ], [4, 4], [CONSUMER_REGS, PRODUCER_REGS])


_CAPABILITY: dict[int, tuple[int, int]] = {}  # device index -> compute capability (a driver query per launch
# cost ~40 us of the H200 host's time per forward, scripts/host_profile.py)


def _capability(dev: torch.device) -> tuple[int, int]:
    idx = dev.index if dev.index is not None else torch.cuda.current_device()
    cap = _CAPABILITY.get(idx)
    if cap is None:
        cap = _CAPABILITY[idx] = torch.cuda.get_device_capability(idx)
    return cap


def _check_operands(fn: str, fp32: tuple[str, ...] = (), **tensors: Tensor) -> None:
    """Raise ValueError naming ``fn`` and the operand unless every tensor is contiguous, bf16 (fp32 for the names in
    ``fp32``) and on the first one's device: the kernels read raw pointers and TMA descriptors, so another dtype or
    a strided view would be misread, not refused."""
    dev = next(iter(tensors.values())).device
    for name, t in tensors.items():
        want = torch.float32 if name in fp32 else torch.bfloat16
        if t.dtype != want or not t.is_contiguous() or t.device != dev:
            raise ValueError(f"{fn}: {name} must be a contiguous {want} tensor on {dev}, got {t.dtype} "
                             f"{'contiguous' if t.is_contiguous() else 'strided'} on {t.device} (pass "
                             f"tensor.to({want}).contiguous())")


def _gemm1_programs(cfg: WsConfig, programs: int | None) -> int | None:
    """``programs`` as given, or with ``GEMM1_GRID`` and a cooperative config, one program per tile (a ping-pong
    program needs two tiles to keep both consumers busy; ``GEMM1_DYNAMIC`` keeps the persistent grid)."""
    grid = GEMM1_GRID and cfg.coop and not _dynamic(cfg)
    return programs if programs is not None or not grid else 1 << 30


_TILE_COUNTERS: dict[tuple, Tensor] = {}  # (device index, stream, kernel) -> int32 counter of GEMM1_DYNAMIC


def _tile_counter(dev: torch.device, kernel: str) -> Tensor:
    """The zeroed int32 tile counter of a ``GEMM1_DYNAMIC`` launch of ``kernel`` on the current stream of ``dev``.

    The kernel leaves it at zero (``_take_tile``), so one counter serves every launch in stream order; launches on
    two streams would race for one, hence one per stream. Under CUDA-graph capture a fresh one is allocated (its
    zero fill is captured with the graph, which then owns it): a cached counter first allocated inside a capture
    would hold garbage for eager launches until the graph replays."""
    if dev.type != "cuda" or torch.cuda.is_current_stream_capturing():  # not cuda: the CPU tests' host-only driver
        return torch.zeros(1, dtype=torch.int32, device=dev)
    idx = dev.index if dev.index is not None else torch.cuda.current_device()
    key = (idx, torch.cuda.current_stream(idx).cuda_stream, kernel)
    c = _TILE_COUNTERS.get(key)
    if c is None:
        c = _TILE_COUNTERS[key] = torch.zeros(1, dtype=torch.int32, device=dev)
    return c


#: The counter schedule (``GEMM1_DYNAMIC``, ``WsConfig.dynamic``) hung on the GPU until session 33's ticket fix (sessions
#: 32-33); with it, its GPU tests pass (session 37: 16, bitwise the persistent schedule), but it gains nothing over the
#: expert order (A/B within 1 % at both shapes, ``ab_kernels_dynamic_1xh100_s37a_20261207.json``). It stays fenced, so
#: a launch that asks for it raises; set False only to measure or debug it (``scripts/ab_kernels.py
#: --unfence-dynamic``).
DYNAMIC_FENCED = True


def _dynamic(cfg: WsConfig) -> bool:
    """Whether a GEMM1 launch with ``cfg`` takes its tiles from a counter (``cfg.dynamic`` or ``GEMM1_DYNAMIC``;
    cooperative configs only).

    Raises:
        RuntimeError: it asks for the counter schedule while :data:`DYNAMIC_FENCED` (no gain measured)."""
    dynamic = (cfg.dynamic or GEMM1_DYNAMIC) and cfg.coop
    if dynamic and DYNAMIC_FENCED:
        raise RuntimeError(
            "TITAN_MEGAMOE_WS_GEMM1_DYNAMIC / WsConfig.dynamic: the counter tile schedule is disabled (it hung before "
            "session 33's fix and measured no faster since: docs/NOTES.md sessions 32-37). Unset "
            "TITAN_MEGAMOE_WS_GEMM1_DYNAMIC (the default schedule computes the same bits).")
    return dynamic


def _programs(dev: torch.device, tiles: int, programs: int | None) -> int:
    """Persistent grid size: ``programs`` (default: the device's SM count), at most ``tiles``, at least 1."""
    if programs is None:
        programs = _sm_count(dev.index if dev.index is not None else torch.cuda.current_device())
    return max(1, min(programs, tiles))


def _platform_reason(t: Tensor) -> str | None:
    """Why the Gluon kernels cannot run on ``t``'s device with this Triton (None: they can)."""
    if not HAVE_GLUON:
        return "this Triton has no Gluon Hopper API"
    if not t.is_cuda or _capability(t.device)[0] != 9:
        return "needs an sm_90 (Hopper) GPU"
    if not triton.__version__.startswith("3.6"):
        return f"written against Triton 3.6's Gluon, found {triton.__version__}"
    return None


def ws_gemm1_dgrad_supported(dgate_up_N2F: Tensor, w1_EFD: Tensor, cfg: WsConfig = DEFAULT) -> str | None:
    """None if the warp-specialized GEMM1 dgrad can take these operands, else why not."""
    reason = _platform_reason(dgate_up_N2F)
    if reason:
        return reason
    E, F, D = w1_EFD.shape
    if F % cfg.block_k or D % 8:
        return f"needs F % {cfg.block_k} == 0 and D % 8 == 0 (F={F}, D={D})"
    if cfg.split_n and not cfg.coop:
        return "split_n needs the cooperative schedule (coop=True)"
    return None


def sm90_compile_args(cfg: WsConfig, D: int, F: int, kind: str = "gemm1_dgrad", top_k: int = 8) -> tuple[dict, dict]:
    """(signature, constexprs) of ``_gemm1_dgrad_ws_kernel`` (``kind`` "gemm1_dgrad"), ``_gemm1_fwd_ws_kernel``
    ("gemm1") or ``_gemm2_dgrad_ws_kernel`` ("gemm2_dgrad") for ``sm90_check.compile_sm90`` (CPU build checks:
    registers, shared memory, wgmma count, no ptxas wgmma serialization)."""
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k

    def desc(block):
        layout = gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16)
        return f"tensordesc<bf16[{block[0]}, {block[1]}],{layout!r}>"

    if kind == "gemm2_dgrad":
        sig = {"dout_ptr": "*bf16", "w2_desc": desc([bk, bn]), "dgu_desc": desc([bm // 2, bn // 2]),
               "hs_desc": desc([bm // 2, bn // 2]), "gu_desc": desc([bm, bn]), "scores_ptr": "*fp32", "dscore_ptr": "*fp32",
               "row_pair_ptr": "*i32", "tile_expert_ptr": "*i32", "offsets_ptr": "*i32", "E": "i32"}
        cx = dict(D=D, F=F, TOPK=top_k, NUM_N=F // bn, GROUP_M=cfg.group_m, STAGES=cfg.stages, BM=bm, BK=bk,
                  PRODUCER_REGS=cfg.producer_regs, CONSUMER_REGS=cfg.consumer_regs, SPLIT=cfg.split_n)
        return sig, cx
    if kind == "gemm1":
        sig = {"x_ptr": "*bf16", "w1_desc": desc([bn, bk]), "w3_desc": desc([bn, bk]), "gu_desc": desc([bm // 2, bn]),
               "h_desc": desc([bm // 2, bn]), "row_pair_ptr": "*i32", "tile_expert_ptr": "*i32",
               "offsets_ptr": "*i32", "counter_ptr": "*i32", "E": "i32"}
        cx = dict(D=D, F=F, TOPK=top_k, NUM_N=F // bn, GROUP_M=cfg.group_m, STAGES=cfg.stages, BM=bm, BK=bk,
                  PRODUCER_REGS=cfg.producer_regs, CONSUMER_REGS=cfg.consumer_regs, SKIP_EMPTY=cfg.skip_empty,
                  DYNAMIC=cfg.dynamic)
        return sig, cx
    bh = bn // 2 if cfg.split_n else bn
    sig = {"a_desc": desc([bm, bk]), "w1_desc": desc([bk, bh]), "w3_desc": desc([bk, bh]),
           "dx_desc": desc([bm // 2 if cfg.coop else bm, bh]), "row_pair_ptr": "*i32", "tile_expert_ptr": "*i32",
           "offsets_ptr": "*i32", "counter_ptr": "*i32", "E": "i32"}
    cx = dict(F=F, NUM_N=-(-D // bn), GROUP_M=cfg.group_m, STAGES=cfg.stages, COOP=cfg.coop,
              PRODUCER_REGS=cfg.producer_regs, CONSUMER_REGS=cfg.consumer_regs, SPLIT=cfg.split_n,
              SKIP_EMPTY=cfg.skip_empty, DYNAMIC=cfg.dynamic)
    return sig, cx


#: Config of the Gluon GEMM1 forward (cooperative: each consumer holds the gate and up accumulators of
#: 64 rows x 128 columns; 216 registers for them, 72 for the 4-warp gather producer: the sm_90a build
#: spills nothing there, 200 / 104 spilled 88-112 bytes).
FWD_CONFIG = WsConfig(block_n=128, stages=4, group_m=1, coop=True, consumer_regs=216, producer_regs=72)


def ws_gemm1_fwd_supported(x_TD: Tensor, w1_EFD: Tensor, cfg: WsConfig = FWD_CONFIG) -> str | None:
    """None if the warp-specialized GEMM1 forward can take these operands, else why not."""
    reason = _platform_reason(x_TD)
    if reason:
        return reason
    E, F, D = w1_EFD.shape
    if F % cfg.block_n or D % cfg.block_k:
        return f"needs F % {cfg.block_n} == 0 and D % {cfg.block_k} == 0 (F={F}, D={D})"
    return None


def ws_gemm1_fwd(x_TD: Tensor, w1_EFD: Tensor, w3_EFD: Tensor, layout, *, gate_up_out: Tensor | None = None,
                 h_out: Tensor | None = None, cfg: WsConfig = FWD_CONFIG, programs: int | None = None):
    """GEMM1 (gate and up) with the row gather and SwiGLU, by the warp-specialized Gluon kernel.

    Same contract as ``grouped_gemm.gemm1_swiglu_fwd``: for each padded row r with pair p = row_pair[r] >= 0,
    t = p // K, e = tile_expert[r // BM]: gate_up[r] = [x[t] @ w1[e].T | x[t] @ w3[e].T] and
    h[r] = silu(gate) * up (fp32, then bf16); padding rows of live tiles are zeros, tiles past offsets[E]
    are not written.

    Args:
        x_TD: (T, D) bf16 contiguous; w1_EFD, w3_EFD: (E, F, D) bf16 contiguous.
        layout: the routing layout (block_m 128).
        gate_up_out, h_out: optional (N_cap, 2F) / (N_cap, F) bf16 outputs.
        programs: grid size (default: the SM count; one program per tile with ``GEMM1_GRID``).

    Returns:
        (gate_up (N_cap, 2F), h (N_cap, F)).

    Raises:
        ValueError: an unsupported case (``ws_gemm1_fwd_supported``'s reason) or mismatched shapes.
    """
    _check_operands("ws_gemm1_fwd", x=x_TD, w1=w1_EFD, w3=w3_EFD,
                    **{k: v for k, v in (("gate_up_out", gate_up_out), ("h_out", h_out)) if v is not None})
    reason = ws_gemm1_fwd_supported(x_TD, w1_EFD, cfg)
    if reason:
        raise ValueError(f"ws_gemm1_fwd: {reason}")
    E, F, D = w1_EFD.shape
    if layout.block_m != cfg.block_m or tuple(w3_EFD.shape) != (E, F, D) or x_TD.shape[1] != D:
        raise ValueError(f"ws_gemm1_fwd: x {tuple(x_TD.shape)}, w3 {tuple(w3_EFD.shape)} or layout.block_m "
                         f"{layout.block_m} do not match (E, F, D) = ({E}, {F}, {D}), block_m {cfg.block_m}")
    n_cap, dev = layout.n_cap, x_TD.device
    gu = torch.empty((n_cap, 2 * F), dtype=torch.bfloat16, device=dev) if gate_up_out is None else gate_up_out
    h = torch.empty((n_cap, F), dtype=torch.bfloat16, device=dev) if h_out is None else h_out
    return launch_gemm1_fwd(x_TD, w1_EFD, w3_EFD, layout, gu, h, cfg, programs)


def launch_gemm1_fwd(x_TD: Tensor, w1_EFD: Tensor, w3_EFD: Tensor, layout, gu: Tensor, h: Tensor,
                     cfg: WsConfig = FWD_CONFIG, programs: int | None = None):
    """``ws_gemm1_fwd`` without its checks, for a caller that has made them (``grouped_gemm.gemm1_swiglu_fwd``:
    operands, outputs, layout, and ``ws_gemm1_fwd_supported``); returns (gu, h)."""
    E, F, D = w1_EFD.shape
    n_cap, dev = layout.n_cap, x_TD.device
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    w1_desc = _desc(w1_EFD, (E * F, D), (bn, bk))
    w3_desc = _desc(w3_EFD, (E * F, D), (bn, bk))
    gu_desc = _desc(gu, (n_cap, 2 * F), (bm // 2, bn))
    h_desc = _desc(h, (n_cap, F), (bm // 2, bn))
    num_n = F // bn
    programs = _programs(dev, layout.n_tiles_cap * num_n, _gemm1_programs(cfg, programs))
    dynamic = _dynamic(cfg)
    counter = _tile_counter(dev, "gemm1_fwd") if dynamic else layout.offsets  # not read unless dynamic
    launch(_gemm1_fwd_ws_kernel, (programs,),
           x_TD, w1_desc, w3_desc, gu_desc, h_desc, layout.row_pair, layout.tile_expert, layout.offsets, counter, E,
           D, F, layout.top_k, num_n, 0 if GEMM1_EXPERT_ORDER else cfg.group_m, cfg.stages, bm, bk, cfg.producer_regs,
           cfg.consumer_regs, cfg.skip_empty or SKIP_PAD_BLOCKS, dynamic, num_warps=4, maxnreg=cfg.maxnreg)
    return gu, h


@functools.lru_cache(maxsize=None)
def _smem_layout(block: tuple[int, ...], dtype: torch.dtype = torch.bfloat16):
    gl_dtype = {torch.bfloat16: gl.bfloat16, torch.float8_e4m3fn: gl.float8e4nv, torch.float32: gl.float32}[dtype]
    return gl.NVMMASharedLayout.get_default_for(list(block), gl_dtype)


_CHECKED_DESCS: set = set()  # (shape, block, dtype) that TensorDescriptor's own checks have passed


def _desc(t: Tensor, shape, block) -> "TensorDescriptor":
    """Host TMA descriptor of the contiguous bf16 (or e4m3) ``t`` viewed as ``shape``, tiles of ``block``.

    The first descriptor of each (shape, block, dtype) is built by ``TensorDescriptor`` with its checks (rank,
    16-byte strides and base, block shape, layout); later ones of the same key only re-check the base address
    (the one input that changes) and skip ``__post_init__``: 0.3 instead of 1.6 us on the CPU machine, four
    descriptors per GEMM1 launch, before GEMM1 is enqueued (the forward is host-bound until then)."""
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * shape[i + 1]
    key = (tuple(shape), tuple(block), t.dtype)
    if key not in _CHECKED_DESCS or t.data_ptr() % 16:
        d = TensorDescriptor(t, list(shape), strides, list(block), _smem_layout(tuple(block), t.dtype))
        _CHECKED_DESCS.add(key)
        return d
    d = object.__new__(TensorDescriptor)
    d.base, d.shape, d.strides, d.block_shape = t, list(shape), strides, list(block)
    d.layout, d.padding = _smem_layout(tuple(block), t.dtype), "zero"
    return d


def ws_gemm1_dgrad(dgate_up_N2F: Tensor, w1_EFD: Tensor, w3_EFD: Tensor, layout, *, out: Tensor | None = None,
                   cfg: WsConfig = DEFAULT, programs: int | None = None) -> Tensor:
    """GEMM1 dgrad by the warp-specialized Gluon kernel: dx_rows[r] = dgate[r] @ w1[e] + dup[r] @ w3[e].

    Args:
        dgate_up_N2F: (N_cap, 2F) bf16, contiguous; padding rows may hold anything (their outputs are 0).
        w1_EFD, w3_EFD: (E, F, D) bf16, contiguous.
        layout: the routing layout (``routing.RoutingLayout``) with ``block_m == cfg.block_m``.
        out: optional (N_cap, D) bf16 output.
        programs: grid size (default: the SM count; one program per tile with ``GEMM1_GRID`` and a cooperative cfg).

    Returns:
        dx_rows (N_cap, D) bf16: rows [0, offsets[E]) written (zeros on padding rows), the rest untouched,
        as ``grouped_gemm_bwd.gemm1_dgrad``.

    Raises:
        ValueError: shapes / layout block size / an unsupported case (``ws_gemm1_dgrad_supported``'s reason).
    """
    _check_operands("ws_gemm1_dgrad", dgate_up=dgate_up_N2F, w1=w1_EFD, w3=w3_EFD,
                    **({} if out is None else {"out": out}))
    reason = ws_gemm1_dgrad_supported(dgate_up_N2F, w1_EFD, cfg)
    if reason:
        raise ValueError(f"ws_gemm1_dgrad: {reason}")
    E, F, D = w1_EFD.shape
    if layout.block_m != cfg.block_m:
        raise ValueError(f"ws_gemm1_dgrad: layout.block_m={layout.block_m} != cfg.block_m={cfg.block_m}")
    n_cap = layout.n_cap
    if tuple(dgate_up_N2F.shape) != (n_cap, 2 * F) or tuple(w3_EFD.shape) != (E, F, D):
        raise ValueError(f"ws_gemm1_dgrad: dgate_up {tuple(dgate_up_N2F.shape)} / w3 {tuple(w3_EFD.shape)} do not "
                         f"match (N_cap, 2F) = ({n_cap}, {2 * F}) / (E, F, D) = ({E}, {F}, {D})")
    dx = torch.empty((n_cap, D), dtype=torch.bfloat16, device=dgate_up_N2F.device) if out is None else out
    return launch_gemm1_dgrad(dgate_up_N2F, w1_EFD, w3_EFD, layout, dx, cfg, programs)


def launch_gemm1_dgrad(dgate_up_N2F: Tensor, w1_EFD: Tensor, w3_EFD: Tensor, layout, dx: Tensor,
                       cfg: WsConfig = DEFAULT, programs: int | None = None) -> Tensor:
    """``ws_gemm1_dgrad`` without its checks, for a caller that has made them (``grouped_gemm_bwd.gemm1_dgrad``:
    operands, output, layout, and ``ws_gemm1_dgrad_supported``); returns dx."""
    E, F, D = w1_EFD.shape
    n_cap = layout.n_cap
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    bh = bn // 2 if cfg.split_n else bn  # the B tiles and stores of split_n are column halves
    a_desc = _desc(dgate_up_N2F, (n_cap, 2 * F), (bm, bk))
    w1_desc = _desc(w1_EFD, (E * F, D), (bk, bh))
    w3_desc = _desc(w3_EFD, (E * F, D), (bk, bh))
    dx_desc = _desc(dx, (n_cap, D), (bm // 2 if cfg.coop else bm, bh))
    num_n = -(-D // bn)
    programs = _programs(dx.device, layout.n_tiles_cap * num_n, _gemm1_programs(cfg, programs))
    dynamic = _dynamic(cfg)
    counter = _tile_counter(dx.device, "gemm1_dgrad") if dynamic else layout.offsets  # not read unless dynamic
    launch(_gemm1_dgrad_ws_kernel, (programs,),
           a_desc, w1_desc, w3_desc, dx_desc, layout.row_pair, layout.tile_expert, layout.offsets, counter, E,
           F, num_n, 0 if GEMM1_EXPERT_ORDER else cfg.group_m, cfg.stages, cfg.coop, cfg.producer_regs,
           cfg.consumer_regs, cfg.split_n, cfg.skip_empty or SKIP_PAD_BLOCKS, dynamic, num_warps=4,
           maxnreg=cfg.maxnreg)
    return dx


#: Config of the Gluon GEMM2 dgrad (cooperative 128 x 128 tiles: each consumer holds a 64 x 128 fp32 accumulator
#: and the epilogue's fp32 gate / up / SwiGLU tiles; BN 128 gives the Triton kernel's d score partial columns).
#: 4 stages: with the gate / up tiles in shared memory (64 KB) the build takes 213 KB. One H200 (session 18,
#: bench_ws_gemm2_dgrad_v2_s18e_1xh200_20261205.json): 1.120 ms at 30B, 3.733 at 235B, against the Triton kernel's
#: 1.014 / 3.484 (session 13's version, global gate / up loads: 1.164 at 4 stages, 1.109 at 6), so it stays opt-in.
G2D_CONFIG = WsConfig(block_n=128, stages=4, group_m=1, coop=True, consumer_regs=216, producer_regs=72)
#: Session 18's v2 of it: two m64n64 accumulators per consumer (``split_n``), each wgmma re-reading the A tile.
G2D_SPLIT_CONFIG = WsConfig(block_n=128, stages=4, group_m=1, coop=True, consumer_regs=216, producer_regs=72,
                            split_n=True)


def ws_gemm2_dgrad_supported(dout_TD: Tensor, w2_EDF: Tensor, cfg: WsConfig = G2D_CONFIG) -> str | None:
    """None if the warp-specialized GEMM2 dgrad can take these operands, else why not."""
    reason = _platform_reason(dout_TD)
    if reason:
        return reason
    E, D, F = w2_EDF.shape
    if F % cfg.block_n or D % cfg.block_k:
        return f"needs F % {cfg.block_n} == 0 and D % {cfg.block_k} == 0 (F={F}, D={D})"
    return None


def ws_gemm2_dgrad(dout_TD: Tensor, w2_EDF: Tensor, gate_up_N2F: Tensor, scores_TK: Tensor, layout, *,
                   out: tuple[Tensor, Tensor] | None = None, hs_out: Tensor | None = None,
                   cfg: WsConfig = G2D_CONFIG, programs: int | None = None):
    """GEMM2 dgrad with the row gather and the SwiGLU backward, by the warp-specialized Gluon kernel.

    Same contract as ``grouped_gemm_bwd.gemm2_dgrad_swiglu_bwd`` with ``hs_out`` (required here): per padded row r
    (pair p >= 0, token t = p // K, expert e): g = dout[t] @ w2[e] (fp32), dh = s[p] g, dgate = dh up silu'(gate),
    dup = dh silu(gate), hs[r] = bf16(s[p] silu(gate) up), dscore_partial[r, j] = sum of g h over the columns of
    block j (h = bf16(silu(gate) up)); zeros on padding rows; tiles past offsets[E] not written.

    Args:
        dout_TD: (T, D) bf16 contiguous; w2_EDF: (E, D, F) bf16 contiguous; gate_up_N2F: (N_cap, 2F) bf16 saved by
            the forward; scores_TK: (T, K) fp32; layout: the routing layout (block_m 128).
        out: optional (dgate_up (N_cap, 2F) bf16, dscore_partial (N_cap, F // 128) fp32) buffers.
        hs_out: (N_cap, F) bf16 buffer for s h (optional: allocated if None).
        programs: persistent grid size (default: the SM count).

    Returns:
        (dgate_up, dscore_partial, hs).

    Raises:
        ValueError: an operand of another dtype, not contiguous or on another device; an unsupported case
            (``ws_gemm2_dgrad_supported``'s reason); mismatched shapes.
    """
    outs = {} if out is None else {"out[0] (dgate_up)": out[0], "out[1] (dscore_partial)": out[1]}
    _check_operands("ws_gemm2_dgrad", ("scores", "out[1] (dscore_partial)"), dout=dout_TD, w2=w2_EDF,
                    gate_up=gate_up_N2F, scores=scores_TK, **outs, **({} if hs_out is None else {"hs_out": hs_out}))
    reason = ws_gemm2_dgrad_supported(dout_TD, w2_EDF, cfg)
    if reason:
        raise ValueError(f"ws_gemm2_dgrad: {reason}")
    E, D, F = w2_EDF.shape
    n_cap, dev, nb = layout.n_cap, dout_TD.device, F // cfg.block_n
    T, K = scores_TK.shape
    if (layout.block_m != cfg.block_m or tuple(dout_TD.shape) != (T, D) or tuple(gate_up_N2F.shape) != (n_cap, 2 * F)
            or layout.top_k != K):
        raise ValueError(f"ws_gemm2_dgrad: dout {tuple(dout_TD.shape)}, gate_up {tuple(gate_up_N2F.shape)}, scores "
                         f"{tuple(scores_TK.shape)} or layout (block_m {layout.block_m}, top_k {layout.top_k}) do not "
                         f"match (E, D, F) = ({E}, {D}, {F}), N_cap {n_cap}, block_m {cfg.block_m}")
    if out is None:
        out = (torch.empty((n_cap, 2 * F), dtype=torch.bfloat16, device=dev),
               torch.empty((n_cap, nb), dtype=torch.float32, device=dev))
    hs = torch.empty((n_cap, F), dtype=torch.bfloat16, device=dev) if hs_out is None else hs_out
    return (*launch_gemm2_dgrad(dout_TD, w2_EDF, gate_up_N2F, scores_TK, layout, out[0], out[1], hs, cfg, programs), hs)


def launch_gemm2_dgrad(dout_TD: Tensor, w2_EDF: Tensor, gate_up_N2F: Tensor, scores_TK: Tensor, layout,
                       dgate_up: Tensor, dscore_part: Tensor, hs: Tensor, cfg: WsConfig = G2D_CONFIG,
                       programs: int | None = None):
    """``ws_gemm2_dgrad`` without its checks, for a caller that has made them
    (``grouped_gemm_bwd.gemm2_dgrad_swiglu_bwd``); returns (dgate_up, dscore_part)."""
    E, D, F = w2_EDF.shape
    n_cap, dev = layout.n_cap, dout_TD.device
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    w2_desc = _desc(w2_EDF, (E * D, F), (bk, bn))
    dgu_desc = _desc(dgate_up, (n_cap, 2 * F), (bm // 2, bn // 2))  # the epilogue writes column halves
    hs_desc = _desc(hs, (n_cap, F), (bm // 2, bn // 2))
    gu_desc = _desc(gate_up_N2F, (n_cap, 2 * F), (bm, bn))  # the epilogue's gate / up tiles
    num_n = F // bn
    programs = _programs(dev, layout.n_tiles_cap * num_n, programs)
    launch(_gemm2_dgrad_ws_kernel, (programs,),
           dout_TD, w2_desc, dgu_desc, hs_desc, gu_desc, scores_TK, dscore_part, layout.row_pair,
           layout.tile_expert, layout.offsets, E, D, F, layout.top_k, num_n, cfg.group_m, cfg.stages, bm, bk,
           cfg.producer_regs, cfg.consumer_regs, cfg.split_n, num_warps=4, maxnreg=cfg.maxnreg)
    return dgate_up, dscore_part
