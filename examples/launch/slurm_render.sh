#!/usr/bin/env bash
# Render the sbatch script of a multi-node recipe (4 nodes x 8 H200, AWS EFA); nothing is submitted.
#   examples/launch/slurm_render.sh [OUT_DIR] [overrides...]    # default OUT_DIR: a new temporary folder
# On a Slurm login node, `uccl-moe slurm recipe=dsv3_h200_efa_4n --submit` renders and submits in one step;
# a sweep (`nodes=4,8`) renders one script per combination.
set -euo pipefail
UCCL_MOE=${UCCL_MOE:-uccl-moe}
out=${1:-$(mktemp -d)}
shift || true
# shellcheck disable=SC2086  # UCCL_MOE may be a command with arguments
$UCCL_MOE slurm recipe=dsv3_h200_efa_4n --run-dir "$out" --quiet "$@"
echo "--- $out/job.sbatch (head)"
head -n 20 "$out/job.sbatch"
