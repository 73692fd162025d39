#!/usr/bin/env bash
# GPU calls of session 31: session 30's (never ran: GPU tests of the padding skips and tile orders, the 235B layer
# beside stock with every opt-in row, kernel A/B, 30B) plus two opt-ins of session 31: WS_GEMM1_DYNAMIC (persistent
# GEMM1 forward / dgrad taking tiles in order from a per-launch atomic counter) and WS_GEMM2 (a warp-specialized Gluon
# bf16 GEMM2 forward). Say in the results which card ran.
# Call as: REV=<hash> PART=a [BUDGET=seconds] bash scripts/sessions/gpu_s31.sh   (carry .whl; see scripts/gpu_env.sh)
source scripts/gpu_env.sh
session_start
# The new kernels' GPU tests run apart, after the rest (a hang would stall a run): the counter schedule
# (test_ws_gemm.py -k dynamic) and the Gluon GEMM2 (test_ws_gemm2.py); each one's A/B and layer rows run only if its
# tests passed.
new_tests() {  # new_tests TAG FILE KEYWORDS
  timeout -s KILL $(left 150) python3 -m pytest -q -rfE -s "$2" -k "$3" -p no:cacheprovider \
    > "$OUT/keep/tests_gpu_$1.log" 2>&1
  local rc=$?
  echo "[t=$((SECONDS - t0))s] $1 gpu tests rc $rc: $(tail -1 "$OUT/keep/tests_gpu_$1.log")"
  grep -E "^(FAILED|ERROR)|^E  " "$OUT/keep/tests_gpu_$1.log" | head -12
  return $rc
}
ab() {  # ab TAG SHAPES ROUNDS CAP GROUPS
  timeout $(left $4) python3 scripts/ab_kernels.py --shapes "$2" --rounds "$3" --groups "$5" \
    --out "$OUT/keep/ab_kernels_$1.json" > "$OUT/ab_kernels_$1.log" 2>&1
  echo "[t=$((SECONDS - t0))s] ab_kernels $1 rc $?"; grep -E "^(30b|235b)" "$OUT/ab_kernels_$1.log"; tail -3 "$OUT/ab_kernels_$1.log"
}
if [ "$PART" = a ]; then
  gpu_tests ws_a tests/test_ws_gemm.py tests/test_ws_wgrad.py -k "on_gpu and not dynamic"
  [ "$(left 300)" -ge 150 ] && layer_ab 235b_a \
    "WS_GEMM1_GRID=1 WS_GEMM1_GRID=1,WS_GEMM1_EXPERT_ORDER=1 SKIP_PAD_BLOCKS=1 WS_GEMM1_EXPERT_ORDER=1 GEMM2_DGRAD_WIDE=0,WS_WGRAD_SPLIT=0" \
    qwen3-235b-a22b bf16 tt-compile,megamoe-triton 8
  rows=""; groups=""
  if [ "$(left 200)" -ge 60 ] && new_tests dynamic_a tests/test_ws_gemm.py "on_gpu and dynamic"; then
    rows="WS_GEMM1_DYNAMIC=1 WS_GEMM1_DYNAMIC=1,WS_GEMM1_EXPERT_ORDER=1 WS_GEMM1_GRID=1"
    groups="gemm1_dgrad_dynamic,gemm1_fwd_dynamic"
  fi
  if [ "$(left 200)" -ge 60 ] && new_tests gemm2_a tests/test_ws_gemm2.py "on_gpu"; then
    rows="$rows WS_GEMM2=1"; groups="${groups:+$groups,}gemm2_fwd_gluon"
  fi
  [ -n "$groups" ] && ab new_a 235b,30b 8 150 "$groups"
  [ -n "$rows" ] && [ "$(left 200)" -ge 80 ] && layer_ab 235b_new_a "$rows" qwen3-235b-a22b bf16 megamoe-triton 8
  [ "$(left 100)" -ge 50 ] && ab a 235b,30b 8 200 \
    gemm1_dgrad_grid,gemm1_dgrad_order,gemm1_fwd_grid,gemm1_fwd_order,gemm1_dgrad_skip,gemm1_fwd_skip,wgrad_w13_trim,wgrad_w2_trim,gemm2_fwd
  [ "$(left 200)" -ge 80 ] && gpu_tests op_a tests/test_gpu.py -k "real_shapes or cuda_graph or no_host_sync or fp8_bwd_layer"
  [ "$(left 200)" -ge 90 ] && layer_ab 30b_a "SKIP_PAD_BLOCKS=1 WS_GEMM1_EXPERT_ORDER=1 WS_GEMM1_DYNAMIC=1 GEMM2_DGRAD_WIDE=0" \
    qwen3-30b-a3b bf16 tt-compile,megamoe-triton 6
  mv "$OUT"/keep/*.log "$OUT"/ 2>/dev/null
fi
# PART=b: the short form: the counter schedule's tests and A/B first (the newest), then the other changed kernels'
#   GPU tests and their A/B at 235B.
if [ "$PART" = b ]; then
  new_tests dynamic_b tests/test_ws_gemm.py "on_gpu and dynamic" && ab dyn_b 235b 6 120 gemm1_dgrad_dynamic,gemm1_fwd_dynamic
  new_tests gemm2_b tests/test_ws_gemm2.py "on_gpu" && ab gemm2_b 235b 6 60 gemm2_fwd_gluon
  timeout -s KILL $(left 170) python3 -m pytest -q -rfE -x tests/test_ws_wgrad.py tests/test_ws_gemm.py \
    -k "on_gpu and not gemm2_dgrad and not dynamic" -p no:cacheprovider > "$OUT/keep/tests_gpu_ws_b.log" 2>&1
  echo "[t=$((SECONDS - t0))s] gpu tests: $(tail -1 "$OUT/keep/tests_gpu_ws_b.log")"
  grep -E "^(FAILED|ERROR)|^E  " "$OUT/keep/tests_gpu_ws_b.log" | head -20
  [ "$(left 100)" -ge 40 ] && ab b 235b 6 100 \
    gemm1_dgrad_grid,gemm1_dgrad_order,gemm1_fwd_grid,gemm1_fwd_order,gemm1_dgrad_skip,wgrad_w13_trim,gemm1_fwd_skip,wgrad_w2_trim
  mv "$OUT"/keep/*.log "$OUT"/ 2>/dev/null
fi
# PART=c: for a call with ~300-450 s: issue 4's 235B layer beside stock with today's defaults only (no untested
#   switch in the layer), then the new kernels' tests and their A/B at 235B, then the other changed kernels' tests.
if [ "$PART" = c ]; then
  layer_ab 235b_c "" qwen3-235b-a22b bf16 tt-compile,megamoe-triton 4
  groups=""
  [ "$(left 150)" -ge 60 ] && new_tests dynamic_c tests/test_ws_gemm.py "on_gpu and dynamic" \
    && groups="gemm1_dgrad_dynamic,gemm1_fwd_dynamic"
  [ "$(left 150)" -ge 60 ] && new_tests gemm2_c tests/test_ws_gemm2.py "on_gpu" && groups="${groups:+$groups,}gemm2_fwd_gluon"
  [ -n "$groups" ] && [ "$(left 100)" -ge 40 ] && ab new_c 235b 6 100 "$groups"
  [ "$(left 200)" -ge 60 ] && gpu_tests ws_c tests/test_ws_gemm.py tests/test_ws_wgrad.py -k "on_gpu and not dynamic"
  mv "$OUT"/keep/*.log "$OUT"/ 2>/dev/null
fi
session_pack "s31$PART"
