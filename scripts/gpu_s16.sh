#!/usr/bin/env bash
# GPU calls of session 12 (1 H200).
#   PART=a: why the from-idle step exceeds the device time at 235B (scripts/power_probe.py: from idle, head
#     start, from idle after a 40 ms cool-down, with nvidia-smi sampling clocks / power / reasons; one
#     profiled from-idle step's device gaps; host time of the gate GEMM).
# Call as: REV=<hash> PART=a bash scripts/gpu_s16.sh   (carry .whl; see scripts/gpu_env.sh)
source scripts/gpu_env.sh
session_start
if [ "$PART" = a ]; then
  nvidia-smi -q -d POWER,CLOCK,PERFORMANCE > "$OUT/keep/smi_q.txt" 2>&1
  grep -iE "Power Limit|Max Clocks|SM  |Graphics" "$OUT/keep/smi_q.txt" | head -20
  timeout 400 python3 scripts/power_probe.py --out "$OUT/keep/power_probe.json" > "$OUT/keep/power_probe.log" 2>&1
  echo "[t=$((SECONDS - t0))s] power_probe rc $?"; cut -c1-600 "$OUT/keep/power_probe.log" | grep -v Warning | tail -40
fi
session_pack "s16$PART"
