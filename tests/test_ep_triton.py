"""Expert-parallel Triton backend (v1) against the reference operator, with R emulated ranks in one
process: each rank's workspace is its own buffer, the kernels store into peers' buffers through the
address table exactly as they do over NVLink, and ``run_lockstep`` stands in for the barriers.

On CPU the kernels run in Triton's interpreter (small shapes); on a GPU machine the same tests run
compiled (emulated peers on one GPU). The 2-GPU symmetric-memory run is in tests/test_gpu.py.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

# Run as a script (compile check subprocess): compiled mode. Under pytest on CPU: the interpreter.
os.environ.setdefault("TRITON_INTERPRET", "0" if __name__ == "__main__" or torch.cuda.is_available() else "1")

from titan_megamoe.comm.peers import emulated_group  # noqa: E402
from titan_megamoe.comm.workspace import WorkspaceLayout, workspace_bytes  # noqa: E402
from titan_megamoe.kernels import ep_comm  # noqa: E402
from titan_megamoe.kernels.sm90_check import compile_sm90  # noqa: E402
from _sm90 import sm90_result  # noqa: E402
from titan_megamoe.ops.ep_backend import (EPRank, ep_backward_steps, ep_forward_steps, ep_forward_steps_v2,  # noqa: E402
                                           run_lockstep)
from titan_megamoe.ops.reference import mega_moe_ref  # noqa: E402
from titan_megamoe.testing import assert_close_rel, make_routing  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
BM = 16 if DEV == "cpu" else 128

CASES = [
    # (routing, R, tokens per rank, T_cap, D, F, E, K): the edge each row covers
    ("uniform", 2, [37, 21], 40, 32, 32, 4, 2),  # T not a multiple of the block, T < T_cap
    ("zero_expert", 2, [24, 24], 24, 32, 48, 8, 3),  # experts with no token
    ("one_rank", 2, [20, 16], 20, 32, 32, 4, 2),  # every token's experts on rank 0
    ("uniform", 2, [0, 19], 19, 32, 32, 4, 2),  # a rank with no tokens
    ("one_expert", 4, [12, 9, 16, 5], 16, 48, 32, 8, 1),  # top_k = 1, EP = 4, all tokens on expert 0
    ("skewed", 4, [16, 16, 16, 16], 16, 32, 32, 8, 4),
    # EP = 8 (a full H200 node, issue 8): one expert per rank, one empty rank, uneven token counts
    ("uniform", 8, [5, 0, 9, 3, 7, 8, 2, 6], 9, 32, 32, 8, 2),
    # EP = 8, two experts per rank (a rank's slab holds two experts' rows), top_k = 3 (a token's slots
    # on up to 3 ranks), one empty rank, uneven counts not a multiple of the 16-row block, T < T_cap
    ("uniform", 8, [13, 0, 17, 5, 21, 9, 1, 11], 24, 32, 32, 16, 3),
    # EP = 8, every token's experts on rank 0 (both of its experts): 7 ranks receive nothing, compute
    # on empty slabs and still combine; rank 0 receives from the 7 sources with tokens
    ("one_rank", 8, [6, 3, 0, 7, 2, 5, 4, 1], 7, 32, 32, 16, 2),
]


def _inputs(routing, R, Ts, D, F, E, K, seed):
    g = torch.Generator().manual_seed(seed)
    w1 = (torch.randn(E, F, D, generator=g) / D**0.5).bfloat16()
    w3 = (torch.randn(E, F, D, generator=g) / D**0.5).bfloat16()
    w2 = (torch.randn(E, D, F, generator=g) / F**0.5).bfloat16()
    ranks = []
    for r, T in enumerate(Ts):
        x = torch.randn(T, D, generator=g).bfloat16()
        ids = make_routing(routing, T, E, K, ep=R, seed=seed + r) if T else torch.zeros(0, K, dtype=torch.int64)
        s = torch.rand(T, K, generator=g)
        dout = torch.randn(T, D, generator=g).bfloat16()
        ranks.append([t.to(DEV) for t in (x, ids, s, dout)])
    return [w.to(DEV) for w in (w1, w2, w3)], ranks


def _local_weights(weights, E, R):
    """Each rank's slice (w1, w2, w3) of the global expert weights."""
    e_l = E // R
    return [tuple(w[r * e_l:(r + 1) * e_l] for w in weights) for r in range(R)]


def _emulated_ranks(R, t_cap, D, E, K, weights, max_rows=None):
    """One emulated peer group on a fresh workspace: (per-rank EPRank contexts, per-rank local weights)."""
    ws = WorkspaceLayout.build(R, t_cap, D, K)
    peers = emulated_group(R, ws.nbytes, DEV)
    ctxs = [EPRank(peers[r], ws, E // R, max_rows or R * t_cap * K, BM) for r in range(R)]
    return ctxs, _local_weights(weights, E, R)


def _ep_run(R, t_cap, D, E, K, weights, ranks, max_rows=None):
    ctxs, local = _emulated_ranks(R, t_cap, D, E, K, weights, max_rows)
    fwd = run_lockstep([ep_forward_steps(ctxs[r], x, ids, s, *local[r]) for r, (x, ids, s, _) in enumerate(ranks)])
    bwd = run_lockstep([
        ep_backward_steps(ctxs[r], dout, x, ids, s, *local[r], fwd[r][1], fwd[r][2])
        for r, (x, ids, s, dout) in enumerate(ranks)
    ])
    return fwd, bwd


def _reference(weights, ranks, E):
    """One process, all experts, all ranks' tokens concatenated: fp32 oracle of every rank's out, dx,
    dscores and of the full dw1 / dw2 / dw3."""
    x = torch.cat([r[0] for r in ranks]).float().requires_grad_()
    ids = torch.cat([r[1] for r in ranks])
    s = torch.cat([r[2] for r in ranks]).float().requires_grad_()
    dout = torch.cat([r[3] for r in ranks]).float()
    ws = [w.float().requires_grad_() for w in weights]
    out = mega_moe_ref(x, ids, s, *ws, num_experts=E)
    out.backward(dout)
    return out.detach(), x.grad, s.grad, [w.grad for w in ws]


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-R{c[1]}-K{c[7]}" for c in CASES])
def test_ep_matches_reference(case):
    routing, R, Ts, t_cap, D, F, E, K = case
    weights, ranks = _inputs(routing, R, Ts, D, F, E, K, seed=7)
    fwd, bwd = _ep_run(R, t_cap, D, E, K, weights, ranks)
    out, dx, ds, dws = _reference(weights, ranks, E)
    bounds = [0] + list(torch.tensor(Ts).cumsum(0))
    e_l = E // R
    for r in range(R):
        a, b = int(bounds[r]), int(bounds[r + 1])
        assert fwd[r][0].shape == (Ts[r], D) and torch.isfinite(fwd[r][0]).all()
        if Ts[r]:
            assert_close_rel(fwd[r][0].float(), out[a:b], torch.bfloat16, f"rank {r} out")
            assert_close_rel(bwd[r][0].float(), dx[a:b], torch.bfloat16, f"rank {r} dx")
            assert_close_rel(bwd[r][1], ds[a:b], torch.bfloat16, f"rank {r} dscores")
        for name, got, want in zip(("dw1", "dw2", "dw3"), bwd[r][2:], dws):
            want = want[r * e_l:(r + 1) * e_l]
            if want.abs().max() == 0:  # experts of this rank received no token
                assert (got == 0).all(), f"rank {r} {name}: no tokens, gradient must be exactly 0"
            else:
                assert_close_rel(got.float(), want, torch.bfloat16, f"rank {r} {name}")


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch has no _grouped_mm")
def test_ep_with_grouped_mm_wgrad_matches_triton_wgrad(monkeypatch):
    """EP backward with the sm_90 default wgrad forced (slab rows gathered by the received layout):
    same weight gradients as the Triton wgrad within bf16 rounding, the rest bitwise equal."""
    routing, R, Ts, t_cap, D, F, E, K = CASES[0]
    weights, ranks = _inputs(routing, R, Ts, D, F, E, K, seed=7)
    monkeypatch.setenv("TITAN_MEGAMOE_WGRAD", "triton")
    _, bwd_t = _ep_run(R, t_cap, D, E, K, weights, ranks)
    monkeypatch.setenv("TITAN_MEGAMOE_WGRAD", "grouped_mm")
    _, bwd_g = _ep_run(R, t_cap, D, E, K, weights, ranks)
    for r in range(R):
        assert torch.equal(bwd_g[r][0], bwd_t[r][0]) and torch.equal(bwd_g[r][1], bwd_t[r][1]), f"rank {r} dx/ds"
        for name, g, t in zip(("dw1", "dw2", "dw3"), bwd_g[r][2:], bwd_t[r][2:]):
            assert_close_rel(g.float(), t.float(), torch.bfloat16, f"rank {r} {name}")


def test_ep_backward_v3_bitwise_equals_v1():
    """Overlap v3 (d score / dx pushes issued before the wgrads, on a side stream on GPUs) gives v1's
    backward bit for bit, with an empty rank and EP = 4."""
    from titan_megamoe.ops.ep_backend import ep_backward_steps_v3

    for routing, R, Ts, t_cap, D, F, E, K in (CASES[0], ("one_expert", 4, [12, 0, 16, 5], 16, 48, 32, 8, 1)):
        weights, ranks = _inputs(routing, R, Ts, D, F, E, K, seed=3)
        fwd, bwd = _ep_run(R, t_cap, D, E, K, weights, ranks)
        ctxs, local = _emulated_ranks(R, t_cap, D, E, K, weights)
        fwd3 = run_lockstep([ep_forward_steps(ctxs[r], x, ids, s, *local[r]) for r, (x, ids, s, _) in enumerate(ranks)])
        bwd3 = run_lockstep([ep_backward_steps_v3(ctxs[r], dout, x, ids, s, *local[r], fwd3[r][1], fwd3[r][2])
                             for r, (x, ids, s, dout) in enumerate(ranks)])
        for r in range(R):
            for name, a, b in zip(("dx", "dscores", "dw1", "dw2", "dw3"), bwd3[r], bwd[r]):
                assert torch.equal(a, b), f"{routing} R={R} rank {r} {name}: v3 differs from v1"


@pytest.mark.parametrize("K", [1, 2, 4])
def test_bf16_combine_rows_against_fp32(monkeypatch, K):
    """comm/workspace.py's claim for the bf16 comb rows: with at most two slots per token (K <= 2) the
    forward output and dx are bitwise those of fp32 comb rows (a one-slot partial is the bf16 row
    itself; a two-slot one on one rank is rounded once, as the fp32 path rounds its sum once); at K = 4
    (several slots per rank) they differ, and their error against the fp32 oracle grows by less than
    one bf16 rounding (2^-8 relative; the interpreter truncates instead of rounding, the worst case).
    d scores and the weight gradients never go through comb: bitwise equal."""
    from titan_megamoe.comm import workspace
    from titan_megamoe.testing import rel_err

    R, Ts, t_cap, D, F, E = 2, [27, 19], 32, 32, 32, 4
    weights, ranks = _inputs("uniform", R, Ts, D, F, E, K, seed=11)
    got = {}
    for dt in (torch.float32, torch.bfloat16):
        monkeypatch.setattr(workspace, "COMBINE_DTYPE", dt)
        got[dt] = _ep_run(R, t_cap, D, E, K, weights, ranks)
        assert _emulated_ranks(R, t_cap, D, E, K, weights)[0][0].ws.dtypes["comb"] == dt
    (f32f, f32b), (bf_f, bf_b) = got[torch.float32], got[torch.bfloat16]
    out, dx, *_ = _reference(weights, ranks, E)
    for name, i, want, a, b in (("out", 0, out, f32f, bf_f), ("dx", 0, dx, f32b, bf_b)):
        a_all, b_all = (torch.cat([v[r][i] for r in range(R)]).float() for v in (a, b))
        if K <= 2:
            assert torch.equal(a_all, b_all), f"K={K} {name}: bf16 comb rows changed the result"
        else:
            assert not torch.equal(a_all, b_all), f"{name}: K=4 never rounded a partial (the test is too weak)"
            assert rel_err(b_all, want) - rel_err(a_all, want) < 2**-8, (
                f"{name}: bf16 comb rows {rel_err(b_all, want):.4f} vs fp32 {rel_err(a_all, want):.4f} "
                "against the oracle")
    for r in range(R):
        for i, name in enumerate(("dscores", "dw1", "dw2", "dw3"), start=1):
            assert torch.equal(f32b[r][i], bf_b[r][i]), f"rank {r} {name}"


def test_ep_deterministic_and_buffer_reuse():
    """Two runs give bitwise equal results; a second call with other routing on the same workspace
    (stale rows from the first call left in the buffers) is still right."""
    R, Ts, t_cap, D, F, E, K = 2, [30, 26], 32, 32, 32, 4, 2
    weights, ranks = _inputs("uniform", R, Ts, D, F, E, K, seed=1)
    a = _ep_run(R, t_cap, D, E, K, weights, ranks)
    b = _ep_run(R, t_cap, D, E, K, weights, ranks)
    for r in range(R):  # out, then dx, dscores, dw1, dw2, dw3 (gate_up rows past the layout are unwritten)
        for ta, tb in zip((a[0][r][0],) + a[1][r], (b[0][r][0],) + b[1][r]):
            assert torch.equal(ta, tb)
    # same workspace, two calls: the second routing differs (skewed), fewer tokens on rank 0
    ctxs, local = _emulated_ranks(R, t_cap, D, E, K, weights)
    run_lockstep([ep_forward_steps(ctxs[r], x, ids, s, *local[r]) for r, (x, ids, s, _) in enumerate(ranks)])
    _, ranks2 = _inputs("skewed", R, [11, 26], D, F, E, K, seed=2)
    got = run_lockstep([ep_forward_steps(ctxs[r], x, ids, s, *local[r]) for r, (x, ids, s, _) in enumerate(ranks2)])
    out, *_ = _reference(weights, ranks2, E)
    assert_close_rel(torch.cat([g[0] for g in got]).float(), out, torch.bfloat16, "second call out")


V2_CASES = [
    # (routing, R, tokens per rank, T_cap, D, F, E, K, flag_block): the edge each row covers
    ("uniform", 2, [37, 21], 40, 32, 32, 4, 2, 8),  # 5 flag blocks per source, last one partial
    ("one_expert", 4, [12, 9, 16, 5], 16, 48, 32, 8, 1, 4),  # EP = 4, a tile spans every source's blocks
    ("uniform", 2, [0, 19], 19, 32, 32, 4, 2, 16),  # an empty rank still flags its blocks
    # EP = 8, two experts per rank: 8 sources' flags per destination, 3 blocks each (last one partial),
    # an empty rank
    ("uniform", 8, [13, 0, 17, 5, 20, 9, 1, 11], 20, 32, 32, 16, 2, 8),
]


def _v2_run(R, t_cap, D, E, K, weights, ranks, fb, calls=1, timeout_ms=120_000, skip_rows_of=None):
    """v1 and v2 forwards on the same inputs (each on its own emulated group), ``calls`` times on the
    same workspace; returns (v1 results, v2 results, v2 peers) of the last call."""
    ws = WorkspaceLayout.build(R, t_cap, D, K, flag_block=fb)
    e_l = E // R
    local = _local_weights(weights, E, R)
    out = []
    for steps in (ep_forward_steps, ep_forward_steps_v2):
        peers = emulated_group(R, ws.nbytes, DEV, timeout_ms=timeout_ms)
        ctxs = [EPRank(peers[r], ws, e_l, R * t_cap * K, BM) for r in range(R)]
        for _ in range(calls):
            res = run_lockstep([steps(ctxs[r], x, ids, s, *local[r]) for r, (x, ids, s, _) in enumerate(ranks)], peers)
        out.append((res, peers))
    return out[0][0], out[1][0], out[1][1]


@pytest.mark.parametrize("case", V2_CASES, ids=[f"{c[0]}-R{c[1]}-FB{c[8]}" for c in V2_CASES])
def test_ep_v2_forward_bitwise_equals_v1(case):
    """Overlap v2 (x rows streamed with per-block arrival flags, GEMM1 waiting for its blocks) gives
    the v1 forward bit for bit; two calls on one workspace (flags never reset: epoch-tagged)."""
    routing, R, Ts, t_cap, D, F, E, K, fb = case
    weights, ranks = _inputs(routing, R, Ts, D, F, E, K, seed=11)
    v1, v2, peers = _v2_run(R, t_cap, D, E, K, weights, ranks, fb, calls=2)
    ws = WorkspaceLayout.build(R, t_cap, D, K, flag_block=fb)
    for r in range(R):
        assert torch.equal(v1[r][0], v2[r][0]), f"rank {r} out"
        n = int(v1[r][2].offsets[-1])  # gate_up rows in use (rows past the layout are unwritten)
        assert torch.equal(v1[r][1][:n], v2[r][1][:n]), f"rank {r} gate_up"
        for name in ("counts", "offsets", "row_pair", "pair_row", "tile_expert"):
            assert torch.equal(getattr(v1[r][2], name), getattr(v2[r][2], name)), name
        sync = peers[r].sync
        assert sync.status.tolist() == [0, 0, 0, 0]
        # 3 barriers per forward, 2 calls; every source flagged every block with the 2nd call's epoch (5)
        assert sync.epoch.item() == 6
        flags = ws.view(peers[r].buffer(), "xflag")
        assert (flags == 5).all(), flags


def test_ep_v2_rows_that_never_arrive_time_out():
    """A source whose row dispatch never runs: GEMM1 of the other rank stops waiting after the bound
    and records [2, source, epoch, site]; the monitor raises naming both ranks and the phase."""
    from titan_megamoe.comm.signals import WaitMonitor, site_code
    from titan_megamoe.errors import PeerTimeoutError

    R, Ts, t_cap, D, F, E, K, fb = 2, [16, 16], 16, 32, 32, 4, 2, 8
    weights, ranks = _inputs("uniform", R, Ts, D, F, E, K, seed=5)
    real = ep_comm.dispatch_rows

    def lossy(x, ids, ws, bases, rank, e_l, epoch, progs):
        if rank != 1:
            real(x, ids, ws, bases, rank, e_l, epoch, progs)

    ep_comm.dispatch_rows = lossy
    try:
        _, _, peers = _v2_run(R, t_cap, D, E, K, weights, ranks, fb, timeout_ms=100)
    finally:
        ep_comm.dispatch_rows = real
    assert peers[0].sync.status.tolist() == [2, 1, 2, site_code("fwd.gemm1 waiting for x rows (v2 arrival flags)")]
    mon = WaitMonitor()
    mon.record("layers.0.moe", peers[0].sync)
    with pytest.raises(PeerTimeoutError, match=r"layers\.0\.moe: expert-parallel rank 0 .*fwd\.gemm1 waiting for "
                       r"x rows.* rank 1"):
        mon.check()


def test_workspace_formula():
    """The documented size formula (plus alignment) and the region views."""
    R, T, D, K = 2, 16384, 2048, 8
    nb = workspace_bytes(R, T, D, K)
    base = R * T * (6 * D + 8 * K) + 4 * T * K + 4 * R * (T // 128)  # bf16 comb rows, + the v2 arrival flags
    assert base <= nb <= base + 7 * 256
    ws = WorkspaceLayout.build(3, 5, 16, 2)
    buf = torch.zeros(ws.nbytes, dtype=torch.uint8)
    assert ws.view(buf, "x").shape == (3, 5, 16) and ws.view(buf, "x").dtype == torch.bfloat16
    assert ws.view(buf, "dscore").shape == (5, 2) and ws.view(buf, "comb").dtype == torch.bfloat16
    assert "GiB per GPU" in ws.describe()
    with pytest.raises(ValueError, match="must be >= 1"):
        WorkspaceLayout.build(0, 5, 16, 2)


def test_lockstep_detects_mismatched_barriers():
    def steps(n):
        for _ in range(n):
            yield
        return n

    assert run_lockstep([steps(2), steps(2)]) == [2, 2]
    with pytest.raises(RuntimeError, match="steps differ"):
        run_lockstep([steps(1), steps(3)])


def test_capacity_overflow_raises_with_the_setting():
    """A rank receiving more pairs than max_rows: the call stays inside its buffers, and the capacity
    monitor raises naming the layer, the count, the capacity and the setting to raise."""
    from titan_megamoe.comm.capacity import CapacityMonitor
    from titan_megamoe.errors import CapacityError

    R, Ts, t_cap, D, F, E, K = 2, [24, 24], 24, 32, 32, 4, 2
    weights, ranks = _inputs("one_rank", R, Ts, D, F, E, K, seed=3)  # rank 0 receives all 96 pairs
    fwd, _ = _ep_run(R, t_cap, D, E, K, weights, ranks, max_rows=40)
    mon = CapacityMonitor()
    mon.record("layers.3.moe", fwd[1][2].counts, 40)  # rank 1: no pair, fine
    mon.check()
    mon.record("layers.3.moe", fwd[0][2].counts, 40)
    with pytest.raises(CapacityError, match=r"layers\.3\.moe: this rank received 96 .* capacity of 40.*capacity_factor"):
        mon.flush()
    mon.flush()  # cleared after raising


def test_ep_op_fake_shapes(tmp_path):
    """The EP custom op's fake (torch.compile / meta) gives the shapes of the real outputs, with the
    group size read from the process group (a 1-rank gloo group here)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from titan_megamoe.testing import single_rank_group

    import titan_megamoe.ops.ep_library  # noqa: F401  (registers the ops)
    from titan_megamoe.kernels.routing import layout_caps

    with single_rank_group(tmp_path) as name:
        with FakeTensorMode():
            x = torch.empty(10, 32, dtype=torch.bfloat16)
            ids = torch.empty(10, 2, dtype=torch.int64)
            s = torch.empty(10, 2)
            w1, w2 = torch.empty(4, 48, 32, dtype=torch.bfloat16), torch.empty(4, 32, 48, dtype=torch.bfloat16)
            out, gate_up, counts, offsets, row_pair, pair_row, tiles = torch.ops.megamoe.bf16_mega_moe_ep_fwd(
                x, ids, s, w1, w2, w1, name, 12, 30, "moe", "v1")
        n_cap, n_tiles = layout_caps(12, 2, 4, 16 if os.environ.get("TRITON_INTERPRET") == "1" else 128, 30)
        assert out.shape == (10, 32) and gate_up.shape == (n_cap, 96)
        assert counts.shape == (4,) and offsets.shape == (5,) and row_pair.shape == (n_cap,)
        assert pair_row.shape == (24,) and tiles.shape == (n_tiles,)


def _layer_ep_worker(rank, R):
    """MegaMoE (backend triton, EP = R) under TorchTitan's apply_moe_ep_tp in real gloo processes over
    shared-memory peers, vs the same layer on one process with the reference backend."""
    import copy

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.models.llama4.infra.parallelize import apply_moe_ep_tp
    from torchtitan.models.moe.moe import MoEArgs

    from titan_megamoe.config import MegaMoEConfig
    from titan_megamoe.layer import MegaMoE

    T, D, F, E, K = 24, 32, 32, 8, 2
    args = MoEArgs(num_experts=E, top_k=K, score_func="softmax", route_norm=True, score_before_experts=False,
                   num_shared_experts=0, use_grouped_mm=False)
    torch.manual_seed(0)
    single = MegaMoE(args, D, F, config=MegaMoEConfig(backend="reference"))
    with torch.no_grad():
        single.init_weights(0.02, torch.device("cpu"))
    single = single.to(torch.bfloat16)
    ep_layer = MegaMoE.from_moe(copy.deepcopy(single), config=MegaMoEConfig(backend="triton"), max_tokens_per_rank=T)

    class Block(torch.nn.Module):
        def __init__(self, moe):
            super().__init__()
            self.moe, self.moe_enabled = moe, True

    class Model(torch.nn.Module):
        def __init__(self, moe):
            super().__init__()
            self.layers = torch.nn.ModuleDict({"0": Block(moe)})

    mesh = init_device_mesh("cpu", (R,), mesh_dim_names=("ep",))
    apply_moe_ep_tp(Model(ep_layer), tp_mesh=None, ep_mesh=mesh, etp_mesh=None, ep_etp_mesh=None)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(1, R * T, D, generator=gen).bfloat16()
    g = torch.randn(1, R * T, D, generator=gen).bfloat16()
    xs = x.float().requires_grad_()
    ref = single.float()(xs)
    ref.backward(g.float())
    tok = slice(rank * T, (rank + 1) * T)
    from titan_megamoe.ops import eager

    first = None
    for call in range(2):  # twice: the shared workspace is reused; the eager path, then the custom op's
        eager.ENABLED = call == 0
        xm = x[:, tok].clone().requires_grad_()
        for p in ep_layer.parameters():
            p.grad = None
        out = ep_layer(xm)
        out.backward(g[:, tok])
        eager.ENABLED = True
        got = [out.detach(), xm.grad] + [getattr(ep_layer.experts, n).grad.to_local() for n in ("w1", "w2", "w3")]
        if first is None:
            first = got
        else:
            assert all(torch.equal(a, b) for a, b in zip(got, first)), "the custom op differs from the eager path"
        from titan_megamoe.ops import ep_library

        assert ep_library._PEERS, "the EP triton op did not run (no workspace was created)"
        assert_close_rel(out.float(), ref[:, tok], torch.bfloat16, f"call {call} out")
        assert_close_rel(xm.grad.float(), xs.grad[:, tok], torch.bfloat16, f"call {call} dx")
        e = E // R
        for n in ("w1", "w2", "w3"):
            got = getattr(ep_layer.experts, n).grad.to_local().float()
            assert_close_rel(got, getattr(single.experts, n).grad[rank * e:(rank + 1) * e], torch.bfloat16, f"d{n}")
        gw = ep_layer.router.gate.weight.grad.float().clone()
        dist.all_reduce(gw)
        assert_close_rel(gw, single.router.gate.weight.grad, torch.bfloat16, "dgate")


def test_layer_ep2_in_gloo_processes():
    """The whole layer at EP = 2 through the custom ops, the converter and TorchTitan's
    EP plan, in two processes whose workspaces are shared-memory files (the Triton interpreter's
    stand-in for symmetric memory)."""
    from titan_megamoe.testing import run_gloo

    if torch.cuda.is_available():
        pytest.skip("CPU test (gloo + interpreter); the GPU run is tests/test_gpu.py::test_ep_triton_two_gpus")
    run_gloo(_layer_ep_worker, 2, timeout_s=300)


def _compile_sm90_all() -> list[dict]:
    """The four EP kernels at the Qwen3-30B-A3B shape (EP = 2, 16384 tokens, top-8), the FP8-payload
    dispatch (EP = 2 and 8: its destination loop is unrolled) and the bounded barrier (comm/signals.py:
    globaltimer, release / acquire atomics at system scope), for sm_90a."""
    from triton.runtime.jit import JITFunction

    T_CAP, D, K = 16384, 2048, 8
    jit = {n: JITFunction(getattr(ep_comm, n).fn) for n in
           ("_dispatch_kernel", "_combine_push_kernel", "_dscore_push_kernel", "_combine_sum_kernel")}
    cases = [
        ("dispatch", "_dispatch_kernel",
         {"x_TD": "*bf16", "dy_TD": "*bf16", "ids_TK": "*i64", "scores_TK": "*fp32", "peer_bases": "i64",
          "T": "i32", "rank": "i32", "OFF_X": "i64", "OFF_DY": "i64", "OFF_IDS": "i64", "OFF_SC": "i64"},
         dict(T_CAP=T_CAP, D=D, K=K, KP=8, E_LOCAL=64, HAS_DY=True, BT=16, BD=512)),
        ("combine_push", "_combine_push_kernel",
         {"rows_ND": "*bf16", "pair_row_P": "*i32", "peer_bases": "i64", "rank": "i32", "OFF_COMB": "i64"},
         dict(T_CAP=T_CAP, D=D, K=K, BT=16, BD=256, COMB_BF16=True)),
        ("dscore_push", "_dscore_push_kernel",
         {"part_NB": "*fp32", "pair_row_P": "*i32", "peer_bases": "i64", "OFF_DS": "i64"},
         dict(T_CAP=T_CAP, K=K, KP=8, NB=6, BT=32)),
        ("combine_sum", "_combine_sum_kernel",
         {"comb_RTD": "*bf16", "ids_TK": "*i64", "out_TD": "*bf16", "T": "i32"},
         dict(R=2, T_CAP=T_CAP, D=D, K=K, KP=8, E_LOCAL=64, BT=16, BD=512)),
    ]
    res = [dict(label=label, **compile_sm90(jit[name], sig, cx, num_warps=4, num_stages=1))
           for label, name, sig, cx in cases]
    from titan_megamoe.comm import signals

    bar = {"peer_bases": "i64", "epoch_ptr": "*i32", "status_ptr": "*i32", "OFF_SYNC": "i64", "rank": "i32",
           "site": "i32", "max_polls": "i32", "timeout_ns": "i64"}
    res.append(dict(label="barrier", **compile_sm90(JITFunction(signals._barrier_kernel.fn), bar,
                                                    dict(R=2, USE_TIMER=True), num_warps=1, num_stages=1)))
    rows = {"x_TD": "*bf16", "ids_TK": "*i64", "peer_bases": "i64", "epoch_ptr": "*i32", "T": "i32", "rank": "i32",
            "OFF_X": "i64", "OFF_FLAG": "i64"}
    # the FP8 payload push (x quantized 1x128 in registers, e4m3 + scales to each destination)
    fp8 = {"x_TD": "*bf16", "ids_TK": "*i64", "scores_TK": "*fp32", "peer_bases": "i64", "count_ptr": "*i32",
           "T": "i32", "rank": "i32", "OFF_XQ": "i64", "OFF_XS": "i64", "OFF_IDS": "i64", "OFF_SC": "i64"}
    for label, R in (("dispatch_fp8", 2), ("dispatch_fp8_ep8", 8)):
        res.append(dict(label=label, **compile_sm90(
            JITFunction(ep_comm._dispatch_fp8_kernel.fn), fp8,
            dict(T_CAP=T_CAP, D=D, K=K, KP=8, E_LOCAL=128 // R, R=R, BT=16, NGP=D // 128, CHECK=True,
                 EXACT_ROUND=False, EPS=1e-12), num_warps=4, num_stages=1)))
    res.append(dict(label="dispatch_rows", **compile_sm90(
        JITFunction(ep_comm._dispatch_rows_kernel.fn), rows,
        dict(T_CAP=T_CAP, D=D, K=K, KP=8, E_LOCAL=64, R=2, FB=128, NB=128, BT=16, BD=512, NPROG=132),
        num_warps=4, num_stages=1)))
    # GEMM1 with the v2 wait in its prologue, at the Hopper default tile: still wgmma, no spills
    from titan_megamoe.kernels import grouped_gemm as gg
    from titan_megamoe.kernels.configs import config_for

    cfg = config_for("gemm1", D, 768, False)
    g1 = {"x_ptr": "*bf16", "w1_ptr": "*bf16", "w3_ptr": "*bf16", "row_pair_ptr": "*i32", "tile_expert_ptr": "*i32",
          "gate_up_ptr": "*bf16", "h_ptr": "*bf16", "E": "i32", "flags_ptr": "*i32", "epoch_ptr": "*i32",
          "status_ptr": "*i32", "max_polls": "i32", "timeout_ns": "i64"}
    cx = dict(F=768, D=D, K=K, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
              EVEN_K=True, USE_TMA=False, UPCAST_FP32=False, WAIT=True, T_CAP=T_CAP, FB=128, NB=128, SITE=8,
              USE_TIMER=True)
    res.append(dict(label="gemm1_wait", **compile_sm90(gg._kernel_variant(gg._gemm1_swiglu_fwd_kernel, False), g1, cx,
                                                       num_warps=cfg.num_warps, num_stages=cfg.num_stages)))
    return res


@pytest.mark.parametrize("label", ["dispatch", "combine_push", "dscore_push", "combine_sum", "barrier", "dispatch_rows",
                                   "gemm1_wait", "dispatch_fp8", "dispatch_fp8_ep8"])
def test_ep_kernels_compile_for_sm90a(label):
    r = sm90_result(__file__, label)
    assert r["target"], "PTX not built for sm_90a"
    assert "STACK:0" in r["usage"] or not r["usage"], f"{label}: register spills ({r['usage']})"
    if label == "gemm1_wait":
        assert r["wgmma"] > 0, "GEMM1 with the v2 wait lost its wgmma"


if __name__ == "__main__":
    if sys.argv[1:2] == ["compile-sm90"]:
        print(json.dumps(_compile_sm90_all()))
    else:
        raise SystemExit("usage: python tests/test_ep_triton.py compile-sm90")
