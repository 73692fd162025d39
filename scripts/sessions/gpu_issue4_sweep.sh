#!/usr/bin/env bash
# GPU (1 H200): no-host-sync layer test, compare.layer EP=1 (30B, 235B) after the sync / zero-fill fixes,
# then the kernel config sweep at the 30B shape (JSON lines tee'd under $OUT, so partial results return).
source scripts/gpu_env.sh
export TITAN_MEGAMOE_GIT_REV=$REV
set +e
timeout 60 python3 -m pytest tests/test_gpu.py -k "no_host_sync" -q -rs 2>&1 | tail -4
timeout 170 python3 -m compare.layer --shapes qwen3-30b-a3b,qwen3-235b-a22b --impls tt-compile,megamoe-triton \
  --precisions bf16 --routings random --iters 20 --warmup 5 --out "$OUT/layer_1xh200_ep1_triton_v2.json" 2>&1 | grep "^|\|GEMM\|rror"
timeout ${SWEEP_S:-300} python3 scripts/sweep_kernel_configs.py 30b --kinds ${KINDS:-wgrad_w13,wgrad_w2,gemm2_dgrad,gemm2,gemm1_dgrad,gemm1} 2>&1 \
  | grep -v Warn | tee "$OUT/sweep_30b.jsonl" | grep '"best"\|rror'
