#!/usr/bin/env bash
# Render an AMD Primus experiment (16 x MI300X + Broadcom Thor-2) that trains through the uccl dispatcher, with the
# primus-cli command line and a primus.sbatch; nothing is run or submitted.
#   examples/launch/primus_render.sh [OUT_DIR] [overrides...]   # default OUT_DIR: a new temporary folder
# `--submit` on `uccl-moe primus` would sbatch it; the experiment sets moe_token_dispatcher_type: uccl.
set -euo pipefail
UCCL_MOE=${UCCL_MOE:-uccl-moe}
out=${1:-$(mktemp -d)}
shift || true
# shellcheck disable=SC2086  # UCCL_MOE may be a command with arguments
$UCCL_MOE primus recipe=dsv3_mi300x_broadcom_16n --run-dir "$out" --quiet "$@"
echo "--- $out/primus_exp.yaml (the dispatcher lines)"
grep -n "moe_token_dispatcher_type\|moe_uccl" "$out/primus_exp.yaml"
