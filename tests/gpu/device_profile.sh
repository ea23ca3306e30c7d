#!/usr/bin/env bash
# The 2-GPU device call for the step statistics and profiling: build, the GPU tests of MoeTimer/StepProfiler/timeline,
# then `uccl-moe compare` of the DeepSeek-V3 proxy on EP2 (uccl vs alltoall) with --profile on rank 0, and the
# timeline of each run's trace. Small outputs land in $OUT.
#   carry: .whl (megatron-core cp312 wheel, hydra-core, omegaconf, antlr4; pydeps/nanobind if the image lacks it)
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
# nanobind for the build, when the image lacks it: a copy of the package in .whl/pydeps
python3 -c 'import nanobind' 2>/dev/null || export PYTHONPATH=$PYTHONPATH:$PWD/.whl/pydeps
{ nvidia-smi -L; python3 -c 'import torch; print("torch", torch.__version__, "gpus", torch.cuda.device_count())'; } 2>&1
UCCL_MOE_JOBS=16 tools/build_inplace.sh -DUCCL_MOE_CUDA_ARCHS=90 > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
el "built"
timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider --timeout 240 -m gpu -rA \
  tests/gpu/test_profiling_gpu.py > "$OUT/pytest_gpu.log" 2>&1
echo "pytest rc=$?"; grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed|Error" "$OUT/pytest_gpu.log" | tail -20
el "tests done"
R=/tmp/cmp
timeout ${CMP_TIMEOUT:-420} python3 -m uccl_moe.cli compare recipe=dsv3_proxy_local parallel=ep2 platform.gpus_per_node=2 \
  dispatchers=[uccl,alltoall] train.train_iters=${ITERS:-8} \
  "train.extra_args=[--profile,--profile-step-start,${PSTART:-5},--profile-step-end,${PEND:-7}]" --run-dir $R \
  > "$OUT/compare.log" 2>&1
echo "compare rc=$?"; cp $R/compare.md $R/compare.json "$OUT/" 2>/dev/null; cat $R/compare.md 2>/dev/null
grep -hE "Error|error" $R/*/train.log | head -10
el "compare done"
for d in uccl alltoall; do
  tr=$R/$d/profile/trace_rank0.json
  ls -la "$tr"
  python3 -m uccl_moe.megatron.timeline "$tr" --json "$OUT/timeline_$d.json" 2>&1 | grep -v -i warn
  gzip -c "$tr" > "/tmp/trace_$d.json.gz" && [ "$(stat -c %s "/tmp/trace_$d.json.gz")" -lt 15000000 ] \
    && cp "/tmp/trace_$d.json.gz" "$OUT/"
done
el "total"
