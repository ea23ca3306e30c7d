#!/usr/bin/env bash
# One 4-GPU device call that verifies the merged tree: build, every GPU test (native intranode EP2/3/4 against the
# reference, reference backend on NCCL vs gloo, Megatron dispatcher on CUDA, device timeout path), a short
# `uccl-moe train` of the DeepSeek-V3 proxy on the GPUs, and the EP4 headline benchmark. Logs land in $OUT.
#   carry: .whl (megatron-core cp312 wheel)
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
{ nvidia-smi -L; python3 -c 'import torch; print("torch", torch.__version__, "gpus", torch.cuda.device_count())'; } 2>&1
UCCL_MOE_JOBS=16 tools/build_inplace.sh -DUCCL_MOE_CUDA_ARCHS=90 > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
el "built"
timeout ${TEST_TIMEOUT:-330} python3 -m pytest -q -p no:cacheprovider --timeout 240 -m gpu -rA \
  ${TESTS:-tests/gpu tests/uccl_moe/test_native_core.py tests/uccl_moe/megatron/test_dispatcher_gpu.py} \
  > "$OUT/pytest_gpu.log" 2>&1
echo "pytest rc=$?"; grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed" "$OUT/pytest_gpu.log" | tail -30
el "tests done"
if [ "${TRAIN:-1}" = 1 ]; then
  timeout ${TRAIN_TIMEOUT:-150} python3 -m uccl_moe.cli train recipe=dsv3_proxy_local train.train_iters=${ITERS:-6} \
    > "$OUT/train_uccl.log" 2>&1
  echo "train rc=$?"; grep -E "iteration|loss|Error|error" "$OUT/train_uccl.log" | tail -8 | cut -c1-240
  el "train done"
fi
if [ "${BENCH:-1}" = 1 ]; then
  timeout ${BENCH_TIMEOUT:-120} python3 -m uccl_moe.bench --ranks 4 --hidden 7168 --tokens 4096 --experts 256 --dtypes fp8,bf16 \
    --sms 24 --nvl-send 8 --iters 30 --json "$OUT/ep4.json" --png "$OUT/ep4.png" > "$OUT/bench.log" 2>&1
  grep -v "it/s\]" "$OUT/bench.log" | tail -12 | cut -c1-220
  el "bench done"
fi
