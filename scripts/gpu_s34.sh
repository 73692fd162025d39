#!/usr/bin/env bash
# GPU calls of session 34 (planned in session 33; the FP8 forward's launch halves added and run first): (1) the counter schedule with session 33's ticket fix (every
# thread of the producer partition issues the atomic; the scalar form's broadcast lacked reconvergence in the SASS):
# one launch per process, killed at 25 s, then its GPU tests and its A/B if the probes return; (2) issue 4 on an H200
# if one comes (both shapes beside stock at today's defaults, run first). Say in the results which card ran.
# Call as: REV=<hash> PART=a|b|c [BUDGET=seconds] bash scripts/gpu_s34.sh   (b: the counter schedule alone; c: Nsight on the FP8 GEMMs)   (carry .whl; see scripts/gpu_env.sh)
source scripts/gpu_env.sh
session_start
probe() {  # probe TAG ARGS...: one counter-schedule launch in its own process, killed at 25 s
  timeout -s KILL 25 python3 scripts/probe_dynamic.py "${@:2}" > "$OUT/keep/probe_dynamic_$1.log" 2>&1
  local rc=$?; echo "[t=$((SECONDS - t0))s] probe $1 rc $rc: $(tail -1 "$OUT/keep/probe_dynamic_$1.log" | cut -c1-220)"
  return $rc
}
counter_schedule() {  # the counter schedule with session 33's ticket fix: the probes, then its tests and A/B if they return
  if [ "$(left 200)" -ge 80 ] && probe p1 --programs 1 && probe pall && probe p30b --shape 16384,128,8,2048,768; then
    TITAN_MEGAMOE_TEST_DYNAMIC=1 timeout -s KILL $(left 150) python3 -m pytest -q -rfE -x tests/test_ws_gemm.py \
      -k "on_gpu and dynamic" -p no:cacheprovider > "$OUT/keep/tests_gpu_dynamic_a.log" 2>&1
    echo "[t=$((SECONDS - t0))s] dynamic GPU tests: $(tail -1 "$OUT/keep/tests_gpu_dynamic_a.log")"
    grep -E "^(FAILED|ERROR)|^E  " "$OUT/keep/tests_gpu_dynamic_a.log" | head -12
    timeout $(left 150) python3 scripts/ab_kernels.py --shapes 235b,30b --rounds 8 --unfence-dynamic \
      --groups gemm1_dgrad_dynamic,gemm1_fwd_dynamic --out "$OUT/keep/ab_kernels_dynamic_a.json" \
      > "$OUT/keep/ab_kernels_dynamic_a.log" 2>&1
    echo "[t=$((SECONDS - t0))s] ab dynamic rc $?"; grep -E "^(30b|235b)" "$OUT/keep/ab_kernels_dynamic_a.log"
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
  timeout $(left 240) "$(ncu_bin)" --clock-control none --launch-skip 1 --launch-count 12 \
    -k "regex:_fp8_ws_kernel|gemm|nvjet|sm90|cutlass|device_kernel" --section SpeedOfLight --section SchedulerStats \
    --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,lts__t_bytes.sum.per_second,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,sm__cycles_elapsed.avg.per_second" \
    python3 scripts/ncu_gemm_fp8.py --shape 30b > "$OUT/keep/ncu_gemm_fp8_c.txt" 2> "$OUT/keep/ncu_gemm_fp8_c.err"
  echo "[t=$((SECONDS - t0))s] ncu rc $?"
  awk '/^  [_a-zA-Z]/{print; next} /Duration|Compute \(SM\) Throughput|Memory Throughput|L2 Cache Throughput|DRAM Throughput|lts__t_bytes|gmma_cycles|per_second|Issued Warp|stalled/' \
    "$OUT/keep/ncu_gemm_fp8_c.txt" | awk '$NF+0 >= 0.15 || !/stalled/' | cut -c1-120 | head -160
  tail -3 "$OUT/keep/ncu_gemm_fp8_c.err" | cut -c1-200
  timeout $(left 60) python3 scripts/ncu_gemm_fp8.py --shape 30b --time
fi
(cd "$OUT/keep" && tar czf "logs_keep_$PART.tgz" *.log 2>/dev/null && rm -f *.log)  # few files come back
session_pack "s34$PART"
