#!/usr/bin/env bash
# GPU (2 H200), issue 5 item 5: where the EP layer's time goes. compare.ep_overlap at EP=2 for both Qwen3
# shapes, 16384 tokens/rank, random routing, overlap modes v1 and v2 (MODES=v1 for v1 only): full fwd / fwd+bwd vs communication alone vs compute alone,
# the overlap fraction, per-phase CUDA events and a profiler summary (top kernels, idle gap).
# Files under $OUT (<= 6): gpu.txt, ep_overlap_2xh200.json, ep_overlap.log. ~2-4 minutes (most of it
# Triton JIT on a fresh machine). Call as: REV=<hash> bash scripts/gpu_ep_overlap.sh
source scripts/gpu_env.sh
export TITAN_MEGAMOE_GIT_REV=$REV
MODES=${MODES:-v1,v2}
set +e
timeout 225 python3 -m torch.distributed.run --standalone --nproc_per_node 2 -m compare.ep_overlap \
  --shapes qwen3-30b-a3b,qwen3-235b-a22b --tokens 16384 --routings random --modes "$MODES" \
  --iters 8 --warmup 2 --profile-iters 2 --out "$OUT/ep_overlap_2xh200.json" 2>&1 \
  | grep -v "^USDT\|UserWarning\|warnings.warn" > "$OUT/ep_overlap.log"
echo "exit ${PIPESTATUS[0]}" >> "$OUT/ep_overlap.log"
tail -60 "$OUT/ep_overlap.log"
