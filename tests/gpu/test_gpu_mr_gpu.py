"""The dma-buf half of GPU memory registration (native/src/transport/gpu_mr.cc) on a real GPU: the driver exports a
cudaMalloc'd range as a dma-buf fd, the fd the ibverbs transport then hands to ibv_reg_dmabuf_mr. No NIC needed.
Run on the GPU machine: python -m pytest -q tests/gpu/test_gpu_mr_gpu.py"""

from __future__ import annotations

import os
import stat

import pytest
import torch

pytestmark = pytest.mark.gpu

_ALIGN = 2 << 20  # kDmabufAlignBytes: the export works on whole GPU pages


def _native():
    from uccl_moe import _C

    if not hasattr(_C, "gpu_export_dmabuf"):
        pytest.skip("this build has no ibverbs transport (rdma-core headers missing at build time)")
    return _C


def test_a_cuda_allocation_exports_as_a_dmabuf_fd() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (run on a GPU machine: tools/device)")
    C = _native()
    if C.gpu_backend() == "none":
        pytest.skip("CPU-only build of uccl_moe")
    buf = torch.empty(4 * _ALIGN, dtype=torch.uint8, device="cuda")
    base = (buf.data_ptr() + _ALIGN - 1) // _ALIGN * _ALIGN  # whole GPU pages inside the allocation
    fd, why = C.gpu_export_dmabuf(base, 2 * _ALIGN)
    if fd < 0 and "not supported" in why:
        pytest.skip(f"the driver or kernel has no dma-buf export here: {why}")
    assert fd >= 0, why
    try:
        st = os.fstat(fd)
        assert not stat.S_ISDIR(st.st_mode)
        # A dma-buf fd reports its size, and /proc names its exporter.
        assert os.lseek(fd, 0, os.SEEK_END) >= 2 * _ALIGN
        with open(f"/proc/self/fdinfo/{fd}") as f:
            info = f.read()
        assert "exp_name" in info, info
    finally:
        os.close(fd)


def test_an_unaligned_or_host_range_is_refused_with_a_reason() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (run on a GPU machine: tools/device)")
    C = _native()
    host = torch.empty(_ALIGN, dtype=torch.uint8)
    fd, why = C.gpu_export_dmabuf(host.data_ptr(), _ALIGN)
    assert fd == -1 and why, "host memory is not a GPU allocation"
