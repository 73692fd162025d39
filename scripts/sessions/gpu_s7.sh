#!/usr/bin/env bash
# GPU, next session's calls (written in session 6, which had no device time): measure what session 6
# built on CPU, each against its switch in the same call.
#   PART=a (2 H200, ~8 min): correctness on the GPU with the new defaults (kernels/launch.py fast launch,
#     bf16 combine rows): tests/test_gpu.py single-GPU tests + the 2-GPU EP worker (bf16); host time per
#     launcher with the fast path off / on (scripts/host_overhead.py); scripts/bench_fp8.py: persistent
#     GEMM2 (bf16, FP8) vs the grid kernels, bitwise flags, and session 5's fused dgate_up row.
#   PART=b and PART=d (EP 2, never run: no 2-GPU machine in sessions 6 and 7) moved to scripts/sessions/gpu_s8.sh
#     (its PART b and c).
#   PART=c (1 H200 is enough, ~8 min): compare.layer EP 1 at 30B with (FAST_LAUNCH, PERSISTENT_GEMM2) =
#     (0,0), (1,0), (1,1), three processes (both are read at import); then session 5's fused dgate_up at
#     EP 2 (TITAN_MEGAMOE_FP8_FUSED_DGU 0 / 1) if two GPUs and time are left.
# Predictions (docs/NOTES.md, session 6): EP 1 30B fwd 3.28 -> ~3.15 ms from the launch path; EP 2 30B
# fwd 4.42 -> ~4.2 ms; combine_push 0.38 -> 0.19-0.27 ms per direction (fwd+bwd -0.25..-0.45 ms); persistent
# GEMM2 unknown sign (prefetch across tiles vs one CTA per SM at 235 registers).
# Call as: REV=<hash> PART=a bash scripts/sessions/gpu_s7.sh   (carry .whl; see scripts/gpu_env.sh)
source scripts/gpu_env.sh
export TITAN_MEGAMOE_GIT_REV=$REV
set +e
t0=$SECONDS
PART=${PART:-a}
NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")
mkdir -p "$OUT/keep"
if [ "$PART" = a ]; then
  timeout 200 python3 -m pytest -q -rA tests/test_gpu.py -k "not ep_triton and not reference_ep2" \
    > "$OUT/tests_gpu.log" 2>&1
  echo "[t=$((SECONDS - t0))s] tests_gpu rc $?"; grep -E "passed|failed|Error" "$OUT/tests_gpu.log" | tail -5
  if [ "$NGPU" -ge 2 ]; then
    EP_TRITON_PRECISIONS=bf16 EP_TRITON_ITERS=6 timeout 150 python3 -m torch.distributed.run --standalone \
      --nproc_per_node 2 tests/ep_triton_worker.py > "$OUT/ep_worker.log" 2>&1
    echo "[t=$((SECONDS - t0))s] ep worker rc $?: $(grep -c PASS "$OUT/ep_worker.log") PASS lines"
    grep -v "^\[W\|UserWarning\|warnings.warn" "$OUT/ep_worker.log" | grep -i "fail\|error\|mismatch\|assert" | head
  fi
  timeout 90 python3 scripts/host_overhead.py --iters 50 --out "$OUT/keep/host_overhead_30b_1xh200.json" \
    > "$OUT/host.log" 2>&1
  echo "[t=$((SECONDS - t0))s] host_overhead rc $?"; cat "$OUT/host.log" | grep stage
  timeout 200 python3 scripts/bench_fp8.py --shapes 30b,235b > "$OUT/keep/bench_fp8_1xh200.json" 2> "$OUT/bench.log"
  echo "[t=$((SECONDS - t0))s] bench_fp8 rc $?"; grep "gemm2_fwd\|gemm2_dgrad\|quant_dgate_up" "$OUT/bench.log"
  grep -o '"gemm2_persistent_bitwise_grid": {[^}]*}\|"gemm2_dgrad_quant_dgu_bitwise_dual": [a-z]*' \
    "$OUT/keep/bench_fp8_1xh200.json"
fi
if [ "$PART" = c ]; then
  for mode in "0 0" "1 0" "1 1"; do
    set -- $mode
    TITAN_MEGAMOE_FAST_LAUNCH=$1 TITAN_MEGAMOE_PERSISTENT_GEMM2=$2 timeout 110 python3 -m compare.layer \
      --shapes qwen3-30b-a3b --impls tt-compile,megamoe-triton --precisions bf16 --routings random \
      --iters 20 --warmup 5 --no-plot --out "$OUT/keep/layer_1xh200_ep1_fast$1_pers$2.json" > "$OUT/layer_$1$2.log" 2>&1
    echo "[t=$((SECONDS - t0))s] layer ep1 FAST_LAUNCH=$1 PERSISTENT_GEMM2=$2 rc $?"; grep "^|" "$OUT/layer_$1$2.log"
  done
  left=$((500 - (SECONDS - t0)))
  if [ "$NGPU" -ge 2 ] && [ $left -gt 200 ]; then
    for flag in 0 1; do
      mkdir -p "$OUT/fused$flag"
      REV=$REV OUT="$OUT/fused$flag" TITAN_MEGAMOE_FP8_FUSED_DGU=$flag PRECISIONS=fp8 MODES=v1 TIMEOUT=$((left / 2 - 10)) \
        bash scripts/gpu_ep_overlap.sh > /dev/null 2>&1
      cp "$OUT/fused$flag/ep_overlap_2xh200.json" "$OUT/keep/ep_overlap_2xh200_fp8_fused_dgu$flag.json" 2>/dev/null
      echo "[t=$((SECONDS - t0))s] ep_overlap fp8 v1 FUSED_DGU=$flag"
      grep "^| qwen\|^phases" "$OUT/fused$flag/ep_overlap.log" | head -6
    done
  fi
fi
# at most 8 files come back: the JSON records as they are, the logs in one archive
cd "$OUT" && tar czf /tmp/logs_s7$PART.tgz --exclude=keep . && mv keep/* . && rmdir keep
find . -mindepth 1 -maxdepth 1 -type d -exec rm -rf {} + ; mv /tmp/logs_s7$PART.tgz . ; ls "$OUT"
