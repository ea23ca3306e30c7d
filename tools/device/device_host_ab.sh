#!/usr/bin/env bash
# One device call comparing the host time per call of a baseline tree (ab_tree, prepared as device_ab_tree.sh says)
# with this one, on one GPU: tools/device/profile_call.py (back-to-back calls) and tools/device/host_parts.py (the GPU held
# by a sleep kernel), alternating trees. Knobs: HAB_ORDER (default "base new base new"), HAB_TOKENS (default 128),
# HAB_PARTS=0 to skip host_parts.py. Both tools also time this tree's synchronous ops on the caller's stream
# (UCCL_MOE_CALLER_STREAM_OPS) within the same process. Source tools/device/device_setup.sh first (it builds this
# tree; this script builds ab_tree).
set -uo pipefail
(cd ab_tree && UCCL_MOE_JOBS=16 tools/build_inplace.sh -DUCCL_MOE_CUDA_ARCHS=90 > /tmp/build_base.log 2>&1) \
  || { tail -30 /tmp/build_base.log; exit 1; }
ROOT=$PWD
for v in ${HAB_ORDER:-base new base new}; do
  dir=$ROOT; [ "$v" = base ] && dir=$ROOT/ab_tree
  echo "== $v: profile_call"
  (cd "$dir" && PYTHONPATH=/tmp/site:$dir timeout 120 python3 tools/device/profile_call.py --tokens "${HAB_TOKENS:-128}" \
    --calls 500 --top 0 2>&1 | grep -E "host time per call|Error|error" | grep -v "^ ")
  if [ "${HAB_PARTS:-1}" = 1 ]; then
    echo "== $v: host_parts"
    (cd "$dir" && PYTHONPATH=/tmp/site:$dir timeout 120 python3 tools/device/host_parts.py --tokens "${HAB_TOKENS:-128}" 2>&1 \
      | grep -E "^(Buffer|Native)|Error|error")
  fi
done
