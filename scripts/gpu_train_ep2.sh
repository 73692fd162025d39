#!/usr/bin/env bash
# GPU (2 H200), issues 5 and 7: training side by side at EP = 2 with megamoe_bf16 (fused
# operator, EP inside it), stock TorchTitan bf16 and FP8, same seed/data/steps, one compare.train invocation per set.
# Call as: REV=<hash> bash scripts/gpu_train_ep2.sh [debug|30b]
source scripts/gpu_env.sh
export TITAN_MEGAMOE_GIT_REV=$REV
set +e
set_name=${1:-debug}
if [ "$set_name" = debug ]; then stem=qwen3_debugmoe; steps=200; else stem=qwen3_30b_a3b_8L; steps=60; fi
python3 -m compare.train --ngpu 2 --steps $steps --skip 10 \
  --configs train_configs/${stem}_megamoe_bf16.toml train_configs/${stem}_baseline_bf16.toml \
            train_configs/${stem}_baseline_fp8.toml \
  --labels megamoe-triton-ep torchtitan-bf16 torchtitan-fp8 \
  --out "$OUT/train_${set_name}_2xh200_ep2.json" 2>&1 | tail -12
