#!/usr/bin/env bash
# The 4-GPU device call: build, GPU tests (EP2/3/4), benchmarks (EP4 sweep of SMs/chunks, EP2, EP3, 128-token
# latency), compute-sanitizer memcheck and racecheck on a small EP2 case. Everything lands in $OUT (<= 8 files).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
L="$OUT/bench.log"
{ nvidia-smi -L; nvidia-smi topo -m; } > "$L" 2>&1
t0=$(date +%s)
UCCL_MOE_JOBS=16 tools/build_inplace.sh -DUCCL_MOE_CUDA_ARCHS=90 > /tmp/build.log 2>&1 || { tail -40 /tmp/build.log; exit 1; }
echo "build $(( $(date +%s) - t0 )) s" | tee -a "$L"
T=tests/gpu/test_intranode_native.py
UMOE_TEST_VERBOSE=1 timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -s -p no:cacheprovider --timeout 200 ${TESTS:-$T} > "$OUT/pytest.log" 2>&1
grep -E "passed|failed|BAD|Error" "$OUT/pytest.log" | tail -8
echo "tests done $(( $(date +%s) - t0 )) s" | tee -a "$L"
B="python3 -m uccl_moe.bench --hidden 7168 --iters 30"
timeout 200 $B --ranks 4 --tokens 128,4096 --experts 256 --dtypes fp8,bf16 --sms ${EP4_SMS:-16,24,32} \
  --nvl-send ${EP4_CHUNKS:-8,16} --nvl-recv ${EP4_RECV:-256,512} --json "$OUT/ep4.json" --png "$OUT/ep4.png" 2>&1 | grep -v "it/s\]" >> "$L"
timeout 90 $B --ranks 2 --tokens 128,4096 --experts 256 --dtypes fp8,bf16 --sms 24 --nvl-send ${CHUNKS:-8,16} \
  --json "$OUT/ep2.json" --png "" 2>&1 | grep -v "it/s\]" >> "$L"
timeout 90 $B --ranks 3 --tokens 128,4096 --experts 255 --dtypes fp8,bf16 --sms 24 --nvl-send ${CHUNKS:-8,16} \
  --json "$OUT/ep3.json" --png "" 2>&1 | grep -v "it/s\]" >> "$L"
echo "bench done $(( $(date +%s) - t0 )) s" | tee -a "$L"
grep -A60 "uccl-moe bench on" "$L" | grep -v "^wrote" | cut -c1-220
if [ "${SANITIZE:-1}" = 1 ]; then  # one small case, two iterations; both logs in one file
  for tool in memcheck racecheck; do
    UMOE_TEST_SMALL=1 UMOE_TEST_ITERS=2 UMOE_TEST_BIG=0 UCCL_MOE_TIMEOUT_S=100 timeout ${SAN_TIMEOUT:-100} \
      compute-sanitizer --tool $tool --target-processes all python3 -m pytest -q -s -p no:cacheprovider -o addopts="" \
      "$T::test_native_intranode_matches_reference[2]" >> "$OUT/sanitizer.log" 2>&1
    echo "$tool rc=$?"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|passed|failed" "$OUT/sanitizer.log" | tail -2
  done
fi
echo "total $(( $(date +%s) - t0 )) s"
