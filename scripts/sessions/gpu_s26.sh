#!/usr/bin/env bash
# GPU calls of session 26 (say in the results which card ran).
# Call as: REV=<hash> PART=a bash scripts/sessions/gpu_s26.sh   (carry .whl; see scripts/gpu_env.sh)
source scripts/gpu_env.sh
session_start
# PART=a: ordered consumers (the two cooperative consumer warpgroups issue each K step's MMAs in turn, so one scales
#   its partials while the other's MMAs run): FP8 wgrad (FP8_WGRAD_CONSUMER=ordered) and the FP8 GEMM1, GEMM1 dgrad,
#   GEMM2 (FP8_ORDERED_MMA=1). (1) GPU tests (bitwise the default consumers); (2) kernel benches, 30B and 235B;
#   (3) compare.layer fp8 / fp8_bwd with the switches, same process per shape; (4) on an H200 only: bf16 beside stock.
#   Also the quantization passes' warp-owned columns (FP8_QUANT_COLS=warp: a warp owns 8 whole columns, so the 128-row
#   amax takes shuffles, no CTA barrier; swizzled tile buffers): GPU tests (bitwise the Triton kernels) and a bench.
if [ "$PART" = a ]; then
  gpu_tests a tests/test_ws_wgrad_fp8.py tests/test_ws_gemm_fp8.py tests/test_gl_quant_bwd.py -k "gpu"
  timeout 120 python3 scripts/bench_wgrad_fp8.py --out "$OUT/keep/bench_wgrad_fp8_a.json" > "$OUT/keep/bench_wgrad_fp8_a.log" 2>&1
  echo "[t=$((SECONDS - t0))s] wgrad bench rc $?"; grep -v "^{" "$OUT/keep/bench_wgrad_fp8_a.log" | cut -c1-170 | tail -14
  for mode in bench-fwd-fp8 bench-dgrad-fp8 bench-g2-fp8; do
    timeout 90 python3 scripts/bench_ws_gemm.py $mode --out "$OUT/keep/bench_$mode.json" > "$OUT/keep/bench_$mode.log" 2>&1
    echo "[t=$((SECONDS - t0))s] $mode rc $?"
    grep '^{' "$OUT/keep/bench_$mode.log" | python3 -c "
import json, sys, re
for l in sys.stdin:
    r = json.loads(l); c = r.get('cfg', '')
    c = ' '.join(re.findall(r'(stages=\d+|ordered=\w+)', c))
    print(r['shape'], r['kernel'][:40], c, round(r['ms'], 4), round(r.get('tflops') or 0), r.get('bitwise_triton', ''))"
  done
  timeout 100 python3 scripts/bench_quant_bwd.py --shapes 30b,235b > "$OUT/keep/bench_quant_bwd_a.json" 2> "$OUT/keep/bench_quant_bwd_a.log"
  echo "[t=$((SECONDS - t0))s] quant bench rc $?"; grep "pipe" "$OUT/keep/bench_quant_bwd_a.log" | cut -c17-175 | tail -24
fi
# PART=b: compare.layer fp8 / fp8_bwd with the switches of PART a, same process per shape; on an H200 only: bf16 beside
#   stock TorchTitan compiled (issue 4).
if [ "$PART" = b ]; then
  timeout 110 python3 scripts/sweep_kernel_configs.py 30b --kinds gemm2_dgrad_fp8 --out "$OUT/keep/sweep_g2d_fp8_b.json" \
    > "$OUT/keep/sweep_g2d_fp8_b.log" 2>&1
  echo "[t=$((SECONDS - t0))s] sweep gemm2_dgrad_fp8 rc $?"; grep '^{' "$OUT/keep/sweep_g2d_fp8_b.log" | cut -c1-230 | head -12
  layer_ab 30b_b "FP8_WGRAD_CONSUMER=ordered FP8_ORDERED_MMA=1 FP8_QUANT_COLS=warp FP8_WGRAD_CONSUMER=ordered,FP8_ORDERED_MMA=1,FP8_QUANT_COLS=warp" \
    qwen3-30b-a3b fp8,fp8_bwd megamoe-triton 10
  layer_ab 235b_b "FP8_WGRAD_CONSUMER=ordered,FP8_ORDERED_MMA=1 FP8_WGRAD_CONSUMER=ordered,FP8_ORDERED_MMA=1,FP8_QUANT_COLS=warp" \
    qwen3-235b-a22b fp8
  TITAN_MEGAMOE_FP8_WGRAD_CONSUMER=ordered TITAN_MEGAMOE_FP8_ORDERED_MMA=1 TITAN_MEGAMOE_FP8_QUANT_COLS=warp \
    timeout 90 python3 -m compare.profile --shape qwen3-30b-a3b --impl megamoe-triton --precision fp8 --iters 5 \
    --top 18 --out "$OUT/keep/profile_30b_fp8_b.json" > "$OUT/keep/profile_30b_fp8_b.log" 2>&1
  echo "[t=$((SECONDS - t0))s] profile (all three switches on) rc $?"; tail -22 "$OUT/keep/profile_30b_fp8_b.log" | cut -c1-140
  if grep -q H200 "$OUT/gpu.txt"; then
    layer_ab 30b_bf16_b "" qwen3-30b-a3b bf16 tt-compile,megamoe-triton
    layer_ab 235b_bf16_b "" qwen3-235b-a22b bf16 tt-compile,megamoe-triton
  fi
fi
# PART=c: FP8_QUANT_COLS=warp on by default (PART a/b: bitwise, 30B fp8 7.958 -> 7.662 ms); the wgrad's ordered consumer
#   removed (slower). Lean (little device time left): (1) compare.layer beside stock TorchTitan compiled (bf16 and fp8), with rows for the old default (FP8_QUANT_COLS=cta)
#   and GEMM2_DGRAD_FP8_2CTA=1 (the Triton FP8 GEMM2 dgrad at BN 64, two programs per SM), same process per shape;
#   (2) the FP8 op / fused-node GPU tests with the new default, if time is left.
if [ "$PART" = c ]; then
  layer_ab 30b_c "FP8_QUANT_COLS=cta GEMM2_DGRAD_FP8_2CTA=1" qwen3-30b-a3b bf16,fp8 tt-compile,megamoe-triton 12
  layer_ab 235b_c "GEMM2_DGRAD_FP8_2CTA=1" qwen3-235b-a22b bf16,fp8 tt-compile,megamoe-triton 10
  timeout -s KILL 90 python3 -m pytest -q -rfE tests/test_gpu.py tests/test_eager_layer.py -k "fp8" -p no:cacheprovider \
    > "$OUT/keep/tests_gpu_c.log" 2>&1
  echo "[t=$((SECONDS - t0))s] gpu tests: $(tail -1 "$OUT/keep/tests_gpu_c.log")"; grep -E "^(FAILED|ERROR)" "$OUT/keep/tests_gpu_c.log" | head
fi
# PART=d: GEMM2_DGRAD_FP8_2CTA again in another process (PART c: 30B fp8 7.138 -> 7.017 ms, 235B 22.84 -> 23.14).
if [ "$PART" = d ]; then
  layer_ab 30b_d "GEMM2_DGRAD_FP8_2CTA=1" qwen3-30b-a3b fp8,fp8_bwd megamoe-triton 4
  layer_ab 235b_d "GEMM2_DGRAD_FP8_2CTA=1" qwen3-235b-a22b fp8 megamoe-triton 2
fi
session_pack "s26$PART"
