#!/usr/bin/env bash
# GPU calls planned in session 37 for session 38 (one GPU; PART a ran at 31868e8, PART b did not: see gpu_s39.sh).
# PART a: (1) the FP8 Gluon GEMMs' GPU tests (the scale prefetch, Fp8WsConfig.prefetch, bitwise the default) and
#   their A/B (scale prefetch rows in the three FP8 groups); (2) the 235B layer in every precision beside stock
#   compiled with today's defaults (the wide FP8 GEMM1 dgrad / GEMM2: README's 235B fp8 row predates them); between
#   them the FP8 wgrad's GPU tests and A/B (two output staging tiles per consumer, session 38), and the 30B fp8 layer
#   with h quantized in the GEMM1 epilogue (FP8_GEMM1_QUANT_H, session 38; its bitwise test and ab rows run with the
#   FP8 GEMM group).
# PART b: scripts/gpu_ci.sh (the H100 baselines), then the debug model 300 steps in bf16 / fp8 / fp8_bwd (issue 6's
#   accuracy item with today's FP8 kernels; the committed runs are from 2026-11-30's kernels).
# Call as: REV=<hash> PART=a|b [BUDGET=seconds] bash scripts/sessions/gpu_s38.sh   (carry .whl; see scripts/gpu_env.sh)
source scripts/gpu_env.sh
session_start
if [ "$PART" = a ]; then
  fp8_gemm_tests_ab a
  [ "$(left 300)" -ge 150 ] && layer_ab 30b_a FP8_GEMM1_QUANT_H=1 qwen3-30b-a3b fp8 megamoe-triton
  wgrad_fp8_tests_ab a
  [ "$(left 300)" -ge 180 ] && layer_ab 235b_a FP8_GEMM1_QUANT_H=1 qwen3-235b-a22b bf16,fp8,fp8_bwd tt-compile,megamoe-triton 12
fi
if [ "$PART" = b ]; then
  ci_and_debug_train_fp8 b
fi
(cd "$OUT/keep" && tar czf "logs_keep_$PART.tgz" *.log 2>/dev/null && rm -f *.log)  # few files come back
session_pack "s38$PART"
