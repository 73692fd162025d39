"""FP8 payload of the "fp8" forward at EP > 1 (``ep_comm.dispatch_push_fp8``, ``ops/ep_fp8_backend.py``):
x quantized 1x128 on the source inside the push kernel, e4m3 rows + fp32 scales landing in the
destinations' xq / xs slab (which shares the dy region's bytes, ``comm/workspace.py``).

Two oracles, both bitwise (``torch.equal``), because the math is the same and only where it runs moves:

* the kernel: the received xq / xs rows equal ``quantize_act_1x128`` of the bf16 slab that
  ``dispatch_push`` leaves (the v1 payload), on every placed row; the metadata regions are equal;
  rows nobody sent keep the 0xFF poison (no stray stores); non-finite groups counted once per token.
* the layer: forward and backward of every rank with ``payload="fp8"`` equal ``payload="bf16"`` (the
  receive-side quantization of v1): out, gate_up, the receive layout, dx, d scores, dw1..dw3. The FP8
  run goes first on a fresh, poisoned workspace, then the bf16 one on the same workspace, then the FP8
  forward again over the stale dy / x bytes the backward left (what the overlay sees in training).

R emulated ranks in one process (``run_lockstep``), Triton interpreter on CPU, small shapes (each live
128-row tile of the FP8 GEMMs costs ~0.1-0.3 s there). The 2-GPU run: tests/ep_triton_worker.py.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from titan_megamoe.comm.peers import emulated_group  # noqa: E402
from titan_megamoe.comm.workspace import WorkspaceLayout  # noqa: E402
from titan_megamoe.kernels import ep_comm  # noqa: E402
from titan_megamoe.kernels.fp8_quant import quantize_act_1x128  # noqa: E402
from titan_megamoe.ops.ep_backend import EPRank, run_lockstep  # noqa: E402
from titan_megamoe.ops.ep_fp8_backend import ep_fp8_backward_steps, ep_fp8_forward_steps  # noqa: E402
from titan_megamoe.ops.fp8_backend import FP8_BLOCK_M, NONFINITE, prepare_weights  # noqa: E402
from titan_megamoe.testing import make_routing  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _tokens(routing, R, Ts, D, E, K, seed):
    """Per rank: x (T, D) bf16 with rows of very different magnitudes (a zero row, tiny rows in e4m3's
    subnormal range after scaling, large ones), ids (T, K), scores (T, K) fp32, dout (T, D) bf16."""
    g = torch.Generator().manual_seed(seed)
    ranks = []
    for r, T in enumerate(Ts):
        mag = torch.exp2(torch.randint(-20, 12, (T, 1), generator=g).float())
        x = (torch.randn(T, D, generator=g) * mag).bfloat16()
        if T:
            x[0] = 0.0
        ids = make_routing(routing, T, E, K, ep=R, seed=seed + r) if T else torch.zeros(0, K, dtype=torch.int64)
        s = torch.softmax(torch.randn(T, K, generator=g), -1)
        dout = torch.randn(T, D, generator=g).bfloat16()
        ranks.append([t.to(DEV) for t in (x, ids, s, dout)])
    return ranks


# --------------------------------------------------------------------------------------------------
# The kernel
# --------------------------------------------------------------------------------------------------

KERNEL_CASES = [
    # (routing, R, tokens per rank, T_cap, D, E, K): the edges each row covers
    ("uniform", 2, [37, 21], 40, 256, 4, 2),  # T not a multiple of the token block, T < T_cap, 2 groups
    ("one_rank", 2, [20, 0], 20, 128, 4, 2),  # every token to rank 0 (rank 1's slab empty); a rank with no tokens
    ("zero_expert", 4, [12, 9, 16, 5], 16, 384, 8, 2),  # EP = 4; D / 128 = 3 groups (scale vector padded to 4)
    ("one_expert", 4, [7, 16, 3, 11], 16, 128, 4, 1),  # top_k = 1, every token on expert 0 (rank 0)
    # EP = 8 (the destination loop unrolled 8 times), two experts per rank, top_k = 3 (a token to up to
    # 3 ranks), a rank with no tokens, 2 groups
    ("uniform", 8, [13, 0, 17, 5, 21, 9, 1, 11], 24, 256, 16, 3),
]


def _push_both(R, Ts, t_cap, D, E, K, ranks):
    """Every rank's dispatch_push (bf16 payload) into one emulated group and dispatch_push_fp8 into
    another; returns (layout, bf16 group, fp8 group, the fp8 kernel's non-finite count)."""
    ws = WorkspaceLayout.build(R, t_cap, D, K)
    pa, pb = emulated_group(R, ws.nbytes, DEV), emulated_group(R, ws.nbytes, DEV)
    count = torch.zeros(1, dtype=torch.int32, device=DEV)
    for r, (x, ids, s, _) in enumerate(ranks):
        ep_comm.dispatch_push(x, None, ids, s, ws, pa[r].ptr_table(), r, E // R)
        ep_comm.dispatch_push_fp8(x, ids, s, ws, pb[r].ptr_table(), r, E // R, nonfinite_count=count)
    return ws, pa, pb, count


@pytest.mark.parametrize("case", KERNEL_CASES, ids=[f"{c[0]}-R{c[1]}-D{c[4]}" for c in KERNEL_CASES])
def test_fp8_push_equals_receive_side_quantization(case):
    routing, R, Ts, t_cap, D, E, K = case
    ranks = _tokens(routing, R, Ts, D, E, K, seed=5)
    ws, pa, pb, count = _push_both(R, Ts, t_cap, D, E, K, ranks)
    n = R * t_cap
    for r in range(R):
        bf16 = {k: ws.view(pa[r].buffer(), k) for k in ("x", "ids", "scores")}
        fp8 = {k: ws.view(pb[r].buffer(), k) for k in ("xq", "xs", "ids", "scores")}
        for k in ("ids", "scores"):
            assert torch.equal(bf16[k], fp8[k]), f"rank {r} {k}"
        placed = (fp8["ids"].reshape(n, K) >= 0).any(1)
        xq, xs = fp8["xq"].reshape(n, D), fp8["xs"].reshape(n, -1)
        assert xs.shape[1] == -(-D // 128)
        if placed.any():
            want_q, want_s = quantize_act_1x128(bf16["x"].reshape(n, D)[placed].contiguous())
            assert torch.equal(xq[placed].view(torch.uint8), want_q.view(torch.uint8)), f"rank {r}: e4m3 rows differ"
            assert torch.equal(xs[placed], want_s), f"rank {r}: scales differ"
        # rows no source sent are untouched (still the 0xFF poison of a fresh workspace)
        assert (xq[~placed].view(torch.uint8) == 255).all() and (xs[~placed].view(torch.int32) == -1).all()
    assert int(count.item()) == 0


def test_worked_example():
    """The ``dispatch_push_fp8`` docstring example: R = 2, one expert per rank, T_cap = 2, D = 128."""
    R, t_cap, D, K = 2, 2, 128, 1
    ws = WorkspaceLayout.build(R, t_cap, D, K)
    peers = emulated_group(R, ws.nbytes, DEV)
    x = torch.zeros(2, D, dtype=torch.bfloat16, device=DEV)
    x[0, 0], x[1, 0] = 896.0, 1.0
    ids = torch.tensor([[1], [0]], device=DEV)
    ep_comm.dispatch_push_fp8(x, ids, torch.ones(2, 1, device=DEV), ws, peers[0].ptr_table(), 0, 1)
    q1, s1 = ws.view(peers[1].buffer(), "xq")[0, 0].float(), ws.view(peers[1].buffer(), "xs")[0, 0]
    q0, s0 = ws.view(peers[0].buffer(), "xq")[0, 1].float(), ws.view(peers[0].buffer(), "xs")[0, 1]
    assert q1[0] == 448 and (q1[1:] == 0).all() and s1.tolist() == [2.0]
    assert q0[0] == 448 and (q0[1:] == 0).all() and torch.equal(s0, torch.tensor([1.0], device=DEV) / 448)


def test_nonfinite_groups_counted_once_per_token():
    """inf in one group of a token routed to two ranks, NaN in another token's group: 2, not 3 (the
    count is per token on the source, whatever the number of its destinations)."""
    R, t_cap, D, K, E = 2, 8, 256, 2, 2
    ws = WorkspaceLayout.build(R, t_cap, D, K)
    peers = emulated_group(R, ws.nbytes, DEV)
    x = torch.randn(4, D, device=DEV).bfloat16()
    x[1, 130] = float("inf")
    x[2, 5] = float("nan")
    ids = torch.tensor([[0, 1], [0, 1], [0, 0], [1, 1]], device=DEV)
    count = torch.zeros(1, dtype=torch.int32, device=DEV)
    ep_comm.dispatch_push_fp8(x, ids, torch.ones(4, K, device=DEV), ws, peers[0].ptr_table(), 0, 1,
                              nonfinite_count=count)
    assert int(count.item()) == 2


def test_dispatch_fp8_errors():
    R, t_cap, D, K = 2, 4, 128, 1
    ws = WorkspaceLayout.build(R, t_cap, D, K)
    peers = emulated_group(R, ws.nbytes, DEV)
    ids, s = torch.zeros(4, K, dtype=torch.int64, device=DEV), torch.ones(4, K, device=DEV)
    push = lambda x, i=ids, sc=s: ep_comm.dispatch_push_fp8(x, i, sc, ws, peers[0].ptr_table(), 0, 1)  # noqa: E731
    with pytest.raises(ValueError, match="multiple of 128"):
        push(torch.zeros(4, 64, dtype=torch.bfloat16, device=DEV))
    with pytest.raises(ValueError, match="T_cap=4"):
        push(torch.zeros(5, D, dtype=torch.bfloat16, device=DEV), torch.zeros(5, K, dtype=torch.int64, device=DEV),
             torch.ones(5, K, device=DEV))
    with pytest.raises(ValueError, match="contiguous"):
        push(torch.zeros(D, 4, dtype=torch.bfloat16, device=DEV).t())
    ctx = EPRank(peers[0], ws, 1, R * t_cap * K, FP8_BLOCK_M)
    w = torch.zeros(1, 128, D, dtype=torch.bfloat16, device=DEV)
    steps = ep_fp8_forward_steps(ctx, torch.zeros(4, D, dtype=torch.bfloat16, device=DEV), ids, s, w,
                                 w.transpose(1, 2), w, [], True, payload="int8")
    with pytest.raises(ValueError, match="choose one of"):
        next(steps)


def test_fp8_slab_overlays_dy():
    """xq and xs lie inside the dy region (no other region's bytes, no growth of the workspace), xs
    after xq, 256-byte aligned; views have the documented shapes and dtypes."""
    for R, T, D, K in ((2, 16384, 2048, 8), (8, 16384, 4096, 8), (3, 5, 16, 2), (4, 16, 384, 2)):
        ws = WorkspaceLayout.build(R, T, D, K)
        assert ws.nbytes == WorkspaceLayout.build(R, T, D, K).nbytes
        lo, hi = ws.offsets["dy"], ws.offsets["ids"]
        assert ws.offsets["xq"] == lo and ws.offsets["xs"] % 256 == 0
        assert ws.offsets["xq"] + R * T * D <= ws.offsets["xs"]
        assert ws.offsets["xs"] + R * T * (-(-D // 128)) * 4 <= hi
        if D >= 128:
            assert hi - lo == -(-(R * T * D * 2) // 256) * 256  # the dy region did not grow
        buf = torch.empty(ws.nbytes, dtype=torch.uint8, device="meta")  # shapes only (GBs at the real sizes)
        assert ws.view(buf, "xq").dtype == torch.float8_e4m3fn and ws.view(buf, "xq").shape == (R, T, D)
        assert ws.view(buf, "xs").dtype == torch.float32 and ws.view(buf, "xs").shape == (R, T, -(-D // 128))


# --------------------------------------------------------------------------------------------------
# The layer: FP8 payload == bf16 payload, forward and backward, bitwise
# --------------------------------------------------------------------------------------------------

LAYER_CASES = [
    # (routing, R, tokens per rank, T_cap, D, F, E, K, backward too): the edges each row covers
    # top_k = 1, every token on expert 0: zero-token experts, all tokens to rank 0 (rank 1 receives
    # nothing), T not a multiple of 128 or of the token block
    ("one_expert", 2, [70, 45], 72, 128, 128, 4, 1, True),
    # EP = 4, one expert per rank, a zero-token expert
    ("zero_expert", 4, [12, 9, 16, 5], 16, 128, 128, 4, 2, True),
    # a source rank with no tokens (it still sends its metadata and receives), tokens on both ranks;
    # forward only: the backward does not depend on the payload except through the forward's outputs
    # (gate_up, layout), compared bitwise here, and costs ~6 s per run in the interpreter
    ("uniform", 2, [0, 19], 19, 128, 128, 4, 2, False),
    # EP = 8, two experts per rank, a source rank with no tokens, uneven token counts; forward only
    # (as above: ~12 s, ~33 s with the backward)
    ("uniform", 8, [13, 0, 17, 5, 21, 9, 1, 11], 24, 128, 128, 16, 2, False),
]


def _weights(E, F, D, seed):
    g = torch.Generator().manual_seed(seed)
    w1 = (torch.randn(E, F, D, generator=g) / D**0.5).bfloat16()
    w3 = (torch.randn(E, F, D, generator=g) / D**0.5).bfloat16()
    w2 = (torch.randn(E, D, F, generator=g) / F**0.5).bfloat16()
    return [w.to(DEV) for w in (w1, w2, w3)]


def _forward(ctxs, local, wq, ranks, payload):
    return run_lockstep([ep_fp8_forward_steps(ctxs[r], x, ids, s, *local[r], wq[r], True, f"rank{r}", payload=payload)
                         for r, (x, ids, s, _) in enumerate(ranks)])


def _fwd_bwd(ctxs, local, wq, ranks, payload, bwd=True):
    """Per rank: [out, gate_up, layout tensors..., dx, dscores, dw1, dw2, dw3] (forward only: no bwd)."""
    fwd = _forward(ctxs, local, wq, ranks, payload)
    if not bwd:
        return [_flat(f) for f in fwd]
    bwd = run_lockstep([ep_fp8_backward_steps(ctxs[r], dy, x, ids, s, wq[r][:6], fwd[r][1], fwd[r][2],
                                              torch.bfloat16, f"rank{r}")
                        for r, (x, ids, s, dy) in enumerate(ranks)])
    return [_flat(f) + list(b) for f, b in zip(fwd, bwd)]


def _flat(fwd):
    """gate_up cut at offsets[E]: rows of tiles with expert -1 are never written (torch.empty)."""
    out, gate_up, L = fwd
    return [out, gate_up[:int(L.offsets[-1])], L.counts, L.offsets, L.row_pair, L.pair_row, L.tile_expert]


FLAT_NAMES = ("out", "gate_up", "counts", "offsets", "row_pair", "pair_row", "tile_expert", "dx", "dscores", "dw1",
              "dw2", "dw3")


@pytest.mark.parametrize("case", LAYER_CASES, ids=[f"{c[0]}-R{c[1]}-K{c[7]}" for c in LAYER_CASES])
def test_fp8_payload_bitwise_equals_bf16_payload(case):
    routing, R, Ts, t_cap, D, F, E, K, bwd = case
    weights = _weights(E, F, D, seed=3)
    ranks = _tokens(routing, R, Ts, D, E, K, seed=4)
    ws = WorkspaceLayout.build(R, t_cap, D, K)
    peers = emulated_group(R, ws.nbytes, DEV)
    ctxs = [EPRank(peers[r], ws, E // R, R * t_cap * K, FP8_BLOCK_M) for r in range(R)]
    e_l = E // R
    local = [[w[r * e_l:(r + 1) * e_l] for w in weights] for r in range(R)]
    wq = [prepare_weights(*local[r], fp8_forward=True, cache=None, layer_name=f"rank{r}") for r in range(R)]
    fp8 = _fwd_bwd(ctxs, local, wq, ranks, "fp8", bwd)  # fresh workspace: unplaced xq / xs rows are poison
    bf16 = _fwd_bwd(ctxs, local, wq, ranks, "bf16", bwd)
    again = _forward(ctxs, local, wq, ranks, "fp8")  # xq / xs over stale bytes (the last backward's dy)
    NONFINITE.flush()  # neither payload saw a non-finite group (poison / stale rows are never quantized or read)
    for r in range(R):
        for name, a, b in zip(FLAT_NAMES, fp8[r], bf16[r]):
            assert a.dtype == b.dtype and torch.equal(a, b), f"rank {r} {name}: FP8 payload differs from bf16 payload"
        for name, a, b in zip(FLAT_NAMES, _flat(again[r]), fp8[r]):
            assert torch.equal(a, b), f"rank {r} {name}: second FP8-payload forward (stale slab) differs"
        assert all(torch.isfinite(t).all() for t in fp8[r][:2] + fp8[r][7:]), f"rank {r}: not finite"
        assert len(fp8[r]) == (12 if bwd else 7)
