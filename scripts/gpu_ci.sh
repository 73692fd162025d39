#!/usr/bin/env bash
# GPU CI check (one GPU; committed baselines from an H200 and from an H100, chosen by the GPU's name). See docs/CI.md.
#
#   REV=$(git rev-parse --short HEAD) OUT=/tmp/ci bash scripts/gpu_ci.sh
#
# 1. compare.layer, EP=1, Qwen3-30B-A3B layer shape, bf16, random routing: stock TorchTitan compiled
#    vs megamoe triton (20 timed steps after 5 warm-up, as the baseline).
# 2. compare.train, the 1-GPU debug set: megamoe triton vs stock TorchTitan, 100 steps, seed 42, on
#    the baseline's LR schedule (200 steps).
# 3. compare.regress of each new JSON against the committed baseline, with a tolerance.
# Exit status: 0 all within tolerance; 1 a regression (or a missing / failed / changed entry);
# 2 a measurement produced no result file, or bad arguments.
#
# Environment (all optional):
#   REV        git revision to record (pass it from the machine that has the real .git; a copied
#              tree's .git can be stale). Default: what git says here, else "unknown".
#   OUT        result folder (default /tmp/out): layer_ci.json, train_ci.json (+ logs, PNG),
#              regress_layer.txt, regress_train.txt, gpu.txt
#   LAYER_TOL  relative slow-down allowed for layer times and speedups (default 0.07)
#   TRAIN_TOL  relative slow-down allowed for tokens/s/GPU and the speedup vs stock (default 0.10)
#   LOSS_TOL   absolute change allowed for the mean loss of steps 91-100 (default 0.25): gross errors
#              only (divergence, NaN); see the comment at its default below
#   EARLY_STEPS, EARLY_LOSS_TOL  the loss of each of steps 1..EARLY_STEPS must be within EARLY_LOSS_TOL
#              (absolute) of the baseline's same step (defaults 15 and 0.002): the numerics check
#   LAYER_BASELINE, TRAIN_BASELINE  baseline files (defaults: the committed ones below, by GPU model)
#   STEPS      training steps (default 100; the baseline has 200, compared over the same steps)
#   PYTHON     interpreter (default python3)
#   GPU_CI_ENV "plain": do not source scripts/gpu_env.sh (this project's device set-up, used
#              automatically when .whl/ holds wheels); the environment is then taken as it is
set -uo pipefail
cd "$(dirname "$0")/.."

if [ "${GPU_CI_ENV:-auto}" != plain ] && compgen -G ".whl/*.whl" >/dev/null && [ -f scripts/gpu_env.sh ]; then
  # this project's device machines: wheels the image lacks, offline mode, multicast off; sets OUT, REV
  source scripts/gpu_env.sh || exit 2
  set +e
else
  export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1} HF_DATASETS_OFFLINE=${HF_DATASETS_OFFLINE:-1}
  OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
  REV=${REV:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
  { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 || true; } > "$OUT/gpu.txt"
fi
[ "${REV:-unknown}" != unknown ] && export TITAN_MEGAMOE_GIT_REV=$REV

PY=${PYTHON:-python3}
LAYER_TOL=${LAYER_TOL:-0.07}
TRAIN_TOL=${TRAIN_TOL:-0.10}
# Training is not bitwise reproducible run to run (nondeterministic stock kernels): with the same
# config and seed, the losses agree to ~2e-4 over steps 1-15 and then diverge chaotically. Measured on
# H200, the mean loss of steps 91-100 (200-step LR schedule) differed by 0.108 between two megamoe
# triton runs (5.458 vs 5.566) and by 0.057 for stock TorchTitan; a 300-step run's final loss by 0.19
# (5.090 vs 5.283, 3.8 %). 0.1 gave a false LOSS CHANGED; 0.25 is above that spread and still catches
# divergence. Numerics changes are caught by the early-steps check (EARLY_STEPS, EARLY_LOSS_TOL).
LOSS_TOL=${LOSS_TOL:-0.25}
EARLY_STEPS=${EARLY_STEPS:-15}
EARLY_LOSS_TOL=${EARLY_LOSS_TOL:-0.002}
STEPS=${STEPS:-100}
# Default baselines: the committed results of this GPU model (times do not carry across models: stock TorchTitan
# ran 12 % slower on an H100 than on the H200 baseline's card), else the H200 ones.
GPU_NAME=$({ nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null || true; } | head -1)
case "$GPU_NAME" in
  *H100*) DEF_LAYER=benchmarks/results/gpu_ci_layer_1xh100_s33c_20261207.json
          DEF_TRAIN=benchmarks/results/gpu_ci_train_1xh100_s33c_20261207.json ;;
  *)      DEF_LAYER=benchmarks/results/layer_1xh200_ep1_triton_gmm_wgrad_20261130.json
          DEF_TRAIN=benchmarks/results/train_debug_1xh200_triton_20261130.json ;;
esac
LAYER_BASELINE=${LAYER_BASELINE:-$DEF_LAYER}
TRAIN_BASELINE=${TRAIN_BASELINE:-$DEF_TRAIN}
status=0
note() { echo "[gpu_ci] $*"; }

note "rev ${REV:-unknown}; out $OUT; tolerances: layer $LAYER_TOL, train $TRAIN_TOL, loss $LOSS_TOL," \
  "early loss $EARLY_LOSS_TOL (steps 1-$EARLY_STEPS)"
note "GPU ${GPU_NAME:-unknown}; baselines $LAYER_BASELINE, $TRAIN_BASELINE"

# 1. one MoE layer (exit code ignored here: a failed record is caught by compare.regress as NOT OK)
timeout 900 "$PY" -m compare.layer --shapes qwen3-30b-a3b --impls tt-compile,megamoe-triton --precisions bf16 \
  --routings random --iters 20 --warmup 5 --no-plot --out "$OUT/layer_ci.json" 2>&1 | grep -v -i "warn" | tail -20

# 2. training, the 1-GPU debug set (same labels as the baseline file). TorchTitan decays the learning
#    rate over lr_scheduler.total_steps (default: the step count): keep the baseline's schedule so that
#    the first STEPS steps are the baseline's first STEPS steps.
LR_STEPS=$("$PY" -c "import json, sys; from compare.regress import lr_schedule
print(lr_schedule(json.load(open(sys.argv[1]))['run']['options'])[0])" "$TRAIN_BASELINE") \
  || { note "cannot read the LR schedule length of $TRAIN_BASELINE"; exit 2; }
timeout 1200 "$PY" -m compare.train --ngpu 1 --steps "$STEPS" --skip 10 --extra "--lr_scheduler.total_steps $LR_STEPS" \
  --configs train_configs/qwen3_debugmoe_1gpu_megamoe_triton_bf16.toml train_configs/qwen3_debugmoe_1gpu_baseline_bf16.toml \
  --labels megamoe-triton torchtitan-baseline --out "$OUT/train_ci.json" 2>&1 | tail -12

# 3. regressions
for kind in layer train; do
  if [ ! -s "$OUT/${kind}_ci.json" ]; then
    note "FAIL: $OUT/${kind}_ci.json was not written (see the output above)"; status=2; continue
  fi
done
if [ -s "$OUT/layer_ci.json" ]; then
  "$PY" -m compare.regress "$OUT/layer_ci.json" --baseline "$LAYER_BASELINE" --tolerance "$LAYER_TOL" \
    --select implementation=tt-compile,megamoe-triton --select shape=qwen3-30b-a3b --select precision=bf16 \
    | tee "$OUT/regress_layer.txt"
  rc=${PIPESTATUS[0]}; note "layer regress exit $rc"; [ "$rc" -ne 0 ] && [ "$status" -eq 0 ] && status=$rc
fi
if [ -s "$OUT/train_ci.json" ]; then
  "$PY" -m compare.regress "$OUT/train_ci.json" --baseline "$TRAIN_BASELINE" --tolerance "$TRAIN_TOL" \
    --loss-tolerance "$LOSS_TOL" --early-steps "$EARLY_STEPS" --early-loss-tolerance "$EARLY_LOSS_TOL" \
    --select label=megamoe-triton,torchtitan-baseline \
    | tee "$OUT/regress_train.txt"
  rc=${PIPESTATUS[0]}; note "train regress exit $rc"; [ "$rc" -ne 0 ] && [ "$status" -eq 0 ] && status=$rc
fi
[ "$status" -eq 0 ] && note "PASS" || note "FAIL (exit $status)"
exit "$status"
