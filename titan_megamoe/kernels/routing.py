"""Routing metadata for the fused kernels: expert-major, block-aligned row layout, no host sync.

Shape legend: T tokens, K top_k, P = T*K (token, slot) pairs (pair p = t*K + k), E experts,
BM the GEMM row block, N_cap = P + E*(BM-1) rows (static upper bound of the padded layout),
n_tiles_cap = N_cap // BM (rounded up).

Layout: each expert's rows are contiguous, in ascending pair order (stable, so deterministic), and
padded to a multiple of BM; an expert with no pair has no rows and no tile. Row r of expert e lives
at ``offsets[e] + i``. Padding rows hold pair -1. Every buffer has a size known from (T, K, E, BM)
alone, so nothing is read back to the host and the whole layer can be captured in a CUDA graph;
kernels launch ``n_tiles_cap`` row tiles and return early on tiles whose expert is -1.

Example (T=2, K=2, E=3, BM=2; ids [[2, 0], [0, 1]], pairs p = 0..3 with experts [2, 0, 0, 1]):
counts [2, 1, 1] -> padded [2, 2, 2] -> offsets [0, 2, 4, 6];
row_pair = [1, 2, 3, -1, 0, -1, (-1 ...)]; pair_row = [4, 0, 1, 2]; tile_expert = [0, 1, 2, -1, ...].

Two builds, bitwise identical outputs:
    * ``build_routing_layout_triton``: two Triton kernels, two launches (``_count_kernel``,
      ``_layout_kernel``). The layer is launch-bound before its first GEMM, and the torch build costs
      ~20 launches (~10 us of host time each) for a few microseconds of device work.
    * ``build_routing_layout_torch``: ~20 small torch ops; the reference of the tests and the fallback.
``build_routing_layout`` picks the Triton build for CUDA tensors, and for CPU tensors when
``TRITON_INTERPRET=1`` (read at call time), else the torch build.

Triton build, with the pairs cut into S contiguous splits of CHUNK pairs (S, CHUNK static from P):
    1. ``_count_kernel``, grid (E, S): program (e, s) counts the pairs of expert e in split s ->
       hist[e, s].
    2. ``_layout_kernel``, grid (E + 1, S): every program reduces the whole (E, S) hist to counts and
       offsets (a few thousand int32 in registers, cheaper than a third launch); program (e, s) then
       rescans split s and places each pair of expert e at offsets[e] + (pairs of e in earlier splits)
       + (its rank among e's pairs of the split, a masked cumsum plus a running carry). Programs
       (e, 0) also write e's padding rows and tiles; the column e = E writes the tail past offsets[E].
Every output element has exactly one writer and no atomics are used, so the result is deterministic
(the same bits every run) and needs no zero-fill launch. The price is that each kernel compares
every pair against every expert (E * P compares, spread over E * S programs, ids read from L2).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from titan_megamoe.kernels.jit import interpreting as _interpreting
from titan_megamoe.kernels.launch import launch

try:  # triton is a Linux-only dependency: elsewhere only the torch build exists
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only on machines without triton
    triton = None

__all__ = [
    "RoutingLayout",
    "build_routing_layout",
    "build_routing_layout_torch",
    "build_routing_layout_triton",
    "layout_caps",
]
def layout_caps(T: int, K: int, E: int, block_m: int, max_rows: int | None = None) -> tuple[int, int]:
    """(N_cap, n_tiles_cap): rows and row tiles of the padded layout, for any routing.

    ``max_rows`` caps the placed pairs (the expert-parallel receive capacity): N_cap then holds
    min(T*K, max_rows) pairs plus the worst-case padding; pairs beyond it are not placed.
    """
    placed = T * K if max_rows is None else min(T * K, max_rows)
    n_cap = placed + E * (block_m - 1)
    n_tiles = -(-n_cap // block_m)
    return n_tiles * block_m, n_tiles


@dataclass
class RoutingLayout:
    """Expert-major padded layout of the (token, slot) pairs; all int32 device tensors.

    Attributes:
        counts: (E,) pairs per expert.
        offsets: (E + 1,) first padded row of each expert; offsets[E] = rows in use.
        row_pair: (N_cap,) pair id t*K + k of each padded row, -1 for padding / unused rows.
        pair_row: (P,) padded row of each pair, -1 for a pair not placed (id outside [0, E): the
            expert-parallel receive side marks slots owned by other ranks -1; or beyond ``max_rows``).
        tile_expert: (n_tiles_cap,) expert of each BM-row tile, -1 for tiles past the end.
        block_m, num_experts, top_k: the constants the layout was built for.
        max_rows: the cap on placed pairs the layout was built with (None: T*K). When counts sum to
            more (capacity overflow), offsets are clamped to N_cap, the pairs past it get pair_row -1,
            and the caller must raise (``counts`` stay exact, so it can tell).
    """

    counts: Tensor
    offsets: Tensor
    row_pair: Tensor
    pair_row: Tensor
    tile_expert: Tensor
    block_m: int
    num_experts: int
    top_k: int
    max_rows: int | None = None

    @property
    def n_cap(self) -> int:
        return self.row_pair.shape[0]

    @property
    def n_tiles_cap(self) -> int:
        return self.tile_expert.shape[0]


# --------------------------------------------------------------------------------------------------
# Triton build: two kernels, two launches
# --------------------------------------------------------------------------------------------------

#: Largest E the Triton build takes (one (E_PAD,) block of counts per program); above, the torch build.
MAX_TRITON_EXPERTS = 4096
#: Bound on E_PAD * S_PAD, the (E, S) hist every ``_layout_kernel`` program holds in registers: at
#: 4096 (e.g. 128 x 32) the sm_90a build takes 109 registers with 4 warps, at 8192 it took 254.
_HIST_MAX = 4096

if triton is not None:
    # tl.sum / tl.cumsum are @jit library functions: in the interpreter every call re-patches
    # triton.language (~3 ms, most of the CPU tests' time). tl.reduce / tl.associative_scan with their
    # combine function is what they expand to for int32 when compiled, and the interpreter maps that
    # combine function straight to numpy.
    _sum_combine = tl.standard._sum_combine

    @triton.jit
    def _count_kernel(
        ids_ptr,  # (P,) int32 or int64, expert of each pair, in [0, E)
        hist_ptr,  # (E, S) int32 out: pairs of expert e in split s
        P,  # i32, pairs
        CHUNK,  # i32, pairs per split, a multiple of BLOCK
        S,  # i32, splits
        BLOCK: tl.constexpr,  # pairs per loop step
    ):
        """Program (e, s) of grid (E, S) writes hist[e, s]: how many pairs of split s route to e.

        A plain compare-and-count, no atomics: each hist element has one writer, so the counts do not
        depend on scheduling.
        """
        e = tl.program_id(0)
        s = tl.program_id(1)
        lane = tl.arange(0, BLOCK)
        acc = tl.zeros([BLOCK], dtype=tl.int32)
        start = s * CHUNK
        end = tl.minimum(start + CHUNK, P)
        # while, not range(start, end, BLOCK): with numpy 2.4 the interpreter cannot turn a runtime
        # bound into a Python int (int() of a 1-element array); compiled, it is an scf.while.
        while start < end:
            offs = start + lane
            ids = tl.load(ids_ptr + offs, mask=offs < end, other=-1)  # -1 matches no expert
            acc += (ids == e).to(tl.int32)
            start += BLOCK
        tl.store(hist_ptr + e * S + s, tl.reduce(acc, 0, _sum_combine))

    @triton.jit
    def _layout_kernel(
        ids_ptr,  # (P,) int32 or int64, expert of each pair, in [0, E)
        hist_ptr,  # (E, S) int32, from _count_kernel
        counts_ptr,  # (E,) int32 out (program (0, 0))
        offsets_ptr,  # (E + 1,) int32 out (program (0, 0))
        row_pair_ptr,  # (N_CAP,) int32 out: pair of each row, -1 for padding and tail rows
        pair_row_ptr,  # (P,) int32 out: row of each pair
        tile_expert_ptr,  # (N_TILES,) int32 out: expert of each BM-row tile, -1 past offsets[E]
        P,  # i32, pairs
        CHUNK,  # i32, pairs per split, a multiple of BLOCK
        S,  # i32, splits
        E,  # i32, experts
        N_CAP,  # i32, rows of the layout
        N_TILES,  # i32, BM-row tiles of the layout
        BM: tl.constexpr,  # row block
        BM_PAD: tl.constexpr,  # next power of two >= BM (one masked block covers a padding run)
        E_PAD: tl.constexpr,  # next power of two >= E
        S_PAD: tl.constexpr,  # next power of two >= S
        BLOCK: tl.constexpr,  # pairs (rows, tiles) per loop step
    ):
        """Grid (E + 1, S). Every row, pair and tile entry is written by exactly one program:

        * (e, s), e < E: row_pair / pair_row of expert e's pairs in split s. Their rows start at
          offsets[e] + (pairs of e in splits < s) and follow pair order, so the layout is the stable
          (ascending pair) order of the torch build's argsort, without a sort and without atomics.
        * (e, 0), e < E: also e's padding rows [offsets[e] + counts[e], offsets[e + 1]) -> -1 and its
          tiles [offsets[e] // BM, offsets[e + 1] // BM) -> e.
        * (E, s): the tail, rows [offsets[E], N_CAP) -> -1 and tiles [offsets[E] // BM, N_TILES) -> -1,
          strided over the S programs.
        * (0, 0): counts and offsets.
        """
        e = tl.program_id(0)
        s = tl.program_id(1)
        ex = tl.arange(0, E_PAD)
        sx = tl.arange(0, S_PAD)
        # Each program rebuilds counts and offsets from the whole (E, S) hist (<= _HIST_MAX int32):
        # cheaper than a third launch that would compute them once.
        hist = tl.load(hist_ptr + ex[:, None] * S + sx[None, :], mask=(ex[:, None] < E) & (sx[None, :] < S),
                       other=0)
        counts = tl.reduce(hist, 1, _sum_combine)  # (E_PAD,), 0 past E
        padded = (counts + BM - 1) // BM * BM
        # clamped to N_CAP: on capacity overflow nothing is written past the buffers (the caller raises)
        ends = tl.minimum(tl.associative_scan(padded, 0, _sum_combine), N_CAP)  # ends[i] = offsets[i + 1]
        total = tl.minimum(tl.reduce(padded, 0, _sum_combine), N_CAP)  # offsets[E], rows in use
        if (e == 0) & (s == 0):
            tl.store(counts_ptr + ex, counts, mask=ex < E)
            tl.store(offsets_ptr + 1 + ex, ends, mask=ex < E)
            tl.store(offsets_ptr + ex, tl.zeros([E_PAD], dtype=tl.int32), mask=ex == 0)
        lane = tl.arange(0, BLOCK)
        if e < E:
            first = tl.minimum(tl.reduce(tl.where(ex < e, padded, 0), 0, _sum_combine), N_CAP)  # offsets[e]
            cnt = tl.reduce(tl.where(ex == e, counts, 0), 0, _sum_combine)
            last = tl.minimum(first + tl.reduce(tl.where(ex == e, padded, 0), 0, _sum_combine), N_CAP)
            # next free row of e: its pairs in earlier splits come first (row e of hist reloaded, so
            # the 2-D block is dead here and does not take registers through the loop)
            row = first + tl.reduce(tl.load(hist_ptr + e * S + sx, mask=sx < s, other=0), 0, _sum_combine)
            start = s * CHUNK
            end = tl.minimum(start + CHUNK, P)
            while start < end:  # while: see _count_kernel
                offs = start + lane
                ids = tl.load(ids_ptr + offs, mask=offs < end, other=-1)
                hit = ids == e
                hit_i = hit.to(tl.int32)
                # rank within the block = hits at or before the lane, minus one: keeps pair order
                rows = row + tl.associative_scan(hit_i, 0, _sum_combine) - 1
                fits = rows < last  # False only on capacity overflow
                tl.store(row_pair_ptr + rows, offs, mask=hit & fits)
                tl.store(pair_row_ptr + offs, tl.where(fits, rows, -1), mask=hit)
                row += tl.reduce(hit_i, 0, _sum_combine)
                start += BLOCK
            if s == 0:
                pad = first + cnt + tl.arange(0, BM_PAD)  # fewer than BM padding rows
                tl.store(row_pair_ptr + pad, tl.full([BM_PAD], -1, tl.int32), mask=pad < last)
                t = first // BM
                t_end = last // BM
                while t < t_end:
                    tiles = t + lane
                    tl.store(tile_expert_ptr + tiles, tl.zeros([BLOCK], dtype=tl.int32) + e, mask=tiles < t_end)
                    t += BLOCK
        else:
            r = total + s * BLOCK
            while r < N_CAP:
                rows = r + lane
                tl.store(row_pair_ptr + rows, tl.full([BLOCK], -1, tl.int32), mask=rows < N_CAP)
                r += S * BLOCK
            t = total // BM + s * BLOCK
            while t < N_TILES:
                tiles = t + lane
                tl.store(tile_expert_ptr + tiles, tl.full([BLOCK], -1, tl.int32), mask=tiles < N_TILES)
                t += S * BLOCK
            # pairs no expert program places (ids outside [0, E): slots of other EP ranks) -> -1
            start = s * CHUNK
            end = tl.minimum(start + CHUNK, P)
            while start < end:
                offs = start + lane
                ids = tl.load(ids_ptr + offs, mask=offs < end, other=0)
                tl.store(pair_row_ptr + offs, tl.full([BLOCK], -1, tl.int32),
                         mask=(offs < end) & ((ids < 0) | (ids >= E)))
                start += BLOCK


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@functools.lru_cache(maxsize=None)
def _split_plan(P: int, E: int, block: int, chunk: int | None) -> tuple[int, int]:
    """(S, CHUNK): P pairs cut into S splits of CHUNK (a multiple of ``block``) pairs, static from P.

    Enough splits that each program scans about 4 blocks (parallelism along P, not only along E),
    but E_PAD * S_PAD <= _HIST_MAX so the hist fits in registers; no empty split.
    """
    if chunk is None:
        s_cap = max(1, _HIST_MAX // _next_pow2(E))
        s_cap = 1 << (s_cap.bit_length() - 1)  # a power of two, so S_PAD <= s_cap too
        S = max(1, min(-(-P // (4 * block)), s_cap))
        chunk = -(-P // S)
    chunk = max(block, -(-chunk // block) * block)
    S = max(1, -(-P // chunk))
    if _next_pow2(E) * _next_pow2(S) > _HIST_MAX:
        raise ValueError(f"chunk={chunk} gives {S} splits: hist ({E} x {S}) larger than {_HIST_MAX}")
    return S, chunk


def _empty_i32(n: int, device) -> Tensor:
    """torch.empty of int32; a separate function so tests can poison the buffers (every element must
    be written by the kernels)."""
    return torch.empty(n, dtype=torch.int32, device=device)


#: Each array of one allocation starts on a 128-byte boundary (32 int32): the alignment separate allocations
#: have, so the kernels get the same specialization (16-byte aligned pointers) and aligned vector accesses.
_PART_ALIGN = 32


@functools.lru_cache(maxsize=None)
def _parts_split(sizes: tuple[int, ...]) -> tuple[int, tuple[int, ...]]:
    split: list[int] = []
    for n in sizes:
        split += [n, -n % _PART_ALIGN]
    return sum(split), tuple(split)


def _empty_i32_parts(sizes: tuple[int, ...], device) -> tuple[Tensor, ...]:
    """Uninitialized int32 arrays of ``sizes`` as views of one allocation: one ``torch.empty`` and one
    ``split_with_sizes`` instead of an allocation each (the forward is host-bound until GEMM1 is enqueued,
    and a CUDA allocation costs ~11 us of host time on the H200 machines, docs/NOTES.md session 13)."""
    total, split = _parts_split(sizes)
    return _empty_i32(total, device).split_with_sizes(split)[::2]


def build_routing_layout_triton(topk_ids_TK: Tensor, num_experts: int, block_m: int, *, block: int | None = None,
                                chunk: int | None = None, max_rows: int | None = None,
                                one_allocation: bool = False) -> RoutingLayout:
    """Build the layout with two Triton kernels (two launches, no host sync, no atomics).

    Same contract and bitwise the same result as ``build_routing_layout_torch``.

    Args:
        topk_ids_TK: (T, K) int32 or int64 expert ids; ids outside [0, num_experts) are not placed
            (pair_row -1). Other integer dtypes are cast to int32 first (one more launch); on CUDA,
            or on CPU under ``TRITON_INTERPRET=1``.
        num_experts: E, at most ``MAX_TRITON_EXPERTS``.
        block_m: BM, the row block of the grouped GEMMs.
        block: pairs per loop step of the kernels (a power of two); default 1024 compiled, 256 in the
            interpreter (whose cost is per operation, nearly whatever the block size).
        chunk: pairs per split (rounded up to a multiple of ``block``); default from P compiled (see
            ``_split_plan``), one split in the interpreter. Tests set both small to cover several
            steps and several splits.
        max_rows: cap on placed pairs (see ``layout_caps``); None: T*K.
        one_allocation: the arrays as 128-byte-aligned views of one ``torch.empty`` (one allocation instead of
            six: host time before GEMM1). Not for a custom op's outputs, which must not alias each other.

    Returns:
        RoutingLayout (see its attributes).
    """
    if triton is None:
        raise RuntimeError("triton is not installed: use build_routing_layout_torch")
    T, K = topk_ids_TK.shape
    E, BM = num_experts, block_m
    if E > MAX_TRITON_EXPERTS:
        raise ValueError(f"num_experts={E} > {MAX_TRITON_EXPERTS}: use build_routing_layout_torch")
    dev = topk_ids_TK.device
    P = T * K
    n_cap, n_tiles = layout_caps(T, K, E, BM, max_rows)
    ids_P = topk_ids_TK.reshape(-1)  # a view when contiguous (no launch)
    if ids_P.dtype not in (torch.int32, torch.int64):
        ids_P = ids_P.to(torch.int32)
    ids_P = ids_P.contiguous()
    interp = _interpreting()
    if block is None:
        block = 256 if interp else 1024
    if chunk is None and interp:
        chunk = P  # one split: the interpreter runs programs one after another, more only cost time
    if block & (block - 1):
        raise ValueError(f"block={block} is not a power of two")
    S, chunk = _split_plan(P, E, block, chunk)
    # Uninitialized (an allocation, no launch): the kernels write every element.
    if one_allocation:
        hist, counts, offsets, row_pair, pair_row, tile_expert = _empty_i32_parts(
            (E * S, E, E + 1, n_cap, P, n_tiles), dev)
    else:
        hist, counts, offsets = _empty_i32(E * S, dev), _empty_i32(E, dev), _empty_i32(E + 1, dev)
        row_pair, pair_row, tile_expert = _empty_i32(n_cap, dev), _empty_i32(P, dev), _empty_i32(n_tiles, dev)
    opts = {} if interp else dict(num_warps=4)
    launch(_count_kernel, (E, S), ids_P, hist, P, chunk, S, BLOCK=block, **opts)
    launch(_layout_kernel, (E + 1, S),
        ids_P, hist, counts, offsets, row_pair, pair_row, tile_expert, P, chunk, S, E, n_cap, n_tiles,
        BM=BM, BM_PAD=_next_pow2(BM), E_PAD=_next_pow2(E), S_PAD=_next_pow2(S), BLOCK=block, **opts,
    )
    return RoutingLayout(counts=counts, offsets=offsets, row_pair=row_pair, pair_row=pair_row,
                         tile_expert=tile_expert, block_m=BM, num_experts=E, top_k=K, max_rows=max_rows)


def _use_triton(topk_ids_TK: Tensor, num_experts: int) -> bool:
    if triton is None or num_experts > MAX_TRITON_EXPERTS:
        return False
    return topk_ids_TK.is_cuda or (topk_ids_TK.device.type == "cpu" and _interpreting())


def build_routing_layout(topk_ids_TK: Tensor, num_experts: int, block_m: int,
                         max_rows: int | None = None, *, one_allocation: bool = False) -> RoutingLayout:
    """Build the padded expert-major layout from top-k ids with device work only (no host sync).

    Dispatches to ``build_routing_layout_triton`` (two launches) for CUDA tensors, and for CPU tensors
    when ``TRITON_INTERPRET=1``; otherwise (CPU without the interpreter, no triton, E above
    ``MAX_TRITON_EXPERTS``) to ``build_routing_layout_torch``. Both give bitwise the same layout.

    Args:
        topk_ids_TK: (T, K) integer expert ids in [0, num_experts) (ids outside give undefined layout;
            the op checks them up front).
        num_experts: E.
        block_m: BM, the row block of the grouped GEMMs (a power of two).
        one_allocation: see ``build_routing_layout_triton`` (the torch build ignores it).

    Returns:
        RoutingLayout (see its attributes).
    """
    if _use_triton(topk_ids_TK, num_experts):
        return build_routing_layout_triton(topk_ids_TK, num_experts, block_m, max_rows=max_rows,
                                           one_allocation=one_allocation)
    return build_routing_layout_torch(topk_ids_TK, num_experts, block_m, max_rows=max_rows)


def build_routing_layout_torch(topk_ids_TK: Tensor, num_experts: int, block_m: int,
                               max_rows: int | None = None) -> RoutingLayout:
    """Reference build of the layout from ~20 torch device ops (no host sync); the fallback where the
    Triton kernels cannot run, and the reference of the tests.

    Args:
        topk_ids_TK: (T, K) integer expert ids in [0, num_experts) (ids outside give undefined layout;
            the op checks them up front).
        num_experts: E.
        block_m: BM, the row block of the grouped GEMMs (a power of two).

    Returns:
        RoutingLayout (see its attributes).
    """
    T, K = topk_ids_TK.shape
    E, BM = num_experts, block_m
    dev = topk_ids_TK.device
    P = T * K
    n_cap, n_tiles = layout_caps(T, K, E, BM, max_rows)
    ids_P = topk_ids_TK.reshape(-1).to(torch.int64)
    # ids outside [0, E) go to a virtual expert E: sorted last, never placed.
    ids_P = torch.where((ids_P >= 0) & (ids_P < E), ids_P, torch.full_like(ids_P, E))
    # scatter_add instead of bincount: bincount reads max() back to the host.
    counts_x = torch.zeros(E + 1, dtype=torch.int64, device=dev).scatter_add_(0, ids_P, torch.ones_like(ids_P))
    counts = counts_x[:E]
    padded = (counts + BM - 1) // BM * BM
    offsets = torch.zeros(E + 1, dtype=torch.int64, device=dev)
    offsets[1:] = torch.cumsum(padded, 0).clamp(max=n_cap)  # clamped: capacity overflow writes nothing
    order = torch.argsort(ids_P, stable=True)  # pairs grouped by expert, ascending pair id within
    sorted_ids = ids_P[order]
    starts = torch.cumsum(counts_x, 0) - counts_x  # unpadded start of each expert in `order`
    rank_in_expert = torch.arange(P, device=dev) - starts[sorted_ids]
    ends_x = torch.cat([offsets[1:], offsets[-1:]])  # the virtual expert E has no rows
    first_x = torch.cat([offsets[:-1], offsets[-1:]])
    rows = first_x[sorted_ids] + rank_in_expert
    placed = (sorted_ids < E) & (rows < ends_x[sorted_ids])
    # unplaced pairs write into a sink row past the end (no boolean indexing: that syncs the host)
    sink = torch.full((n_cap + 1,), -1, dtype=torch.int32, device=dev)
    sink[torch.where(placed, rows, n_cap)] = order.to(torch.int32)
    row_pair = sink[:n_cap]
    pair_row = torch.empty(P, dtype=torch.int32, device=dev)
    pair_row[order] = torch.where(placed, rows, -1).to(torch.int32)
    tile_start = torch.arange(n_tiles, device=dev) * BM
    tile_expert = torch.searchsorted(offsets[1:], tile_start, right=True)  # first expert ending after
    tile_expert = torch.where(tile_start < offsets[E], tile_expert, torch.full_like(tile_expert, -1))
    return RoutingLayout(
        counts=counts.to(torch.int32), offsets=offsets.to(torch.int32), row_pair=row_pair,
        pair_row=pair_row, tile_expert=tile_expert.to(torch.int32), block_m=BM, num_experts=E, top_k=K,
        max_rows=max_rows,
    )
