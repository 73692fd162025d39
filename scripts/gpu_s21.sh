#!/usr/bin/env bash
# GPU calls of session 21 (1 H200 asked; say in the results which card ran).
#   PART=a: (1) the FP8 op GPU tests with the gathered 128x1 pass at 8 warps as the default (session 20 ran it only
#     as a sweep variant); (2) compare.profile of the fp8 layer at 30B with TITAN_MEGAMOE_WS_WGRAD_FP8=1: does the
#     Gluon FP8 wgrad run in the layer, and for how long (session 20: -1.1 ms at kernel level, +0.02 ms in the
#     layer, unexplained); (3) compare.layer bf16 / fp8 / fp8_bwd beside stock compiled at both shapes, with
#     WS_WGRAD_FP8=1 rows (same process).
# Call as: REV=<hash> PART=a bash scripts/gpu_s21.sh   (carry .whl; see scripts/gpu_env.sh)
source scripts/gpu_env.sh
session_start
if [ "$PART" = a ]; then
  timeout -s KILL 110 python3 -m pytest -q -rA tests/test_gpu.py tests/test_ws_wgrad_fp8.py -k "fp8 and not builds_for_sm90a" \
    -p no:cacheprovider > "$OUT/keep/tests_gpu_a.log" 2>&1
  echo "[t=$((SECONDS - t0))s] gpu tests: $(tail -1 "$OUT/keep/tests_gpu_a.log")"; grep -E "^(FAILED|ERROR)" "$OUT/keep/tests_gpu_a.log" | head || true
  TITAN_MEGAMOE_WS_WGRAD_FP8=1 timeout 70 python3 -m compare.profile --shape qwen3-30b-a3b --impl megamoe-triton \
    --precision fp8 --iters 5 --top 16 --out "$OUT/keep/profile_30b_fp8_wswgrad.json" > "$OUT/keep/profile_30b_fp8_wswgrad.log" 2>&1
  echo "[t=$((SECONDS - t0))s] profile rc $?"; tail -20 "$OUT/keep/profile_30b_fp8_wswgrad.log" | cut -c1-130
  lim=$((560 - SECONDS + t0)); [ "$lim" -lt 10 ] && lim=10
  timeout "$lim" python3 -m compare.layer --shapes qwen3-30b-a3b,qwen3-235b-a22b --impls tt-compile,megamoe-triton \
    --precisions bf16,fp8,fp8_bwd --routings random --iters 10 --warmup 3 --device-time --no-plot \
    --switches WS_WGRAD_FP8=1 --out "$OUT/keep/layer_ep1_fp8.json" > "$OUT/keep/layer_fp8.log" 2>&1
  echo "[t=$((SECONDS - t0))s] layer rc $?"; grep "^| qwen3" "$OUT/keep/layer_fp8.log" | head -24
fi
session_pack "s21$PART"
