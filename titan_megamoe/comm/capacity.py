"""Receive-capacity checks of the expert-parallel path without a host sync.

Each call records the number of (token, expert) pairs its rank received (a device scalar, copied to
pinned host memory asynchronously); the next call of any layer reads the copies that have landed
(``torch.cuda.Event.query``, no wait) and raises ``CapacityError`` for one over the capacity. So an
overflow stops training at most a few layer calls after it happened, with the layer, the count and
the setting to raise; the overflowing call itself wrote nothing out of bounds (the layout clamps)
but dropped the pairs past the capacity, so its result must not be trusted (the error says so).
``flush()`` waits for every pending copy (end of a step, tests).
"""

from __future__ import annotations

import torch

from titan_megamoe.errors import CapacityError

__all__ = ["CapacityMonitor"]


class CapacityMonitor:
    """Pending (layer, capacity, received count) records of this process."""

    def __init__(self) -> None:
        self._pending: list[tuple[str, int, torch.Tensor, object]] = []

    def record(self, layer_name: str, counts_E: torch.Tensor, max_rows: int) -> None:
        """Queue the check of one call: ``counts_E`` (E_l,) int32 pairs per local expert (device)."""
        total = counts_E.sum(dtype=torch.int64).reshape(1)
        if total.is_cuda:
            if torch.cuda.is_current_stream_capturing():
                return  # inside a CUDA graph: no host copy can be queued; the eager warm-up checked
            host = torch.empty(1, dtype=torch.int64, pin_memory=True)
            host.copy_(total, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host, event = total, None
        self._pending.append((layer_name, max_rows, host, event))

    def check(self, wait: bool = False) -> None:
        """Raise for the first landed record over its capacity; keep the ones not landed yet.

        Raises:
            CapacityError: naming the layer, the received pairs, the capacity and the setting.
        """
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return  # cudaEventQuery is not permitted while a CUDA graph is being captured
        keep = []
        for layer, cap, host, event in self._pending:
            if event is not None and not wait and not event.query():
                keep.append((layer, cap, host, event))
                continue
            if event is not None and wait:
                event.synchronize()
            n = int(host[0])
            if n > cap:
                self._pending = []
                raise CapacityError(
                    f"{layer}: this rank received {n} (token, expert) pairs in one call, more than its "
                    f"receive capacity of {cap}; the pairs past it were dropped in that call. Raise "
                    "[megamoe] capacity_factor (capacity = capacity_factor * max_tokens_per_rank * top_k), "
                    "or balance the router (load-balancing loss / expert bias)."
                )
        self._pending = keep

    def flush(self) -> None:
        """Wait for every pending record and check it."""
        self.check(wait=True)
