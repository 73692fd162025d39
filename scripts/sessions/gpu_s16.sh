#!/usr/bin/env bash
# GPU calls of session 12 (1 H200).
#   PART=a: why the from-idle step exceeds the device time at 235B (scripts/power_probe.py: from idle, head
#     start, from idle after a 40 ms cool-down, with nvidia-smi sampling clocks / power / reasons; one
#     profiled from-idle step's device gaps; host time of the gate GEMM).
#   PART=b: the gate linear fused into the router kernel (FUSED_GATE, default on): GPU tests of the router,
#     the eager layer and test_gpu.py; compare.layer with NVML clock / power per pass, --device-time and
#     --cooldown-ms 40, same-process A/B against FUSED_GATE=0.
# Call as: REV=<hash> PART=a bash scripts/sessions/gpu_s16.sh   (carry .whl; see scripts/gpu_env.sh)
source scripts/gpu_env.sh
session_start
if [ "$PART" = a ]; then
  nvidia-smi -q -d POWER,CLOCK,PERFORMANCE > "$OUT/keep/smi_q.txt" 2>&1
  grep -iE "Power Limit|Max Clocks|SM  |Graphics" "$OUT/keep/smi_q.txt" | head -20
  timeout 400 python3 scripts/power_probe.py --out "$OUT/keep/power_probe.json" > "$OUT/keep/power_probe.log" 2>&1
  echo "[t=$((SECONDS - t0))s] power_probe rc $?"; cut -c1-600 "$OUT/keep/power_probe.log" | grep -v Warning | tail -40
elif [ "$PART" = b ]; then
  timeout -s KILL 300 python3 -m pytest -q -rA tests/test_router_kernel.py tests/test_eager_layer.py tests/test_gpu.py \
    -k "not ep_triton and not reference_ep2 and not compiles_for_sm90a" > "$OUT/keep/tests_gpu.log" 2>&1
  echo "[t=$((SECONDS - t0))s] gpu tests: $(tail -1 "$OUT/keep/tests_gpu.log")"
  grep -E "^(FAILED|ERROR)" "$OUT/keep/tests_gpu.log" | head
  timeout 360 python3 -m compare.layer --shapes qwen3-30b-a3b,qwen3-235b-a22b --impls tt-compile,megamoe-triton \
    --precisions bf16 --routings random --iters 20 --warmup 5 --device-time --cooldown-ms 40 --no-plot \
    --switches FUSED_GATE=0 --out "$OUT/keep/layer_1xh200_ep1.json" > "$OUT/layer.log" 2>&1
  echo "[t=$((SECONDS - t0))s] layer rc $?"; grep "^|" "$OUT/layer.log"; tail -3 "$OUT/layer.log" | cut -c1-300
fi
session_pack "s16$PART"
