#!/usr/bin/env bash
# GPU (2 H200), session 5 last call: dead blocks (past the last expert) skipped whole in the FP8
# backward's quantizers.
# 1. the 2-GPU EP worker, fp8 + fp8_bwd only (bitwise payload check, CUDA graphs, timings);
# 2. compare.layer EP=2, both shapes, stock compiled bf16 / fp8 vs megamoe bf16 / fp8 / fp8_bwd;
# 3. if time is left: compare.train EP=2, 30B-shape 8 layers, megamoe fp8 vs stock fp8, 30 steps.
# Call as: REV=<hash> bash scripts/sessions/gpu_s5_e.sh
source scripts/gpu_env.sh
export TITAN_MEGAMOE_GIT_REV=$REV
set +e
t0=$SECONDS
EP_TRITON_PRECISIONS=fp8,fp8_bwd EP_TRITON_ITERS=6 timeout 150 python3 -m torch.distributed.run --standalone \
  --nproc_per_node 2 tests/ep_triton_worker.py > "$OUT/ep_worker.log" 2>&1
echo "[t=$((SECONDS - t0))s] ep worker rc $?: $(grep -c PASS "$OUT/ep_worker.log") PASS lines"
grep -v "^\[W\|UserWarning\|warnings.warn" "$OUT/ep_worker.log" | grep -i "fail\|error\|PASS\|times\|mismatch\|assert" | head -20
timeout 190 python3 -m torch.distributed.run --standalone --nproc_per_node 2 -m compare.layer \
  --shapes qwen3-30b-a3b,qwen3-235b-a22b --impls tt-compile,megamoe-triton --precisions bf16,fp8,fp8_bwd \
  --routings random --iters 15 --warmup 4 --no-plot --out "$OUT/layer_ep2.json" > "$OUT/layer_ep2.log" 2>&1
echo "[t=$((SECONDS - t0))s] layer ep2 rc $?"; grep "^|\|rror" "$OUT/layer_ep2.log" | head -14
left=$((470 - (SECONDS - t0)))
if [ $left -gt 120 ]; then
  S=train_configs/qwen3_30b_a3b_8L
  timeout $left python3 -m compare.train --ngpu 2 --steps 30 --skip 10 \
    --configs ${S}_megamoe_fp8.toml ${S}_baseline_fp8.toml \
    --labels megamoe-fp8 torchtitan-fp8 --out "$OUT/train_30b8L_ep2_fp8.json" > "$OUT/train.log" 2>&1
  echo "[t=$((SECONDS - t0))s] train rc $?"; grep "^|" "$OUT/train.log"
fi
rm -f "$OUT/gpu.txt"
cd "$OUT" && tar czf /tmp/s5e_logs.tgz . && mkdir -p /tmp/keep && cp -f layer_ep2.json train_30b8L_ep2_fp8.json /tmp/keep/ 2>/dev/null
rm -rf "$OUT"/* && mv /tmp/s5e_logs.tgz /tmp/keep/* "$OUT"/ ; ls "$OUT"
