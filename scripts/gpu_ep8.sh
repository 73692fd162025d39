#!/usr/bin/env bash
# Ready for the first call that gets eight GPUs of one node (kind nvidia-h200-x8 or nvidia-h100-x8; none lent so far):
# issue 8 at EP = 8 with today's kernels. Each PART fits one 600 s call; run a first. Say in the results which card ran.
#   a: the multi-GPU tests at EP = 8 (the reference over NCCL, the EP Triton backend over symmetric memory: edge cases,
#      bitwise repeatability, workspace reuse, FP8), then compare.layer at EP = 8 on the 30B shape, bf16 / fp8 /
#      fp8_bwd beside stock TorchTitan bf16 and fp8 compiled, device time included;
#   b: the same at 235B, and the skewed routing at 30B;
#   c: compare.train on the full Qwen3-30B-A3B model (EP = 8, FSDP 8, seq_len 16384, full activation
#      checkpointing): megamoe bf16 beside stock bf16;
#   d: the same with megamoe fp8 beside stock fp8 (c and d: one invocation each, same seed and data).
# Call as: REV=<hash> PART=a [BUDGET=seconds] bash scripts/gpu_ep8.sh   (carry .whl; see scripts/gpu_env.sh)
source scripts/gpu_env.sh
session_start
EP_GPUS=8
train() {  # train TAG CONFIG_A CONFIG_B LABEL_A LABEL_B
  local s=train_configs/qwen3_30b_a3b
  timeout $(left 570) python3 -m compare.train --ngpu 8 --steps 25 --skip 5 \
    --configs "${s}_$2.toml" "${s}_$3.toml" --labels "$4" "$5" \
    --out "$OUT/keep/train_30b_ep8_$1.json" > "$OUT/keep/train_30b_ep8_$1.log" 2>&1
  echo "[t=$((SECONDS - t0))s] compare.train $1 rc $?"; tail -12 "$OUT/keep/train_30b_ep8_$1.log"
}
if [ "$PART" = a ]; then
  nvidia-smi topo -m | tee "$OUT/topo.txt"
  TITAN_MEGAMOE_TEST_EP=8 timeout -s KILL $(left 300) python3 -m pytest -q -rfE -s tests/test_gpu.py \
    -k "ep2 or ep_triton" -p no:cacheprovider > "$OUT/keep/tests_gpu_ep8_a.log" 2>&1
  echo "[t=$((SECONDS - t0))s] EP = 8 tests: $(tail -1 "$OUT/keep/tests_gpu_ep8_a.log")"
  grep -E "^(FAILED|ERROR)|^E  |EP=8" "$OUT/keep/tests_gpu_ep8_a.log" | head -20
  [ "$(left 300)" -ge 120 ] && ep_layer 30b_a qwen3-30b-a3b bf16,fp8,fp8_bwd random 300
fi
if [ "$PART" = b ]; then
  ep_layer 235b_b qwen3-235b-a22b bf16,fp8,fp8_bwd random 380
  [ "$(left 200)" -ge 100 ] && ep_layer 30b_skewed_b qwen3-30b-a3b bf16,fp8 skewed 200
fi
[ "$PART" = c ] && train c megamoe_bf16 baseline_bf16 megamoe-bf16 torchtitan-bf16
[ "$PART" = d ] && train d megamoe_fp8 baseline_fp8 megamoe-fp8 torchtitan-fp8
# one archive for every log (the device tool brings back a limited number of files)
(cd "$OUT/keep" && tar czf "$OUT/keep/logs_ep8_$PART.tgz" *.log 2>/dev/null && rm -f *.log)
session_pack "ep8$PART"
