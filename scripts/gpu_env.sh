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

# The shared frame of a session script (gpu_s12.sh on; the earlier ones spell it out):
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
