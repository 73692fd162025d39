#!/usr/bin/env bash
# GPU calls of session 25 (1 H200 asked; say in the results which card ran).
# Call as: REV=<hash> PART=a bash scripts/sessions/gpu_s25.sh   (carry .whl; see scripts/gpu_env.sh)
source scripts/gpu_env.sh
session_start
# PART=a: the FP8 wgrad's 128 x 256 tiles (FP8_WGRAD_WIDE_CONFIG; FP8_WGRAD_CONSUMER=wide in a layer), first GPU run:
#   (1) GPU tests (bitwise the 128 x 128 tiles, v1 and the Triton wgrad); (2) bench_wgrad_fp8.py, 30B and 235B;
#   (3) compare.layer fp8 / fp8_bwd with FP8_WGRAD_CONSUMER=wide rows, same process per shape; (4) on an H200 only:
#   compare.layer bf16 beside stock TorchTitan compiled (issue 4).
if [ "$PART" = a ]; then
  gpu_tests a tests/test_ws_wgrad_fp8.py
  timeout 150 python3 scripts/bench_wgrad_fp8.py --out "$OUT/keep/bench_wgrad_fp8_a.json" > "$OUT/keep/bench_wgrad_fp8_a.log" 2>&1
  echo "[t=$((SECONDS - t0))s] bench rc $?"; grep -v "^{" "$OUT/keep/bench_wgrad_fp8_a.log" | grep gluon | cut -c1-150 | tail -20
  layer_ab 30b_fp8_a FP8_WGRAD_CONSUMER=wide qwen3-30b-a3b fp8,fp8_bwd
  layer_ab 235b_fp8_a FP8_WGRAD_CONSUMER=wide qwen3-235b-a22b fp8
  if grep -q H200 "$OUT/gpu.txt"; then
    layer_ab 30b_bf16_a "" qwen3-30b-a3b bf16 tt-compile,megamoe-triton
    layer_ab 235b_bf16_a "" qwen3-235b-a22b bf16 tt-compile,megamoe-triton
  fi
fi
# PART=b: the FP8 backward's quantization passes as persistent, load-pipelined Gluon kernels (gl_quant_bwd PIPE_CONFIG,
#   FP8_QUANT_PIPE=1; whole 128 x 128 tiles in flight by cp.async, the dual pass's row work from shared memory):
#   (1) GPU tests (bitwise the Triton kernels, poisoned outputs); (2) bench_quant_bwd.py, 30B and 235B, a config
#   sweep; (3) compare.layer fp8 / fp8_bwd with FP8_QUANT_PIPE=1 rows, same process per shape.
if [ "$PART" = b ]; then
  gpu_tests b tests/test_gl_quant_bwd.py
  timeout 200 python3 scripts/bench_quant_bwd.py > "$OUT/keep/bench_quant_bwd_b.json" 2> "$OUT/keep/bench_quant_bwd_b.log"
  echo "[t=$((SECONDS - t0))s] bench rc $?"; grep "^\[bench" "$OUT/keep/bench_quant_bwd_b.log" | cut -c1-200 | tail -40
  layer_ab 30b_fp8_b FP8_QUANT_PIPE=1 qwen3-30b-a3b fp8,fp8_bwd
  layer_ab 235b_fp8_b FP8_QUANT_PIPE=1 qwen3-235b-a22b fp8
fi
# PART=c: the pipelined quantization kernels on by default (FP8_QUANT_PIPE=1; PART b: bitwise, dual -8 %, gathered -2 %,
#   layer 30B fp8 -0.14 ms): (1) GPU tests of the quantizers and of the FP8 path (op, fused layer node); (2)
#   compare.layer beside stock TorchTitan compiled, all precisions, with FP8_QUANT_PIPE=0 rows, same process per
#   shape; (3) bench_quant_bwd.py with more configs (column slabs of 64, 16 warps); (4) compare.profile 30B fp8: where
#   the step's kernel time goes now; (5) Nsight Compute on the pipelined kernels.
if [ "$PART" = c ]; then
  timeout -s KILL 200 python3 -m pytest -q -rfE tests/test_gl_quant_bwd.py tests/test_eager_layer.py tests/test_gpu.py \
    -k "fp8 or gl_quant" -p no:cacheprovider > "$OUT/keep/tests_gpu_c.log" 2>&1
  echo "[t=$((SECONDS - t0))s] gpu tests: $(tail -1 "$OUT/keep/tests_gpu_c.log")"; grep -E "^(FAILED|ERROR)" "$OUT/keep/tests_gpu_c.log" | head
  layer_ab 30b_c FP8_QUANT_PIPE=0 qwen3-30b-a3b bf16,fp8,fp8_bwd tt-compile,megamoe-triton 9
  layer_ab 235b_c FP8_QUANT_PIPE=0 qwen3-235b-a22b bf16,fp8 tt-compile,megamoe-triton 7
  timeout 100 python3 scripts/bench_quant_bwd.py --shapes 30b > "$OUT/keep/bench_quant_bwd_c.json" 2> "$OUT/keep/bench_quant_bwd_c.log"
  echo "[t=$((SECONDS - t0))s] bench rc $?"; grep "pipe" "$OUT/keep/bench_quant_bwd_c.log" | cut -c17-150 | tail -40
  timeout 90 python3 -m compare.profile --shape qwen3-30b-a3b --impl megamoe-triton --precision fp8 --iters 5 \
    --top 22 --out "$OUT/keep/profile_30b_fp8_c.json" > "$OUT/keep/profile_30b_fp8_c.log" 2>&1
  echo "[t=$((SECONDS - t0))s] profile rc $?"; tail -26 "$OUT/keep/profile_30b_fp8_c.log" | cut -c1-140
  timeout 100 "$(ncu_bin)" --clock-control none -k "regex:_pipe_kernel" --section SpeedOfLight --section Occupancy \
    --section SchedulerStats --section WarpStateStats --section MemoryWorkloadAnalysis \
    --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
    python3 scripts/bench_quant_bwd.py --shapes 30b --ncu > "$OUT/keep/ncu_quant_pipe_c.txt" 2> "$OUT/keep/ncu_quant_pipe_c.err"
  echo "[t=$((SECONDS - t0))s] ncu rc $?"
  awk '/^  _/{print; next} /Duration|Compute \(SM\) Throughput|Memory Throughput|DRAM Throughput|L2 Hit|Achieved Occupancy|Issued Warp|Eligible|stalled/' \
    "$OUT/keep/ncu_quant_pipe_c.txt" | awk '$NF+0 >= 0.2 || !/stalled/' | cut -c1-120 | head -70
fi
session_pack "s25$PART"
