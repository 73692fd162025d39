#!/usr/bin/env bash
# GPU calls of session 34 (planned in session 33; the FP8 forward's launch halves added and run first): (1) the counter schedule with session 33's ticket fix (every
# thread of the producer partition issues the atomic; the scalar form's broadcast lacked reconvergence in the SASS):
# one launch per process, killed at 25 s, then its GPU tests and its A/B if the probes return; (2) issue 4 on an H200
# if one comes (both shapes beside stock at today's defaults, run first). Say in the results which card ran.
# Call as: REV=<hash> PART=a|b|c [BUDGET=seconds] bash scripts/sessions/gpu_s34.sh   (b: the counter schedule alone; c: Nsight on the FP8 GEMMs)   (carry .whl; see scripts/gpu_env.sh)
source scripts/gpu_env.sh
session_start
counter_schedule() {  # the counter schedule with session 33's ticket fix: the probes, then its tests and A/B if they return
  if [ "$(left 200)" -ge 80 ] && probe p1 --programs 1 && probe pall && probe p30b --shape 16384,128,8,2048,768; then
    dynamic_tests_ab
  fi
}
if [ "$PART" = a ]; then
  if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then  # issue 4 names an H200: first
    layer_ab 30b_h200 "" qwen3-30b-a3b bf16 tt-compile,megamoe-triton 4
    layer_ab 235b_h200 "" qwen3-235b-a22b bf16 tt-compile,megamoe-triton 4
  fi
  # session 34's default first: the FP8 forward through the launch halves (FP8_FAST_FWD): the fused FP8 node's GPU
  # tests (bitwise the modular path), then the 30B layer with the switch on and off in one process
  TITAN_MEGAMOE_TEST_DYNAMIC=0 timeout -s KILL $(left 150) python3 -m pytest -q -rfE tests/test_eager_layer.py \
    -k "fp8 and not fast_forward" -p no:cacheprovider > "$OUT/keep/tests_gpu_fp8_fast_a.log" 2>&1
  echo "[t=$((SECONDS - t0))s] fp8 node GPU tests: $(tail -1 "$OUT/keep/tests_gpu_fp8_fast_a.log")"
  grep -E "^(FAILED|ERROR)|^E  " "$OUT/keep/tests_gpu_fp8_fast_a.log" | head -12
  [ "$(left 200)" -ge 100 ] && layer_ab 30b_fp8_fast_a "FP8_FAST_FWD=0" qwen3-30b-a3b bf16,fp8 megamoe-triton 8
  counter_schedule
fi
[ "$PART" = b ] && counter_schedule  # the counter schedule alone (a short call)
if [ "$PART" = c ]; then  # (session 35) the FP8 GEMMs' stall reasons at 30B beside a dense rowwise e4m3 GEMM
  ncu_fp8 c 12
fi
(cd "$OUT/keep" && tar czf "logs_keep_$PART.tgz" *.log 2>/dev/null && rm -f *.log)  # few files come back
session_pack "s34$PART"
