#!/usr/bin/env bash
# GPU calls of session 9 (1 H200).
#   PART=a (~9 min): GEMM2 dgrad with two programs per SM (configs.HOPPER_GEMM2_DGRAD_2CTA: 3 stages,
#     128-register cap) against its one-per-SM default, and the s*h-store ablation, kernel alone
#     (scripts/sweep_kernel_configs.py --two-cta, both shapes); then compare.layer EP 1 both shapes,
#     stock compiled vs megamoe bf16 with, in the same process (--switches), GEMM2_DGRAD_2CTA=1,
#     FUSED_ROUTER=0 and PERSISTENT_GEMM2=0 one at a time (--device-time).
#   PART=b (~7 min): the single-GPU tests of tests/test_gpu.py with the two-per-SM GEMM2 dgrad as the
#     default (and the side-stream gather test); then compare.layer EP 1 both shapes with, in the same
#     process, SIDE_GATHER=1 (wgrad row gathers beside GEMM1 dgrad) and GEMM2_DGRAD_2CTA=0.
#     (Ran at 187e53b; TITAN_MEGAMOE_SIDE_GATHER measured no gain and was removed after, so PART b as
#     written needs that revision.)
#   PART=c (~7 min): scripts/gpu_ci.sh at the final tree (layer check + debug-model training against
#     the committed baselines), then compare.profile of the megamoe step at both shapes.
#   PART=d (~6 min): the debug model's training throughput with GEMM2_DGRAD_2CTA=1 and =0 alternating, one
#     compare.train process each (60 steps, seed 42; the first with the stock baseline beside it): PART c's
#     GPU CI run measured megamoe 107,084 tokens/s/GPU against 141,044 in session 8 (stock 102,584 vs
#     118,214), so is it the machine or the new default?
# Call as: REV=<hash> PART=a bash scripts/sessions/gpu_s11.sh   (carry .whl; see scripts/gpu_env.sh)
source scripts/gpu_env.sh
export TITAN_MEGAMOE_GIT_REV=$REV
set +e
t0=$SECONDS
PART=${PART:-a}
mkdir -p "$OUT/keep"
if [ "$PART" = a ]; then
  for sh in 30b 235b; do
    timeout 170 python3 scripts/sweep_kernel_configs.py $sh --kinds gemm2_dgrad,gemm2_dgrad_nohs --two-cta \
      --out "$OUT/keep/sweep_gemm2_dgrad_2cta_${sh}_1xh200.json" > "$OUT/sweep_$sh.log" 2>&1
    echo "[t=$((SECONDS - t0))s] sweep $sh rc $?"
    python3 -c "
import json,sys
for l in open('$OUT/sweep_$sh.log'):
    if not l.startswith('{'): continue
    r=json.loads(l)
    if 'best' in r: print('  best', r['best'], r['ms'], r['tflops']); continue
    c=r['cfg']; k=[(x['name'][:28], x['n_regs'], x['n_spills'], x['shared'], x['programs_per_sm']) for x in r.get('compiled',[])]
    print(' ', r['kind'], c['num_stages'], c['maxnreg'], c['use_tma'], r.get('ms'), r.get('tflops'), r.get('rel_err_vs_default'), r.get('error','')[:80], k)
"
  done
  timeout 300 python3 -m compare.layer --shapes qwen3-30b-a3b,qwen3-235b-a22b --impls tt-compile,megamoe-triton \
    --precisions bf16 --routings random --iters 20 --warmup 5 --device-time --no-plot \
    --switches GEMM2_DGRAD_2CTA=1 FUSED_ROUTER=0 PERSISTENT_GEMM2=0 --out "$OUT/keep/layer_1xh200_ep1_s9a.json" \
    > "$OUT/layer_s9a.log" 2>&1
  echo "[t=$((SECONDS - t0))s] layer switches rc $?"; grep "^|" "$OUT/layer_s9a.log"
fi
if [ "$PART" = b ]; then
  timeout 240 python3 -m pytest -q -rA tests/test_gpu.py -k "not ep_triton and not reference_ep2" > "$OUT/keep/tests_gpu_s9b.log" 2>&1
  echo "[t=$((SECONDS - t0))s] tests: $(grep -E 'passed|failed' "$OUT/keep/tests_gpu_s9b.log" | tail -1)"
  grep -E "^(FAILED|ERROR)" "$OUT/keep/tests_gpu_s9b.log" | head
  timeout 300 python3 -m compare.layer --shapes qwen3-30b-a3b,qwen3-235b-a22b --impls tt-compile,megamoe-triton \
    --precisions bf16 --routings random --iters 20 --warmup 5 --device-time --no-plot \
    --switches SIDE_GATHER=1 GEMM2_DGRAD_2CTA=0 --out "$OUT/keep/layer_1xh200_ep1_s9b.json" > "$OUT/layer_s9b.log" 2>&1
  echo "[t=$((SECONDS - t0))s] layer switches rc $?"; grep "^|" "$OUT/layer_s9b.log"
fi
if [ "$PART" = c ]; then
  REV=$REV OUT="$OUT/ci" timeout 380 bash scripts/gpu_ci.sh > "$OUT/gpu_ci.log" 2>&1
  echo "[t=$((SECONDS - t0))s] gpu_ci exit $?"; grep -v "^\[W\|warn\|it/s" "$OUT/gpu_ci.log" | tail -30
  cp "$OUT/ci/layer_ci.json" "$OUT/ci/train_ci.json" "$OUT/gpu_ci.log" "$OUT/keep/" 2>/dev/null
  png=$(ls "$OUT"/ci/*.png 2>/dev/null | head -1); [ -n "$png" ] && cp "$png" "$OUT/keep/"
  for sh in 30b-a3b 235b-a22b; do
    timeout 60 python3 -m compare.profile --shape qwen3-$sh --impl megamoe-triton --top 14 --iters 3 --warmup 2 \
      --out "$OUT/keep/profile_${sh%%-*}_megamoe-triton_s9.json" > "$OUT/profile_$sh.log" 2>&1
    echo "[t=$((SECONDS - t0))s] profile $sh rc $?"; grep -E "^\||total|host" "$OUT/profile_$sh.log" | head -16
  done
fi
if [ "$PART" = d ]; then
  run=0
  for v in 1 0 1 0; do
    run=$((run + 1))
    cfgs="train_configs/qwen3_debugmoe_1gpu_megamoe_triton_bf16.toml"; labels="megamoe-triton-2cta$v"
    if [ $run = 1 ]; then
      cfgs="$cfgs train_configs/qwen3_debugmoe_1gpu_baseline_bf16.toml"; labels="$labels torchtitan-baseline"
    fi
    TITAN_MEGAMOE_GEMM2_DGRAD_2CTA=$v timeout 200 python3 -m compare.train --ngpu 1 --steps 60 --skip 10 \
      --configs $cfgs --labels $labels --out "$OUT/keep/train_debug_2cta${v}_run${run}.json" > "$OUT/train_$run.log" 2>&1
    echo "[t=$((SECONDS - t0))s] run $run (2CTA=$v) rc $?"; grep "^| " "$OUT/train_$run.log" | tail -3
  done
  rm -f "$OUT"/keep/*.png
fi
if [ "$PART" != a ] && [ "$PART" != b ] && [ "$PART" != c ] && [ "$PART" != d ]; then
  echo "PART=$PART: not defined"; exit 2
fi
cd "$OUT" && tar czf /tmp/logs_s11$PART.tgz --exclude=keep . && find . -mindepth 1 -maxdepth 1 ! -name keep -exec rm -rf {} +
mv keep/* . ; rmdir keep ; mv /tmp/logs_s11$PART.tgz . ; ls "$OUT"
