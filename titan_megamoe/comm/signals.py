"""Bounded cross-rank waits of the expert-parallel path: a flag barrier that never hangs, a device
status word that records who did not arrive, and the host check that turns it into an error.

Shape legend: R EP ranks. Every rank's symmetric buffer ends with a *sync area* of ``SYNC_BYTES``
(int32 words, zeroed at creation): word p holds the epoch of the last barrier rank p signalled to
this rank. Each rank also owns two local device tensors: ``epoch`` (1,) int32, the number of barriers
it has entered, incremented by the barrier kernel itself (so a CUDA-graph replay advances it too), and
``status`` (4,) int32 = [code, rank that did not arrive, epoch, site], all zero while healthy.

Why not ``torch.distributed._symmetric_memory``'s ``barrier(channel, timeout_ms)``: it is bounded,
but on timeout it prints ``[FATAL] SymmetricMemory::barrier: rank r failed to receive signal from
rank p`` and executes ``__trap()``; the CUDA context is then dead (the next sync raises "unspecified
launch failure" with no layer, no phase) and nothing can be reported from Python. With
``timeout_ms=0`` it waits forever. Here a timed-out wait writes ``status`` and returns; every later
wait of the process sees the code and skips waiting (fail fast, so the queued work drains in
milliseconds instead of one timeout per barrier); the host raises ``PeerTimeoutError`` naming the
layer, the phase, this rank and the missing rank at the next EP call (``WaitMonitor``, no sync).

Protocol (DESIGN.md section 7): the kernel stores epoch e into word ``rank`` of every peer's sync
area with a release atomic at system scope (the stores of earlier kernels on the stream are complete
and ordered before it), then polls its own words with acquire atomics until every peer's word is
>= e (signed difference, so the int32 epoch may wrap). ">=" and not "==": a fast peer may already be
in barrier e+1 and have overwritten e. Bound: ``globaltimer`` deadline on GPUs; an iteration cap in
the interpreter (no clock there: ``timeout_ms * INTERP_POLLS_PER_MS`` polls, >= timeout_ms of wall
time at the interpreter's >= 1 ms per poll).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from titan_megamoe.errors import PeerTimeoutError
from titan_megamoe.kernels.jit import interpreting as _interpreting
from titan_megamoe.kernels.launch import launch

__all__ = ["SYNC_BYTES", "SITES", "site_code", "PeerSync", "WaitMonitor", "barrier_wait", "RowArrival",
           "wait_flags"]

SYNC_BYTES = 256  # 64 int32 words: R <= 64 barrier flags
INTERP_POLLS_PER_MS = 1  # measured 1-2.5 ms per poll in the interpreter (CPU, 2026-11-30)
#: Wait sites (the status word stores the index): names used in errors.
SITES = ["init", "fwd.before_dispatch", "fwd.after_dispatch", "fwd.after_combine_push",
         "bwd.before_dispatch", "bwd.after_dispatch", "bwd.after_combine_push", "test",
         "fwd.gemm1 waiting for x rows (v2 arrival flags)"]


def site_code(name: str) -> int:
    """Index of a wait site in ``SITES`` (ValueError for an unknown name)."""
    try:
        return SITES.index(name)
    except ValueError:
        raise ValueError(f"unknown wait site {name!r}; known: {SITES}") from None


@triton.jit
def _now_ns(USE_TIMER: tl.constexpr):
    if USE_TIMER:
        t = tl.extra.cuda.globaltimer()
    else:
        t = tl.full((), 0, tl.int64)
    return t


@triton.jit
def _barrier_kernel(
    peer_bases,        # address of R uint64 buffer bases (symmetric memory / shared-memory table)
    epoch_ptr,         # (1,) int32 this rank's barrier count (read, +1, written back)
    status_ptr,        # (4,) int32 [code, missing rank, epoch, site], 0 while healthy
    OFF_SYNC,          # i64 byte offset of the sync area in every buffer
    rank, site,        # i32
    max_polls,         # i32 poll cap (interpreter bound; huge on GPUs)
    timeout_ns,        # i64 deadline from entry (GPUs)
    R: tl.constexpr, USE_TIMER: tl.constexpr,
):
    """Grid (1,), one warp. Signal every peer (epoch e into its sync word ``rank``, release, system
    scope), then wait for every peer's word >= e (acquire) unless ``status`` already holds an error.
    On timeout: status = [1, first missing rank, e, site] (if it was 0) and return."""
    e = tl.load(epoch_ptr) + 1
    tl.store(epoch_ptr, e)
    for p in tl.static_range(R):
        if p != rank:
            base = tl.load(peer_bases.to(tl.pointer_type(tl.uint64)) + p).to(tl.pointer_type(tl.int8))
            tl.atomic_xchg((base + OFF_SYNC).to(tl.pointer_type(tl.int32)) + rank, e, sem="release", scope="sys")
    me = tl.load(peer_bases.to(tl.pointer_type(tl.uint64)) + rank).to(tl.pointer_type(tl.int8))
    flags = (me + OFF_SYNC).to(tl.pointer_type(tl.int32))
    healthy = tl.load(status_ptr) == 0  # after a timeout, never wait again (fail fast)
    missing = -1
    t0 = _now_ns(USE_TIMER)
    for p in tl.static_range(R):
        if p != rank:
            v = tl.atomic_add(flags + p, 0, sem="acquire", scope="sys")
            i = 0
            late = healthy & ((v - e) < 0)
            while late:
                v = tl.atomic_add(flags + p, 0, sem="acquire", scope="sys")
                i += 1
                late = ((v - e) < 0) & (i < max_polls) & ((_now_ns(USE_TIMER) - t0) < timeout_ns)
            if healthy & ((v - e) < 0) & (missing < 0):
                missing = p
    if missing >= 0:
        if tl.atomic_cas(status_ptr, 0, 1) == 0:
            tl.store(status_ptr + 1, missing)
            tl.store(status_ptr + 2, e)
            tl.store(status_ptr + 3, site)


@triton.jit
def wait_flags(flags_ptr, epoch_ptr, status_ptr, g_lo, g_hi, max_polls, timeout_ns,
               NB: tl.constexpr, SITE: tl.constexpr, USE_TIMER: tl.constexpr):
    """Device helper (overlap v2): wait until ``flags[g] == epoch`` for g = g_lo .. g_hi (int32
    scalars; g = source * NB + block), polling with acquire atomics at system scope, in order. Bounded
    by ``max_polls`` polls in all / ``timeout_ns`` since entry; skipped when ``status`` already holds
    an error (fail fast). On timeout: status = [2, source rank of the late block, epoch, SITE] (first
    writer wins) and return; the caller computes on whatever the rows hold (the host raises later).
    Called by all threads of a program; the polled value is broadcast by Triton (one thread loads,
    shared memory + CTA barrier), so every thread's later loads are ordered after the acquire."""
    e = tl.load(epoch_ptr)
    healthy = tl.load(status_ptr) == 0
    t0 = _now_ns(USE_TIMER)
    g = g_lo
    late = g_lo * 0 - 1
    polls = g_lo * 0
    while (g <= g_hi) & (late < 0) & healthy:
        v = tl.atomic_add(flags_ptr + g, 0, sem="acquire", scope="sys")
        arrived = v == e
        polls = tl.where(arrived, polls, polls + 1)
        timed = (~arrived) & ((polls >= max_polls) | ((_now_ns(USE_TIMER) - t0) >= timeout_ns))
        late = tl.where(timed, g, late)
        g = tl.where(arrived, g + 1, g)
    if late >= 0:
        if tl.atomic_cas(status_ptr, 0, 2) == 0:
            tl.store(status_ptr + 1, late // NB)
            tl.store(status_ptr + 2, e)
            tl.store(status_ptr + 3, SITE)


@dataclass(frozen=True)
class RowArrival:
    """What GEMM1 needs to wait for the v2 dispatch's rows (``gemm1_swiglu_fwd(..., wait=...)``).

    Attributes:
        flags: (R * NB,) int32 view of this rank's xflag region; epoch / status: ``PeerSync``'s.
        t_cap, flag_block, n_blocks: T_cap, FB, NB (slab row j = src * T_cap + t lives in flag block
            src * NB + t // FB).
        max_polls, timeout_ns, use_timer: ``PeerSync.poll_bounds()``; site: ``site_code(...)``.
    """

    flags: torch.Tensor
    epoch: torch.Tensor
    status: torch.Tensor
    t_cap: int
    flag_block: int
    n_blocks: int
    max_polls: int
    timeout_ns: int
    use_timer: bool
    site: int


class PeerSync:
    """This rank's side of the bounded waits: ``epoch`` and ``status`` device tensors, the timeout.

    Args:
        rank, world: this rank, R.
        ptr_table: device address of the R buffer bases (``Peers.ptr_table()``).
        sync_offset: byte offset of the sync area (same in every rank's buffer, zeroed before use).
        device: where ``epoch`` / ``status`` live (the buffers' device).
        timeout_ms: bound of every wait (> 0).
    """

    def __init__(self, rank: int, world: int, ptr_table: int, sync_offset: int, device, timeout_ms: int):
        if timeout_ms <= 0:
            raise ValueError(f"timeout_ms must be > 0 (every EP wait is bounded), got {timeout_ms}")
        if world > SYNC_BYTES // 4:
            raise ValueError(f"at most {SYNC_BYTES // 4} EP ranks, got {world}")
        self.rank, self.world, self.timeout_ms = rank, world, timeout_ms
        self.ptr_table, self.sync_offset = ptr_table, sync_offset
        self.epoch = torch.zeros(1, dtype=torch.int32, device=device)
        self.status = torch.zeros(4, dtype=torch.int32, device=device)

    def poll_bounds(self) -> tuple[int, int, bool]:
        """(max polls, timeout ns, use the GPU clock) for the wait kernels."""
        if _interpreting():
            return max(1, self.timeout_ms * INTERP_POLLS_PER_MS), 2**62, False
        return 2**31 - 1, self.timeout_ms * 1_000_000, True

    def barrier(self, site: str = "test") -> None:
        """Stream-ordered bounded barrier over the R ranks (one launch, no host sync)."""
        barrier_wait(self, site_code(site))

    def row_arrival(self, flags_RNB: torch.Tensor, t_cap: int, flag_block: int) -> RowArrival:
        """The GEMM1 wait of overlap v2 on this rank's ``flags_RNB`` (R, NB) int32 xflag region."""
        polls, tns, timer = self.poll_bounds()
        return RowArrival(flags_RNB.reshape(-1), self.epoch, self.status, t_cap, flag_block, flags_RNB.shape[1],
                          polls, tns, timer, site_code("fwd.gemm1 waiting for x rows (v2 arrival flags)"))

    def describe(self, status: list[int], layer: str) -> str:
        """The error message of a non-zero status (see ``WaitMonitor``)."""
        code, missing, epoch, site = status
        where = SITES[site] if 0 <= site < len(SITES) else f"site {site}"
        who = f"the x rows of rank {missing} never arrived" if code == 2 else f"rank {missing} never arrived"
        return (f"{layer}: expert-parallel rank {self.rank} waited {self.timeout_ms} ms at '{where}' (wait "
                f"#{epoch} of this rank) and {who}; this call's results (and those of "
                f"the calls queued after it) are wrong. Check rank {missing}'s log (crash, out of memory, hang "
                "before this layer); check that every EP rank runs the same MoE layers in the same order, the "
                "same number of micro-batches and every backward (a layer or backward skipped on one rank "
                "desynchronizes the EP waits); if a rank is legitimately slower (first-call Triton compile, "
                "a checkpoint save), raise the timeout (titan_megamoe.ops.ep_library.set_timeout_ms, before the first EP call).")


def barrier_wait(sync: PeerSync, site: int) -> None:
    polls, tns, timer = sync.poll_bounds()
    launch(_barrier_kernel, (1,),
        sync.ptr_table, sync.epoch, sync.status, sync.sync_offset, sync.rank, site, polls, tns,
        R=sync.world, USE_TIMER=timer, **({} if _interpreting() else {"num_warps": 1}),
    )


class WaitMonitor:
    """Pending (layer, status copy) records of this process: the lazy host check of ``status``.

    ``record`` queues an asynchronous copy of a rank's status after a call (pinned memory + event on
    GPUs; nothing while a CUDA graph is captured); ``check`` raises for the first landed record with
    a non-zero code without waiting for the others (no host sync); ``flush`` waits for all.
    """

    def __init__(self) -> None:
        self._pending: list[tuple[str, PeerSync, torch.Tensor, object]] = []

    def record(self, layer: str, sync: PeerSync) -> None:
        st = sync.status
        if st.is_cuda:
            if torch.cuda.is_current_stream_capturing():
                return
            host = torch.empty(4, dtype=torch.int32, pin_memory=True)
            host.copy_(st, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host, event = st.clone(), None
        self._pending.append((layer, sync, host, event))

    def check(self, wait: bool = False) -> None:
        """Raises:
            PeerTimeoutError: naming the layer, the phase, this rank and the rank that never arrived.
        """
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return  # cudaEventQuery is not permitted while a CUDA graph is being captured
        keep = []
        for layer, sync, host, event in self._pending:
            if event is not None and not wait and not event.query():
                keep.append((layer, sync, host, event))
                continue
            if event is not None and wait:
                event.synchronize()
            st = [int(v) for v in host.tolist()]
            if st[0] != 0:
                self._pending = []
                raise PeerTimeoutError(sync.describe(st, layer))
        self._pending = keep

    def flush(self) -> None:
        self.check(wait=True)
