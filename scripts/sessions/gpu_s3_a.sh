#!/usr/bin/env bash
# GPU (2 H200), session 3 call A: GPU tests of the Triton path after the refactors (EP=1 routing / op /
# CUDA graph, EP=2 worker incl. CUDA-graph capture), then compare.layer at EP=2, both Qwen3 shapes,
# megamoe-triton beside stock TorchTitan compiled bf16 and fp8, same run.
# Call as: REV=<hash> bash scripts/sessions/gpu_s3_a.sh
source scripts/gpu_env.sh
export TITAN_MEGAMOE_GIT_REV=$REV
set +e
timeout 200 python3 -m pytest tests/test_routing.py tests/test_gpu.py -k "triton or routing" -q -rs 2>&1 | grep -v "Warn\|warn" | tail -6 | tee "$OUT/gpu_tests.log"
timeout 330 python3 -m torch.distributed.run --standalone --nproc_per_node 2 -m compare.layer \
  --shapes qwen3-30b-a3b,qwen3-235b-a22b --impls tt-compile,megamoe-triton --precisions bf16,fp8 \
  --routings random --iters 20 --warmup 5 --out "$OUT/layer_2xh200_ep2_triton.json" 2>&1 | grep "^|\|GEMM\|rror\|Traceback" | head -40
rm -f "$OUT/gpu.txt"; ls "$OUT"
