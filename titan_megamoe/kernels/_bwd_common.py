"""Shared pieces of the backward kernels (``grouped_gemm_bwd.py`` dgrad, ``grouped_gemm_wgrad.py``
wgrad): interpreter switches, launch configs, argument checks, TMA descriptors."""

from __future__ import annotations

import dataclasses
import functools

import torch
from torch import Tensor
from triton.tools.tensor_descriptor import TensorDescriptor

from titan_megamoe.kernels import configs
from titan_megamoe.kernels.configs import GemmConfig, _pow2_at_most, config_for
from titan_megamoe.kernels.jit import interpreting as _interpreting
from titan_megamoe.kernels.routing import RoutingLayout

# --------------------------------------------------------------------------------------------------
# Launch helpers
# --------------------------------------------------------------------------------------------------

def default_bwd_config(kind: str, layout: RoutingLayout, D: int, F: int) -> GemmConfig:
    """Frozen launch config of backward kernel ``kind`` ("gemm2_dgrad", "gemm1_dgrad", "wgrad_w2",
    "wgrad_w13"), from ``configs.config_for`` (the dgrad kernels share the forward GEMMs' shapes).

    gemm2_dgrad (N over F, K over D) has GEMM1's shape, gemm1_dgrad (N over D, K over F) GEMM2's; BM is
    the layout's. wgrad: BM x BN output tile of the weight, BK = 64 rows per step, 8 warps, GEMM2's
    stages. TMA (contiguous operands) vs pointer loads per kernel, as measured on one H200 (median ms,
    16384 tokens, top-8, 128 experts, 30B-A3B / 235B-A22B shapes): gemm2_dgrad (+ s*h store) TMA
    1.09 / 3.50 vs pointer 1.14 / 3.63; wgrad_w2 from stored s*h TMA 1.04 / 4.17 vs 1.12 / 4.69;
    gemm1_dgrad pointer 1.34 / 5.39 vs TMA 1.70; wgrad_w13 pointer 2.23-2.56 / 9.44 vs TMA 3.19.
    Sweep of 2026-11-29 at the 30B shape (``scripts/sweep_kernel_configs.py``,
    benchmarks/results/sweep_kernels_30b_1xh200_20261130.json): gemm1_dgrad 3 stages 1.34 vs 4 stages
    1.45 ms; wider (BN 256) or deeper (BK 128) wgrad tiles were 8-40 % slower; TMA for gemm2_dgrad
    1.10 vs 1.14 and wgrad_w2 1.00 vs 1.10. wgrad_w13 (v2, two accumulators sharing the x gather,
    48 KiB per stage): 5 stages 2.23 ms vs 4 stages 2.94 at the 30B shape (v1 best 2.54). gemm2_dgrad
    since session 9 (D >= 2048): ``configs.HOPPER_GEMM2_DGRAD_2CTA``'s 3 stages and 128 registers, two
    programs per SM: 0.956 / 3.309 ms against 1.094 / 3.339 for the 4-stage one-per-SM config. Since
    session 28 (F % 256 == 0): ``configs.HOPPER_GEMM2_DGRAD_WIDE``, 128 x 256 tiles at 16 warps, one program per SM
    (one H100, interleaved: 0.999 / 3.131 ms against 1.047 / 3.577 for the two-per-SM config).
    """
    return _default_bwd_config(kind, layout.block_m, D, F, _interpreting())


@functools.lru_cache(maxsize=None)  # asked on every launch; fixed per (kind, BM, D, F, mode)
def _default_bwd_config(kind: str, block_m: int, D: int, F: int, interp: bool) -> GemmConfig:
    if kind == "gemm2_dgrad":
        cfg = dataclasses.replace(config_for("gemm1", D, F, interp), block_m=block_m, use_tma=not interp)
        # the attribute, so switches.override can flip it; D >= 2048: where it was measured (the 30B and
        # 235B shapes); the debug model's training (D = 256) was within noise either way, so it keeps
        # the one-per-SM config there
        wide = configs.HOPPER_GEMM2_DGRAD_WIDE
        # F % 256 == 0: the shapes measured (F = 768, 1536); others keep the two-per-SM config
        if configs.GEMM2_DGRAD_WIDE and not interp and D >= configs.GEMM2_DGRAD_2CTA_MIN_DIM and F % wide.block_n == 0:
            return dataclasses.replace(cfg, block_n=wide.block_n, num_warps=wide.num_warps,
                                       num_stages=wide.num_stages, maxnreg=wide.maxnreg)
        if configs.GEMM2_DGRAD_2CTA and not interp and D >= configs.GEMM2_DGRAD_2CTA_MIN_DIM:
            two = configs.HOPPER_GEMM2_DGRAD_2CTA
            cfg = dataclasses.replace(cfg, num_warps=two.num_warps, num_stages=two.num_stages, maxnreg=two.maxnreg)
        return cfg
    if kind == "gemm1_dgrad":
        cfg = dataclasses.replace(config_for("gemm2", D, F, interp), persistent=False)  # no persistent mode here
        return dataclasses.replace(cfg, block_m=block_m, use_tma=False, group_m=1,
                                   num_stages=cfg.num_stages if interp else 3)
    if kind in ("wgrad_w2", "wgrad_w13"):
        base = dataclasses.replace(config_for("gemm2", D, F, interp), persistent=False)
        if interp:
            return dataclasses.replace(base, block_m=16, block_n=16, block_k=16)
        m_dim, n_dim = (D, F) if kind == "wgrad_w2" else (F, D)
        return dataclasses.replace(base, block_m=_pow2_at_most(m_dim, 128), block_n=_pow2_at_most(n_dim, 128),
                                   block_k=64, group_m=1, use_tma=kind == "wgrad_w2",
                                   num_stages=4 if kind == "wgrad_w2" else 5)
    raise ValueError(f"unknown backward kernel kind {kind!r}; choose gemm2_dgrad, gemm1_dgrad, "
                     "wgrad_w2 or wgrad_w13")


def _check(t: Tensor, name: str, shape: tuple, dtype, device) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    if isinstance(dtype, tuple):
        if t.dtype not in dtype:
            raise ValueError(f"{name} must be one of {dtype}, got {t.dtype}")
    elif t.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {t.dtype}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")


def _check_layout(layout: RoutingLayout, device) -> None:
    for name in ("counts", "offsets", "row_pair", "pair_row", "tile_expert"):
        t = getattr(layout, name)
        if t.dtype != torch.int32 or t.device != device or not t.is_contiguous():
            raise ValueError(f"layout.{name} must be a contiguous int32 tensor on {device}")
    if layout.n_cap != layout.n_tiles_cap * layout.block_m:
        raise ValueError("layout.row_pair length must be n_tiles_cap * block_m")


def _check_row_config(cfg: GemmConfig, layout: RoutingLayout) -> None:
    if cfg.block_m != layout.block_m:
        raise ValueError(f"config.block_m={cfg.block_m} must equal layout.block_m={layout.block_m}: "
                         "one program owns one row tile of the layout")


def _tma_ok(cfg: GemmConfig, *tensors: Tensor) -> bool:
    """TMA needs 16-byte aligned bases and non-last strides (so D, F multiples of 8 in bf16)."""
    if not cfg.use_tma:
        return False
    for t in tensors:
        if t.data_ptr() % 16 or any((s * t.element_size()) % 16 for s in t.stride()[:-1]):
            return False
    return True


def _desc(t: Tensor, shape: list[int], block: list[int]) -> TensorDescriptor:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.insert(0, acc)
        acc *= n
    return TensorDescriptor(t, shape, strides, block)


def _launch_opts(cfg: GemmConfig) -> dict:
    # The interpreter drops these keywords; INTERPRET feeds fp32 to tl.dot there (bf16 dot is garbage).
    return {**cfg.compile_options(), "INTERPRET": _interpreting()}


_ACT = torch.bfloat16
_WGRAD_DTYPES = (torch.bfloat16, torch.float32)
