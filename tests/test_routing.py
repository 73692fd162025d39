"""Routing layout (kernels/routing.py): invariants on named routings, and the Triton build against the
torch build, bitwise.

On CPU the Triton kernels run in the interpreter (conftest sets TRITON_INTERPRET=1; routing.py reads it
at call time). The interpreter costs ~0.3 ms per operation per program, so cases keep T small and E
moderate; several loop steps and several splits come from small explicit ``block`` / ``chunk``.

The sm_90a compile check runs in a subprocess with TRITON_INTERPRET=0 (``python tests/test_routing.py
compile-sm90``), as in test_kernels_fwd.py: no GPU needed, catches kernels that only the interpreter
accepts and register spills.
"""

import os

# Before any import of triton. Run as a script (compile check), the default is the real compiler.
os.environ.setdefault("TRITON_INTERPRET", "0" if __name__ == "__main__" else "1")

import sys  # noqa: E402

if __name__ == "__main__":
    import _script_setup  # noqa: F401  (this checkout first; registration stubs on a bare GPU machine)

import json  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from titan_megamoe.kernels import routing  # noqa: E402
from titan_megamoe.kernels.routing import (  # noqa: E402
    build_routing_layout,
    build_routing_layout_torch,
    build_routing_layout_triton,
    layout_caps,
)
from titan_megamoe.kernels.sm90_check import compile_sm90  # noqa: E402
from _sm90 import sm90_result  # noqa: E402
from titan_megamoe.kernels.jit import flavor  # noqa: E402
from titan_megamoe.testing import make_routing  # noqa: E402

FIELDS = ("counts", "offsets", "row_pair", "pair_row", "tile_expert")


def assert_same_layout(got, want):
    """Bitwise equality of every tensor field (dtype and shape included) and of the constants."""
    for f in FIELDS:
        a, b = getattr(got, f), getattr(want, f)
        assert a.dtype == b.dtype == torch.int32, f"{f}: dtype {a.dtype} vs {b.dtype}"
        assert a.shape == b.shape, f"{f}: shape {tuple(a.shape)} vs {tuple(b.shape)}"
        bad = (a != b).nonzero().flatten()
        assert bad.numel() == 0, f"{f}: {bad.numel()} entries differ, first at {bad[:8].tolist()}: " \
                                 f"{a[bad[:8]].tolist()} vs {b[bad[:8]].tolist()}"
    assert (got.block_m, got.num_experts, got.top_k) == (want.block_m, want.num_experts, want.top_k)


@pytest.fixture
def poisoned(monkeypatch):
    """Triton output buffers start as -7 (never a valid value): an element no kernel writes shows up
    as a mismatch instead of passing by luck with whatever torch.empty returned."""
    monkeypatch.setattr(routing, "_empty_i32", lambda n, device: torch.full((n,), -7, dtype=torch.int32,
                                                                           device=device))


@pytest.mark.parametrize("build", [build_routing_layout, build_routing_layout_torch], ids=["dispatch", "torch"])
def test_docstring_example(build):
    L = build(torch.tensor([[2, 0], [0, 1]]), 3, 2)
    assert L.counts.tolist() == [2, 1, 1]
    assert L.offsets.tolist() == [0, 2, 4, 6]
    assert L.row_pair.tolist()[:6] == [1, 2, 3, -1, 0, -1]
    assert L.pair_row.tolist() == [4, 0, 1, 2]
    assert L.tile_expert.tolist()[:4] == [0, 1, 2, -1]


CASES = [
    # (routing, T, E, K, BM): what it covers
    ("uniform", 37, 8, 2, 4),
    ("zero_expert", 64, 8, 3, 8),  # experts with no row have no tile
    ("one_expert", 50, 8, 1, 16),  # top_k = 1, one expert gets every token
    ("skewed", 101, 16, 4, 32),  # T not a multiple of BM, hot experts
    ("uniform", 1, 4, 4, 128),  # one token, K = E
]


@pytest.mark.parametrize("routing_kind,T,E,K,BM", CASES, ids=[f"{c[0]}-T{c[1]}-K{c[3]}-BM{c[4]}" for c in CASES])
def test_layout_invariants(routing_kind, T, E, K, BM):
    ids = make_routing(routing_kind, T, E, K, seed=T)
    L = build_routing_layout(ids, E, BM)
    n_cap, n_tiles = layout_caps(T, K, E, BM)
    assert L.row_pair.shape == (n_cap,) and L.tile_expert.shape == (n_tiles,)
    flat = ids.reshape(-1)
    counts = torch.bincount(flat, minlength=E)
    assert torch.equal(L.counts.long(), counts)
    padded = (counts + BM - 1) // BM * BM
    assert L.offsets.tolist() == [0] + torch.cumsum(padded, 0).tolist()
    # every pair sits in its expert's range, in ascending pair order, and the maps are inverse
    for e in range(E):
        lo, hi = L.offsets[e].item(), L.offsets[e + 1].item()
        pairs = L.row_pair[lo:hi]
        real = pairs[pairs >= 0]
        assert real.tolist() == torch.nonzero(flat == e).squeeze(1).tolist()
        assert torch.all(pairs[len(real):] == -1)  # padding at the end of the expert's block
        assert all(L.tile_expert[r // BM].item() == e for r in range(lo, hi, BM))
    assert torch.equal(L.row_pair[L.pair_row.long()], torch.arange(T * K, dtype=torch.int32))
    assert torch.all(L.row_pair[L.offsets[E]:] == -1)
    assert torch.all(L.tile_expert[L.offsets[E].item() // BM:] == -1)


# --------------------------------------------------------------------------------------------------
# Triton build == torch build, bitwise
# --------------------------------------------------------------------------------------------------


def _ids(kind: str, T: int, K: int, E: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """(T, K) expert ids of a named pattern (ids may repeat within a token: the layout allows it)."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "random":  # uniform, with repeats
        ids = torch.randint(0, E, (T, K), generator=gen)
    elif kind == "last":  # every pair on the last expert
        ids = torch.full((T, K), E - 1)
    elif kind == "first":  # every pair on expert 0
        ids = torch.full((T, K), 0)
    elif kind == "odd":  # only odd experts: 0, the even ones (and E - 1 when E is odd) get nothing
        ids = torch.randint(0, E // 2, (T, K), generator=gen) * 2 + 1
    elif kind == "hot":  # one expert takes ~3/4 of the pairs, the rest spread
        ids = torch.where(torch.rand(T, K, generator=gen) < 0.75, E // 2, torch.randint(0, E, (T, K), generator=gen))
    elif kind == "transposed":  # a non-contiguous (T, K) view
        ids = torch.randint(0, E, (K, T), generator=gen).t()
    else:
        ids = make_routing(kind, T, E, K, seed=seed)  # distinct per token (uniform, skewed, ...)
    # on a GPU machine the kernels are compiled (interpreter off): run them on the GPU
    return ids.to(dtype).to("cuda" if torch.cuda.is_available() else "cpu")


CMP_CASES = [
    # (kind, T, K, E, BM, ids dtype, block, chunk): what it covers
    ("random", 37, 4, 8, 16, torch.int64, None, None),  # T not a multiple of anything
    ("random", 37, 4, 8, 16, torch.int32, None, None),  # int32 ids
    ("uniform", 1, 4, 4, 128, torch.int64, None, None),  # T = 1, K = E, BM 128
    ("uniform", 1, 1, 1, 16, torch.int32, None, None),  # E = 1, P = 1
    ("last", 50, 1, 8, 16, torch.int64, None, None),  # K = 1, every pair on the last expert
    ("first", 20, 3, 6, 128, torch.int32, None, None),  # E = 6, every pair on expert 0
    ("odd", 64, 2, 60, 16, torch.int32, None, None),  # E = 60, half the experts empty (incl. 0)
    ("random", 45, 2, 60, 128, torch.int64, None, None),  # E = 60, BM 128: most experts < 1 tile
    ("skewed", 101, 4, 16, 32, torch.int64, None, None),  # hot experts, long tail
    ("zero_expert", 40, 3, 6, 16, torch.int32, None, None),  # E = 6, experts with no pair
    ("transposed", 33, 2, 8, 16, torch.int64, None, None),  # non-contiguous ids
    ("random", 0, 2, 4, 16, torch.int64, None, None),  # no pair at all: everything is tail
    ("random", 100, 4, 8, 128, torch.int64, 16, None),  # one split, 25 loop steps
    ("hot", 300, 2, 6, 16, torch.int64, 16, 64),  # 10 splits x 4 steps, last split partial
    ("odd", 97, 3, 6, 16, torch.int32, 16, 48),  # splits holding none of some expert
    ("random", 70, 8, 8, 16, torch.int32, 32, 32),  # one step per split, 18 splits
]


@pytest.mark.parametrize(
    "kind,T,K,E,BM,dtype,block,chunk", CMP_CASES,
    ids=[f"{c[0]}-T{c[1]}-K{c[2]}-E{c[3]}-BM{c[4]}-{str(c[5])[6:]}-b{c[6]}-c{c[7]}" for c in CMP_CASES],
)
def test_triton_matches_torch_bitwise(poisoned, kind, T, K, E, BM, dtype, block, chunk):
    ids = _ids(kind, T, K, E, dtype, seed=T * 31 + E)
    got = build_routing_layout_triton(ids, E, BM, block=block, chunk=chunk)
    assert_same_layout(got, build_routing_layout_torch(ids, E, BM))


def test_triton_deterministic(poisoned):
    ids = _ids("hot", 64, 4, 8, torch.int64, seed=3)
    a = build_routing_layout_triton(ids, 8, 16, block=16, chunk=32)
    b = build_routing_layout_triton(ids, 8, 16, block=32, chunk=None)  # another split: same bits
    assert_same_layout(a, b)


def test_split_plan():
    """Compiled-mode defaults: splits cover P exactly once, none empty, the hist fits the bound."""
    for P in (0, 1, 1000, 4096, 4097, 131072, 1 << 20):
        for E in (1, 6, 8, 128, 1000, 4096):
            S, chunk = routing._split_plan(P, E, 1024, None)
            assert chunk % 1024 == 0 and chunk >= 1024 and S >= 1
            assert S * chunk >= P and (S - 1) * chunk < max(P, 1)
            assert routing._next_pow2(E) * routing._next_pow2(S) <= routing._HIST_MAX
    assert routing._split_plan(131072, 128, 1024, None) == (32, 4096)  # 30B/235B: 16k tokens, top-8
    with pytest.raises(ValueError):
        routing._split_plan(1 << 20, 4096, 16, 16)


def test_two_launches_no_other_op(monkeypatch):
    """The Triton build launches exactly two kernels and runs no other torch op than allocations and
    views (so no hidden launch and no host sync such as .item())."""
    from torch.utils._python_dispatch import TorchDispatchMode

    launches, ops = [], []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(str(func))
            return func(*args, **(kwargs or {}))

    monkeypatch.setattr(routing, "launch", lambda k, grid, *a, **kw: launches.append((k.fn.__name__, grid)))
    ids = torch.randint(0, 8, (37, 4))  # contiguous int64: no cast, no copy
    with Record():
        build_routing_layout_triton(ids, 8, 16, block=16, chunk=64)
    assert [(n, g) for n, g in launches] == [("_count_kernel", (8, 3)), ("_layout_kernel", (9, 3))]
    assert set(ops) <= {"aten.view.default", "aten.empty.memory_format"}, ops
    launches.clear(), ops.clear()
    with Record():
        build_routing_layout_triton(ids, 8, 16, block=16, chunk=64, one_allocation=True)
    assert [(n, g) for n, g in launches] == [("_count_kernel", (8, 3)), ("_layout_kernel", (9, 3))]
    assert set(ops) <= {"aten.view.default", "aten.empty.memory_format", "aten.split_with_sizes.default"}, ops
    assert ops.count("aten.empty.memory_format") == 1, ops  # one allocation for the six arrays and the hist


@pytest.mark.parametrize("T,K,E,BM,block,chunk", [(29, 3, 5, 16, None, None), (300, 2, 6, 16, 16, 64),
                                                   (0, 2, 4, 16, None, None)], ids=["odd", "splits", "empty"])
def test_one_allocation_matches_torch_bitwise(poisoned, T, K, E, BM, block, chunk):
    """``one_allocation``: the same layout (poisoned buffer, every element written), several splits, no pair."""
    ids = _ids("hot", T, K, E, torch.int64, seed=T + E)
    got = build_routing_layout_triton(ids, E, BM, block=block, chunk=chunk, one_allocation=True)
    assert_same_layout(got, build_routing_layout_torch(ids, E, BM))


def test_layout_arrays_share_one_allocation_each_128_byte_aligned():
    """The arrays are views of one buffer, each starting on a 128-byte boundary (the alignment of a separate
    allocation: the kernels get the same 16-byte-aligned specialization), none overlapping another."""
    L = build_routing_layout_triton(_ids("random", 29, 3, 5, torch.int64, seed=3), 5, 16, one_allocation=True)
    arrays = [L.counts, L.offsets, L.row_pair, L.pair_row, L.tile_expert]
    assert len({a.untyped_storage().data_ptr() for a in arrays}) == 1
    spans = sorted((a.storage_offset(), a.storage_offset() + a.numel()) for a in arrays)
    assert all(a.storage_offset() % 32 == 0 and a.is_contiguous() for a in arrays)
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:])), spans
    assert [a.numel() for a in arrays] == [5, 6, L.n_cap, 29 * 3, L.n_tiles_cap]


def test_dispatch(monkeypatch):
    """CPU ids: the Triton build when TRITON_INTERPRET=1, else the torch build (both read per call)."""
    calls = []
    monkeypatch.setattr(routing, "build_routing_layout_triton", lambda *a, **k: calls.append("triton"))
    monkeypatch.setattr(routing, "build_routing_layout_torch", lambda *a, **k: calls.append("torch"))
    ids = torch.zeros(2, 2, dtype=torch.int64)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    routing.build_routing_layout(ids, 4, 16)
    routing.build_routing_layout(ids, routing.MAX_TRITON_EXPERTS + 1, 16)  # too many experts: torch
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    routing.build_routing_layout(ids, 4, 16)
    assert calls == ["triton", "torch", "torch"]


@pytest.mark.cuda
@pytest.mark.parametrize("T,K,E,BM", [(16384, 8, 128, 128), (4097, 6, 60, 128), (1, 8, 128, 128), (5000, 2, 1024, 64)])
def test_triton_matches_torch_cuda(T, K, E, BM):
    gen = torch.Generator().manual_seed(T)
    for dtype in (torch.int64, torch.int32):
        ids = torch.randint(0, E, (T, K), generator=gen).to(dtype).cuda()
        ids[: T // 2] = torch.randint(0, 4, (T // 2, K), generator=gen).to(dtype).cuda()  # a few hot experts
        assert_same_layout(build_routing_layout(ids, E, BM), build_routing_layout_torch(ids, E, BM))


# --------------------------------------------------------------------------------------------------
# sm_90a compile check (subprocess, no GPU needed)
# --------------------------------------------------------------------------------------------------

COMPILE_CASES = [
    # (label, ids type, E_PAD, S_PAD, BM)
    ("i64_e128_s32", "*i64", 128, 32, 128),  # 16k tokens, top-8, 128 experts (the default plan)
    ("i32_e128_s32", "*i32", 128, 32, 128),
    ("i64_e4096_s1", "*i64", 4096, 1, 128),  # MAX_TRITON_EXPERTS
    ("i64_e8_s1", "*i64", 8, 1, 16),
]


def _compile_sm90_all() -> list[dict]:
    results = []
    for label, ids_ty, e_pad, s_pad, bm in COMPILE_CASES:
        i32 = ("P", "CHUNK", "S")
        sig = {"ids_ptr": ids_ty, "hist_ptr": "*i32", **{n: "i32" for n in i32}}
        r = compile_sm90(flavor(routing._count_kernel, False), sig, dict(BLOCK=1024), num_warps=4, num_stages=1)
        results.append(dict(label=f"count_{label}", **r))
        sig = {"ids_ptr": ids_ty, **{n: "*i32" for n in ("hist_ptr", "counts_ptr", "offsets_ptr", "row_pair_ptr",
                                                         "pair_row_ptr", "tile_expert_ptr")},
               **{n: "i32" for n in (*i32, "E", "N_CAP", "N_TILES")}}
        cx = dict(BM=bm, BM_PAD=bm, E_PAD=e_pad, S_PAD=s_pad, BLOCK=1024)
        r = compile_sm90(flavor(routing._layout_kernel, False), sig, cx, num_warps=4, num_stages=1)
        results.append(dict(label=f"layout_{label}", **r))
    return results


@pytest.mark.parametrize("label", [f"{k}_{c[0]}" for c in COMPILE_CASES for k in ("count", "layout")])
def test_compiles_for_sm90a(label):
    r = sm90_result(__file__, label)
    assert r["target"], "PTX not built for sm_90a"
    assert "STACK:0" in r["usage"] or not r["usage"], f"{label}: register spills ({r['usage']})"



EP_CASES = [  # (T, K, E, BM, max_rows): expert-parallel receive side, slots of other ranks are -1
    (37, 4, 6, 16, None),
    (50, 8, 8, 16, 120),  # capacity overflow: 400 pairs (minus -1 slots) into 120 rows
    (20, 2, 3, 16, 1000),  # cap above need: same layout as no cap, bigger N_cap only when < T*K
    (1, 1, 4, 16, 1),
]


@pytest.mark.parametrize("T,K,E,BM,max_rows", EP_CASES)
def test_unplaced_ids_and_capacity(poisoned, T, K, E, BM, max_rows):
    """Ids outside [0, E) (-1: another rank's slot; E + 3) are never placed (pair_row -1, not counted);
    with max_rows below the need, the layout stays in its buffers (offsets clamped to N_cap), every
    placed pair round-trips, the counts stay exact (the caller detects the overflow), and the Triton
    and torch builds agree bitwise."""
    gen = torch.Generator().manual_seed(T + E)
    ids = torch.randint(-1, E, (T, K), generator=gen)
    ids[::5, 0] = E + 3
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    ids = ids.to(dev)
    tri = build_routing_layout_triton(ids, E, BM, max_rows=max_rows)
    ref = build_routing_layout_torch(ids, E, BM, max_rows=max_rows)
    assert_same_layout(tri, ref)
    n_cap, _ = layout_caps(T, K, E, BM, max_rows)
    assert tri.n_cap == n_cap
    flat = ids.reshape(-1).cpu()
    valid = (flat >= 0) & (flat < E)
    assert torch.equal(tri.counts.cpu(), torch.bincount(flat[valid], minlength=E).to(torch.int32))
    pr = tri.pair_row.cpu()
    assert (pr[~valid] == -1).all()
    placed = (pr >= 0).nonzero().flatten()
    assert torch.equal(tri.row_pair.cpu()[pr[placed].long()], placed.to(torch.int32))
    assert int(tri.offsets[-1]) <= n_cap
    if max_rows is None or int(valid.sum()) + E * (BM - 1) <= n_cap:
        assert int((pr >= 0).sum()) == int(valid.sum())  # no overflow: every valid pair placed
    else:
        assert int((pr >= 0).sum()) < int(valid.sum())


if __name__ == "__main__":
    if sys.argv[1:2] == ["compile-sm90"]:
        print(json.dumps(_compile_sm90_all()))
    else:
        raise SystemExit("usage: python tests/test_routing.py compile-sm90")
