#!/usr/bin/env bash
# GPU calls of session 18 (1 H200): does the timing harness perturb what it times?
#   PART=a: the GPU tests of the commits no GPU has run (router kernels, scatter_dx, eager layer); then
#     scripts/protocol_ab.py at 30B and 235B: stock compiled and megamoe under four protocols interleaved in one
#     process (NVML thread / none / child process, automatic gc on / off).
#   PART=b: compare.layer 30B / 235B, tt-compile and megamoe-triton, with the harness's new defaults (gc off
#     while timing, NVML in a child process), --device-time.
#   PART=c: the GPU tests PART a's time limits cut (all of test_router_kernel.py, test_kernels_bwd.py's scatter
#     tests), then compare.layer as PART b (new harness defaults) without switches.
#   PART=d: scripts/dense_floor.py at 30B and 235B: a dense cuBLAS chain of the layer's shape under compare.layer's
#     protocol beside megamoe and stock compiled (the floor the power-capped card allows).
#   PART=e: the Gluon GEMM2 dgrad with its epilogue's gate / up tiles prefetched by TMA: its GPU tests, bench-g2d
#     (Triton vs Gluon, both shapes), then compare.layer 30B / 235B with --switches WS_GEMM2_DGRAD=1.
#   PART=f: compare.layer 30B / 235B, tt-compile and megamoe-triton, 40 timed steps (new harness defaults).
#   PART=g: compare.layer 30B (tt-compile, megamoe-triton, 30 steps) in three processes: NVML sampler off, in a
#     child process, on a thread (is compare.layer's from-idle excess over scripts/dense_floor.py the sampler?).
#   PART=h (for the next session: not run in session 18): the FP8 backward's bf16 wgrads through the Gluon kernels
#     (FP8_WGRAD=bf16, the FP8 dgrad's bf16 s*h rows): GPU tests, then compare.layer fp8 / fp8_bwd 30B and 235B with
#     --switches FP8_WGRAD=bf16 beside the FP8 wgrad and our bf16, same process.
#   PART=i: the GPU tests of the FP8 GEMM2 dgrad's bf16 s*h rows and of FP8_WGRAD=bf16 (what the last ~100 s of the
#     session's device time allow; PART h has the measurements).
#   PART=j (written in session 19, no device lent then): the GPU tests of the Gluon blockwise-FP8 GEMM1
#     (tests/test_ws_gemm_fp8.py) and of PART i, then scripts/bench_ws_gemm.py bench-fwd-fp8 (Triton vs Gluon FP8
#     GEMM1, both shapes).
#   PART=k: compare.layer 30B, megamoe bf16 / fp8 / fp8_bwd, with --switches FP8_WGRAD=bf16, WS_GEMM1_FP8=1 and
#     both, same process (fp8_bwd's forward runs the Gluon bf16 GEMM1 since session 19). PART=l: 235B, both switches.
#   PART=m: the Gluon FP8 GEMM1 dgrad: GPU tests, bench-dgrad-fp8, compare.layer fp8 both shapes with it switched on.
#   PART=n (for the next session): the final state of session 19 (both Gluon FP8 kernels on by default): the FP8 GPU
#     tests (test_gpu.py's op tests at the 30B shape, test_ws_gemm_fp8.py), then compare.layer bf16 / fp8 / fp8_bwd
#     beside stock compiled at both shapes.
# Call as: REV=<hash> PART=a bash scripts/sessions/gpu_s19.sh   (carry .whl; see scripts/gpu_env.sh)
source scripts/gpu_env.sh
session_start
if [ "$PART" = a ]; then
  for spec in "tests/test_router_kernel.py:110:" "tests/test_kernels_bwd.py:60:scatter" "tests/test_eager_layer.py:70:"; do
    IFS=: read -r f lim k <<< "$spec"; n=$(basename "$f" .py)
    timeout -s KILL "$lim" python3 -m pytest -q -rA "$f" -k "${k:-not compiles_for_sm90a}" > "$OUT/keep/${n}_gpu.log" 2>&1
    echo "[t=$((SECONDS - t0))s] $n: $(tail -1 "$OUT/keep/${n}_gpu.log")"; grep -E "^(FAILED|ERROR)" "$OUT/keep/${n}_gpu.log" | head -5
  done
  timeout 150 python3 scripts/protocol_ab.py --rounds 4 --iters 20 --out "$OUT/keep/protocol_ab_30b.json" \
    > "$OUT/keep/protocol_ab_30b.log" 2>&1
  echo "[t=$((SECONDS - t0))s] protocol_ab 30b rc $?"; tail -8 "$OUT/keep/protocol_ab_30b.log"
  timeout 200 python3 scripts/protocol_ab.py --shape qwen3-235b-a22b --rounds 3 --iters 12 \
    --out "$OUT/keep/protocol_ab_235b.json" > "$OUT/keep/protocol_ab_235b.log" 2>&1
  echo "[t=$((SECONDS - t0))s] protocol_ab 235b rc $?"; tail -8 "$OUT/keep/protocol_ab_235b.log"
elif [ "$PART" = b ]; then
  timeout 330 python3 -m compare.layer --shapes qwen3-30b-a3b,qwen3-235b-a22b --impls tt-compile,megamoe-triton \
    --precisions bf16 --routings random --iters 30 --warmup 5 --device-time --no-plot \
    --out "$OUT/keep/layer_1xh200_ep1.json" > "$OUT/keep/layer.log" 2>&1
  echo "[t=$((SECONDS - t0))s] layer rc $?"; grep "^|" "$OUT/keep/layer.log"; tail -2 "$OUT/keep/layer.log" | cut -c1-300
elif [ "$PART" = c ]; then
  timeout -s KILL 230 python3 -m pytest -q -rA tests/test_router_kernel.py tests/test_kernels_bwd.py \
    -k "not compiles_for_sm90a and (route or scatter)" > "$OUT/keep/tests_gpu_c.log" 2>&1
  echo "[t=$((SECONDS - t0))s] gpu tests: $(tail -1 "$OUT/keep/tests_gpu_c.log")"; grep -E "^(FAILED|ERROR)" "$OUT/keep/tests_gpu_c.log" | head
  grep -c PASSED "$OUT/keep/tests_gpu_c.log"
  timeout 300 python3 -m compare.layer --shapes qwen3-30b-a3b,qwen3-235b-a22b --impls tt-compile,megamoe-triton \
    --precisions bf16 --routings random --iters 30 --warmup 5 --device-time --no-plot \
    --out "$OUT/keep/layer_ep1.json" > "$OUT/keep/layer.log" 2>&1
  echo "[t=$((SECONDS - t0))s] layer rc $?"; grep "^|" "$OUT/keep/layer.log" | head -14; tail -2 "$OUT/keep/layer.log" | cut -c1-300
elif [ "$PART" = d ]; then
  timeout 400 python3 scripts/dense_floor.py --rounds 3 --iters 15 --out "$OUT/keep/dense_floor.json" \
    > "$OUT/keep/dense_floor.log" 2>&1
  echo "[t=$((SECONDS - t0))s] dense_floor rc $?"; grep -v "round" "$OUT/keep/dense_floor.log" | tail -24
elif [ "$PART" = e ]; then
  timeout -s KILL 150 python3 -m pytest -q -rA tests/test_ws_gemm.py -k "gemm2_dgrad" > "$OUT/keep/tests_gpu_e.log" 2>&1
  echo "[t=$((SECONDS - t0))s] gpu tests: $(tail -1 "$OUT/keep/tests_gpu_e.log")"; grep -E "^(FAILED|ERROR)|^E " "$OUT/keep/tests_gpu_e.log" | head -8
  timeout 150 python3 scripts/bench_ws_gemm.py bench-g2d --out "$OUT/keep/bench_g2d.json" > "$OUT/keep/bench_g2d.log" 2>&1
  echo "[t=$((SECONDS - t0))s] bench rc $?"; cut -c1-260 "$OUT/keep/bench_g2d.log" | tail -8
  timeout 240 python3 -m compare.layer --shapes qwen3-30b-a3b,qwen3-235b-a22b --impls tt-compile,megamoe-triton \
    --precisions bf16 --routings random --iters 30 --warmup 5 --device-time --no-plot --switches WS_GEMM2_DGRAD=1 \
    --out "$OUT/keep/layer_ep1.json" > "$OUT/keep/layer.log" 2>&1
  echo "[t=$((SECONDS - t0))s] layer rc $?"; grep "^|" "$OUT/keep/layer.log" | head -22
elif [ "$PART" = f ]; then
  timeout 280 python3 -m compare.layer --shapes qwen3-30b-a3b,qwen3-235b-a22b --impls tt-compile,megamoe-triton \
    --precisions bf16 --routings random --iters 40 --warmup 5 --device-time --no-plot \
    --out "$OUT/keep/layer_ep1.json" > "$OUT/keep/layer.log" 2>&1
  echo "[t=$((SECONDS - t0))s] layer rc $?"; grep "^|" "$OUT/keep/layer.log" | head -14
elif [ "$PART" = g ]; then
  for ps in off process thread; do
    timeout 100 python3 -m compare.layer --shapes qwen3-30b-a3b --impls tt-compile,megamoe-triton --precisions bf16 \
      --routings random --iters 30 --warmup 5 --no-plot --power-sampler $ps \
      --out "$OUT/keep/layer_30b_sampler_$ps.json" > "$OUT/keep/layer_30b_sampler_$ps.log" 2>&1
    echo "[t=$((SECONDS - t0))s] sampler $ps rc $?"; grep "^| qwen3" "$OUT/keep/layer_30b_sampler_$ps.log" | head -2
  done
elif [ "$PART" = h ]; then
  timeout -s KILL 150 python3 -m pytest -q -rA tests/test_kernels_fp8_bwd.py tests/test_fp8_op.py -k "hs_rows or wgrad_diagnosis or gemm2_dgrad" \
    > "$OUT/keep/tests_gpu_h.log" 2>&1
  echo "[t=$((SECONDS - t0))s] gpu tests: $(tail -1 "$OUT/keep/tests_gpu_h.log")"; grep -E "^(FAILED|ERROR)|^E " "$OUT/keep/tests_gpu_h.log" | head -8
  timeout 400 python3 -m compare.layer --shapes qwen3-30b-a3b,qwen3-235b-a22b --impls megamoe-triton \
    --precisions bf16,fp8,fp8_bwd --routings random --iters 20 --warmup 5 --device-time --no-plot \
    --switches FP8_WGRAD=bf16 --out "$OUT/keep/layer_ep1_fp8.json" > "$OUT/keep/layer_fp8.log" 2>&1
  echo "[t=$((SECONDS - t0))s] layer rc $?"; grep "^|" "$OUT/keep/layer_fp8.log" | head -24
elif [ "$PART" = i ]; then
  timeout -s KILL 80 python3 -m pytest -v -rA tests/test_kernels_fp8_bwd.py tests/test_fp8_op.py \
    -k "hs_rows or wgrad_diagnosis" > "$OUT/keep/tests_gpu_i.log" 2>&1
  echo "[t=$((SECONDS - t0))s] gpu tests: $(tail -1 "$OUT/keep/tests_gpu_i.log")"; grep -E "PASSED|FAILED|ERROR" "$OUT/keep/tests_gpu_i.log" | cut -c1-160 | head -12
elif [ "$PART" = j ]; then
  timeout -s KILL 200 python3 -m pytest -v -rA tests/test_ws_gemm_fp8.py tests/test_kernels_fp8_bwd.py tests/test_fp8_op.py \
    -k "not compiles_for_sm90a and not builds_for_sm90a and (ws_gemm1_fwd_fp8 or hs_rows or wgrad_diagnosis or switched_on)" \
    > "$OUT/keep/tests_gpu_j.log" 2>&1
  echo "[t=$((SECONDS - t0))s] gpu tests: $(tail -1 "$OUT/keep/tests_gpu_j.log")"; grep -E "PASSED|FAILED|ERROR|^E " "$OUT/keep/tests_gpu_j.log" | cut -c1-160 | head -20
  timeout 200 python3 scripts/bench_ws_gemm.py bench-fwd-fp8 --out "$OUT/keep/bench_ws_gemm1_fp8.json" \
    > "$OUT/keep/bench_ws_gemm1_fp8.log" 2>&1
  echo "[t=$((SECONDS - t0))s] bench rc $?"; cut -c1-300 "$OUT/keep/bench_ws_gemm1_fp8.log" | tail -14
elif [ "$PART" = m ]; then
  timeout -s KILL 150 python3 -m pytest -v -rA tests/test_ws_gemm_fp8.py -k "dgrad and not builds_for_sm90a" \
    > "$OUT/keep/tests_gpu_m.log" 2>&1
  echo "[t=$((SECONDS - t0))s] gpu tests: $(tail -1 "$OUT/keep/tests_gpu_m.log")"; grep -E "FAILED|ERROR|^E " "$OUT/keep/tests_gpu_m.log" | cut -c1-200 | head -12 || true
  timeout 150 python3 scripts/bench_ws_gemm.py bench-dgrad-fp8 --out "$OUT/keep/bench_ws_gemm1_dgrad_fp8.json" \
    > "$OUT/keep/bench_ws_gemm1_dgrad_fp8.log" 2>&1
  echo "[t=$((SECONDS - t0))s] bench rc $?"; cut -c1-300 "$OUT/keep/bench_ws_gemm1_dgrad_fp8.log" | tail -12
  timeout 200 python3 -m compare.layer --shapes qwen3-30b-a3b,qwen3-235b-a22b --impls megamoe-triton --precisions fp8 \
    --routings random --iters 15 --warmup 3 --device-time --no-plot --switches WS_GEMM1_DGRAD_FP8=1 \
    WS_GEMM1_DGRAD_FP8=1,WS_GEMM1_FP8=1 --out "$OUT/keep/layer_ep1_fp8_m.json" > "$OUT/keep/layer_fp8_m.log" 2>&1
  echo "[t=$((SECONDS - t0))s] layer rc $?"; grep "^|" "$OUT/keep/layer_fp8_m.log" | head -10
elif [ "$PART" = n ]; then
  timeout -s KILL 120 python3 -m pytest -q -rA tests/test_gpu.py tests/test_ws_gemm_fp8.py -k "fp8 and not builds_for_sm90a" \
    > "$OUT/keep/tests_gpu_n.log" 2>&1
  echo "[t=$((SECONDS - t0))s] gpu tests: $(tail -1 "$OUT/keep/tests_gpu_n.log")"; grep -E "^(FAILED|ERROR)" "$OUT/keep/tests_gpu_n.log" | head || true
  timeout 400 python3 -m compare.layer --shapes qwen3-30b-a3b,qwen3-235b-a22b --impls tt-compile,megamoe-triton \
    --precisions bf16,fp8,fp8_bwd --routings random --iters 20 --warmup 5 --device-time --no-plot \
    --out "$OUT/keep/layer_ep1_fp8_n.json" > "$OUT/keep/layer_fp8_n.log" 2>&1
  echo "[t=$((SECONDS - t0))s] layer rc $?"; grep "^| qwen3" "$OUT/keep/layer_fp8_n.log" | head -12
elif [ "$PART" = k ]; then
  timeout 330 python3 -m compare.layer --shapes qwen3-30b-a3b --impls megamoe-triton --precisions bf16,fp8,fp8_bwd \
    --routings random --iters 20 --warmup 5 --device-time --no-plot \
    --switches FP8_WGRAD=bf16 WS_GEMM1_FP8=1 FP8_WGRAD=bf16,WS_GEMM1_FP8=1 \
    --out "$OUT/keep/layer_ep1_fp8_k.json" > "$OUT/keep/layer_fp8_k.log" 2>&1
  echo "[t=$((SECONDS - t0))s] layer 30b rc $?"; grep "^|" "$OUT/keep/layer_fp8_k.log" | head -24
elif [ "$PART" = l ]; then
  timeout 330 python3 -m compare.layer --shapes qwen3-235b-a22b --impls megamoe-triton --precisions bf16,fp8,fp8_bwd \
    --routings random --iters 12 --warmup 3 --device-time --no-plot --switches FP8_WGRAD=bf16,WS_GEMM1_FP8=1 \
    --out "$OUT/keep/layer_ep1_fp8_l.json" > "$OUT/keep/layer_fp8_l.log" 2>&1
  echo "[t=$((SECONDS - t0))s] layer 235b rc $?"; grep "^|" "$OUT/keep/layer_fp8_l.log" | head -24
fi
session_pack "s19$PART"
