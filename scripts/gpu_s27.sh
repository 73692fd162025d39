#!/usr/bin/env bash
# GPU calls of session 27 (say in the results which card ran).
# Call as: REV=<hash> PART=a bash scripts/gpu_s27.sh   (carry .whl; see scripts/gpu_env.sh)
source scripts/gpu_env.sh
session_start
# PART=a: (1) on an H200 only: issue 4's measurement, bf16 beside stock TorchTitan compiled at both shapes (fp8 rows
#   too, for issue 6); (2) the FP8 GPU tests with GEMM2_DGRAD_FP8_2CTA=1 (session 26's run was cut after 21 passes),
#   before making it the default at D <= 2048; (3) where the bf16 235B step goes now (the last profile is session 9's).
if [ "$PART" = a ]; then
  if grep -q H200 "$OUT/gpu.txt"; then
    layer_ab 30b_a "" qwen3-30b-a3b bf16,fp8 tt-compile,megamoe-triton
    layer_ab 235b_a "" qwen3-235b-a22b bf16,fp8 tt-compile,megamoe-triton
  fi
  TITAN_MEGAMOE_GEMM2_DGRAD_FP8_2CTA=1 gpu_tests 2cta_a tests/test_kernels_fp8_bwd.py tests/test_gpu.py \
    tests/test_eager_layer.py -k "fp8"
  timeout 100 python3 -m compare.profile --shape qwen3-235b-a22b --impl megamoe-triton --precision bf16 --iters 5 \
    --top 16 --out "$OUT/keep/profile_235b_bf16_a.json" > "$OUT/keep/profile_235b_bf16_a.log" 2>&1
  echo "[t=$((SECONDS - t0))s] profile 235B bf16 rc $?"; tail -20 "$OUT/keep/profile_235b_bf16_a.log" | cut -c1-140
fi
session_pack "s27$PART"
