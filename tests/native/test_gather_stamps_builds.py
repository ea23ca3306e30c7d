"""The stamped build of the copy-engine dispatch's gather (-DUCCL_MOE_STAMP_GATHER, with and without
-DUCCL_MOE_STAMP_WAIT_ALL: gather_stamps.cuh; run only on the device machines, tools/device/gather_stamps.py) still
compiles: the stamps sit inside the kernel and would rot unseen, since the shipped build compiles them out."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
KERNELS = ROOT / "native" / "src" / "kernels" / "intranode"
VARIANTS = {"stamped": ["-DUCCL_MOE_STAMP_GATHER"],
            "wait_all": ["-DUCCL_MOE_STAMP_GATHER", "-DUCCL_MOE_STAMP_WAIT_ALL"]}


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_stamped_gather_compiles(tmp_path: Path) -> None:
    flags = ["-DUCCL_MOE_WITH_CUDA=1", "-DUCCL_MOE_WITH_INTRANODE_KERNELS=1", f"-I{ROOT / 'native' / 'include'}",
             f"-I{ROOT / 'uccl_moe'}", "-O3", "-DNDEBUG", "--generate-code=arch=compute_90,code=sm_90", "-std=c++17",
             "-x", "cu", "-c"]
    procs = {name: subprocess.Popen(["nvcc", *flags, *extra, str(KERNELS / "dispatch_ce.cu"), "-o",
                                     str(tmp_path / f"{name}.o")],
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for name, extra in VARIANTS.items()}
    for name, proc in procs.items():
        out, _ = proc.communicate(timeout=900)
        assert proc.returncode == 0, f"{name}:\n{out[-4000:]}"
        assert (tmp_path / f"{name}.o").stat().st_size > 0


def test_only_the_gather_is_stamped() -> None:
    """The stamps' hooks are in dispatch_ce.cu alone (another file's would need a compile check here)."""
    stamped = {p.name for p in KERNELS.glob("*.cu") if "UCCL_MOE_STAMP(" in p.read_text()}
    assert stamped == {"dispatch_ce.cu"}, stamped
