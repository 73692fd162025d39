#!/usr/bin/env bash
# GPU calls of session 24 (1 H200 asked; say in the results which card ran).
# Call as: REV=<hash> PART=a bash scripts/sessions/gpu_s24.sh   (carry .whl; see scripts/gpu_env.sh)
# PARTs a-d ran at the revisions named in benchmarks/results/README.md; the wgrad's pipelined consumer and
# scripts/bench_fp8_prefetch.py were removed after PART d (both slower), so PARTs a, c and d run only at theirs. PART f
# (the 128 x 256 wgrad tiles) moved to gpu_s25.sh PART a.
source scripts/gpu_env.sh
session_start
wgrad_ncu() {  # wgrad_ncu TAG: Nsight Compute on the FP8 wgrad kernels at 30B (Triton, Gluon configs)
  timeout 200 "$(ncu_bin)" --clock-control none --launch-count 16 -k "regex:_wgrad_fp8" \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section SchedulerStats \
    --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,lts__t_bytes.sum.per_second,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active" \
    python3 scripts/bench_wgrad_fp8.py --shapes 30b --ncu > "$OUT/keep/ncu_wgrad_$1.txt" 2> "$OUT/keep/ncu_wgrad_$1.err"
  echo "[t=$((SECONDS - t0))s] ncu rc $?"
  awk '/^  _/{print; next} /Duration|Compute \(SM\) Throughput|Memory Throughput|L2 Cache Throughput|DRAM Throughput|L1\/TEX Hit|L2 Hit|lts__t_bytes|gmma_cycles|Achieved Occupancy|Issued Warp|stalled/' \
    "$OUT/keep/ncu_wgrad_$1.txt" | awk '$NF+0 >= 0.15 || !/stalled/' | cut -c1-120 | head -150
  tail -3 "$OUT/keep/ncu_wgrad_$1.err" | cut -c1-200
}
# PART=a: the FP8 wgrad's pipelined consumer (ws_wgrad_fp8 pipeline=True: steps in pairs, one MMA in flight while the
#   other half is scaled; two output staging buffers): (1) GPU tests (bitwise v1 and the Triton wgrad); (2)
#   bench_wgrad_fp8.py, Triton / Gluon v1 / pipelined, 30B and 235B; (3) Nsight Compute on the three at 30B (is the
#   kernel L2-bound or issue-bound); (4) on an H200 only: compare.layer bf16 beside stock TorchTitan (issue 4).
if [ "$PART" = a ]; then
  gpu_tests a tests/test_ws_wgrad_fp8.py
  timeout 200 python3 scripts/bench_wgrad_fp8.py --out "$OUT/keep/bench_wgrad_fp8_a.json" > "$OUT/keep/bench_wgrad_fp8_a.log" 2>&1
  echo "[t=$((SECONDS - t0))s] bench rc $?"; grep -v "^{" "$OUT/keep/bench_wgrad_fp8_a.log" | cut -c1-230 | tail -14
  wgrad_ncu a
  if grep -q H200 "$OUT/gpu.txt"; then
    layer_ab 30b_bf16_a "" qwen3-30b-a3b bf16 tt-compile,megamoe-triton
    layer_ab 235b_bf16_a "" qwen3-235b-a22b bf16 tt-compile,megamoe-triton
  fi
fi
# PART=b: where the Gluon FP8 wgrad's time goes (PART a: the pipelined consumer gained 0-6 %; Nsight Compute: L2 at
#   5.1-5.3 TB/s, 43-48 % of its peak, long-scoreboard and barrier stalls): bench_wgrad_fp8.py --ablate, v1 with the
#   per-step scale loads, the scaling, the output stores, the MMAs or the per-step partials left out.
if [ "$PART" = b ]; then
  timeout 300 python3 scripts/bench_wgrad_fp8.py --ablate --out "$OUT/keep/bench_wgrad_fp8_b.json" > "$OUT/keep/bench_wgrad_fp8_b.log" 2>&1
  echo "[t=$((SECONDS - t0))s] bench rc $?"; grep -v "^{" "$OUT/keep/bench_wgrad_fp8_b.log" | cut -c1-160 | tail -40
fi
# PART=c: the FP8 wgrad's scale rows by TMA into each stage (smem_scales, the default; PART b: the per-step global
#   scale loads cost dw2 0.66 vs 0.50 ms): (1) GPU tests (bitwise v1, the pipelined consumer and the Triton wgrad);
#   (2) bench_wgrad_fp8.py, 30B and 235B; (3) compare.layer fp8 / fp8_bwd 30B and fp8 235B with
#   FP8_WGRAD_SMEM_SCALES=0 rows, same process per shape.
if [ "$PART" = c ]; then
  gpu_tests c tests/test_ws_wgrad_fp8.py
  timeout 200 python3 scripts/bench_wgrad_fp8.py --out "$OUT/keep/bench_wgrad_fp8_c.json" > "$OUT/keep/bench_wgrad_fp8_c.log" 2>&1
  echo "[t=$((SECONDS - t0))s] bench rc $?"; grep -v "^{" "$OUT/keep/bench_wgrad_fp8_c.log" | cut -c1-200 | tail -24
  layer_ab 30b_fp8_c FP8_WGRAD_SMEM_SCALES=0 qwen3-30b-a3b fp8,fp8_bwd
  layer_ab 235b_fp8_c FP8_WGRAD_SMEM_SCALES=0 qwen3-235b-a22b fp8
fi
# PART=d: (1) GPU tests of the FP8 wgrad (every consumer bitwise the others and the Triton wgrad) and of the Gluon FP8
#   GEMMs with their scales loaded a step ahead (FP8_SCALE_PREFETCH, default; bitwise the Triton kernels); (2)
#   bench_wgrad_fp8.py (smem / pipe consumers) and bench_fp8_prefetch.py, 30B and 235B; (3) compare.layer 30B and 235B,
#   bf16 and fp8, megamoe rows with FP8_WGRAD_CONSUMER=pipe, =v1 and FP8_SCALE_PREFETCH=0, same process per shape.
if [ "$PART" = d ]; then
  gpu_tests d tests/test_ws_wgrad_fp8.py tests/test_ws_gemm_fp8.py
  timeout 150 python3 scripts/bench_wgrad_fp8.py --out "$OUT/keep/bench_wgrad_fp8_d.json" > "$OUT/keep/bench_wgrad_fp8_d.log" 2>&1
  echo "[t=$((SECONDS - t0))s] bench rc $?"; grep -v "^{" "$OUT/keep/bench_wgrad_fp8_d.log" | grep gluon | cut -c1-150 | tail -20
  timeout 120 python3 scripts/bench_fp8_prefetch.py --out "$OUT/keep/bench_fp8_prefetch_d.json" > "$OUT/keep/bench_fp8_prefetch_d.log" 2>&1
  echo "[t=$((SECONDS - t0))s] bench rc $?"; cut -c1-150 "$OUT/keep/bench_fp8_prefetch_d.log" | tail -18
  sw="FP8_WGRAD_CONSUMER=pipe FP8_WGRAD_CONSUMER=v1 FP8_SCALE_PREFETCH=0"
  layer_ab 30b_d "$sw" qwen3-30b-a3b bf16,fp8 megamoe-triton 10
  layer_ab 235b_d "$sw" qwen3-235b-a22b bf16,fp8 megamoe-triton 10
fi
# PART=e: the final tree (the FP8 wgrad's scale rows by TMA, the pipelined consumer and the scale prefetch of PART d
#   removed: both slower): (1) GPU tests of the FP8 wgrad and GEMMs; (2) compare.layer with stock TorchTitan compiled in
#   the same process, 30B bf16 / fp8 / fp8_bwd, then 235B bf16 / fp8.
if [ "$PART" = e ]; then
  gpu_tests e tests/test_ws_wgrad_fp8.py tests/test_ws_gemm_fp8.py
  layer_ab 30b_e "" qwen3-30b-a3b bf16,fp8,fp8_bwd tt-compile,megamoe-triton 8
  layer_ab 235b_e "" qwen3-235b-a22b bf16,fp8 tt-compile,megamoe-triton 8
fi
session_pack "s24$PART"
