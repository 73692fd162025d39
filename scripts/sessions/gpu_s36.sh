#!/usr/bin/env bash
# GPU calls of session 36. PART a: today's tree on the GPU first (GPU tests after the default backend became "triton";
# the Gluon FP8 GEMM2 dgrad's tile timeline; the 30B layer in every precision beside stock TorchTitan compiled), then
# the counter schedule's probes (session 33's ticket fix) if time is left. PART b: the ping-pong FP8 GEMM2 dgrad
# (session 36): its GPU tests, the A/B against the Triton kernel and the cooperative Gluon one, the layer with it.
# PART c: WS_GEMM2_DGRAD_FP8=auto (the default now) in the layer beside the Triton kernel, and the FP8 op / node tests.
# Call as: REV=<hash> PART=a|b|c [BUDGET=seconds] bash scripts/sessions/gpu_s36.sh   (carry .whl; see scripts/gpu_env.sh)
source scripts/gpu_env.sh
session_start
if [ "$PART" = a ]; then
  gpu_tests head_a tests/test_gpu.py tests/test_ws_gemm2_dgrad_fp8.py tests/test_eager_layer.py -k "gpu or fp8"
  timeout $(left 90) python3 scripts/bench_ws_gemm.py trace-g2d-fp8 --out "$OUT/keep/trace_g2d_fp8_a.json" \
    > "$OUT/keep/trace_g2d_fp8_a.log" 2>&1; echo "[t=$((SECONDS - t0))s] trace rc $?"; cat "$OUT/keep/trace_g2d_fp8_a.log" | head -30
  [ "$(left 200)" -ge 120 ] && layer_ab 30b_a "" qwen3-30b-a3b bf16,fp8,fp8_bwd tt-compile,megamoe-triton 8
  if [ "$(left 100)" -ge 80 ] && probe p1 --programs 1 && probe pall && probe p30b --shape 16384,128,8,2048,768; then
    echo "counter schedule: the probes returned"
  fi
fi
if [ "$PART" = b ]; then  # the ping-pong FP8 GEMM2 dgrad: GPU tests (each case bitwise the cooperative kernel), then timings
  timeout -s KILL $(left 170) python3 -m pytest -q -rfE tests/test_ws_gemm2_dgrad_fp8.py -p no:cacheprovider \
    > "$OUT/keep/tests_gpu_pingpong_b.log" 2>&1
  echo "[t=$((SECONDS - t0))s] ping-pong GPU tests: $(tail -1 "$OUT/keep/tests_gpu_pingpong_b.log")"
  grep -E "^(FAILED|ERROR)|^E  " "$OUT/keep/tests_gpu_pingpong_b.log" | head -12
  if grep -q " passed" "$OUT/keep/tests_gpu_pingpong_b.log" && ! grep -q "failed" "$OUT/keep/tests_gpu_pingpong_b.log"; then
    timeout $(left 60) python3 scripts/bench_ws_gemm.py trace-g2d-fp8-pingpong --out "$OUT/keep/trace_g2d_fp8_pp_b.json" \
      > "$OUT/keep/trace_g2d_fp8_pp_b.log" 2>&1; echo "[t=$((SECONDS - t0))s] trace rc $?"; head -24 "$OUT/keep/trace_g2d_fp8_pp_b.log"
    timeout $(left 120) python3 scripts/ab_kernels.py --shapes 30b,235b --rounds 8 --groups gemm2_dgrad_fp8 \
      --out "$OUT/keep/ab_kernels_g2d_fp8_b.json" > "$OUT/keep/ab_kernels_g2d_fp8_b.log" 2>&1
    echo "[t=$((SECONDS - t0))s] ab rc $?"; grep -E "^(30b|235b)" "$OUT/keep/ab_kernels_g2d_fp8_b.log"
    [ "$(left 200)" -ge 90 ] && layer_ab 30b_pp_b "WS_GEMM2_DGRAD_FP8=pingpong" qwen3-30b-a3b bf16,fp8,fp8_bwd megamoe-triton 8
    [ "$(left 200)" -ge 110 ] && layer_ab 235b_pp_b "WS_GEMM2_DGRAD_FP8=pingpong" qwen3-235b-a22b bf16,fp8 megamoe-triton 8
    if [ "$(left 120)" -ge 60 ]; then  # the FP8 op and fused layer node through the ping-pong kernel
      TITAN_MEGAMOE_WS_GEMM2_DGRAD_FP8=pingpong timeout -s KILL $(left 120) python3 -m pytest -q -rfE tests/test_fp8_op.py \
        tests/test_eager_layer.py -k "fp8 and not fast_forward" -p no:cacheprovider > "$OUT/keep/tests_gpu_pp_op_b.log" 2>&1
      echo "[t=$((SECONDS - t0))s] FP8 op / node GPU tests with the ping-pong kernel: $(tail -1 "$OUT/keep/tests_gpu_pp_op_b.log")"
      grep -E "^(FAILED|ERROR)|^E  " "$OUT/keep/tests_gpu_pp_op_b.log" | head -12
    fi
  fi
fi
if [ "$PART" = c ]; then  # WS_GEMM2_DGRAD_FP8=auto the default: the layer beside the Triton kernel (=0), then the tests
  layer_ab 235b_c "WS_GEMM2_DGRAD_FP8=0 WS_GEMM2_DGRAD_FP8=pingpong" qwen3-235b-a22b fp8 megamoe-triton 8
  [ "$(left 100)" -ge 50 ] && layer_ab 30b_c "WS_GEMM2_DGRAD_FP8=0" qwen3-30b-a3b fp8,fp8_bwd megamoe-triton 8
  if [ "$(left 100)" -ge 40 ]; then
    timeout -s KILL $(left 100) python3 -m pytest -q -rfE tests/test_fp8_op.py tests/test_eager_layer.py \
      -k "fp8 and not fast_forward" -p no:cacheprovider > "$OUT/keep/tests_gpu_auto_c.log" 2>&1
    echo "[t=$((SECONDS - t0))s] FP8 op / node GPU tests at the auto default: $(tail -1 "$OUT/keep/tests_gpu_auto_c.log")"
    grep -E "^(FAILED|ERROR)|^E  " "$OUT/keep/tests_gpu_auto_c.log" | head -12
  fi
fi
(cd "$OUT/keep" && tar czf "logs_keep_$PART.tgz" *.log 2>/dev/null && rm -f *.log)  # few files come back
session_pack "s36$PART"
