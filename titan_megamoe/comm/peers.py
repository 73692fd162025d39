"""The ranks that share the expert-parallel workspace: PyTorch symmetric memory on GPUs, or emulated
peers in one process (CPU tests, Triton interpreter).

A ``Peers`` object gives this rank's workspace buffer, the device address of a table holding every
rank's buffer address (what the kernels index by rank, DESIGN.md section 7), and a barrier.
"""

from __future__ import annotations

from typing import Protocol

import torch

__all__ = ["Peers", "EmulatedPeers", "emulated_group", "SharedMemPeers", "SymmMemPeers", "make_peers"]


class Peers(Protocol):
    rank: int
    world: int

    def buffer(self) -> torch.Tensor:
        """This rank's workspace, a uint8 tensor of the layout's ``nbytes``."""

    def ptr_table(self) -> int:
        """Device address of an array of ``world`` uint64: every rank's buffer address."""

    def barrier(self) -> None:
        """Stream-ordered barrier over the ranks: every rank's earlier work on its stream is done
        (and visible) before any rank's later work starts."""


class EmulatedPeers:
    """One rank of an in-process group (see ``emulated_group``). The barrier is a no-op: the caller
    runs every rank's steps in lockstep (``ops.ep_backend.run_lockstep``)."""

    def __init__(self, rank: int, bufs: list[torch.Tensor], table: torch.Tensor):
        self.rank, self.world = rank, len(bufs)
        self._bufs, self._table = bufs, table

    def buffer(self) -> torch.Tensor:
        return self._bufs[self.rank]

    def ptr_table(self) -> int:
        return self._table.data_ptr()

    def barrier(self) -> None:
        pass


def emulated_group(world: int, nbytes: int, device="cpu") -> list[EmulatedPeers]:
    """``world`` emulated ranks in this process, each with its own ``nbytes`` buffer, filled with
    0xFF bytes (poison: NaN for floats, -1 for ints) so a read of a never-written row shows."""
    bufs = [torch.full((nbytes,), 255, dtype=torch.uint8, device=device) for _ in range(world)]
    table = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64, device=device)
    return [EmulatedPeers(r, bufs, table) for r in range(world)]


class SymmMemPeers:
    """This process's rank in ``group``, over one PyTorch symmetric-memory allocation (CUDA backend,
    NVLink multicast never used). Collective: every rank of the group constructs it in the same order.

    Args:
        group: the expert-parallel process group (NCCL).
        nbytes: workspace bytes (``WorkspaceLayout.nbytes``).
        timeout_ms: bound of every barrier wait; a peer that never arrives raises instead of hanging.
    """

    def __init__(self, group, nbytes: int, timeout_ms: int = 120_000):
        import torch.distributed as dist
        import torch.distributed._symmetric_memory as symm_mem

        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self._timeout_ms = timeout_ms
        self._buf = symm_mem.empty(nbytes, dtype=torch.uint8, device=torch.device("cuda", torch.cuda.current_device()))
        self._handle = symm_mem.rendezvous(self._buf, group.group_name)
        self._handle.barrier(channel=0, timeout_ms=timeout_ms)

    def buffer(self) -> torch.Tensor:
        return self._buf

    def ptr_table(self) -> int:
        return self._handle.buffer_ptrs_dev

    def barrier(self) -> None:
        self._handle.barrier(channel=0, timeout_ms=self._timeout_ms)


class SharedMemPeers:
    """This process's rank in a CPU (gloo) ``group``, over one shared-memory file per rank (/dev/shm)
    that every rank maps: the kernels (Triton interpreter) store into a peer's mapping exactly as they
    store into a peer's symmetric buffer on GPUs. For CPU tests of the whole layer at EP > 1 in real
    processes. Collective: every rank constructs it in the same order.

    Args:
        group: a gloo process group; nbytes: workspace bytes; tag: distinguishes workspaces.
    """

    def __init__(self, group, nbytes: int, tag: str):
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
            f.truncate(nbytes)
        dist.barrier(group=group)
        self._bufs = [torch.from_file(p, shared=True, size=nbytes, dtype=torch.uint8) for p in paths]
        self._bufs[self.rank].fill_(255)  # poison, as the emulated group
        self._table = torch.tensor([b.data_ptr() for b in self._bufs], dtype=torch.int64)
        dist.barrier(group=group)
        os.unlink(paths[self.rank])  # the mappings stay valid; nothing is left in /dev/shm

    def buffer(self) -> torch.Tensor:
        return self._bufs[self.rank]

    def ptr_table(self) -> int:
        return self._table.data_ptr()

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier(group=self._group)


def make_peers(group, nbytes: int, tag: str):
    """Symmetric memory for an NCCL group on GPUs; shared-memory files for a gloo group on CPU."""
    import torch.distributed as dist

    if dist.get_backend(group) == "gloo":
        return SharedMemPeers(group, nbytes, tag)
    return SymmMemPeers(group, nbytes)
