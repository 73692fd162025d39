#!/usr/bin/env bash
# GPU check (2 H200): (1) a DCP checkpoint saved by stock TorchTitan loads into megamoe and gives the
# same loss as stock loaded from it; (2) megamoe trains under torch.compile (inductor) with full and
# selective activation checkpointing.
source scripts/gpu_env.sh
python3 -m titan_megamoe.data.prepare > "$OUT/prepare.txt"
L="python3 -m titan_megamoe.launch --ngpu 2"
$L --config train_configs/qwen3_debugmoe_baseline_bf16.toml --steps 10 -- --checkpoint.enable \
  --checkpoint.interval 10 --checkpoint.folder ckpt_stock --checkpoint.last_save_model_only > "$OUT/ckpt_save_stock.log" 2>&1
ls outputs/ckpt_stock
for impl in baseline megamoe; do
  $L --config train_configs/qwen3_debugmoe_${impl}_bf16.toml --steps 3 -- --checkpoint.enable \
    --checkpoint.folder ckpt_load_${impl} --checkpoint.initial_load_path outputs/ckpt_stock/step-10 \
    --checkpoint.interval 1000 > "$OUT/ckpt_load_${impl}.log" 2>&1 || tail -20 "$OUT/ckpt_load_${impl}.log"
  echo "loaded into $impl:"; grep -E "step: +[123] " "$OUT/ckpt_load_${impl}.log"
done
for ac in full selective; do
  $L --config train_configs/qwen3_debugmoe_megamoe_reference_bf16.toml --steps 30 -- --compile.enable \
    --activation_checkpoint.mode $ac > "$OUT/compile_ac_${ac}.log" 2>&1 || tail -30 "$OUT/compile_ac_${ac}.log"
  echo "megamoe compile + AC $ac:"; grep -E "step: +(1|2|10|30) " "$OUT/compile_ac_${ac}.log"
done
