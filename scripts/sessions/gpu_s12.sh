#!/usr/bin/env bash
# GPU calls written in session 9 for session 10, which did not run them (its device time went to the Gluon
# kernels, scripts/sessions/gpu_s13.sh); PART a moved into scripts/sessions/gpu_s14.sh PART a.
#   PART=a (1 H200, ~4 min): compare.layer EP 1 30B fp8 / fp8_bwd with stock fp8 compiled beside them (FP8 not
#     re-measured since session 8) and a profiler trace of the 30B bf16 step (compare.profile --trace) for
#     the next kernel work (the GEMM epilogues' exposure, docs/NOTES.md session 9). (Session 9's last call
#     already ran the persistent GEMM2 at two programs per SM this script first held: 0.847 vs 0.685 ms,
#     slower; benchmarks/results/sweep_gemm2_2cta_30b_1xh200_20261202.json.)
#   PART=b / PART=c (2 H200): the EP = 2 runs that wait since session 6: `REV=<hash> PART=b bash scripts/sessions/gpu_s8.sh`
#     and `PART=c` (unchanged; today's defaults, including the two-per-SM GEMM2 dgrad, which EP = 2 has not run).
# Call as: REV=<hash> PART=a bash scripts/sessions/gpu_s12.sh   (carry .whl; see scripts/gpu_env.sh)
source scripts/gpu_env.sh
session_start
if [ "$PART" = a ]; then
  timeout 200 python3 -m compare.layer --shapes qwen3-30b-a3b --impls tt-compile,megamoe-triton --precisions fp8,fp8_bwd \
    --routings random --iters 20 --warmup 5 --device-time --no-plot --out "$OUT/keep/layer_1xh200_ep1_fp8.json" \
    > "$OUT/layer_fp8.log" 2>&1
  echo "[t=$((SECONDS - t0))s] layer fp8 rc $?"; grep "^| qwen" "$OUT/layer_fp8.log"
  timeout 90 python3 -m compare.profile --shape qwen3-30b-a3b --impl megamoe-triton --top 14 --iters 3 --warmup 2 \
    --out "$OUT/keep/profile_30b_megamoe-triton.json" --trace "$OUT/trace_30b.json" > "$OUT/profile_30b.log" 2>&1
  echo "[t=$((SECONDS - t0))s] profile rc $?"; gzip -f "$OUT/trace_30b.json" && mv "$OUT/trace_30b.json.gz" "$OUT/keep/"
else
  echo "PART=$PART: run scripts/sessions/gpu_s8.sh with the same PART (see the header)"; exit 2
fi
session_pack s12$PART
