#!/usr/bin/env bash
# GPU calls of session 15 (1 H200): the host path before GEMM1 (sessions 13-14's CPU-only trims) measured.
#   PART=a: GPU tests of the changed paths; scripts/host_profile.py alternating between this tree and the
#     last GPU-measured tree (.ab/base, a `git archive` of it, git-ignored and carried), three rounds each.
#   PART=b: compare.layer 30B / 235B, tt-compile and megamoe-triton, then the base tree's megamoe-triton in
#     the same script (back to back, same machine).
#   PART=c (session 16): scripts/step_gaps.py on the 30B layer (where a from-idle step leaves the GPU idle),
#     then the GPU tests PART ab's 240 s limit cut off (test_routing.py on).
#   PART=d (session 17): GPU tests of the router backward kernel and scatter_dx with the router's dx; compare.layer
#     30B / 235B with both switched off, and with only the router dx in scatter off, in the same process; step_gaps 30B.
#   PART=e (session 17): scripts/sweep_scatter_dx.py (scatter_dx's program tile, with and without the router's dx),
#     then the scatter_dx GPU tests.
#   PART=f (session 17): one more 30B compare.layer sample, 50 timed steps (the from-idle ratio moves between runs).
#   PART=ab: one call (device loans were scarce): GPU tests, compare.layer, host_profile A/B (two rounds), the
#     base tree's compare.layer, in that order of priority.
# Call as: REV=<hash> BASE=<hash> PART=a bash scripts/sessions/gpu_s18.sh   (carry .whl and .ab; see scripts/gpu_env.sh)
source scripts/gpu_env.sh
session_start
BASE=${BASE:-unknown}
B=$PWD/.ab/base
if [ "$PART" = a ]; then
  timeout -s KILL 300 python3 -m pytest -q -rA tests/test_gpu.py tests/test_eager_layer.py tests/test_routing.py \
    tests/test_router_kernel.py tests/test_triton_op.py -k "not ep_triton and not reference_ep2 and not compiles_for_sm90a" \
    > "$OUT/keep/tests_gpu.log" 2>&1
  echo "[t=$((SECONDS - t0))s] gpu tests: $(tail -1 "$OUT/keep/tests_gpu.log")"
  grep -E "^(FAILED|ERROR)" "$OUT/keep/tests_gpu.log" | head
  for r in 1 2 3; do
    timeout 90 python3 scripts/host_profile.py --iters 40 --out "$OUT/keep/host_profile_new_r$r.json" > "$OUT/hp.log" 2>&1; head -1 "$OUT/hp.log"
    echo "[t=$((SECONDS - t0))s] new r$r"
    (cd "$B" && TITAN_MEGAMOE_GIT_REV=$BASE PYTHONPATH=/tmp/site:$B timeout 90 python3 scripts/host_profile.py --iters 40 \
      --out "$OUT/keep/host_profile_base_r$r.json" > "$OUT/hp.log" 2>&1; head -1 "$OUT/hp.log")
    echo "[t=$((SECONDS - t0))s] base r$r"
  done
elif [ "$PART" = ab ]; then
  timeout -s KILL 240 python3 -m pytest -q -rA tests/test_gpu.py tests/test_eager_layer.py tests/test_routing.py \
    tests/test_router_kernel.py tests/test_triton_op.py -k "not ep_triton and not reference_ep2 and not compiles_for_sm90a" \
    > "$OUT/keep/tests_gpu.log" 2>&1
  echo "[t=$((SECONDS - t0))s] gpu tests: $(tail -1 "$OUT/keep/tests_gpu.log")"
  grep -E "^(FAILED|ERROR)" "$OUT/keep/tests_gpu.log" | head
  timeout 300 python3 -m compare.layer --shapes qwen3-30b-a3b,qwen3-235b-a22b --impls tt-compile,megamoe-triton \
    --precisions bf16 --routings random --iters 20 --warmup 5 --device-time --no-plot \
    --out "$OUT/keep/layer_1xh200_ep1.json" > "$OUT/keep/layer.log" 2>&1
  echo "[t=$((SECONDS - t0))s] layer rc $?"; grep "^|" "$OUT/keep/layer.log"
  for r in 1 2; do
    timeout 60 python3 scripts/host_profile.py --iters 30 --out "$OUT/keep/host_profile_new_r$r.json" > "$OUT/hp.log" 2>&1; head -1 "$OUT/hp.log"
    (cd "$B" && TITAN_MEGAMOE_GIT_REV=$BASE PYTHONPATH=/tmp/site:$B timeout 60 python3 scripts/host_profile.py --iters 30 \
      --out "$OUT/keep/host_profile_base_r$r.json" > "$OUT/hp.log" 2>&1; head -1 "$OUT/hp.log")
    echo "[t=$((SECONDS - t0))s] host_profile round $r"
  done
  (cd "$B" && TITAN_MEGAMOE_GIT_REV=$BASE PYTHONPATH=/tmp/site:$B timeout 170 python3 -m compare.layer \
    --shapes qwen3-30b-a3b,qwen3-235b-a22b --impls megamoe-triton --precisions bf16 --routings random --iters 20 \
    --warmup 5 --device-time --no-plot --out "$OUT/keep/layer_1xh200_ep1_base.json" > "$OUT/keep/layer_base.log" 2>&1)
  echo "[t=$((SECONDS - t0))s] base layer rc $?"; grep "^|" "$OUT/keep/layer_base.log"
elif [ "$PART" = c ]; then
  timeout 120 python3 scripts/step_gaps.py --iters 10 --out "$OUT/keep/step_gaps_30b.json" > "$OUT/keep/step_gaps_30b.log" 2>&1
  echo "[t=$((SECONDS - t0))s] step_gaps rc $?"; cat "$OUT/keep/step_gaps_30b.log" | tail -80
  timeout 150 python3 scripts/step_gaps.py --shape qwen3-235b-a22b --iters 8 --out "$OUT/keep/step_gaps_235b.json" \
    > "$OUT/keep/step_gaps_235b.log" 2>&1
  echo "[t=$((SECONDS - t0))s] step_gaps 235b rc $?"; cat "$OUT/keep/step_gaps_235b.log" | tail -60
  timeout -s KILL 280 python3 -m pytest -q -rA tests/test_routing.py tests/test_router_kernel.py tests/test_triton_op.py \
    -k "not ep_triton and not reference_ep2 and not compiles_for_sm90a" > "$OUT/keep/tests_gpu_c.log" 2>&1
  echo "[t=$((SECONDS - t0))s] gpu tests: $(tail -1 "$OUT/keep/tests_gpu_c.log")"
  grep -E "^(FAILED|ERROR)" "$OUT/keep/tests_gpu_c.log" | head
elif [ "$PART" = d ]; then
  timeout -s KILL 200 python3 -m pytest -q -rA tests/test_router_kernel.py tests/test_kernels_bwd.py tests/test_eager_layer.py \
    -k "route_backward or gradients or scatter or modular_path or worked" > "$OUT/keep/tests_gpu_d.log" 2>&1
  echo "[t=$((SECONDS - t0))s] gpu tests: $(tail -1 "$OUT/keep/tests_gpu_d.log")"
  grep -E "^(FAILED|ERROR)" "$OUT/keep/tests_gpu_d.log" | head
  timeout 330 python3 -m compare.layer --shapes qwen3-30b-a3b,qwen3-235b-a22b --impls tt-compile,megamoe-triton \
    --precisions bf16 --routings random --iters 20 --warmup 5 --device-time --no-plot \
    --switches ROUTER_BWD_KERNEL=0,ROUTER_DX_IN_SCATTER=0 ROUTER_DX_IN_SCATTER=0 \
    --out "$OUT/keep/layer_1xh200_ep1.json" > "$OUT/keep/layer.log" 2>&1
  echo "[t=$((SECONDS - t0))s] layer rc $?"; grep "^|" "$OUT/keep/layer.log"; tail -2 "$OUT/keep/layer.log" | cut -c1-300
  timeout 60 python3 scripts/step_gaps.py --iters 10 --out "$OUT/keep/step_gaps_30b.json" > "$OUT/keep/step_gaps_30b.log" 2>&1
  echo "[t=$((SECONDS - t0))s] step_gaps rc $?"; grep -E "kernels, kernel time|^\| [0-9]+ \| _" "$OUT/keep/step_gaps_30b.log"
elif [ "$PART" = e ]; then
  timeout 200 python3 scripts/sweep_scatter_dx.py --out "$OUT/keep/sweep_scatter_dx.json" > "$OUT/keep/sweep_scatter_dx.log" 2>&1
  echo "[t=$((SECONDS - t0))s] sweep rc $?"; cat "$OUT/keep/sweep_scatter_dx.log" | tail -50
  timeout -s KILL 120 python3 -m pytest -q -rA tests/test_kernels_bwd.py -k "scatter" > "$OUT/keep/tests_gpu_e.log" 2>&1
  echo "[t=$((SECONDS - t0))s] gpu tests: $(tail -1 "$OUT/keep/tests_gpu_e.log")"
  grep -E "^(FAILED|ERROR)" "$OUT/keep/tests_gpu_e.log" | head
elif [ "$PART" = f ]; then
  timeout 200 python3 -m compare.layer --shapes qwen3-30b-a3b --impls tt-compile,megamoe-triton \
    --precisions bf16 --routings random --iters 50 --warmup 10 --device-time --no-plot \
    --out "$OUT/keep/layer_1xh200_ep1_30b.json" > "$OUT/keep/layer_30b.log" 2>&1
  echo "[t=$((SECONDS - t0))s] layer rc $?"; grep "^|" "$OUT/keep/layer_30b.log" | head -12
elif [ "$PART" = b ]; then
  timeout 330 python3 -m compare.layer --shapes qwen3-30b-a3b,qwen3-235b-a22b --impls tt-compile,megamoe-triton \
    --precisions bf16 --routings random --iters 20 --warmup 5 --device-time --no-plot \
    --out "$OUT/keep/layer_1xh200_ep1.json" > "$OUT/layer.log" 2>&1
  echo "[t=$((SECONDS - t0))s] layer rc $?"; grep "^|" "$OUT/layer.log"; tail -2 "$OUT/layer.log" | cut -c1-300
  (cd "$B" && TITAN_MEGAMOE_GIT_REV=$BASE PYTHONPATH=/tmp/site:$B timeout 200 python3 -m compare.layer \
    --shapes qwen3-30b-a3b,qwen3-235b-a22b --impls megamoe-triton --precisions bf16 --routings random --iters 20 \
    --warmup 5 --device-time --no-plot --out "$OUT/keep/layer_1xh200_ep1_base.json" > "$OUT/layer_base.log" 2>&1)
  echo "[t=$((SECONDS - t0))s] base layer rc $?"; grep "^|" "$OUT/layer_base.log"; tail -2 "$OUT/layer_base.log" | cut -c1-300
fi
session_pack "s18$PART"
