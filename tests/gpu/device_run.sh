#!/usr/bin/env bash
# One device call: build in place (sm_90), run the native GPU tests, then the benchmark. Logs go to $OUT.
#   MODE=quick|full  BENCH_ARGS="..."  tests/gpu/device_run.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi -L | tee "$OUT/smi.txt"; nvidia-smi topo -m >> "$OUT/smi.txt" 2>&1
t0=$(date +%s)
UCCL_MOE_JOBS=16 tools/build_inplace.sh -DUCCL_MOE_CUDA_ARCHS=90 > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
grep -E "spill|warning" "$OUT/build.log" | head -20
echo "build $(( $(date +%s) - t0 )) s"
python3 -c "import uccl_moe._C as C; print('intranode kernels:', C.has_intranode_kernels())"
if [ -n "${TESTS:-}" ]; then
  timeout ${TEST_TIMEOUT:-400} python3 -m pytest -x -q -p no:cacheprovider ${TESTS} 2>&1 | tee "$OUT/pytest.log" | tail -40
fi
if [ -n "${BENCH_ARGS:-}" ]; then
  timeout ${BENCH_TIMEOUT:-300} python3 -m uccl_moe.bench ${BENCH_ARGS} --json "$OUT/bench.json" --png "$OUT/bench.png" 2>&1 | tee "$OUT/bench.log" | grep -v "it/s" | tail -40
fi
echo "total $(( $(date +%s) - t0 )) s"
