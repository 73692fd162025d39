"""Weight gradients of the fused SwiGLU MoE experts: K-grouped GEMMs over each expert's rows.

See ``grouped_gemm_bwd.py`` for the shape legend, the data flow of the whole backward and the
measurements; this file holds step 3 (``wgrad_w2``, ``wgrad_w13``). Deterministic: each output element
is written once by one program that reduces over the expert's rows in row order.

Three implementations, picked per call by :func:`wgrad_impl`:

* ``"triton"``: our kernels below, gathering token rows inside the K loop (no extra buffer).
* ``"grouped_mm"`` (the sm_90 default until session 13; still where "gluon" cannot take the shape): one
  pass gathers the token-side operand (x, or dout) into the layout's row order with zero padding rows
  (:func:`gather_rows`), then ``torch._grouped_mm`` (PyTorch's CUTLASS grouped GEMM, jagged K = each expert's padded segment of the layout). Why: at the 30B shape
  stock TorchTitan's grouped GEMMs run ~615 TF/s on the H200 (``profile_30b_tt-compile_20261130.json``:
  0.67 ms per 0.41 TFLOP call) while our K-grouped kernels reach 370-410 TF/s: each expert's K loop is
  short (~1024 rows) and nothing overlaps its pipeline fill and epilogue; CUTLASS's warp-specialized
  persistent kernel does. The extra gather pass costs one read and one write of N_cap x D bf16.
  Zero-row experts: empty groups give exact zeros on sm_90 (pytorch/pytorch#172439 reports it wrong
  on sm_100 only, hence the capability test). Not used for fp32 outputs or caller buffers.
* ``"gluon"`` (default on sm_90): ``ws_wgrad``'s warp-specialized K-grouped GEMM with the row gather in its
  producer (no gathered copy); where it cannot take the shape, "grouped_mm".
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from titan_megamoe.kernels.jit import cdiv, env_choice, grouped_tile, next_pow2
from titan_megamoe.kernels.jit import interp_int as _interp_int
from titan_megamoe.kernels.launch import launch
from titan_megamoe.kernels._bwd_common import (
    _ACT,
    _WGRAD_DTYPES,
    _check,
    _check_layout,
    _desc,
    _launch_opts,
    _tma_ok,
    default_bwd_config,
)
from titan_megamoe.kernels.configs import GemmConfig
from titan_megamoe.kernels.routing import RoutingLayout
from titan_megamoe.kernels.ws_wgrad import SPLIT_CONFIG, WGRAD_CONFIG, ws_wgrad_supported, ws_wgrad_w2, ws_wgrad_w13

__all__ = ["wgrad_w2", "wgrad_w13", "wgrad_impl", "gather_rows", "WGRAD_IMPLS"]

#: Implementations of the wgrads (module docstring). ``TITAN_MEGAMOE_WGRAD`` = one of them forces it
#: (A/B benchmarks, tests); "auto" (default) picks "gluon" on sm_90 CUDA devices, else "triton".
WGRAD_IMPLS = ("auto", "triton", "grouped_mm", "gluon")
#: ``TITAN_MEGAMOE_WS_WGRAD_SPLIT`` (read at import; a same-process switch): "1" runs the Gluon wgrads at
#: ``ws_wgrad.SPLIT_CONFIG`` (each consumer's accumulator as two column halves, half the epilogue's shared memory,
#: a 4-stage ring), "0" at ``WGRAD_CONFIG`` (3 stages); "auto" (default) takes the split config for model dims
#: >= ``WS_WGRAD_SPLIT_MIN_DIM``. Why: Nsight on one H100 found the 3-stage Gluon GEMM1 dgrad's tensor pipe busy
#: 66-71 % against 88-90 % for the 4-stage GEMM1 forward (``ncu_gemm_l2_1xh100_s27a_20261206.txt``). Measured on
#: one H100 (docs/NOTES.md, sessions 27-28): at 235B, dw1 | dw3 5.83 -> 5.44 ms interleaved
#: (``ab_kernels_1xh100_s27c_20261206.json``), 5.65-5.79 -> 5.07-5.14 under Nsight with the tensor pipe 65-67 ->
#: 77 % busy and DRAM reads 5.5-6.2 -> 2.3-2.9 GB (``ncu_wgrad_1xh100_s28a_20261206.txt``), layer fwd+bwd device
#: time 26.26 -> 25.70 ms, same process (``layer_1xh100_ep1_235b_s28a_20261206.json``); at 30B 2-3 % slower.
WS_WGRAD_SPLIT = env_choice("TITAN_MEGAMOE_WS_WGRAD_SPLIT", "auto", ("auto", "1", "0"))
#: Model dim from which "auto" splits: measured faster at D = 4096 (235B), slower at 2048 (30B).
WS_WGRAD_SPLIT_MIN_DIM = 4096


def _ws_wgrad_config(D: int):
    """The Gluon wgrads' config for model dim D under ``WS_WGRAD_SPLIT``."""
    split = WS_WGRAD_SPLIT == "1" or (WS_WGRAD_SPLIT == "auto" and D >= WS_WGRAD_SPLIT_MIN_DIM)
    return SPLIT_CONFIG if split else WGRAD_CONFIG


def wgrad_impl(device: torch.device, out_dtype: torch.dtype | None = None, *, custom: bool = False,
               impl: str | None = None) -> str:
    """"triton" or "grouped_mm" for a wgrad on ``device``.

    Args:
        device: where the operands are.
        out_dtype: requested gradient dtype (None: bf16); fp32 outputs stay on the Triton kernels.
        custom: a caller config or output buffer was given (Triton kernels only).
        impl: None (read ``TITAN_MEGAMOE_WGRAD``, default "auto") or one of ``WGRAD_IMPLS``.

    Raises:
        ValueError: an unknown ``impl`` / ``TITAN_MEGAMOE_WGRAD`` value.
    """
    impl = impl or os.environ.get("TITAN_MEGAMOE_WGRAD", "auto")
    if impl not in WGRAD_IMPLS:
        raise ValueError(f"wgrad implementation {impl!r} is not one of {WGRAD_IMPLS} (TITAN_MEGAMOE_WGRAD)")
    if custom or (out_dtype not in (None, torch.bfloat16)) or not hasattr(torch, "_grouped_mm"):
        return "triton"
    if impl in ("auto", "gluon"):
        ok = device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9
        return "gluon" if ok else "triton"
    return impl


@triton.jit
def _gather_rows_kernel(
    src_TD,           # (T, D) bf16 token rows
    row_pair_N,       # (N_cap,) int32
    offsets_E1,       # (E + 1,) int32; rows >= offsets[E] are left unwritten
    out_ND,           # (N_cap, D) bf16 out
    D: tl.constexpr, K: tl.constexpr, E: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr,
):
    """out[r] = src[row_pair[r] // K] for rows with a pair, zeros for padding rows (r < offsets[E])."""
    r0 = tl.program_id(0) * BR
    end = tl.load(offsets_E1 + E)
    if r0 < end:
        rows = r0 + tl.arange(0, BR)
        live = rows < end
        pair = tl.load(row_pair_N + rows, mask=live, other=-1)
        valid = pair >= 0
        tok64 = tl.where(valid, pair // K, 0).to(tl.int64)  # int64: T * D can pass 2^31
        cols = tl.program_id(1) * BD + tl.arange(0, BD)
        c_ok = cols < D
        v = tl.load(src_TD + tok64[:, None] * D + cols[None, :], mask=valid[:, None] & c_ok[None, :], other=0.0)
        tl.store(out_ND + rows.to(tl.int64)[:, None] * D + cols[None, :], v, mask=live[:, None] & c_ok[None, :])


def gather_rows(src_TD: Tensor, layout: RoutingLayout) -> Tensor:
    """Token rows in the layout's padded expert-major order, one pass.

    Args:
        src_TD: (T, D) bf16 contiguous token rows (x, or dout), T * K = the layout's pairs.
        layout: the routing layout.

    Returns:
        (N_cap, D) bf16: row r < offsets[E] holds ``src[row_pair[r] // K]`` or zeros (padding); rows
        from offsets[E] on are not written (no grouped GEMM reads them).
    """
    T, D = src_TD.shape
    out = torch.empty((layout.n_cap, D), dtype=src_TD.dtype, device=src_TD.device)
    BR, BD = 16, min(512, next_pow2(D))
    grid = (cdiv(layout.n_cap, BR), cdiv(D, BD))
    launch(_gather_rows_kernel, grid, src_TD, layout.row_pair, layout.offsets, out, D, layout.top_k,
                                         layout.num_experts, BR=BR, BD=BD)
    return out


def _grouped_mm_wgrad(a_MN: Tensor, b_ND: Tensor, layout: RoutingLayout) -> Tensor:
    """out[e] = a[:, s_e:t_e] @ b[s_e:t_e] over each expert's padded segment [offsets[e], offsets[e+1])."""
    return torch._grouped_mm(a_MN, b_ND, offs=layout.offsets[1:])


@triton.jit
def _wgrad_w2_kernel(
    dout_TD,          # (T, D) bf16, gathered by token
    gate_up_N2F,      # (N_cap, 2F) bf16 pointer, or TMA descriptor over (N_cap, 2, F), block [BK, 1, BN]
    hs_NF,            # (N_cap, F) bf16 s * h rows (HS_SAVED), pointer or TMA descriptor, block [BK, BN]
    scores_P,         # (P,) fp32
    row_pair_N,       # (N_cap,) int32
    offsets_E1,       # (E + 1,) int32 first padded row of each expert
    dw2_EDF,          # (E, D, F) bf16 or fp32 out
    D: tl.constexpr, F: tl.constexpr, K: tl.constexpr, NBM: tl.constexpr, NBN: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    USE_TMA: tl.constexpr, HS_SAVED: tl.constexpr, INTERPRET: tl.constexpr,
):
    """dw2[e][d, f] = sum_{r in expert e} dout[t, d] * (s[p] h[r, f]), h = silu(gate) * up.

    The B operand s * h is recomputed from gate_up in the loader (HS_SAVED=False), or read from the
    rows ``gemm2_dgrad_swiglu_bwd`` stored (HS_SAVED=True: no math in the main loop).
    Grid: (NBM * NBN, E), NBM = cdiv(D, BM), NBN = cdiv(F, BN), grouped order within an expert. The
    program of (m, n, e) owns dw2[e, m*BM:(m+1)*BM, n*BN:(n+1)*BN] and loops over the expert's rows in
    BK chunks (bounds read from offsets on device); no rows -> zeros.
    HS_SAVED + TMA: the tile's rows past the expert's end are masked to 0 (a BK chunk can reach rows from
    offsets[E] on, which gemm2_dgrad leaves unwritten, when BK exceeds the layout's BM; NaN x 0 is NaN).
    """
    pid = tl.program_id(0)
    e = tl.program_id(1)
    pid_m, pid_n = grouped_tile(pid, NBM, NBN, GROUP_M)

    dd = pid_m * BM + tl.arange(0, BM)
    ff = pid_n * BN + tl.arange(0, BN)
    d_ok = dd < D
    f_ok = ff < F
    start = tl.load(offsets_E1 + e)
    end = tl.load(offsets_E1 + e + 1)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    # The expert's rows [start, end), bounds read on device (no host sync). Interpreter: range() over a
    # runtime scalar fails with numpy >= 2.3, so the bounds go through _interp_int there.
    for r0 in range(_interp_int(start) if INTERPRET else start, _interp_int(end) if INTERPRET else end, BK):
        rows = r0 + tl.arange(0, BK)
        rows64 = rows.to(tl.int64)  # int64: N_cap * 2F can pass 2^31
        pair = tl.load(row_pair_N + rows, mask=rows < end, other=-1)
        valid = pair >= 0
        tok64 = tl.where(valid, pair // K, 0).to(tl.int64)  # int64: T * D can pass 2^31
        # dout^T tile (BM, BK): token rows gathered, transposed by the pointer layout.
        a = tl.load(dout_TD + tok64[None, :] * D + dd[:, None], mask=valid[None, :] & d_ok[:, None], other=0.0)
        if HS_SAVED:
            if USE_TMA:  # masked: a chunk can run past offsets[E] into unwritten rows when BK > the layout's BM
                b = tl.where(valid[:, None], hs_NF.load([r0, pid_n * BN]), 0.0).to(dout_TD.dtype.element_ty)
            else:
                b = tl.load(hs_NF + rows64[:, None] * F + ff[None, :], mask=valid[:, None] & f_ok[None, :], other=0.0)
        else:
            s = tl.load(scores_P + pair, mask=valid, other=0.0)
            if USE_TMA:
                gate = gate_up_N2F.load([r0, 0, pid_n * BN]).reshape(BK, BN).to(tl.float32)
                up = gate_up_N2F.load([r0, 1, pid_n * BN]).reshape(BK, BN).to(tl.float32)
            else:
                gu_off = rows64[:, None] * (2 * F) + ff[None, :]
                gmask = valid[:, None] & f_ok[None, :]
                gate = tl.load(gate_up_N2F + gu_off, mask=gmask, other=0.0).to(tl.float32)
                up = tl.load(gate_up_N2F + gu_off + F, mask=gmask, other=0.0).to(tl.float32)
            hs = gate / (1.0 + tl.exp(-gate)) * up * s[:, None]
            b = tl.where(valid[:, None], hs, 0.0).to(dout_TD.dtype.element_ty)
        if INTERPRET:  # interpreter: bf16 tl.dot returns garbage there
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    out = dw2_EDF + e.to(tl.int64) * D * F + dd.to(tl.int64)[:, None] * F + ff[None, :]  # int64: E*D*F
    tl.store(out, acc.to(dw2_EDF.dtype.element_ty), mask=d_ok[:, None] & f_ok[None, :])


@triton.jit
def _wgrad_w13_kernel(
    dgate_up_N2F,     # (N_cap, 2F) bf16 pointer, or TMA descriptor over (N_cap, 2, F), block [BK, 1, BM]
    x_TD,             # (T, D) bf16, gathered by token
    row_pair_N,       # (N_cap,) int32
    offsets_E1,       # (E + 1,) int32
    dw1_EFD,          # (E, F, D) bf16 or fp32 out
    dw3_EFD,          # (E, F, D) bf16 or fp32 out
    D: tl.constexpr, F: tl.constexpr, K: tl.constexpr, NBF: tl.constexpr, NBN: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    USE_TMA: tl.constexpr, INTERPRET: tl.constexpr,
):
    """dw1[e] = sum_r dgate[r]^T x[t] and dw3[e] = sum_r dup[r]^T x[t] in one program per tile pair.

    Two fp32 accumulators (gate, up) share each gathered x tile, so the token gather (the costly,
    irregular load) runs once for both weights: the structure of GEMM1's forward (v2; v1 had one
    program per weight and gathered x twice: 317 TF/s at the 30B shape).
    Grid: (NBF * NBN, E), NBF = cdiv(F, BM), NBN = cdiv(D, BN), grouped order within an expert. The
    program of (m, n, e) owns dw1[e] and dw3[e] rows m*BM:(m+1)*BM, columns n*BN:(n+1)*BN and loops
    over the expert's rows in BK chunks (bounds read from offsets on device); no rows -> zeros.
    """
    pid = tl.program_id(0)
    e = tl.program_id(1)
    pid_m, pid_n = grouped_tile(pid, NBF, NBN, GROUP_M)
    ff = pid_m * BM + tl.arange(0, BM)
    dd = pid_n * BN + tl.arange(0, BN)
    f_ok = ff < F
    d_ok = dd < D
    start = tl.load(offsets_E1 + e)
    end = tl.load(offsets_E1 + e + 1)
    acc_g = tl.zeros((BM, BN), dtype=tl.float32)
    acc_u = tl.zeros((BM, BN), dtype=tl.float32)
    # The expert's rows [start, end), bounds read on device (no host sync). Interpreter: range() over a
    # runtime scalar fails with numpy >= 2.3, so the bounds go through _interp_int there.
    for r0 in range(_interp_int(start) if INTERPRET else start, _interp_int(end) if INTERPRET else end, BK):
        rows = r0 + tl.arange(0, BK)
        pair = tl.load(row_pair_N + rows, mask=rows < end, other=-1)
        valid = pair >= 0
        tok64 = tl.where(valid, pair // K, 0).to(tl.int64)  # int64: T * D can pass 2^31
        if USE_TMA:
            g_t = dgate_up_N2F.load([r0, 0, pid_m * BM]).reshape(BK, BM)
            u_t = dgate_up_N2F.load([r0, 1, pid_m * BM]).reshape(BK, BM)
            a_g = tl.trans(tl.where(valid[:, None], g_t, 0.0))
            a_u = tl.trans(tl.where(valid[:, None], u_t, 0.0))
        else:
            a_off = rows.to(tl.int64)[None, :] * (2 * F) + ff[:, None]  # int64: N_cap * 2F
            a_mask = valid[None, :] & f_ok[:, None]
            a_g = tl.load(dgate_up_N2F + a_off, mask=a_mask, other=0.0)
            a_u = tl.load(dgate_up_N2F + a_off + F, mask=a_mask, other=0.0)
        b = tl.load(x_TD + tok64[:, None] * D + dd[None, :], mask=valid[:, None] & d_ok[None, :], other=0.0)
        if INTERPRET:  # interpreter: bf16 tl.dot returns garbage there
            bf = b.to(tl.float32)
            acc_g = tl.dot(a_g.to(tl.float32), bf, acc_g, input_precision="ieee")
            acc_u = tl.dot(a_u.to(tl.float32), bf, acc_u, input_precision="ieee")
        else:
            acc_g = tl.dot(a_g, b, acc_g)
            acc_u = tl.dot(a_u, b, acc_u)
    off = e.to(tl.int64) * F * D + ff.to(tl.int64)[:, None] * D + dd[None, :]  # int64: E * F * D
    m = f_ok[:, None] & d_ok[None, :]
    tl.store(dw1_EFD + off, acc_g.to(dw1_EFD.dtype.element_ty), mask=m)
    tl.store(dw3_EFD + off, acc_u.to(dw3_EFD.dtype.element_ty), mask=m)


def _wgrad_out(out, shape, out_dtype, dev, name):
    if out is None:
        return torch.empty(shape, dtype=out_dtype, device=dev)
    _check(out, name, shape, out_dtype, dev)
    return out


def wgrad_w2(
    dout_TD: Tensor, gate_up_N2F: Tensor, scores_TK: Tensor, layout: RoutingLayout,
    config: GemmConfig | None = None, *, hs_NF: Tensor | None = None, out_dtype: torch.dtype | None = None,
    out: Tensor | None = None, impl: str | None = None,
) -> Tensor:
    """dw2[e] = sum_{rows r of e} (s[p] dout[t])^T outer h[r] = sum_r dout[t]^T outer (s[p] h[r]).

    Args:
        dout_TD: (T, D) bf16 (gathered by token); gate_up_N2F: (N_cap, 2F) bf16 saved by the forward;
        scores_TK: (T, K) fp32; layout: the routing layout (any block_m).
        config: BM x BN tile of dw2[e] (over D x F), BK rows per reduction step.
        hs_NF: optional (N_cap, F) bf16 s * h rows from ``gemm2_dgrad_swiglu_bwd(..., hs_out=...)``:
            read instead of recomputing bf16(s * silu(gate) * up) from gate_up in the loader (the
            recompute puts SwiGLU math between the loads and the MMA of every step).
        out_dtype: bf16 (default: the weights' dtype of this bf16 operator) or fp32 (FSDP fp32 master
            gradients); accumulation is fp32 either way.
        out: optional (E, D, F) caller buffer of ``out_dtype``.
        impl: None (``wgrad_impl`` picks) or "triton" / "grouped_mm" / "gluon" (module docstring; grouped_mm
            and gluon need ``hs_NF``, bf16 output and no config / out).

    Returns:
        (E, D, F) dw2; experts without rows get exact zeros.

    Grid: (cdiv(D, BM) * cdiv(F, BN), E); each program owns one output tile of one expert and reduces
    over that expert's rows offsets[e]..offsets[e+1] (read on device) in BK steps, in row order.
    """
    dev = dout_TD.device
    if dout_TD.dim() != 2 or gate_up_N2F.dim() != 2:
        raise ValueError("dout must be (T, D) and gate_up (N_cap, 2F)")
    T, D = dout_TD.shape
    F = gate_up_N2F.shape[1] // 2
    E, K = layout.num_experts, layout.top_k
    _check_layout(layout, dev)
    _check(dout_TD, "dout", (T, D), _ACT, dev)
    _check(gate_up_N2F, "gate_up", (layout.n_cap, 2 * F), _ACT, dev)
    _check(scores_TK, "topk_scores", (T, K), torch.float32, dev)
    if layout.pair_row.shape[0] != T * K:
        raise ValueError(f"layout was built for {layout.pair_row.shape[0]} pairs, dout/scores give T*K={T * K}")
    out_dtype = out_dtype or _ACT
    if out_dtype not in _WGRAD_DTYPES:
        raise ValueError(f"out_dtype must be one of {_WGRAD_DTYPES}, got {out_dtype}")
    if hs_NF is not None:
        _check(hs_NF, "hs_NF", (layout.n_cap, F), _ACT, dev)
    custom = config is not None or out is not None or hs_NF is None
    chosen = wgrad_impl(dev, out_dtype, custom=custom, impl=impl)
    ws_cfg = _ws_wgrad_config(D)
    if chosen == "gluon" and ws_wgrad_supported(D, F, layout, dout_TD, ws_cfg) is None:
        return ws_wgrad_w2(dout_TD.contiguous(), hs_NF, layout, cfg=ws_cfg)
    if chosen in ("grouped_mm", "gluon"):
        # dw2[e] = dout_rows[e]^T @ (s h)[e]; padding rows of the gathered dout are zeros
        return _grouped_mm_wgrad(gather_rows(dout_TD, layout).t(), hs_NF, layout)
    cfg = config or default_bwd_config("wgrad_w2", layout, D, F)
    dw2 = _wgrad_out(out, (E, D, F), out_dtype, dev, "out (dw2)")
    nbm, nbn = cdiv(D, cfg.block_m), cdiv(F, cfg.block_n)
    use_tma = _tma_ok(cfg, gate_up_N2F) and F % 8 == 0  # (N_cap, 2, F) view needs F*2 B aligned rows
    if use_tma:
        gu_arg = _desc(gate_up_N2F, [layout.n_cap, 2, F], [cfg.block_k, 1, cfg.block_n])
        hs_arg = gu_arg if hs_NF is None else _desc(hs_NF, [layout.n_cap, F], [cfg.block_k, cfg.block_n])
    else:
        gu_arg, hs_arg = gate_up_N2F, gate_up_N2F if hs_NF is None else hs_NF
    if E * nbm * nbn:
        launch(_wgrad_w2_kernel, (nbm * nbn, E),
            dout_TD, gu_arg, hs_arg, scores_TK, layout.row_pair, layout.offsets, dw2, D, F, K, nbm, nbn,
            BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k, GROUP_M=cfg.group_m, USE_TMA=use_tma,
            HS_SAVED=hs_NF is not None, **_launch_opts(cfg),
        )
    return dw2


def wgrad_w13(
    dgate_up_N2F: Tensor, x_TD: Tensor, layout: RoutingLayout, config: GemmConfig | None = None, *,
    out_dtype: torch.dtype | None = None, out: tuple[Tensor, Tensor] | None = None, impl: str | None = None,
) -> tuple[Tensor, Tensor]:
    """dw1[e] = sum_{rows r of e} dgate[r]^T outer x[t], dw3[e] = sum_r dup[r]^T outer x[t].

    One launch; each program accumulates both weights' tiles from one gathered x tile.

    Args:
        dgate_up_N2F: (N_cap, 2F) bf16 from ``gemm2_dgrad_swiglu_bwd``; x_TD: (T, D) bf16 layer input
            (gathered by token); layout: the routing layout (any block_m).
        config: BM x BN tile of dw1[e] / dw3[e] (over F x D), BK rows per reduction step.
        out_dtype: bf16 (default) or fp32; out: optional (dw1, dw3) caller buffers.
        impl: None (``wgrad_impl`` picks) or "triton" / "grouped_mm" / "gluon" (module docstring; grouped_mm
            and gluon need bf16 output and no config / out).

    Returns:
        dw1, dw3 (E, F, D); experts without rows get exact zeros.

    Grid: (cdiv(F, BM) * cdiv(D, BN), E); each program owns the same tile of dw1[e] and dw3[e] and
    reduces over the expert's rows in row order.
    """
    dev = x_TD.device
    if dgate_up_N2F.dim() != 2 or x_TD.dim() != 2:
        raise ValueError("dgate_up must be (N_cap, 2F) and x (T, D)")
    T, D = x_TD.shape
    F = dgate_up_N2F.shape[1] // 2
    E, K = layout.num_experts, layout.top_k
    _check_layout(layout, dev)
    _check(x_TD, "x", (T, D), _ACT, dev)
    _check(dgate_up_N2F, "dgate_up", (layout.n_cap, 2 * F), _ACT, dev)
    if layout.pair_row.shape[0] != T * K:
        raise ValueError(f"layout was built for {layout.pair_row.shape[0]} pairs, x gives T*K={T * K}")
    out_dtype = out_dtype or _ACT
    if out_dtype not in _WGRAD_DTYPES:
        raise ValueError(f"out_dtype must be one of {_WGRAD_DTYPES}, got {out_dtype}")
    custom = config is not None or out is not None
    chosen = wgrad_impl(dev, out_dtype, custom=custom, impl=impl)
    ws_cfg = _ws_wgrad_config(D)
    if chosen == "gluon" and ws_wgrad_supported(D, F, layout, x_TD, ws_cfg) is None:
        return ws_wgrad_w13(dgate_up_N2F, x_TD, layout, cfg=ws_cfg)
    if chosen in ("grouped_mm", "gluon"):
        # dw1[e] = dgate[e]^T @ x_rows[e], dw3 likewise: the gate / up halves as strided views, no copy
        x_rows = gather_rows(x_TD, layout)
        return (_grouped_mm_wgrad(dgate_up_N2F[:, :F].t(), x_rows, layout),
                _grouped_mm_wgrad(dgate_up_N2F[:, F:].t(), x_rows, layout))
    cfg = config or default_bwd_config("wgrad_w13", layout, D, F)
    dw1 = _wgrad_out(None if out is None else out[0], (E, F, D), out_dtype, dev, "out[0] (dw1)")
    dw3 = _wgrad_out(None if out is None else out[1], (E, F, D), out_dtype, dev, "out[1] (dw3)")
    nbf, nbn = cdiv(F, cfg.block_m), cdiv(D, cfg.block_n)
    use_tma = _tma_ok(cfg, dgate_up_N2F) and F % 8 == 0
    dgu_arg = (_desc(dgate_up_N2F, [layout.n_cap, 2, F], [cfg.block_k, 1, cfg.block_m])
               if use_tma else dgate_up_N2F)
    if E * nbf * nbn:
        launch(_wgrad_w13_kernel, (nbf * nbn, E),
            dgu_arg, x_TD, layout.row_pair, layout.offsets, dw1, dw3, D, F, K, nbf, nbn,
            BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k, GROUP_M=cfg.group_m, USE_TMA=use_tma,
            **_launch_opts(cfg),
        )
    return dw1, dw3
