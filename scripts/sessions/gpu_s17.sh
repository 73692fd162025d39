#!/usr/bin/env bash
# GPU calls of session 13 (1 H200).
#   PART=a: the Gluon K-grouped wgrads with the row gather in the producer (kernels/ws_wgrad.py): GPU tests
#     (tests/test_ws_wgrad.py), do_bench against gather + grouped_mm (scripts/bench_ws_wgrad.py), and
#     compare.layer with the same-process A/B WGRAD=gluon.
#   PART=b: v2 (x rows as the gathered A, dw1 / dw3 stored transposed), "gluon" the sm_90 default: the same
#     tests and bench, compare.layer with the A/B WGRAD=grouped_mm (the previous default).
#   PART=c: the GPU suite with the new default: test_gpu.py (graph capture, no host sync, real shapes),
#     test_kernels_bwd.py, test_triton_op.py, test_eager_layer.py; before them, the 30B kernel profile.
#   PART=d (and e: v2, one shared staging tile, 5 stages): the ping-pong Gluon GEMM2 dgrad (removed after PART e:
#     slower than the Triton kernel; run at 7728033 / 68dd907) (kernels/ws_gemm2_dgrad.py): GPU tests (test_ws_gemm.py g2d cases),
#     bench-g2d, compare.layer with the A/B WS_GEMM2_DGRAD=pingpong.
# Call as: REV=<hash> PART=a bash scripts/sessions/gpu_s17.sh   (carry .whl; see scripts/gpu_env.sh)
source scripts/gpu_env.sh
session_start
if [ "$PART" = a ] || [ "$PART" = b ]; then
  [ "$PART" = b ] && ALT=grouped_mm || ALT=gluon
  timeout -s KILL 150 python3 -m pytest -q -rA tests/test_ws_wgrad.py > "$OUT/keep/tests_ws_wgrad.log" 2>&1
  echo "[t=$((SECONDS - t0))s] ws_wgrad tests: $(tail -1 "$OUT/keep/tests_ws_wgrad.log")"
  grep -E "^(FAILED|ERROR)|Error" "$OUT/keep/tests_ws_wgrad.log" | head
  timeout -s KILL 150 python3 scripts/bench_ws_wgrad.py --out "$OUT/keep/bench_ws_wgrad.json" > "$OUT/keep/bench_ws_wgrad.log" 2>&1
  echo "[t=$((SECONDS - t0))s] bench rc $?"; cat "$OUT/keep/bench_ws_wgrad.log" | grep -v Warn | tail -24
  if grep -q " passed" "$OUT/keep/tests_ws_wgrad.log" && ! grep -q "failed" "$OUT/keep/tests_ws_wgrad.log"; then
    timeout -s KILL 270 python3 -m compare.layer --shapes qwen3-30b-a3b,qwen3-235b-a22b --impls tt-compile,megamoe-triton \
      --precisions bf16 --routings random --iters 20 --warmup 5 --device-time --no-plot \
      --switches WGRAD=$ALT --out "$OUT/keep/layer_1xh200_ep1.json" > "$OUT/layer.log" 2>&1
    echo "[t=$((SECONDS - t0))s] layer rc $?"; grep "^|" "$OUT/layer.log"; tail -3 "$OUT/layer.log" | cut -c1-300
  fi
elif [ "$PART" = d ] || [ "$PART" = e ]; then
  timeout -s KILL 150 python3 -m pytest -q -rA tests/test_ws_gemm.py -k "gemm2_dgrad" > "$OUT/keep/tests_ws_g2d.log" 2>&1
  echo "[t=$((SECONDS - t0))s] g2d tests: $(tail -1 "$OUT/keep/tests_ws_g2d.log")"
  grep -E "^(FAILED|ERROR)|Error" "$OUT/keep/tests_ws_g2d.log" | head
  timeout -s KILL 150 python3 scripts/bench_ws_gemm.py bench-g2d --out "$OUT/keep/bench_g2d.json" > "$OUT/keep/bench_g2d.log" 2>&1
  echo "[t=$((SECONDS - t0))s] bench rc $?"; grep -v Warn "$OUT/keep/bench_g2d.log" | tail -12 | cut -c1-400
  faster=$(python3 -c "import json; r=json.load(open('$OUT/keep/bench_g2d.json'))['rows']; t=[x['ms'] for x in r if x['shape']=='30b' and x['kernel'].startswith('triton')][0]; p=min(x['ms'] for x in r if x['shape']=='30b' and 'ping-pong' in x['kernel']); print(int(p < t))" 2>/dev/null)
  echo "ping-pong faster than Triton at 30B: ${faster:-?}"
  if [ "$PART" = d ] || [ "$faster" = 1 ]; then ok=1; else ok=0; fi
  if [ $ok = 1 ] && grep -q "PASSED.*pingpong" "$OUT/keep/tests_ws_g2d.log" && ! grep -q "FAILED.*pingpong" "$OUT/keep/tests_ws_g2d.log"; then
    timeout -s KILL 270 python3 -m compare.layer --shapes qwen3-30b-a3b,qwen3-235b-a22b --impls tt-compile,megamoe-triton \
      --precisions bf16 --routings random --iters 20 --warmup 5 --device-time --no-plot \
      --switches WS_GEMM2_DGRAD=pingpong --out "$OUT/keep/layer_1xh200_ep1.json" > "$OUT/layer.log" 2>&1
    echo "[t=$((SECONDS - t0))s] layer rc $?"; grep "^|" "$OUT/layer.log" | head -20; tail -2 "$OUT/layer.log" | cut -c1-300
  fi
elif [ "$PART" = c ]; then
  timeout -s KILL 120 python3 -m compare.profile --shape qwen3-30b-a3b --impl megamoe-triton --iters 10 \
    --out "$OUT/keep/profile_30b_megamoe-triton.json" > "$OUT/keep/profile_30b.log" 2>&1
  echo "[t=$((SECONDS - t0))s] profile rc $?"; grep -v Warn "$OUT/keep/profile_30b.log" | tail -28 | cut -c1-200
  timeout -s KILL 420 python3 -m pytest -q -rA tests/test_gpu.py tests/test_kernels_bwd.py tests/test_triton_op.py \
    tests/test_eager_layer.py -k "not ep_triton and not reference_ep2 and not compiles_for_sm90a" \
    > "$OUT/keep/tests_gpu.log" 2>&1
  echo "[t=$((SECONDS - t0))s] gpu tests: $(tail -1 "$OUT/keep/tests_gpu.log")"
  grep -E "^(FAILED|ERROR)" "$OUT/keep/tests_gpu.log" | head
fi
session_pack "s17$PART"
