#!/usr/bin/env bash
# GPU session part B1 (2 H200): seed-43 training runs (noise band), routing capture from the trained
# debug model, then compare.layer at EP=2 for both Qwen3 shapes.
source scripts/gpu_env.sh
export TITAN_MEGAMOE_GIT_REV=${REV:-unknown}
python3 -m titan_megamoe.data.prepare > "$OUT/prepare.txt"
for impl in baseline megamoe; do
  extra="--debug.seed 43"
  [ "$impl" = baseline ] && extra="$extra --checkpoint.enable --checkpoint.interval 200 --checkpoint.folder ckpt --checkpoint.last_save_model_only"
  python3 -m titan_megamoe.launch --config train_configs/qwen3_debugmoe_${impl}_bf16.toml --ngpu 2 --steps 200 \
    -- $extra > "$OUT/train_debug_${impl}_seed43.log" 2>&1 || { echo "TRAIN $impl FAILED"; tail -30 "$OUT/train_debug_${impl}_seed43.log"; }
  grep -E "step: +200 " "$OUT/train_debug_${impl}_seed43.log" | head -1
done
ls outputs/ckpt || true
python3 -m compare.capture_routing --out "$OUT/routing_debugmoe_layer4.pt" --layer 4 --checkpoint outputs/ckpt/step-200 \
  --batches 4 --batch-size 2 --seq-len 2048 2>&1 | tail -3
timeout 330 torchrun --standalone --nproc_per_node 2 -m compare.layer --shapes qwen3-30b-a3b,qwen3-235b-a22b \
  --impls tt-eager,tt-compile,megamoe-reference --precisions bf16,fp8 --routings random \
  --out "$OUT/layer_2xh200_ep2.json" 2>&1 | grep -v Warning | tail -25
