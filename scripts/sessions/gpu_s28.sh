#!/usr/bin/env bash
# GPU calls of session 28 (say in the results which card ran).
# Call as: REV=<hash> PART=a [BUDGET=seconds] bash scripts/sessions/gpu_s28.sh   (carry .whl; see scripts/gpu_env.sh)
source scripts/gpu_env.sh
session_start
NCU_METRICS="gpu__time_duration.sum,sm__cycles_elapsed.avg.per_second,sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed,l1tex__throughput.avg.pct_of_peak_sustained_elapsed,lts__throughput.avg.pct_of_peak_sustained_elapsed,dram__throughput.avg.pct_of_peak_sustained_elapsed,dram__bytes_read.sum,dram__bytes_write.sum,launch__registers_per_thread,launch__grid_size"
ncu_rows() { grep -E "^  [a-zA-Z_]|duration|per_second|pct_of_peak|bytes_read|bytes_write|registers|grid_size|Stall|Warp Cycles|Issued" "$1" | cut -c1-120 | head -${2:-80}; }
# PART=a: (1) GPU tests of the Gluon GEMM1 / GEMM2 dgrads (session 27's _store_halves refactor never ran on a GPU;
#   the GEMM2 dgrad's v3: one m64n128 accumulator per consumer, two staging tiles); (2) the bf16 GEMM2 dgrad (~455 TF/s
#   at 235B, the least efficient GEMM of the layer) interleaved: Triton two-per-SM (default) / one-per-SM / 128 x 256 at
#   16 warps, Gluon v3 / v2-style split; then Nsight at 235B (tensor pipe, shared memory, L2, DRAM, warp stalls).
#   Hypothesis: two m64n64 wgmmas per k16 step read the A tile twice and ask ~192 B/clk of shared memory at the tensor
#   pipe's peak (the SM has 128), one m64n128 ~160; (3) the layer with WS_GEMM2_DGRAD=1 (v3) and WS_WGRAD_SPLIT=1;
#   (4) if time is left, session 27's PART e (Nsight on the wgrads, default and split_n).
if [ "$PART" = a ]; then
  gpu_tests ws_a tests/test_ws_gemm_fp8.py tests/test_ws_gemm.py -k gpu
  timeout $(left 120) python3 scripts/ab_kernels.py --shapes 235b,30b --groups gemm2_dgrad --rounds 8 \
    --out "$OUT/keep/ab_kernels_a.json" > "$OUT/ab_kernels_a.log" 2>&1
  echo "[t=$((SECONDS - t0))s] ab_kernels rc $?"; grep -E "^(30b|235b)" "$OUT/ab_kernels_a.log"; tail -3 "$OUT/ab_kernels_a.log"
  timeout $(left 100) "$(ncu_bin)" --clock-control none -k "regex:dgrad" --launch-skip 7 --launch-count 18 \
    --section WarpStateStats --metrics "$NCU_METRICS" \
    python3 scripts/ab_kernels.py --shapes 235b --groups gemm2_dgrad --rounds 1 --reps 1 \
    > "$OUT/keep/ncu_gemm2_dgrad_a.txt" 2> "$OUT/ncu_gemm2_dgrad_a.err"
  echo "[t=$((SECONDS - t0))s] ncu gemm2 dgrad rc $?"; ncu_rows "$OUT/keep/ncu_gemm2_dgrad_a.txt" 150
  [ "$(left 100)" -ge 70 ] && layer_ab 235b_a "WS_GEMM2_DGRAD=1 WS_WGRAD_SPLIT=1" qwen3-235b-a22b bf16 megamoe-triton 3
  [ "$(left 100)" -ge 50 ] && layer_ab 30b_a "WS_GEMM2_DGRAD=1" qwen3-30b-a3b bf16 megamoe-triton 2
  if [ "$(left 100)" -ge 60 ]; then
    timeout $(left 100) "$(ncu_bin)" --clock-control none -k "regex:_wgrad_ws_kernel" --launch-skip 2 --launch-count 16 \
      --metrics "$NCU_METRICS" python3 scripts/ab_kernels.py --shapes 235b --groups wgrad_w13,wgrad_w2 --rounds 1 \
      --reps 1 > "$OUT/keep/ncu_wgrad_a.txt" 2> "$OUT/ncu_wgrad_a.err"
    echo "[t=$((SECONDS - t0))s] ncu wgrad rc $?"; ncu_rows "$OUT/keep/ncu_wgrad_a.txt" 120
  fi
  mv "$OUT"/keep/*.log "$OUT"/ 2>/dev/null
fi
# PART=b: PART a's interleaved A/B put the Triton GEMM2 dgrad on 128 x 256 tiles at 16 warps, one program per SM,
#   4 stages, 12 % ahead of the two-per-SM default at 235B (3.131 vs 3.577 ms) and 5 % at 30B, bitwise the same
#   outputs; Nsight: the default is L2-bound (84 %), the wide tile halves the gathered rows' L2 traffic. Now the
#   default (GEMM2_DGRAD_WIDE), and WS_WGRAD_SPLIT "auto" (split at D >= 4096). (1) compare.layer 235B: the new
#   defaults against the old ones (both off) and the wide tile alone, same process, beside stock TorchTitan compiled
#   (issue 4); (2) 30B bf16 / fp8 likewise; (3) the bf16 op's GPU tests at real shapes (the wide GEMM2 dgrad in the
#   op, CUDA-graph capture). Not run in session 28 (no device time left); ready for the next call:
#   REV=<hash> PART=b bash scripts/sessions/gpu_s28.sh
if [ "$PART" = b ]; then
  layer_ab 235b_b "GEMM2_DGRAD_WIDE=0,WS_WGRAD_SPLIT=0 WS_WGRAD_SPLIT=0" qwen3-235b-a22b bf16 tt-compile,megamoe-triton 5
  [ "$(left 200)" -ge 60 ] && gpu_tests wide_b tests/test_gpu.py -k "real_shapes or cuda_graph or no_host_sync"
  # GEMM2 forward at 16 warps (the GEMM2 dgrad's lesson), and the GEMM1 dgrads (Triton, Gluon at group_m 1 / 4 / 8)
  [ "$(left 100)" -ge 50 ] && timeout $(left 100) python3 scripts/ab_kernels.py --shapes 235b,30b \
    --groups gemm2_fwd,gemm1_dgrad,gemm1_dgrad_order --rounds 8 --out "$OUT/keep/ab_kernels_b.json" \
    > "$OUT/ab_kernels_b.log" 2>&1
  echo "[t=$((SECONDS - t0))s] ab_kernels rc $?"; grep -E "^(30b|235b)" "$OUT/ab_kernels_b.log"; tail -3 "$OUT/ab_kernels_b.log"
  # the GEMM1 dgrad's DRAM over-read (~11 GB against 5.1): Triton (hardware block order) against the persistent Gluon
  # kernel at group_m 1 / 4 / 8. Hypothesis: the persistent programs drift apart, so the live tiles stop being a
  # contiguous window of the tile order and an expert's 25 MB of weights is read from DRAM more than once.
  if [ "$(left 100)" -ge 60 ]; then
    timeout $(left 90) "$(ncu_bin)" --clock-control none -k "regex:gemm1_dgrad" --launch-count 30 \
      --metrics "$NCU_METRICS" python3 scripts/ab_kernels.py --shapes 235b --groups gemm1_dgrad,gemm1_dgrad_order \
      --rounds 1 --reps 1 > "$OUT/keep/ncu_gemm1_dgrad_b.txt" 2> "$OUT/ncu_gemm1_dgrad_b.err"
    echo "[t=$((SECONDS - t0))s] ncu gemm1 dgrad rc $?"; ncu_rows "$OUT/keep/ncu_gemm1_dgrad_b.txt" 200
  fi
  [ "$(left 200)" -ge 100 ] && layer_ab 30b_b "GEMM2_DGRAD_WIDE=0" qwen3-30b-a3b bf16,fp8 tt-compile,megamoe-triton 8
  mv "$OUT"/keep/*.log "$OUT"/ 2>/dev/null
fi
session_pack "s28$PART"
