#!/usr/bin/env bash
# GPU (1 H200), issue 4 closing evidence: GPU tests of the Triton path (routing kernels compiled, op vs
# reference at real shapes, CUDA graph, no host sync), compare.layer EP=1 (30B, 235B) and the debug-model
# training with backend = "triton" vs "reference" vs stock TorchTitan (200 steps, compare.train).
source scripts/gpu_env.sh
export TITAN_MEGAMOE_GIT_REV=$REV
set +e
timeout 100 python3 -m pytest tests/test_routing.py tests/test_gpu.py -k "triton or routing" -q -rs 2>&1 | grep -v "Warn\|warn" | tail -8 | tee "$OUT/gpu_tests.log"
timeout 160 python3 -m compare.layer --shapes qwen3-30b-a3b,qwen3-235b-a22b --impls tt-eager,tt-compile,megamoe-triton \
  --precisions bf16 --routings random --iters 20 --warmup 5 --out "$OUT/layer_1xh200_ep1_triton.json" 2>&1 | grep "^|\|GEMM\|rror"
timeout 280 bash scripts/gpu_triton_train.sh 2>&1 | tail -14
rm -f "$OUT/gpu.txt" "$OUT/layer_1xh200_ep1_triton.png"; ls "$OUT"  # at most 8 files come back
