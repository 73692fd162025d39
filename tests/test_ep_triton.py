"""Expert-parallel Triton backend (v1) against the reference operator, with R emulated ranks in one
process: each rank's workspace is its own buffer, the kernels store into peers' buffers through the
address table exactly as they do over NVLink, and ``run_lockstep`` stands in for the barriers.

On CPU the kernels run in Triton's interpreter (small shapes); on a GPU machine the same tests run
compiled (emulated peers on one GPU). The 2-GPU symmetric-memory run is in tests/test_gpu.py.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from titan_megamoe.comm.peers import emulated_group  # noqa: E402
from titan_megamoe.comm.workspace import WorkspaceLayout, workspace_bytes  # noqa: E402
from titan_megamoe.ops.ep_backend import EPRank, ep_backward_steps, ep_forward_steps, run_lockstep  # noqa: E402
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


def _ep_run(R, t_cap, D, E, K, weights, ranks, max_rows=None):
    ws = WorkspaceLayout.build(R, t_cap, D, K)
    peers = emulated_group(R, ws.nbytes, DEV)
    e_l = E // R
    w1, w2, w3 = weights
    local = [(w1[r * e_l:(r + 1) * e_l], w2[r * e_l:(r + 1) * e_l], w3[r * e_l:(r + 1) * e_l]) for r in range(R)]
    cap = max_rows or R * t_cap * K
    ctxs = [EPRank(peers[r], ws, e_l, cap, BM) for r in range(R)]
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
    ws = WorkspaceLayout.build(R, t_cap, D, K)
    peers = emulated_group(R, ws.nbytes, DEV)
    e_l = E // R
    w1, w2, w3 = weights
    ctxs = [EPRank(peers[r], ws, e_l, R * t_cap * K, BM) for r in range(R)]
    local = [(w1[r * e_l:(r + 1) * e_l], w2[r * e_l:(r + 1) * e_l], w3[r * e_l:(r + 1) * e_l]) for r in range(R)]
    run_lockstep([ep_forward_steps(ctxs[r], x, ids, s, *local[r]) for r, (x, ids, s, _) in enumerate(ranks)])
    _, ranks2 = _inputs("skewed", R, [11, 26], D, F, E, K, seed=2)
    got = run_lockstep([ep_forward_steps(ctxs[r], x, ids, s, *local[r]) for r, (x, ids, s, _) in enumerate(ranks2)])
    out, *_ = _reference(weights, ranks2, E)
    assert_close_rel(torch.cat([g[0] for g in got]).float(), out, torch.bfloat16, "second call out")


def test_workspace_formula():
    """The documented size formula (plus alignment) and the region views."""
    R, T, D, K = 2, 16384, 2048, 8
    nb = workspace_bytes(R, T, D, K)
    assert R * T * (8 * D + 8 * K) + 4 * T * K <= nb <= R * T * (8 * D + 8 * K) + 4 * T * K + 6 * 256
    ws = WorkspaceLayout.build(3, 5, 16, 2)
    buf = torch.zeros(ws.nbytes, dtype=torch.uint8)
    assert ws.view(buf, "x").shape == (3, 5, 16) and ws.view(buf, "x").dtype == torch.bfloat16
    assert ws.view(buf, "dscore").shape == (5, 2) and ws.view(buf, "comb").dtype == torch.float32
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
