#!/usr/bin/env bash
# GPU calls of session 20 (1 H200 asked; say in the results which card ran).
#   (session 20 adds the Gluon FP8 wgrad, kernels/ws_wgrad_fp8.py: its GPU tests, sweep rows and a layer row in PART a)
#   PART=a: session 19's final state (both Gluon FP8 kernels on by default; was gpu_s19.sh PART n, never run): the
#     FP8 GPU tests (test_gpu.py's op tests at the 30B shape, test_ws_gemm_fp8.py) and compare.profile of the fp8
#     layer at 30B (where the FP8 step's device time goes, per kernel); then scripts/sweep_kernel_configs.py at 30B
#     on the FP8 backward's Triton kernels (GEMM2 dgrad, both wgrads: BN 64 at 128 registers / 64-row wgrad tiles
#     fit two programs per SM, so one's per-K-block promotion stall and epilogue can run under the other's MMAs)
#     and its quantization passes (the dual dgate_up pass v1 / v2, the gathered 128x1 pass: warps, column block);
#     compare.layer 30B, megamoe bf16 / fp8 with and without both v2 quant passes, in the time left (560 s in all).
#   PART=b: compare.layer bf16 / fp8 / fp8_bwd beside stock compiled at both shapes, with FP8_DUAL_QUANT=v2,FP8_GATHER_QUANT=v2 rows;
#     then the 235B sweep of the GEMM2 dgrad and the dual pass.
# Call as: REV=<hash> PART=a bash scripts/sessions/gpu_s20.sh   (carry .whl; see scripts/gpu_env.sh)
source scripts/gpu_env.sh
session_start
sweep() {  # sweep SHAPE KINDS LIMIT_S: scripts/sweep_kernel_configs.py, one line per variant
  timeout "$3" python3 scripts/sweep_kernel_configs.py "$1" --kinds "$2" --out "$OUT/keep/sweep_fp8_bwd_$1.json" \
    > "$OUT/keep/sweep_fp8_bwd_$1.log" 2>&1
  echo "[t=$((SECONDS - t0))s] sweep $1 rc $?"; python3 - "$OUT/keep/sweep_fp8_bwd_$1.log" <<'PY'
import json, sys
for ln in open(sys.argv[1]):
    if ln.startswith("{"):
        r = json.loads(ln); c = r.get("cfg", {})
        cfg = ([c.get(k) for k in ("block_m", "block_n", "num_warps", "num_stages", "maxnreg", "group_m")]
               if "block_m" in c else c)
        print(r.get("kind", r.get("best")), cfg, r.get("ms"),
              r.get("tflops") or r.get("gb_per_s"), r.get("bitwise_default"),
              [(k["n_regs"], k["n_spills"], k["programs_per_sm"]) for k in r.get("compiled", [])], r.get("error", ""))
PY
}
if [ "$PART" = a ]; then
  timeout -s KILL 130 python3 -m pytest -v -rA tests/test_ws_wgrad_fp8.py tests/test_ws_gemm_fp8.py tests/test_gpu.py -k "fp8 and not builds_for_sm90a" \
    -p no:cacheprovider > "$OUT/keep/tests_gpu_a.log" 2>&1
  echo "[t=$((SECONDS - t0))s] gpu tests: $(tail -1 "$OUT/keep/tests_gpu_a.log")"; grep -E "^(FAILED|ERROR)" "$OUT/keep/tests_gpu_a.log" | head || true
  timeout 50 python3 -m compare.profile --shape qwen3-30b-a3b --impl megamoe-triton --precision fp8 --iters 5 \
    --top 30 --out "$OUT/keep/profile_30b_fp8.json" > "$OUT/keep/profile_30b_fp8.log" 2>&1
  echo "[t=$((SECONDS - t0))s] profile rc $?"; tail -34 "$OUT/keep/profile_30b_fp8.log" | cut -c1-150
  # the Gluon wgrad only where its GPU tests passed (a failing or hanging kernel must not eat the call)
  sw="FP8_DUAL_QUANT=v2,FP8_GATHER_QUANT=v2 WS_WGRAD_FP8=1"
  if ! grep -qE "wgrad_fp8_matches_triton_and_fp32_on_gpu\[30b\] PASSED|PASSED .*wgrad_fp8_matches_triton_and_fp32_on_gpu\[30b\]" \
      "$OUT/keep/tests_gpu_a.log" \
      || grep -qE "ws_wgrad.*FAILED|FAILED.*ws_wgrad" "$OUT/keep/tests_gpu_a.log"; then
    export SWEEP_NO_GLUON_WGRAD=1; sw="FP8_DUAL_QUANT=v2,FP8_GATHER_QUANT=v2"; echo "Gluon wgrad left out"
  fi
  sweep 30b quant_dual_fp8,quant_gather_t_fp8,gemm2_dgrad_fp8,wgrad_w2_fp8,wgrad_w13_fp8 250
  lim=$((560 - SECONDS + t0)); [ "$lim" -lt 10 ] && lim=10
  timeout "$lim" python3 -m compare.layer --shapes qwen3-30b-a3b --impls megamoe-triton \
    --precisions bf16,fp8 --routings random --iters 8 --warmup 3 --device-time --no-plot \
    --switches $sw --out "$OUT/keep/layer_ep1_fp8_a.json" > "$OUT/keep/layer_fp8_a.log" 2>&1
  echo "[t=$((SECONDS - t0))s] layer rc $?"; grep "^| qwen3" "$OUT/keep/layer_fp8_a.log" | head -8
elif [ "$PART" = b ]; then
  timeout 400 python3 -m compare.layer --shapes qwen3-30b-a3b,qwen3-235b-a22b --impls tt-compile,megamoe-triton \
    --precisions bf16,fp8,fp8_bwd --routings random --iters 12 --warmup 4 --device-time --no-plot \
    --switches FP8_DUAL_QUANT=v2,FP8_GATHER_QUANT=v2 --out "$OUT/keep/layer_ep1_fp8.json" > "$OUT/keep/layer_fp8.log" 2>&1
  echo "[t=$((SECONDS - t0))s] layer rc $?"; grep "^| qwen3" "$OUT/keep/layer_fp8.log" | head -20
  sweep 235b quant_dual_fp8,gemm2_dgrad_fp8 150
elif [ "$PART" = d ]; then  # PART c's sweep timed its output copies: kernels alone now, plus the fp8 profile
  sweep 30b gemm2_dgrad_fp8,wgrad_w2_fp8,wgrad_w13_fp8 150
  TITAN_MEGAMOE_WS_WGRAD_FP8=1 timeout 60 python3 -m compare.profile --shape qwen3-30b-a3b --impl megamoe-triton \
    --precision fp8 --iters 5 --top 14 --out "$OUT/keep/profile_30b_fp8_wswgrad.json" > "$OUT/keep/profile_30b_fp8_wswgrad.log" 2>&1
  echo "[t=$((SECONDS - t0))s] profile rc $?"; tail -18 "$OUT/keep/profile_30b_fp8_wswgrad.log" | cut -c1-120
  mv "$OUT/keep/sweep_fp8_bwd_30b.log" "$OUT/keep/sweep_fp8_bwd_30b_d.log"; mv "$OUT/keep/sweep_fp8_bwd_30b.json" "$OUT/keep/sweep_fp8_bwd_30b_d.json"
  sweep 235b wgrad_w2_fp8,wgrad_w13_fp8 120
elif [ "$PART" = e ]; then  # PART d cut to what ~300 s of device time allows
  TITAN_MEGAMOE_WS_WGRAD_FP8=1 timeout 60 python3 -m compare.profile --shape qwen3-30b-a3b --impl megamoe-triton \
    --precision fp8 --iters 5 --top 14 --out "$OUT/keep/profile_30b_fp8_wswgrad.json" > "$OUT/keep/profile_30b_fp8_wswgrad.log" 2>&1
  echo "[t=$((SECONDS - t0))s] profile rc $?"; tail -18 "$OUT/keep/profile_30b_fp8_wswgrad.log" | cut -c1-120
  sweep 30b wgrad_w2_fp8 70
elif [ "$PART" = f ]; then  # the profile of PART e alone
  TITAN_MEGAMOE_WS_WGRAD_FP8=1 timeout 70 python3 -m compare.profile --shape qwen3-30b-a3b --impl megamoe-triton \
    --precision fp8 --iters 5 --top 14 --out "$OUT/keep/profile_30b_fp8_wswgrad.json" > "$OUT/keep/profile_30b_fp8_wswgrad.log" 2>&1
  echo "[t=$((SECONDS - t0))s] profile rc $?"; tail -18 "$OUT/keep/profile_30b_fp8_wswgrad.log" | cut -c1-120
elif [ "$PART" = c ]; then
  sweep 30b quant_dual_fp8,quant_gather_t_fp8,gemm2_dgrad_fp8,wgrad_w2_fp8,wgrad_w13_fp8 300
fi
session_pack "s20$PART"
