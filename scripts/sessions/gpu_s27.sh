#!/usr/bin/env bash
# GPU calls of session 27 (say in the results which card ran).
# Call as: REV=<hash> PART=a bash scripts/sessions/gpu_s27.sh   (carry .whl; see scripts/gpu_env.sh)
source scripts/gpu_env.sh
session_start
# PART=a: (1) on an H200 only: issue 4's measurement, bf16 beside stock TorchTitan compiled at both shapes (fp8 rows
#   too, for issue 6); (2) the FP8 GPU tests with GEMM2_DGRAD_FP8_2CTA=1 (session 26's run was cut after 21 passes),
#   before making it the default at D <= 2048 (last, with what time is left); (3) where the bf16 235B step goes now (the last profile is session 9's); (4) Nsight Compute on a dense cuBLAS GEMM and
#   the bf16 Gluon GEMM1 dgrad / GEMM1 at 235B: is L2 -> SM bandwidth what holds them at ~620 TF/s? (scripts/ncu_gemm_l2.py)
if [ "$PART" = a ]; then
  if grep -q H200 "$OUT/gpu.txt"; then
    layer_ab 30b_a "" qwen3-30b-a3b bf16,fp8 tt-compile,megamoe-triton
    layer_ab 235b_a "" qwen3-235b-a22b bf16,fp8 tt-compile,megamoe-triton
  fi
  timeout 150 "$(ncu_bin)" --clock-control none -k "regex:gemm|nvjet|_ws_kernel" --launch-count 9 \
    --section SpeedOfLight --metrics "gpu__time_duration.sum,sm__cycles_elapsed.avg.per_second,lts__t_bytes.sum.per_second,dram__bytes.sum.per_second,sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed,lts__throughput.avg.pct_of_peak_sustained_elapsed" \
    python3 scripts/ncu_gemm_l2.py > "$OUT/keep/ncu_gemm_l2_a.txt" 2> "$OUT/keep/ncu_gemm_l2_a.err"
  echo "[t=$((SECONDS - t0))s] ncu rc $?"
  grep -E "^  [a-zA-Z_]|Duration|Frequency|Throughput|per_second|pct_of_peak|gmma.sum|time_duration" "$OUT/keep/ncu_gemm_l2_a.txt" \
    | cut -c1-130 | head -90
  tail -3 "$OUT/keep/ncu_gemm_l2_a.err" | cut -c1-200
  timeout 60 python3 scripts/ncu_gemm_l2.py --time
  timeout 100 python3 -m compare.profile --shape qwen3-235b-a22b --impl megamoe-triton --precision bf16 --iters 5 \
    --top 16 --out "$OUT/keep/profile_235b_bf16_a.json" > "$OUT/keep/profile_235b_bf16_a.log" 2>&1
  echo "[t=$((SECONDS - t0))s] profile 235B bf16 rc $?"; tail -20 "$OUT/keep/profile_235b_bf16_a.log" | cut -c1-140
  TITAN_MEGAMOE_GEMM2_DGRAD_FP8_2CTA=1 gpu_tests 2cta_a tests/test_kernels_fp8_bwd.py tests/test_gpu.py \
    tests/test_eager_layer.py -k "fp8"
fi
# PART=b: PART a's Nsight found the bf16 Gluon GEMM1 dgrad's tensor pipe busy only 66-71 % (3-stage ring) against 88-90 %
#   for the 4-stage GEMM1 forward and 93 % for cuBLAS, L2 at 70 % and shared memory at 55 %: a pipeline too shallow, not
#   a bandwidth bound. split_n (each consumer's accumulator as two column halves, half the epilogue's staging) frees a
#   4th stage for the GEMM1 dgrad (WS_GEMM1_DGRAD=split) and the wgrads (WS_WGRAD_SPLIT=1). (1) kernel benches, 30B /
#   235B, bitwise the default; (2) compare.layer bf16 with the switches, same process; (3) GPU tests of both kernels
#   (split cases included); (4) the FP8 op tests with GEMM2_DGRAD_FP8_2CTA=1 (PART a's run was cut at 240 s).
if [ "$PART" = b ]; then
  timeout 100 python3 scripts/bench_ws_gemm.py bench --out "$OUT/keep/bench_ws_gemm1_dgrad_b.json" > "$OUT/keep/bench_g1d_b.log" 2>&1
  echo "[t=$((SECONDS - t0))s] GEMM1 dgrad bench rc $?"
  grep '^{' "$OUT/keep/bench_g1d_b.log" | python3 -c "
import json, sys
for l in sys.stdin:
    r = json.loads(l); print(r.get('shape', ''), r['kernel'][:34], r.get('cfg', '')[9:80], round(r['ms'], 3), round(r['tflops']), r.get('bitwise_triton', ''))"
  timeout 120 python3 scripts/bench_ws_wgrad.py --out "$OUT/keep/bench_ws_wgrad_b.json" > "$OUT/keep/bench_wgrad_b.log" 2>&1
  echo "[t=$((SECONDS - t0))s] wgrad bench rc $?"; grep -E "^(30b|235b|dense)" "$OUT/keep/bench_wgrad_b.log"
  grep -o '"bitwise_first_config": [a-z]*' "$OUT/keep/bench_ws_wgrad_b.json" | sort | uniq -c
  layer_ab 30b_b "WS_GEMM1_DGRAD=split WS_WGRAD_SPLIT=1 WS_GEMM1_DGRAD=split,WS_WGRAD_SPLIT=1" qwen3-30b-a3b bf16
  layer_ab 235b_b "WS_GEMM1_DGRAD=split WS_WGRAD_SPLIT=1 WS_GEMM1_DGRAD=split,WS_WGRAD_SPLIT=1" qwen3-235b-a22b bf16
  gpu_tests ws_b tests/test_ws_gemm.py tests/test_ws_wgrad.py -k "gpu"
  TITAN_MEGAMOE_GEMM2_DGRAD_FP8_2CTA=1 timeout -s KILL 100 python3 -m pytest -q -rfE tests/test_gpu.py \
    tests/test_eager_layer.py -k "fp8" -p no:cacheprovider > "$OUT/keep/tests_gpu_2cta_b.log" 2>&1
  echo "[t=$((SECONDS - t0))s] fp8 tests (2CTA): $(tail -1 "$OUT/keep/tests_gpu_2cta_b.log")"
  grep -E "^(FAILED|ERROR)" "$OUT/keep/tests_gpu_2cta_b.log" | head
  mv "$OUT"/keep/*.log "$OUT"/ 2>/dev/null; mv "$OUT"/tests_gpu_*.log "$OUT/keep/"  # at most 8 files come back
fi
# PART=c: PART b timed the variants one after the other with do_bench, which favours the first (the same Gluon GEMM1
#   dgrad: 1.212 ms first, 1.343 second), and its layer rows spread +-1 ms at 235B. (1) scripts/ab_kernels.py: Triton /
#   Gluon coop / Gluon split GEMM1 dgrad and default / split wgrads, interleaved in rotated rounds; (2) Nsight on the
#   split GEMM1 dgrad beside the default (tensor pipe busy %); (3) compare.layer: 30B fp8 with GEMM2_DGRAD_FP8_2CTA's
#   new default ("auto": on at D = 2048) against =0, and bf16 235B with the split switches again.
if [ "$PART" = c ]; then
  timeout 150 python3 scripts/ab_kernels.py --out "$OUT/keep/ab_kernels_c.json" 2>&1 | tee "$OUT/ab_kernels_c.log"
  echo "[t=$((SECONDS - t0))s] ab_kernels done"
  timeout 120 "$(ncu_bin)" --clock-control none -k "regex:_gemm1_dgrad_ws_kernel" --launch-count 6 --launch-skip 1 \
    --metrics "gpu__time_duration.sum,sm__cycles_elapsed.avg.per_second,lts__throughput.avg.pct_of_peak_sustained_elapsed,sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed,l1tex__throughput.avg.pct_of_peak_sustained_elapsed,dram__throughput.avg.pct_of_peak_sustained_elapsed" \
    python3 scripts/ncu_gemm_l2.py > "$OUT/keep/ncu_split_c.txt" 2> "$OUT/ncu_split_c.err"
  echo "[t=$((SECONDS - t0))s] ncu rc $?"
  grep -E "^  [a-zA-Z_]|duration|per_second|pct_of_peak" "$OUT/keep/ncu_split_c.txt" | cut -c1-120 | head -50
  layer_ab 30b_fp8_c "GEMM2_DGRAD_FP8_2CTA=0" qwen3-30b-a3b fp8,fp8_bwd megamoe-triton 4
  layer_ab 235b_c "WS_WGRAD_SPLIT=1,WS_GEMM1_DGRAD=split WS_WGRAD_SPLIT=1" qwen3-235b-a22b bf16 megamoe-triton 3
  mv "$OUT"/keep/*.log "$OUT"/ 2>/dev/null
fi
# PART=d: PART c's interleaved A/B put the Triton GEMM1 dgrad ahead of the Gluon one at 235B on this H100 (5.46 vs 5.90
#   ms, noisy; Gluon 17 % ahead at 30B). compare.layer beside stock TorchTitan compiled: 235B bf16 with WS_GEMM1_DGRAD=0
#   (the Triton kernel), and 30B bf16 / fp8 with the new FP8 default (GEMM2_DGRAD_FP8_2CTA "auto").
if [ "$PART" = d ]; then
  layer_ab 235b_d "WS_GEMM1_DGRAD=0" qwen3-235b-a22b bf16 tt-compile,megamoe-triton 4
  layer_ab 30b_d "" qwen3-30b-a3b bf16,fp8 tt-compile,megamoe-triton 6
  mv "$OUT"/keep/*.log "$OUT"/ 2>/dev/null
fi
# PART=e: the wgrads under Nsight Compute, default (3 stages) and split_n (4 stages), 235B: does the 4th stage raise the
#   tensor pipe's busy share as it did for the GEMM1 dgrad (67-70 -> 79-84 %)? The launcher is ab_kernels.py (one round).
#   Not run in session 27 (no device time left to start a machine).
if [ "$PART" = e ]; then
  timeout 150 "$(ncu_bin)" --clock-control none -k "regex:_wgrad_ws_kernel" --launch-count 12 \
    --metrics "launch__shared_mem_per_block_dynamic,gpu__time_duration.sum,sm__cycles_elapsed.avg.per_second,lts__throughput.avg.pct_of_peak_sustained_elapsed,sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed,l1tex__throughput.avg.pct_of_peak_sustained_elapsed,dram__throughput.avg.pct_of_peak_sustained_elapsed" \
    python3 scripts/ab_kernels.py --shapes 235b --rounds 1 --reps 1 > "$OUT/keep/ncu_wgrad_e.txt" 2> "$OUT/ncu_wgrad_e.err"
  echo "[t=$((SECONDS - t0))s] ncu rc $?"
  grep -E "^  [a-zA-Z_]|shared_mem|duration|per_second|pct_of_peak" "$OUT/keep/ncu_wgrad_e.txt" | cut -c1-120 | head -110
fi
session_pack "s27$PART"
