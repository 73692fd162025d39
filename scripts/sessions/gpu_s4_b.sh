#!/usr/bin/env bash
# GPU (2 H200), session 4 second call: the grouped-mm wgrad (gathered rows + torch._grouped_mm) and
# the forward's host time.
# GPU 0: compare.layer EP=1, both Qwen3 shapes, bf16, stock compiled vs megamoe (new default wgrad).
# GPU 1 meanwhile: bwd kernel correctness (compiled) + wgrad A/B bench (Triton vs grouped_mm) at both
#   shapes; scripts/host_overhead.py; the op-level GPU tests.
# Call as: REV=<hash> bash scripts/sessions/gpu_s4_b.sh
source scripts/gpu_env.sh
export TITAN_MEGAMOE_GIT_REV=$REV
set +e
t0=$SECONDS
(
  export CUDA_VISIBLE_DEVICES=1
  timeout 100 python3 tests/test_kernels_bwd.py gpu 30b --wgrad-only > "$OUT/wgrad_30b.log" 2>&1
  echo "[t=$((SECONDS - t0))s] wgrad 30b rc $?"
  timeout 100 python3 tests/test_kernels_bwd.py gpu 235b --wgrad-only > "$OUT/wgrad_235b.log" 2>&1
  echo "[t=$((SECONDS - t0))s] wgrad 235b rc $?"
  timeout 60 python3 scripts/host_overhead.py --out "$OUT/host_overhead_30b.json" > "$OUT/host.log" 2>&1
  echo "[t=$((SECONDS - t0))s] host overhead rc $?"
  [ $((SECONDS - t0)) -lt 160 ] && timeout 60 python3 -m pytest -q -x tests/test_triton_op.py -rs > "$OUT/op_tests.log" 2>&1
  echo "[t=$((SECONDS - t0))s] op tests: $(tail -1 "$OUT/op_tests.log")"
) > "$OUT/gpu1.log" 2>&1 &
CUDA_VISIBLE_DEVICES=0 timeout 200 python3 -m compare.layer --shapes qwen3-30b-a3b,qwen3-235b-a22b \
  --impls tt-compile,megamoe-triton --precisions bf16 --routings random --iters 20 --warmup 5 \
  --no-plot --out "$OUT/layer_ep1.json" > "$OUT/layer_ep1.log" 2>&1
echo "[t=$((SECONDS - t0))s] layer rc $?"; grep "^|\|rror" "$OUT/layer_ep1.log" | head -12
wait
cat "$OUT/gpu1.log"; grep -h '"kernel"\|speedup\|rror' "$OUT/wgrad_30b.log" "$OUT/wgrad_235b.log" | head -40
cat "$OUT/host.log" | tail -20
rm -f "$OUT/gpu.txt"
cd "$OUT" && tar czf /tmp/s4b_logs.tgz . && mkdir -p /tmp/keep && cp -f layer_ep1.json host_overhead_30b.json /tmp/keep/ 2>/dev/null
rm -rf "$OUT"/* && mv /tmp/s4b_logs.tgz /tmp/keep/* "$OUT"/ ; ls "$OUT"
