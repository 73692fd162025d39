# Sourced by the GPU session scripts: wheels the H200 image lacks, offline mode, multicast off.
set -euo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
# Pass REV=<hash> literally from the calling machine: the device copy's .git can be stale.
REV=${REV:-unknown}
[ "$REV" = unknown ] && echo "gpu_env.sh: REV not given; results will carry git_rev=unknown" >&2
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, torchtitan; print('torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())" | tee -a "$OUT/gpu.txt"

# The shared frame of a session script (scripts/sessions/gpu_s12.sh on; the earlier ones spell it out):
#   session_start          after sourcing: record REV, keep going past failures, start the clock,
#                          PART (default a), $OUT/keep for the files to bring back
#   session_pack TAG       at the end: logs tarred as $OUT/logs_TAG.tgz, the kept files moved up into $OUT
session_start() {
  export TITAN_MEGAMOE_GIT_REV=$REV
  set +e
  t0=$SECONDS
  PART=${PART:-a}
  mkdir -p "$OUT/keep"
}
session_pack() {
  (cd "$OUT" && tar czf "/tmp/logs_$1.tgz" --exclude=keep . && find . -mindepth 1 -maxdepth 1 ! -name keep -exec rm -rf {} +
   mv keep/* . ; rmdir keep ; mv "/tmp/logs_$1.tgz" . ; ls "$OUT")
}

# Helpers of the session scripts (scripts/sessions/gpu_s24.sh on):
left() {  # left CAP: the seconds a step may take, at most CAP, within the call's BUDGET (default 575); at least 5
  local l=$((${BUDGET:-575} - SECONDS + t0)); [ "$l" -gt "$1" ] && l=$1; [ "$l" -lt 5 ] && l=5; echo $l
}
ncu_bin() { command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1; }
gpu_tests() {  # gpu_tests TAG FILES... : pytest on the GPU, the summary line and failures
  local tag=$1; shift
  timeout -s KILL 240 python3 -m pytest -q -rfE -s "$@" -p no:cacheprovider > "$OUT/keep/tests_gpu_$tag.log" 2>&1
  echo "[t=$((SECONDS - t0))s] gpu tests: $(tail -1 "$OUT/keep/tests_gpu_$tag.log")"
  grep -E "^(FAILED|ERROR)|^E  |bitwise" "$OUT/keep/tests_gpu_$tag.log" | head -24 || true
}
ep_layer() {  # ep_layer TAG SHAPES PRECISIONS ROUTINGS CAP, at EP = $EP_GPUS (gpu_ep2.sh / gpu_ep8.sh set it)
  timeout $(left "$5") python3 -m torch.distributed.run --standalone --nproc_per_node "$EP_GPUS" -m compare.layer \
    --shapes "$2" --impls tt-compile,megamoe-triton --precisions "$3" --routings "$4" --iters 10 --warmup 3 \
    --device-time --no-plot --out "$OUT/keep/layer_ep${EP_GPUS}_$1.json" > "$OUT/keep/layer_ep${EP_GPUS}_$1.log" 2>&1
  echo "[t=$((SECONDS - t0))s] layer ep$EP_GPUS $1 rc $?"; grep "^| qwen3" "$OUT/keep/layer_ep${EP_GPUS}_$1.log" | head -16
}
layer_ab() {  # layer_ab TAG SWITCHES SHAPE PRECISIONS [IMPLS]: compare.layer rows, default and with each switch set
  # (LAYER_FLAGS, env: more compare.layer options, e.g. --fp8-weights-per-step)
  local lim=$((${BUDGET:-570} - 5 - SECONDS + t0)); [ "$lim" -lt 10 ] && lim=10
  timeout "$lim" python3 -m compare.layer --shapes "$3" --impls "${5:-megamoe-triton}" --precisions "$4" \
    --routings random --iters 10 --warmup 3 --device-time --no-plot ${2:+--switches $2} ${LAYER_FLAGS:-} \
    --out "$OUT/keep/layer_$1.json" > "$OUT/keep/layer_$1.log" 2>&1
  echo "[t=$((SECONDS - t0))s] layer $1 rc $?"; grep "^| qwen3" "$OUT/keep/layer_$1.log" | head -${6:-12}
}
probe() {  # probe TAG ARGS...: one counter-schedule launch (scripts/probe_dynamic.py) in its own process, killed at 25 s
  timeout -s KILL 25 python3 scripts/probe_dynamic.py "${@:2}" > "$OUT/keep/probe_dynamic_$1.log" 2>&1
  local rc=$?; echo "[t=$((SECONDS - t0))s] probe $1 rc $rc: $(tail -1 "$OUT/keep/probe_dynamic_$1.log" | cut -c1-220)"
  return $rc
}
dynamic_tests_ab() {  # the counter schedule's GPU tests, then its A/B (scripts/ab_kernels.py --unfence-dynamic)
  TITAN_MEGAMOE_TEST_DYNAMIC=1 timeout -s KILL $(left 150) python3 -m pytest -q -rfE -x tests/test_ws_gemm.py \
    -k "on_gpu and dynamic" -p no:cacheprovider > "$OUT/keep/tests_gpu_dynamic_a.log" 2>&1
  echo "[t=$((SECONDS - t0))s] dynamic GPU tests: $(tail -1 "$OUT/keep/tests_gpu_dynamic_a.log")"
  grep -E "^(FAILED|ERROR)|^E  " "$OUT/keep/tests_gpu_dynamic_a.log" | head -12
  timeout $(left 150) python3 scripts/ab_kernels.py --shapes 235b,30b --rounds 8 --unfence-dynamic \
    --groups gemm1_dgrad_dynamic,gemm1_fwd_dynamic --out "$OUT/keep/ab_kernels_dynamic_a.json" \
    > "$OUT/keep/ab_kernels_dynamic_a.log" 2>&1
  echo "[t=$((SECONDS - t0))s] ab dynamic rc $?"; grep -E "^(30b|235b)" "$OUT/keep/ab_kernels_dynamic_a.log"
}
ncu_run() {  # FILE REGEX SKIP COUNT CMD...: Nsight Compute on CMD's kernels matching REGEX (stall reasons, L2 -> SM
  # bytes, tensor pipe) into $OUT/keep/FILE.txt, and its summary lines
  timeout $(left 240) "$(ncu_bin)" --clock-control none --launch-skip "$3" --launch-count "$4" -k "regex:$2" \
    --section SpeedOfLight --section SchedulerStats \
    --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,lts__t_bytes.sum.per_second,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,sm__cycles_elapsed.avg.per_second" \
    "${@:5}" > "$OUT/keep/$1.txt" 2> "$OUT/keep/$1.err"
  echo "[t=$((SECONDS - t0))s] ncu $1 rc $?"
  awk '/^  [_a-zA-Z]/{print; next} /Duration|Compute \(SM\) Throughput|Memory Throughput|L2 Cache Throughput|DRAM Throughput|lts__t_bytes|gmma_cycles|per_second|Issued Warp|stalled/' \
    "$OUT/keep/$1.txt" | awk '$NF+0 >= 0.15 || !/stalled/' | cut -c1-120 | head -200
  tail -3 "$OUT/keep/$1.err" | cut -c1-200
}
ncu_fp8() {  # TAG COUNT: Nsight Compute on scripts/ncu_gemm_fp8.py at 30B (the Gluon FP8 GEMMs beside cuBLAS's dense one)
  ncu_run "ncu_gemm_fp8_$1" "_fp8_ws_kernel|gemm|nvjet|sm90|cutlass|device_kernel" 1 "$2" \
    python3 scripts/ncu_gemm_fp8.py --shape 30b
  timeout $(left 60) python3 scripts/ncu_gemm_fp8.py --shape 30b --time
}
ci_and_debug_train_fp8() {  # TAG: scripts/gpu_ci.sh, then the debug model 300 steps in bf16 / fp8 / fp8_bwd and
  # compare.loss_spread against bf16 (issue 6's accuracy item: final loss within 2 % of bf16)
  OUT="$OUT/keep/ci" timeout $(left 420) bash scripts/gpu_ci.sh > "$OUT/keep/gpu_ci_$1.log" 2>&1
  echo "[t=$((SECONDS - t0))s] gpu_ci rc $?"; tail -12 "$OUT/keep/gpu_ci_$1.log"
  timeout $(left 300) python3 -m compare.train --ngpu 1 --steps 300 --skip 10 --configs \
    train_configs/qwen3_debugmoe_1gpu_megamoe_triton_bf16.toml train_configs/qwen3_debugmoe_1gpu_megamoe_fp8.toml \
    train_configs/qwen3_debugmoe_1gpu_megamoe_fp8_bwd.toml --labels triton-bf16 triton-fp8 triton-fp8_bwd \
    --out "$OUT/keep/train_debug_fp8_$1.json" > "$OUT/keep/train_debug_fp8_$1.log" 2>&1
  echo "[t=$((SECONDS - t0))s] train rc $?"; tail -8 "$OUT/keep/train_debug_fp8_$1.log"
  python3 -m compare.loss_spread "$OUT/keep/train_debug_fp8_$1.json" \
    --reference qwen3_debugmoe_1gpu_megamoe_triton_bf16 --out "$OUT/keep/loss_spread_fp8_$1.json" 2>&1 | tail -8
}
tests_ab() {  # NAME TESTFILE CAP GROUPS TAG: TESTFILE's GPU tests (at most CAP s), then (if they all pass) the A/B of
  # scripts/ab_kernels.py's GROUPS at both shapes; files *_NAME_TAG.{log,json}; returns 1 when the tests did not pass
  local log="$OUT/keep/tests_gpu_$1_$5.log"
  timeout -s KILL $(left $3) python3 -m pytest -q -rfE "$2" -k "gpu" -p no:cacheprovider > "$log" 2>&1
  echo "[t=$((SECONDS - t0))s] $1 GPU tests: $(tail -1 "$log")"
  grep -E "^(FAILED|ERROR)|^E  " "$log" | head -8
  grep -q " passed" "$log" && ! grep -q "failed" "$log" || return 1
  timeout $(left 150) python3 scripts/ab_kernels.py --shapes 30b,235b --rounds 8 --groups "$4" \
    --out "$OUT/keep/ab_kernels_$1_$5.json" > "$OUT/keep/ab_kernels_$1_$5.log" 2>&1
  echo "[t=$((SECONDS - t0))s] ab rc $?"; grep -E "^(30b|235b)" "$OUT/keep/ab_kernels_$1_$5.log"
}
ab_groups() {  # TAG GROUPS [SHAPES]: scripts/ab_kernels.py's GROUPS alone (8 rotated rounds, bitwise against the first)
  timeout $(left 150) python3 scripts/ab_kernels.py --shapes "${3:-30b,235b}" --rounds 8 --groups "$2" \
    --out "$OUT/keep/ab_kernels_$1.json" > "$OUT/keep/ab_kernels_$1.log" 2>&1
  echo "[t=$((SECONDS - t0))s] ab $1 rc $?"; grep -E "^(30b|235b)" "$OUT/keep/ab_kernels_$1.log"
}
fp8_gemm_tests_ab() {  # TAG: the FP8 GEMM1 / dgrad / GEMM2 tests, then the A/B of their tile groups
  tests_ab fp8 tests/test_ws_gemm_fp8.py 220 \
    gemm1_fwd_fp8_quant_h,gemm1_fwd_fp8_wide,gemm1_dgrad_fp8_wide,gemm2_fwd_fp8_wide "$1"
}
wgrad_fp8_tests_ab() {  # TAG: the FP8 wgrad tests, then the A/B of its staging-tile rows
  tests_ab wgrad_fp8 tests/test_ws_wgrad_fp8.py 240 wgrad_w13_fp8,wgrad_w2_fp8 "$1"  # 240: each config x shape compiles
}

debug_train_seed() {  # TAG SEED LABELS...: the debug model 300 steps at --seed SEED, one run per label of
  # bf16 / fp8 / fp8_bwd (issue 6's accuracy item over seeds; compare.loss_spread combines the records afterwards).
  # LABEL_SUFFIX (env): appended to the run labels, for a run under a switch (compare.train does not record the
  # environment; group such runs with compare.loss_spread --group-by label)
  local tag=$1 seed=$2; shift 2
  local cfgs=() labels=()
  for l in "$@"; do
    case $l in bf16) cfgs+=(train_configs/qwen3_debugmoe_1gpu_megamoe_triton_bf16.toml) ;;
      *) cfgs+=("train_configs/qwen3_debugmoe_1gpu_megamoe_$l.toml") ;; esac
    labels+=("triton-$l${LABEL_SUFFIX:-}")
  done
  timeout $(left 420) python3 -m compare.train --ngpu 1 --steps 300 --skip 10 --seed "$seed" --configs "${cfgs[@]}" \
    --labels "${labels[@]}" --out "$OUT/keep/train_debug_fp8_seed${seed}_$tag.json" \
    > "$OUT/keep/train_debug_fp8_seed${seed}_$tag.log" 2>&1
  echo "[t=$((SECONDS - t0))s] train seed $seed rc $?"; grep "^| triton" "$OUT/keep/train_debug_fp8_seed${seed}_$tag.log"
}
prof() {  # prof TAG SHAPE PRECISION: compare.profile's kernels per step (megamoe-triton, 5 iterations)
  timeout $(left 100) python3 -m compare.profile --shape "$2" --impl megamoe-triton --precision "$3" --iters 5 \
    --top 22 --out "$OUT/keep/profile_$1.json" > "$OUT/keep/profile_$1.log" 2>&1
  echo "[t=$((SECONDS - t0))s] profile $1 rc $?"; tail -26 "$OUT/keep/profile_$1.log" | cut -c1-150
}
ncu_wgrad() {  # TAG SHAPE: Nsight Compute on the FP8 wgrads as the op launches them (dw2's 2nd launch, dw1 | dw3's
  # two; scripts/bench_wgrad_fp8.py --ncu --default-only; never profiled before session 40)
  ncu_run "ncu_wgrad_fp8_$1" "_wgrad_fp8_ws_kernel" 1 3 python3 scripts/bench_wgrad_fp8.py --ncu --default-only \
    --shapes "$2"
}
