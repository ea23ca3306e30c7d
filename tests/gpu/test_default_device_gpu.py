"""Issue 29 on GPUs: the native Buffer and the uccl Megatron dispatcher under ``torch.set_default_device("cuda")`` +
``torch.set_default_dtype(torch.bfloat16)`` (what DeepEP V1's harness sets) and inside ``with torch.device("cuda")``
with a float64 default: bit-identical to the plain run. 2 GPUs.

    python -m pytest -q tests/gpu/test_default_device_gpu.py
"""

from __future__ import annotations

import pytest
import torch
from helpers.defaults import GPU_MODES
from helpers.mp import run_gpu_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.mp, pytest.mark.timeout(900)]


def _buffer_rank(rank: int, world: int, gloo, modes):
    from tests.uccl_moe.test_buffer_defaults import under_every_mode

    return under_every_mode(rank, world, modes, backend="native")


def _dispatcher_rank(rank: int, world: int, gloo, modes):
    from tests.uccl_moe.megatron.test_dispatcher_defaults import dispatcher_modes

    return dispatcher_modes(rank, world, modes, device_kind="cuda")


def _need_two_gpus() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")


def test_native_buffer_under_default_cuda_device_and_bf16():
    _need_two_gpus()
    for rank, failures in enumerate(run_gpu_ranks(_buffer_rank, 2, GPU_MODES)):
        assert not failures, f"rank {rank}: {failures}"


def test_uccl_dispatcher_under_default_cuda_device_and_bf16():
    pytest.importorskip("megatron.core")
    _need_two_gpus()
    for rank, failures in enumerate(run_gpu_ranks(_dispatcher_rank, 2, GPU_MODES)):
        assert not failures, f"rank {rank}: {failures}"
