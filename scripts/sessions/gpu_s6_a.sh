#!/usr/bin/env bash
# GPU (2 H200), session 6 draft (branch fused-dgu): dgate_up quantized in gemm2_dgrad's epilogue
# (TITAN_MEGAMOE_FP8_FUSED_DGU=1, fp8_backend.FUSED_DGU_QUANT) vs the separate dual pass (default).
# 1. compiled correctness: the fused outputs bitwise equal to the dual pass (kernel test, CASES) and the
#    op's gradients bitwise equal with the flag on / off (test_fp8_op), on one GPU;
# 2. scripts/bench_fp8.py (one GPU, EP = 1 layout, both shapes): gemm2_dgrad_quant_dgu/fp8 against
#    gemm2_dgrad/fp8 + quant_dgate_up_dual/fp8, and the compiled fused outputs bitwise vs the dual pass;
# 3. compare.ep_overlap EP 2, fp8 mode v1, both shapes, flag off then on (records say fused_dgu_quant):
#    predicted (30B) bwd.quant_dgate_up 0.8 ms gone, bwd.gemm2_dgrad +0 .. +0.3 ms (epilogue at 255
#    registers), FP8 backward -0.6 .. -1.0 ms; risk: register pressure slows GEMM2 dgrad by more.
# 4. PART=c: compare.ep_overlap fp8 v1 with the bf16 grouped-mm weight gradients (the existing diagnosis
#    switch TITAN_MEGAMOE_FP8_WGRAD=bf16, never timed at EP 2): the FP8 wgrads (2.8 ms at 30B) plus their
#    two transposed quant passes (~0.9) against the bf16 grouped-mm wgrads (2.4 incl. gathers); accuracy of
#    that mix is in fp8_ablation_*_20261130.json. If it is faster, it is a candidate speed option.
# Calls (each under the 10-minute command limit): PART=a (steps 1-2, ~4 min), PART=b (step 3, ~6 min),
# PART=c (step 4, ~3 min).
# Call as: REV=<hash> PART=a bash scripts/sessions/gpu_s6_a.sh
source scripts/gpu_env.sh
export TITAN_MEGAMOE_GIT_REV=$REV
set +e
t0=$SECONDS
PART=${PART:-a}
if [ "$PART" = a ]; then
timeout 150 python3 -m pytest -q -rA tests/test_kernels_fp8_bwd.py tests/test_fp8_op.py -k "fused or gemm2_dgrad or dual" \
  > "$OUT/tests.log" 2>&1
echo "[t=$((SECONDS - t0))s] tests rc $?"; grep -E "passed|failed|Error|differs" "$OUT/tests.log" | head -12
timeout 200 python3 scripts/bench_fp8.py --shapes 30b,235b > "$OUT/bench_fp8.json" 2> "$OUT/bench_fp8.log"
echo "[t=$((SECONDS - t0))s] bench_fp8 rc $?"; grep "gemm2_dgrad\|quant_dgate_up" "$OUT/bench_fp8.log"
grep -o '"gemm2_dgrad_quant_dgu_bitwise_dual": [a-z]*' "$OUT/bench_fp8.json"
fi
if [ "$PART" = b ]; then
for flag in 0 1; do
  mkdir -p "$OUT/fused$flag"
  REV=$REV OUT="$OUT/fused$flag" TITAN_MEGAMOE_FP8_FUSED_DGU=$flag PRECISIONS=fp8 MODES=v1 TIMEOUT=180 \
    bash scripts/gpu_ep_overlap.sh > /dev/null 2>&1
  echo "[t=$((SECONDS - t0))s] ep_overlap fp8 v1 FUSED_DGU=$flag"
  grep "^| qwen\|^phases" "$OUT/fused$flag/ep_overlap.log" | head -12
done
fi
if [ "$PART" = c ]; then
  mkdir -p "$OUT/wgrad_bf16"
  REV=$REV OUT="$OUT/wgrad_bf16" TITAN_MEGAMOE_FP8_WGRAD=bf16 PRECISIONS=fp8 MODES=v1 TIMEOUT=180 \
    bash scripts/gpu_ep_overlap.sh > /dev/null 2>&1
  echo "[t=$((SECONDS - t0))s] ep_overlap fp8 v1 TITAN_MEGAMOE_FP8_WGRAD=bf16"
  grep "^| qwen\|^phases" "$OUT/wgrad_bf16/ep_overlap.log" | head -12
fi
