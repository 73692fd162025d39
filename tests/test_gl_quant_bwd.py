"""The Gluon quantization passes of the FP8 backward (kernels/gl_quant_bwd.py): sm_90a builds on the CPU machine
(no spills at the default launch configurations, with and without end_row), the launchers' choice between them and
the Triton kernels, and on a GPU their outputs against the Triton kernels bitwise (edge cases: rows past end_row,
invalid rows holding NaN, an expert without rows, all rows on two experts, top_k 1, row counts and column counts that
are not multiples of 128, non-finite groups counted as the Triton kernels count them)."""

import json
import sys

import pytest
import torch

from _sm90 import sm90_result  # noqa: E402

# (label, kernel, C): the dual pass at 2F, the gathered pass at D, both Qwen3 shapes
BUILDS = [("dual_30b", "dual", 1536, True), ("dual_235b", "dual", 3072, True), ("gather_30b", "gather", 2048, True),
          ("gather_235b", "gather", 4096, True), ("dual_30b_no_end", "dual", 1536, False),
          ("gather_30b_no_end", "gather", 2048, False), ("dual_pipe_30b", "dual_pipe", 1536, True),
          ("dual_pipe_235b_no_end", "dual_pipe", 3072, False), ("gather_pipe_30b", "gather_pipe", 2048, True),
          ("gather_pipe_235b_no_end", "gather_pipe", 4096, False), ("dual_pipe_warp_30b", "dual_pipe", 1536, True),
          ("gather_pipe_warp_235b_no_end", "gather_pipe", 4096, False)]


def _compile_sm90_all() -> list[dict]:
    from titan_megamoe.kernels import gl_quant_bwd as GQ
    from titan_megamoe.kernels.sm90_check import compile_sm90
    from titan_megamoe.ops.fp8_reference import AMAX_EPS

    out = []
    default_cols = GQ.PIPE_CONFIG["COLS"] or GQ.QUANT_COLS
    for label, kind, C, has_end in BUILDS:
        pipe = kind.endswith("_pipe")
        GQ.PIPE_CONFIG["COLS"] = "warp" if "_warp" in label else default_cols
        opts = GQ.pipe_launch_options() if pipe else GQ.launch_options(kind)
        nw = opts.pop("num_warps")
        if kind.startswith("dual"):
            fn = GQ._gl_quant_dual_pipe_kernel if pipe else GQ._gl_quant_dual_kernel
            sig = dict(x_ptr="*bf16", valid_ptr="*u8", y_ptr="*fp8e4nv", s_ptr="*fp32", yT_ptr="*fp8e4nv",
                       sT_ptr="*fp32", count_ptr="*i32", end_ptr="*i32", M="i32", LD="i32")
            cx = dict(C=C, CHECK=True, EPS=AMAX_EPS, HAS_END=has_end)
        else:
            fn = GQ._gl_quant_gather_pipe_kernel if pipe else GQ._gl_quant_gather_128x1_t_kernel
            sig = dict(x_ptr="*bf16", row_index_ptr="*i32", yT_ptr="*fp8e4nv", scale_ptr="*fp32", count_ptr="*i32",
                       end_ptr="*i32", M="i32", LD="i32")
            cx = dict(C=C, TOP_K=8, CHECK=True, EPS=AMAX_EPS, HAS_END=has_end)
        cx.update({k: opts.pop(k) for k in ("NW", "SLAB", "BC", "STAGES", "WARP_COLS") if k in opts})
        r = compile_sm90(fn, sig, cx, num_warps=nw, num_stages=1, divisible=("LD", "M"), **opts)
        out.append(dict(label=label, **r))
    return out


@pytest.mark.parametrize("label", [b[0] for b in BUILDS])
def test_gl_quant_builds_for_sm90a_without_spills(label):
    """No spills; the pipelined kernels: 16-byte cp.async (8 per thread and tile, issued at two prologue sites and
    in the loop), registers and shared memory that let PIPE_CONFIG's programs share an SM."""
    from titan_megamoe.kernels import gl_quant_bwd as GQ
    from titan_megamoe.kernels.sm90_check import HOPPER_SMEM_BYTES

    r = sm90_result(__file__, label)
    assert r["target"], "PTX not built for sm_90a"
    assert "STACK:0" in r["usage"], f"{label}: register spills ({r['usage']})"
    assert r["wgmma"] == 0 and r["tma"] == 0, r
    if "_pipe" in label:  # COLS="warp" too: a swizzled buffer, the same copies
        cfg = GQ.PIPE_CONFIG
        assert r["cp_async"] == 8 * cfg["STAGES"], r
        regs = int(r["usage"].split("REG:")[1].split()[0])
        assert regs * 32 * cfg["NW"] * cfg["PER_SM"] <= 65536, f"{label}: {regs} registers"
        assert r["shared"] * cfg["PER_SM"] <= HOPPER_SMEM_BYTES, r["shared"]
    else:
        assert r["cp_async"] == 0, r  # plain loads and stores


def test_launchers_take_the_triton_kernels_where_gluon_cannot_run():
    """variant="gluon" on the CPU (or in the interpreter, or for fp32 input) runs the Triton kernel: same results as
    "v1"; an unknown variant is a clear error."""
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU tensors need Triton's interpreter (TRITON_INTERPRET=1, the CPU suite's setting)")
    from titan_megamoe.kernels.fp8_quant_bwd import quantize_dual_1x128_128x1_t, quantize_gather_128x1_t

    g = torch.Generator().manual_seed(5)
    x = torch.randn(256, 256, generator=g).bfloat16()
    valid = torch.rand(256, generator=g) > 0.2
    a = quantize_dual_1x128_128x1_t(x, valid, variant="v1")
    b = quantize_dual_1x128_128x1_t(x, valid, variant="gluon")
    assert all(torch.equal(u.view(torch.uint8) if u.dtype == torch.float8_e4m3fn else u,
                           v.view(torch.uint8) if v.dtype == torch.float8_e4m3fn else v) for u, v in zip(a, b))
    idx = torch.randint(0, 64 * 2, (256,), generator=g, dtype=torch.int32)
    q1, s1 = quantize_gather_128x1_t(x[:64], idx, 2, variant="v1")
    q2, s2 = quantize_gather_128x1_t(x[:64], idx, 2, variant="gluon")
    assert torch.equal(q1.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(s1, s2)
    b = quantize_dual_1x128_128x1_t(x, valid, variant="gluon_pipe")
    assert all(torch.equal(_bytes(u), _bytes(v)) for u, v in zip(a, b))
    with pytest.raises(ValueError, match="variant must be one of .'v1', 'gluon', 'gluon_pipe'."):
        quantize_dual_1x128_128x1_t(x, valid, variant="pipe")
    with pytest.raises(ValueError, match="variant must be one of"):
        quantize_gather_128x1_t(x[:64], idx, 2, variant="fast")


def _bytes(t):
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


# (T, E, K, C of the dual pass, D of the gathered pass, routing)
GPU_CASES = [(4096, 16, 4, 512, 256, "uniform"), (1000, 8, 1, 256, 384, "uniform"), (3000, 32, 4, 384, 200, "zero"),
             (2048, 16, 2, 256, 640, "one"), (16384, 128, 8, 1536, 2048, "uniform")]


@pytest.mark.cuda
@pytest.mark.parametrize("cols", ["cta", "warp"])
@pytest.mark.parametrize("case", GPU_CASES, ids=["uniform", "top1", "zero-expert-odd-D", "one-expert", "30b"])
def test_gl_quant_bitwise_the_triton_kernels_on_gpu(case, cols, monkeypatch):
    """cols: the pipelined kernels' column work (gl_quant_bwd.PIPE_CONFIG["COLS"])."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm_90 GPU")
    from titan_megamoe.kernels import gl_quant_bwd as GQ

    monkeypatch.setitem(GQ.PIPE_CONFIG, "COLS", cols)
    from titan_megamoe.kernels.fp8_quant_bwd import (
        empty_transposed,
        quantize_dual_1x128_128x1_t,
        quantize_gather_128x1_t,
    )
    from titan_megamoe.kernels.routing import build_routing_layout

    T, E, K, C, D, routing = case
    g = torch.Generator(device="cuda").manual_seed(T + C)
    if routing == "one":  # every token on experts 3 and 1: the others get no rows
        ids = torch.tensor([[3, 1]], device="cuda").expand(T, K).contiguous()
    else:
        probs = torch.rand(T, E, device="cuda", generator=g)
        if routing == "zero":
            probs[:, 1] = -1.0  # expert 1 gets no rows
        ids = probs.topk(K, dim=1).indices
    L = build_routing_layout(ids, E, 128)
    if routing == "zero":
        assert int(L.counts[1]) == 0
    valid = L.row_pair >= 0
    x = (torch.randn(T, D, device="cuda", generator=g) * torch.rand(T, 1, device="cuda", generator=g) * 4).bfloat16()
    dgu = torch.randn(L.n_cap, C, device="cuda", generator=g).bfloat16()
    dgu[~valid] = float("nan")  # invalid rows read as zero, whatever they hold
    end = int(L.offsets[-1])
    for variant, end_row in ((v, e) for v in ("gluon", "gluon_pipe") for e in (None, L.offsets[-1:])):
        lim = end if end_row is not None else L.n_cap
        c1, c2 = (torch.zeros(1, dtype=torch.int32, device="cuda") for _ in range(2))
        a = quantize_dual_1x128_128x1_t(dgu, valid, end_row=end_row, nonfinite_count=c1, variant="v1")
        b = quantize_dual_1x128_128x1_t(dgu, valid, end_row=end_row, nonfinite_count=c2, variant=variant)
        assert torch.equal(_bytes(a[0])[:lim], _bytes(b[0])[:lim]) and torch.equal(a[1][:lim], b[1][:lim])
        assert torch.equal(_bytes(a[2])[:, :lim], _bytes(b[2])[:, :lim])
        assert torch.equal(a[3], b[3]) and int(c1) == int(c2) == 0  # scales of dead blocks written too
        q1, s1 = quantize_gather_128x1_t(x, L.row_pair, K, end_row=end_row, nonfinite_count=c1, variant="v1")
        # the gathered pass's outputs poisoned first (every row below lim must be written)
        q2 = empty_transposed(D, L.n_cap, "cuda")
        q2.view(torch.uint8).fill_(0x7F)  # e4m3 NaN
        s2 = torch.full((L.n_cap // 128, D), float("nan"), device="cuda")
        quantize_gather_128x1_t(x, L.row_pair, K, end_row=end_row, nonfinite_count=c2, variant=variant, out=q2,
                                scale_out=s2)
        assert torch.equal(_bytes(q1)[:, :lim], _bytes(q2)[:, :lim]) and torch.equal(s1, s2)
        assert int(c1) == int(c2) == 0
    # a row count that is not a multiple of 128 (the dual pass takes any M)
    m = 300
    a = quantize_dual_1x128_128x1_t(dgu[:m], valid[:m], variant="v1")
    for variant in ("gluon", "gluon_pipe"):
        b = quantize_dual_1x128_128x1_t(dgu[:m], valid[:m], variant=variant)
        assert all(torch.equal(_bytes(u), _bytes(v)) for u, v in zip(a, b)), variant
    # a non-finite value: counted as the Triton kernels count it (one row group and one column group)
    dgu[int(valid.nonzero()[0]), 0] = float("inf")
    x[int(L.row_pair[int(valid.nonzero()[0])]) // K, 1] = float("nan")
    for variant in ("gluon", "gluon_pipe"):
        c1, c2 = (torch.zeros(1, dtype=torch.int32, device="cuda") for _ in range(2))
        quantize_dual_1x128_128x1_t(dgu, valid, nonfinite_count=c1, variant="v1")
        quantize_dual_1x128_128x1_t(dgu, valid, nonfinite_count=c2, variant=variant)
        assert int(c1) == int(c2) == 2, variant
        c1.zero_(), c2.zero_()
        quantize_gather_128x1_t(x, L.row_pair, K, nonfinite_count=c1, variant="v1")
        quantize_gather_128x1_t(x, L.row_pair, K, nonfinite_count=c2, variant=variant)
        assert int(c1) == int(c2) > 0, variant


if __name__ == "__main__":
    if sys.argv[1:2] == ["compile-sm90"]:
        print(json.dumps(_compile_sm90_all()))
    else:
        raise SystemExit("usage: python tests/test_gl_quant_bwd.py compile-sm90")
