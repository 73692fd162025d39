#!/usr/bin/env bash
# GPU calls of session 28 (say in the results which card ran).
# Call as: REV=<hash> PART=a bash scripts/gpu_s28.sh   (carry .whl; see scripts/gpu_env.sh)
source scripts/gpu_env.sh
session_start
NCU_METRICS="gpu__time_duration.sum,sm__cycles_elapsed.avg.per_second,sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed,l1tex__throughput.avg.pct_of_peak_sustained_elapsed,lts__throughput.avg.pct_of_peak_sustained_elapsed,dram__throughput.avg.pct_of_peak_sustained_elapsed,dram__bytes_read.sum,dram__bytes_write.sum,launch__registers_per_thread,launch__grid_size"
left() { local l=$((575 - SECONDS + t0)); [ "$l" -gt "$1" ] && l=$1; [ "$l" -lt 5 ] && l=5; echo $l; }  # left CAP: seconds
ncu_rows() { grep -E "^  [a-zA-Z_]|duration|per_second|pct_of_peak|bytes_read|bytes_write|registers|grid_size|Stall|Warp Cycles|Issued" "$1" | cut -c1-120 | head -${2:-80}; }
# PART=a: (1) the GPU tests of session 27's ws_gemm._store_halves refactor (the default FP8 GEMM1 dgrad's epilogue and
#   the split bf16 one), never run on a GPU; (2) the bf16 GEMM2 dgrad at 235B (~455 TF/s, the least efficient GEMM of
#   the layer): interleaved Triton two-per-SM / one-per-SM / 128 x 256 at 16 warps / Gluon with one m64n128 accumulator
#   per consumer (new: v3) or two m64n64 (session 18's v2), then Nsight (tensor pipe, shared memory, L2,
#   DRAM, warp stall reasons). Hypothesis: the Gluon v2 kernel's m64n64 wgmmas (two 64-column accumulators per
#   consumer) ask 128 B/clk of shared memory, its whole bandwidth; the Triton kernel's 128 x 128 tiles ~160 B/clk at
#   the tensor pipe's peak, so both are shared-memory bound; (3) the Gluon GEMM1 dgrad's tile order (group_m 1 / 4 / 8):
#   DRAM bytes (session 27: ~11 GB against a 5.1 GB minimum) and time; (4) session 27's PART e: Nsight on the wgrads,
#   default and split_n; (5) the layer with WS_WGRAD_SPLIT=1 and with WS_GEMM2_DGRAD=1 (v3) at 235B if time is left. On an H200, issue 4's measurement first (layer beside stock TorchTitan compiled).
if [ "$PART" = a ]; then
  if grep -q H200 "$OUT/gpu.txt"; then  # issue 4 names the H200: its measurement first, beside stock compiled
    layer_ab 235b_h200_a "" qwen3-235b-a22b bf16 tt-compile,megamoe-triton 4
    layer_ab 30b_h200_a "" qwen3-30b-a3b bf16 tt-compile,megamoe-triton 4
  fi
  gpu_tests halves_a tests/test_ws_gemm_fp8.py tests/test_ws_gemm.py -k gpu
  timeout $(left 150) python3 scripts/ab_kernels.py --shapes 235b,30b --groups gemm2_dgrad,gemm1_dgrad_order --rounds 8 \
    --out "$OUT/keep/ab_kernels_a.json" > "$OUT/ab_kernels_a.log" 2>&1
  echo "[t=$((SECONDS - t0))s] ab_kernels rc $?"; grep -E "^(30b|235b)" "$OUT/ab_kernels_a.log"; tail -3 "$OUT/ab_kernels_a.log"
  timeout $(left 120) "$(ncu_bin)" --clock-control none -k "regex:dgrad" --launch-skip 7 --launch-count 18 \
    --section WarpStateStats --metrics "$NCU_METRICS" \
    python3 scripts/ab_kernels.py --shapes 235b --groups gemm2_dgrad --rounds 1 --reps 1 \
    > "$OUT/keep/ncu_gemm2_dgrad_a.txt" 2> "$OUT/ncu_gemm2_dgrad_a.err"
  echo "[t=$((SECONDS - t0))s] ncu gemm2 dgrad rc $?"; ncu_rows "$OUT/keep/ncu_gemm2_dgrad_a.txt" 150
  timeout $(left 100) "$(ncu_bin)" --clock-control none -k "regex:_wgrad_ws_kernel" --launch-skip 2 --launch-count 16 \
    --metrics "$NCU_METRICS" \
    python3 scripts/ab_kernels.py --shapes 235b --groups wgrad_w13,wgrad_w2 --rounds 1 --reps 1 \
    > "$OUT/keep/ncu_wgrad_a.txt" 2> "$OUT/ncu_wgrad_a.err"
  echo "[t=$((SECONDS - t0))s] ncu wgrad rc $?"; ncu_rows "$OUT/keep/ncu_wgrad_a.txt" 120
  timeout $(left 100) "$(ncu_bin)" --clock-control none -k "regex:_gemm1_dgrad_ws_kernel" --launch-skip 3 --launch-count 12 \
    --metrics "$NCU_METRICS" \
    python3 scripts/ab_kernels.py --shapes 235b --groups gemm1_dgrad_order --rounds 1 --reps 1 \
    > "$OUT/keep/ncu_gemm1_dgrad_order_a.txt" 2> "$OUT/ncu_order_a.err"
  echo "[t=$((SECONDS - t0))s] ncu gemm1 dgrad order rc $?"; ncu_rows "$OUT/keep/ncu_gemm1_dgrad_order_a.txt" 120
  [ "$(left 100)" -ge 60 ] && layer_ab 235b_wsplit_a "WS_WGRAD_SPLIT=1 WS_GEMM2_DGRAD=1" qwen3-235b-a22b bf16 megamoe-triton 3
  mv "$OUT"/keep/*.log "$OUT"/ 2>/dev/null
fi
session_pack "s28$PART"
