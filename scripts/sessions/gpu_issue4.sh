#!/usr/bin/env bash
# GPU (1 H200), issue 4 evidence in one call: Triton op tests at real shapes (incl. CUDA graph),
# compare.layer EP=1 for both Qwen3 shapes beside stock TorchTitan, per-kernel profiles and kernel benches.
source scripts/gpu_env.sh
export TITAN_MEGAMOE_GIT_REV=$REV
set +e
timeout 150 python3 -m pytest tests/test_triton_op.py tests/test_gpu.py -k "triton" -q -rs 2>&1 | tail -15 > "$OUT/gpu_triton_tests.log"
cat "$OUT/gpu_triton_tests.log"
timeout 240 python3 -m compare.layer --shapes qwen3-30b-a3b,qwen3-235b-a22b --impls tt-eager,tt-compile,megamoe-triton \
  --precisions bf16 --routings random --iters 20 --warmup 5 --out "$OUT/layer_1xh200_ep1_triton.json" 2>&1 | grep "^|\|GEMM\|rror"
for impl in megamoe-triton tt-compile; do
  timeout 60 python3 -m compare.profile --shape qwen3-30b-a3b --impl $impl --top 14 --out "$OUT/profile_30b_$impl.json" 2>&1 | grep -v Warning
done
timeout 50 python3 tests/test_kernels_fwd.py bench 30b 2>&1 | tail -9
timeout 50 python3 tests/test_kernels_bwd.py gpu 30b 2>&1 | tail -12
