#!/usr/bin/env bash
# (Never run: session 9 ran its content, extended, as scripts/sessions/gpu_s11.sh PART a.)
# GPU, next session's calls (written in session 8, 1 H200 lent, device time spent).
#   PART=a (1 H200, ~4 min): where GEMM2 dgrad's time goes (378 TF/s at 30B against ~600 for the other
#     GEMMs, docs/NOTES.md session 8): scripts/sweep_kernel_configs.py at both shapes for gemm2_dgrad
#     (its config variants) and gemm2_dgrad_nohs (default config without the s*h store), then the
#     GPU tests of test_gpu.py's single-GPU set as a check of the tree; then compare.layer EP 1 both
#     shapes, stock compiled vs megamoe bf16 with session 8's defaults and, in the same process
#     (--switches), FUSED_ROUTER=0, PERSISTENT_GEMM2=0 and EAGER_AUTOGRAD=0 one at a time: the
#     same-process A/B the session-8 defaults were chosen without (~3 min).
#   PART=b / PART=c (2 H200): the EP = 2 measurements that have waited since session 6 — run
#     `REV=<hash> PART=b bash scripts/sessions/gpu_s8.sh` and `PART=c` (unchanged; they use today's defaults).
# Call as: REV=<hash> PART=a bash scripts/sessions/gpu_s10.sh   (carry .whl; see scripts/gpu_env.sh)
source scripts/gpu_env.sh
export TITAN_MEGAMOE_GIT_REV=$REV
set +e
t0=$SECONDS
PART=${PART:-a}
mkdir -p "$OUT/keep"
if [ "$PART" = a ]; then
  for sh in 30b 235b; do
    timeout 150 python3 scripts/sweep_kernel_configs.py $sh --kinds gemm2_dgrad,gemm2_dgrad_nohs \
      --out "$OUT/keep/sweep_gemm2_dgrad_${sh}_1xh200.json" > "$OUT/sweep_$sh.log" 2>&1
    echo "[t=$((SECONDS - t0))s] sweep $sh rc $?"; grep '"best"\|_nohs' "$OUT/sweep_$sh.log" | head -4
  done
  timeout 200 python3 -m pytest -q -rA tests/test_gpu.py -k "not ep_triton and not reference_ep2" > "$OUT/keep/tests_gpu.log" 2>&1
  echo "[t=$((SECONDS - t0))s] tests: $(grep -E 'passed|failed' "$OUT/keep/tests_gpu.log" | tail -1)"
  timeout 240 python3 -m compare.layer --shapes qwen3-30b-a3b,qwen3-235b-a22b --impls tt-compile,megamoe-triton \
    --precisions bf16 --routings random --iters 20 --warmup 5 --device-time --no-plot \
    --switches FUSED_ROUTER=0 PERSISTENT_GEMM2=0 EAGER_AUTOGRAD=0 --out "$OUT/keep/layer_1xh200_ep1_switches.json" \
    > "$OUT/layer_switches.log" 2>&1
  echo "[t=$((SECONDS - t0))s] layer switches rc $?"; grep "^|" "$OUT/layer_switches.log"
fi
if [ "$PART" != a ]; then
  echo "PART=$PART: run scripts/sessions/gpu_s8.sh with the same PART (see the header)"; exit 2
fi
cd "$OUT" && tar czf /tmp/logs_s10$PART.tgz --exclude=keep . && find . -mindepth 1 -maxdepth 1 ! -name keep -exec rm -rf {} +
mv keep/* . ; rmdir keep ; mv /tmp/logs_s10$PART.tgz . ; ls "$OUT"
