#!/usr/bin/env bash
# GPU (2 H200), issue 5 item 5: where the EP layer's time goes. compare.ep_overlap at EP=2 for both Qwen3
# shapes, 16384 tokens/rank, random routing, overlap modes v1 and v2 (MODES=v1 for v1 only): full fwd / fwd+bwd vs communication alone vs compute alone,
# the overlap fraction, per-phase CUDA events and a profiler summary (top kernels, idle gap).
# PRECISIONS (default bf16) adds FP8 EP v1 (fp8, fp8_bwd; mode v1 only, FP8 weights quantized once before
# timing), with the FP8 passes' per-phase events (quant_x, gemm1, ..., quant_dgate_up, wgrad_w13, ...):
# e.g. PRECISIONS=bf16,fp8 MODES=v1 TIMEOUT=400 for where the FP8 backward's time goes; PRECISIONS=fp8
# MODES=v1,v1b: the FP8 x payload of the forward (v1, the default) against bf16 rows (v1b). TIMEOUT (default
# 225 s) bounds the run; records are written one by one, so a run cut short keeps what it measured.
# Files under $OUT (<= 6): gpu.txt, ep_overlap_2xh200.json, ep_overlap.log. ~2-4 minutes (most of it
# Triton JIT on a fresh machine). Call as: REV=<hash> bash scripts/gpu_ep_overlap.sh
source scripts/gpu_env.sh
export TITAN_MEGAMOE_GIT_REV=$REV
MODES=${MODES:-v1,v2}
PRECISIONS=${PRECISIONS:-bf16}
TIMEOUT=${TIMEOUT:-225}
set +e
timeout "$TIMEOUT" python3 -m torch.distributed.run --standalone --nproc_per_node 2 -m compare.ep_overlap \
  --shapes qwen3-30b-a3b,qwen3-235b-a22b --tokens 16384 --routings random --modes "$MODES" --precisions "$PRECISIONS" \
  --iters 8 --warmup 2 --profile-iters 2 --out "$OUT/ep_overlap_2xh200.json" 2>&1 \
  | grep -v "^USDT\|UserWarning\|warnings.warn" > "$OUT/ep_overlap.log"
echo "exit ${PIPESTATUS[0]}" >> "$OUT/ep_overlap.log"
tail -60 "$OUT/ep_overlap.log"
