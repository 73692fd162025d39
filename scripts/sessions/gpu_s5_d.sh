#!/usr/bin/env bash
# GPU (2 H200), session 5 fourth call: the FP8 backward fixes (block-uniform end_row, expert -1 tiles
# skipped in the dgrad kernels, bf16 too) and the FP8 x payload (dispatch_push_fp8), first GPU run.
# 1. the 2-GPU EP worker (bf16 v1/v2/v3, fp8 with both x payloads bitwise equal, fp8_bwd; CUDA graphs;
#    timings of the 30B shape);
# 2. compare.layer EP=2, both shapes: stock compiled bf16 / fp8 vs megamoe bf16 / fp8 / fp8_bwd;
# 3. if time is left: compare.ep_overlap 30B fp8 modes v1 (FP8 payload) and v1b (bf16 payload), phases.
# Call as: REV=<hash> bash scripts/sessions/gpu_s5_d.sh
source scripts/gpu_env.sh
export TITAN_MEGAMOE_GIT_REV=$REV
set +e
t0=$SECONDS
EP_TRITON_ITERS=6 timeout 230 python3 -m torch.distributed.run --standalone --nproc_per_node 2 tests/ep_triton_worker.py \
  > "$OUT/ep_worker.log" 2>&1
echo "[t=$((SECONDS - t0))s] ep worker rc $?: $(grep -c PASS "$OUT/ep_worker.log") PASS lines"
grep -v "^\[W\|UserWarning\|warnings.warn" "$OUT/ep_worker.log" | grep -i "fail\|error\|PASS\|times\|mismatch\|assert" | head -30
timeout 200 python3 -m torch.distributed.run --standalone --nproc_per_node 2 -m compare.layer \
  --shapes qwen3-30b-a3b,qwen3-235b-a22b --impls tt-compile,megamoe-triton --precisions bf16,fp8,fp8_bwd \
  --routings random --iters 15 --warmup 4 --no-plot --out "$OUT/layer_ep2.json" > "$OUT/layer_ep2.log" 2>&1
echo "[t=$((SECONDS - t0))s] layer ep2 rc $?"; grep "^|\|rror" "$OUT/layer_ep2.log" | head -14
left=$((555 - (SECONDS - t0)))
if [ $left -gt 50 ]; then
  timeout $left python3 -m torch.distributed.run --standalone --nproc_per_node 2 -m compare.ep_overlap \
    --shapes qwen3-30b-a3b --tokens 16384 --routings random --modes v1,v1b --precisions bf16,fp8 \
    --iters 8 --warmup 2 --profile-iters 2 --out "$OUT/ep_overlap_2xh200.json" > "$OUT/ep_overlap.log" 2>&1
  echo "[t=$((SECONDS - t0))s] ep_overlap rc $?"; grep "^| qwen\|^phases" "$OUT/ep_overlap.log" | head -12
fi
rm -f "$OUT/gpu.txt"
cd "$OUT" && tar czf /tmp/s5d_logs.tgz . && mkdir -p /tmp/keep && cp -f layer_ep2.json ep_overlap_2xh200.json /tmp/keep/ 2>/dev/null
rm -rf "$OUT"/* && mv /tmp/s5d_logs.tgz /tmp/keep/* "$OUT"/ ; ls "$OUT"
