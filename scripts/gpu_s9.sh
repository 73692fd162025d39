#!/usr/bin/env bash
# GPU, session 8's calls (1 H200 lent; the EP = 2 parts of gpu_s8.sh, b and c, still wait for two GPUs).
#   PART=t (~5 min): the GPU tests, three pytest processes side by side (compiles are host-bound, the
#     GPU has room): the fused router's tests compiled (tests/test_router_kernel.py), the eager
#     autograd tests, and the single-GPU tests of tests/test_gpu.py with the fused router and the bf16
#     persistent GEMM2 switched on (gpu_s8.sh PART a measured both faster; its test step ran out of
#     time at 150 s: the tests need ~175 s alone).
#   PART=m: see below.
# Call as: REV=<hash> PART=t bash scripts/gpu_s9.sh   (carry .whl; see scripts/gpu_env.sh)
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
cd "$OUT" && tar czf /tmp/logs_s9$PART.tgz --exclude=keep . && find . -mindepth 1 -maxdepth 1 ! -name keep -exec rm -rf {} +
mv keep/* . ; rmdir keep ; mv /tmp/logs_s9$PART.tgz . ; ls "$OUT"
