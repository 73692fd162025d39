#!/usr/bin/env bash
# GPU calls planned in session 36 for the next session (one GPU).
# PART a: (1) the launch-equivalence test on a GPU (its subprocess now keeps the machine's wheel path); (2) Nsight
#   Compute on the Gluon FP8 GEMMs at 30B beside a dense rowwise e4m3 GEMM, the FP8 GEMM2 dgrad's two schedules
#   included: stall reasons and L2 throughput (session 36's hypothesis: the gathered-row main loops are bound by the
#   L2 -> SM stream); (3) the wide FP8 tiles (FP8_FWD_WIDE, FP8_DGRAD_WIDE, FP8_GEMM2_WIDE): GPU tests, kernel A/B,
#   the 30B fp8 layer with them on; (4) the counter schedule's GPU tests and A/B (its probes returned in session 36).
# PART b: scripts/gpu_ci.sh (the H100 baselines), then the debug model 300 steps in bf16 / fp8 / fp8_bwd (issue 6's
#   accuracy item with today's FP8 kernels). PART c: both layer shapes in every precision beside stock compiled.
# Call as: REV=<hash> PART=a|b|c [BUDGET=seconds] bash scripts/sessions/gpu_s37.sh   (carry .whl; see scripts/gpu_env.sh)
source scripts/gpu_env.sh
session_start
if [ "$PART" = a ]; then
  gpu_tests fast_a tests/test_eager_layer.py -k "fast_forward"
  # the wide FP8 tiles (GEMM1 forward: session 36; GEMM1 dgrad, GEMM2 forward: session 37; CPU-built): GPU tests
  # (bitwise the default tiles, poisoned outputs), kernel A/B, then the layer with all three switched on
  if fp8_gemm_tests_ab wide_a; then
    [ "$(left 200)" -ge 90 ] && layer_ab 30b_wide_a \
      "FP8_FWD_WIDE=1,FP8_DGRAD_WIDE=1,FP8_GEMM2_WIDE=1" qwen3-30b-a3b fp8 megamoe-triton 8
  fi
  [ "$(left 250)" -ge 150 ] && ncu_fp8 a 20
  [ "$(left 200)" -ge 120 ] && dynamic_tests_ab
fi
if [ "$PART" = b ]; then
  ci_and_debug_train_fp8 b
fi
if [ "$PART" = c ]; then  # both layer shapes in every precision beside stock compiled, today's defaults (the wide
  # FP8 GEMM1 dgrad / GEMM2 on since PART a) and a row with those two off; the launch-equivalence test again (fixed)
  [ "${SKIP_FAST:-0}" = 1 ] || gpu_tests fast_c tests/test_eager_layer.py -k "fast_forward"
  layer_ab 30b_c "FP8_DGRAD_WIDE=0,FP8_GEMM2_WIDE=0" qwen3-30b-a3b ${PRECS_30B:-bf16,fp8,fp8_bwd} \
    tt-compile,megamoe-triton 12
  [ "$(left 300)" -ge 150 ] && layer_ab 235b_c "FP8_DGRAD_WIDE=0,FP8_GEMM2_WIDE=0" qwen3-235b-a22b bf16,fp8,fp8_bwd \
    tt-compile,megamoe-triton 12
fi
(cd "$OUT/keep" && tar czf "logs_keep_$PART.tgz" *.log 2>/dev/null && rm -f *.log)  # few files come back
session_pack "s37$PART"
