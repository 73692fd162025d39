#!/usr/bin/env bash
# GPU calls of session 20 (1 H200 asked; say in the results which card ran).
#   PART=a: session 19's final state (both Gluon FP8 kernels on by default; was gpu_s19.sh PART n, never run):
#     the FP8 GPU tests (test_gpu.py's op tests at the 30B shape, test_ws_gemm_fp8.py), compare.profile of the fp8
#     layer at 30B (where the FP8 step's device time goes, per kernel), then compare.layer bf16 / fp8 / fp8_bwd
#     beside stock compiled at both shapes.
# Call as: REV=<hash> PART=a bash scripts/gpu_s20.sh   (carry .whl; see scripts/gpu_env.sh)
source scripts/gpu_env.sh
session_start
if [ "$PART" = a ]; then
  timeout -s KILL 120 python3 -m pytest -q -rA tests/test_gpu.py tests/test_ws_gemm_fp8.py -k "fp8 and not builds_for_sm90a" \
    > "$OUT/keep/tests_gpu_a.log" 2>&1
  echo "[t=$((SECONDS - t0))s] gpu tests: $(tail -1 "$OUT/keep/tests_gpu_a.log")"; grep -E "^(FAILED|ERROR)" "$OUT/keep/tests_gpu_a.log" | head || true
  timeout 70 python3 -m compare.profile --shape qwen3-30b-a3b --impl megamoe-triton --precision fp8 --iters 5 \
    --top 30 --out "$OUT/keep/profile_30b_fp8.json" > "$OUT/keep/profile_30b_fp8.log" 2>&1
  echo "[t=$((SECONDS - t0))s] profile rc $?"; tail -34 "$OUT/keep/profile_30b_fp8.log" | cut -c1-150
  timeout 340 python3 -m compare.layer --shapes qwen3-30b-a3b,qwen3-235b-a22b --impls tt-compile,megamoe-triton \
    --precisions bf16,fp8,fp8_bwd --routings random --iters 15 --warmup 5 --device-time --no-plot \
    --out "$OUT/keep/layer_ep1_fp8.json" > "$OUT/keep/layer_fp8.log" 2>&1
  echo "[t=$((SECONDS - t0))s] layer rc $?"; grep "^| qwen3" "$OUT/keep/layer_fp8.log" | head -12
fi
session_pack "s20$PART"
