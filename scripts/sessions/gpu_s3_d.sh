#!/usr/bin/env bash
# GPU (2 H200), session 3 call D: compare.ep_overlap at EP=2 (v1 and v2, both shapes: full vs comm alone
# vs compute alone, per-phase events, profiler summary); then compare.layer EP=1 (bf16 / fp8 / fp8_bwd beside
# stock compiled bf16 / fp8) on GPU 0 while GPU 1 runs the quick kernel sweep (wgrad v3, gemm2_dgrad
# prefetch A/B). Call as: REV=<hash> bash scripts/sessions/gpu_s3_d.sh
source scripts/gpu_env.sh
export TITAN_MEGAMOE_GIT_REV=$REV
set +e
t0=$SECONDS
MODES=v1,v2 timeout 250 bash scripts/gpu_ep_overlap.sh > /dev/null 2>&1
echo "[t=$((SECONDS - t0))s] ep_overlap: $(tail -1 "$OUT/ep_overlap.log")"
(
  export CUDA_VISIBLE_DEVICES=1
  timeout 120 python3 scripts/sweep_kernel_configs.py 30b --quick --kinds wgrad_w13,wgrad_w2,gemm2_dgrad \
    --out "$OUT/sweep_30b.json" > /dev/null 2>&1
  timeout 100 python3 scripts/sweep_kernel_configs.py 235b --quick --kinds wgrad_w13,gemm2_dgrad \
    --out "$OUT/sweep_235b.json" > /dev/null 2>&1
  echo "[t=$((SECONDS - t0))s] sweeps done"
) &
CUDA_VISIBLE_DEVICES=0 timeout 260 python3 -m compare.layer --shapes qwen3-30b-a3b,qwen3-235b-a22b \
  --impls tt-compile,megamoe-triton --precisions bf16,fp8,fp8_bwd --routings random --iters 20 --warmup 5 \
  --no-plot --out "$OUT/layer_ep1.json" 2>&1 | grep "^|\|GEMM rates\|rror"
echo "[t=$((SECONDS - t0))s] layer done"
wait
grep -A40 "overlap" "$OUT/ep_overlap.log" | grep "^|" | head -30
rm -f "$OUT/gpu.txt"; ls "$OUT"
