#!/usr/bin/env bash
# GPU (2 H200), session 3 call C. 1) the 2-GPU EP worker (v1 + v2 overlap, CUDA graphs, own bounded
# barrier), full log. 2) in parallel, one job per GPU:
#   GPU 0: FP8 tests compiled (quantizers, fwd/bwd kernels, op at the 30B shape), kernel sweeps (wgrad v3,
#          gemm2_dgrad prefetch A/B, 64-row wgrad tiles), compare.layer EP=1 bf16 / fp8 / fp8_bwd
#   GPU 1: bench_fp8 (FP8 vs bf16 vs torch._scaled_grouped_mm), debug-model training 300 steps
#          triton bf16 / fp8 / fp8_bwd (issue 6 item 4)
# Call as: REV=<hash> bash scripts/gpu_s3_c.sh
source scripts/gpu_env.sh
export TITAN_MEGAMOE_GIT_REV=$REV
set +e
t0=$SECONDS
timeout 200 python3 -m pytest tests/test_gpu.py -k "ep_triton" -q -rs > "$OUT/ep_test.log" 2>&1
tail -3 "$OUT/ep_test.log"; echo "[t=$((SECONDS - t0))s] ep test done"
(
  export CUDA_VISIBLE_DEVICES=0
  timeout 120 python3 -m pytest tests/test_fp8_quant.py tests/test_kernels_fp8.py tests/test_kernels_fp8_bwd.py \
    tests/test_gpu.py -k "fp8" -q -rs > "$OUT/fp8_tests.log" 2>&1
  echo "[t=$((SECONDS - t0))s] fp8 tests: $(tail -1 "$OUT/fp8_tests.log")"
  for sh in 30b 235b; do
    timeout 75 python3 scripts/sweep_kernel_configs.py $sh --quick --kinds wgrad_w13,wgrad_w2,gemm2_dgrad \
      --out "$OUT/sweep_$sh.json" > /dev/null 2>&1
  done
  echo "[t=$((SECONDS - t0))s] sweeps done"
  timeout 230 python3 -m compare.layer --shapes qwen3-30b-a3b,qwen3-235b-a22b --impls tt-compile,megamoe-triton \
    --precisions bf16,fp8,fp8_bwd --routings random --iters 20 --warmup 5 --no-plot \
    --out "$OUT/layer_ep1.json" 2>&1 | grep "^|\|GEMM rates\|rror" > /tmp/layer_ep1.md
  echo "[t=$((SECONDS - t0))s] layer done"
) &
(
  export CUDA_VISIBLE_DEVICES=1
  timeout 100 python3 scripts/bench_fp8.py > "$OUT/bench_fp8.log" 2>&1
  echo "[t=$((SECONDS - t0))s] bench_fp8 done"
  timeout 330 python3 -m compare.train --ngpu 1 --steps 300 --skip 10 --no-plot \
    --configs train_configs/qwen3_debugmoe_1gpu_megamoe_triton_bf16.toml train_configs/qwen3_debugmoe_1gpu_megamoe_fp8.toml \
              train_configs/qwen3_debugmoe_1gpu_megamoe_fp8_bwd.toml --labels triton-bf16 triton-fp8 triton-fp8_bwd \
    --out "$OUT/train_fp8.json" 2>&1 | grep "^|" > /tmp/train_fp8.md
  echo "[t=$((SECONDS - t0))s] fp8 training done"
) &
wait
cat /tmp/layer_ep1.md /tmp/train_fp8.md; tail -2 "$OUT/bench_fp8.log"
rm -f "$OUT/gpu.txt" "$OUT"/train_fp8_*.log "$OUT"/*.png; ls "$OUT"  # at most 8 files come back
