#!/usr/bin/env bash
# GPU, next session's calls (written in session 7, whose device loans paused after two 1-H200 calls):
# measure session 7's host-side changes against their switches in the same call, then the EP = 2 parts
# of scripts/sessions/gpu_s7.sh that never ran (no 2-GPU machine was lent in session 6 or 7).
#   PART=a (1 H200 is enough, ~8 min): GPU tests (single-GPU tests of tests/test_gpu.py, and the eager
#     autograd / fused router tests compiled); host_overhead.py (stages with the eager Function and the
#     fused router on / off); compare.layer EP 1: both shapes, stock compiled vs megamoe bf16 with today's
#     defaults plus the opt-in fused router (TITAN_MEGAMOE_FUSED_ROUTER=1: make it the default if its GPU
#     tests pass and it is faster), then megamoe alone at 30B with (EAGER_AUTOGRAD, FUSED_ROUTER, PERSISTENT_GEMM2) = (0,0,0),
#     (1,0,0), (1,1,1) (the before, the halfway, and the bf16 persistent GEMM2 again: session 7's layer run
#     said -0.17 ms fwd, its do_bench +0.06 ms), one process each, then 30B fp8 / fp8_bwd (persistent FP8
#     GEMM2 now the default). 7 files back.
#   PART=b (2 H200, ~9 min): the 2-GPU EP worker (bf16), compare.layer EP 2 both shapes bf16 / fp8 vs
#     stock compiled bf16 / fp8, ep_overlap bf16 v1 with TITAN_MEGAMOE_COMBINE_DTYPE=fp32 vs bf16
#     (gpu_s7.sh PART b).
#   PART=c (2 H200, ~9 min): ep_overlap fp8 v1 with TITAN_MEGAMOE_FP8_WGRAD=bf16, then compare.train
#     30B-8L fp8 EP 2 vs stock fp8, 30 steps (gpu_s7.sh PART d).
# Every compare.layer run adds --device-time (the device's work alone, behind a 40 ms device sleep, beside
# the from-idle times): the host-side changes should cut fwd ms and leave fwd device ms unchanged.
# Predictions (docs/NOTES.md, session 7): EP 1 30B fwd -0.25..-0.45 ms on the H200 host from the eager
# Function, another -0.2..-0.4 ms from the fused router (host time before GEMM1); fwd+bwd less (the
# backward is device-bound); FP8 fwd unchanged within noise (host-bound), fp8 fwd+bwd -0.05 ms.
# Call as: REV=<hash> PART=a bash scripts/sessions/gpu_s8.sh   (carry .whl; see scripts/gpu_env.sh)
source scripts/gpu_env.sh
export TITAN_MEGAMOE_GIT_REV=$REV
set +e
t0=$SECONDS
PART=${PART:-a}
mkdir -p "$OUT/keep"
if [ "$PART" = a ]; then
  timeout 150 python3 -m pytest -q -rA tests/test_gpu.py tests/test_eager_autograd.py tests/test_router_kernel.py \
    -k "not ep_triton and not reference_ep2 and not layer_matches_stock" > "$OUT/tests_gpu.log" 2>&1
  echo "[t=$((SECONDS - t0))s] tests rc $?"; grep -E "passed|failed|Error" "$OUT/tests_gpu.log" | tail -5
  timeout 60 python3 scripts/host_overhead.py --iters 40 --out "$OUT/keep/host_overhead_30b_1xh200.json" \
    > "$OUT/host.log" 2>&1
  echo "[t=$((SECONDS - t0))s] host_overhead rc $?"; grep stage "$OUT/host.log"
  TITAN_MEGAMOE_FUSED_ROUTER=1 timeout 150 python3 -m compare.layer --shapes qwen3-30b-a3b,qwen3-235b-a22b \
    --impls tt-compile,megamoe-triton \
    --precisions bf16 --routings random --iters 20 --warmup 5 --device-time --no-plot --out "$OUT/keep/layer_1xh200_ep1.json" \
    > "$OUT/layer.log" 2>&1
  echo "[t=$((SECONDS - t0))s] layer ep1 rc $?"; grep "^|" "$OUT/layer.log"
  for mode in "0 0 0" "1 0 0" "1 1 1"; do
    set -- $mode
    TITAN_MEGAMOE_EAGER_AUTOGRAD=$1 TITAN_MEGAMOE_FUSED_ROUTER=$2 TITAN_MEGAMOE_PERSISTENT_GEMM2=$3 timeout 45 \
      python3 -m compare.layer --shapes qwen3-30b-a3b --impls megamoe-triton --precisions bf16 --routings random \
      --iters 20 --warmup 5 --device-time --no-plot --out "$OUT/keep/layer_1xh200_ep1_eager$1_router$2_pers$3.json" \
      > "$OUT/layer_$1$2$3.log" 2>&1
    echo "[t=$((SECONDS - t0))s] layer ep1 EAGER_AUTOGRAD=$1 FUSED_ROUTER=$2 PERSISTENT_GEMM2=$3 rc $?"
    grep "^| qwen" "$OUT/layer_$1$2$3.log"
  done
  timeout 70 python3 -m compare.layer --shapes qwen3-30b-a3b --impls megamoe-triton --precisions fp8,fp8_bwd \
    --routings random --iters 20 --warmup 5 --device-time --no-plot --out "$OUT/keep/layer_1xh200_ep1_fp8.json" > "$OUT/layer_fp8.log" 2>&1
  echo "[t=$((SECONDS - t0))s] layer ep1 fp8 rc $?"; grep "^| qwen" "$OUT/layer_fp8.log"
fi
if [ "$PART" = b ]; then
  EP_TRITON_PRECISIONS=bf16 EP_TRITON_ITERS=6 timeout 150 python3 -m torch.distributed.run --standalone \
    --nproc_per_node 2 tests/ep_triton_worker.py > "$OUT/ep_worker.log" 2>&1
  echo "[t=$((SECONDS - t0))s] ep worker rc $?: $(grep -c PASS "$OUT/ep_worker.log") PASS lines"
  grep -v "^\[W\|UserWarning\|warnings.warn" "$OUT/ep_worker.log" | grep -i "fail\|error\|mismatch\|assert" | head
  timeout 200 python3 -m torch.distributed.run --standalone --nproc_per_node 2 -m compare.layer \
    --shapes qwen3-30b-a3b,qwen3-235b-a22b --impls tt-compile,megamoe-triton --precisions bf16,fp8 \
    --routings random --iters 15 --warmup 4 --device-time --no-plot --out "$OUT/keep/layer_2xh200_ep2.json" > "$OUT/layer_ep2.log" 2>&1
  echo "[t=$((SECONDS - t0))s] layer ep2 rc $?"; grep "^|\|rror" "$OUT/layer_ep2.log" | head -14
  for cd in fp32 bf16; do
    mkdir -p "$OUT/comb_$cd"
    REV=$REV OUT="$OUT/comb_$cd" TITAN_MEGAMOE_COMBINE_DTYPE=$cd PRECISIONS=bf16 MODES=v1 TIMEOUT=100 \
      bash scripts/gpu_ep_overlap.sh > /dev/null 2>&1
    cp "$OUT/comb_$cd/ep_overlap_2xh200.json" "$OUT/keep/ep_overlap_2xh200_comb_$cd.json" 2>/dev/null
    echo "[t=$((SECONDS - t0))s] ep_overlap bf16 v1 combine $cd"
    grep "^| qwen\|^phases" "$OUT/comb_$cd/ep_overlap.log" | head -6
  done
fi
if [ "$PART" = c ]; then
  mkdir -p "$OUT/wgrad_bf16"
  REV=$REV OUT="$OUT/wgrad_bf16" TITAN_MEGAMOE_FP8_WGRAD=bf16 PRECISIONS=fp8 MODES=v1 TIMEOUT=150 \
    bash scripts/gpu_ep_overlap.sh > /dev/null 2>&1
  cp "$OUT/wgrad_bf16/ep_overlap_2xh200.json" "$OUT/keep/ep_overlap_2xh200_fp8_wgrad_bf16.json" 2>/dev/null
  echo "[t=$((SECONDS - t0))s] ep_overlap fp8 v1 TITAN_MEGAMOE_FP8_WGRAD=bf16"
  grep "^| qwen\|^phases" "$OUT/wgrad_bf16/ep_overlap.log" | head -6
  S=train_configs/qwen3_30b_a3b_8L
  left=$((520 - (SECONDS - t0)))
  timeout $left python3 -m compare.train --ngpu 2 --steps 30 --skip 10 \
    --configs ${S}_megamoe_fp8.toml ${S}_baseline_fp8.toml --labels megamoe-fp8 torchtitan-fp8 \
    --out "$OUT/keep/train_30b8L_2xh200_ep2_fp8.json" > "$OUT/train.log" 2>&1
  echo "[t=$((SECONDS - t0))s] train rc $?"; grep "^|" "$OUT/train.log"
fi
# at most 8 files come back: the JSON records as they are, everything else in one archive (gpu_s7.sh left
# the logs beside the archive too, and PART c's last records did not come back)
cd "$OUT" && tar czf /tmp/logs_s8$PART.tgz --exclude=keep . && find . -mindepth 1 -maxdepth 1 ! -name keep -exec rm -rf {} +
mv keep/* . ; rmdir keep ; mv /tmp/logs_s8$PART.tgz . ; ls "$OUT"
