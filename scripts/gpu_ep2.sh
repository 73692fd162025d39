#!/usr/bin/env bash
# Ready for the first call that gets two GPUs (kind nvidia-h100-x2 or nvidia-h200-x2; none lent since session 5):
# issues 5, 6 and 7 at EP = 2 with today's kernels (the EP = 2 rows in README predate the EP = 1 kernel work of
# sessions 7-33). Each PART fits one 600 s call; run a first, then b, then c. Say in the results which card ran.
#   a: the 2-GPU tests (EP reference over NCCL, the EP Triton backend over symmetric memory), then compare.layer at
#      EP = 2 on the 30B shape, bf16 / fp8 / fp8_bwd beside stock TorchTitan bf16 and fp8 compiled (issue 5's 30B
#      targets, issue 6's 30B rows), device time included;
#   b: the same at 235B (issue 5's 2x, issue 6's 4x stock fp8), and the skewed routing at 30B;
#   c: compare.train on the 8-layer 30B-shape model, EP = 2 (issue 7's targets): megamoe bf16 and fp8 beside stock
#      bf16 and fp8, one invocation, same seed and data.
# Call as: REV=<hash> PART=a [BUDGET=seconds] bash scripts/gpu_ep2.sh   (carry .whl; see scripts/gpu_env.sh)
source scripts/gpu_env.sh
session_start
EP_GPUS=2
if [ "$PART" = a ]; then
  nvidia-smi topo -m | tee "$OUT/topo.txt"
  timeout -s KILL $(left 240) python3 -m pytest -q -rfE -s tests/test_gpu.py -k "ep2 or ep_triton" -p no:cacheprovider \
    > "$OUT/keep/tests_gpu_ep2_a.log" 2>&1
  echo "[t=$((SECONDS - t0))s] 2-GPU tests: $(tail -1 "$OUT/keep/tests_gpu_ep2_a.log")"
  grep -E "^(FAILED|ERROR)|^E  " "$OUT/keep/tests_gpu_ep2_a.log" | head -20
  [ "$(left 300)" -ge 120 ] && ep_layer 30b_a qwen3-30b-a3b bf16,fp8,fp8_bwd random 300
fi
if [ "$PART" = b ]; then
  ep_layer 235b_b qwen3-235b-a22b bf16,fp8,fp8_bwd random 360
  [ "$(left 200)" -ge 100 ] && ep_layer 30b_skewed_b qwen3-30b-a3b bf16,fp8 skewed 200
fi
if [ "$PART" = c ]; then
  s=train_configs/qwen3_30b_a3b_8L
  timeout $(left 560) python3 -m compare.train --ngpu 2 --steps 40 --skip 10 \
    --configs ${s}_megamoe_bf16.toml ${s}_baseline_bf16.toml ${s}_baseline_fp8.toml ${s}_megamoe_fp8.toml \
    --labels megamoe-bf16 torchtitan-bf16 torchtitan-fp8 megamoe-fp8 \
    --out "$OUT/keep/train_30b8L_ep2_c.json" > "$OUT/keep/train_30b8L_ep2_c.log" 2>&1
  echo "[t=$((SECONDS - t0))s] compare.train rc $?"; tail -14 "$OUT/keep/train_30b8L_ep2_c.log"
fi
# one archive for every log (the device tool brings back a limited number of files)
(cd "$OUT/keep" && tar czf "$OUT/keep/logs_ep2_$PART.tgz" *.log 2>/dev/null && rm -f *.log)
session_pack "ep2$PART"
