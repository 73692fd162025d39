#!/usr/bin/env bash
# GPU, session 8's calls (1 H200 lent; the EP = 2 parts of gpu_s8.sh, b and c, still wait for two GPUs).
#   PART=t (~5 min): the GPU tests, three pytest processes side by side (compiles are host-bound, the
#     GPU has room): the fused router's tests compiled (tests/test_router_kernel.py), the eager
#     autograd tests, and the single-GPU tests of tests/test_gpu.py with the fused router and the bf16
#     persistent GEMM2 switched on (gpu_s8.sh PART a measured both faster; its test step ran out of
#     time at 150 s: the tests need ~175 s alone).
#   PART=m (~7 min): the router-hist change (the fused router writes the routing layout's count hist,
#     the layout build skips its count kernel: one launch fewer before GEMM1) and session 8's new
#     defaults (fused router, bf16 persistent GEMM2). GPU tests of the hist path, test_gpu.py's
#     single-GPU tests with the new defaults; compare.layer EP 1 both shapes stock compiled vs
#     megamoe bf16 (--device-time); 30B megamoe with TITAN_MEGAMOE_ROUTER_HIST=0 / 1 (one process
#     each); 30B fp8 / fp8_bwd; compare.profile of the megamoe step at both shapes
#     (per-kernel device time, for the next GEMM work). Prediction (docs/NOTES.md session 8): 30B fwd
#     3.16 -> 2.95-3.05 ms on this host (the count launch's ~150-200 us of host time), device time
#     unchanged within +-0.03 ms, fwd+bwd -0.1..-0.2 ms.
#     (PART m ran at 5ba1368; the router hist was reverted after it, so TITAN_MEGAMOE_ROUTER_HIST no
#     longer exists: the part is kept as the record of that run.)
#   PART=c (~4 min): scripts/gpu_ci.sh (layer + debug-model training vs the committed baselines) with
#     session 8's defaults: the fused router now runs in the uncompiled debug-model training.
# Call as: REV=<hash> PART=t bash scripts/sessions/gpu_s9.sh   (carry .whl; see scripts/gpu_env.sh)
source scripts/gpu_env.sh
export TITAN_MEGAMOE_GIT_REV=$REV
set +e
t0=$SECONDS
PART=${PART:-t}
mkdir -p "$OUT/keep"
if [ "$PART" = t ]; then
  timeout 420 python3 -m pytest -q -rA --durations=5 tests/test_router_kernel.py > "$OUT/tests_router.log" 2>&1 &
  TITAN_MEGAMOE_FUSED_ROUTER=1 TITAN_MEGAMOE_PERSISTENT_GEMM2=1 timeout 420 python3 -m pytest -q -rA --durations=5 \
    tests/test_gpu.py -k "not ep_triton and not reference_ep2" > "$OUT/tests_gpu.log" 2>&1 &
  TITAN_MEGAMOE_FUSED_ROUTER=1 timeout 420 python3 -m pytest -q -rA tests/test_eager_autograd.py > "$OUT/tests_eager.log" 2>&1 &
  wait
  echo "[t=$((SECONDS - t0))s] tests done"
  for f in router gpu eager; do echo "== $f"; grep -E "^(FAILED|ERROR)|passed|failed|rror" "$OUT/tests_$f.log" | tail -8; done
  cp "$OUT"/tests_*.log "$OUT/keep/"
fi
if [ "$PART" = m ]; then
  (timeout 240 python3 -m pytest -q -rA tests/test_router_kernel.py \
     tests/test_eager_autograd.py tests/test_routing.py -k "hist or layer or ties or every_output or cuda or eager" \
     > "$OUT/tests_hist.log" 2>&1) &
  timeout 240 python3 -m pytest -q -rA tests/test_gpu.py -k "not ep_triton and not reference_ep2" > "$OUT/tests_gpu.log" 2>&1 &
  wait
  echo "[t=$((SECONDS - t0))s] tests done"
  for f in hist gpu; do echo "== $f"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests_$f.log" | tail -6; done
  timeout 170 python3 -m compare.layer --shapes qwen3-30b-a3b,qwen3-235b-a22b --impls tt-compile,megamoe-triton \
    --precisions bf16 --routings random --iters 20 --warmup 5 --device-time --no-plot --out "$OUT/keep/layer_1xh200_ep1.json" \
    > "$OUT/layer.log" 2>&1
  echo "[t=$((SECONDS - t0))s] layer ep1 rc $?"; grep "^|" "$OUT/layer.log"
  for run in 0a 1a; do
    h=${run:0:1}
    TITAN_MEGAMOE_ROUTER_HIST=$h timeout 50 python3 -m compare.layer --shapes qwen3-30b-a3b --impls megamoe-triton \
      --precisions bf16 --routings random --iters 20 --warmup 5 --device-time --no-plot --out "$OUT/hist_$run.json" \
      > "$OUT/layer_hist_$run.log" 2>&1
    echo "[t=$((SECONDS - t0))s] 30B ROUTER_HIST=$h ($run) rc $?"; grep "^| qwen" "$OUT/layer_hist_$run.log"
  done
  python3 - "$OUT" <<'PY'
import json, sys, glob, os
out = sys.argv[1]
runs = {os.path.basename(p)[5:-5]: json.load(open(p)) for p in sorted(glob.glob(f"{out}/hist_*.json"))}
json.dump({"note": "compare.layer 30B megamoe-triton bf16, TITAN_MEGAMOE_ROUTER_HIST=0/1, one process per run, "
           "0a then 1a", "runs": runs}, open(f"{out}/keep/layer_1xh200_ep1_router_hist.json", "w"), indent=1)
PY
  timeout 70 python3 -m compare.layer --shapes qwen3-30b-a3b --impls megamoe-triton --precisions fp8,fp8_bwd \
    --routings random --iters 20 --warmup 5 --device-time --no-plot --out "$OUT/keep/layer_1xh200_ep1_fp8.json" > "$OUT/layer_fp8.log" 2>&1
  echo "[t=$((SECONDS - t0))s] layer ep1 fp8 rc $?"; grep "^| qwen" "$OUT/layer_fp8.log"
  for sh in 30b-a3b 235b-a22b; do
    timeout 60 python3 -m compare.profile --shape qwen3-$sh --impl megamoe-triton --top 14 --iters 3 --warmup 2 \
      --out "$OUT/keep/profile_${sh%%-*}_megamoe-triton_s8.json" > "$OUT/profile_$sh.log" 2>&1
    echo "[t=$((SECONDS - t0))s] profile $sh rc $?"; grep -E "^\||total|host" "$OUT/profile_$sh.log" | head -18
  done
  cp "$OUT/tests_hist.log" "$OUT/tests_gpu.log" "$OUT/keep/"
fi
if [ "$PART" = c ]; then
  REV=$REV OUT="$OUT/ci" timeout 380 bash scripts/gpu_ci.sh > "$OUT/gpu_ci.log" 2>&1
  echo "[t=$((SECONDS - t0))s] gpu_ci exit $?"; grep -v "^\[W\|warn\|it/s" "$OUT/gpu_ci.log" | tail -40
  cp "$OUT/ci/layer_ci.json" "$OUT/ci/train_ci.json" "$OUT/gpu_ci.log" "$OUT/keep/" 2>/dev/null
fi
cd "$OUT" && tar czf /tmp/logs_s9$PART.tgz --exclude=keep . && find . -mindepth 1 -maxdepth 1 ! -name keep -exec rm -rf {} +
mv keep/* . ; rmdir keep ; mv /tmp/logs_s9$PART.tgz . ; ls "$OUT"
