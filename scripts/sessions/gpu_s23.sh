#!/usr/bin/env bash
# GPU calls of session 23 (1 H200 asked; say in the results which card ran).
#   PART=a: the FP8 backward's standalone quantization passes, persistent and load-pipelined (fp8_quant_bwd.*_pipe_kernel,
#     TITAN_MEGAMOE_FP8_QUANT_PIPE): (1) scripts/bench_quant_pipe.py, v1 against the pipelined variants, bitwise checked,
#     30B and 235B; (2) Nsight Compute on v1 and the default pipelined kernels (30B): throughput, occupancy, stall
#     reasons; (3) compare.layer 30B fp8 / fp8_bwd, default rows and FP8_QUANT_PIPE=1 rows in one process.
#   PART a ran at git 1ada2c5; its pipelined kernels and scripts/bench_quant_pipe.py were removed after it (slower:
#   docs/NOTES.md, session 23), so PART a runs only in that revision.
# Call as: REV=<hash> PART=b bash scripts/sessions/gpu_s23.sh   (carry .whl; see scripts/gpu_env.sh)
source scripts/gpu_env.sh
session_start
quant_tests() {  # quant_tests TAG: the Gluon quantization passes' GPU tests
  timeout -s KILL 120 python3 -m pytest -q -rfE tests/test_gl_quant_bwd.py -p no:cacheprovider > "$OUT/keep/tests_gpu_$1.log" 2>&1
  echo "[t=$((SECONDS - t0))s] gpu tests: $(tail -1 "$OUT/keep/tests_gpu_$1.log")"; grep -E "^(FAILED|ERROR)|^E  " "$OUT/keep/tests_gpu_$1.log" | head -20 || true
}
quant_bench() {  # quant_bench SCRIPT TAG: the script's sweep at 30B and 235B, one line per row
  timeout 200 python3 "scripts/$1.py" --shapes 30b,235b > "$OUT/keep/$1_$2.json" 2> "$OUT/keep/$1_$2.err"
  echo "[t=$((SECONDS - t0))s] $1 rc $?"
  python3 - "$OUT/keep/$1_$2.json" <<'PY' || tail -5 "$OUT/keep/$1_$2.err"
import json, sys
d = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
for sh in d["shapes"]:
    for r in sh["rows"]:
        print(sh["shape"], r["pass_"], r["variant"], r.get("ms"), r.get("gbs"), r.get("bitwise_v1"), r.get("error", ""))
PY
}
ncu_bin() { command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1; }
layer_fp8_ab() {  # layer_fp8_ab TAG SWITCH [SHAPE PRECISIONS]: compare.layer fp8 rows, default and with SWITCH
  local name=${3:-qwen3-30b-a3b} prec=${4:-fp8,fp8_bwd} lim=$((570 - SECONDS + t0)); [ "$lim" -lt 10 ] && lim=10
  timeout "$lim" python3 -m compare.layer --shapes "$name" --impls megamoe-triton --precisions "$prec" \
    --routings random --iters 10 --warmup 3 --device-time --no-plot --switches "$2" \
    --out "$OUT/keep/layer_$1.json" > "$OUT/keep/layer_$1.log" 2>&1
  echo "[t=$((SECONDS - t0))s] layer $1 rc $?"; grep "^| qwen3" "$OUT/keep/layer_$1.log" | head -8
}
if [ "$PART" = a ]; then
  quant_bench bench_quant_pipe a
  NCU=$(ncu_bin)
  timeout 150 "$NCU" --clock-control none -k regex:_quant_ --section SpeedOfLight --section MemoryWorkloadAnalysis \
    --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats \
    python3 scripts/bench_quant_pipe.py --shapes 30b --ncu > "$OUT/keep/ncu_quant_a.txt" 2> "$OUT/keep/ncu_quant_a.err"
  echo "[t=$((SECONDS - t0))s] ncu rc $?"
  grep -E "^  _quant|Duration|Memory Throughput|DRAM Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Stall|Warp Cycles Per Issued|Issued Warp|No Eligible|Block Limit" \
    "$OUT/keep/ncu_quant_a.txt" | head -120
  tail -3 "$OUT/keep/ncu_quant_a.err"
  layer_fp8_ab 30b_fp8_a FP8_QUANT_PIPE=1
fi
# PART=b: the FP8 backward's quantization passes in Gluon (gl_quant_bwd.py: explicit layouts, 4 column scales per thread,
#   16-byte transposed stores, the reciprocal quotient), PART a's pipelined kernels removed: (1) GPU tests, Gluon
#   bitwise the Triton kernels; (2) scripts/bench_quant_bwd.py 30B / 235B, four Gluon launch configurations; (3) Nsight
#   Compute on v1 and the default Gluon kernels; (4) compare.layer 30B fp8 / fp8_bwd with FP8_QUANT_GLUON=1 rows.
if [ "$PART" = b ]; then
  quant_tests b
  quant_bench bench_quant_bwd b
  NCU=$(ncu_bin)
  timeout 120 "$NCU" --clock-control none -k regex:_quant_ --section SpeedOfLight --section Occupancy \
    --section LaunchStats --section WarpStateStats --section SchedulerStats \
    python3 scripts/bench_quant_bwd.py --shapes 30b --ncu > "$OUT/keep/ncu_quant_b.txt" 2> "$OUT/keep/ncu_quant_b.err"
  echo "[t=$((SECONDS - t0))s] ncu rc $?"
  grep -E "^  _|Duration|DRAM Throughput|Achieved Occupancy|Registers Per|Warp Cycles Per Issued|Issued Warp|No Eligible" \
    "$OUT/keep/ncu_quant_b.txt" | awk '/^  _/{n++} n%2==1' | head -60
  layer_fp8_ab 30b_fp8_b FP8_QUANT_GLUON=1
fi
# PART=c: PART b's Gluon kernels with a lowering fix (the end_row test as an if / else over a tile function: an
#   `if dead` on a constexpr False broke Gluon's lowering without end_row) and per-pass launch configurations:
#   (1) GPU tests; (2) bench_quant_bwd.py: dual at 8 warps capped at 128 registers (two programs per SM), the gathered
#   pass at 32 / 64 / 128 columns per program and 4 / 8 warps; (3) Nsight Compute stall reasons of v1 and the default
#   Gluon kernels; (4) compare.layer 30B fp8 / fp8_bwd with FP8_QUANT_GLUON=1 rows.
if [ "$PART" = c ]; then
  quant_tests c
  quant_bench bench_quant_bwd c
  NCU=$(ncu_bin)
  timeout 120 "$NCU" --clock-control none -k regex:_quant_ --section SpeedOfLight --section Occupancy \
    --section SchedulerStats --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
    python3 scripts/bench_quant_bwd.py --shapes 30b --ncu > "$OUT/keep/ncu_quant_c.txt" 2> "$OUT/keep/ncu_quant_c.err"
  echo "[t=$((SECONDS - t0))s] ncu rc $?"
  awk '/^  _/{n++; print; next} n%2==1 && /Duration|DRAM Throughput|Achieved Occupancy|Registers Per|Issued Warp|stalled/' \
    "$OUT/keep/ncu_quant_c.txt" | awk '$NF+0 >= 0.1 || !/stalled/' | head -90
  tail -2 "$OUT/keep/ncu_quant_c.err"
  layer_fp8_ab 30b_fp8_c FP8_QUANT_GLUON=1
fi
# PART=d: the dual pass over 32-column slabs and two 64-row halves (80 registers: three programs per SM), the gathered
#   pass at 4 warps x 32 columns (six per SM) as defaults: (1) GPU tests; (2) bench_quant_bwd.py sweep; (3) compare.layer
#   30B fp8 / fp8_bwd and 235B fp8 with FP8_QUANT_GLUON=1 rows (same process per shape).
if [ "$PART" = d ]; then
  quant_tests d
  quant_bench bench_quant_bwd d
  layer_fp8_ab 30b_fp8_d FP8_QUANT_GLUON=1
  layer_fp8_ab 235b_fp8_d FP8_QUANT_GLUON=1 qwen3-235b-a22b fp8
fi
# PART=e: the final tree (Gluon quantization passes on by default): (1) the FP8 GPU tests through the op, the fused
#   layer node and the quantizers; (2) compare.layer with stock TorchTitan compiled in the same process, 30B bf16 / fp8
#   / fp8_bwd, then 235B bf16 / fp8 (one process per shape).
if [ "$PART" = e ]; then
  timeout -s KILL 150 python3 -m pytest -q -rfE tests/test_gl_quant_bwd.py tests/test_eager_layer.py tests/test_gpu.py \
    -k "fp8 or gl_quant" -p no:cacheprovider > "$OUT/keep/tests_gpu_e.log" 2>&1
  echo "[t=$((SECONDS - t0))s] gpu tests: $(tail -1 "$OUT/keep/tests_gpu_e.log")"; grep -E "^(FAILED|ERROR)" "$OUT/keep/tests_gpu_e.log" | head || true
  for shape in 30b 235b; do
    prec=bf16,fp8,fp8_bwd; name=qwen3-30b-a3b; [ $shape = 235b ] && prec=bf16,fp8 && name=qwen3-235b-a22b
    lim=$((580 - SECONDS + t0)); [ $shape = 30b ] && lim=200; [ "$lim" -lt 10 ] && lim=10
    timeout "$lim" python3 -m compare.layer --shapes $name --impls tt-compile,megamoe-triton --precisions $prec \
      --routings random --iters 10 --warmup 3 --device-time --no-plot --out "$OUT/keep/layer_${shape}_e.json" \
      > "$OUT/keep/layer_${shape}_e.log" 2>&1
    echo "[t=$((SECONDS - t0))s] layer $shape rc $?"; grep "^| qwen3" "$OUT/keep/layer_${shape}_e.log" | head -12
  done
fi
# PART=f: where the fp8 and bf16 steps' kernel time goes now (compare.profile, 30B, kernels summed per name).
if [ "$PART" = f ]; then
  for prec in fp8 bf16; do
    timeout 120 python3 -m compare.profile --shape qwen3-30b-a3b --impl megamoe-triton --precision $prec --iters 5 \
      --top 22 --out "$OUT/keep/profile_30b_${prec}_f.json" > "$OUT/keep/profile_30b_${prec}_f.log" 2>&1
    echo "[t=$((SECONDS - t0))s] profile $prec rc $?"; tail -26 "$OUT/keep/profile_30b_${prec}_f.log" | cut -c1-140
  done
fi
# PART=g: the final tree's GPU tests (the launchers' sm_90 check cached per device): the Gluon quantization passes and
#   the FP8 path through the op and the fused layer node.
if [ "$PART" = g ]; then
  timeout -s KILL 200 python3 -m pytest -q -rfE tests/test_gl_quant_bwd.py tests/test_eager_layer.py tests/test_gpu.py \
    -k "fp8 or gl_quant" -p no:cacheprovider > "$OUT/keep/tests_gpu_g.log" 2>&1
  echo "[t=$((SECONDS - t0))s] gpu tests: $(tail -1 "$OUT/keep/tests_gpu_g.log")"; grep -E "^(FAILED|ERROR)" "$OUT/keep/tests_gpu_g.log" | head || true
fi
# PART=h: why the FP8 GEMM2 (0.70 ms, bf16 0.71) and FP8 GEMM2 dgrad (1.24, bf16 1.02) do not beat bf16 (PART f): Nsight
#   Compute on their first launches in scripts/bench_fp8.py at 30B (GEMM2 grid bf16 / fp8, GEMM2 dgrad bf16 / fp8,
#   GEMM2 persistent fp8 / bf16, in that order): throughput, tensor-pipe use, occupancy, stall reasons.
if [ "$PART" = h ]; then
  timeout 240 "$(ncu_bin)" --clock-control none --launch-count 6 \
    -k "regex:_gemm2_scatter_fwd_fp8_kernel|_gemm2_dgrad_swiglu_bwd_fp8_kernel|_gemm2_dgrad_swiglu_bwd_kernel|_gemm2_scatter_fwd_kernel" \
    --section SpeedOfLight --section ComputeWorkloadAnalysis --section Occupancy --section SchedulerStats \
    --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
    python3 scripts/bench_fp8.py --shapes 30b > "$OUT/keep/ncu_gemm2_h.txt" 2> "$OUT/keep/ncu_gemm2_h.err"
  echo "[t=$((SECONDS - t0))s] ncu rc $?"
  awk '/^  _/{print; next} /Duration|Compute \(SM\) Throughput|DRAM Throughput|Achieved Occupancy|Registers Per|Issued Warp|Executed Ipc A|stalled/' \
    "$OUT/keep/ncu_gemm2_h.txt" | awk '$NF+0 >= 0.15 || !/stalled/' | cut -c1-120 | head -120
  tail -3 "$OUT/keep/ncu_gemm2_h.err" | cut -c1-200
fi
# PART=i: a Gluon FP8 GEMM2 (ws_gemm_fp8.ws_gemm2_fwd_fp8: the GEMM1 dgrad's producer / consumers, one K segment,
#   scatter epilogue; opt-in WS_GEMM2_FP8): (1) GPU tests of ws_gemm_fp8.py (the GEMM1 dgrad's too: its kernel code is
#   now shared); (2) bench-g2-fp8 against the Triton kernel, 30B and 235B; (3) compare.layer 30B fp8 A/B.
if [ "$PART" = i ]; then
  timeout -s KILL 120 python3 -m pytest -q -rfE -s tests/test_ws_gemm_fp8.py -k "gpu and (gemm2 or dgrad)" \
    -p no:cacheprovider > "$OUT/keep/tests_gpu_i.log" 2>&1
  echo "[t=$((SECONDS - t0))s] gpu tests: $(tail -1 "$OUT/keep/tests_gpu_i.log")"; grep -E "^(FAILED|ERROR)|^E  |bitwise" "$OUT/keep/tests_gpu_i.log" | head -20 || true
  timeout 90 python3 scripts/bench_ws_gemm.py bench-g2-fp8 --out "$OUT/keep/bench_g2_fp8_i.json" > "$OUT/keep/bench_g2_fp8_i.log" 2>&1
  echo "[t=$((SECONDS - t0))s] bench rc $?"; cut -c1-220 "$OUT/keep/bench_g2_fp8_i.log" | tail -12
  layer_fp8_ab 30b_fp8_i WS_GEMM2_FP8=1 qwen3-30b-a3b fp8
fi
session_pack "s23$PART"
