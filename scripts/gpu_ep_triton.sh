#!/usr/bin/env bash
# GPU (2 H200), issue 5: the EP Triton backend's 2-GPU test (vs reference, edge cases, bitwise repeat),
# then compare.layer at EP=2 for both Qwen3 shapes beside stock TorchTitan (bf16 and fp8, eager and
# compile), same run. Call as: REV=<hash> bash scripts/gpu_ep_triton.sh
source scripts/gpu_env.sh
export TITAN_MEGAMOE_GIT_REV=$REV
set +e
timeout 200 python3 -m pytest tests/test_gpu.py -k "ep_triton" -q -rs 2>&1 | tail -4 | tee "$OUT/gpu_tests.log"
timeout 330 python3 -m torch.distributed.run --standalone --nproc_per_node 2 -m compare.layer \
  --shapes qwen3-30b-a3b,qwen3-235b-a22b --impls tt-eager,tt-compile,megamoe-triton --precisions bf16,fp8 \
  --routings random --iters 20 --warmup 5 --out "$OUT/layer_2xh200_ep2_triton.json" 2>&1 | grep "^|\|GEMM\|rror"
