"""The FP8 backward's standalone quantization passes in Gluon (explicit layouts): the dual 1x128 + transposed 128x1
pass of dgate_up and the gathered transposed 128x1 pass of x / dout, bitwise the Triton kernels of ``fp8_quant_bwd.py``
on finite input (that module keeps the launchers, the checks, the CPU interpreter path and the Triton kernels, which
run where these cannot: off sm_90, non-bf16 input, ``TITAN_MEGAMOE_FP8_QUANT_GLUON=0``).

Why (docs/NOTES.md, session 23): Nsight Compute on an H100 (30B) shows the Triton kernels bound by instruction issue
and latency, not by DRAM: the dual pass issues ~51 lane-instructions per element at 0.48 instructions per scheduler
cycle and 25 % occupancy (128 registers), DRAM at 37 % of peak; the gathered pass 0.69 per cycle, DRAM 25 %. The
causes are layouts Triton picks and a kernel cannot change there:

* the loads' layout gives each thread 16 consecutive columns of a row, so every thread computes 16 column scales (an
  IEEE division each, plus the reciprocal) and the scale work is as large as the element work;
* each element's x / scale is a ``div.rn`` (~10 instructions behind a branch); the reciprocal form
  (``fp8_quant._div_by_group``: one FMUL, two FFMA, the same bits) raised Triton's registers (128 -> 157, 68 -> 120)
  and lost occupancy;
* the transposed store goes through a layout conversion in shared memory.

Here the column (128x1) work uses a layout in which a thread holds ``128 / NW`` rows of 1 column (``BC / 32``
columns in general): the loads read 2 bytes per row per thread (a warp reads 64 contiguous bytes of a row), each
thread computes its column's scale once, and the same registers re-read with rows fastest (a register permutation,
``convert_layout(..., assert_trivial=True)``) store the column's rows as one 16-byte vector of the transposed output.
The row (1x128) work uses 16 columns x few rows per thread. The quotient is the reciprocal form; the sign of a zero
quotient is x's by one LOP3 bit-select; the e4m3 cast saturates (``cvt.rn.satfinite``) where the Triton kernels clamp
first (the same bits for any finite quotient; a NaN quotient, only in a group with a non-finite scale, which both
count as an error, stays NaN). amax is taken on the bf16 bits, so tiles stay bf16 in registers. Few values per thread
keep several programs per SM, which hides the loads' latency: the dual pass takes its 128 x 128 tile as four 32-column
slabs and then two 64-row halves (80 registers, three programs per SM; the second read hits L2), the gathered pass
128 rows x 32 columns at 4 warps (79 registers, six per SM). Measured on one H100 (session 23, 30B): dual 0.733 ->
0.557 ms, gathered 0.403 -> 0.351; first layouts with a whole tile per program at one program per SM ran slower than
the Triton kernels.

Math per group exactly as ``ops/fp8_reference.py`` (amax over |x| with NaN kept, floored at EPS, scale = amax / 448
rounded as IEEE division, x / scale rounded to nearest, saturated at +-448, cast to e4m3 round to nearest even).
The persistent, load-pipelined variants at the end of this file (``FP8_QUANT_PIPE``, the default) keep whole tiles
in flight by cp.async and run the same quantization functions on shared memory.
GPU only (Gluon has no interpreter path): CPU tests build the kernels for sm_90a; GPU tests compare them with the
Triton kernels bitwise (``tests/test_gl_quant_bwd.py``).
"""

from __future__ import annotations

from titan_megamoe.kernels.jit import env_choice
from titan_megamoe.kernels.ws_gemm import HAVE_GLUON

if HAVE_GLUON:
    import triton.language as tl
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import async_copy as gl_async_copy

__all__ = ["DUAL_CONFIG", "GATHER_CONFIG", "PIPE_CONFIG", "launch_options", "pipe_launch_options"]

#: launch configuration of each kernel: warps (NW), ptxas's register cap (None: none), the dual pass's column slabs
#: (SLAB) and the gathered pass's columns per program (BC); a program is 128 rows. scripts/bench_quant_bwd.py sweeps
#: them (docs/NOTES.md, session 23).
DUAL_CONFIG = dict(NW=8, maxnreg=80, SLAB=32)  # 80 registers, no spills: three programs per SM
GATHER_CONFIG = dict(NW=4, maxnreg=None, BC=32)  # 79 registers: six programs per SM


#: the persistent, load-pipelined variants (``_gl_quant_dual_pipe_kernel``, ``_gl_quant_gather_pipe_kernel``): warps,
#: 128 x 128 bf16 tiles in flight per program (STAGES, 32 KiB each), programs per SM, the column slab of the 128x1 work.
#: H100, 30B (session 25): dual 0.557 -> 0.511 ms, gathered 0.351 -> 0.344; 64-column slabs and 16 warps slower
#: (bench_quant_bwd_1xh100_s25{b,c}_20261206.json); Nsight Compute: bound by shared-load latency in the column work.
#: COLS: the column work's layout: "cta", a warp reads 32 columns of one row and the 128-row amax crosses the warps
#: (through shared memory, a CTA barrier per slab); "warp", a warp owns 8 whole columns (16 rows x 2 columns a thread,
#: 8 threads down the rows), so the amax takes three shuffles, each shared load reads 4 bytes a thread and the
#: transposed stores fill 128-byte lines; the tile buffers are then swizzled (16-byte chunks XOR (row // 16) % 8) so
#: the 8 rows one load touches fall in different banks. SLAB is ignored there (8 NW columns per slab). None:
#: :data:`QUANT_COLS` decides.
PIPE_CONFIG = dict(NW=8, STAGES=3, PER_SM=2, SLAB=32, COLS=None)

#: ``TITAN_MEGAMOE_FP8_QUANT_COLS`` (default ``warp``): PIPE_CONFIG's COLS where it is None. Read at import; a
#: same-process switch. H100 (session 26, bitwise the same): 30B dual 0.511 -> 0.377 ms, gathered 0.343 ->
#: 0.229, 235B dual 1.148 -> 0.807, gathered 0.675 -> 0.451 (bench_quant_bwd_1xh100_s26a_20261206.json); layer, same
#: process, 30B fp8 fwd+bwd 7.958 -> 7.662 ms (layer_1xh100_ep1_30b_s26b_20261206.json).
QUANT_COLS = env_choice("TITAN_MEGAMOE_FP8_QUANT_COLS", "warp", ("warp", "cta"))


def pipe_launch_options() -> dict:
    """Keyword arguments of a launch of a pipelined kernel: the constexprs NW, STAGES, SLAB, WARP_COLS and
    num_warps.

    Raises:
        ValueError: PIPE_CONFIG["COLS"] not "cta" or "warp"."""
    cols = PIPE_CONFIG.get("COLS") or QUANT_COLS
    if cols not in ("cta", "warp"):
        raise ValueError(f"gl_quant_bwd.PIPE_CONFIG['COLS']={cols!r}: choose 'cta' or 'warp'")
    return dict(NW=PIPE_CONFIG["NW"], STAGES=PIPE_CONFIG["STAGES"], SLAB=PIPE_CONFIG["SLAB"],
                WARP_COLS=cols == "warp", num_warps=PIPE_CONFIG["NW"])


def launch_options(kind: str) -> dict:
    """Keyword arguments of a launch of the "dual" or "gather" kernel: the constexprs NW (and BC) and the launch
    options num_warps (and maxnreg where capped)."""
    cfg = DUAL_CONFIG if kind == "dual" else GATHER_CONFIG
    opts = {k: v for k, v in cfg.items() if k != "maxnreg"}
    opts["num_warps"] = cfg["NW"]
    if cfg.get("maxnreg") is not None:
        opts["maxnreg"] = cfg["maxnreg"]
    return opts


if HAVE_GLUON:

    @gluon.jit
    def _e4m3(x, neg_scale, rcp):
        """e4m3(x / scale) saturated at +-448, the quotient rounded as ``div_rn``: one FMUL and two FFMA from the
        group's reciprocal rcp = RN(1 / scale) (Markstein; ``fp8_quant._div_by_group``); neg_scale = -scale and rcp
        broadcast to x (the remainder x - q scale as fma(q, -scale, x): Triton's unary minus is 0 - q, one more FFMA per
        element). The cast saturates finite values at +-448 as ``fp8_quant._e4m3_of``'s clamp does; a NaN quotient
        (only in a group with a non-finite scale, which the kernels count) stays NaN where the clamp made it -448."""
        q = x * rcp
        q = gl.fma(gl.fma(q, neg_scale, x), rcp, q)
        # |q| with x's sign (-0.0 / s is -0.0) in one LOP3 (bit select, LUT 0xE4 = (a & c) | (b & ~c)); written as
        # and / or the compiler makes it four instructions (sign bit to a predicate, then FSEL)
        q = gl.inline_asm_elementwise("lop3.b32 $0, $1, $2, 2147483647, 0xE4;", "=r,r,r",
                                      [q.to(gl.int32, bitcast=True), x.to(gl.int32, bitcast=True)], dtype=gl.int32,
                                      is_pure=True, pack=1).to(gl.float32, bitcast=True)
        return q.to(gl.float8e4nv)  # cvt.rn.satfinite

    @gluon.jit
    def _amax_bits(xb, AXIS: gl.constexpr):
        """max |x| along AXIS of a bf16 tile, as the int32 bits of the fp32 value: taken on the bf16 bits (|x| as int16
        orders as the float, NaN above +inf), then widened by a 16-bit shift (bf16 -> fp32 is exact), so the tile
        stays bf16 in registers (half the registers of fp32)."""
        m = gl.max(xb.to(gl.int16, bitcast=True) & 32767, axis=AXIS)
        return m.to(gl.int32) << 16

    @gluon.jit
    def _scale_rcp(bits, EPS: gl.constexpr):
        """(scale, 1 / scale) of groups whose amax has the int32 bits ``bits`` (|x| bits: the integer max is the float
        max, NaN above +inf): scale = max(amax, EPS) / 448 as IEEE division, NaN kept."""
        amax = gl.maximum(bits.to(gl.float32, bitcast=True), EPS, propagate_nan=tl.PropagateNan.ALL)
        scale = gl.div_rn(amax, gl.full(amax.shape, 448.0, gl.float32, layout=amax.type.layout))
        rcp = gl.div_rn(gl.full(amax.shape, 1.0, gl.float32, layout=amax.type.layout), scale)
        return scale, rcp

    @gluon.jit
    def _col_quant_store(x, rows, cols, row_ok, col_ok, b, yT_ptr, sT_ptr, LD, C: gl.constexpr, EPS: gl.constexpr,
                         NW: gl.constexpr, BC: gl.constexpr, ROWS_IN_THREAD: gl.constexpr = False):
        """128x1 groups of one (128, BC) bf16 tile: e4m3 values to yT[col, row] (16-byte stores along rows), scales
        to sT[b, col]; returns the count of non-finite scales among the valid columns. The tile comes in the column
        layout (a thread holds 128 / NW rows of BC / 32 columns, a warp one row), or with ROWS_IN_THREAD in a layout
        whose threads already hold contiguous rows of their columns (``_pipe_tile``'s warp-owned columns), stored
        as it is."""
        scale, rcp = _scale_rcp(_amax_bits(x, 0), EPS)
        q = _e4m3(x.to(gl.float32), gl.expand_dims(-scale, 0), gl.expand_dims(rcp, 0))
        if ROWS_IN_THREAD:
            qT, rT, cT, okT, cokT = q, rows, cols, row_ok, col_ok
        else:
            # the same registers with rows fastest: each thread's 128 / NW rows of a column are one contiguous vector
            LT: gl.constexpr = gl.BlockedLayout([128 // NW, BC // 32], [1, 32], [NW, 1], [0, 1])
            qT = gl.convert_layout(q, LT, assert_trivial=True)
            rT = gl.convert_layout(rows, gl.SliceLayout(1, LT), assert_trivial=True)
            cT = gl.convert_layout(cols, gl.SliceLayout(0, LT), assert_trivial=True)
            okT = gl.convert_layout(row_ok, gl.SliceLayout(1, LT), assert_trivial=True)
            cokT = gl.convert_layout(col_ok, gl.SliceLayout(0, LT), assert_trivial=True)
        # int64: col * LD passes 2^31 at full shapes
        gl.store(yT_ptr + gl.expand_dims(cT.to(gl.int64), 0) * LD + gl.expand_dims(rT, 1), qT,
                 mask=gl.expand_dims(okT, 1) & gl.expand_dims(cokT, 0))
        gl.store(sT_ptr + b.to(gl.int64) * C + cols, scale, mask=col_ok)
        return gl.sum((col_ok & ~(scale < float("inf"))).to(gl.int32), axis=0)  # NaN < inf is False

    @gluon.jit
    def _row_quant_store(xr, rr, rr_ok, cr, g, y_ptr, s_ptr, C: gl.constexpr, CHECK: gl.constexpr,
                         EPS: gl.constexpr):
        """1x128 groups of a (rows rr, columns cr) bf16 half tile in the row layout (column block g): e4m3 values to
        y[rr, cr], scales to s[rr, g]; returns the count of non-finite scales among the rows < M (0 without
        CHECK)."""
        scale, rcp = _scale_rcp(_amax_bits(xr, 1), EPS)
        q = _e4m3(xr.to(gl.float32), gl.expand_dims(-scale, 1), gl.expand_dims(rcp, 1))
        offs = gl.expand_dims(rr.to(gl.int64), 1) * C + gl.expand_dims(cr, 0)
        gl.store(y_ptr + offs, q, mask=gl.expand_dims(rr_ok, 1))
        return _row_scales_store(scale, rr, rr_ok, g, s_ptr, C, CHECK)

    @gluon.jit
    def _row_scales_store(scale, rr, rr_ok, g, s_ptr, C: gl.constexpr, CHECK: gl.constexpr):
        """The 1x128 scales of rows rr (column block g) to s[rr, g]; returns the count of non-finite ones among
        the rows < M (0 without CHECK)."""
        gl.store(s_ptr + rr.to(gl.int64) * (C // 128) + g, scale, mask=rr_ok)
        n_bad = 0
        if CHECK:
            n_bad = gl.sum((rr_ok & ~(scale < float("inf"))).to(gl.int32), axis=0)
        return n_bad

    @gluon.jit
    def _row_quant_halves(buf, b, g, M, y_ptr, s_ptr, C: gl.constexpr, CHECK: gl.constexpr, EPS: gl.constexpr,
                          NW: gl.constexpr):
        """``_row_quant_store`` of a whole 128 x 128 tile in shared memory, read as two 64-column halves (a row
        slice of the swizzled buffer would split its swizzle pattern; a whole-tile load holds 64 values a thread):
        the rows' amax from both halves, then each half quantized and stored. The same bits."""
        LH: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NW, 1], [1, 0])
        rr = b * 128 + gl.arange(0, 128, layout=gl.SliceLayout(1, LH))
        rr_ok = rr < M
        bits = gl.maximum(_amax_bits(buf.slice(0, 64, dim=1).load(LH), 1),
                          _amax_bits(buf.slice(64, 64, dim=1).load(LH), 1))
        scale, rcp = _scale_rcp(bits, EPS)
        for c in gl.static_range(2):
            cr = g * 128 + c * 64 + gl.arange(0, 64, layout=gl.SliceLayout(0, LH))
            q = _e4m3(buf.slice(c * 64, 64, dim=1).load(LH).to(gl.float32), gl.expand_dims(-scale, 1),
                      gl.expand_dims(rcp, 1))
            gl.store(y_ptr + gl.expand_dims(rr.to(gl.int64), 1) * C + gl.expand_dims(cr, 0), q,
                     mask=gl.expand_dims(rr_ok, 1))
        return _row_scales_store(scale, rr, rr_ok, g, s_ptr, C, CHECK)

    @gluon.jit
    def _dead_block_scales(sT_ptr, b, col0, C: gl.constexpr, EPS: gl.constexpr, NW: gl.constexpr, BC: gl.constexpr):
        """A 128-row block past end_row: its finite column scales only (as the Triton kernels)."""
        L1: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
        cols = col0 + gl.arange(0, BC, layout=L1)
        zero = gl.full((BC,), 0.0, gl.float32, layout=L1)
        scale = gl.div_rn(gl.maximum(zero, EPS), gl.full((BC,), 448.0, gl.float32, layout=L1))
        gl.store(sT_ptr + b.to(gl.int64) * C + cols, scale, mask=cols < C)

    @gluon.jit
    def _dual_tile(x_ptr, valid_ptr, y_ptr, s_ptr, yT_ptr, sT_ptr, count_ptr, M, LD, b, g, C: gl.constexpr,
                         CHECK: gl.constexpr, EPS: gl.constexpr, NW: gl.constexpr, SLAB: gl.constexpr):
        """One 128 x 128 tile, few values live per thread (three programs per SM): the column (128x1) pass over
        SLAB-column slabs, then the row (1x128) pass over two 64-row halves (the tile again, from L2)."""
        LC: gl.constexpr = gl.BlockedLayout([128 // NW, SLAB // 32], [1, 32], [NW, 1], [1, 0])
        rows = b * 128 + gl.arange(0, 128, layout=gl.SliceLayout(1, LC))
        row_ok = rows < M
        live = row_ok & (gl.load(valid_ptr + rows, mask=row_ok, other=0) != 0)
        roff = gl.expand_dims(rows.to(gl.int64), 1) * C
        n_bad = 0
        for k in gl.static_range(128 // SLAB):
            cols = g * 128 + k * SLAB + gl.arange(0, SLAB, layout=gl.SliceLayout(0, LC))
            x = gl.load(x_ptr + roff + gl.expand_dims(cols, 0), mask=gl.expand_dims(live, 1), other=0.0)
            n_bad += _col_quant_store(x, rows, cols, row_ok, cols < C, b, yT_ptr, sT_ptr, LD, C, EPS, NW, SLAB)
        LR: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [NW, 1], [1, 0])
        cr = g * 128 + gl.arange(0, 128, layout=gl.SliceLayout(0, LR))
        for h in gl.static_range(2):
            rr = b * 128 + h * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, LR))
            rr_ok = rr < M
            live_r = rr_ok & (gl.load(valid_ptr + rr, mask=rr_ok, other=0) != 0)
            offs = gl.expand_dims(rr.to(gl.int64), 1) * C + gl.expand_dims(cr, 0)
            xr = gl.load(x_ptr + offs, mask=gl.expand_dims(live_r, 1), other=0.0)
            n_bad += _row_quant_store(xr, rr, rr_ok, cr, g, y_ptr, s_ptr, C, CHECK, EPS)
        if CHECK:
            gl.atomic_add(count_ptr, n_bad, mask=n_bad > 0)

    @gluon.jit
    def _gl_quant_dual_kernel(x_ptr, valid_ptr, y_ptr, s_ptr, yT_ptr, sT_ptr, count_ptr, end_ptr, M, LD,
                              C: gl.constexpr, CHECK: gl.constexpr, EPS: gl.constexpr, HAS_END: gl.constexpr,
                              NW: gl.constexpr, SLAB: gl.constexpr):
        """``fp8_quant_bwd._quant_dual_kernel`` (same arguments, grid (cdiv(M, 128), C // 128), same outputs
        bitwise): program (b, g) owns rows [128 b, 128 b + 128) x columns [128 g, 128 g + 128)."""
        b = gl.program_id(0)
        g = gl.program_id(1)
        if HAS_END:
            if b * 128 >= gl.load(end_ptr):
                _dead_block_scales(sT_ptr, b, g * 128, C, EPS, NW, 128)
            else:
                _dual_tile(x_ptr, valid_ptr, y_ptr, s_ptr, yT_ptr, sT_ptr, count_ptr, M, LD, b, g, C, CHECK, EPS, NW,
                           SLAB)
        else:
            _dual_tile(x_ptr, valid_ptr, y_ptr, s_ptr, yT_ptr, sT_ptr, count_ptr, M, LD, b, g, C, CHECK, EPS, NW, SLAB)

    @gluon.jit
    def _gather_tile(x_ptr, row_index_ptr, yT_ptr, scale_ptr, count_ptr, M, LD, b, j, C: gl.constexpr,
                     TOP_K: gl.constexpr, CHECK: gl.constexpr, EPS: gl.constexpr, NW: gl.constexpr, BC: gl.constexpr):
        LC: gl.constexpr = gl.BlockedLayout([128 // NW, BC // 32], [1, 32], [NW, 1], [1, 0])
        rows = b * 128 + gl.arange(0, 128, layout=gl.SliceLayout(1, LC))
        cols = j * BC + gl.arange(0, BC, layout=gl.SliceLayout(0, LC))
        row_ok = rows < M
        col_ok = cols < C
        idx = gl.load(row_index_ptr + rows, mask=row_ok, other=-1)
        live = idx >= 0
        src = gl.where(live, idx // TOP_K, 0).to(gl.int64)  # int64: src * C can pass 2^31
        x = gl.load(x_ptr + gl.expand_dims(src, 1) * C + gl.expand_dims(cols, 0),
                    mask=gl.expand_dims(live, 1) & gl.expand_dims(col_ok, 0), other=0.0)
        n_bad = _col_quant_store(x, rows, cols, row_ok, col_ok, b, yT_ptr, scale_ptr, LD, C, EPS, NW, BC)
        if CHECK:
            gl.atomic_add(count_ptr, n_bad, mask=n_bad > 0)

    @gluon.jit
    def _gl_quant_gather_128x1_t_kernel(x_ptr, row_index_ptr, yT_ptr, scale_ptr, count_ptr, end_ptr, M, LD,
                                        C: gl.constexpr, TOP_K: gl.constexpr, CHECK: gl.constexpr,
                                        EPS: gl.constexpr, HAS_END: gl.constexpr, NW: gl.constexpr,
                                        BC: gl.constexpr):
        """``fp8_quant_bwd._quant_gather_128x1_t_kernel`` with BC columns per program (grid (cdiv(M, 128),
        cdiv(C, BC)), same outputs bitwise): row r of the tile is x[row_index[r] // TOP_K], zero where
        row_index[r] < 0."""
        b = gl.program_id(0)
        j = gl.program_id(1)
        if HAS_END:
            if b * 128 >= gl.load(end_ptr):
                _dead_block_scales(scale_ptr, b, j * BC, C, EPS, NW, BC)
            else:
                _gather_tile(x_ptr, row_index_ptr, yT_ptr, scale_ptr, count_ptr, M, LD, b, j, C, TOP_K, CHECK, EPS, NW,
                             BC)
        else:
            _gather_tile(x_ptr, row_index_ptr, yT_ptr, scale_ptr, count_ptr, M, LD, b, j, C, TOP_K, CHECK, EPS, NW, BC)

    # ---------------------------------------------------------------------------------------------------------------
    # Persistent, load-pipelined variants (session 25). Why: the kernels above move one 128-row tile per short-lived
    # program and keep little in flight (a program loads a 32-column slab, quantizes it, stores, then loads the next;
    # the dual pass re-reads its tile from L2 for the row work): 1.5 TB/s of useful bytes for the dual pass, 2.5 for
    # the gathered one (session 23, H100). Here each program walks tiles t = pid, pid + programs, ... and keeps
    # STAGES whole 128 x 128 bf16 tiles in flight by cp.async (16-byte chunks; masked rows are zero-filled, as the
    # loads above read them), so the loads of the next tiles run under the quantization of this one, and the dual
    # pass's row work reads shared memory. The quantization itself is the functions above: the same bits.
    # ---------------------------------------------------------------------------------------------------------------

    @gluon.jit
    def _pipe_rows(idx_ptr, end, M, i, n_i, pid, nprog, Mb, TOP_K: gl.constexpr, NW: gl.constexpr,
                   GATHER: gl.constexpr, HAS_END: gl.constexpr):
        """(source row, live) of the 128 rows of this program's i-th tile in the copy layout: tiles t = pid + i
        nprog as (rows b, columns g), b fastest, so concurrent tiles share g and a gathered source stays in L2.
        Nothing is live past the last tile or in a dead block (past end)."""
        LD: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [NW, 1], [1, 0])  # 16-byte chunks, 2 rows per warp
        b = (pid + i * nprog) % Mb
        rows = b * 128 + gl.arange(0, 128, layout=gl.SliceLayout(1, LD))
        ok = (rows < M) & (i < n_i)
        if HAS_END:
            ok = ok & (b * 128 < end)
        if GATHER:
            idx = gl.load(idx_ptr + rows, mask=ok, other=-1)
            ok = ok & (idx >= 0)
            src = gl.where(ok, idx // TOP_K, 0)
        else:
            ok = ok & (gl.load(idx_ptr + rows, mask=ok, other=0) != 0)
            src = rows
        return src, ok

    @gluon.jit
    def _pipe_issue(bufs, x_ptr, src, ok, i, pid, nprog, Mb, C: gl.constexpr, STAGES: gl.constexpr,
                    NW: gl.constexpr):
        """cp.async of the i-th tile's rows ``src`` (zero-filled where not ``ok``) into buffer i % STAGES, one
        commit group (an empty one past the last tile)."""
        LD: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [NW, 1], [1, 0])
        g = (pid + i * nprog) // Mb
        cols = g * 128 + gl.arange(0, 128, layout=gl.SliceLayout(0, LD))
        ptrs = x_ptr + gl.expand_dims(src.to(gl.int64) * C, 1) + gl.expand_dims(cols, 0)  # int64: src * C > 2^31
        gl_async_copy.async_copy_global_to_shared(bufs.index(i % STAGES), ptrs, mask=gl.expand_dims(ok, 1))
        gl_async_copy.commit_group()

    @gluon.jit
    def _pipe_tile(buf, y_ptr, s_ptr, yT_ptr, sT_ptr, count_ptr, M, LD, b, g, C: gl.constexpr, CHECK: gl.constexpr,
                   EPS: gl.constexpr, NW: gl.constexpr, SLAB: gl.constexpr, DUAL: gl.constexpr,
                   WARP_COLS: gl.constexpr):
        """Quantize a live 128 x 128 tile from shared memory (rows that are not live hold zeros): its 128x1 groups
        (transposed), with DUAL also its 1x128 groups, as ``_dual_tile`` / ``_gather_tile``. WARP_COLS: the column
        work in warp-owned columns (``PIPE_CONFIG["COLS"]``)."""
        n_bad = 0
        if WARP_COLS:
            LW: gl.constexpr = gl.BlockedLayout([16, 2], [8, 4], [1, NW], [0, 1])
            WS: gl.constexpr = 8 * NW  # columns per slab
            rows_w = b * 128 + gl.arange(0, 128, layout=gl.SliceLayout(1, LW))
            for k in gl.static_range(128 // WS):
                cols = g * 128 + k * WS + gl.arange(0, WS, layout=gl.SliceLayout(0, LW))
                x = buf.slice(k * WS, WS, dim=1).load(LW)
                n_bad += _col_quant_store(x, rows_w, cols, rows_w < M, cols < C, b, yT_ptr, sT_ptr, LD, C, EPS, NW, WS,
                                          True)
        else:
            LC: gl.constexpr = gl.BlockedLayout([128 // NW, SLAB // 32], [1, 32], [NW, 1], [1, 0])
            rows = b * 128 + gl.arange(0, 128, layout=gl.SliceLayout(1, LC))
            row_ok = rows < M
            for k in gl.static_range(128 // SLAB):
                cols = g * 128 + k * SLAB + gl.arange(0, SLAB, layout=gl.SliceLayout(0, LC))
                x = buf.slice(k * SLAB, SLAB, dim=1).load(LC)
                n_bad += _col_quant_store(x, rows, cols, row_ok, cols < C, b, yT_ptr, sT_ptr, LD, C, EPS, NW, SLAB)
        if DUAL:
            LR: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [NW, 1], [1, 0])
            cr = g * 128 + gl.arange(0, 128, layout=gl.SliceLayout(0, LR))
            if WARP_COLS:  # a row slice would split the swizzle pattern (128 rows): column halves, two passes
                n_bad += _row_quant_halves(buf, b, g, M, y_ptr, s_ptr, C, CHECK, EPS, NW)
            else:
                for h in gl.static_range(2):
                    rr = b * 128 + h * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, LR))
                    rr_ok = rr < M
                    xr = buf.slice(h * 64, 64, dim=0).load(LR)
                    n_bad += _row_quant_store(xr, rr, rr_ok, cr, g, y_ptr, s_ptr, C, CHECK, EPS)
        if CHECK:
            gl.atomic_add(count_ptr, n_bad, mask=n_bad > 0)

    @gluon.jit
    def _pipe_loop(x_ptr, idx_ptr, y_ptr, s_ptr, yT_ptr, sT_ptr, count_ptr, end_ptr, M, LD, C: gl.constexpr,
                   TOP_K: gl.constexpr, CHECK: gl.constexpr, EPS: gl.constexpr, HAS_END: gl.constexpr,
                   NW: gl.constexpr, STAGES: gl.constexpr, SLAB: gl.constexpr, GATHER: gl.constexpr,
                   WARP_COLS: gl.constexpr):
        pid = gl.program_id(0)
        nprog = gl.num_programs(0)
        Mb = gl.cdiv(M, 128)
        n_i = gl.cdiv(Mb * (C // 128) - pid, nprog)
        if HAS_END:
            end = gl.load(end_ptr)
        else:
            end = M
        # WARP_COLS: 16-byte chunks XOR (row // 16) % 8, so a column load's 8 rows (16 apart) hit 8 bank groups
        layout: gl.constexpr = gl.SwizzledSharedLayout(8 if WARP_COLS else 1, 16 if WARP_COLS else 1,
                                                       8 if WARP_COLS else 1, order=[1, 0])
        bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, 128, 128], layout)
        for i in gl.static_range(STAGES - 1):
            src, ok = _pipe_rows(idx_ptr, end, M, i, n_i, pid, nprog, Mb, TOP_K, NW, GATHER, HAS_END)
            _pipe_issue(bufs, x_ptr, src, ok, i, pid, nprog, Mb, C, STAGES, NW)
        # the row indices of the next issue, loaded one tile ahead: their latency runs under a tile's quantization
        src, ok = _pipe_rows(idx_ptr, end, M, STAGES - 1, n_i, pid, nprog, Mb, TOP_K, NW, GATHER, HAS_END)
        for i in range(n_i):
            gl.thread_barrier()  # every warp is done with tile i - 1's buffer, which this issue refills
            _pipe_issue(bufs, x_ptr, src, ok, i + STAGES - 1, pid, nprog, Mb, C, STAGES, NW)
            src, ok = _pipe_rows(idx_ptr, end, M, i + STAGES, n_i, pid, nprog, Mb, TOP_K, NW, GATHER, HAS_END)
            gl_async_copy.wait_group(STAGES - 1)  # this thread's copies of tile i have landed
            gl.thread_barrier()  # and every other thread's
            t = pid + i * nprog
            b = t % Mb
            g = t // Mb
            if HAS_END:
                if b * 128 >= end:
                    _dead_block_scales(sT_ptr, b, g * 128, C, EPS, NW, 128)
                else:
                    _pipe_tile(bufs.index(i % STAGES), y_ptr, s_ptr, yT_ptr, sT_ptr, count_ptr, M, LD, b, g, C,
                               CHECK, EPS, NW, SLAB, not GATHER, WARP_COLS)
            else:
                _pipe_tile(bufs.index(i % STAGES), y_ptr, s_ptr, yT_ptr, sT_ptr, count_ptr, M, LD, b, g, C, CHECK,
                           EPS, NW, SLAB, not GATHER, WARP_COLS)
        gl_async_copy.wait_group(0)

    @gluon.jit
    def _gl_quant_dual_pipe_kernel(x_ptr, valid_ptr, y_ptr, s_ptr, yT_ptr, sT_ptr, count_ptr, end_ptr, M, LD,
                                   C: gl.constexpr, CHECK: gl.constexpr, EPS: gl.constexpr, HAS_END: gl.constexpr,
                                   NW: gl.constexpr, STAGES: gl.constexpr, SLAB: gl.constexpr,
                                   WARP_COLS: gl.constexpr = False):
        """``_gl_quant_dual_kernel``'s arguments and outputs (bitwise), persistent: grid (programs,), each program
        the tiles pid, pid + programs, ... of the (cdiv(M, 128), C // 128) tile grid, STAGES tiles in flight."""
        _pipe_loop(x_ptr, valid_ptr, y_ptr, s_ptr, yT_ptr, sT_ptr, count_ptr, end_ptr, M, LD, C, 1, CHECK, EPS,
                   HAS_END, NW, STAGES, SLAB, False, WARP_COLS)

    @gluon.jit
    def _gl_quant_gather_pipe_kernel(x_ptr, row_index_ptr, yT_ptr, scale_ptr, count_ptr, end_ptr, M, LD,
                                     C: gl.constexpr, TOP_K: gl.constexpr, CHECK: gl.constexpr, EPS: gl.constexpr,
                                     HAS_END: gl.constexpr, NW: gl.constexpr, STAGES: gl.constexpr,
                                     SLAB: gl.constexpr, WARP_COLS: gl.constexpr = False):
        """``_gl_quant_gather_128x1_t_kernel``'s arguments and outputs (bitwise) for C a multiple of 128, persistent
        as ``_gl_quant_dual_pipe_kernel``: row r of a tile is x[row_index[r] // TOP_K], zero where row_index[r] <
        0."""
        _pipe_loop(x_ptr, row_index_ptr, scale_ptr, scale_ptr, yT_ptr, scale_ptr, count_ptr, end_ptr, M, LD, C,
                   TOP_K, CHECK, EPS, HAS_END, NW, STAGES, SLAB, True, WARP_COLS)
