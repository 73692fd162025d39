#!/usr/bin/env bash
# GPU calls planned in session 32 (after its one H100 call, scripts/sessions/gpu_s31.sh PART a): issue 4's layers beside stock at
# the new defaults (expert-order GEMM1 tiles, Gluon GEMM2 forward) on whatever card comes (an H200 is the issue's),
# the FP8 rows (the FP8 node's host path changed, and fp8_bwd's forward takes the new bf16 defaults), the padding-skip
# A/B again (its forward skip lost 16 % at 235B in the A/B but not in the layer), then a bounded probe of the counter
# schedule's hang. Say in the results which card ran.
# Call as: REV=<hash> PART=a [BUDGET=seconds] bash scripts/sessions/gpu_s32.sh   (carry .whl; see scripts/gpu_env.sh)
source scripts/gpu_env.sh
session_start
ab() {  # ab TAG SHAPES ROUNDS CAP GROUPS
  timeout $(left $4) python3 scripts/ab_kernels.py --shapes "$2" --rounds "$3" --groups "$5" \
    --out "$OUT/keep/ab_kernels_$1.json" > "$OUT/ab_kernels_$1.log" 2>&1
  echo "[t=$((SECONDS - t0))s] ab_kernels $1 rc $?"; grep -E "^(30b|235b)" "$OUT/ab_kernels_$1.log"; tail -3 "$OUT/ab_kernels_$1.log"
}
if [ "$PART" = a ]; then
  # issue 4: both shapes beside stock compiled, today's defaults, and session 31's state as a same-process row
  layer_ab 235b_a "WS_GEMM1_EXPERT_ORDER=0,WS_GEMM2=0 WGRAD_TRIM_K=1" qwen3-235b-a22b bf16 tt-compile,megamoe-triton 6
  [ "$(left 200)" -ge 90 ] && layer_ab 30b_a "WS_GEMM1_EXPERT_ORDER=0,WS_GEMM2=0" qwen3-30b-a3b bf16 tt-compile,megamoe-triton 6
  [ "$(left 200)" -ge 80 ] && gpu_tests op_a tests/test_gpu.py tests/test_ws_gemm2.py \
    -k "real_shapes or cuda_graph or no_host_sync or fp8 or on_gpu"
  # FP8 at EP = 1 beside stock fp8 compiled (issue 6's rows on one GPU)
  [ "$(left 200)" -ge 100 ] && layer_ab 30b_fp8_a "" qwen3-30b-a3b bf16,fp8,fp8_bwd tt-compile,megamoe-triton 8
  [ "$(left 200)" -ge 60 ] && ab skip_a 235b,30b 8 120 gemm1_fwd_skip,gemm1_dgrad_skip,wgrad_w13_trim,wgrad_w2_trim
  # the counter schedule's hang, bounded: its GPU tests (fenced off by default) one at a time, first the smallest
  [ "$(left 100)" -ge 60 ] && TITAN_MEGAMOE_TEST_DYNAMIC=1 timeout -s KILL 60 python3 -u -m pytest -v -x -s \
    tests/test_ws_gemm.py -k "on_gpu and dynamic and top1" -p no:cacheprovider > "$OUT/keep/tests_gpu_dynamic_a.log" 2>&1
  echo "[t=$((SECONDS - t0))s] dynamic probe rc $?: $(tail -2 "$OUT/keep/tests_gpu_dynamic_a.log" | head -1)"
  mv "$OUT"/keep/*.log "$OUT"/ 2>/dev/null
fi
# PART=c: for a call with ~250-400 s: the 235B layer beside stock at today's defaults, then the 30B one.
if [ "$PART" = c ]; then
  layer_ab 235b_c "" qwen3-235b-a22b bf16 tt-compile,megamoe-triton 4
  [ "$(left 200)" -ge 90 ] && layer_ab 30b_c "" qwen3-30b-a3b bf16 tt-compile,megamoe-triton 4
  mv "$OUT"/keep/*.log "$OUT"/ 2>/dev/null
fi
session_pack "s32$PART"
