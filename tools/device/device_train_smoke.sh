#!/usr/bin/env bash
# One-GPU smoke of the training path (EP=1, 16 experts so it fits one GPU): uccl vs alltoall through
# `uccl-moe compare` for a few steps. Step time here ~ an EP4 rank's compute at 64 experts.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
. tools/device/device_setup.sh || exit 1
python3 -c "import megatron.core as m, hydra; print('megatron-core', m.__version__)"
timeout ${SMOKE_TIMEOUT:-420} python3 -m uccl_moe.cli compare recipe=dsv3_proxy_local 'dispatchers=[uccl,alltoall]' \
  platform.gpus_per_node=1 parallel.expert_model_parallel_size=1 model.num_experts=16 \
  parallel.micro_batch_size=${MBS:-1} parallel.global_batch_size=${GBS:-8} train.train_iters=${ITERS:-6} \
  --run-dir "$OUT/cmp" --timeout-s 240 --verbose "$@" 2>&1 | grep -v "UserWarning\|warnings.warn" | tail -80
