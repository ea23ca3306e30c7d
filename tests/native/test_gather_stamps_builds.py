"""The stamped build of the copy-engine dispatch's gather (-DUCCL_MOE_STAMP_GATHER, with and without
-DUCCL_MOE_STAMP_WAIT_ALL: gather_stamps.cuh; run only on the device machines, tools/device/gather_stamps.py) still
compiles: the stamps sit inside the kernel and would rot unseen, since the shipped build compiles them out."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from helpers.nvcc import KERNELS, compile_all

VARIANTS = {"stamped": ["-DUCCL_MOE_STAMP_GATHER"],
            "wait_all": ["-DUCCL_MOE_STAMP_GATHER", "-DUCCL_MOE_STAMP_WAIT_ALL"]}


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_stamped_gather_compiles(tmp_path: Path) -> None:
    compile_all({name: ("dispatch_ce.cu", extra) for name, extra in VARIANTS.items()}, tmp_path)


def test_only_the_gather_is_stamped() -> None:
    """The stamps' hooks are in dispatch_ce.cu alone (another file's would need a compile check here)."""
    stamped = {p.name for p in KERNELS.glob("*.cu") if "UCCL_MOE_STAMP(" in p.read_text()}
    assert stamped == {"dispatch_ce.cu"}, stamped
