"""uccl_moe.utils helpers that need no GPU."""

from __future__ import annotations

import pytest
import torch

from uccl_moe.utils import host_ints


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_host_ints_reads_every_value_in_order(dtype):
    t = torch.tensor([[3, -1], [7, 2**30]], dtype=dtype)
    assert host_ints(t) == [3, -1, 7, 2**30]
    assert host_ints(t[:, 1]) == [-1, 2**30]  # a strided view
    assert host_ints(torch.empty(0, dtype=dtype)) == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on a GPU machine: tools/device)")
@pytest.mark.gpu
def test_host_ints_on_the_device_matches_cpu():
    t = torch.randint(-5, 1 << 20, (17, 3), dtype=torch.int64)
    assert host_ints(t.cuda()) == t.reshape(-1).tolist()
