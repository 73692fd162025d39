#!/usr/bin/env bash
# GPU calls of session 27 (say in the results which card ran).
# Call as: REV=<hash> PART=a bash scripts/gpu_s27.sh   (carry .whl; see scripts/gpu_env.sh)
source scripts/gpu_env.sh
session_start
# PART=a: (1) on an H200 only: issue 4's measurement, bf16 beside stock TorchTitan compiled at both shapes (fp8 rows
#   too, for issue 6); (2) the FP8 GPU tests with GEMM2_DGRAD_FP8_2CTA=1 (session 26's run was cut after 21 passes),
#   before making it the default at D <= 2048 (last, with what time is left); (3) where the bf16 235B step goes now (the last profile is session 9's); (4) Nsight Compute on a dense cuBLAS GEMM and
#   the bf16 Gluon GEMM1 dgrad / GEMM1 at 235B: is L2 -> SM bandwidth what holds them at ~620 TF/s? (scripts/ncu_gemm_l2.py)
if [ "$PART" = a ]; then
  if grep -q H200 "$OUT/gpu.txt"; then
    layer_ab 30b_a "" qwen3-30b-a3b bf16,fp8 tt-compile,megamoe-triton
    layer_ab 235b_a "" qwen3-235b-a22b bf16,fp8 tt-compile,megamoe-triton
  fi
  timeout 150 "$(ncu_bin)" --clock-control none -k "regex:gemm|nvjet|_ws_kernel" --launch-count 9 \
    --section SpeedOfLight --metrics "gpu__time_duration.sum,sm__cycles_elapsed.avg.per_second,lts__t_bytes.sum.per_second,dram__bytes.sum.per_second,sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed,lts__throughput.avg.pct_of_peak_sustained_elapsed" \
    python3 scripts/ncu_gemm_l2.py > "$OUT/keep/ncu_gemm_l2_a.txt" 2> "$OUT/keep/ncu_gemm_l2_a.err"
  echo "[t=$((SECONDS - t0))s] ncu rc $?"
  grep -E "^  [a-zA-Z_]|Duration|Frequency|Throughput|per_second|pct_of_peak|gmma.sum|time_duration" "$OUT/keep/ncu_gemm_l2_a.txt" \
    | cut -c1-130 | head -90
  tail -3 "$OUT/keep/ncu_gemm_l2_a.err" | cut -c1-200
  timeout 60 python3 scripts/ncu_gemm_l2.py --time
  timeout 100 python3 -m compare.profile --shape qwen3-235b-a22b --impl megamoe-triton --precision bf16 --iters 5 \
    --top 16 --out "$OUT/keep/profile_235b_bf16_a.json" > "$OUT/keep/profile_235b_bf16_a.log" 2>&1
  echo "[t=$((SECONDS - t0))s] profile 235B bf16 rc $?"; tail -20 "$OUT/keep/profile_235b_bf16_a.log" | cut -c1-140
  TITAN_MEGAMOE_GEMM2_DGRAD_FP8_2CTA=1 gpu_tests 2cta_a tests/test_kernels_fp8_bwd.py tests/test_gpu.py \
    tests/test_eager_layer.py -k "fp8"
fi
session_pack "s27$PART"
