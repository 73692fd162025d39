#!/usr/bin/env bash
# GPU calls of session 22 (1 H200 asked; say in the results which card ran).
#   PART=a: session 21's final defaults (Gluon FP8 wgrad on, the fused eager FP8 node, the switches.override fix, the
#     lazy weight-cache counter), which no GPU ran together: (1) the FP8 GPU tests through the layer and the op;
#     (2) compare.layer, stock TorchTitan compiled beside megamoe bf16 / fp8 / fp8_bwd, 30B then 235B (one process
#     per shape, so a time-out keeps the first JSON).
# Call as: REV=<hash> PART=a bash scripts/sessions/gpu_s22.sh   (carry .whl; see scripts/gpu_env.sh)
source scripts/gpu_env.sh
session_start
layer() {  # layer TAG SHAPE PRECISIONS LIMIT_S [more compare.layer args]
  local tag=$1 shape=$2 prec=$3 lim=$4; shift 4
  timeout "$lim" python3 -m compare.layer --shapes "$shape" --impls tt-compile,megamoe-triton --precisions "$prec" \
    --routings random --iters 10 --warmup 3 --device-time --no-plot --out "$OUT/keep/layer_$tag.json" "$@" \
    > "$OUT/keep/layer_$tag.log" 2>&1
  echo "[t=$((SECONDS - t0))s] layer $tag rc $?"; grep "^| qwen3" "$OUT/keep/layer_$tag.log" | head -24
}
bench_fp8_ab() {  # bench_fp8_ab BASE.json NEW.json [FILTER]: per-kernel ms of two scripts/bench_fp8.py records
  python3 - "$@" <<'PY' || true
import json, sys
def rows(p):
    d = json.loads(open(p).read().strip().splitlines()[-1])
    return {(sh["shape"], k): v.get("ms") for sh in d["shapes"] for k, v in sh["kernels"].items()}
a, b = rows(sys.argv[1]), rows(sys.argv[2])
for k in a:
    if k in b and a[k] and b[k] and (len(sys.argv) < 4 or sys.argv[3] in k[1]):
        print(f"{str(k):50s} base {a[k]:.4f}  new {b[k]:.4f}  ({b[k] / a[k]:.3f}x)")
PY
}
if [ "$PART" = a ]; then
  timeout -s KILL 90 python3 -m pytest -q -rA tests/test_eager_layer.py tests/test_gpu.py -k fp8 -p no:cacheprovider \
    > "$OUT/keep/tests_gpu_a.log" 2>&1
  echo "[t=$((SECONDS - t0))s] gpu tests: $(tail -1 "$OUT/keep/tests_gpu_a.log")"; grep -E "^(FAILED|ERROR)" "$OUT/keep/tests_gpu_a.log" | head || true
  layer 30b qwen3-30b-a3b bf16,fp8,fp8_bwd 220
  lim=$((560 - SECONDS + t0)); [ "$lim" -lt 10 ] && lim=10
  layer 235b qwen3-235b-a22b bf16,fp8 "$lim"
fi
# PART=b: why the Gluon FP8 GEMM2 dgrad's epilogue is slow (session 21: its s * h column amax pass ~26 us per tile):
#   global-timer stamps inside each consumer's tiles (launch_gemm2_dgrad_fp8(trace=...)), for the default two-pass
#   epilogue, the same without the amax pass (ablate 1) and the one-pass epilogue (2; checked bitwise against 1);
#   then the kernel's GPU tests (the stamps and the epilogue switch changed its signature).
if [ "$PART" = b ]; then
  timeout 150 python3 scripts/bench_ws_gemm.py trace-g2d-fp8 --shapes 30b,235b --out "$OUT/keep/trace_g2d_fp8.json" \
    > "$OUT/keep/trace_g2d_fp8.log" 2>&1
  echo "[t=$((SECONDS - t0))s] trace rc $?"; cut -c1-200 "$OUT/keep/trace_g2d_fp8.log" | tail -60
  timeout -s KILL 100 python3 -m pytest -q -rA tests/test_ws_gemm2_dgrad_fp8.py -p no:cacheprovider \
    > "$OUT/keep/tests_gpu_b.log" 2>&1
  echo "[t=$((SECONDS - t0))s] gpu tests: $(tail -1 "$OUT/keep/tests_gpu_b.log")"; grep -E "^(FAILED|ERROR)" "$OUT/keep/tests_gpu_b.log" | head || true
fi
# PART=c: the quantization's x / scale by one reciprocal per group and Markstein's FMA correction instead of div.rn
#   per element (fp8_quant._div_by_group, and the Gluon GEMM2 dgrad's _e4m3_t): (1) GPU tests that compare the
#   quantization bitwise with torch (test_fp8_quant.py: midpoints with arbitrary scales included), the FP8 backward
#   kernels and the Gluon FP8 GEMM2 dgrad; (2) its trace, both epilogues; (3) scripts/bench_fp8.py (every FP8 kernel)
#   at 30B in the base tree (.ab/base, BASE=<hash>, before the change) and in this one; (4) compare.layer 30B.
if [ "$PART" = c ]; then
  B=$PWD/.ab/base; BASE=${BASE:-unknown}
  timeout -s KILL 170 python3 -m pytest -q -rfE tests/test_fp8_quant.py tests/test_ws_gemm2_dgrad_fp8.py \
    tests/test_kernels_fp8_bwd.py -k "not sm90a" -p no:cacheprovider > "$OUT/keep/tests_gpu_c.log" 2>&1
  echo "[t=$((SECONDS - t0))s] gpu tests: $(tail -1 "$OUT/keep/tests_gpu_c.log")"; grep -E "^(FAILED|ERROR)" "$OUT/keep/tests_gpu_c.log" | head || true
  timeout 100 python3 scripts/bench_ws_gemm.py trace-g2d-fp8 --shapes 30b,235b --out "$OUT/keep/trace_g2d_fp8_c.json" \
    > "$OUT/keep/trace_g2d_fp8_c.log" 2>&1
  echo "[t=$((SECONDS - t0))s] trace rc $?"; grep -E "^\{|main loop|stores issued|next tile" "$OUT/keep/trace_g2d_fp8_c.log" | cut -c1-160
  timeout 80 python3 scripts/bench_fp8.py --shapes 30b > "$OUT/keep/bench_fp8_30b_c.json" 2> "$OUT/keep/bench_fp8_30b_c.err"
  echo "[t=$((SECONDS - t0))s] bench_fp8 rc $?"
  (cd "$B" && TITAN_MEGAMOE_GIT_REV=$BASE PYTHONPATH=/tmp/site:$B timeout 80 python3 scripts/bench_fp8.py --shapes 30b \
    > "$OUT/keep/bench_fp8_30b_base.json" 2> "$OUT/keep/bench_fp8_30b_base.err")
  echo "[t=$((SECONDS - t0))s] bench_fp8 base rc $?"
  bench_fp8_ab "$OUT/keep/bench_fp8_30b_base.json" "$OUT/keep/bench_fp8_30b_c.json"
  lim=$((560 - SECONDS + t0)); [ "$lim" -lt 10 ] && lim=10
  timeout "$lim" python3 -m compare.layer --shapes qwen3-30b-a3b --impls megamoe-triton --precisions fp8,fp8_bwd,bf16 \
    --routings random --iters 10 --warmup 3 --device-time --no-plot --switches WS_GEMM2_DGRAD_FP8=1 \
    --out "$OUT/keep/layer_30b_c.json" > "$OUT/keep/layer_30b_c.log" 2>&1
  echo "[t=$((SECONDS - t0))s] layer rc $?"; grep "^| qwen3" "$OUT/keep/layer_30b_c.log" | head -14
fi
# PART=d: PART c's A/B again (bench_fp8.py crashed there on a leftover of a removed kernel, fixed in both trees):
#   every FP8 kernel at 30B, base tree (.ab/base, before the reciprocal quantization) then this one; then the fp8
#   layer (30B, compare.layer) in each tree; first the bitwise quantization tests and the Gluon GEMM2 dgrad's.
if [ "$PART" = d ]; then
  B=$PWD/.ab/base; BASE=${BASE:-unknown}
  timeout -s KILL 110 python3 -m pytest -q -rfE tests/test_fp8_quant.py tests/test_ws_gemm2_dgrad_fp8.py -k "not sm90a" \
    -p no:cacheprovider > "$OUT/keep/tests_gpu_d.log" 2>&1
  echo "[t=$((SECONDS - t0))s] gpu tests: $(tail -1 "$OUT/keep/tests_gpu_d.log")"; grep -E "^(FAILED|ERROR)" "$OUT/keep/tests_gpu_d.log" | head || true
  (cd "$B" && TITAN_MEGAMOE_GIT_REV=$BASE PYTHONPATH=/tmp/site:$B timeout 70 python3 scripts/bench_fp8.py --shapes 30b \
    > "$OUT/keep/bench_fp8_30b_base.json" 2> "$OUT/keep/bench_fp8_30b_base.err")
  echo "[t=$((SECONDS - t0))s] bench_fp8 base rc $?"
  timeout 70 python3 scripts/bench_fp8.py --shapes 30b > "$OUT/keep/bench_fp8_30b_d.json" 2> "$OUT/keep/bench_fp8_30b_d.err"
  echo "[t=$((SECONDS - t0))s] bench_fp8 rc $?"
  bench_fp8_ab "$OUT/keep/bench_fp8_30b_base.json" "$OUT/keep/bench_fp8_30b_d.json"
  for tree in base new; do
    d=$PWD; [ $tree = base ] && d=$B
    (cd "$d" && TITAN_MEGAMOE_GIT_REV=$([ $tree = base ] && echo $BASE || echo $REV) PYTHONPATH=/tmp/site:$d timeout 90 \
      python3 -m compare.layer --shapes qwen3-30b-a3b --impls megamoe-triton --precisions fp8,fp8_bwd --routings random \
      --iters 10 --warmup 3 --device-time --no-plot --out "$OUT/keep/layer_30b_fp8_$tree.json" > "$OUT/keep/layer_30b_fp8_$tree.log" 2>&1)
    echo "[t=$((SECONDS - t0))s] layer $tree rc $?"; grep "^| qwen3" "$OUT/keep/layer_30b_fp8_$tree.log" | sed -n 1,2p\;3,4p
  done
fi
# PART=e: the reciprocal quantization kept only where PART d measured it faster (weights, GEMM epilogues; the
#   standalone activation passes back on div_rn), the Gluon FP8 GEMM2 dgrad with its one-pass epilogue only:
#   GPU tests, bench_fp8.py 30B and the fp8 layer in the base tree and this one, the Gluon kernel's trace.
if [ "$PART" = e ]; then
  B=$PWD/.ab/base; BASE=${BASE:-unknown}
  timeout -s KILL 120 python3 -m pytest -q -rfE tests/test_fp8_quant.py tests/test_ws_gemm2_dgrad_fp8.py tests/test_gpu.py \
    -k "not sm90a and (fp8 or quant or midpoint or weight)" -p no:cacheprovider > "$OUT/keep/tests_gpu_e.log" 2>&1
  echo "[t=$((SECONDS - t0))s] gpu tests: $(tail -1 "$OUT/keep/tests_gpu_e.log")"; grep -E "^(FAILED|ERROR)" "$OUT/keep/tests_gpu_e.log" | head || true
  timeout 40 python3 scripts/bench_ws_gemm.py trace-g2d-fp8 --shapes 30b,235b --out "$OUT/keep/trace_g2d_fp8_e.json" \
    > "$OUT/keep/trace_g2d_fp8_e.log" 2>&1
  echo "[t=$((SECONDS - t0))s] trace rc $?"; cut -c1-150 "$OUT/keep/trace_g2d_fp8_e.log"
  (cd "$B" && TITAN_MEGAMOE_GIT_REV=$BASE PYTHONPATH=/tmp/site:$B timeout 45 python3 scripts/bench_fp8.py --shapes 30b \
    > "$OUT/keep/bench_fp8_30b_base_e.json" 2> /dev/null)
  timeout 45 python3 scripts/bench_fp8.py --shapes 30b > "$OUT/keep/bench_fp8_30b_e.json" 2> /dev/null
  echo "[t=$((SECONDS - t0))s] bench_fp8 rc $?"
  bench_fp8_ab "$OUT/keep/bench_fp8_30b_base_e.json" "$OUT/keep/bench_fp8_30b_e.json" "/fp8"
  for tree in base new; do
    d=$PWD; [ $tree = base ] && d=$B
    (cd "$d" && TITAN_MEGAMOE_GIT_REV=$([ $tree = base ] && echo $BASE || echo $REV) PYTHONPATH=/tmp/site:$d timeout 60 \
      python3 -m compare.layer --shapes qwen3-30b-a3b --impls megamoe-triton --precisions fp8,fp8_bwd --routings random \
      --iters 10 --warmup 3 --device-time --no-plot --out "$OUT/keep/layer_30b_fp8_${tree}_e.json" > "$OUT/keep/layer_30b_fp8_${tree}_e.log" 2>&1)
    echo "[t=$((SECONDS - t0))s] layer $tree rc $?"; grep "^| qwen3" "$OUT/keep/layer_30b_fp8_${tree}_e.log" | sed -n 1,4p
  done
fi
session_pack "s22$PART"
