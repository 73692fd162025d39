"""Forward grouped-GEMM kernels (gather + GEMM1 + SwiGLU, GEMM2 + score + scatter, top-k combine).

On CPU the kernels run in Triton's interpreter: TRITON_INTERPRET=1 is set below before anything can
import triton, and the kernel module reads it again at launch time (pytest may import it earlier
through another test file). Operands are upcast to fp32 there, but output casts to bf16 truncate, so
every comparison uses the bf16 relative-error bound of ``titan_megamoe.testing.TOLERANCES`` (2e-2).

The sm_90a compile check runs in a subprocess with TRITON_INTERPRET=0: ``triton.compile`` needs
JITFunctions, and triton's own jit library functions are InterpretedFunctions once triton was imported
in interpreter mode.

Run ``python tests/test_kernels_fwd.py bench [30b|235b]`` on a GPU for per-kernel timings (TF/s).
"""

import os

# Before any import of triton (see the module docstring). Run as a script (bench / compile check),
# the default is the real compiler.
os.environ.setdefault("TRITON_INTERPRET", "0" if __name__ == "__main__" else "1")

import sys  # noqa: E402

if __name__ == "__main__":
    import _script_setup  # noqa: F401  (this checkout first; registration stubs on a bare GPU machine)

import dataclasses  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from titan_megamoe.kernels.sm90_check import (  # noqa: E402
    HOPPER_SMEM_BYTES,
    compile_sm90,
)
from _sm90 import sm90_result  # noqa: E402
from titan_megamoe.testing import assert_close_rel, bench_layer_inputs, make_routing  # noqa: E402

SMEM_LIMIT_SM90 = HOPPER_SMEM_BYTES


def _kernels():
    # Lazy: imported inside tests so TRITON_INTERPRET is already set whatever pytest collected first.
    from titan_megamoe.kernels import grouped_gemm

    return grouped_gemm


def _base_config():
    from titan_megamoe.kernels.configs import config_for

    return config_for("gemm1", 64, 64, grouped_gemm_interpreting())


def grouped_gemm_interpreting() -> bool:
    return _kernels().interpret_mode()


@dataclasses.dataclass(frozen=True)
class Case:
    routing: str
    T: int
    E: int
    K: int
    D: int
    F: int
    use_tma: bool | None = None  # None: the config's default (pointer loads)
    block_n: int = 16
    block_k: int = 16
    seed: int = 0


# Each row names the edge it covers.
CASES = {
    # near-uniform load, T=37 not a multiple of BM=16 (partial last tile per expert)
    "uniform_k2": Case("uniform", 37, 4, 2, 32, 48),
    # top_k = 1: one pair per token, P = T
    "uniform_k1": Case("uniform", 37, 4, 1, 32, 32),
    # some experts get no token: no rows, no tiles for them
    "zero_expert_k4": Case("zero_expert", 37, 8, 4, 32, 32),
    # every token picks expert 0: one expert owns 37 rows = 3 tiles (2 full + 1 partial)
    "one_expert_k2": Case("one_expert", 37, 4, 2, 32, 32),
    # hot experts and a long tail, with a zero-token expert likely
    "skewed_k4": Case("skewed", 37, 8, 4, 64, 32, seed=3),
    # TMA tensor descriptors for the weight / h tiles (the non-default path)
    "uniform_k2_tma": Case("uniform", 37, 4, 2, 32, 48, use_tma=True),
    "zero_expert_k4_tma": Case("zero_expert", 37, 8, 4, 32, 32, use_tma=True),
    # D % BK != 0 and F % BK != 0 (48 % 32): masked reduction tails, BN = 32 > F tail
    "uneven_k_pointer": Case("skewed", 21, 4, 2, 48, 48, use_tma=False, block_n=32, block_k=32, seed=1),
    "uneven_k_tma": Case("uniform", 21, 4, 2, 48, 48, use_tma=True, block_n=32, block_k=32, seed=2),
}


def _config(case: Case):
    base = _base_config()
    use_tma = base.use_tma if case.use_tma is None else case.use_tma
    return dataclasses.replace(base, block_n=case.block_n, block_k=case.block_k, use_tma=use_tma)


def _inputs(case: Case):
    g = torch.Generator().manual_seed(case.seed)
    T, E, K, D, F = case.T, case.E, case.K, case.D, case.F
    x = torch.randn(T, D, generator=g).to(torch.bfloat16)
    w1 = (torch.randn(E, F, D, generator=g) / D**0.5).to(torch.bfloat16)
    w3 = (torch.randn(E, F, D, generator=g) / D**0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, D, F, generator=g) / F**0.5).to(torch.bfloat16)
    ids = make_routing(case.routing, T, E, K, seed=case.seed)
    scores = torch.softmax(torch.randn(T, K, generator=g), dim=-1).float().contiguous()
    return x, w1, w2, w3, ids, scores


def _poisoned(shape):
    return torch.full(shape, float("nan"), dtype=torch.bfloat16)


def _forward(name: str):
    """One forward through the three kernels into NaN-poisoned buffers."""
    from titan_megamoe.kernels.routing import build_routing_layout

    gg = _kernels()
    case = CASES[name]
    cfg = _config(case)
    x, w1, w2, w3, ids, scores = _inputs(case)
    layout = build_routing_layout(ids, case.E, cfg.block_m)
    N, P = layout.n_cap, case.T * case.K
    gate_up, h = gg.gemm1_swiglu_fwd(
        x, w1, w3, layout, gate_up_out=_poisoned((N, 2 * case.F)), h_out=_poisoned((N, case.F)), config=cfg
    )
    y = gg.gemm2_scatter_fwd(h, w2, scores, layout, out_pairs=_poisoned((P, case.D)), config=cfg)
    out = gg.combine_topk(y, case.T, case.K)
    return dict(case=case, cfg=cfg, x=x, w1=w1, w2=w2, w3=w3, ids=ids, scores=scores, layout=layout,
                gate_up=gate_up, h=h, y=y, out=out)


_run = functools.lru_cache(maxsize=None)(_forward)  # several tests read the same forward


def _live_rows(layout):
    """Rows of tiles whose expert is >= 0: [0, offsets[E])."""
    return int(layout.offsets[-1])


# ------------------------------------------------------------------------------------------------
# End to end vs the oracle
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CASES))
def test_forward_matches_reference(name):
    from titan_megamoe.ops.reference import mega_moe_ref

    r = _run(name)
    case = r["case"]
    args = (r["ids"], r["scores"])
    # Same bf16-valued operands in fp32: the exact math our fp32-accumulating kernels approximate.
    ref32 = mega_moe_ref(r["x"].float(), *args, r["w1"].float(), r["w2"].float(), r["w3"].float(), num_experts=case.E)
    assert_close_rel(r["out"].float(), ref32, torch.bfloat16, name=f"{name} vs fp32 oracle")
    # The oracle on the bf16 tensors themselves (its own bf16 roundings).
    ref16 = mega_moe_ref(r["x"], *args, r["w1"], r["w2"], r["w3"], num_experts=case.E)
    assert_close_rel(r["out"], ref16, torch.bfloat16, name=f"{name} vs bf16 oracle")


# ------------------------------------------------------------------------------------------------
# Per kernel, against torch expressions on the layout
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CASES))
def test_gemm1_rows_and_padding(name):
    r = _run(name)
    case, layout = r["case"], r["layout"]
    F = case.F
    gate_up, h = r["gate_up"].float(), r["h"].float()
    row_pair = layout.row_pair.long()
    tile_expert = layout.tile_expert.long()
    live = _live_rows(layout)
    rows = torch.arange(layout.n_cap)
    valid = row_pair >= 0
    # every pair row and every padding row of a live tile was written; rows past the last expert were
    # skipped (still the NaN poison), as documented
    assert torch.isfinite(gate_up[:live]).all() and torch.isfinite(h[:live]).all()
    assert torch.isnan(gate_up[live:]).all() and torch.isnan(h[live:]).all()
    assert int(valid.sum()) == case.T * case.K and bool((rows[valid] < live).all())
    pad_live = ~valid & (rows < live)
    assert (gate_up[pad_live] == 0).all() and (h[pad_live] == 0).all(), "padding rows must be exact zeros"

    r_idx = rows[valid]
    tok = row_pair[valid] // case.K
    exp_ = tile_expert[r_idx // layout.block_m]
    x32 = r["x"].float()[tok]  # (P, D)
    gate = torch.einsum("pd,pfd->pf", x32, r["w1"].float()[exp_])
    up = torch.einsum("pd,pfd->pf", x32, r["w3"].float()[exp_])
    assert_close_rel(gate_up[r_idx, :F], gate, torch.bfloat16, name="gate")
    assert_close_rel(gate_up[r_idx, F:], up, torch.bfloat16, name="up")
    assert_close_rel(h[r_idx], torch.nn.functional.silu(gate) * up, torch.bfloat16, name="h")
    # SwiGLU is computed from the fp32 accumulators, not from the stored bf16 gate/up: check it
    # against the stored values too (loose: one bf16 rounding of gate/up apart)
    g16, u16 = gate_up[r_idx, :F], gate_up[r_idx, F:]
    assert_close_rel(h[r_idx], torch.nn.functional.silu(g16) * u16, torch.bfloat16, name="h vs stored gate/up")


@pytest.mark.parametrize("name", ["uniform_k2", "zero_expert_k4_tma", "uneven_k_pointer", "uneven_k_tma"])
def test_gemm2_scatter_rows(name):
    """Every (P, D) row written exactly once, = score * (h[r] @ w2[e].T); h's padding rows never leak."""
    gg = _kernels()
    r = _run(name)
    case, layout, cfg = r["case"], r["layout"], r["cfg"]
    g = torch.Generator().manual_seed(7)
    h = torch.randn(layout.n_cap, case.F, generator=g).to(torch.bfloat16)
    h[layout.row_pair < 0] = float("nan")  # padding rows: whatever they hold must not reach the output
    y_out = _poisoned((case.T * case.K, case.D))
    y = gg.gemm2_scatter_fwd(h, r["w2"], r["scores"], layout, out_pairs=y_out, config=cfg)
    assert torch.isfinite(y).all(), "a pair row was not written (or a padding row leaked)"
    pair_row = layout.pair_row.long()
    exp_ = layout.tile_expert.long()[pair_row // layout.block_m]
    expect = torch.einsum("pf,pdf->pd", h.float()[pair_row], r["w2"].float()[exp_]) * r["scores"].reshape(-1, 1)
    assert_close_rel(y.float(), expect, torch.bfloat16, name="y")


@pytest.mark.parametrize("name", ["uniform_k2", "uniform_k1", "zero_expert_k4", "one_expert_k2", "skewed_k4",
                                  "uneven_k_pointer"])
@pytest.mark.parametrize("by_row", [False, True])
def test_gemm2_persistent_is_bitwise_the_grid(name, by_row):
    """GemmConfig.persistent: a few programs loop over the live tiles (3 in the interpreter, so each
    takes several) and write bitwise what the one-program-per-tile grid writes, NaN-poisoned rows left
    unwritten included (pair order and layout-row order)."""
    gg = _kernels()
    r = _run(name)
    case, layout = r["case"], r["layout"]
    cfg = dataclasses.replace(r["cfg"], use_tma=False)
    rows = layout.n_cap if by_row else case.T * case.K
    grid_y = gg.gemm2_scatter_fwd(r["h"], r["w2"], r["scores"], layout, out_pairs=_poisoned((rows, case.D)),
                                  config=cfg, by_row=by_row)
    pers_y = gg.gemm2_scatter_fwd(r["h"], r["w2"], r["scores"], layout, out_pairs=_poisoned((rows, case.D)),
                                  config=dataclasses.replace(cfg, persistent=True), by_row=by_row)
    n_tiles = int(layout.offsets[-1]) // layout.block_m * (-(-case.D // cfg.block_n))
    assert n_tiles > 3, f"{name}: {n_tiles} tiles, too few for 3 programs to loop"
    assert torch.equal(grid_y.view(torch.int16), pers_y.view(torch.int16)), f"{name}: persistent GEMM2 differs"
    if not by_row:
        assert torch.isfinite(pers_y).all(), "a pair row was not written"


def test_persistent_config_needs_pointer_loads():
    from titan_megamoe.kernels.configs import GemmConfig

    with pytest.raises(ValueError, match="pointer loads only"):
        GemmConfig(persistent=True, use_tma=True)


def test_combine_topk_fixed_order():
    gg = _kernels()
    # worked example of the docstring: K=2, token 0 rows [1, 2] and [3, 4] -> [4, 6]
    y = torch.tensor([[1.0] * 16, [3.0] * 16], dtype=torch.bfloat16)
    y[0, 1], y[1, 1] = 2.0, 4.0
    out = gg.combine_topk(y, 1, 2)
    assert out[0, 0].item() == 4.0 and out[0, 1].item() == 6.0
    # random rows: fp32 sum over k in order, D = 80 not a multiple of the column block
    g = torch.Generator().manual_seed(1)
    T, K, D = 9, 3, 80
    y = torch.randn(T * K, D, generator=g).to(torch.bfloat16)
    out = gg.combine_topk(y, T, K)
    assert_close_rel(out.float(), y.float().view(T, K, D).sum(1), torch.bfloat16, name="combine")
    assert torch.equal(out, gg.combine_topk(y, T, K))


def test_worked_example_layout_rows():
    """Docstring example of gemm1_swiglu_fwd (BM = 16): which layout row holds which (token, expert)."""
    from titan_megamoe.kernels.routing import build_routing_layout

    gg = _kernels()
    cfg = _base_config()
    T, K, E, D, F = 2, 2, 3, 32, 16
    g = torch.Generator().manual_seed(5)
    x = torch.randn(T, D, generator=g).to(torch.bfloat16)
    w1 = torch.randn(E, F, D, generator=g).to(torch.bfloat16)
    w3 = torch.randn(E, F, D, generator=g).to(torch.bfloat16)
    ids = torch.tensor([[2, 0], [0, 1]])
    layout = build_routing_layout(ids, E, cfg.block_m)
    assert layout.n_cap == 64 and layout.tile_expert.tolist() == [0, 1, 2, -1]
    gate_up, _ = gg.gemm1_swiglu_fwd(x, w1, w3, layout, gate_up_out=_poisoned((64, 2 * F)), h_out=_poisoned((64, F)),
                                     config=cfg)
    expect = {0: (0, 0), 1: (1, 0), 16: (1, 1), 32: (0, 2)}  # row -> (token, expert)
    for row, (t, e) in expect.items():
        assert_close_rel(gate_up[row, :F].float(), x[t].float() @ w1[e].float().T, torch.bfloat16, name=f"row {row}")
    assert (gate_up[[2, 17, 33, 47]] == 0).all()  # padding rows of live tiles
    assert torch.isnan(gate_up[48:].float()).all()  # tile with expert -1: skipped


@pytest.mark.parametrize("name", ["uniform_k2", "skewed_k4"])
def test_bitwise_deterministic(name):
    a, b = _run(name), _forward(name)
    for key in ("gate_up", "h", "y", "out"):  # bit patterns (the skipped rows hold NaN poison)
        assert torch.equal(a[key].view(torch.int16), b[key].view(torch.int16)), key


def test_empty_routing_and_allocation():
    """T = 0: no tiles; launchers return empty buffers without launching."""
    from titan_megamoe.kernels.routing import build_routing_layout

    gg = _kernels()
    cfg = _base_config()
    layout = build_routing_layout(torch.empty(0, 2, dtype=torch.int64), 4, cfg.block_m)
    x = torch.empty(0, 32, dtype=torch.bfloat16)
    w = torch.zeros(4, 16, 32, dtype=torch.bfloat16)
    gate_up, h = gg.gemm1_swiglu_fwd(x, w, w, layout, config=cfg)
    assert gate_up.shape == (layout.n_cap, 32) and h.shape == (layout.n_cap, 16)


# ------------------------------------------------------------------------------------------------
# Preconditions
# ------------------------------------------------------------------------------------------------


def test_preconditions_raise():
    from titan_megamoe.kernels.routing import build_routing_layout

    gg = _kernels()
    cfg = _base_config()
    case = CASES["uniform_k2"]
    x, w1, w2, w3, ids, scores = _inputs(case)
    layout = build_routing_layout(ids, case.E, cfg.block_m)
    with pytest.raises(ValueError, match="block_m"):
        gg.gemm1_swiglu_fwd(x, w1, w3, layout, config=dataclasses.replace(cfg, block_m=cfg.block_m * 2))
    with pytest.raises(ValueError, match="bf16"):
        gg.gemm1_swiglu_fwd(x.float(), w1, w3, layout, config=cfg)
    with pytest.raises(ValueError, match="contiguous"):
        gg.gemm1_swiglu_fwd(x, w1.transpose(1, 2).contiguous().transpose(1, 2), w3, layout, config=cfg)
    with pytest.raises(ValueError, match="multiples of 16"):
        gg.gemm1_swiglu_fwd(x[:, :24].contiguous(), w1[:, :, :24].contiguous(), w3[:, :, :24].contiguous(), layout,
                            config=cfg)
    other_k = build_routing_layout(ids[:, :1], case.E, cfg.block_m)  # built for K = 1
    with pytest.raises(ValueError, match="not built for"):
        gg.gemm1_swiglu_fwd(x, w1, w3, other_k.__class__(**{**other_k.__dict__, "top_k": 2}), config=cfg)
    with pytest.raises(ValueError, match="experts"):
        gg.gemm1_swiglu_fwd(x, w1[:2].contiguous(), w3[:2].contiguous(), layout, config=cfg)
    with pytest.raises(ValueError, match="shape"):
        gg.gemm1_swiglu_fwd(x, w1, w3, layout, h_out=torch.empty(3, 3, dtype=torch.bfloat16), config=cfg)
    h = torch.zeros(layout.n_cap, case.F, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="fp32"):
        gg.gemm2_scatter_fwd(h, w2, scores.bfloat16(), layout, config=cfg)
    with pytest.raises(ValueError, match="top_k"):
        gg.gemm2_scatter_fwd(h, w2, scores[:, :1].contiguous(), layout, config=cfg)
    with pytest.raises(ValueError, match="shape"):
        gg.gemm2_scatter_fwd(h[:-1], w2, scores, layout, config=cfg)
    with pytest.raises(ValueError, match="T\\*K"):
        gg.combine_topk(torch.zeros(5, 16, dtype=torch.bfloat16), 2, 2)


def test_configs():
    from titan_megamoe.kernels.configs import GemmConfig, config_for, interpreter_config

    with pytest.raises(ValueError, match="power of two"):
        GemmConfig(block_m=96)
    with pytest.raises(ValueError, match="unknown kind"):
        config_for("gemm3", 64, 64, False)
    assert config_for("gemm1", 2048, 768, True) == interpreter_config()
    g1, g2 = config_for("gemm1", 2048, 768, False), config_for("gemm2", 2048, 768, False)
    assert g1.block_m == g2.block_m == 128  # one layout for both GEMMs
    assert config_for("gemm2", 32, 32, False).block_n == 32  # tiny debug dims: blocks shrink to fit
    with pytest.raises(ValueError, match="maxnreg"):
        GemmConfig(maxnreg=300)
    assert GemmConfig().compile_options() == {"num_warps": 8, "num_stages": 4}
    assert GemmConfig(num_warps=4, num_stages=3, maxnreg=128).compile_options() == {
        "num_warps": 4, "num_stages": 3, "maxnreg": 128}


def test_mode_read_at_launch(monkeypatch):
    gg = _kernels()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not gg.interpret_mode()
    from triton.runtime.jit import JITFunction

    assert isinstance(gg._kernel_variant(gg._gemm1_swiglu_fwd_kernel, False), JITFunction)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert gg.interpret_mode()


# ------------------------------------------------------------------------------------------------
# sm_90a compile check (no GPU needed): wgmma present, shared memory fits
# ------------------------------------------------------------------------------------------------

# (label, kernel kind, D, F, use_tma): the real layer shapes of Qwen3-30B-A3B / 235B-A22B
COMPILE_CASES = [
    ("gemm1_tma_30b", "gemm1", 2048, 768, True),
    ("gemm1_ptr_30b", "gemm1", 2048, 768, False),
    ("gemm2_tma_30b", "gemm2", 2048, 768, True),
    ("gemm2_ptr_30b", "gemm2", 2048, 768, False),
    ("gemm1_ptr_235b", "gemm1", 4096, 1536, False),
    ("gemm1_tma_235b", "gemm1", 4096, 1536, True),
    ("gemm2_ptr_235b", "gemm2", 4096, 1536, False),
    ("gemm2_tma_235b", "gemm2", 4096, 1536, True),
    ("gemm2_persistent_30b", "gemm2", 2048, 768, False),
    ("gemm2_persistent_235b", "gemm2", 4096, 1536, False),
    ("combine", "combine", 2048, 768, False),
]


def _compile_sm90_all() -> list[dict]:
    """Compile every COMPILE_CASES kernel for sm_90a (run with TRITON_INTERPRET=0, no GPU needed)."""
    from titan_megamoe.kernels import grouped_gemm as gg
    from titan_megamoe.kernels.configs import config_for

    results = []
    for label, kind, D, F, use_tma in COMPILE_CASES:
        if kind == "combine":
            fn = gg._kernel_variant(gg._combine_topk_fwd_kernel, False)
            sig = {"y_ptr": "*bf16", "out_ptr": "*bf16"}
            cx = dict(D=D, K=8, BLOCK_D=1024)
            opts = dict(num_warps=4, num_stages=1)
        else:
            from titan_megamoe.kernels.configs import HOPPER_GEMM1, HOPPER_GEMM2

            # the grid kernels' own configs (GEMM2's default is the persistent one since session 8)
            sized = config_for(kind, D, F, False)
            cfg = dataclasses.replace(HOPPER_GEMM1 if kind == "gemm1" else HOPPER_GEMM2, block_n=sized.block_n,
                                      block_k=sized.block_k, use_tma=use_tma)
            if "persistent" in label:
                from titan_megamoe.kernels.configs import HOPPER_GEMM2_PERSISTENT as cfg
            tile = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
                        USE_TMA=use_tma, UPCAST_FP32=False)
            if kind == "gemm1":
                fn = gg._kernel_variant(gg._gemm1_swiglu_fwd_kernel, False)
                sig = {"x_ptr": "*bf16", "w1_ptr": "*bf16", "w3_ptr": "*bf16", "row_pair_ptr": "*i32",
                       "tile_expert_ptr": "*i32", "gate_up_ptr": "*bf16", "h_ptr": "*bf16", "E": "i32"}
                cx = dict(F=F, D=D, K=8, EVEN_K=D % cfg.block_k == 0, **tile)
            else:
                fn = gg._kernel_variant(gg._gemm2_scatter_fwd_kernel, False)
                sig = {"h_ptr": "*bf16", "w2_ptr": "*bf16", "scores_ptr": "*fp32", "row_pair_ptr": "*i32",
                       "tile_expert_ptr": "*i32", "out_pairs_ptr": "*bf16", "offsets_ptr": "*i32", "N_cap": "i32",
                       "E": "i32"}
                # every constexpr given: triton.compile does not apply the kernel's defaults
                cx = dict(F=F, D=D, EVEN_K=F % cfg.block_k == 0, BY_ROW=False, PERSISTENT=cfg.persistent,
                          NUM_PROGS=132 if cfg.persistent else 1, **tile)
            opts = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        r = compile_sm90(fn, sig, cx, num_warps=opts["num_warps"], num_stages=opts["num_stages"],
                         divisible=("N_cap",))
        results.append(dict(label=label, **r))
    return results


@pytest.mark.parametrize("label", [c[0] for c in COMPILE_CASES])
def test_compiles_for_sm90a(label):
    r = sm90_result(__file__, label)
    assert r["target"], "PTX not built for sm_90a"
    if label != "combine":
        assert r["wgmma"] > 0, f"{label}: no wgmma (Hopper tensor core) instruction in the PTX"
        assert (r["tma"] > 0) == ("_tma_" in label), f"{label}: TMA loads {r['tma']}"
        if label.startswith("gemm1"):
            assert r["cp_async"] > 0, f"{label}: the x-row gather is not pipelined through cp.async"
    assert r["shared"] <= SMEM_LIMIT_SM90, f"{label}: {r['shared']} bytes of shared memory > {SMEM_LIMIT_SM90}"
    assert "STACK:0" in r["usage"] or not r["usage"], f"{label}: register spills ({r['usage']})"
    if "persistent" in label:  # the tile loop and the K loop are one loop (else no prefetch across tiles)
        assert r["loops"] == 1, f"{label}: {r['loops']} loops in the TTGIR, the tile loop was not flattened"


# ------------------------------------------------------------------------------------------------
# Script entry: compile check subprocess, GPU benchmark
# ------------------------------------------------------------------------------------------------


def _bench(argv: list[str]) -> None:
    """GPU: correctness vs torch on a real shape, then median time and TF/s of each kernel."""
    import triton

    from titan_megamoe.kernels import grouped_gemm as gg
    from titan_megamoe.kernels.configs import config_for
    from titan_megamoe.kernels.routing import build_routing_layout

    shape = argv[0] if argv else "30b"
    v = bench_layer_inputs(shape, "cuda")
    T, E, K, D, F = v.T, v.E, v.K, v.D, v.F
    dev = "cuda"
    x, w1, w2, w3, ids, scores = v.x, v.w1, v.w2, v.w3, v.ids, v.scores
    layout = build_routing_layout(ids, E, 128)
    gu, h = gg.gemm1_swiglu_fwd(x, w1, w3, layout)
    y = gg.gemm2_scatter_fwd(h, w2, scores, layout)
    out = gg.combine_topk(y, T, K)
    from titan_megamoe.ops.reference import mega_moe_ref
    from titan_megamoe.testing import rel_err

    ref = mega_moe_ref(x, ids, scores, w1, w2, w3, num_experts=E)
    print(json.dumps({"shape": shape, "rel_err_vs_ref": rel_err(out, ref)}))
    flops = 2 * T * K * D * F
    rep = dataclasses.replace
    c1, c2 = config_for("gemm1", D, F, False), config_for("gemm2", D, F, False)
    # the defaults first, then the alternatives configs.py's docstring compares them with
    variants = [("gemm1", c) for c in (c1, rep(c1, use_tma=True), rep(c1, group_m=8))]
    variants += [("gemm2", c) for c in (c2, rep(c2, use_tma=True), rep(c2, block_n=128), rep(c2, group_m=8))]
    for kind, cfg in variants:
        if kind == "gemm1":
            nflop = 2 * flops  # gate and up

            def fn(c=cfg):
                return gg.gemm1_swiglu_fwd(x, w1, w3, layout, gate_up_out=gu, h_out=h, config=c)
        else:
            nflop = flops

            def fn(c=cfg):
                return gg.gemm2_scatter_fwd(h, w2, scores, layout, out_pairs=y, config=c)
        try:
            live = int(layout.offsets[-1])  # rows past the last expert are never written
            base = (h[:live] if kind == "gemm1" else y).clone()
            fn()
            err = rel_err(h[:live] if kind == "gemm1" else y, base)  # every config must agree
            ms = triton.testing.do_bench(fn, warmup=25, rep=100)
            print(json.dumps({"kind": kind, "cfg": dataclasses.astuple(cfg), "ms": round(ms, 4),
                              "tflops": round(nflop / ms / 1e9, 1), "rel_err_vs_default": err}))
        except Exception as e:  # report and keep going: one bad config must not hide the others
            print(json.dumps({"kind": kind, "cfg": dataclasses.astuple(cfg), "error": repr(e)[:300]}))
    ms = triton.testing.do_bench(lambda: gg.combine_topk(y, T, K), warmup=25, rep=100)
    nbytes = (T * K * D + T * D) * 2  # read the (P, D) pair rows, write (T, D)
    print(json.dumps({"kind": "combine", "ms": round(ms, 4), "GB/s": round(nbytes / ms / 1e6, 1)}))


if __name__ == "__main__":
    if sys.argv[1:2] == ["compile-sm90"]:
        print(json.dumps(_compile_sm90_all()))
    elif sys.argv[1:2] == ["bench"]:
        _bench(sys.argv[2:])
    else:
        raise SystemExit("usage: python tests/test_kernels_fwd.py compile-sm90 | bench [30b|235b]")
