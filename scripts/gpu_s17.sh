#!/usr/bin/env bash
# GPU calls of session 13 (1 H200).
#   PART=a: the Gluon K-grouped wgrads with the row gather in the producer (kernels/ws_wgrad.py): GPU tests
#     (tests/test_ws_wgrad.py), do_bench against gather + grouped_mm (scripts/bench_ws_wgrad.py), and
#     compare.layer with the same-process A/B WGRAD=gluon.
# Call as: REV=<hash> PART=a bash scripts/gpu_s17.sh   (carry .whl; see scripts/gpu_env.sh)
source scripts/gpu_env.sh
session_start
if [ "$PART" = a ]; then
  timeout -s KILL 150 python3 -m pytest -q -rA tests/test_ws_wgrad.py > "$OUT/keep/tests_ws_wgrad.log" 2>&1
  echo "[t=$((SECONDS - t0))s] ws_wgrad tests: $(tail -1 "$OUT/keep/tests_ws_wgrad.log")"
  grep -E "^(FAILED|ERROR)|Error" "$OUT/keep/tests_ws_wgrad.log" | head
  timeout -s KILL 150 python3 scripts/bench_ws_wgrad.py --out "$OUT/keep/bench_ws_wgrad.json" > "$OUT/keep/bench_ws_wgrad.log" 2>&1
  echo "[t=$((SECONDS - t0))s] bench rc $?"; cat "$OUT/keep/bench_ws_wgrad.log" | grep -v Warn | tail -24
  if grep -q " passed" "$OUT/keep/tests_ws_wgrad.log" && ! grep -q "failed" "$OUT/keep/tests_ws_wgrad.log"; then
    timeout -s KILL 270 python3 -m compare.layer --shapes qwen3-30b-a3b,qwen3-235b-a22b --impls tt-compile,megamoe-triton \
      --precisions bf16 --routings random --iters 20 --warmup 5 --device-time --no-plot \
      --switches WGRAD=gluon --out "$OUT/keep/layer_1xh200_ep1.json" > "$OUT/layer.log" 2>&1
    echo "[t=$((SECONDS - t0))s] layer rc $?"; grep "^|" "$OUT/layer.log"; tail -3 "$OUT/layer.log" | cut -c1-300
  fi
fi
session_pack "s17$PART"
