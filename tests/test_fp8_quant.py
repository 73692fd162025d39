"""Blockwise FP8 quantization: Triton kernels (kernels/fp8_quant.py) against the pure-PyTorch oracle
(ops/fp8_reference.py), bit for bit; the oracle against the e4m3 error bound; errors; sm_90a build.

On CPU the kernels run in Triton's interpreter (conftest sets TRITON_INTERPRET=1; the launchers read it
at call time and then round to the e4m3 grid before the cast, because the interpreter's own fp32 ->
fp8 cast is not round-to-nearest-even: see ``test_interpreter_cast_quirk``). On a GPU machine the same
tests run compiled on the GPU, against the oracle computed on the GPU.

Bitwise means: the fp8 bytes and the fp32 scales are equal (``torch.equal`` on a uint8 view), not
close. Both sides compute amax exactly (a max), one IEEE division for the scale, one per element and a
round-to-nearest-even cast, so there is nothing to be tolerant about.

The sm_90a compile check runs in a subprocess with TRITON_INTERPRET=0 (``python tests/test_fp8_quant.py
compile-sm90``), as in test_kernels_fwd.py: no GPU needed; it also reads the PTX for the instructions
the bitwise argument relies on (``div.rn.f32``, ``cvt.rn.satfinite.e4m3x2.f32``) and checks for
register spills.
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

from titan_megamoe.kernels.sm90_check import (  # noqa: E402
    HOPPER_SMEM_BYTES,
    compile_sm90,
)
from _sm90 import sm90_result  # noqa: E402
from titan_megamoe.ops import fp8_reference as ref  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
E4M3 = torch.float8_e4m3fn
EPS_SCALE = (torch.tensor(ref.AMAX_EPS, dtype=torch.float32) / 448.0).item()  # scale of an all-zero group


def _fq():
    # Lazy: imported inside tests so TRITON_INTERPRET is already set whatever pytest collected first.
    from titan_megamoe.kernels import fp8_quant

    return fp8_quant


def _wide_range(shape, dtype, seed, dim=0):
    """Gaussian values whose slices along ``dim`` are scaled by 1e-3 .. 1e3 (shuffled): groups of
    very different magnitudes, and (for 128x1) groups that mix them."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen)
    n = shape[dim]
    mag = torch.logspace(-3, 3, n)[torch.randperm(n, generator=gen)]
    view = [1] * len(shape)
    view[dim] = n
    return (x * mag.view(view)).to(dtype).to(DEV)


def assert_bitwise(got, want, what=""):
    """fp8 bytes and fp32 scales equal bit for bit (NaN scales compare by their bits too)."""
    (q, s), (rq, rs) = got, want
    assert q.dtype == rq.dtype == E4M3 and q.shape == rq.shape, f"{what}: {q.dtype} {q.shape} vs {rq.dtype} {rq.shape}"
    assert s.dtype == rs.dtype == torch.float32 and s.shape == rs.shape, f"{what}: scales {s.shape} vs {rs.shape}"
    for name, a, b in (("values", q.view(torch.uint8), rq.view(torch.uint8)),
                       ("scales", s.view(torch.int32), rs.view(torch.int32))):
        bad = (a != b).nonzero()
        assert bad.numel() == 0, (f"{what}: {bad.shape[0]} {name} differ, first at {bad[:4].tolist()}: "
                                  f"{[a[tuple(i)].item() for i in bad[:4]]} vs {[b[tuple(i)].item() for i in bad[:4]]}")


# --------------------------------------------------------------------------------------------------
# Kernels == oracle, bitwise
# --------------------------------------------------------------------------------------------------

ACT_CASES = [
    # (M, D, dtype): what it covers
    (1, 128, torch.bfloat16),  # one row, one group
    (37, 384, torch.bfloat16),  # M not a multiple of the row block, 3 groups
    (130, 256, torch.float32),  # fp32 input, M just past a 128-row block
    (5, 128, torch.float16),  # fp16 input
]


@pytest.mark.parametrize("M,D,dtype", ACT_CASES, ids=[f"M{c[0]}-D{c[1]}-{str(c[2])[6:]}" for c in ACT_CASES])
def test_act_1x128_matches_reference(M, D, dtype):
    x = _wide_range((M, D), dtype, seed=M + D)
    assert_bitwise(_fq().quantize_act_1x128(x), ref.quantize_act_1x128(x), f"1x128 {M}x{D}")


GATHER_CASES = [
    # (M_in, D, index pattern, top_k): what it covers
    (20, 256, "mixed", 1),  # -1 rows, repeats, out-of-order rows
    (1, 128, "all_minus_one", 1),  # every output row is a zero row
    (33, 384, "layout", 4),  # layout.row_pair of a real routing with K = 4 (token = pair // K)
]


def _row_index(kind, M_in, top_k, seed):
    gen = torch.Generator().manual_seed(seed)
    if kind == "mixed":
        idx = torch.randint(-1, M_in, (3 * M_in + 5,), generator=gen)
        idx[:3] = torch.tensor([M_in - 1, -1, 0])
    elif kind == "all_minus_one":
        idx = torch.full((7,), -1)
    else:
        from titan_megamoe.kernels.routing import build_routing_layout_torch
        from titan_megamoe.testing import make_routing

        ids = make_routing("skewed", M_in, 8, top_k, seed=seed)
        idx = build_routing_layout_torch(ids, 8, 16).row_pair  # padding rows are -1
    return idx.to(torch.int32).to(DEV)


@pytest.mark.parametrize("M_in,D,kind,top_k", GATHER_CASES, ids=[c[2] for c in GATHER_CASES])
def test_act_1x128_gather_matches_reference(M_in, D, kind, top_k):
    x = _wide_range((M_in, D), torch.bfloat16, seed=M_in)
    idx = _row_index(kind, M_in, top_k, seed=D)
    M = idx.shape[0]
    # poisoned caller buffers (NaN bytes / NaN scales): an element the kernel does not write shows up
    out = torch.full((M, D), 0x7F, dtype=torch.uint8, device=DEV).view(E4M3)
    scale_out = torch.full((M, D // 128), float("nan"), device=DEV)
    got = _fq().quantize_act_1x128(x, idx, top_k, out=out, scale_out=scale_out)
    assert got[0] is out and got[1] is scale_out  # the _out convention
    want = ref.quantize_act_1x128(x, idx, top_k)
    assert_bitwise(got, want, f"gather {kind}")
    zero = idx < 0
    assert torch.all(got[1][zero] == EPS_SCALE) and torch.all(got[0][zero].view(torch.uint8) == 0)


COL_CASES = [
    # (M, D, dtype, row_valid): what it covers
    (1, 128, torch.bfloat16, None),  # one row: a block of 1 valid row
    (129, 384, torch.bfloat16, None),  # M one past a block: a 1-row last block
    (300, 200, torch.float32, None),  # D not a multiple of 128 or of the column block
    (256, 64, torch.bfloat16, "bool"),  # invalid rows (bool mask) left out of the max, stored as 0
    (70, 128, torch.bfloat16, "int32"),  # int32 mask, e.g. from layout arithmetic
]


@pytest.mark.parametrize("M,D,dtype,valid", COL_CASES, ids=[f"M{c[0]}-D{c[1]}-{c[3]}" for c in COL_CASES])
def test_act_128x1_matches_reference(M, D, dtype, valid):
    x = _wide_range((M, D), dtype, seed=M * D, dim=0)  # rows of very different magnitude share a group
    row_valid = None
    if valid:
        gen = torch.Generator().manual_seed(M)
        row_valid = (torch.rand(M, generator=gen) < 0.6).to(DEV)
        x[~row_valid] = float("nan")  # never read: would poison the max and the count
        if valid == "int32":
            row_valid = row_valid.to(torch.int32)
    fq = _fq()
    count = fq.new_nonfinite_count(DEV)
    got = fq.quantize_act_128x1(x, row_valid, nonfinite_count=count)
    assert_bitwise(got, ref.quantize_act_128x1(x, row_valid), f"128x1 {M}x{D}")
    assert count.item() == 0
    if valid:
        assert torch.all(got[0][row_valid == 0].view(torch.uint8) == 0)


W_CASES = [
    # (E, N, Kd, dtype): what it covers
    (3, 200, 256, torch.bfloat16),  # E = 3, N not a multiple of 128 (partial last row block)
    (1, 128, 384, torch.float32),  # fp32 master weights, exact blocks
    (2, 1, 128, torch.bfloat16),  # N = 1
]


@pytest.mark.parametrize("E,N,Kd,dtype", W_CASES, ids=[f"E{c[0]}-N{c[1]}-K{c[2]}" for c in W_CASES])
def test_weight_128x128_matches_reference(E, N, Kd, dtype):
    w = _wide_range((E, N, Kd), dtype, seed=N + Kd, dim=1) * 0.02
    assert_bitwise(_fq().quantize_weight_128x128(w), ref.quantize_weight_128x128(w), f"w {E}x{N}x{Kd}")


@pytest.mark.parametrize("forward", [True, False], ids=["fwd-and-t", "t-only"])
@pytest.mark.parametrize("E,N,Kd,dtype", W_CASES, ids=[f"E{c[0]}-N{c[1]}-K{c[2]}" for c in W_CASES])
def test_weight_128x128_transposed_in_one_pass_matches_reference(E, N, Kd, dtype, forward):
    """The fused transposed copy: the transpose of the reference quantization of w, bit for bit, and the reference
    quantization of w transposed (the FP8 dgrads' K-major operand); a non-finite block counted once (though stored
    twice) and stored as the untransposed kernel stores it."""
    fq = _fq()
    w = _wide_range((E, N, Kd), dtype, seed=N + Kd + 1, dim=1) * 0.02
    count = fq.new_nonfinite_count(DEV)
    q, s, qt, st = fq.quantize_weight_128x128_t(w, forward=forward, nonfinite_count=count)
    rq, rs = ref.quantize_weight_128x128(w)
    assert qt.shape == (E, Kd, N) and st.shape == (E, Kd // 128, -(-N // 128))
    assert_bitwise((qt, st), (rq.transpose(1, 2).contiguous(), rs.transpose(1, 2).contiguous()), "transposed")
    if N % 128 == 0:  # the transposed weight's own reference quantization (its blocks are the same blocks)
        assert_bitwise((qt, st), ref.quantize_weight_128x128(w.transpose(1, 2).contiguous()))
    if forward:
        assert_bitwise((q, s), (rq, rs), "as it lies")
    else:
        assert q is None and s is None
    assert count.item() == 0
    w[E - 1, N - 1, Kd - 1] = float("inf")
    q, s, qt, st = fq.quantize_weight_128x128_t(w, forward=forward, nonfinite_count=count)
    kq, ks = fq.quantize_weight_128x128(w)
    assert_bitwise((qt, st), (kq.transpose(1, 2).contiguous(), ks.transpose(1, 2).contiguous()), "non-finite block")
    assert count.item() == 1


def test_empty_inputs():
    fq = _fq()
    q, s = fq.quantize_act_1x128(torch.zeros(0, 256, device=DEV))
    assert q.shape == (0, 256) and s.shape == (0, 2)
    q, s = fq.quantize_act_128x1(torch.zeros(0, 64, device=DEV))
    assert q.shape == (0, 64) and s.shape == (0, 64)
    q, s = fq.quantize_act_1x128(torch.zeros(0, 128, device=DEV), torch.full((3,), -1, dtype=torch.int32, device=DEV))
    assert torch.all(q.view(torch.uint8) == 0) and torch.all(s == EPS_SCALE)


def test_worked_example():
    """The example of the launcher's docstring."""
    x = torch.zeros(2, 128, device=DEV)
    x[0, 0], x[1, 0] = 896.0, 1.0
    idx = torch.tensor([1, -1, 0], dtype=torch.int32, device=DEV)
    for fn in (_fq().quantize_act_1x128, ref.quantize_act_1x128):
        q, s = fn(x, idx)
        assert s[:, 0].tolist() == [(torch.tensor(1.0) / 448.0).item(), EPS_SCALE, 2.0]
        assert q.float()[:, 0].tolist() == [448.0, 0.0, 448.0] and torch.all(q.float()[:, 1:] == 0)


def test_rounding_ties_and_edges():
    """A group whose amax is 448 has scale exactly 1, so q = e4m3(x): feed every midpoint between
    consecutive e4m3 values (ties: must go to the even neighbour), the fp32 neighbours of each
    midpoint, every e4m3 value, signed zeros, and values around the normal/subnormal boundary."""
    grid = torch.arange(0, 127, dtype=torch.uint8).view(E4M3).float()  # all finite e4m3 >= 0 (0x7F is NaN)
    mids = (grid[:-1] + grid[1:]) / 2  # exact in fp32
    up, down = torch.nextafter(mids, torch.tensor(1e9)), torch.nextafter(mids, torch.tensor(0.0))
    vals = torch.cat([grid, mids, up, down, torch.tensor([0.0, -0.0, 2**-6, 2**-7, 2**-10, 2**-11, 1e-30])])
    vals = torch.cat([vals, -vals])
    rows = -(-vals.numel() // 127)
    x = torch.zeros(rows * 127)
    x[: vals.numel()] = vals
    x = torch.cat([torch.full((rows, 1), 448.0), x.view(rows, 127)], dim=1).to(DEV)
    q, s = _fq().quantize_act_1x128(x)
    assert torch.all(s == 1.0)
    assert torch.equal(q.view(torch.uint8), x.to(E4M3).view(torch.uint8))  # torch's own cast
    assert_bitwise((q, s), ref.quantize_act_1x128(x), "ties")


def _rn32(v):
    """The fp32 nearest to the exact rational v, ties to even."""
    import numpy as np
    from fractions import Fraction

    f = np.float32(float(v))
    cands = [f, np.nextafter(f, np.float32(-np.inf)), np.nextafter(f, np.float32(np.inf))]
    err = [abs(Fraction(float(c)) - v) for c in cands]
    best = min(err)
    tied = [c for c, e in zip(cands, err) if e == best]
    return min(tied, key=lambda c: int(np.array(c).view(np.uint32)) & 1)


def test_reciprocal_and_fma_correction_is_the_ieee_quotient():
    """``fp8_quant._div_by_group``'s arithmetic (y = RN(1/b), q = RN(x y), q' = RN(q + RN(x - b q) y), each FMA
    one rounding) gives RN(x / b) bit for bit, in exact rational arithmetic: random scales of many binades, the
    divisors with all-ones significands, x at every e4m3 midpoint times b (rounded to fp32) and its fp32
    neighbours, x = +-amax. The compiled quantization kernels rely on it (their GPU tests compare with torch's
    division); the interpreter keeps ``div_rn``."""
    import numpy as np
    from fractions import Fraction

    rng = np.random.default_rng(0)
    grid = torch.arange(0, 127, dtype=torch.uint8).view(E4M3).float().numpy()
    mids = ((grid[:-1] + grid[1:]) / 2).astype(np.float32)
    amax = np.concatenate([(rng.random(40) * 10.0 ** rng.integers(-10, 6, 40)),
                           [448.0, 1.0, 3.0, 2.0 ** -20, 1e-12]]).astype(np.float32)
    ones = np.array([0x3F7FFFFF, 0x3FFFFFFF, 0x2F7FFFFF, 0x437FFFFF], dtype=np.uint32).view(np.float32)
    pairs = []
    # 448: the Gluon FP8 GEMM2 dgrad takes amax / 448 this way (ws_gemm2_dgrad_fp8.RCP_448)
    for b in np.concatenate([(amax / np.float32(448.0)).astype(np.float32), ones, [np.float32(448.0)]]):
        xs = (rng.choice(mids, 24) * b).astype(np.float32)
        xs = np.concatenate([xs, np.nextafter(xs, np.float32(np.inf)), np.nextafter(xs, np.float32(0)),
                             (rng.uniform(-448, 448, 24) * b).astype(np.float32), [b * np.float32(448.0)]])
        pairs += [(np.float32(x), b) for x in np.concatenate([xs, -xs])]
    from titan_megamoe.kernels.ws_gemm2_dgrad_fp8 import RCP_448

    assert np.float32(RCP_448) == np.float32(1.0) / np.float32(448.0) and float(np.float32(RCP_448)) == RCP_448
    for x, b in pairs:
        y = np.float32(1.0) / b  # numpy: IEEE fp32 division (round to nearest)
        q = np.float32(x * y)
        r = _rn32(Fraction(float(x)) - Fraction(float(b)) * Fraction(float(q)))  # one FMA: one rounding
        got = _rn32(Fraction(float(q)) + Fraction(float(r)) * Fraction(float(y)))
        want = x / b
        assert np.array(got).view(np.uint32) == np.array(want).view(np.uint32), (float(x), float(b), got, want)


def test_quantization_near_e4m3_midpoints_with_arbitrary_scales():
    """Groups whose scale is not a power of two and whose x / scale lands on (or one fp32 step beside) a midpoint
    between two e4m3 values: the kernels' quotient must round exactly as torch's division (``div_rn``, or in the
    weight quantization the reciprocal and FMA correction of ``_div_by_group``)."""
    g = torch.Generator().manual_seed(3)
    grid = torch.arange(0, 127, dtype=torch.uint8).view(E4M3).float()
    mids = (grid[:-1] + grid[1:]) / 2
    rows = []
    for amax in torch.rand(16, generator=g) * 10.0 ** torch.randint(-6, 4, (16,), generator=g):
        s = (amax / 448.0).float()
        m = mids[torch.randint(0, mids.numel(), (127,), generator=g)]
        x = (m * s).float()
        x = torch.where(torch.rand(127, generator=g) < 0.3, torch.nextafter(x, torch.tensor(1e30)), x)
        x = x * torch.where(torch.rand(127, generator=g) < 0.5, -1.0, 1.0)
        rows.append(torch.cat([amax.reshape(1).float(), x]))
    x = torch.stack(rows).to(DEV)
    assert_bitwise(_fq().quantize_act_1x128(x), ref.quantize_act_1x128(x), "midpoints, 1x128")
    assert_bitwise(_fq().quantize_act_128x1(x.t().contiguous()), ref.quantize_act_128x1(x.t().contiguous()),
                   "midpoints, 128x1")
    blocks = []  # 2 x 3 weight blocks of 128 x 128, each with its own amax (its first value) and scale
    for b in range(6):
        amax = (torch.rand((), generator=g) * 10.0 ** torch.randint(-6, 3, (), generator=g)).float()
        m = mids[torch.randint(0, mids.numel(), (128 * 128,), generator=g)]
        v = (m * (amax / 448.0).float()).float() * torch.where(torch.rand(128 * 128, generator=g) < 0.5, -1.0, 1.0)
        v[0] = amax
        blocks.append(v.view(128, 128))
    w = torch.cat([torch.cat(blocks[3 * r:3 * r + 3], dim=1) for r in range(2)], dim=0)[None].to(DEV)
    assert_bitwise(_fq().quantize_weight_128x128(w), ref.quantize_weight_128x128(w), "midpoints, 128x128")


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="interpreter-only quirk (compiled kernels "
                    "use the hardware cvt.rn.satfinite, checked in the sm_90a PTX)")
def test_interpreter_cast_quirk():
    """Why the launchers set EXACT_ROUND in the interpreter: triton's interpreter casts fp32 -> e4m3
    with ties away from zero, a mantissa carry ORed into the exponent, and truncated subnormals. If this
    starts to pass through, the interpreter was fixed and the EXACT_ROUND pre-rounding could go."""
    import triton
    import triton.language as tl

    @triton.jit
    def _raw_cast_kernel(x_ptr, y_ptr, N: tl.constexpr):
        offs = tl.arange(0, N)
        tl.store(y_ptr + offs, tl.load(x_ptr + offs).to(tl.float8e4nv))

    x = torch.tensor([1.0625, 0.0312, 3 * 2**-10, 1.0, 0.0, 448.0, -2.5, 0.75 * 2**-9])
    y = torch.empty(8, dtype=E4M3)
    _raw_cast_kernel[(1,)](x, y, N=8)
    mismatch = (y.view(torch.uint8) != x.to(E4M3).view(torch.uint8))
    if not mismatch.any():
        pytest.skip("the interpreter's fp32 -> e4m3 cast now matches torch: EXACT_ROUND may be dropped")
    assert mismatch[:3].all() and not mismatch[3:7].any(), mismatch  # the three documented quirks only


# --------------------------------------------------------------------------------------------------
# Oracle properties: zero groups, error bound
# --------------------------------------------------------------------------------------------------


def test_all_zero_groups():
    """Zero groups (a zero row group, a zero column, a zero weight block): finite scale eps / 448, zeros."""
    fq = _fq()
    x = _wide_range((6, 256), torch.bfloat16, seed=1)
    x[2, 128:] = 0.0
    x[:, 7] = 0.0
    w = _wide_range((2, 130, 256), torch.bfloat16, seed=2)
    w[1, :128, 128:] = 0.0
    for got, want, pos in (
        (fq.quantize_act_1x128(x), ref.quantize_act_1x128(x), (2, 1)),
        (fq.quantize_act_128x1(x), ref.quantize_act_128x1(x), (0, 7)),
        (fq.quantize_weight_128x128(w), ref.quantize_weight_128x128(w), (1, 0, 1)),
    ):
        assert_bitwise(got, want)
        assert got[1][pos].item() == EPS_SCALE > 0 and torch.isfinite(got[1]).all()
    assert torch.all(fq.quantize_act_1x128(x)[0][2, 128:].view(torch.uint8) == 0)
    assert torch.all(fq.quantize_act_128x1(x)[0][:, 7].view(torch.uint8) == 0)
    assert torch.all(fq.quantize_weight_128x128(w)[0][1, :128, 128:].view(torch.uint8) == 0)


def _check_error_bound(x, deq, scale_full):
    """Per element: |deq - x| <= max(2^-4 |x|, 2^-10 s) (+ fp32 rounding slack). e4m3 keeps 3 mantissa
    bits, so round-to-nearest moves a value in the normal range (|x / s| >= 2^-6) by at most half an ulp
    = 2^-4 of the bottom of its binade, i.e. <= 2^-4 |x|; below it the grid step is 2^-9, so at most
    2^-10 in units of s. The divisions x / s and q * s add 2^-24 relative each, covered by the slack.

    Norm-wise: ||deq - x|| / ||x|| <= 0.04. The worst case 2^-4 = 0.0625 needs every element at a tie
    at the bottom of a binade; a typical rounding error is spread over +-ulp / 2 (rms ulp / sqrt(12))
    and the ulp is 2^-3 / m relative to a value with mantissa m in [1, 2), which gives ~0.025 for
    Gaussian data (0.020-0.026 measured on these inputs); subnormal-range elements add at most 2^-10 s each, small
    against the group's largest values. 0.04 leaves margin for the data and still fails for a wrong
    scale or rounding (one lost mantissa bit doubles the error to ~0.05)."""
    x = x.double()
    err = (deq.double() - x).abs()
    bound = torch.maximum(2.0**-4 * x.abs(), 2.0**-10 * scale_full.double()) * (1 + 2.0**-20)
    over = (err > bound).nonzero()
    assert over.numel() == 0, f"{over.shape[0]} elements over the e4m3 bound, first {over[:4].tolist()}"
    rel = (torch.linalg.vector_norm(deq.double() - x) / torch.linalg.vector_norm(x)).item()
    assert rel <= 0.04, rel
    return rel


def test_dequantized_error_within_e4m3_bound():
    x = _wide_range((200, 384), torch.bfloat16, seed=3)
    q, s = ref.quantize_act_1x128(x)
    r1 = _check_error_bound(x, ref.dequantize_act_1x128(q, s), s.repeat_interleave(128, dim=1))
    q, s = ref.quantize_act_128x1(x)
    r2 = _check_error_bound(x, ref.dequantize_act_128x1(q, s), s.repeat_interleave(128, dim=0)[:200])
    w = _wide_range((3, 200, 256), torch.float32, seed=4, dim=1) * 0.02
    q, s = ref.quantize_weight_128x128(w)
    full = s.repeat_interleave(128, dim=1)[:, :200].repeat_interleave(128, dim=2)
    r3 = _check_error_bound(w, ref.dequantize_weight_128x128(q, s), full)
    assert min(r1, r2, r3) > 0.01  # quantized for real (an identity would pass the bound trivially)


# --------------------------------------------------------------------------------------------------
# Errors: dims, non-finite input, launcher arguments
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_dims_not_multiple_of_128_raise(impl):
    mod = ref if impl == "reference" else _fq()
    with pytest.raises(ValueError, match=r"layers\.3\.moe x has channel dim D \(last dim\) = 100.*precision = 'bf16'"):
        mod.quantize_act_1x128(torch.zeros(4, 100, device=DEV), name="layers.3.moe x")
    with pytest.raises(ValueError, match=r"w2 has reduction dim Kd \(last dim\) = 200.*precision = 'bf16'"):
        mod.quantize_weight_128x128(torch.zeros(2, 128, 200, device=DEV), name="w2")
    mod.quantize_act_128x1(torch.zeros(4, 100, device=DEV))  # 128x1 groups rows: any D is fine
    mod.quantize_weight_128x128(torch.zeros(2, 100, 128, device=DEV))  # any N is fine


NONFINITE = [
    # (kind, bad value): what it covers
    ("1x128", float("inf")),
    ("1x128", float("nan")),  # NaN must not be skipped by the max (tl.max / maxnum would)
    ("128x1", float("-inf")),
    ("weight", float("nan")),
]


def _kernel_and_oracle(kind):
    fq = _fq()
    return {"1x128": (fq.quantize_act_1x128, ref.quantize_act_1x128),
            "128x1": (fq.quantize_act_128x1, ref.quantize_act_128x1),
            "weight": (fq.quantize_weight_128x128, ref.quantize_weight_128x128)}[kind]


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # inf / inf in the interpreter
@pytest.mark.parametrize("kind,bad", NONFINITE, ids=[f"{k}-{b}" for k, b in NONFINITE])
def test_nonfinite_input(kind, bad):
    fq = _fq()
    x = _wide_range((3, 130, 256) if kind == "weight" else (130, 256), torch.bfloat16, seed=5)
    spots = [(1, 2, 3), (2, 129, 255)] if kind == "weight" else [(1, 3), (129, 255), (129, 250)]
    for p in spots:
        x[p] = bad
    kernel, oracle = _kernel_and_oracle(kind)
    with pytest.raises(ValueError, match=r"layers\.7\.moe: \d+ of \d+ FP8 scaling groups have a non-finite"):
        oracle(x, name="layers.7.moe")
    want = oracle(x, check_finite=False)
    n_bad = int((~torch.isfinite(want[1])).sum())
    assert n_bad == (2 if kind != "128x1" else 3)
    count = fq.new_nonfinite_count(DEV)
    got = kernel(x, nonfinite_count=count)
    assert count.item() == n_bad  # no host sync in the kernel; the count is read here
    # the scales (inf / NaN ones included) equal the oracle's; values of the bad groups are unspecified
    assert torch.equal(got[1].isnan(), want[1].isnan())
    fin = torch.isfinite(want[1])
    assert torch.equal(got[1][fin], want[1][fin]) and torch.equal(got[1][~fin].isinf(), want[1][~fin].isinf())
    kernel(x, nonfinite_count=count)  # counts accumulate over launches until the caller zeroes them
    assert count.item() == 2 * n_bad
    with pytest.raises(ValueError, match=rf"layers\.7\.moe: {2 * n_bad} FP8 scaling groups have a non-finite"):
        fq.check_nonfinite_count(count, "layers.7.moe")


def test_nonfinite_not_read_is_not_counted():
    """A NaN row that the gather never reads (index -1, or a row not indexed) raises nothing."""
    fq = _fq()
    x = _wide_range((8, 128), torch.bfloat16, seed=6)
    x[5] = float("nan")
    idx = torch.tensor([0, -1, 7, 2], dtype=torch.int32, device=DEV)
    count = fq.new_nonfinite_count(DEV)
    got = fq.quantize_act_1x128(x, idx, nonfinite_count=count)
    assert count.item() == 0
    assert_bitwise(got, ref.quantize_act_1x128(x, idx))
    fq.check_nonfinite_count(count)  # no raise


def test_act_1x128_row_valid_quantizes_rows_in_place():
    """``row_valid`` (h's quantization: rows in layout order, zero where row_pair < 0): bitwise the gather with the
    index "the row itself, or -1", into poisoned buffers; a NaN row it leaves out is neither read nor counted."""
    fq = _fq()
    x = _wide_range((300, 256), torch.bfloat16, seed=8)
    x[7] = float("nan")
    valid = torch.arange(300, dtype=torch.int32, device=DEV) % 5 - 1  # -1 on every fifth row, others >= 0
    valid[7] = -1
    idx = torch.where(valid >= 0, torch.arange(300, dtype=torch.int32, device=DEV), -1)
    out = torch.full((300, 256), 0x7F, dtype=torch.uint8, device=DEV).view(E4M3)
    scale_out = torch.full((300, 2), float("nan"), device=DEV)
    count = fq.new_nonfinite_count(DEV)
    got = fq.quantize_act_1x128(x, row_valid=valid, out=out, scale_out=scale_out, nonfinite_count=count)
    assert got[0] is out and count.item() == 0
    assert_bitwise(got, ref.quantize_act_1x128(x, idx), "row_valid")
    assert torch.all(got[1][valid < 0] == EPS_SCALE) and (got[0][valid < 0].view(torch.uint8) == 0).all()
    with pytest.raises(ValueError, match="row_index .* or row_valid .*, not both"):
        fq.quantize_act_1x128(x, idx, row_valid=valid)
    with pytest.raises(ValueError, match="row_valid has 299 entries, x has 300 rows"):
        fq.quantize_act_1x128(x, row_valid=valid[:299].contiguous())


def test_launcher_argument_errors():
    fq = _fq()
    x = torch.zeros(8, 128, device=DEV)
    with pytest.raises(ValueError, match="row_index must be one of"):
        fq.quantize_act_1x128(x, torch.zeros(4, dtype=torch.int64, device=DEV))
    with pytest.raises(ValueError, match="must be contiguous"):
        fq.quantize_act_1x128(torch.zeros(256, 8, device=DEV).t())
    with pytest.raises(ValueError, match="nonfinite_count must be a \\(1,\\) int32"):
        fq.quantize_act_1x128(x, nonfinite_count=torch.zeros(1, dtype=torch.int64, device=DEV))
    with pytest.raises(ValueError, match="must be one of"):
        fq.quantize_weight_128x128(torch.zeros(1, 128, 128, dtype=torch.int32, device=DEV))
    with pytest.raises(ValueError, match="row_valid must have shape"):
        fq.quantize_act_128x1(x, torch.ones(7, dtype=torch.bool, device=DEV))
    with pytest.raises(ValueError, match="scale_out must be a contiguous"):
        fq.quantize_act_1x128(x, scale_out=torch.empty(8, 2, device=DEV))
    with pytest.raises(ValueError, match="top_k=0 must be >= 1"):
        fq.quantize_act_1x128(x, torch.zeros(2, dtype=torch.int32, device=DEV), 0)


# --------------------------------------------------------------------------------------------------
# sm_90a compile check (no GPU needed): builds, the right instructions, no spills
# --------------------------------------------------------------------------------------------------

# (label, kernel, input dtype, dims, flags): the real shapes of Qwen3-30B-A3B (D 2048, F 768) and
# 235B-A22B (D 4096, F 1536)
COMPILE_CASES = [
    ("act_1x128_bf16", "act", "bf16", dict(D=2048), dict(GATHER=False)),
    ("act_1x128_gather_bf16", "act", "bf16", dict(D=4096), dict(GATHER=True, TOP_K=8)),
    ("act_1x128_fp32", "act", "fp32", dict(D=2048), dict(GATHER=False)),
    ("act_128x1_bf16", "col", "bf16", dict(D=768), dict(HAS_VALID=True)),
    ("act_128x1_fp32", "col", "fp32", dict(D=4096), dict(HAS_VALID=False)),
    ("weight_128x128_bf16", "weight", "bf16", dict(N=768, Kd=2048), dict(FORWARD=True, TRANSPOSED=False)),
    ("weight_128x128_fp32", "weight", "fp32", dict(N=4096, Kd=1536), dict(FORWARD=True, TRANSPOSED=False)),
    # the transposed copy in the same pass (quantize_weight_128x128_t): "fp8" (both) and "fp8_bwd" (transposed only)
    ("weight_128x128_t_bf16", "weight", "bf16", dict(N=768, Kd=2048), dict(FORWARD=True, TRANSPOSED=True)),
    ("weight_128x128_t_only_fp32", "weight", "fp32", dict(N=4096, Kd=1536), dict(FORWARD=False, TRANSPOSED=True)),
]


def _ptx_counts(fn, sig, cx, num_warps) -> dict:
    """Instruction counts of the PTX (the same compile as compile_sm90's, served from triton's cache)."""
    import triton
    from triton.backends.compiler import GPUTarget

    full = dict(sig)
    full.update({k: "constexpr" for k in cx})
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n, t in full.items() if t.startswith("*")}
    ck = triton.compile(triton.compiler.ASTSource(fn=fn, signature=full, constexprs=cx, attrs=attrs),
                        target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps, num_stages=1))
    ptx = ck.asm["ptx"]
    return {k: ptx.count(k) for k in ("cvt.rn.satfinite.e4m3x2.f32", "div.rn.f32", "div.full.f32", "div.approx",
                                      "atom.global")}


def _compile_sm90_all() -> list[dict]:
    """Compile every COMPILE_CASES kernel for sm_90a (run with TRITON_INTERPRET=0, no GPU needed)."""
    from titan_megamoe.kernels import fp8_quant as fq
    from titan_megamoe.kernels.grouped_gemm import _kernel_variant

    results = []
    for label, kind, dt, dims, flags in COMPILE_CASES:
        common = dict(CHECK=True, EXACT_ROUND=False, EPS=ref.AMAX_EPS)
        if kind == "act":
            fn = _kernel_variant(fq._quant_act_1x128_kernel, False)
            sig = {"x_ptr": f"*{dt}", "row_index_ptr": "*i32", "y_ptr": "*fp8e4nv", "scale_ptr": "*fp32",
                   "count_ptr": "*i32", "M": "i32"}
            cx = dict(BLOCK_M=fq._ACT_BLOCK_M[False], **{"TOP_K": 1, **flags}, **dims, **common)
            warps = fq._ACT_WARPS
        elif kind == "col":
            fn = _kernel_variant(fq._quant_act_128x1_kernel, False)
            sig = {"x_ptr": f"*{dt}", "valid_ptr": "*u8", "y_ptr": "*fp8e4nv", "scale_ptr": "*fp32",
                   "count_ptr": "*i32", "M": "i32"}
            cx = dict(BLOCK_D=fq._COL_BLOCK_D[False], **dims, **flags, **common)
            warps = fq._COL_WARPS
        else:
            fn = _kernel_variant(fq._quant_weight_128x128_kernel, False)
            sig = {"w_ptr": f"*{dt}", "y_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "count_ptr": "*i32",
                   "yt_ptr": "*fp8e4nv", "scale_t_ptr": "*fp32"}
            cx = dict(**dims, **flags, **common)
            warps = fq._W_WARPS
        r = compile_sm90(fn, sig, cx, num_warps=warps, num_stages=1)
        results.append(dict(label=label, **r, **_ptx_counts(fn, sig, cx, warps)))
    return results


@pytest.mark.parametrize("label", [c[0] for c in COMPILE_CASES])
def test_compiles_for_sm90a(label):
    r = sm90_result(__file__, label)
    assert r["target"], "PTX not built for sm_90a"
    # the bitwise argument: IEEE divisions (a plain fp32 '/' would be div.full.f32, approximate) and
    # the round-to-nearest-even hardware cast
    assert r["div.rn.f32"] > 0 and r["div.full.f32"] == 0 and r["div.approx"] == 0, r
    assert r["cvt.rn.satfinite.e4m3x2.f32"] > 0, r
    assert r["atom.global"] > 0, f"{label}: no atomic for the non-finite counter"
    assert r["shared"] <= HOPPER_SMEM_BYTES, f"{label}: {r['shared']} bytes of shared memory"
    assert "STACK:0" in r["usage"] or not r["usage"], f"{label}: register spills ({r['usage']})"


if __name__ == "__main__":
    if sys.argv[1:2] == ["compile-sm90"]:
        print(json.dumps(_compile_sm90_all()))
    else:
        raise SystemExit("usage: python tests/test_fp8_quant.py compile-sm90")
