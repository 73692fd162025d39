#!/usr/bin/env bash
# GPU (2 H200), session 3 call B: EP=2 training of the reduced-layer 30B-A3B model (megamoe-triton-ep vs
# stock TorchTitan bf16 and fp8 compiled, one compare.train invocation), then the FP8 kernel tests
# compiled on the H200 and the FP8 forward GEMM bench. Call as: REV=<hash> bash scripts/sessions/gpu_s3_b.sh
source scripts/gpu_env.sh
export TITAN_MEGAMOE_GIT_REV=$REV
set +e
timeout 430 python3 -m compare.train --ngpu 2 --steps 50 --skip 10 \
  --configs train_configs/qwen3_30b_a3b_8L_megamoe_bf16.toml train_configs/qwen3_30b_a3b_8L_baseline_bf16.toml \
            train_configs/qwen3_30b_a3b_8L_baseline_fp8.toml \
  --labels megamoe-triton-ep torchtitan-bf16 torchtitan-fp8 \
  --out "$OUT/train_30b8L_2xh200_ep2.json" 2>&1 | tail -14
timeout 90 python3 -m pytest tests/test_fp8_quant.py tests/test_kernels_fp8.py -q -x 2>&1 | tail -3 | tee "$OUT/fp8_tests.log"
timeout 40 python3 tests/test_kernels_fp8.py bench 30b 2>&1 | tail -8
rm -f "$OUT/gpu.txt"; ls "$OUT"
