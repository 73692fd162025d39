#!/usr/bin/env bash
# GPU session part B2: compare.layer at EP=1 (one H200) for both shapes, and EP=2 with the skewed and
# replayed (captured from the trained debug model) routings on the 30B shape.
source scripts/gpu_env.sh
export TITAN_MEGAMOE_GIT_REV=${REV:-unknown}
CUDA_VISIBLE_DEVICES=0 timeout 280 python3 -m compare.layer --shapes qwen3-30b-a3b,qwen3-235b-a22b \
  --impls tt-eager,tt-compile,megamoe-reference --precisions bf16,fp8 --routings random \
  --out "$OUT/layer_1xh200_ep1.json" 2>&1 | grep "^|\|GEMM" 
timeout 250 torchrun --standalone --nproc_per_node 2 -m compare.layer --shapes qwen3-30b-a3b \
  --impls tt-eager,tt-compile,megamoe-reference --precisions bf16 \
  --routings skewed,replay:benchmarks/results/routing_debugmoe_layer4_20261129.pt \
  --out "$OUT/layer_2xh200_ep2_routings.json" 2>&1 | grep "^|\|GEMM"
