#!/usr/bin/env bash
# GPU calls of session 30 (session 29's, which never ran, plus WS_GEMM1_EXPERT_ORDER and WS_GEMM1_GRID) (say in the results which card ran).
# Call as: REV=<hash> PART=a [BUDGET=seconds] bash scripts/gpu_s30.sh   (carry .whl; see scripts/gpu_env.sh)
source scripts/gpu_env.sh
session_start
left() { local l=$((${BUDGET:-575} - SECONDS + t0)); [ "$l" -gt "$1" ] && l=$1; [ "$l" -lt 5 ] && l=5; echo $l; }  # left CAP: seconds
# PART=a: session 28's PART b never ran (its two new defaults, GEMM2_DGRAD_WIDE and the split wgrads at D >= 4096, have
#   not run in a layer on any GPU), plus this session's padding skips (SKIP_PAD_BLOCKS, opt-in until this runs: the Gluon GEMM1 forward / dgrad
#   consumers issue no MMA on 64 all-padding rows, the Gluon wgrads end each expert at its last row rounded up to 64;
#   ~2.9 % of those kernels' rows; bitwise the same outputs, checked on the CPU only as sm_90a builds).
#   Session 30 adds two opt-ins against the 235B GEMM1 dgrad's DRAM over-read (~11 GB for 5.1 GB of operands):
#   WS_GEMM1_EXPERT_ORDER (the GEMM1 forward / dgrad tiles expert by expert, column block by column block) and
#   WS_GEMM1_GRID (the cooperative ones at one program per tile, not one persistent program per SM). Their bitwise GPU
#   checks ride in the same tests; each has a layer row and kernel groups (gemm1_{fwd,dgrad}_order, gemm1_{fwd,dgrad}_grid).
#   (1) GPU tests of the changed kernels (the skips on, bitwise against them off, poisoned rows past the wgrad's cut) and test_gpu.py's
#   real-shape / CUDA-graph cases; (2) compare.layer 235B bf16 beside stock TorchTitan compiled (issue 4): the new
#   defaults, then SKIP_PAD_BLOCKS=1, then session 28's old defaults too, same process; (3) the kernels interleaved
#   (skip / trim on and off, GEMM2 forward at 16 warps, GEMM1 dgrad tile orders); (4) 30B bf16 layer.
if [ "$PART" = a ]; then
  gpu_tests ws_a tests/test_ws_gemm.py tests/test_ws_wgrad.py -k on_gpu
  [ "$(left 300)" -ge 150 ] && layer_ab 235b_a \
    "WS_GEMM1_GRID=1 WS_GEMM1_GRID=1,WS_GEMM1_EXPERT_ORDER=1 SKIP_PAD_BLOCKS=1 WS_GEMM1_EXPERT_ORDER=1 GEMM2_DGRAD_WIDE=0,WS_WGRAD_SPLIT=0" \
    qwen3-235b-a22b bf16 tt-compile,megamoe-triton 8
  [ "$(left 100)" -ge 50 ] && timeout $(left 200) python3 scripts/ab_kernels.py --shapes 235b,30b --rounds 8 \
    --groups gemm1_dgrad_grid,gemm1_dgrad_order,gemm1_fwd_grid,gemm1_fwd_order,gemm1_dgrad_skip,gemm1_fwd_skip,wgrad_w13_trim,wgrad_w2_trim,gemm2_fwd \
    --out "$OUT/keep/ab_kernels_a.json" > "$OUT/ab_kernels_a.log" 2>&1
  echo "[t=$((SECONDS - t0))s] ab_kernels rc $?"; grep -E "^(30b|235b)" "$OUT/ab_kernels_a.log"; tail -3 "$OUT/ab_kernels_a.log"
  [ "$(left 200)" -ge 80 ] && gpu_tests op_a tests/test_gpu.py -k "real_shapes or cuda_graph or no_host_sync"
  [ "$(left 200)" -ge 90 ] && layer_ab 30b_a "SKIP_PAD_BLOCKS=1 WS_GEMM1_EXPERT_ORDER=1 WS_GEMM1_GRID=1 GEMM2_DGRAD_WIDE=0" qwen3-30b-a3b \
    bf16 tt-compile,megamoe-triton 6
  mv "$OUT"/keep/*.log "$OUT"/ 2>/dev/null
fi
# PART=b: the short form for a call with little device time left: the changed kernels' GPU tests (bitwise against
#   SKIP off), then the skip / trim kernels interleaved at 235B.
if [ "$PART" = b ]; then
  timeout -s KILL $(left 170) python3 -m pytest -q -rfE -x tests/test_ws_wgrad.py tests/test_ws_gemm.py \
    -k "on_gpu and not gemm2_dgrad" -p no:cacheprovider > "$OUT/keep/tests_gpu_ws_b.log" 2>&1
  echo "[t=$((SECONDS - t0))s] gpu tests: $(tail -1 "$OUT/keep/tests_gpu_ws_b.log")"
  grep -E "^(FAILED|ERROR)|^E  " "$OUT/keep/tests_gpu_ws_b.log" | head -20
  [ "$(left 100)" -ge 40 ] && timeout $(left 100) python3 scripts/ab_kernels.py --shapes 235b \
    --groups gemm1_dgrad_grid,gemm1_dgrad_order,gemm1_fwd_grid,gemm1_fwd_order,gemm1_dgrad_skip,wgrad_w13_trim,gemm1_fwd_skip,wgrad_w2_trim --rounds 6 \
    --out "$OUT/keep/ab_kernels_b.json" > "$OUT/ab_kernels_b.log" 2>&1
  echo "[t=$((SECONDS - t0))s] ab_kernels rc $?"; grep -E "^(30b|235b)" "$OUT/ab_kernels_b.log"; tail -3 "$OUT/ab_kernels_b.log"
  mv "$OUT"/keep/*.log "$OUT"/ 2>/dev/null
fi
session_pack "s30$PART"
