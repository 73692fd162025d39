#!/usr/bin/env bash
# GPU calls of session 10 (1 H200).
#   PART=a (~9 min): the warp-specialized Gluon GEMM1 dgrad (kernels/ws_gemm.py): correctness on edge cases
#     (scripts/bench_ws_gemm.py check, killed after 150 s should a protocol bug hang it), then do_bench against
#     the Triton kernel at both shapes; the host cost of launches and driver calls (scripts/launch_cost.py:
#     is cuPointerGetAttribute what makes a Triton launch cost 150-220 us here?); compare.layer EP 1 both
#     shapes with POINTER_ARGS=0 beside the default in the same process (--device-time).
#   PART=b (~9 min): after PART a found every wgmma of the Gluon kernel serialized by ptxas (C7514, a select on the
#     accumulator; fixed, now a CPU compile check): ws check / bench again with the ping-pong and cooperative
#     schedules, the GPU cases of tests/test_ws_gemm.py, and compare.layer EP 1 both shapes with
#     WS_GEMM1_DGRAD=pingpong and =coop beside the default (Triton GEMM1 dgrad) in the same process.
#   PART=c (~8 min): with the cooperative Gluon GEMM1 dgrad the default (D >= 2048): tests/test_ws_gemm.py and the
#     single-GPU tests of tests/test_gpu.py (graph capture, no host sync, real shapes), compare.layer EP 1 both
#     shapes with WS_GEMM1_DGRAD=0 beside the default, and the per-kernel profile of the 30B step.
#   PART=d (~7 min): the Gluon GEMM1 forward (gathered rows by cp.async in 4 producer warps, SwiGLU epilogue):
#     check-fwd (killed after 120 s should it hang), bench-fwd against the Triton kernel, its GPU tests, and, only
#     if the check passed, compare.layer EP 1 both shapes with WS_GEMM1=1 beside the default in one process.
#   PART=e (~4 min): the Gluon kernels launched through kernels/launch.py's fast path (PART d: WS_GEMM1=1 cut the
#     30B forward's device time 2.395 -> 2.231 ms but its host enqueue went 0.93 -> 1.26 ms through Gluon's own
#     launch path, so the forward from idle did not move): tests/test_ws_gemm.py on the GPU, compare.layer EP 1
#     both shapes with WS_GEMM1=1 beside the default.
# Call as: REV=<hash> PART=a bash scripts/sessions/gpu_s13.sh   (carry .whl; see scripts/gpu_env.sh)
source scripts/gpu_env.sh
session_start
if [ "$PART" = a ]; then
  timeout -s KILL 150 python3 scripts/bench_ws_gemm.py check > "$OUT/keep/ws_check.log" 2>&1
  echo "[t=$((SECONDS - t0))s] ws check rc $?"; grep -v "^{" "$OUT/keep/ws_check.log" | tail -5
  python3 -c "
import json
for l in open('$OUT/keep/ws_check.log'):
    if l.startswith('{'): r=json.loads(l); print(' ', r['ok'], r['case'], '%.2e'%r['rel_err_vs_fp32'], '%.2e'%r['rel_diff_vs_triton'], r['bitwise_triton'], r['nan_rows'], r['nonzero_padding_rows'])"
  timeout -s KILL 150 python3 scripts/bench_ws_gemm.py bench --out "$OUT/keep/bench_ws_gemm_1xh200.json" > "$OUT/ws_bench.log" 2>&1
  echo "[t=$((SECONDS - t0))s] ws bench rc $?"; grep -v "^{" "$OUT/ws_bench.log" | tail -5
  python3 -c "
import json
for l in open('$OUT/ws_bench.log'):
    if l.startswith('{'): r=json.loads(l); print(' ', r.get('shape',''), r['kernel'][:30], r.get('cfg','')[9:60], '%.3f ms'%r['ms'], '%.0f TF/s'%r['tflops'], r.get('bitwise_triton',''))"
  timeout 150 python3 scripts/launch_cost.py --iters 100 --out "$OUT/keep/launch_cost_1xh200.json" > "$OUT/launch_cost.log" 2>&1
  echo "[t=$((SECONDS - t0))s] launch cost rc $?"; grep -v "^{" "$OUT/launch_cost.log" | tail -3
  python3 -c "
import json
for l in open('$OUT/launch_cost.log'):
    if l.startswith('{'): r=json.loads(l); print('  %8.1f us  %s' % (r['host_us'], r['stage']))"
  timeout 320 python3 -m compare.layer --shapes qwen3-30b-a3b,qwen3-235b-a22b --impls tt-compile,megamoe-triton \
    --precisions bf16 --routings random --iters 20 --warmup 5 --device-time --no-plot \
    --switches POINTER_ARGS=0 --out "$OUT/keep/layer_1xh200_ep1_s10a.json" > "$OUT/layer_s10a.log" 2>&1
  echo "[t=$((SECONDS - t0))s] layer switches rc $?"; grep "^|" "$OUT/layer_s10a.log"
elif [ "$PART" = b ]; then
  timeout -s KILL 150 python3 scripts/bench_ws_gemm.py check > "$OUT/keep/ws_check_b.log" 2>&1
  echo "[t=$((SECONDS - t0))s] ws check rc $?"; grep -v "^{" "$OUT/keep/ws_check_b.log" | tail -5
  python3 -c "
import json
for l in open('$OUT/keep/ws_check_b.log'):
    if l.startswith('{'): r=json.loads(l); print(' ', r['ok'], r['case'], '%.2e'%r['rel_err_vs_fp32'], '%.2e'%r['rel_diff_vs_triton'], r['bitwise_triton'], r['nan_rows'], r['nonzero_padding_rows'])"
  timeout -s KILL 200 python3 scripts/bench_ws_gemm.py bench --out "$OUT/keep/bench_ws_gemm_b_1xh200.json" > "$OUT/ws_bench_b.log" 2>&1
  echo "[t=$((SECONDS - t0))s] ws bench rc $?"; grep -v "^{" "$OUT/ws_bench_b.log" | tail -5
  python3 -c "
import json
for l in open('$OUT/ws_bench_b.log'):
    if l.startswith('{'): r=json.loads(l); print(' ', r.get('shape',''), r['kernel'][:30], r.get('cfg','')[9:75], '%.3f ms'%r['ms'], '%.0f TF/s'%r['tflops'], r.get('bitwise_triton',''))"
  timeout -s KILL 150 python3 -m pytest -q -x tests/test_ws_gemm.py > "$OUT/keep/tests_ws_gemm.log" 2>&1
  echo "[t=$((SECONDS - t0))s] tests: $(tail -1 "$OUT/keep/tests_ws_gemm.log")"
  timeout 330 python3 -m compare.layer --shapes qwen3-30b-a3b,qwen3-235b-a22b --impls tt-compile,megamoe-triton \
    --precisions bf16 --routings random --iters 20 --warmup 5 --device-time --no-plot \
    --switches WS_GEMM1_DGRAD=pingpong WS_GEMM1_DGRAD=coop --out "$OUT/keep/layer_1xh200_ep1_s10b.json" \
    > "$OUT/layer_s10b.log" 2>&1
  echo "[t=$((SECONDS - t0))s] layer switches rc $?"; grep "^|" "$OUT/layer_s10b.log"
elif [ "$PART" = c ]; then
  timeout -s KILL 120 python3 -m pytest -q -rA tests/test_ws_gemm.py > "$OUT/keep/tests_ws_gemm_c.log" 2>&1
  echo "[t=$((SECONDS - t0))s] ws tests: $(tail -1 "$OUT/keep/tests_ws_gemm_c.log")"; grep -E "^(FAILED|ERROR)" "$OUT/keep/tests_ws_gemm_c.log" | head
  timeout -s KILL 260 python3 -m pytest -q -rA tests/test_gpu.py -k "not ep_triton and not reference_ep2" > "$OUT/keep/tests_gpu_c.log" 2>&1
  echo "[t=$((SECONDS - t0))s] gpu tests: $(tail -1 "$OUT/keep/tests_gpu_c.log")"; grep -E "^(FAILED|ERROR)" "$OUT/keep/tests_gpu_c.log" | head
  timeout 300 python3 -m compare.layer --shapes qwen3-30b-a3b,qwen3-235b-a22b --impls tt-compile,megamoe-triton \
    --precisions bf16 --routings random --iters 20 --warmup 5 --device-time --no-plot \
    --switches WS_GEMM1_DGRAD=0 --out "$OUT/keep/layer_1xh200_ep1_s10c.json" > "$OUT/layer_s10c.log" 2>&1
  echo "[t=$((SECONDS - t0))s] layer rc $?"; grep "^|" "$OUT/layer_s10c.log"
  timeout 90 python3 -m compare.profile --shape qwen3-30b-a3b --impl megamoe-triton --top 14 --iters 3 --warmup 2 \
    --out "$OUT/keep/profile_30b_megamoe-triton_s10c.json" > "$OUT/profile_30b.log" 2>&1
  echo "[t=$((SECONDS - t0))s] profile rc $?"; tail -20 "$OUT/profile_30b.log"
elif [ "$PART" = d ]; then
  timeout -s KILL 120 python3 scripts/bench_ws_gemm.py check-fwd > "$OUT/keep/ws_check_fwd.log" 2>&1
  rc=$?; echo "[t=$((SECONDS - t0))s] ws check-fwd rc $rc"; grep -v "^{" "$OUT/keep/ws_check_fwd.log" | tail -5
  python3 -c "
import json
for l in open('$OUT/keep/ws_check_fwd.log'):
    if l.startswith('{'): r=json.loads(l); print(' ', r['ok'], r['case'], '%.2e'%r['rel_err_gate_up'], '%.2e'%r['rel_err_h'], r['bitwise_triton'], r['nan_rows'], r['nonzero_padding_rows'])"
  if [ $rc = 0 ]; then
    timeout -s KILL 120 python3 scripts/bench_ws_gemm.py bench-fwd --out "$OUT/keep/bench_ws_gemm1_fwd_1xh200.json" > "$OUT/ws_bench_fwd.log" 2>&1
    echo "[t=$((SECONDS - t0))s] ws bench-fwd rc $?"; grep -v "^{" "$OUT/ws_bench_fwd.log" | tail -3
    python3 -c "
import json
for l in open('$OUT/ws_bench_fwd.log'):
    if l.startswith('{'): r=json.loads(l); print(' ', r.get('shape',''), r['kernel'][:30], r.get('cfg','')[9:75], '%.3f ms'%r['ms'], '%.0f TF/s'%r['tflops'], r.get('bitwise_triton',''))"
    timeout -s KILL 100 python3 -m pytest -q -rA tests/test_ws_gemm.py -k "fwd" > "$OUT/keep/tests_ws_fwd.log" 2>&1
    echo "[t=$((SECONDS - t0))s] fwd tests: $(tail -1 "$OUT/keep/tests_ws_fwd.log")"
    timeout 220 python3 -m compare.layer --shapes qwen3-30b-a3b,qwen3-235b-a22b --impls tt-compile,megamoe-triton \
      --precisions bf16 --routings random --iters 20 --warmup 5 --device-time --no-plot \
      --switches WS_GEMM1=1 --out "$OUT/keep/layer_1xh200_ep1_s10d.json" > "$OUT/layer_s10d.log" 2>&1
    echo "[t=$((SECONDS - t0))s] layer rc $?"; grep "^|" "$OUT/layer_s10d.log"
  fi
elif [ "$PART" = e ]; then
  timeout -s KILL 120 python3 -m pytest -q -rA tests/test_ws_gemm.py > "$OUT/keep/tests_ws_gemm_e.log" 2>&1
  rc=$?; echo "[t=$((SECONDS - t0))s] ws tests rc $rc: $(tail -1 "$OUT/keep/tests_ws_gemm_e.log")"
  grep -E "^(FAILED|ERROR)" "$OUT/keep/tests_ws_gemm_e.log" | head
  if [ $rc = 0 ]; then
    timeout 220 python3 -m compare.layer --shapes qwen3-30b-a3b,qwen3-235b-a22b --impls tt-compile,megamoe-triton \
      --precisions bf16 --routings random --iters 20 --warmup 5 --device-time --no-plot \
      --switches WS_GEMM1=1 --out "$OUT/keep/layer_1xh200_ep1_s10e.json" > "$OUT/layer_s10e.log" 2>&1
    echo "[t=$((SECONDS - t0))s] layer rc $?"; grep "^|" "$OUT/layer_s10e.log"
  fi
else
  echo "PART=$PART: unknown"; exit 2
fi
session_pack s13$PART
