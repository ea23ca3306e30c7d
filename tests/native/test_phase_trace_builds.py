"""The traced build of the intranode kernels (-DUCCL_MOE_TRACE_DISPATCH, phase_trace.cuh; run only by
tools/device/device_2gpu.sh's `trace` stage on the device machines) still compiles: the trace points sit inside the
kernels and would rot unseen, since the shipped build compiles them out."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from helpers.nvcc import KERNELS, compile_all

TRACED = ("dispatch.cu", "combine.cu", "combine_pull.cu")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_traced_kernels_compile(tmp_path: Path) -> None:
    compile_all({name: (name, ["-DUCCL_MOE_TRACE_DISPATCH"]) for name in TRACED}, tmp_path)


def test_every_traced_kernel_file_is_compiled_here() -> None:
    """Each kernel file with trace points is in TRACED (a new one must be added to the compile check)."""
    traced = {p.name for p in KERNELS.glob("*.cu") if "UCCL_MOE_TRACE(" in p.read_text()}
    assert traced == set(TRACED), traced
