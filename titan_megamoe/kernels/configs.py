"""Launch configurations of the grouped-GEMM kernels: frozen dataclasses and a per-arch heuristic.

Shape legend: D model dim, F expert hidden dim, BM / BN / BK the GEMM tile (rows / columns / reduction).

No user-facing knobs live here (STYLE rule 9): the op picks a config with ``config_for`` and builds the
routing layout with ``config.block_m``, so the layout and both GEMMs always agree on BM.

Why the Hopper defaults (H200, sm_90, 227 KiB shared memory per CTA, DESIGN.md sections 5-6):

* GEMM1 (``"gemm1"``, fused gate + up + SwiGLU): one program owns a BM x BN tile of *both* gate and
  up, so it holds two fp32 accumulators: 128 x 128 each = the register footprint of one 128 x 256 tile
  (128 fp32 registers per thread at 8 warps; the sm_90a build uses 245-251 registers, no spills), the
  shape DESIGN measured best for the pointer-gather GEMM1 (128x256x64, 8 warps). Shared memory per
  stage: x tile 128x64 + w1 tile 128x64 + w3 tile 128x64, bf16 = 48 KiB; 4 stages = 192 KiB.
  BN = 256 per operand would need 256 accumulator registers per thread: spills. BN = 64 with 4 warps
  measured 368 / 400 TF/s (30B / 235B shapes) against 505-522 / 541-549 for 128 x 128 x 64; BK 32
  (6 stages) and BK 128 (2 stages) were no better (502 / 379 at 30B).
* GEMM2 (``"gemm2"``, down projection + score + scatter): one accumulator, so BN = 256 fits the same
  registers (171 used): 128 x 256 x 64, 8 warps, 4 stages (48 KiB per stage = 192 KiB). Measured
  460-471 / 534-535 TF/s against 401-414 / 434-447 for 128 x 128 x 64.
* ``group_m`` = 1 for GEMM1: all column blocks of one row tile run back to back (the tile's gathered x
  rows are re-read from L2, and neighbouring row tiles mostly share an expert's weights); group_m 4 / 8
  / 16 measured within +-3 % of it, in both directions between runs. GEMM2: group_m 8 was faster in
  two runs of 2026-11-29 (486 vs 460 and 505 vs 492 TF/s at 30B), so it is the default there.
* ``use_tma`` = False: weight tiles by pointer loads (cp.async, pipelined like the gathered x rows)
  measured 2-5 % faster than TMA descriptors for GEMM1 (522 vs 501 and 541 vs 530 TF/s in the last
  run); for GEMM2 the two are within 2 % (460 vs 450, 535 vs 546). The TMA path stays selectable and
  tested (CPU interpreter, sm_90a build, and bitwise-equal results on the H200).

Measured on one H200 (triton 3.6, torch 2.11) with ``python tests/test_kernels_fwd.py bench 30b|235b``:
T = 16384, E = 128, K = 8, near-uniform routing, ``triton.testing.do_bench`` median; 30B-A3B shape
D 2048 / F 768, 235B-A22B D 4096 / F 1536. GEMM1 ~522 / ~541 TF/s, GEMM2 ~460 / ~535 TF/s (FLOPs
2*P*D*F per projection): above DESIGN's 477 / 490 for the plain pointer-gather GEMM1, below the
>= 600 TF/s target of DESIGN.md section 5. Tile shapes, stages, group_m and TMA all moved the numbers
by a few percent at most; closing the gap needs a persistent tile scheduler and / or warp
specialization.

Interpreter (CPU, ``TRITON_INTERPRET=1``): small 16 x 16 x 16 tiles, 1 warp, 1 stage, one fixed config
(autotuning with several configs fails in the interpreter, DESIGN.md section 7).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from titan_megamoe.kernels.jit import env_flag

__all__ = ["GemmConfig", "HOPPER_GEMM1", "HOPPER_GEMM2", "interpreter_config", "config_for", "persistent_programs"]


@dataclass(frozen=True)
class GemmConfig:
    """Tile and launch parameters of one grouped GEMM.

    Attributes:
        block_m: BM, rows per tile; must equal the routing layout's ``block_m`` (power of two, >= 16).
        block_n: BN, output columns per program (per operand for GEMM1: gate and up each get BN).
        block_k: BK, reduction step (power of two, >= 16).
        num_warps: warps per program (8 = two Hopper warpgroups).
        num_stages: software-pipeline depth of the K loop.
        group_m: row tiles per L2 group of the tile order: a group's row tiles sweep all column
            blocks before the next group starts (1 = all column blocks of a row tile back to back).
        use_tma: load weight tiles (and GEMM2's contiguous h tiles) through TMA tensor descriptors
            (``tl.make_tensor_descriptor``) instead of pointer loads; GEMM1's gathered x rows always
            use pointer loads. Default False: pointer loads measured faster (module docstring).
        persistent: one program per SM looping over the live tiles in one flattened loop (the next
            tile's operands load under this tile's last steps and epilogue); the kernels that have the
            mode (GEMM2, bf16 and FP8) give bitwise the same results. Pointer loads only. The
            dataclass default is False; GEMM2's Hopper configs turn it on (``PERSISTENT_GEMM2``).
        maxnreg: registers per thread ptxas may use (None: its choice). A cap of 65536 / (2 x threads)
            (128 at 8 warps), with shared memory <= half an SM's, lets two programs share an SM, so
            one's epilogue runs under the other's main loop (``HOPPER_GEMM2_DGRAD_2CTA``).
    """

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 4
    group_m: int = 1
    use_tma: bool = False
    persistent: bool = False
    maxnreg: int | None = None

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"GemmConfig.{name}={v} must be a power of two >= 16 (tl.dot minimum)")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"GemmConfig.num_warps={self.num_warps} must be one of 1, 2, 4, 8, 16")
        if self.num_stages < 1 or self.group_m < 1:
            raise ValueError("GemmConfig.num_stages and group_m must be >= 1")
        if self.persistent and self.use_tma:
            raise ValueError("GemmConfig: persistent=True supports pointer loads only (use_tma=False)")
        if self.maxnreg is not None and not 24 <= self.maxnreg <= 255:
            raise ValueError(f"GemmConfig.maxnreg={self.maxnreg} must be None or in [24, 255] (ptxas' range)")

    def compile_options(self) -> dict:
        """The launch keywords Triton compiles with: num_warps, num_stages and, if set, maxnreg."""
        opts = {"num_warps": self.num_warps, "num_stages": self.num_stages}
        if self.maxnreg is not None:
            opts["maxnreg"] = self.maxnreg
        return opts


#: Hopper defaults (see the module docstring for the arithmetic).
HOPPER_GEMM1 = GemmConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=4, group_m=1, use_tma=False)
HOPPER_GEMM2 = GemmConfig(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=4, group_m=8, use_tma=False)
#: GEMM2 persistent (``GemmConfig.persistent``): one program per SM over a flattened tile x K loop. 3
#: stages: the flattening adds a buffer (sm_90a build at the 30B and 235B shapes: 235 registers, 176 KiB,
#: no spills; 4 stages: 255 registers and 224 KiB, at both limits). On one H200, do_bench of the kernel
#: alone: 0.87 -> 0.93 ms at the 30B shape, 3.19 -> 3.13 ms at 235B
#: (benchmarks/results/bench_fp8_persistent_1xh200_20261201.json); in the layer, where it follows GEMM1
#: at once, the forward's device time went 2.42 -> 2.32 ms at 30B in session 8 (3.80 -> 3.64 ms from
#: idle in session 7): the default for bf16 too.
HOPPER_GEMM2_PERSISTENT = GemmConfig(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3, group_m=8,
                                     persistent=True)
#: TITAN_MEGAMOE_PERSISTENT_GEMM2=0 (read at import): the bf16 GEMM2 runs its grid config.
PERSISTENT_GEMM2 = env_flag("TITAN_MEGAMOE_PERSISTENT_GEMM2", True)
#: GEMM2 dgrad (+ SwiGLU backward) with two programs per SM: its epilogue loads gate_up and stores
#: dgate_up and s*h (160 KB per 128 x 128 tile, ~0.38 ms of DRAM time at the 30B shape) with nothing to
#: hide it under at one program per SM (the default: 4 stages, 131 KB shared, 175 registers). 3 stages
#: (98 KB) and a 128-register cap (sm_90a build: 128 registers, 16 B of stack) fit two per SM, so one's
#: epilogue runs under the other's main loop. Same arithmetic in the same order: bitwise the one-per-SM
#: config's results. One H200 (session 9, benchmarks/results/sweep_gemm2_dgrad_2cta_{30b,235b}_1xh200_20261202.json,
#: do_bench): 1.094 -> 0.956 ms at the 30B shape, 3.339 -> 3.309 ms at 235B; in the layer (same process,
#: layer_1xh200_ep1_s9a_20261202.json) fwd+bwd device time 7.615 -> 7.440 ms and 26.08 -> 25.85 ms. The
#: default; ``TITAN_MEGAMOE_GEMM2_DGRAD_2CTA=0`` (read at import) gives the one-per-SM config back.
#: ``default_bwd_config`` takes num_warps, num_stages and maxnreg from it; the tile stays the one-per-SM
#: config's (the same 128 x 128 x 64 at both measured shapes; it shrinks with small F).
HOPPER_GEMM2_DGRAD_2CTA = GemmConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3, group_m=1,
                                     use_tma=True, maxnreg=128)
GEMM2_DGRAD_2CTA = env_flag("TITAN_MEGAMOE_GEMM2_DGRAD_2CTA", True)
#: GEMM2 dgrad on 128 x 256 tiles, one program per SM, 16 warps: 2 x 2 warpgroups of m64n128, so 128 registers per
#: thread as in the two-per-SM config (sm_90a build: 128 registers, 16 B of stack, 196 KB of shared memory at 4
#: stages). Why: Nsight on one H100 (session 28, benchmarks/results/logs/ncu_gemm2_dgrad_1xh100_s28a_20261206.txt)
#: found the two-per-SM 128 x 128 kernel L2-bound (L2 84 % of peak, tensor pipe 54 %); a 256-column tile halves the
#: gathered dout rows' L2 traffic per FLOP (L2 77 %, tensor pipe 67 %). Interleaved A/B on the same H100
#: (scripts/ab_kernels.py, ab_kernels_1xh100_s28a_20261206.json, bitwise the same outputs): 235B 3.577 -> 3.131 ms,
#: 30B 1.047 -> 0.999 (3 stages: 3.342 / 1.103). The default where F % 256 == 0 and D >= GEMM2_DGRAD_2CTA_MIN_DIM;
#: ``TITAN_MEGAMOE_GEMM2_DGRAD_WIDE=0`` (read at import) gives the two-per-SM config back.
HOPPER_GEMM2_DGRAD_WIDE = GemmConfig(block_m=128, block_n=256, block_k=64, num_warps=16, num_stages=4, group_m=1,
                                     use_tma=True, maxnreg=128)
GEMM2_DGRAD_WIDE = env_flag("TITAN_MEGAMOE_GEMM2_DGRAD_WIDE", True)
#: Model dims from which the two-per-SM GEMM2 dgrad applies: measured at D = 2048 and 4096 only. The debug
#: model (D = 256) trained at 110,832 / 105,633 tokens/s/GPU with it and 114,292 / 130,846 without, one
#: process each on one H200 (train_debug_2cta*_s9_20261202.json): no gain shown, within this host's
#: run-to-run spread, so small dims keep the one-per-SM config.
GEMM2_DGRAD_2CTA_MIN_DIM = 2048
#: TITAN_MEGAMOE_PERSISTENT_GEMM2_FP8=0 (read at import): the FP8 GEMM2 runs its grid config. On by
#: default: 0.78 -> 0.71 ms at 30B, 2.61 -> 2.51 ms at 235B (same file), bitwise the grid kernel's output.
PERSISTENT_GEMM2_FP8 = env_flag("TITAN_MEGAMOE_PERSISTENT_GEMM2_FP8", True)


def interpreter_config() -> GemmConfig:
    """The one fixed config for the Triton interpreter on CPU: small tiles keep tests fast."""
    # group_m=2 (not the GPU's 1) so the CPU tests exercise the grouped tile remap; same default path
    # (pointer loads) as the GPU configs.
    return GemmConfig(block_m=16, block_n=16, block_k=16, num_warps=1, num_stages=1, group_m=2, use_tma=False)


def _pow2_at_most(n: int, cap: int) -> int:
    """Largest power of two <= min(n, cap), at least 16."""
    p = 16
    while p * 2 <= min(n, cap):
        p *= 2
    return p


@functools.lru_cache(maxsize=None)  # launchers ask on every launch; the answer is fixed per (kind, D, F)
def config_for(kind: str, D: int, F: int, interpret: bool) -> GemmConfig:
    """Pick the launch config of ``kind`` ("gemm1" or "gemm2") for a layer with dims D and F.

    BM is the same for both kinds (the two GEMMs share one routing layout). Column and reduction
    blocks shrink to the problem for tiny dims (debug shapes) so no program computes mostly padding.
    """
    if kind not in ("gemm1", "gemm2"):
        raise ValueError(f"config_for: unknown kind {kind!r}; choose 'gemm1' or 'gemm2'")
    if interpret:
        return interpreter_config()
    base = HOPPER_GEMM1 if kind == "gemm1" else (HOPPER_GEMM2_PERSISTENT if PERSISTENT_GEMM2 else HOPPER_GEMM2)
    return _sized(base, kind, D, F)


@functools.lru_cache(maxsize=None)
def _sized(base: GemmConfig, kind: str, D: int, F: int) -> GemmConfig:
    """``base`` with its column / reduction blocks shrunk to the dims; cached (a frozen dataclass built on
    every launch cost ~3 us of host time before GEMM1, which the forward waits on)."""
    n_dim, k_dim = (F, D) if kind == "gemm1" else (D, F)
    block_n = _pow2_at_most(n_dim, base.block_n)
    block_k = _pow2_at_most(k_dim, base.block_k)
    return GemmConfig(
        block_m=base.block_m, block_n=block_n, block_k=block_k, num_warps=base.num_warps,
        num_stages=base.num_stages, group_m=base.group_m, use_tma=base.use_tma, persistent=base.persistent,
    )


#: Programs of a persistent kernel in the interpreter: several tiles per program, so CPU tests cover
#: the tile loop.
INTERPRETER_PROGRAMS = 3


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    import torch

    return torch.cuda.get_device_properties(device_index).multi_processor_count


def persistent_programs(device, n_work: int, interpret: bool) -> int:
    """Grid size of a persistent kernel: one program per SM (the flattened GEMM2 kernels hold one CTA
    per SM: 223-244 registers x 256 threads), never more than ``n_work`` (an upper bound of the tiles),
    at least 1; ``INTERPRETER_PROGRAMS`` in the interpreter."""
    if interpret or device.type != "cuda":
        return max(1, min(INTERPRETER_PROGRAMS, n_work))
    import torch

    index = device.index if device.index is not None else torch.cuda.current_device()
    return max(1, min(_sm_count(index), n_work))
