#!/usr/bin/env bash
# GPU (2 H200), session 4 first call: validation of what ran only on CPU so far.
# GPU 1: FP8 wgrad diagnosis (scripts/gpu_fp8_debug.sh), then the 300-step debug training ablation with
#   the FP8 wgrad swapped for bf16 (TITAN_MEGAMOE_FP8_WGRAD=bf16; bf16 config unaffected) and a bf16
#   run with another seed (run-to-run spread of the final loss).
# GPU 0 meanwhile: scripts/gpu_ci.sh (never run on a GPU before).
# Then both: compare.layer EP=2, 30B, skewed + replayed routings, stock compiled vs megamoe (fused EP).
# Call as: REV=<hash> bash scripts/sessions/gpu_s4_a.sh
source scripts/gpu_env.sh
export TITAN_MEGAMOE_GIT_REV=$REV
set +e
t0=$SECONDS
(
  export CUDA_VISIBLE_DEVICES=1
  bash scripts/gpu_fp8_debug.sh > "$OUT/fp8_debug.log" 2>&1
  echo "[t=$((SECONDS - t0))s] fp8 debug done"
  TITAN_MEGAMOE_FP8_WGRAD=bf16 timeout 150 python3 -m compare.train --ngpu 1 --steps 300 --skip 10 \
    --configs train_configs/qwen3_debugmoe_1gpu_megamoe_triton_bf16.toml train_configs/qwen3_debugmoe_1gpu_megamoe_fp8_bwd.toml \
    --labels triton-bf16 fp8_bwd-wgrad_bf16 --out "$OUT/train_fp8_ablation.json" > "$OUT/train_fp8_ablation.log" 2>&1
  echo "[t=$((SECONDS - t0))s] train ablation: $(tail -8 "$OUT/train_fp8_ablation.log")"
  [ $((SECONDS - t0)) -lt 250 ] && timeout 75 python3 -m compare.train --ngpu 1 --steps 300 --skip 10 --seed 7 \
    --configs train_configs/qwen3_debugmoe_1gpu_megamoe_triton_bf16.toml --labels triton-bf16-seed7 \
    --out "$OUT/train_bf16_seed7.json" > /dev/null 2>&1
  echo "[t=$((SECONDS - t0))s] seed7 done"
) > "$OUT/gpu1.log" 2>&1 &
GPU1=$!
( sleep 335; pkill -f "compare.train|fp8_ablation|pytest|titan_megamoe.launch" ) & KILLER=$!
CUDA_VISIBLE_DEVICES=0 timeout 300 bash scripts/gpu_ci.sh > "$OUT/gpu_ci.log" 2>&1
echo "[t=$((SECONDS - t0))s] gpu_ci exit $?"; tail -25 "$OUT/gpu_ci.log"
wait $GPU1; kill $KILLER 2>/dev/null
cat "$OUT/gpu1.log"; grep -hE "rel err vs|passed|failed|^(acc probe|debug |30b )" "$OUT/fp8_debug.log" | head -50
timeout 170 python3 -m torch.distributed.run --standalone --nproc_per_node 2 -m compare.layer --shapes qwen3-30b-a3b \
  --impls tt-compile,megamoe-triton --precisions bf16 \
  --routings skewed,replay:benchmarks/results/routing_debugmoe_layer4_20261129.pt --iters 15 --warmup 4 --no-plot \
  --out "$OUT/layer_ep2_routings.json" 2>&1 | grep "^|\|rror" | head -30
echo "[t=$((SECONDS - t0))s] done"
rm -f "$OUT/gpu.txt"
# the device returns at most 8 files: everything in one archive, plus the result JSONs beside it
cd "$OUT" && tar czf /tmp/s4a_logs.tgz . && mkdir -p /tmp/keep && cp -f layer_ci.json train_ci.json \
  train_fp8_ablation.json train_bf16_seed7.json layer_ep2_routings.json fp8_ablation_30b.json /tmp/keep/ 2>/dev/null
rm -rf "$OUT"/* && mv /tmp/s4a_logs.tgz /tmp/keep/* "$OUT"/ ; ls "$OUT"
