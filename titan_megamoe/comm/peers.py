"""The ranks that share the expert-parallel workspace: PyTorch symmetric memory on GPUs, or emulated
peers in one process (CPU tests, Triton interpreter).

A ``Peers`` object gives this rank's workspace buffer, the device address of a table holding every
rank's buffer address (what the kernels index by rank, DESIGN.md section 7), and a barrier. Every
buffer is ``nbytes`` of workspace followed by the sync area of ``comm/signals.py`` (at
``sync_offset(nbytes)``, zeroed before the first wait); ``peers.sync`` is this rank's ``PeerSync``
(epoch, status, timeout) and the barrier is its bounded flag barrier, except for the emulated group
(lockstep, no barrier to wait in).
"""

from __future__ import annotations

from typing import Protocol

import torch

__all__ = ["Peers", "EmulatedPeers", "emulated_group", "SharedMemPeers", "SymmMemPeers", "check_one_host",
           "make_peers", "sync_offset", "DEFAULT_TIMEOUT_MS"]

#: Bound of every cross-rank wait unless the caller passes another (first-call Triton compiles of a
#: slow rank take tens of seconds; a training step is far shorter).
DEFAULT_TIMEOUT_MS = 120_000


def sync_offset(nbytes: int) -> int:
    """Byte offset of the sync area after ``nbytes`` of workspace (256-byte aligned)."""
    return -(-nbytes // 256) * 256


def _total(nbytes: int) -> int:
    from titan_megamoe.comm.signals import SYNC_BYTES

    return sync_offset(nbytes) + SYNC_BYTES


class Peers(Protocol):
    rank: int
    world: int

    def buffer(self) -> torch.Tensor:
        """This rank's workspace, a uint8 tensor of the layout's ``nbytes``."""

    def ptr_table(self) -> int:
        """Device address of an array of ``world`` uint64: every rank's buffer address."""

    def barrier(self, site: str = "test") -> None:
        """Stream-ordered barrier over the ranks: every rank's earlier work on its stream is done
        (and visible) before any rank's later work starts. Bounded: a rank that does not arrive
        within the timeout is recorded in ``sync.status`` (``comm/signals.py``), never waited for
        forever. ``site``: a name of ``signals.SITES``, for the error."""


class EmulatedPeers:
    """One rank of an in-process group (see ``emulated_group``). The barrier waits for nothing (the
    caller runs every rank's steps in lockstep, ``ops.ep_backend.run_lockstep``); it only advances
    this rank's epoch, as the real barrier kernel does."""

    def __init__(self, rank: int, bufs: list[torch.Tensor], table: torch.Tensor, nbytes: int,
                 timeout_ms: int = DEFAULT_TIMEOUT_MS):
        from titan_megamoe.comm.signals import PeerSync

        self.rank, self.world = rank, len(bufs)
        self._bufs, self._table, self._nbytes = bufs, table, nbytes
        self.sync = PeerSync(rank, self.world, table.data_ptr(), sync_offset(nbytes), bufs[rank].device, timeout_ms)

    def buffer(self) -> torch.Tensor:
        return self._bufs[self.rank][:self._nbytes]

    def ptr_table(self) -> int:
        return self._table.data_ptr()

    def barrier(self, site: str = "test") -> None:
        self.sync.epoch += 1


def emulated_group(world: int, nbytes: int, device="cpu", timeout_ms: int = DEFAULT_TIMEOUT_MS) -> list[EmulatedPeers]:
    """``world`` emulated ranks in this process, each with its own ``nbytes`` buffer (plus the sync
    area, zeroed), filled with 0xFF bytes (poison: NaN for floats, -1 for ints) so a read of a
    never-written row shows."""
    bufs = [torch.full((_total(nbytes),), 255, dtype=torch.uint8, device=device) for _ in range(world)]
    for b in bufs:
        b[sync_offset(nbytes):].zero_()
    table = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64, device=device)
    return [EmulatedPeers(r, bufs, table, nbytes, timeout_ms) for r in range(world)]


class SymmMemPeers:
    """This process's rank in ``group``, over one PyTorch symmetric-memory allocation (CUDA backend,
    NVLink multicast never used). Collective: every rank of the group constructs it in the same order.

    Args:
        group: the expert-parallel process group (NCCL).
        nbytes: workspace bytes (``WorkspaceLayout.nbytes``).
        timeout_ms: bound of every wait; a peer that never arrives is reported (``PeerTimeoutError``
            from ``signals.WaitMonitor``) instead of hanging.
    """

    def __init__(self, group, nbytes: int, timeout_ms: int = DEFAULT_TIMEOUT_MS):
        import torch.distributed as dist
        import torch.distributed._symmetric_memory as symm_mem

        from titan_megamoe.comm.signals import PeerSync

        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self._nbytes = nbytes
        dev = torch.device("cuda", torch.cuda.current_device())
        self._buf = symm_mem.empty(_total(nbytes), dtype=torch.uint8, device=dev)
        self._buf.fill_(255)  # poison, as the emulated group; then the sync area must start at 0
        self._buf[sync_offset(nbytes):].zero_()
        self._handle = symm_mem.rendezvous(self._buf, group.group_name)
        torch.cuda.synchronize(dev)
        # torch's barrier once, at creation (it traps on timeout, acceptable here: no layer yet)
        self._handle.barrier(channel=0, timeout_ms=timeout_ms)
        self.sync = PeerSync(self.rank, self.world, self._handle.buffer_ptrs_dev, sync_offset(nbytes), dev,
                             timeout_ms)

    def buffer(self) -> torch.Tensor:
        return self._buf[:self._nbytes]

    def ptr_table(self) -> int:
        return self._handle.buffer_ptrs_dev

    def barrier(self, site: str = "test") -> None:
        self.sync.barrier(site)


class SharedMemPeers:
    """This process's rank in a CPU (gloo) ``group``, over one shared-memory file per rank (/dev/shm)
    that every rank maps: the kernels (Triton interpreter) store into a peer's mapping exactly as they
    store into a peer's symmetric buffer on GPUs. For CPU tests of the whole layer at EP > 1 in real
    processes. Collective: every rank constructs it in the same order.

    Args:
        group: a gloo process group; nbytes: workspace bytes; tag: distinguishes workspaces;
        timeout_ms: bound of every wait (the flag barrier runs in the interpreter, as on GPUs).
    """

    def __init__(self, group, nbytes: int, tag: str, timeout_ms: int = DEFAULT_TIMEOUT_MS):
        import os
        import tempfile

        import torch.distributed as dist

        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self._group = group
        root = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        # rank 0 names the run (pid) so concurrent test runs never share files
        name = [f"{root}/megamoe_ws_{os.getpid()}_{tag}" if self.rank == 0 else None]
        dist.broadcast_object_list(name, src=dist.get_global_rank(group, 0), group=group)
        paths = [f"{name[0]}_{r}" for r in range(self.world)]
        with open(paths[self.rank], "wb") as f:
            f.truncate(_total(nbytes))
        dist.barrier(group=group)
        self._bufs = [torch.from_file(p, shared=True, size=_total(nbytes), dtype=torch.uint8) for p in paths]
        self._bufs[self.rank].fill_(255)  # poison, as the emulated group
        self._bufs[self.rank][sync_offset(nbytes):].zero_()
        self._table = torch.tensor([b.data_ptr() for b in self._bufs], dtype=torch.int64)
        self._nbytes = nbytes
        dist.barrier(group=group)
        os.unlink(paths[self.rank])  # the mappings stay valid; nothing is left in /dev/shm
        from titan_megamoe.comm.signals import PeerSync

        self.sync = PeerSync(self.rank, self.world, self._table.data_ptr(), sync_offset(nbytes),
                             torch.device("cpu"), timeout_ms)

    def buffer(self) -> torch.Tensor:
        return self._bufs[self.rank][:self._nbytes]

    def ptr_table(self) -> int:
        return self._table.data_ptr()

    def barrier(self, site: str = "test") -> None:
        self.sync.barrier(site)


def _machine() -> tuple[str, str]:
    """(host name, machine id): the kernel's boot id where Linux gives one (containers on one node share it, nodes
    with equal host names do not), else the host name."""
    import socket

    name = socket.gethostname()
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return name, f.read().strip() or name
    except OSError:
        return name, name


def check_one_host(group) -> None:
    """Raise unless every rank of ``group`` runs on this machine (collective: one all-gather of machine ids).

    The workspace is one symmetric-memory allocation that every rank maps through NVLink (on CPU, a shared-memory
    file), which only ranks of one node can do; across nodes the allocation would fail in CUDA's IPC, or hang.

    Raises:
        UnsupportedModelError: the ranks are on several machines, with their host names and what to set instead.
    """
    import torch.distributed as dist

    from titan_megamoe.errors import UnsupportedModelError

    machines: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(machines, _machine(), group=group)
    if len({mid for _, mid in machines}) > 1:
        names = sorted({name for name, _ in machines})
        raise UnsupportedModelError(
            f"megamoe's expert parallelism runs over NVLink inside one node, but this EP group of {len(machines)} "
            f"ranks spans {len({mid for _, mid in machines})} machines (hosts {', '.join(names[:4])}"
            f"{', ...' if len(names) > 4 else ''}): set [parallelism] expert_parallel_degree to at most the GPUs of "
            "one node")


def make_peers(group, nbytes: int, tag: str, timeout_ms: int = DEFAULT_TIMEOUT_MS):
    """Symmetric memory for an NCCL group on GPUs; shared-memory files for a gloo group on CPU.

    Raises:
        UnsupportedModelError: the group's ranks are on several hosts (``check_one_host``).
    """
    import torch.distributed as dist

    check_one_host(group)
    if dist.get_backend(group) == "gloo":
        return SharedMemPeers(group, nbytes, tag, timeout_ms)
    return SymmMemPeers(group, nbytes, timeout_ms)
