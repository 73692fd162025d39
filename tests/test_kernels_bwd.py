"""Backward grouped-GEMM kernels: GEMM2 dgrad + SwiGLU bwd + d score, GEMM1 dgrad + dx scatter, and
the per-expert weight gradients, against autograd through the oracle ``mega_moe_ref``.

On CPU the kernels run in Triton's interpreter: TRITON_INTERPRET=1 is set below before anything can
import triton, and the kernel module reads it again at launch time (pytest may import it earlier
through another test file). Kernels get bf16 operands; the oracle gets the same bf16-rounded values in
fp32, so every comparison uses the bf16 bound ``TOLERANCES[torch.bfloat16]`` (2e-2): the kernels
round gate_up, h, dgate_up and dx_rows to bf16 (truncating in the interpreter), the oracle does not.

Forward quantities (gate_up) are built here with plain torch matmuls from the layout: input
preparation, not the oracle. Rows of tiles whose expert is -1 are NaN-poisoned, as the forward leaves
them unwritten, so a kernel reading them fails the test.

The sm_90a compile check runs in a subprocess with TRITON_INTERPRET=0 (triton's own jit library
functions are InterpretedFunctions once triton was imported in interpreter mode).
``python tests/test_kernels_bwd.py gpu`` on a GPU: correctness of the compiled kernels + timings.
"""

import os

# Before any import of triton (see the module docstring). As a script (compile check / GPU run), the
# default is the real compiler.
os.environ.setdefault("TRITON_INTERPRET", "0" if __name__ == "__main__" else "1")

import sys  # noqa: E402

if __name__ == "__main__":
    import _script_setup  # noqa: F401  (this checkout first; registration stubs on a bare GPU machine)

import dataclasses  # noqa: E402
import json  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from titan_megamoe.kernels.sm90_check import (  # noqa: E402
    HOPPER_SMEM_BYTES,
    compile_sm90,
)
from _sm90 import sm90_result  # noqa: E402
from titan_megamoe.testing import TOLERANCES, assert_close_rel, bench_layer_inputs, make_routing  # noqa: E402

SMEM_LIMIT_SM90 = HOPPER_SMEM_BYTES
TOL = torch.bfloat16  # tolerance key: bf16 operands (TOLERANCES[torch.bfloat16])


def _device() -> str:
    """Where the kernel tests run: CPU under the interpreter, else the GPU (compiled), else skip."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "cpu"
    if torch.cuda.is_available():
        return "cuda"
    pytest.skip("TRITON_INTERPRET is not 1 and no CUDA GPU is visible: nowhere to run the kernels")


def _bwd_module():
    # Lazy: imported inside tests so TRITON_INTERPRET is already set whatever pytest collected first.
    from titan_megamoe.kernels import grouped_gemm_bwd

    return grouped_gemm_bwd


@dataclasses.dataclass(frozen=True)
class Case:
    routing: str
    T: int
    E: int
    K: int
    D: int
    F: int
    use_tma: bool = True
    out_dtype: torch.dtype = torch.bfloat16
    seed: int = 0
    save_hs: bool = False  # gemm2_dgrad stores s * h, wgrad_w2 reads it (else recomputes from gate_up)


CASES = [
    Case("uniform", 37, 4, 2, 64, 48),  # near-uniform load; T=37 not a multiple of BM=16
    Case("uniform", 37, 4, 2, 64, 48, use_tma=False),  # pointer fallback of every contiguous operand
    Case("uniform", 37, 4, 2, 64, 48, save_hs=True),  # wgrad_w2 from the stored s * h rows (TMA)
    Case("zero_expert", 33, 8, 2, 32, 32, seed=1, save_hs=True),  # starved experts: exact-zero wgrad
    Case("one_expert", 40, 4, 3, 32, 48, seed=2),  # expert 0 holds all 40 tokens: long row loop
    Case("skewed", 35, 8, 4, 32, 32, seed=3, use_tma=False, save_hs=True),  # Zipf load, K=4; hs by pointer
    Case("uniform", 31, 4, 1, 64, 32, seed=4),  # top_k = 1
    Case("uniform", 30, 4, 2, 32, 40, seed=5, out_dtype=torch.float32),  # F % BN != 0; fp32 wgrad
]


def _inputs(c: Case, block_m: int, dev: str | None = None) -> dict:
    """bf16 kernel inputs (fp32 copies of the same values for the oracle) and the forward's gate_up."""
    from titan_megamoe.kernels.routing import build_routing_layout

    dev = dev or _device()
    g = torch.Generator().manual_seed(c.seed)
    T, E, K, D, F = c.T, c.E, c.K, c.D, c.F
    ids = make_routing(c.routing, T, E, K, seed=c.seed)
    x = torch.randn(T, D, generator=g).bfloat16()
    w1 = (torch.randn(E, F, D, generator=g) / D**0.5).bfloat16()
    w3 = (torch.randn(E, F, D, generator=g) / D**0.5).bfloat16()
    w2 = (torch.randn(E, D, F, generator=g) / F**0.5).bfloat16()
    scores = torch.softmax(torch.randn(T, K, generator=g), -1)
    dout = torch.randn(T, D, generator=g).bfloat16()
    t = dict(ids=ids, x=x, w1=w1, w2=w2, w3=w3, scores=scores, dout=dout)
    t = {k: v.to(dev) for k, v in t.items()}
    layout = build_routing_layout(t["ids"], E, block_m)
    # gate_up[r] = [x[t] @ w1[e].T, x[t] @ w3[e].T] (fp32 math, bf16 store), zeros on padding rows,
    # NaN on rows of tiles with expert -1 (the forward leaves them unwritten).
    pair = layout.row_pair.long()
    ok = pair >= 0
    tok = torch.where(ok, pair // K, 0)
    expert = layout.tile_expert.long().repeat_interleave(block_m)
    xe = t["x"].float()[tok]
    we = expert.clamp(min=0)
    gate = torch.einsum("nd,nfd->nf", xe, t["w1"].float()[we])
    up = torch.einsum("nd,nfd->nf", xe, t["w3"].float()[we])
    gate_up = (torch.cat([gate, up], 1) * ok[:, None]).bfloat16()
    gate_up[expert < 0] = float("nan")
    t.update(layout=layout, gate_up=gate_up)
    return t


def _configs(c: Case, layout, D: int, F: int) -> dict:
    B = _bwd_module()
    return {k: dataclasses.replace(B.default_bwd_config(k, layout, D, F), use_tma=c.use_tma)
            for k in ("gemm2_dgrad", "gemm1_dgrad", "wgrad_w2", "wgrad_w13")}


def _run_bwd(t: dict, c: Case, cfg: dict, outs: dict | None = None) -> dict:
    """The whole backward chain; ``outs`` optionally supplies caller buffers for every output."""
    B = _bwd_module()
    o = outs or {}
    lay = t["layout"]
    hs = o.get("hs", torch.empty(lay.n_cap, c.F, dtype=torch.bfloat16, device=t["x"].device)) if c.save_hs else None
    dgu, part = B.gemm2_dgrad_swiglu_bwd(t["dout"], t["w2"], t["gate_up"], t["scores"], lay, cfg["gemm2_dgrad"],
                                         out=o.get("g2"), hs_out=hs)
    dscore = B.reduce_dscore(part, lay, c.T, c.K, out=o.get("dscore"))
    dx_rows = B.gemm1_dgrad(dgu, t["w1"], t["w3"], lay, cfg["gemm1_dgrad"], out=o.get("dx_rows"))
    dx = B.scatter_dx(dx_rows, lay, c.T, c.K, out=o.get("dx"))
    dw2 = B.wgrad_w2(t["dout"], t["gate_up"], t["scores"], lay, cfg["wgrad_w2"], hs_NF=hs, out_dtype=c.out_dtype,
                     out=o.get("dw2"))
    dw1, dw3 = B.wgrad_w13(dgu, t["x"], lay, cfg["wgrad_w13"], out_dtype=c.out_dtype, out=o.get("w13"))
    res = dict(dgate_up=dgu, dscore_partial=part, dscore=dscore, dx_rows=dx_rows, dx=dx, dw1=dw1, dw2=dw2, dw3=dw3)
    if hs is not None:
        res["hs"] = hs
    return res


def _oracle_grads(t: dict, E: int) -> dict:
    from titan_megamoe.ops.reference import mega_moe_ref

    leaves = {k: t[k].float().requires_grad_() for k in ("x", "w1", "w2", "w3", "scores")}
    out = mega_moe_ref(leaves["x"], t["ids"], leaves["scores"], leaves["w1"], leaves["w2"], leaves["w3"],
                       num_experts=E)
    out.backward(t["dout"].float())
    return {"dx": leaves["x"].grad, "dscore": leaves["scores"].grad, "dw1": leaves["w1"].grad,
            "dw2": leaves["w2"].grad, "dw3": leaves["w3"].grad}


def _check_against_oracle(c: Case, got: dict, t: dict) -> None:
    ref = _oracle_grads(t, c.E)
    for name in ("dx", "dscore", "dw1", "dw2", "dw3"):
        assert_close_rel(got[name].float().cpu(), ref[name].cpu(), TOL, name=f"{c.routing}/{name}")
    assert got["dx"].dtype == torch.bfloat16 and got["dscore"].dtype == torch.float32
    for name in ("dw1", "dw2", "dw3"):
        assert got[name].dtype == c.out_dtype, name
    # Experts without rows: weight gradients exactly zero (written, not left as allocated).
    empty = (t["layout"].counts == 0).nonzero().flatten().tolist()
    for name in ("dw1", "dw2", "dw3"):
        for e in empty:
            assert torch.equal(got[name][e], torch.zeros_like(got[name][e])), f"{name}[{e}] not exactly 0"
    if c.routing == "zero_expert":
        assert empty, "zero_expert routing produced no empty expert"


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.routing}-T{c.T}-E{c.E}-K{c.K}-D{c.D}-F{c.F}"
                         f"{'' if c.use_tma else '-ptr'}{'-hs' if c.save_hs else ''}"
                         f"{'-fp32w' if c.out_dtype == torch.float32 else ''}")
def test_grads_match_oracle(case):
    B = _bwd_module()
    block_m = B.default_bwd_config("gemm2_dgrad", _FakeLayout(16), case.D, case.F).block_m
    t = _inputs(case, block_m)
    got = _run_bwd(t, case, _configs(case, t["layout"], case.D, case.F))
    _check_against_oracle(case, got, t)
    # Padding rows of the experts' tiles are exact zeros (rows from offsets[E] on, tiles of expert
    # -1, are left unwritten: no consumer reads them).
    L = t["layout"]
    pad = (L.row_pair < 0) & (torch.arange(L.n_cap, device=L.row_pair.device) < L.offsets[-1])
    assert torch.equal(got["dgate_up"][pad], torch.zeros_like(got["dgate_up"][pad]))
    assert torch.equal(got["dx_rows"][pad], torch.zeros_like(got["dx_rows"][pad]))
    assert torch.equal(got["dscore_partial"][pad], torch.zeros_like(got["dscore_partial"][pad]))
    if case.save_hs:
        assert torch.equal(got["hs"][pad], torch.zeros_like(got["hs"][pad]))


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch has no _grouped_mm")
@pytest.mark.parametrize("case", [c for c in CASES if c.out_dtype == torch.bfloat16 and c.use_tma],
                         ids=lambda c: f"{c.routing}-T{c.T}-E{c.E}-K{c.K}-D{c.D}-F{c.F}")
def test_wgrad_grouped_mm_matches_oracle_and_triton(case):
    """The sm_90 default wgrad (rows gathered with zero padding, then torch._grouped_mm over the layout's
    padded expert segments) against the oracle and the Triton wgrad kernels; empty experts exactly 0;
    bitwise repeatable. On CPU torch._grouped_mm runs its reference fallback."""
    B = _bwd_module()
    c = dataclasses.replace(case, save_hs=True)
    t = _inputs(c, 16)
    lay = t["layout"]
    cfg = _configs(c, lay, c.D, c.F)
    hs = torch.empty(lay.n_cap, c.F, dtype=torch.bfloat16, device=t["x"].device)
    dgu, _ = B.gemm2_dgrad_swiglu_bwd(t["dout"], t["w2"], t["gate_up"], t["scores"], lay, cfg["gemm2_dgrad"],
                                      hs_out=hs)
    got = {}
    for impl in ("grouped_mm", "triton"):
        dw2 = B.wgrad_w2(t["dout"], t["gate_up"], t["scores"], lay, hs_NF=hs, impl=impl)
        dw1, dw3 = B.wgrad_w13(dgu, t["x"], lay, impl=impl)
        got[impl] = dict(dw1=dw1, dw2=dw2, dw3=dw3)
    ref = _oracle_grads(t, c.E)
    empty = (lay.counts == 0).nonzero().flatten().tolist()
    for name in ("dw1", "dw2", "dw3"):
        g = got["grouped_mm"][name]
        assert g.dtype == torch.bfloat16 and g.shape == got["triton"][name].shape, name
        assert_close_rel(g.float().cpu(), ref[name].cpu(), TOL, name=f"grouped_mm/{name}")
        # same fp32 sums of the same bf16 products: only the summation order differs
        assert_close_rel(g.float().cpu(), got["triton"][name].float().cpu(), TOL, name=f"grouped_mm~triton/{name}")
        for e in empty:
            assert torch.equal(g[e], torch.zeros_like(g[e])), f"{name}[{e}] not exactly 0"
    again = B.wgrad_w13(dgu, t["x"], lay, impl="grouped_mm")
    assert torch.equal(again[0], got["grouped_mm"]["dw1"]) and torch.equal(again[1], got["grouped_mm"]["dw3"])


def test_gather_rows_padding_zero_and_tokens():
    """gather_rows: row r < offsets[E] = x[row_pair[r] // K] or exact zeros on padding rows."""
    from titan_megamoe.kernels import grouped_gemm_wgrad as W

    c = Case("zero_expert", 33, 8, 2, 32, 32, seed=1)
    t = _inputs(c, 16)
    lay = t["layout"]
    got = W.gather_rows(t["x"], lay)
    end = int(lay.offsets[-1])
    pair = lay.row_pair[:end].long()
    want = torch.where((pair >= 0)[:, None], t["x"][pair.clamp(min=0) // c.K], torch.zeros_like(t["x"][:1]))
    assert got.shape == (lay.n_cap, c.D)
    assert torch.equal(got[:end], want)
    assert (pair < 0).any(), "no padding rows in this case"


def test_wgrad_impl_choice(monkeypatch):
    from titan_megamoe.kernels import grouped_gemm_wgrad as W

    cpu = torch.device("cpu")
    monkeypatch.delenv("TITAN_MEGAMOE_WGRAD", raising=False)
    assert W.wgrad_impl(cpu) == "triton"  # auto: sm_90 CUDA only
    assert W.wgrad_impl(cpu, impl="grouped_mm") == ("grouped_mm" if hasattr(torch, "_grouped_mm") else "triton")
    assert W.wgrad_impl(cpu, torch.float32, impl="grouped_mm") == "triton"  # fp32 gradients: Triton only
    assert W.wgrad_impl(cpu, custom=True, impl="grouped_mm") == "triton"
    monkeypatch.setenv("TITAN_MEGAMOE_WGRAD", "cutlass")
    with pytest.raises(ValueError, match="TITAN_MEGAMOE_WGRAD"):
        W.wgrad_impl(cpu)


class _FakeLayout:
    """Just enough of a RoutingLayout for ``default_bwd_config`` (it reads block_m only)."""

    def __init__(self, block_m: int):
        self.block_m = block_m


def _poisoned_outs(c: Case, t: dict, cfg: dict) -> dict:
    lay, nan = t["layout"], float("nan")
    nb = -(-c.F // cfg["gemm2_dgrad"].block_n)

    def full(*shape, dtype=torch.bfloat16):
        return torch.full(shape, nan, dtype=dtype, device=t["x"].device)

    return {
        "g2": (full(lay.n_cap, 2 * c.F), full(lay.n_cap, nb, dtype=torch.float32)),
        "dscore": full(c.T, c.K, dtype=torch.float32),
        "dx_rows": full(lay.n_cap, c.D),
        "dx": full(c.T, c.D),
        "dw2": full(c.E, c.D, c.F, dtype=c.out_dtype),
        "w13": (full(c.E, c.F, c.D, dtype=c.out_dtype), full(c.E, c.F, c.D, dtype=c.out_dtype)),
        "hs": full(lay.n_cap, c.F),
    }


def test_nan_poisoned_outputs_fully_written_and_deterministic():
    """Every output element is written (NaN-filled caller buffers come back finite) and two runs, one
    into torch.empty buffers and one into the poisoned ones, are bitwise equal (fixed reduction order,
    no atomics). zero_expert: empty experts and padding rows must be written too. Per-row outputs:
    rows from offsets[E] on (tiles of expert -1) are the exception, left unwritten (poison kept)."""
    c = CASES[3]  # zero_expert, save_hs
    t = _inputs(c, 16)
    cfg = _configs(c, t["layout"], c.D, c.F)
    end = int(t["layout"].offsets[-1])
    assert end < t["layout"].n_cap, "the case needs tiles past the last expert"
    first = _run_bwd(t, c, cfg)
    second = _run_bwd(t, c, cfg, outs=_poisoned_outs(c, t, cfg))
    for name, v in second.items():
        if name in ("dgate_up", "dscore_partial", "dx_rows", "hs"):  # (N_cap, ...) per layout row
            assert torch.isnan(v[end:].float()).all(), f"{name}: tiles of expert -1 written"
            v, ref = v[:end], first[name][:end]
        else:
            ref = first[name]
        assert torch.isfinite(v).all(), f"{name}: elements left unwritten (NaN poison survived)"
        assert torch.equal(v, ref), f"{name}: two runs differ"


def test_worked_example():
    """The docstring example: T=2, K=2, E=3, BM=2, ids [[2, 0], [0, 1]] -> pair_row [4, 0, 1, 2]."""
    from titan_megamoe.kernels.routing import build_routing_layout

    B = _bwd_module()
    dev = _device()
    lay = build_routing_layout(torch.tensor([[2, 0], [0, 1]], device=dev), 3, 2)
    assert lay.pair_row.tolist() == [4, 0, 1, 2]
    rows = torch.arange(lay.n_cap, dtype=torch.float32, device=dev)[:, None].expand(lay.n_cap, 4).contiguous()
    dx = B.scatter_dx(rows.bfloat16(), lay, 2, 2)
    assert dx.tolist() == [[4.0] * 4, [3.0] * 4]  # rows 4 + 0 and 1 + 2
    part = (rows[:, :3] * torch.tensor([1.0, 10.0, 100.0], device=dev)).contiguous()  # NB = 3 partials per row
    ds = B.reduce_dscore(part, lay, 2, 2)
    assert ds.tolist() == [[444.0, 0.0], [111.0, 222.0]]


SCATTER_ROUTER_CASES = [  # (routing, T, E, K, D): T not a multiple of BT=32, D not a multiple of BD=128, E < 16
    ("uniform", 37, 8, 2, 200),
    ("one_expert", 70, 16, 4, 128),
    ("zero_expert", 33, 5, 1, 64),  # top_k = 1, E not a power of two
    ("skewed", 64, 128, 8, 96),  # Qwen3's E and K
]


@pytest.mark.parametrize("case", SCATTER_ROUTER_CASES, ids=[f"{c[0]}-T{c[1]}-E{c[2]}-K{c[3]}-D{c[4]}"
                                                            for c in SCATTER_ROUTER_CASES])
def test_scatter_dx_adds_router_dx(case):
    """scatter_dx with the router's dx: sum_k dx_rows[pair_row] + d logits @ gate_w in fp32, one bf16
    rounding; poisoned output, every element written, bitwise the same twice; padding rows never read."""
    from titan_megamoe.kernels.routing import build_routing_layout

    B = _bwd_module()
    dev = _device()
    routing, T, E, K, D = case
    g = torch.Generator().manual_seed(T + E)
    lay = build_routing_layout(make_routing(routing, T, E, K, seed=1).to(dev), E, 16)
    rows = torch.randn(lay.n_cap, D, generator=g).bfloat16().to(dev)
    rows[lay.row_pair < 0] = float("nan")  # padding rows: a read shows
    dl = (torch.randn(T, E, generator=g) * 0.1).bfloat16().to(dev)
    gw = (torch.randn(E, D, generator=g) / E**0.5).bfloat16().to(dev)
    outs = [torch.full((T, D), float("nan"), dtype=torch.bfloat16, device=dev) for _ in range(2)]
    for o in outs:
        B.scatter_dx(rows, lay, T, K, out=o, router_dlogits=dl, gate_w=gw)
    assert torch.isfinite(outs[0]).all() and torch.equal(outs[0], outs[1])
    pr = lay.pair_row.long().view(T, K)
    ref = rows.float()[pr].sum(1) + dl.float() @ gw.float()
    assert_close_rel(outs[0], ref, TOL, "dx with the router's dx")
    plain = B.scatter_dx(rows, lay, T, K)
    assert (outs[0].float() - plain.float()).abs().max() > 0  # the router's part is there
    other = B.scatter_dx(rows, lay, T, K, router_dlogits=dl, gate_w=gw, tile=(16, 256, 8))  # another tile
    assert_close_rel(other, ref, TOL, "dx, tile 16 x 256")
    assert torch.equal(B.scatter_dx(rows, lay, T, K, tile=(8, 512, 4)), plain)  # no dot: the same sums exactly


def test_scatter_dx_router_preconditions():
    from titan_megamoe.kernels.routing import build_routing_layout

    B = _bwd_module()
    dev = _device()
    lay = build_routing_layout(make_routing("uniform", 8, 4, 2, seed=0).to(dev), 4, 16)
    rows = torch.randn(lay.n_cap, 32).bfloat16().to(dev)
    dl, gw = torch.randn(8, 4).bfloat16().to(dev), torch.randn(4, 32).bfloat16().to(dev)
    with pytest.raises(ValueError, match="together"):
        B.scatter_dx(rows, lay, 8, 2, router_dlogits=dl)
    with pytest.raises(ValueError, match="router_dlogits must have shape"):
        B.scatter_dx(rows, lay, 8, 2, router_dlogits=dl[:7], gate_w=gw)
    with pytest.raises(ValueError, match="gate_w must be"):
        B.scatter_dx(rows, lay, 8, 2, router_dlogits=dl, gate_w=gw.float())
    with pytest.raises(ValueError, match="BT=8"):
        B.scatter_dx(rows, lay, 8, 2, router_dlogits=dl, gate_w=gw, tile=(8, 128, 4))
    big = B.SCATTER_ROUTER_MAX_E + 1
    with pytest.raises(ValueError, match="addmm_"):
        B.scatter_dx(rows, lay, 8, 2, router_dlogits=torch.zeros(8, big, dtype=torch.bfloat16, device=dev),
                     gate_w=torch.zeros(big, 32, dtype=torch.bfloat16, device=dev))


def test_preconditions_raise():
    B = _bwd_module()
    c = Case("uniform", 20, 4, 2, 32, 32)
    t = _inputs(c, 16)
    lay = t["layout"]
    cfg = B.default_bwd_config("gemm2_dgrad", lay, c.D, c.F)
    with pytest.raises(ValueError, match="block_m"):
        B.gemm2_dgrad_swiglu_bwd(t["dout"], t["w2"], t["gate_up"], t["scores"], lay,
                                 dataclasses.replace(cfg, block_m=32))
    with pytest.raises(ValueError, match="dout must be"):
        B.gemm2_dgrad_swiglu_bwd(t["dout"].float(), t["w2"], t["gate_up"], t["scores"], lay)
    with pytest.raises(ValueError, match="gate_up must have shape"):
        B.gemm2_dgrad_swiglu_bwd(t["dout"], t["w2"], t["gate_up"][:-16], t["scores"], lay)
    with pytest.raises(ValueError, match="topk_scores must be"):
        B.wgrad_w2(t["dout"], t["gate_up"], t["scores"].double(), lay)
    with pytest.raises(ValueError, match="contiguous"):
        B.gemm1_dgrad(t["gate_up"], t["w1"].transpose(1, 2).contiguous().transpose(1, 2), t["w3"], lay)
    with pytest.raises(ValueError, match="out_dtype"):
        B.wgrad_w13(t["gate_up"], t["x"], lay, out_dtype=torch.float16)
    with pytest.raises(ValueError, match="out\\[0\\]"):
        B.wgrad_w13(t["gate_up"], t["x"], lay, out=(torch.empty(1), torch.empty(1)))
    with pytest.raises(ValueError, match="pairs"):
        B.scatter_dx(torch.zeros(lay.n_cap, c.D, dtype=torch.bfloat16, device=t["x"].device), lay, c.T + 1, c.K)


# ------------------------------------------------------------------------------------------------
# sm_90a compile check (no GPU needed): wgmma present, shared memory fits, no spills
# ------------------------------------------------------------------------------------------------

COMPILE_CASES = [  # (label, kernel, use_tma) at the Qwen3-30B-A3B layer shape D=2048, F=768, K=8
    ("gemm2_dgrad_tma", "gemm2_dgrad", True),  # the default: 128 x 256 at 16 warps (HOPPER_GEMM2_DGRAD_WIDE)
    ("gemm2_dgrad_ptr", "gemm2_dgrad", False),
    ("gemm2_dgrad_2cta_tma", "gemm2_dgrad_2cta", True),  # GEMM2_DGRAD_WIDE=0: two programs per SM
    ("gemm2_dgrad_1cta_tma", "gemm2_dgrad_1cta", True),  # and GEMM2_DGRAD_2CTA=0: one per SM
    ("gemm1_dgrad_tma", "gemm1_dgrad", True),
    ("gemm1_dgrad_ptr", "gemm1_dgrad", False),
    ("wgrad_w2_tma", "wgrad_w2", True),
    ("wgrad_w2_ptr", "wgrad_w2", False),
    ("wgrad_w2_hs_tma", "wgrad_w2_hs", True),
    ("wgrad_w2_hs_ptr", "wgrad_w2_hs", False),
    ("wgrad_w13_tma", "wgrad_w13", True),
    ("wgrad_w13_ptr", "wgrad_w13", False),
    ("reduce_dscore", "reduce_dscore", False),
    ("scatter_dx", "scatter_dx", False),
    ("scatter_dx_router", "scatter_dx_router", False),  # + the router's dx (E = 128: Qwen3)
    ("gather_rows", "gather_rows", False),
]


def _compile_sm90_all(D: int = 2048, F: int = 768, K: int = 8, block_m: int = 128) -> list[dict]:
    """Compile every COMPILE_CASES kernel for sm_90a (run with TRITON_INTERPRET=0, no GPU needed)."""
    from triton.runtime.jit import JITFunction

    from titan_megamoe.kernels import grouped_gemm_bwd as B

    _Lay = _FakeLayout(block_m)

    def desc(block):
        return f"tensordesc<bf16[{', '.join(map(str, block))}]>"

    results = []
    for label, kind, tma in COMPILE_CASES:
        if kind in ("reduce_dscore", "scatter_dx", "scatter_dx_router", "gather_rows"):
            opts = dict(num_warps=4, num_stages=1)
            if kind == "gather_rows":
                from titan_megamoe.kernels import grouped_gemm_wgrad as W

                kern, sig, cx = W._gather_rows_kernel, {"src_TD": "*bf16", "row_pair_N": "*i32", "offsets_E1": "*i32",
                                                        "out_ND": "*bf16"}, dict(D=D, K=K, E=128, BR=16, BD=512)
            elif kind == "reduce_dscore":
                kern, sig, cx = B._reduce_dscore_kernel, {"dscore_part_NB": "*fp32", "pair_row_P": "*i32",
                                                          "dscore_P": "*fp32", "P": "i32"}, dict(NB=6, BLOCK=128)
            else:
                router = dict(E=128, E_PAD=128, ROUTER=True) if kind == "scatter_dx_router" else {}
                kern, sig, cx = B._scatter_dx_kernel, {"dx_rows_ND": "*bf16", "pair_row_P": "*i32", "dx_TD": "*bf16",
                                                       "dl_TE": "*bf16", "gw_ED": "*bf16", "T": "i32"}, dict(
                    D=D, K=K, BT=32, BD=128, **router)
        else:
            base = kind.replace("_hs", "").replace("_1cta", "").replace("_2cta", "")
            cfg = dataclasses.replace(B.default_bwd_config(base, _Lay, D, F), use_tma=tma)
            if kind in ("gemm2_dgrad_1cta", "gemm2_dgrad_2cta"):
                from titan_megamoe.kernels.configs import HOPPER_GEMM2_DGRAD_2CTA as two
                cfg = dataclasses.replace(cfg, block_n=two.block_n, num_warps=two.num_warps, num_stages=two.num_stages,
                                          maxnreg=two.maxnreg)
            if kind == "gemm2_dgrad_1cta":
                cfg = dataclasses.replace(cfg, num_stages=4, maxnreg=None)
            bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
            tile = dict(BM=bm, BN=bn, BK=bk, GROUP_M=cfg.group_m, USE_TMA=tma, INTERPRET=False)
            opts = cfg.compile_options()
            if kind in ("gemm2_dgrad", "gemm2_dgrad_1cta", "gemm2_dgrad_2cta"):
                kern = B._gemm2_dgrad_swiglu_bwd_kernel
                sig = {"dout_TD": "*bf16", "w2_EDF": desc([1, bk, bn]) if tma else "*bf16", "gate_up_N2F": "*bf16",
                       "scores_P": "*fp32", "row_pair_N": "*i32", "tile_expert_M": "*i32", "dgate_up_N2F": "*bf16",
                       "dscore_part_NB": "*fp32", "hs_NF": "*bf16", "n_tiles": "i32"}
                cx = dict(D=D, F=F, K=K, NB=-(-F // bn), STORE_HS=True, **tile)
            elif kind == "gemm1_dgrad":
                kern = B._gemm1_dgrad_kernel
                sig = {"dgate_up_N2F": desc([bm, 1, bk]) if tma else "*bf16",
                       "w1_EFD": desc([1, bk, bn]) if tma else "*bf16", "w3_EFD": desc([1, bk, bn]) if tma else "*bf16",
                       "row_pair_N": "*i32", "tile_expert_M": "*i32", "dx_rows_ND": "*bf16", "n_tiles": "i32"}
                cx = dict(D=D, F=F, NBD=-(-D // bn), **tile)
            elif kind in ("wgrad_w2", "wgrad_w2_hs"):
                kern = B._wgrad_w2_kernel
                hs = kind == "wgrad_w2_hs"
                gu = desc([bk, 1, bn]) if tma else "*bf16"
                hs_t = (desc([bk, bn]) if tma else "*bf16") if hs else gu
                sig = {"dout_TD": "*bf16", "gate_up_N2F": gu, "hs_NF": hs_t,
                       "scores_P": "*fp32", "row_pair_N": "*i32", "offsets_E1": "*i32", "dw2_EDF": "*bf16"}
                cx = dict(D=D, F=F, K=K, NBM=-(-D // bm), NBN=-(-F // bn), HS_SAVED=hs, **tile)
            else:
                kern = B._wgrad_w13_kernel
                sig = {"dgate_up_N2F": desc([bk, 1, bm]) if tma else "*bf16", "x_TD": "*bf16", "row_pair_N": "*i32",
                       "offsets_E1": "*i32", "dw1_EFD": "*bf16", "dw3_EFD": "*bf16"}
                cx = dict(D=D, F=F, K=K, NBF=-(-F // bm), NBN=-(-D // bn), **tile)
        r = compile_sm90(JITFunction(kern.fn), sig, cx, **opts)
        results.append(dict(label=label, **r))
    return results


@pytest.mark.parametrize("label", [c[0] for c in COMPILE_CASES])
def test_compiles_for_sm90a(label):
    r = sm90_result(__file__, label)
    assert r["target"], "PTX not built for sm_90a"
    if label not in ("reduce_dscore", "scatter_dx", "scatter_dx_router", "gather_rows"):  # no GEMM in those
        assert r["wgmma"] > 0, f"{label}: no wgmma (Hopper tensor core) instruction in the PTX"
        assert (r["tma"] > 0) == label.endswith("_tma"), f"{label}: TMA loads {r['tma']}"
        if label != "gemm1_dgrad_tma":  # every other variant has a pointer-loaded (gathered) operand
            assert r["cp_async"] > 0, f"{label}: the pointer-loaded operands are not pipelined through cp.async"
    assert r["shared"] <= SMEM_LIMIT_SM90, f"{label}: {r['shared']} bytes of shared memory > {SMEM_LIMIT_SM90}"
    if label.startswith("gemm2_dgrad") and "_1cta" not in label:  # 128 registers (16 warps on 128 x 256 tiles, or
        # two programs per SM on 128 x 128), a few spilled bytes (16-32 B)
        if "_2cta" in label:  # two programs per SM: half the shared memory each
            assert 2 * (r["shared"] + 1024) <= SMEM_LIMIT_SM90, f"{label}: {r['shared']} B of shared memory per program"
        regs, stack = _usage_field(r["usage"], "REG"), _usage_field(r["usage"], "STACK")
        assert regs <= 128 and stack <= 64, f"{label}: {r['usage']}"
        return
    assert "STACK:0" in r["usage"] or not r["usage"], f"{label}: register spills ({r['usage']})"


def _usage_field(usage: str, name: str) -> int:
    """An integer field of a cuobjdump resource-usage line ("REG:128 STACK:16 ...")."""
    for part in usage.split():
        if part.startswith(name + ":"):
            return int(part.split(":")[1])
    raise AssertionError(f"no {name} in {usage!r}")


@pytest.mark.cuda
def test_grads_match_oracle_cuda():
    """The compiled kernels (TMA and pointer paths) on a GPU, mid-size shape, vs the oracle."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1 in this process: the compiled path is checked by `python "
                    "tests/test_kernels_bwd.py gpu`")
    _gpu_correctness()


def _gpu_correctness(verbose: bool = False) -> None:
    for c in (Case("uniform", 1000, 16, 4, 256, 384, seed=7, save_hs=True),  # TMA everywhere, stored s * h
              Case("zero_expert", 500, 16, 8, 256, 384, use_tma=False, seed=9, out_dtype=torch.float32)):
        B = _bwd_module()
        t = _inputs(c, B.default_bwd_config("gemm2_dgrad", _FakeLayout(128), c.D, c.F).block_m, dev="cuda")
        cfg = _configs(c, t["layout"], c.D, c.F)
        got = _run_bwd(t, c, cfg)
        _check_against_oracle(c, got, t)
        again = _run_bwd(t, c, cfg)
        end = int(t["layout"].offsets[-1])
        for k, v in got.items():
            if k in ("dgate_up", "dscore_partial", "dx_rows", "hs"):  # per layout row: rows from offsets[E] on
                v, w = v[:end], again[k][:end]  # are left unwritten (torch.empty's leftovers differ between runs)
            else:
                w = again[k]
            assert torch.equal(v, w), f"{c}: {k} not deterministic"
        if verbose:
            print(json.dumps({"gpu_case": dataclasses.astuple(c)[:6], "tma": c.use_tma, "ok": True}), flush=True)


# ------------------------------------------------------------------------------------------------
# Script entry: compile check subprocess, GPU correctness + timings
# ------------------------------------------------------------------------------------------------


def _gpu(argv: list[str]) -> None:
    """GPU: compiled-kernel correctness, then median ms / TF/s at a real layer shape: the whole backward
    (default configs: pointer loads, stored s * h) vs a torch._grouped_mm autograd backward (stock
    TorchTitan's expert GEMMs, permute and weighted sum; no all-to-all), then each kernel."""
    import triton

    from titan_megamoe.kernels import grouped_gemm_bwd as B
    from titan_megamoe.kernels.routing import build_routing_layout

    _gpu_correctness(verbose=True)
    shape = argv[0] if argv else "30b"
    v = bench_layer_inputs(shape, "cuda")
    T, E, K, D, F = v.T, v.E, v.K, v.D, v.F
    dev = "cuda"
    x, w1, w2, w3, ids, scores, dout = v.x, v.w1, v.w2, v.w3, v.ids, v.scores, v.dout
    lay = build_routing_layout(ids, E, 128)
    gate_up = torch.randn(lay.n_cap, 2 * F, device=dev).bfloat16()
    hs = torch.empty(lay.n_cap, F, device=dev, dtype=torch.bfloat16)
    P = T * K
    res = {}

    def bench(name, fn, flop):
        ms = triton.testing.do_bench(fn, warmup=5, rep=30)
        res[name] = ms
        print(json.dumps({"shape": shape, "kernel": name, "ms": round(ms, 4), "tflops": round(flop / ms / 1e9, 1)}),
              flush=True)

    def configs(tma):
        return {k: dataclasses.replace(B.default_bwd_config(k, lay, D, F), use_tma=tma)
                for k in ("gemm2_dgrad", "gemm1_dgrad", "wgrad_w2", "wgrad_w13")}

    def whole(cfg, save_hs, wgrad="triton"):
        h = hs if save_hs else None
        g, p = B.gemm2_dgrad_swiglu_bwd(dout, w2, gate_up, scores, lay, cfg["gemm2_dgrad"], hs_out=h)
        B.reduce_dscore(p, lay, T, K)
        B.scatter_dx(B.gemm1_dgrad(g, w1, w3, lay, cfg["gemm1_dgrad"]), lay, T, K)
        if wgrad == "triton":
            B.wgrad_w2(dout, gate_up, scores, lay, cfg["wgrad_w2"], hs_NF=h)
            B.wgrad_w13(g, x, lay, cfg["wgrad_w13"])
        else:
            B.wgrad_w2(dout, gate_up, scores, lay, hs_NF=h, impl=wgrad)
            B.wgrad_w13(g, x, lay, impl=wgrad)

    default = {k: B.default_bwd_config(k, lay, D, F) for k in ("gemm2_dgrad", "gemm1_dgrad", "wgrad_w2", "wgrad_w13")}
    bench("megamoe_bwd_default_hs", lambda: whole(default, True), 12 * P * D * F)
    bench("megamoe_bwd_grouped_mm_wgrad", lambda: whole(default, True, "grouped_mm"), 12 * P * D * F)
    from titan_megamoe.kernels.grouped_gemm_wgrad import gather_rows

    g0, _ = B.gemm2_dgrad_swiglu_bwd(dout, w2, gate_up, scores, lay, default["gemm2_dgrad"], hs_out=hs)
    bench("gather_rows", lambda: gather_rows(x, lay), 0)
    bench("wgrad_w2_grouped_mm", lambda: B.wgrad_w2(dout, gate_up, scores, lay, hs_NF=hs, impl="grouped_mm"),
          2 * P * D * F)
    bench("wgrad_w13_grouped_mm", lambda: B.wgrad_w13(g0, x, lay, impl="grouped_mm"), 4 * P * D * F)
    bench("wgrad_w2_triton_default", lambda: B.wgrad_w2(dout, gate_up, scores, lay, default["wgrad_w2"], hs_NF=hs),
          2 * P * D * F)
    bench("wgrad_w13_triton_default", lambda: B.wgrad_w13(g0, x, lay, default["wgrad_w13"]), 4 * P * D * F)
    if "--wgrad-only" in sys.argv:
        return
    ptr = configs(False)
    bench("megamoe_bwd_ptr_hs", lambda: whole(ptr, True), 12 * P * D * F)

    # Stock-style baseline: permute, torch._grouped_mm x3, SwiGLU, fp32 weighted sum; autograd backward.
    order = torch.argsort(ids.view(-1), stable=True)
    offs = torch.cumsum(torch.bincount(ids.view(-1), minlength=E), 0).to(torch.int32)
    leaves = [t.detach().requires_grad_() for t in (x, w1, w2, w3, scores)]
    xl, w1l, w2l, w3l, sl = leaves
    xs = xl[order // K]
    h_b = torch.nn.functional.silu(torch._grouped_mm(xs, w1l.transpose(-2, -1), offs=offs)) * torch._grouped_mm(
        xs, w3l.transpose(-2, -1), offs=offs)
    ys = torch._grouped_mm(h_b, w2l.transpose(-2, -1), offs=offs)
    yp = torch.empty_like(ys).index_copy(0, order, ys)
    out = (yp.view(T, K, D).float() * sl.unsqueeze(-1)).sum(1).to(torch.bfloat16)
    bench("torch_grouped_mm_bwd", lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True), 12 * P * D * F)
    speedup = res["torch_grouped_mm_bwd"] / res["megamoe_bwd_default_hs"]
    print(json.dumps({"shape": shape, "speedup_vs_torch": round(speedup, 3)}), flush=True)

    dgu, part = B.gemm2_dgrad_swiglu_bwd(dout, w2, gate_up, scores, lay, ptr["gemm2_dgrad"], hs_out=hs)
    bench("gemm2_dgrad_ptr_hs", lambda: B.gemm2_dgrad_swiglu_bwd(dout, w2, gate_up, scores, lay, ptr["gemm2_dgrad"],
                                                                out=(dgu, part), hs_out=hs), 2 * P * D * F)
    bench("wgrad_w2_ptr_hs", lambda: B.wgrad_w2(dout, gate_up, scores, lay, ptr["wgrad_w2"], hs_NF=hs), 2 * P * D * F)
    bench("wgrad_w2_ptr_recompute", lambda: B.wgrad_w2(dout, gate_up, scores, lay, ptr["wgrad_w2"]), 2 * P * D * F)
    bench("gemm1_dgrad_ptr", lambda: B.gemm1_dgrad(dgu, w1, w3, lay, ptr["gemm1_dgrad"]), 4 * P * D * F)
    bench("wgrad_w13_ptr", lambda: B.wgrad_w13(dgu, x, lay, ptr["wgrad_w13"]), 4 * P * D * F)
    tma = configs(True)
    bench("megamoe_bwd_tma_hs", lambda: whole(tma, True), 12 * P * D * F)
    bench("gemm2_dgrad_tma_hs", lambda: B.gemm2_dgrad_swiglu_bwd(dout, w2, gate_up, scores, lay, tma["gemm2_dgrad"],
                                                                out=(dgu, part), hs_out=hs), 2 * P * D * F)
    bench("wgrad_w2_tma_hs", lambda: B.wgrad_w2(dout, gate_up, scores, lay, tma["wgrad_w2"], hs_NF=hs), 2 * P * D * F)


if __name__ == "__main__":
    if sys.argv[1:2] == ["compile-sm90"]:  # optional: D F K block_m
        print(json.dumps(_compile_sm90_all(*map(int, sys.argv[2:6]))))
    elif sys.argv[1:2] == ["gpu"]:
        _gpu(sys.argv[2:])
    else:
        raise SystemExit("usage: python tests/test_kernels_bwd.py compile-sm90 | gpu [30b|235b]")
