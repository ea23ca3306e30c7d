#!/usr/bin/env bash
# One device call comparing a whole baseline tree with this one, side by side in the same run (device_ab.sh swaps
# only the kernel directory; this also covers bindings, runtime and Python). Prepare the baseline here first:
#   rm -rf ab_tree && mkdir ab_tree && git archive <rev> native uccl_moe tools CMakeLists.txt pyproject.toml | tar -x -C ab_tree
# then run (on the device): [AB_ARGS="..."] [AB_ORDER="base new base new"] [PRE_STAGES="itest"] tools/device/device_ab_tree.sh
# PRE_STAGES run tools/device/device_x4.sh stages on this tree before the benchmark (its env knobs apply).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
t0=$(date +%s)
. tools/device/device_setup.sh || exit 1
(cd ab_tree && UCCL_MOE_JOBS=16 tools/build_inplace.sh -DUCCL_MOE_CUDA_ARCHS=90 > "$OUT/build_base.log" 2>&1) \
  || { tail -30 "$OUT/build_base.log"; exit 1; }
echo "builds $(( $(date +%s) - t0 )) s"
if [ -n "${PRE_STAGES:-}" ]; then STAGES="$PRE_STAGES" bash tools/device/device_x4.sh 2>&1 | tail -12; fi
ROOT=$PWD
# $AB_ARGS is word-split on purpose.
for v in ${AB_ORDER:-base new base new}; do
  dir=$ROOT; [ "$v" = base ] && dir=$ROOT/ab_tree
  echo "== $v"
  # shellcheck disable=SC2086
  (cd "$dir" && PYTHONPATH=/tmp/site:$dir timeout "${AB_TIMEOUT:-150}" python3 -m uccl_moe.bench --png= --json= \
    ${AB_ARGS:---ranks 2 --tokens 4096 --dtypes fp8,bf16 --sms 24 --nvl-send 4 --iters 20 --kernel-times} 2>&1 \
    | grep -v "it/s\]" | grep -E "kernels us|^ *[0-9]+ +[0-9]+ +[0-9]+|peer copy|error|Error" | tail -${AB_TAIL:-20})
done
echo "total $(( $(date +%s) - t0 )) s"
