#!/usr/bin/env bash
# One device call comparing baseline intranode kernels with this tree's, side by side in the same run.
#   BASE=<dir with baseline kernel files (.cu/.cuh/.hpp of native/src/kernels/intranode)> [ALT=<dir>] [AB_RANKS=1] [AB_ARGS="..."] [TESTS=...] tools/device/device_ab.sh
# Builds the baseline (the tree with BASE's kernel files swapped in), then this tree (incremental), runs the
# benchmark alternately with each extension (AB_ORDER, default base new base new; a run may set env for itself:
# new@UCCL_MOE_COMBINE_SENDER_SMS=8), prints the per-variant summary (tools/device/ab_summary.py: median over
# runs, ratio to base, a verdict only where the ranges are apart), then the GPU tests on the new build.
# On a one-GPU machine use AB_RANKS=1 (one process: the kernels' SM-side cost; ranks sharing a GPU time-slice).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
K=native/src/kernels/intranode
L="$OUT/ab.log"; nvidia-smi -L > "$L" 2>&1
t0=$(date +%s)
mkdir -p /tmp/ab_new && cp "$K"/*.cu "$K"/*.cuh "$K"/*.hpp /tmp/ab_new/
: > "$OUT/build.log"
# build_variant NAME [DIR]: this tree's kernel files with DIR's laid over them, built into /tmp/ab_NAME.so.
build_variant() {
  cp /tmp/ab_new/* "$K"/ && { [ -z "${2:-}" ] || cp "$2"/* "$K"/; }
  UCCL_MOE_JOBS=16 tools/build_inplace.sh -DUCCL_MOE_CUDA_ARCHS=90 >> "$OUT/build.log" 2>&1 \
    || { tail -30 "$OUT/build.log"; exit 1; }
  SO=$(ls uccl_moe/_C*.so); cp "$SO" "/tmp/ab_$1.so"
}
build_variant base "$BASE"
[ -n "${ALT:-}" ] && build_variant alt "$ALT"  # a third variant (run it with "alt" in AB_ORDER)
build_variant new
grep -E "spill" "$OUT/build.log" | sort | uniq -c | head; echo "builds $(( $(date +%s) - t0 )) s" | tee -a "$L"
# $B and $TESTS are word-split on purpose.
# Default: the API defaults at the headline setting, in device time (host time hidden; a noisy host otherwise swamps
# kernel differences: docs/benchmarks.md).
B="python3 -m uccl_moe.bench --ranks ${AB_RANKS:-1} --png= ${AB_ARGS:---tokens 4096 --iters 25 --device-time}"
i=0; rm -rf /tmp/abj; mkdir -p /tmp/abj  # only this call's runs (a warm machine keeps /tmp)
for spec in ${AB_ORDER:-base new base new}; do   # a run is NAME or NAME@VAR=VAL[,VAR=VAL...] (env for that run)
  v=${spec%%@*}; envs=(); [ "$spec" != "$v" ] && IFS=, read -r -a envs <<< "${spec#*@}"
  for e in "${envs[@]}"; do [[ $e == [A-Za-z_]*=* ]] || { echo "AB_ORDER run '$spec': '$e' is not VAR=VALUE"; exit 2; }; done
  [ -f "/tmp/ab_$v.so" ] || { echo "AB_ORDER run '$spec': no variant '$v' (base, new, or alt with ALT set)"; exit 2; }
  i=$((i + 1)); cp "/tmp/ab_$v.so" "$SO"; v=${spec//[^A-Za-z0-9_]/_}
  echo "== $spec (run $i)" | tee -a "$L"
  env "${envs[@]}" timeout "${AB_TIMEOUT:-120}" $B --json "/tmp/abj/ab${i}_$v.json" > /tmp/ab_run.log 2>&1
  grep -v "it/s\]" /tmp/ab_run.log | grep -E -A8 "disp_us" | tee -a "$L"; grep "kernels us" /tmp/ab_run.log | tee -a "$L"
  if [ ! -s "/tmp/abj/ab${i}_$v.json" ]; then
    tail -15 /tmp/ab_run.log | tee -a "$L"
    [ -n "${AB_FALLBACK:-}" ] && { echo "falling back to: $AB_FALLBACK" | tee -a "$L"; B="$AB_FALLBACK"; AB_FALLBACK=; }
  fi
done
tar -czf "$OUT/ab_json.tgz" -C /tmp abj
python3 tools/device/ab_summary.py /tmp/abj | tee -a "$L"
echo "bench $(( $(date +%s) - t0 )) s" | tee -a "$L"
cp /tmp/ab_new.so "$SO"
if [ -n "${TESTS:-}" ]; then
  TT=$(( ${DEADLINE_S:-400} - ($(date +%s) - t0) )); echo "tests get ${TT} s" | tee -a "$L"
  UMOE_TEST_VERBOSE=1 timeout "$TT" python3 -m pytest -x -q -s -p no:cacheprovider ${TESTS} > "$OUT/pytest.log" 2>&1
  echo "pytest rc=$?" | tee -a "$L"; grep -E "passed|failed|BAD|Error" "$OUT/pytest.log" | tail -8
fi
echo "total $(( $(date +%s) - t0 )) s" | tee -a "$L"
