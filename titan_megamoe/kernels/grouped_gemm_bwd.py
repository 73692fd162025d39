"""Backward of the fused SwiGLU MoE grouped GEMMs: dgrad (dout -> dh -> SwiGLU bwd -> dx, d score)
and per-expert wgrad (K-grouped over each expert's rows; kernels in ``grouped_gemm_wgrad.py``, re-exported
here). Deterministic: no atomics, fixed orders.

Shape legend: T tokens, K top_k, P = T*K pairs (p = t*K + k), E experts, D model dim, F expert hidden
dim, N_cap padded rows of the routing layout (``routing.py``), n_tiles = N_cap // BM row tiles,
NB = cdiv(F, BN) column blocks of F. Row r of the layout holds pair p = row_pair[r] (-1: padding),
token t = p // K, expert e = tile_expert[r // BM].

Forward (``grouped_gemm.py``) saved ``gate_up[r] = [x[t] @ w1[e].T, x[t] @ w3[e].T]`` (N_cap, 2F) bf16;
``h = silu(gate) * up`` and ``y[p] = s[p] * h[r] @ w2[e].T`` are not saved. With dout = d out (T, D):

  1. ``gemm2_dgrad_swiglu_bwd``: g = dout[t] @ w2[e] (gathered dout rows), dh = s[p] g,
     dgate = dh * up * silu'(gate), dup = dh * silu(gate) -> dgate_up (N_cap, 2F) bf16, and per-(row,
     column block) partials of d s[p] = <g, h[r]> (SonicMoE: <dout, y / s> without caching y);
     ``reduce_dscore`` adds the NB partials in a fixed order -> (T, K) fp32.
  2. ``gemm1_dgrad``: dx_rows[r] = dgate[r] @ w1[e] + dup[r] @ w3[e] (N_cap, D) bf16;
     ``scatter_dx``: dx[t] = sum_k dx_rows[pair_row[t*K + k]] in fp32, k order -> (T, D) bf16.
  3. ``wgrad_w2``: dw2[e] = sum_r dout[t]^T (s[p] h[r]) (E, D, F); ``wgrad_w13``: dw1[e] = sum_r
     dgate[r]^T x[t], dw3[e] = sum_r dup[r]^T x[t] (E, F, D). The reduction runs over the expert's rows
     offsets[e]..offsets[e+1] inside one program (bounds read on device): no host sync, each output
     element written once, zero for experts without rows. s * h is recomputed from gate_up in the
     loader, or (faster: 1.12 vs 4.42 ms at the 30B-A3B shape on H200) stored once by step 1
     (``hs_out``) and read by ``wgrad_w2(..., hs_NF=...)``: the op should pass it.

Measured on one H200 (30B-A3B layer, 16384 tokens, top-8, 128 experts, near-uniform routing): the
whole backward (steps 1-3 with stored s * h, pointer loads) 6.05 ms vs 8.24 ms for the autograd
backward of a torch._grouped_mm expert path (stock TorchTitan's GEMMs, no all-to-all): 1.36x;
235B-A22B shape 23.5 vs 24.3 ms (1.04x; wgrad_w13 is 40% of it at ~350 TF/s).

Example (T=2, K=2, BM=2, the layout of ``routing.py``: pair_row = [4, 0, 1, 2]):
dx[0] = dx_rows[4] + dx_rows[0], dx[1] = dx_rows[1] + dx_rows[2] (tested in
``tests/test_kernels_bwd.py::test_worked_example``).

Interpreter (``TRITON_INTERPRET=1``, read at *launch* time): kernels run as ``InterpretedFunction``
whatever the flag was at import (re-wrapping ``kernel.fn``; their one jit helper, ``jit.grouped_tile``,
follows the flag set before import, as tests/conftest.py does), and ``INTERPRET`` feeds fp32 operands
to ``tl.dot`` (bf16 dot returns garbage there) and routes the wgrad row-loop bounds through ``_interp_int``. D, F, K are
constexpr (one compile per layer shape; keeps ``range(0, D, BK)`` working in the interpreter).

Contiguous operands (weights, saved gate_up / dgate_up / hs rows) load through host-built TMA
descriptors (no ``triton.set_allocator`` needed) when ``config.use_tma`` and 16-byte alignment allow,
with a pointer fallback under the ``USE_TMA`` constexpr; scattered token rows (dout, x) always use
pointer gathers (TMA gather is Blackwell-only). ``default_bwd_config`` picks TMA per kernel by
measurement.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from titan_megamoe.kernels.jit import cdiv, env_choice, env_flag, grouped_tile, next_pow2
from titan_megamoe.kernels.launch import launch
from titan_megamoe.kernels._bwd_common import (  # noqa: F401  (re-exported for tests / callers)
    _ACT,
    _WGRAD_DTYPES,
    _check,
    _check_layout,
    _check_row_config,
    _desc,
    _interpreting,
    _launch_opts,
    _tma_ok,
    default_bwd_config,
)
from titan_megamoe.kernels.configs import GemmConfig
from titan_megamoe.kernels.routing import RoutingLayout
from titan_megamoe.kernels import ws_gemm

__all__ = [
    "gemm2_dgrad_swiglu_bwd", "reduce_dscore", "gemm1_dgrad", "scatter_dx", "wgrad_w2", "wgrad_w13",
    "default_bwd_config",
]


#: GEMM1 dgrad by the warp-specialized Gluon kernel (``kernels/ws_gemm.py``) instead of the Triton one, where it
#: applies (sm_90, BM 128, F a multiple of 64; else the Triton kernel): "coop" (the default), "pingpong" (its
#: two schedules) or "0" (off). Bitwise the Triton kernel's output in every case checked on an H200; in the layer
#: (same process, layer_1xh200_ep1_s10b_20261202.json) fwd+bwd device time 7.388 -> 7.192 ms at the 30B shape,
#: 25.46 -> 24.99 ms at 235B. Read at import (``TITAN_MEGAMOE_WS_GEMM1_DGRAD``); a same-process switch. "split":
#: the cooperative kernel with each consumer's accumulator as two column halves (``WsConfig.split_n``), which frees
#: the shared memory of a 4th ring stage (Nsight, one H100: the 3-stage kernel's tensor pipe is busy only 66-71 %).
WS_GEMM1_DGRAD = env_choice("TITAN_MEGAMOE_WS_GEMM1_DGRAD", "coop", ("0", "pingpong", "coop", "split"))
#: GEMM2 dgrad (dout row gather, SwiGLU backward, d score partials, s h for the w2 wgrad) by the warp-specialized
#: Gluon kernel (``ws_gemm.ws_gemm2_dgrad``) where it applies (sm_90, BM 128, D >= ``WS_GEMM1_DGRAD_MIN_DIM``,
#: F % 128 == 0, no config, ``hs_out`` given); else the Triton kernel. Off by default until the GPU suite has run
#: with it (``TITAN_MEGAMOE_WS_GEMM2_DGRAD=1``). Read at import; a same-process switch.
WS_GEMM2_DGRAD = env_flag("TITAN_MEGAMOE_WS_GEMM2_DGRAD", False)
#: Model dims from which the Gluon GEMM1 dgrad applies: measured at D = 2048 and 4096 only (small, host-bound
#: layers such as the debug model's D = 256 keep the Triton kernel and its cheaper launch path).
WS_GEMM1_DGRAD_MIN_DIM = 2048


# --------------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------------


@triton.jit
def _gemm2_dgrad_swiglu_bwd_kernel(
    dout_TD,          # (T, D) bf16, gathered by token
    w2_EDF,           # (E, D, F) bf16 pointer, or TMA descriptor with block [1, BK, BN]
    gate_up_N2F,      # (N_cap, 2F) bf16 saved pre-activations
    scores_P,         # (P,) fp32 routing scores
    row_pair_N,       # (N_cap,) int32
    tile_expert_M,    # (n_tiles,) int32
    dgate_up_N2F,     # (N_cap, 2F) bf16 out
    dscore_part_NB,   # (N_cap, NB) fp32 out
    hs_NF,            # (N_cap, F) bf16 out, s[p] * h[r] for wgrad_w2 (only if STORE_HS)
    n_tiles,          # i32 row tiles of the layout
    D: tl.constexpr, F: tl.constexpr, K: tl.constexpr, NB: tl.constexpr,  # NB = cdiv(F, BN)
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    USE_TMA: tl.constexpr, STORE_HS: tl.constexpr, INTERPRET: tl.constexpr,
):
    """g = dout[t] @ w2[e]; SwiGLU backward; d score partials; optionally hs = s * h for wgrad_w2.

    Grid: (n_tiles * NB,), grouped order (GROUP_M row tiles sweep all column blocks). The program of
    (row tile m, column block n) owns dgate_up[m*BM:(m+1)*BM, n*BN:(n+1)*BN] and the same columns + F,
    dscore_part[m*BM:(m+1)*BM, n] and (STORE_HS) hs[m*BM:(m+1)*BM, n*BN:(n+1)*BN]; padding rows get
    zeros, tiles of expert -1 are left unwritten.
    """
    pid = tl.program_id(0)
    pid_m, pid_n = grouped_tile(pid, n_tiles, NB, GROUP_M)

    rows = pid_m * BM + tl.arange(0, BM)
    rows64 = rows.to(tl.int64)  # int64: N_cap * 2F can pass 2^31 at full shapes
    cols = pid_n * BN + tl.arange(0, BN)
    col_ok = cols < F
    gu_off = rows64[:, None] * (2 * F) + cols[None, :]
    e = tl.load(tile_expert_M + pid_m)
    if e < 0:  # tile past the last expert (rows >= offsets[E]): read by no consumer (wgrads take the
        return  # expert segments, d scores their pairs' rows); half the receive capacity at EP = 2

    pair = tl.load(row_pair_N + rows)
    valid = pair >= 0
    tok64 = tl.where(valid, pair // K, 0).to(tl.int64)  # int64: T * D can pass 2^31
    w_base = e.to(tl.int64) * D * F  # int64: E * D * F passes 2^31 at 235B shapes
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, D, BK):
        ks = k0 + tl.arange(0, BK)
        a = tl.load(dout_TD + tok64[:, None] * D + ks[None, :], mask=valid[:, None] & (ks[None, :] < D), other=0.0)
        if USE_TMA:
            b = w2_EDF.load([e, k0, pid_n * BN]).reshape(BK, BN)
        else:
            b = tl.load(w2_EDF + w_base + ks[:, None] * F + cols[None, :],
                        mask=(ks[:, None] < D) & col_ok[None, :], other=0.0)
        if INTERPRET:  # interpreter: bf16 tl.dot returns garbage there
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)

    # Epilogue: SwiGLU backward in fp32 from the saved pre-activations, in two column halves of BN/2
    # (halves the live fp32 tiles: g, gate, up, sigmoid at once spill at 128 x 128, 8 warps).
    s = tl.load(scores_P + pair, mask=valid, other=0.0)
    out_ty = dgate_up_N2F.dtype.element_ty
    g_lo, g_hi = tl.split(tl.permute(tl.reshape(acc, (BM, 2, BN // 2)), (0, 2, 1)))
    dscore = tl.zeros((BM,), dtype=tl.float32)
    for half in tl.static_range(2):
        g = g_lo if half == 0 else g_hi
        hc = pid_n * BN + half * (BN // 2) + tl.arange(0, BN // 2)
        hc_ok = hc < F
        off = rows64[:, None] * (2 * F) + hc[None, :]
        gate = tl.load(gate_up_N2F + off, mask=hc_ok[None, :], other=0.0).to(tl.float32)
        up = tl.load(gate_up_N2F + off + F, mask=hc_ok[None, :], other=0.0).to(tl.float32)
        sig = 1.0 / (1.0 + tl.exp(-gate))  # not tl.sigmoid: a jit library function (interpreter pitfall)
        silu = gate * sig
        keep = valid[:, None] & hc_ok[None, :]
        h = (silu * up).to(out_ty).to(tl.float32)  # the bf16 h GEMM2 consumed
        dscore += tl.sum(tl.where(keep, g * h, 0.0), axis=1)  # fixed order: lower half first
        dh = g * s[:, None]
        dgate = dh * up * (sig * (1.0 + gate * (1.0 - sig)))  # silu'(x) = sig (1 + x (1 - sig))
        tl.store(dgate_up_N2F + off, tl.where(keep, dgate, 0.0).to(out_ty), mask=hc_ok[None, :])
        tl.store(dgate_up_N2F + off + F, tl.where(keep, dh * silu, 0.0).to(out_ty), mask=hc_ok[None, :])
        if STORE_HS:  # s * h rounded once: the B operand of wgrad_w2, so its loader does no math
            tl.store(hs_NF + rows64[:, None] * F + hc[None, :], tl.where(keep, silu * up * s[:, None], 0.0).to(out_ty),
                     mask=hc_ok[None, :])
    tl.store(dscore_part_NB + rows64 * NB + pid_n, dscore)


@triton.jit
def _reduce_dscore_kernel(
    dscore_part_NB,   # (N_cap, NB) fp32
    pair_row_P,       # (P,) int32
    dscore_P,         # (P,) fp32 out
    P,                # i32 pairs
    NB: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """dscore[p] = sum_j part[pair_row[p], j], j ascending. Grid (cdiv(P, BLOCK),): BLOCK pairs each."""
    p = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = p < P
    r64 = tl.load(pair_row_P + p, mask=ok, other=0).to(tl.int64)  # int64: N_cap * NB offsets
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in range(0, NB):  # fixed order: deterministic
        acc += tl.load(dscore_part_NB + r64 * NB + j, mask=ok, other=0.0)
    tl.store(dscore_P + p, acc, mask=ok)


@triton.jit
def _gemm1_dgrad_kernel(
    dgate_up_N2F,     # (N_cap, 2F) bf16 pointer, or TMA descriptor over (N_cap, 2, F), block [BM, 1, BK]
    w1_EFD,           # (E, F, D) bf16 pointer, or TMA descriptor with block [1, BK, BN]
    w3_EFD,           # (E, F, D) bf16 pointer, or TMA descriptor with block [1, BK, BN]
    row_pair_N,       # (N_cap,) int32
    tile_expert_M,    # (n_tiles,) int32
    dx_rows_ND,       # (N_cap, D) bf16 out
    n_tiles,          # i32 row tiles of the layout
    D: tl.constexpr, F: tl.constexpr, NBD: tl.constexpr,  # NBD = cdiv(D, BN)
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    USE_TMA: tl.constexpr, INTERPRET: tl.constexpr,
):
    """dx_rows[r] = dgate[r] @ w1[e] + dup[r] @ w3[e], one fp32 accumulator over 2F.

    Grid: (n_tiles * NBD,), NBD = cdiv(D, BN), grouped order. The program of (row tile m, column
    block n) owns dx_rows[m*BM:(m+1)*BM, n*BN:(n+1)*BN]; padding rows get zeros, expert -1 tiles are
    left unwritten.
    """
    pid = tl.program_id(0)
    pid_m, pid_n = grouped_tile(pid, n_tiles, NBD, GROUP_M)

    rows = pid_m * BM + tl.arange(0, BM)
    rows64 = rows.to(tl.int64)  # int64: N_cap * 2F and N_cap * D can pass 2^31
    cols = pid_n * BN + tl.arange(0, BN)
    col_ok = cols < D
    out_off = rows64[:, None] * D + cols[None, :]
    out_ty = dx_rows_ND.dtype.element_ty
    e = tl.load(tile_expert_M + pid_m)
    if e < 0:  # tile past the last expert: read by no consumer (dx rows are gathered by pair_row)
        return

    w_base = e.to(tl.int64) * F * D  # int64: E * F * D passes 2^31 at 235B shapes
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for half in tl.static_range(2):  # half 0: dgate x w1, half 1: dup x w3
        for k0 in range(0, F, BK):
            ks = k0 + tl.arange(0, BK)
            if USE_TMA:
                a = dgate_up_N2F.load([pid_m * BM, half, k0]).reshape(BM, BK)
                if half == 0:
                    b = w1_EFD.load([e, k0, pid_n * BN]).reshape(BK, BN)
                else:
                    b = w3_EFD.load([e, k0, pid_n * BN]).reshape(BK, BN)
            else:
                a = tl.load(dgate_up_N2F + rows64[:, None] * (2 * F) + half * F + ks[None, :],
                            mask=ks[None, :] < F, other=0.0)
                b_off = w_base + ks[:, None] * D + cols[None, :]
                b_mask = (ks[:, None] < F) & col_ok[None, :]
                if half == 0:
                    b = tl.load(w1_EFD + b_off, mask=b_mask, other=0.0)
                else:
                    b = tl.load(w3_EFD + b_off, mask=b_mask, other=0.0)
            if INTERPRET:  # interpreter: bf16 tl.dot returns garbage there
                acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
    valid = tl.load(row_pair_N + rows) >= 0
    tl.store(dx_rows_ND + out_off, tl.where(valid[:, None], acc, 0.0).to(out_ty), mask=col_ok[None, :])


@triton.jit
def _scatter_dx_kernel(
    dx_rows_ND,       # (N_cap, D) bf16
    pair_row_P,       # (P,) int32
    dx_TD,            # (T, D) bf16 out
    dl_TE,            # (T, E) bf16 router d logits (read when ROUTER)
    gw_ED,            # (E, D) bf16 gate weight (read when ROUTER)
    T,                # i32 tokens
    D: tl.constexpr, K: tl.constexpr,
    BT: tl.constexpr, BD: tl.constexpr,
    E: tl.constexpr = 1, E_PAD: tl.constexpr = 16,
    ROUTER: tl.constexpr = False, INTERPRET: tl.constexpr = False,
):
    """dx[t] = sum_k dx_rows[pair_row[t*K + k]] (+ dl[t] @ gw with ROUTER) in fp32, k ascending, then cast.

    Grid: (cdiv(T, BT), cdiv(D, BD)); each program owns dx[BT tokens, BD columns].
    """
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    d = tl.program_id(1) * BD + tl.arange(0, BD)
    t_ok = t < T
    m = t_ok[:, None] & (d[None, :] < D)
    acc = tl.zeros((BT, BD), dtype=tl.float32)
    if ROUTER:  # the router's dx (a K = E GEMM), added before the rows and rounded once with them
        EC: tl.constexpr = 32 if E_PAD > 32 else E_PAD  # E in chunks: 10 KB of shared memory, not 40 (occupancy)
        for e0 in tl.static_range(0, E_PAD, EC):
            e = e0 + tl.arange(0, EC)
            e_ok = e < E
            a = tl.load(dl_TE + t.to(tl.int64)[:, None] * E + e[None, :], mask=t_ok[:, None] & e_ok[None, :],
                        other=0.0)
            b = tl.load(gw_ED + e[:, None] * D + d[None, :], mask=e_ok[:, None] & (d[None, :] < D), other=0.0)
            if INTERPRET:  # interpreter: bf16 tl.dot returns garbage there
                acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
    for k in range(0, K):  # fixed order: deterministic
        r64 = tl.load(pair_row_P + t * K + k, mask=t_ok, other=0).to(tl.int64)  # int64: N_cap * D
        acc += tl.load(dx_rows_ND + r64[:, None] * D + d[None, :], mask=m, other=0.0).to(tl.float32)
    tl.store(dx_TD + t.to(tl.int64)[:, None] * D + d[None, :], acc.to(dx_TD.dtype.element_ty), mask=m)


# --------------------------------------------------------------------------------------------------
# Launchers (no host sync: every size comes from shapes and the layout's static caps)
# --------------------------------------------------------------------------------------------------



def gemm2_dgrad_swiglu_bwd(
    dout_TD: Tensor, w2_EDF: Tensor, gate_up_N2F: Tensor, scores_TK: Tensor, layout: RoutingLayout,
    config: GemmConfig | None = None, *, out: tuple[Tensor, Tensor] | None = None, hs_out: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """GEMM2 dgrad fused with the SwiGLU backward and the routing-score gradient partials.

    Per padded row r (pair p >= 0, token t, expert e): g = dout[t] @ w2[e] (fp32), dh = s[p] g,
    dgate = dh * up * silu'(gate), dup = dh * silu(gate); dscore_partial[r, j] = sum over columns
    j*BN..(j+1)*BN of g * h, h = bf16(silu(gate) * up) (what the forward fed GEMM2).

    Args:
        dout_TD: (T, D) bf16 gradient of the layer output; rows are gathered by token in the
            prologue (the EP dispatch of dy will read remote rows there).
        w2_EDF: (E, D, F) bf16 down projection.
        gate_up_N2F: (N_cap, 2F) bf16 pre-activations saved by the forward (layout rows).
        scores_TK: (T, K) fp32 routing scores.
        layout: routing layout built with ``block_m == config.block_m``.
        config: launch config (default ``default_bwd_config("gemm2_dgrad", ...)``).
        out: optional caller buffers (dgate_up (N_cap, 2F) bf16, dscore_partial (N_cap, NB) fp32).
        hs_out: optional (N_cap, F) bf16 buffer; when given, also written with hs[r] = bf16(s[p] h[r])
            (zeros on padding rows), which ``wgrad_w2(..., hs_NF=hs_out)`` consumes without recomputing
            SwiGLU in its main loop (one extra N_cap x F bf16 write, read once).

    Returns:
        dgate_up_N2F (N_cap, 2F) bf16 (zeros on padding rows) and dscore_partial (N_cap, NB) fp32 with
        NB = cdiv(F, config.block_n) (zeros on padding rows); reduce with ``reduce_dscore``. Rows from
        ``layout.offsets[E]`` on (tiles of expert -1) are left unwritten in every output.

    Grid: n_tiles_cap * NB programs (grouped order); each owns a BM x BN tile of dgate and of dup and
    one column of dscore_partial for its BM rows. No host sync, no atomics. With ``WS_GEMM2_DGRAD`` on
    (``TITAN_MEGAMOE_WS_GEMM2_DGRAD=1``), no ``config``, ``hs_out`` given, sm_90, BM 128, D >= 2048 and
    F % 128 == 0, the warp-specialized Gluon kernel (``ws_gemm.ws_gemm2_dgrad``) computes the same outputs
    (NB = F / 128; d score partials summed in another order within a column block).

    Raises:
        ValueError: shape / dtype / device / contiguity mismatch, or config.block_m != layout.block_m.
    """
    dev = dout_TD.device
    if dout_TD.dim() != 2 or w2_EDF.dim() != 3:
        raise ValueError(f"dout must be (T, D) and w2 (E, D, F); got {tuple(dout_TD.shape)}, {tuple(w2_EDF.shape)}")
    T, D = dout_TD.shape
    E, _, F = w2_EDF.shape
    K = layout.top_k
    _check_layout(layout, dev)
    _check(dout_TD, "dout", (T, D), _ACT, dev)
    _check(w2_EDF, "w2", (layout.num_experts, D, F), _ACT, dev)
    _check(gate_up_N2F, "gate_up", (layout.n_cap, 2 * F), _ACT, dev)
    _check(scores_TK, "topk_scores", (T, K), torch.float32, dev)
    if layout.pair_row.shape[0] != T * K:
        raise ValueError(f"layout was built for {layout.pair_row.shape[0]} pairs, dout/scores give T*K={T * K}")
    if hs_out is not None:
        _check(hs_out, "hs_out", (layout.n_cap, F), _ACT, dev)
    if (WS_GEMM2_DGRAD and config is None and hs_out is not None and layout.block_m == 128
            and D >= WS_GEMM1_DGRAD_MIN_DIM and (out is None or out[1].shape[1:] == (F // 128,))):
        if ws_gemm.ws_gemm2_dgrad_supported(dout_TD, w2_EDF) is None:  # operands checked above
            if out is None:
                out = (torch.empty((layout.n_cap, 2 * F), dtype=_ACT, device=dev),
                       torch.empty((layout.n_cap, F // 128), dtype=torch.float32, device=dev))
            else:
                _check(out[0], "out[0] (dgate_up)", (layout.n_cap, 2 * F), _ACT, dev)
                _check(out[1], "out[1] (dscore_partial)", (layout.n_cap, F // 128), torch.float32, dev)
            return ws_gemm.launch_gemm2_dgrad(dout_TD, w2_EDF, gate_up_N2F, scores_TK, layout, out[0], out[1], hs_out)
    cfg = config or default_bwd_config("gemm2_dgrad", layout, D, F)
    _check_row_config(cfg, layout)
    nb = cdiv(F, cfg.block_n)
    n_tiles = layout.n_tiles_cap
    if out is None:
        dgate_up = torch.empty((layout.n_cap, 2 * F), dtype=_ACT, device=dev)
        dscore_part = torch.empty((layout.n_cap, nb), dtype=torch.float32, device=dev)
    else:
        dgate_up, dscore_part = out
        _check(dgate_up, "out[0] (dgate_up)", (layout.n_cap, 2 * F), _ACT, dev)
        _check(dscore_part, "out[1] (dscore_partial)", (layout.n_cap, nb), torch.float32, dev)
    use_tma = _tma_ok(cfg, w2_EDF)
    w2_arg = _desc(w2_EDF, [E, D, F], [1, cfg.block_k, cfg.block_n]) if use_tma else w2_EDF
    if n_tiles * nb:
        launch(_gemm2_dgrad_swiglu_bwd_kernel, (n_tiles * nb,),
            dout_TD, w2_arg, gate_up_N2F, scores_TK, layout.row_pair, layout.tile_expert, dgate_up,
            dscore_part, dgate_up if hs_out is None else hs_out, n_tiles, D, F, K, nb,
            BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k, GROUP_M=cfg.group_m, USE_TMA=use_tma,
            STORE_HS=hs_out is not None, **_launch_opts(cfg),
        )
    return dgate_up, dscore_part


def reduce_dscore(
    dscore_partial: Tensor, layout: RoutingLayout, T: int, K: int, *, out: Tensor | None = None,
) -> Tensor:
    """dscore[t, k] = sum_j dscore_partial[pair_row[t*K + k], j], j ascending (fp32, deterministic).

    Args:
        dscore_partial: (N_cap, NB) fp32 from ``gemm2_dgrad_swiglu_bwd``.
        layout: the routing layout; T, K: tokens and top_k (T*K pairs).
        out: optional (T, K) fp32 caller buffer.

    Returns:
        (T, K) fp32 gradient of the routing scores. Grid: cdiv(T*K, 128) programs of 128 pairs.
    """
    dev = dscore_partial.device
    _check_layout(layout, dev)
    if layout.pair_row.shape[0] != T * K or layout.top_k != K:
        raise ValueError(f"layout was built for {layout.pair_row.shape[0]} pairs and top_k={layout.top_k}, "
                         f"got T={T}, K={K}")
    if dscore_partial.dim() != 2:
        raise ValueError(f"dscore_partial must be (N_cap, NB), got {tuple(dscore_partial.shape)}")
    _check(dscore_partial, "dscore_partial", (layout.n_cap, dscore_partial.shape[1]), torch.float32, dev)
    dscore = torch.empty((T, K), dtype=torch.float32, device=dev) if out is None else out
    _check(dscore, "out (dscore)", (T, K), torch.float32, dev)
    P, block = T * K, 128
    if P:
        launch(_reduce_dscore_kernel, (cdiv(P, block),),
            dscore_partial, layout.pair_row, dscore, P, dscore_partial.shape[1], BLOCK=block, num_warps=4,
        )
    return dscore


def gemm1_dgrad(
    dgate_up_N2F: Tensor, w1_EFD: Tensor, w3_EFD: Tensor, layout: RoutingLayout,
    config: GemmConfig | None = None, *, out: Tensor | None = None,
) -> Tensor:
    """GEMM1 dgrad: dx_rows[r] = dgate[r] @ w1[e] + dup[r] @ w3[e] (one fp32 accumulator over 2F).

    Args:
        dgate_up_N2F: (N_cap, 2F) bf16 from ``gemm2_dgrad_swiglu_bwd``.
        w1_EFD, w3_EFD: (E, F, D) bf16 gate / up projections.
        layout: routing layout with ``block_m == config.block_m``.
        config: launch config (default ``default_bwd_config("gemm1_dgrad", ...)``).
        out: optional (N_cap, D) bf16 caller buffer.

    Returns:
        dx_rows (N_cap, D) bf16 per layout row, zeros on padding rows, rows from ``layout.offsets[E]`` on
        unwritten; ``scatter_dx`` sums the placed rows per token.

    Grid: n_tiles_cap * cdiv(D, BN) programs (grouped order); each owns a BM x BN tile of dx_rows.
    Without ``config``, on sm_90 with BM 128 and D >= ``WS_GEMM1_DGRAD_MIN_DIM``, the warp-specialized Gluon
    kernel (``ws_gemm.ws_gemm1_dgrad``, ``TITAN_MEGAMOE_WS_GEMM1_DGRAD``) computes the same output, bit for bit.
    """
    dev = dgate_up_N2F.device
    if w1_EFD.dim() != 3:
        raise ValueError(f"w1 must be (E, F, D), got {tuple(w1_EFD.shape)}")
    E, F, D = w1_EFD.shape
    _check_layout(layout, dev)
    _check(w1_EFD, "w1", (layout.num_experts, F, D), _ACT, dev)
    _check(w3_EFD, "w3", (layout.num_experts, F, D), _ACT, dev)
    _check(dgate_up_N2F, "dgate_up", (layout.n_cap, 2 * F), _ACT, dev)
    if out is not None:
        _check(out, "out (dx_rows)", (layout.n_cap, D), _ACT, dev)
    if config is None and WS_GEMM1_DGRAD != "0" and layout.block_m == 128 and D >= WS_GEMM1_DGRAD_MIN_DIM:
        ws_cfg = ws_gemm.CONFIGS[WS_GEMM1_DGRAD]
        if ws_gemm.ws_gemm1_dgrad_supported(dgate_up_N2F, w1_EFD, ws_cfg) is None:  # operands checked above
            dx_rows = torch.empty((layout.n_cap, D), dtype=_ACT, device=dev) if out is None else out
            return ws_gemm.launch_gemm1_dgrad(dgate_up_N2F, w1_EFD, w3_EFD, layout, dx_rows, ws_cfg)
    cfg = config or default_bwd_config("gemm1_dgrad", layout, D, F)
    _check_row_config(cfg, layout)
    dx_rows = torch.empty((layout.n_cap, D), dtype=_ACT, device=dev) if out is None else out
    nbd = cdiv(D, cfg.block_n)
    n_tiles = layout.n_tiles_cap
    use_tma = _tma_ok(cfg, dgate_up_N2F, w1_EFD, w3_EFD) and F % 8 == 0  # (N_cap, 2, F) view: F*2 B rows
    if use_tma:
        bk, bn = cfg.block_k, cfg.block_n
        args = (_desc(dgate_up_N2F, [layout.n_cap, 2, F], [cfg.block_m, 1, bk]),
                _desc(w1_EFD, [E, F, D], [1, bk, bn]), _desc(w3_EFD, [E, F, D], [1, bk, bn]))
    else:
        args = (dgate_up_N2F, w1_EFD, w3_EFD)
    if n_tiles * nbd:
        launch(_gemm1_dgrad_kernel, (n_tiles * nbd,),
            *args, layout.row_pair, layout.tile_expert, dx_rows, n_tiles, D, F, nbd,
            BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k, GROUP_M=cfg.group_m, USE_TMA=use_tma,
            **_launch_opts(cfg),
        )
    return dx_rows


#: Largest E whose router dx ``scatter_dx`` adds in its kernel (a (BT, E) @ (E, BD) tl.dot in chunks of 32
#: experts); above, the caller adds it by cuBLAS.
SCATTER_ROUTER_MAX_E = 128


#: ``scatter_dx``'s (tokens, columns, warps) per program; ``scripts/sweep_scatter_dx.py`` times the others.
SCATTER_DX_TILE = (32, 128, 4)


def scatter_dx(dx_rows_ND: Tensor, layout: RoutingLayout, T: int, K: int, *, out: Tensor | None = None,
               router_dlogits: Tensor | None = None, gate_w: Tensor | None = None,
               tile: tuple[int, int, int] | None = None) -> Tensor:
    """dx[t] = sum_k dx_rows[pair_row[t*K + k]] in fp32, k ascending, cast to bf16; with ``router_dlogits`` and
    ``gate_w``, the router's dx ``router_dlogits[t] @ gate_w`` is added in the same fp32 sum first (one
    rounding; saves the separate cuBLAS ``addmm_`` over dx: 52 us at the 30B shape on an H200, docs/NOTES.md
    session 17).

    This gather-sum is where the EP combine of dx will push rows to the source rank.

    Args:
        dx_rows_ND: (N_cap, D) bf16 from ``gemm1_dgrad``.
        layout: the routing layout; T, K: tokens and top_k.
        out: optional (T, D) bf16 caller buffer.
        router_dlogits: optional (T, E) bf16 gradient of the router logits, E <= ``SCATTER_ROUTER_MAX_E``.
        gate_w: (E, D) bf16 gate weight, with ``router_dlogits``.
        tile: (BT tokens, BD columns, warps) per program, powers of two (BT >= 16 with the router's dx: the
            tl.dot's smallest M); default ``SCATTER_DX_TILE``. Every tile gives the same sum order per element.

    Returns:
        (T, D) bf16. Grid: (cdiv(T, BT), cdiv(D, BD)); each program owns a BT x BD tile of dx.

    Raises:
        ValueError: shapes, dtypes or devices that do not match the layout, or only one of
            ``router_dlogits`` / ``gate_w``, or E above ``SCATTER_ROUTER_MAX_E``.
    """
    dev = dx_rows_ND.device
    _check_layout(layout, dev)
    if layout.pair_row.shape[0] != T * K or layout.top_k != K:
        raise ValueError(f"layout was built for {layout.pair_row.shape[0]} pairs and top_k={layout.top_k}, "
                         f"got T={T}, K={K}")
    if dx_rows_ND.dim() != 2:
        raise ValueError(f"dx_rows must be (N_cap, D), got {tuple(dx_rows_ND.shape)}")
    D = dx_rows_ND.shape[1]
    _check(dx_rows_ND, "dx_rows", (layout.n_cap, D), _ACT, dev)
    router = {}
    if (router_dlogits is None) != (gate_w is None):
        raise ValueError("scatter_dx: pass router_dlogits and gate_w together")
    if router_dlogits is not None:
        E = gate_w.shape[0] if gate_w.dim() == 2 else -1
        if not 1 <= E <= SCATTER_ROUTER_MAX_E:
            raise ValueError(f"scatter_dx: gate_w {tuple(gate_w.shape)}: expected (E, {D}) with E <= "
                             f"{SCATTER_ROUTER_MAX_E} (add the router's dx by torch.addmm_ above that)")
        _check(router_dlogits, "router_dlogits", (T, E), _ACT, dev)
        _check(gate_w, "gate_w", (E, D), _ACT, dev)
        router = dict(E=E, E_PAD=max(16, next_pow2(E)), ROUTER=True, INTERPRET=_interpreting())
    dx = torch.empty((T, D), dtype=_ACT, device=dev) if out is None else out
    _check(dx, "out (dx)", (T, D), _ACT, dev)
    bt, bd, warps = SCATTER_DX_TILE if tile is None else tile
    if router and bt < 16:
        raise ValueError(f"scatter_dx: tile {tile} has BT={bt} < 16 rows, too few for the router's dx tl.dot")
    if T * D:
        launch(_scatter_dx_kernel, (cdiv(T, bt), cdiv(D, bd)),
            dx_rows_ND, layout.pair_row, dx, router_dlogits if router else dx, gate_w if router else dx, T, D, K,
            BT=bt, BD=bd, num_warps=warps, **router,
        )
    return dx


# wgrad (step 3) lives in its own file; re-exported so callers keep one import for the backward
from titan_megamoe.kernels.grouped_gemm_wgrad import (  # noqa: E402, F401
    _wgrad_w2_kernel,
    _wgrad_w13_kernel,
    wgrad_w2,
    wgrad_w13,
)
