"""Bounded cross-rank waits (comm/signals.py): a rank that never arrives yields PeerTimeoutError
naming the layer, the phase and both ranks within seconds, never a hang; later waits fail fast;
a healthy barrier sequence leaves the status clean and the epochs equal.

CPU: the flag barrier runs in the Triton interpreter over emulated buffers (one process) and over
shared-memory files (two gloo processes: the EP op itself, with one rank skipping the layer).
"""

from __future__ import annotations

import time

import pytest
import torch

from titan_megamoe.comm.peers import emulated_group
from titan_megamoe.comm.signals import SITES, WaitMonitor, site_code
from titan_megamoe.errors import PeerTimeoutError
from titan_megamoe.testing import run_gloo


def test_missing_rank_times_out_and_names_it():
    if torch.cuda.is_available():
        pytest.skip("CPU interpreter test; the 2-GPU run is tests/test_gpu.py::test_ep_triton_two_gpus")
    peers = emulated_group(2, 1024, timeout_ms=300)
    t0 = time.monotonic()
    peers[0].sync.barrier("fwd.after_dispatch")  # rank 1 never signals
    assert time.monotonic() - t0 < 20
    assert peers[0].sync.status.tolist() == [1, 1, 1, site_code("fwd.after_dispatch")]
    t0 = time.monotonic()
    peers[0].sync.barrier("fwd.after_combine_push")  # fail fast: no second timeout
    assert time.monotonic() - t0 < 2
    assert peers[0].sync.epoch.item() == 2 and peers[0].sync.status[3] == site_code("fwd.after_dispatch")
    mon = WaitMonitor()
    mon.record("layers.3.moe", peers[0].sync)
    with pytest.raises(PeerTimeoutError, match=r"layers\.3\.moe: expert-parallel rank 0 waited 300 ms at "
                       r"'fwd\.after_dispatch' .* rank 1 never arrived.*same MoE layers.*set_timeout_ms"):
        mon.check()
    mon.flush()  # cleared after raising
    # rank 1 arriving late passes at once (rank 0's word holds epoch 2 >= 1) and stays healthy
    peers[1].sync.barrier()
    assert peers[1].sync.status.tolist() == [0, 0, 0, 0] and peers[1].sync.epoch.item() == 1
    with pytest.raises(ValueError, match="unknown wait site"):
        site_code("nowhere")
    assert len(set(SITES)) == len(SITES)


def _op_worker(rank, R):
    """Both ranks create the workspace (collective); rank 0 calls the layer, rank 1 never does."""
    import torch.distributed as dist

    from titan_megamoe.ops import ep_library

    T, D, F, E, K = 8, 16, 16, 4, 2
    ep_library.set_timeout_ms(1500)
    group = dist.group.WORLD
    ctx = ep_library._ep_rank(group.group_name, T, D, K, E // R, R * T * K)
    assert ctx.peers.sync.timeout_ms == 1500
    if rank == 0:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(T, D, generator=g).bfloat16()
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
        s = torch.rand(T, K, generator=g)
        w1, w3 = (torch.randn(E // R, F, D, generator=g).bfloat16() for _ in range(2))
        w2 = torch.randn(E // R, D, F, generator=g).bfloat16()
        t0 = time.monotonic()
        ep_library.mega_moe_ep_triton(x, ids, s, w1, w2, w3, ep_group=group, max_tokens_per_rank=T,
                                      recv_capacity=R * T * K, layer_name="layers.7.moe")
        elapsed = time.monotonic() - t0
        try:
            ep_library.WAITS.flush()
            raise AssertionError("no PeerTimeoutError although rank 1 never arrived")
        except PeerTimeoutError as err:
            msg = str(err)
        assert "layers.7.moe: expert-parallel rank 0" in msg and "'fwd.before_dispatch'" in msg, msg
        assert "rank 1 never arrived" in msg, msg
        assert elapsed < 60, f"the call took {elapsed:.1f} s: later waits did not fail fast"
    dist.barrier(group)


def test_op_errors_when_a_rank_skips_the_layer():
    if torch.cuda.is_available():
        pytest.skip("CPU test (gloo + interpreter)")
    run_gloo(_op_worker, 2, timeout_s=120)


def _hosts_worker(rank, R):
    """The workspace of an EP group is made on one host; ranks that report other hosts are refused, by name."""
    import torch.distributed as dist

    from titan_megamoe.comm import peers as peers_mod
    from titan_megamoe.errors import UnsupportedModelError

    group = dist.group.WORLD
    peers = peers_mod.make_peers(group, 1024, tag="one_host")  # both ranks on this machine: made
    assert peers.world == R and peers.buffer().numel() == 1024
    real = peers_mod._machine
    # containers of one node may differ in host name (one machine); nodes may share one (two machines)
    peers_mod._machine = lambda: (f"node{rank}", "boot-a")
    try:
        peers_mod.make_peers(group, 1024, tag="one_machine")
        peers_mod._machine = lambda: ("node", f"boot-{rank}")
        with pytest.raises(UnsupportedModelError, match="spans 2 machines \\(hosts node\\)") as e:
            peers_mod.make_peers(group, 1024, tag="two_machines")
        assert "expert_parallel_degree to at most the GPUs of one node" in str(e.value)
    finally:
        peers_mod._machine = real
    dist.barrier(group)


def test_an_ep_group_across_hosts_is_refused():
    if torch.cuda.is_available():
        pytest.skip("CPU test (gloo)")
    run_gloo(_hosts_worker, 2, timeout_s=120)
