#!/usr/bin/env bash
# GPU (1 H200), issue 4 after wgrad_w13 v2 / tuned configs / Triton routing: op + layer tests at real
# shapes, compare.layer EP=1 (30B, 235B) beside stock compiled and eager, a per-kernel profile with
# host-enqueue times, and a sweep of the changed kernels at both shapes.
source scripts/gpu_env.sh
export TITAN_MEGAMOE_GIT_REV=$REV
set +e
timeout 150 python3 -m pytest tests/test_triton_op.py tests/test_gpu.py tests/test_routing.py -k "triton or routing" -q -rs 2>&1 | tail -5 | tee "$OUT/gpu_tests.log"
timeout 200 python3 -m compare.layer --shapes qwen3-30b-a3b,qwen3-235b-a22b --impls tt-eager,tt-compile,megamoe-triton \
  --precisions bf16 --routings random --iters 20 --warmup 5 --out "$OUT/layer_1xh200_ep1_triton.json" 2>&1 | grep "^|\|GEMM\|rror"
timeout 45 python3 -m compare.profile --shape qwen3-30b-a3b --impl megamoe-triton --top 12 --out "$OUT/profile_30b_megamoe-triton.json" 2>&1 | grep -v "Warn\|warn"
for s in 30b 235b; do
  timeout 70 python3 scripts/sweep_kernel_configs.py $s --kinds wgrad_w13,gemm1_dgrad --out "$OUT/sweep_$s.json" 2>&1 | grep '"best"\|rror\|"default": true'
done
