#!/usr/bin/env bash
# GPU (1 H200): the debug model trained 200 steps with megamoe triton, megamoe reference and stock
# TorchTitan, same seed and data, side by side (issue 4, item 7).
source scripts/gpu_env.sh
export TITAN_MEGAMOE_GIT_REV=$REV
python3 -m compare.train --ngpu 1 --steps 200 --skip 10 \
  --configs train_configs/qwen3_debugmoe_1gpu_megamoe_triton_bf16.toml \
            train_configs/qwen3_debugmoe_1gpu_megamoe_reference_bf16.toml \
            train_configs/qwen3_debugmoe_1gpu_baseline_bf16.toml \
  --labels megamoe-triton megamoe-reference torchtitan-baseline \
  --out "$OUT/train_debug_1xh200_triton.json" 2>&1 | tail -20
