#!/usr/bin/env bash
# GPU (2 H200), session 3 call C: the 2-GPU EP worker (v1 + v2 overlap, CUDA graphs, own bounded barrier)
# while GPU 1 also trains the debug model 300 steps with triton bf16 / fp8 / fp8_bwd (issue 6 item 4);
# then on GPU 0 the FP8 tests compiled (quantizers, fwd/bwd kernels, op at the 30B shape) and bench_fp8
# (FP8 vs bf16 vs torch._scaled_grouped_mm). Full logs under $OUT. Call as: REV=<hash> bash scripts/sessions/gpu_s3_c.sh
source scripts/gpu_env.sh
export TITAN_MEGAMOE_GIT_REV=$REV
set +e
t0=$SECONDS
(
  export CUDA_VISIBLE_DEVICES=1
  timeout 420 python3 -m compare.train --ngpu 1 --steps 300 --skip 10 \
    --configs train_configs/qwen3_debugmoe_1gpu_megamoe_triton_bf16.toml train_configs/qwen3_debugmoe_1gpu_megamoe_fp8.toml \
              train_configs/qwen3_debugmoe_1gpu_megamoe_fp8_bwd.toml --labels triton-bf16 triton-fp8 triton-fp8_bwd \
    --out "$OUT/train_fp8.json" > /tmp/train_fp8.txt 2>&1
  echo "[t=$((SECONDS - t0))s] fp8 training done"
) &
timeout 220 python3 -m pytest tests/test_gpu.py -k "ep_triton" -q -rs > "$OUT/ep_test.log" 2>&1
echo "[t=$((SECONDS - t0))s] ep test: $(tail -1 "$OUT/ep_test.log")"
export CUDA_VISIBLE_DEVICES=0
timeout 120 python3 -m pytest tests/test_fp8_quant.py tests/test_kernels_fp8.py tests/test_kernels_fp8_bwd.py \
  tests/test_gpu.py -k "fp8" -q -rs > "$OUT/fp8_tests.log" 2>&1
echo "[t=$((SECONDS - t0))s] fp8 tests: $(tail -1 "$OUT/fp8_tests.log")"
timeout 100 python3 scripts/bench_fp8.py > "$OUT/bench_fp8.log" 2>&1
echo "[t=$((SECONDS - t0))s] bench_fp8 done"
wait
grep "^|" /tmp/train_fp8.txt; tail -3 /tmp/train_fp8.txt | grep -v "^|"; tail -c 1500 "$OUT/bench_fp8.log"
rm -f "$OUT/gpu.txt" "$OUT"/train_fp8_*.log "$OUT"/*.png; cp /tmp/train_fp8.txt "$OUT/train_fp8.txt"; ls "$OUT"
