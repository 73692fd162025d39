#!/usr/bin/env bash
# GPU (2 H200), session 5 third call.
# GPU 1: scripts/bench_fp8_quant_ep.py (FP8 backward passes on the EP = 1 layout vs an EP = 2 receive
#   layout, one GPU), then gpu_ci is not disturbed by a second training.
# GPU 0: scripts/gpu_ci.sh (second GPU run; the first failed on loss noise, fixed since).
# Call as: REV=<hash> bash scripts/sessions/gpu_s5_c.sh
source scripts/gpu_env.sh
export TITAN_MEGAMOE_GIT_REV=$REV
set +e
t0=$SECONDS
( CUDA_VISIBLE_DEVICES=1 timeout 200 python3 scripts/bench_fp8_quant_ep.py --shape 30b --out "$OUT/bench_fp8_quant_ep_30b.json" \
    > "$OUT/bench_quant.log" 2>&1; echo "[t=$((SECONDS - t0))s] bench rc $?" >> "$OUT/bench_quant.log" ) &
B=$!
CUDA_VISIBLE_DEVICES=0 timeout 480 bash scripts/gpu_ci.sh > "$OUT/gpu_ci.log" 2>&1
echo "[t=$((SECONDS - t0))s] gpu_ci exit $?"; grep -v "^\[W\|warn" "$OUT/gpu_ci.log" | tail -30
wait $B; grep -v "^\[W\|warn" "$OUT/bench_quant.log" | tail -22
rm -f "$OUT/gpu.txt"
cd "$OUT" && tar czf /tmp/s5c_logs.tgz . && mkdir -p /tmp/keep && cp -f bench_fp8_quant_ep_30b.json layer_ci.json train_ci.json /tmp/keep/ 2>/dev/null
rm -rf "$OUT"/* && mv /tmp/s5c_logs.tgz /tmp/keep/* "$OUT"/ ; ls "$OUT"
