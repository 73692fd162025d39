#!/usr/bin/env bash
# GPU (2 H200), session 5 second call: the FP8 transposed operands' odd row stride (transposed_ld).
# 1. compare.ep_overlap EP=2, both shapes, fp8, mode v1: per-phase events (vs gpu_s5_a's, stride 2^18).
# 2. compare.layer EP=2, both shapes: stock compiled bf16 / fp8 vs megamoe bf16 / fp8 / fp8_bwd.
# 3. if time is left: compare.train EP=2, 30B-shape 8 layers, megamoe fp8 vs stock fp8, 30 steps.
# Call as: REV=<hash> bash scripts/sessions/gpu_s5_b.sh
source scripts/gpu_env.sh
export TITAN_MEGAMOE_GIT_REV=$REV
set +e
t0=$SECONDS
PRECISIONS=fp8 MODES=v1 TIMEOUT=200 bash scripts/gpu_ep_overlap.sh > /dev/null 2>&1
echo "[t=$((SECONDS - t0))s] ep_overlap done"; grep "^| qwen\|^phases\|^profile\|^  [0-9]" "$OUT/ep_overlap.log" | head -40
timeout 240 python3 -m torch.distributed.run --standalone --nproc_per_node 2 -m compare.layer \
  --shapes qwen3-30b-a3b,qwen3-235b-a22b --impls tt-compile,megamoe-triton --precisions bf16,fp8,fp8_bwd \
  --routings random --iters 15 --warmup 4 --no-plot --out "$OUT/layer_ep2.json" > "$OUT/layer_ep2.log" 2>&1
echo "[t=$((SECONDS - t0))s] layer ep2 rc $?"; grep "^|\|rror" "$OUT/layer_ep2.log" | head -14
left=$((560 - (SECONDS - t0)))
if [ $left -gt 150 ]; then
  S=train_configs/qwen3_30b_a3b_8L
  timeout $((left - 15)) python3 -m compare.train --ngpu 2 --steps 30 --skip 10 \
    --configs ${S}_megamoe_fp8.toml ${S}_baseline_fp8.toml \
    --labels megamoe-fp8 torchtitan-fp8 --out "$OUT/train_30b8L_ep2_fp8.json" > "$OUT/train.log" 2>&1
  echo "[t=$((SECONDS - t0))s] train rc $?"; grep "^|" "$OUT/train.log"
fi
rm -f "$OUT/gpu.txt"
cd "$OUT" && tar czf /tmp/s5b_logs.tgz . && mkdir -p /tmp/keep && cp -f ep_overlap_2xh200.json layer_ep2.json train_30b8L_ep2_fp8.json /tmp/keep/ 2>/dev/null
rm -rf "$OUT"/* && mv /tmp/s5b_logs.tgz /tmp/keep/* "$OUT"/ ; ls "$OUT"
