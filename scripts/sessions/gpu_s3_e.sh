#!/usr/bin/env bash
# GPU (2 H200), session 3 last call: 1) the 2-GPU EP worker (v1 + v2, CUDA graphs, bounded barrier), full
# log; 2) GPU 0: compare.layer EP=1, bf16 / fp8 / fp8_bwd beside stock compiled bf16 / fp8, both shapes;
# GPU 1 meanwhile: FP8 tests compiled, then the quick kernel sweep at 30B (wgrad v3, gemm2_dgrad
# prefetch A/B); 3) compare.ep_overlap at EP=2 (v1, v2). Call as: REV=<hash> bash scripts/sessions/gpu_s3_e.sh
source scripts/gpu_env.sh
export TITAN_MEGAMOE_GIT_REV=$REV
set +e
t0=$SECONDS
timeout 150 python3 -m pytest tests/test_gpu.py -k "ep_triton" -q -rs > "$OUT/ep_test.log" 2>&1
echo "[t=$((SECONDS - t0))s] ep test: $(tail -1 "$OUT/ep_test.log")"
(
  export CUDA_VISIBLE_DEVICES=1
  timeout 150 python3 -m pytest tests/test_fp8_quant.py tests/test_kernels_fp8_bwd.py tests/test_fp8_op.py \
    tests/test_gpu.py -k "fp8" -q -rs > "$OUT/fp8_tests.log" 2>&1
  echo "[t=$((SECONDS - t0))s] fp8 tests: $(tail -1 "$OUT/fp8_tests.log")"
  timeout 90 python3 scripts/sweep_kernel_configs.py 30b --quick --kinds wgrad_w13,wgrad_w2,gemm2_dgrad \
    --out "$OUT/sweep_30b.json" > /dev/null 2>&1
  echo "[t=$((SECONDS - t0))s] sweep done"
) &
CUDA_VISIBLE_DEVICES=0 timeout 250 python3 -m compare.layer --shapes qwen3-30b-a3b,qwen3-235b-a22b \
  --impls tt-compile,megamoe-triton --precisions bf16,fp8,fp8_bwd --routings random --iters 20 --warmup 5 \
  --no-plot --out "$OUT/layer_ep1.json" 2>&1 | grep "^|\|GEMM rates\|rror"
echo "[t=$((SECONDS - t0))s] layer done"
wait
MODES=v1,v2 timeout 230 bash scripts/gpu_ep_overlap.sh > /dev/null 2>&1
echo "[t=$((SECONDS - t0))s] ep_overlap: $(tail -1 "$OUT/ep_overlap.log")"
grep "^|" "$OUT/ep_overlap.log" | head -30
rm -f "$OUT/gpu.txt"; ls "$OUT"
