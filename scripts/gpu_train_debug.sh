#!/usr/bin/env bash
# GPU session (2 H200): GPU tests of the reference operator, then the debug Qwen3 MoE trained 200 steps
# with megamoe (reference backend, EP=2) and with stock TorchTitan, same seed and data; summary + plot.
source scripts/gpu_env.sh
python3 -m titan_megamoe.data.prepare | tee "$OUT/prepare.txt"
python3 -m pytest tests/test_gpu.py -q -rs 2>&1 | tee "$OUT/gpu_tests.log" || true
STEPS=${STEPS:-200}
for impl in megamoe baseline; do
  python3 -m titan_megamoe.launch --config train_configs/qwen3_debugmoe_${impl}_bf16.toml --ngpu 2 --steps "$STEPS" \
    -- ${EXTRA_ARGS:-} > "$OUT/train_debug_${impl}.log" 2>&1 || { echo "TRAIN $impl FAILED"; tail -40 "$OUT/train_debug_${impl}.log"; }
  grep -E "step: +[0-9]+ " "$OUT/train_debug_${impl}.log" | tail -3
done
python3 -m compare.trainlog "$OUT/train_debug_megamoe.log" "$OUT/train_debug_baseline.log" \
  --labels "megamoe-reference-ep2" "torchtitan-baseline-ep2" --skip 10 \
  --out-json "$OUT/train_debug_h200x2.json" --out-png "$OUT/train_debug_h200x2.png" \
  --meta "{\"date\": \"$(date -u +%FT%TZ)\", \"git_rev\": \"$REV\", \"gpu\": \"$(head -2 $OUT/gpu.txt | tail -1)\", \"command\": \"bash scripts/gpu_train_debug.sh\", \"configs\": [\"train_configs/qwen3_debugmoe_megamoe_reference_bf16.toml\", \"train_configs/qwen3_debugmoe_baseline_bf16.toml\"]}"
