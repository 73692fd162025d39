#!/usr/bin/env bash
# Short GPU check (1 H200) of the fused Triton backend: op tests compiled (real shapes, CUDA graph),
# then compare.layer EP=1 on the 30B shape beside stock TorchTitan.
source scripts/gpu_env.sh
export TITAN_MEGAMOE_GIT_REV=$REV
timeout 110 python3 -m pytest tests/test_triton_op.py tests/test_gpu.py -k "triton" -x -q 2>&1 | tail -12 | tee "$OUT/gpu_triton_tests.log"
timeout 80 python3 -m compare.layer --shapes qwen3-30b-a3b --impls tt-eager,tt-compile,megamoe-triton \
  --precisions bf16 --routings random --iters 10 --warmup 3 --out "$OUT/layer_1xh200_ep1_triton.json" 2>&1 | grep "^|\|GEMM"
