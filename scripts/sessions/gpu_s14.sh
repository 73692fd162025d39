#!/usr/bin/env bash
# GPU calls for the next session (written in session 10, which had 1 H200 only).
#   PART=a (1 H200, ~8 min): the opt-in Gluon GEMM1 forward through the GPU suite before it becomes the default:
#     tests/test_gpu.py's single-GPU tests and tests/test_ws_gemm.py with TITAN_MEGAMOE_WS_GEMM1=1 (graph
#     capture, no host sync, real-shape reference); compare.layer EP 1 both shapes with WS_GEMM1=1 beside the
#     defaults; the FP8 rows session 9 meant to re-measure (30B fp8 / fp8_bwd vs stock fp8 compiled, not run
#     since session 8).
#   PART=b / PART=c (2 H200): the EP = 2 runs waiting since session 6 (`scripts/sessions/gpu_s8.sh` PARTs b and c), now also
#     with the Gluon GEMM1 dgrad (default for D >= 2048), which has not run at EP = 2.
# Call as: REV=<hash> PART=a bash scripts/sessions/gpu_s14.sh   (carry .whl; see scripts/gpu_env.sh)
source scripts/gpu_env.sh
session_start
if [ "$PART" = a ]; then
  TITAN_MEGAMOE_WS_GEMM1=1 timeout -s KILL 300 python3 -m pytest -q -rA tests/test_gpu.py tests/test_ws_gemm.py \
    -k "not ep_triton and not reference_ep2" > "$OUT/keep/tests_gpu_ws_gemm1.log" 2>&1
  echo "[t=$((SECONDS - t0))s] gpu tests (WS_GEMM1=1): $(tail -1 "$OUT/keep/tests_gpu_ws_gemm1.log")"
  grep -E "^(FAILED|ERROR)" "$OUT/keep/tests_gpu_ws_gemm1.log" | head
  timeout 300 python3 -m compare.layer --shapes qwen3-30b-a3b,qwen3-235b-a22b --impls tt-compile,megamoe-triton \
    --precisions bf16 --routings random --iters 20 --warmup 5 --device-time --no-plot \
    --switches WS_GEMM1=1 --out "$OUT/keep/layer_1xh200_ep1.json" > "$OUT/layer.log" 2>&1
  echo "[t=$((SECONDS - t0))s] layer rc $?"; grep "^|" "$OUT/layer.log"
  timeout 200 python3 -m compare.layer --shapes qwen3-30b-a3b --impls tt-compile,megamoe-triton --precisions fp8,fp8_bwd \
    --routings random --iters 20 --warmup 5 --device-time --no-plot --out "$OUT/keep/layer_1xh200_ep1_fp8.json" \
    > "$OUT/layer_fp8.log" 2>&1
  echo "[t=$((SECONDS - t0))s] layer fp8 rc $?"; grep "^| qwen" "$OUT/layer_fp8.log"
else
  echo "PART=$PART: run scripts/sessions/gpu_s8.sh with the same PART (see the header)"; exit 2
fi
session_pack s14$PART
