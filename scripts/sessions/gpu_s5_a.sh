#!/usr/bin/env bash
# GPU (2 H200), session 5 first call: validation of what ran only on CPU, and where the FP8 EP
# backward's time goes.
# 1. compare.ep_overlap EP=2, both shapes, bf16 + fp8, mode v1: per-phase CUDA events of the FP8 passes
#    (first GPU run of the FP8 mode, of the EP step refactor and of the FP8 quantizers' end_row).
# 2. the 2-GPU EP worker (correctness of the refactor / end_row on the edge cases, CUDA graphs).
# Call as: REV=<hash> bash scripts/sessions/gpu_s5_a.sh
source scripts/gpu_env.sh
export TITAN_MEGAMOE_GIT_REV=$REV
set +e
t0=$SECONDS
PRECISIONS=bf16,fp8 MODES=v1 TIMEOUT=300 bash scripts/gpu_ep_overlap.sh > /dev/null 2>&1
echo "[t=$((SECONDS - t0))s] ep_overlap done"; grep -v "^\[W" "$OUT/ep_overlap.log" | tail -70
left=$((560 - (SECONDS - t0)))
EP_TRITON_ITERS=6 timeout $left python3 -m torch.distributed.run --standalone --nproc_per_node 2 tests/ep_triton_worker.py \
  > "$OUT/ep_worker.log" 2>&1
echo "[t=$((SECONDS - t0))s] ep worker rc $?: $(grep -c PASS "$OUT/ep_worker.log") PASS lines"
grep -v "^\[W\|UserWarning\|warnings.warn" "$OUT/ep_worker.log" | grep -i "fail\|error\|PASS\|times\|ms" | head -30
rm -f "$OUT/gpu.txt"
cd "$OUT" && tar czf /tmp/s5a_logs.tgz . && mkdir -p /tmp/keep && cp -f ep_overlap_2xh200.json /tmp/keep/ 2>/dev/null
rm -rf "$OUT"/* && mv /tmp/s5a_logs.tgz /tmp/keep/* "$OUT"/ ; ls "$OUT"
