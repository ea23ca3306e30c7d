#!/usr/bin/env bash
# Train a real (tiny) Megatron MoE on this host: 2 ranks on gloo, the uccl dispatcher on the reference backend.
#   examples/launch/train_local.sh              # print the torchrun command, Megatron argv and environment only
#   examples/launch/train_local.sh --run        # train it (4 steps; about half a minute on 2 CPU cores)
#   examples/launch/train_local.sh --run train.train_iters=8 dispatcher=alltoall   # any Hydra override
# On GPUs: recipe=dsv3_proxy_local (4 GPUs of this host, EP=4, native backend). UCCL_MOE overrides the command
# (e.g. UCCL_MOE="python -m uccl_moe.cli" in a tree that is not pip-installed).
set -euo pipefail
UCCL_MOE=${UCCL_MOE:-uccl-moe}
mode=--dry-run
if [[ ${1:-} == --run ]]; then mode=; shift; fi
# shellcheck disable=SC2086  # UCCL_MOE may be a command with arguments
exec $UCCL_MOE train recipe=tiny_cpu_moe "$@" $mode
