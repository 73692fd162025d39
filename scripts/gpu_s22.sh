#!/usr/bin/env bash
# GPU calls of session 22 (1 H200 asked; say in the results which card ran).
#   PART=a: session 21's final defaults (Gluon FP8 wgrad on, the fused eager FP8 node, the switches.override fix, the
#     lazy weight-cache counter), which no GPU ran together: (1) the FP8 GPU tests through the layer and the op;
#     (2) compare.layer, stock TorchTitan compiled beside megamoe bf16 / fp8 / fp8_bwd, 30B then 235B (one process
#     per shape, so a time-out keeps the first JSON).
# Call as: REV=<hash> PART=a bash scripts/gpu_s22.sh   (carry .whl; see scripts/gpu_env.sh)
source scripts/gpu_env.sh
session_start
layer() {  # layer TAG SHAPE PRECISIONS LIMIT_S [more compare.layer args]
  local tag=$1 shape=$2 prec=$3 lim=$4; shift 4
  timeout "$lim" python3 -m compare.layer --shapes "$shape" --impls tt-compile,megamoe-triton --precisions "$prec" \
    --routings random --iters 10 --warmup 3 --device-time --no-plot --out "$OUT/keep/layer_$tag.json" "$@" \
    > "$OUT/keep/layer_$tag.log" 2>&1
  echo "[t=$((SECONDS - t0))s] layer $tag rc $?"; grep "^| qwen3" "$OUT/keep/layer_$tag.log" | head -24
}
if [ "$PART" = a ]; then
  timeout -s KILL 90 python3 -m pytest -q -rA tests/test_eager_layer.py tests/test_gpu.py -k fp8 -p no:cacheprovider \
    > "$OUT/keep/tests_gpu_a.log" 2>&1
  echo "[t=$((SECONDS - t0))s] gpu tests: $(tail -1 "$OUT/keep/tests_gpu_a.log")"; grep -E "^(FAILED|ERROR)" "$OUT/keep/tests_gpu_a.log" | head || true
  layer 30b qwen3-30b-a3b bf16,fp8,fp8_bwd 220
  lim=$((560 - SECONDS + t0)); [ "$lim" -lt 10 ] && lim=10
  layer 235b qwen3-235b-a22b bf16,fp8 "$lim"
fi
# PART=b: why the Gluon FP8 GEMM2 dgrad's epilogue is slow (session 21: its s * h column amax pass ~26 us per tile):
#   global-timer stamps inside each consumer's tiles (launch_gemm2_dgrad_fp8(trace=...)), for the default two-pass
#   epilogue, the same without the amax pass (ablate 1) and the one-pass epilogue (2; checked bitwise against 1);
#   then the kernel's GPU tests (the stamps and the epilogue switch changed its signature).
if [ "$PART" = b ]; then
  timeout 150 python3 scripts/bench_ws_gemm.py trace-g2d-fp8 --shapes 30b,235b --out "$OUT/keep/trace_g2d_fp8.json" \
    > "$OUT/keep/trace_g2d_fp8.log" 2>&1
  echo "[t=$((SECONDS - t0))s] trace rc $?"; cut -c1-200 "$OUT/keep/trace_g2d_fp8.log" | tail -60
  timeout -s KILL 100 python3 -m pytest -q -rA tests/test_ws_gemm2_dgrad_fp8.py -p no:cacheprovider \
    > "$OUT/keep/tests_gpu_b.log" 2>&1
  echo "[t=$((SECONDS - t0))s] gpu tests: $(tail -1 "$OUT/keep/tests_gpu_b.log")"; grep -E "^(FAILED|ERROR)" "$OUT/keep/tests_gpu_b.log" | head || true
fi
session_pack "s22$PART"
