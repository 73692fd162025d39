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
# Call as: REV=<hash> PART=a bash scripts/gpu_s11.sh   (carry .whl; see scripts/gpu_env.sh)
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
if [ "$PART" != a ] && [ "$PART" != b ]; then
  echo "PART=$PART: not defined"; exit 2
fi
cd "$OUT" && tar czf /tmp/logs_s11$PART.tgz --exclude=keep . && find . -mindepth 1 -maxdepth 1 ! -name keep -exec rm -rf {} +
mv keep/* . ; rmdir keep ; mv /tmp/logs_s11$PART.tgz . ; ls "$OUT"
