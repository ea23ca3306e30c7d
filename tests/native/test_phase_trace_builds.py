"""The traced build of the intranode kernels (-DUCCL_MOE_TRACE_DISPATCH, phase_trace.cuh; run only by
tools/device/device_2gpu.sh's `trace` stage on the device machines) still compiles: the trace points sit inside the
kernels and would rot unseen, since the shipped build compiles them out."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
KERNELS = ROOT / "native" / "src" / "kernels" / "intranode"
TRACED = ("dispatch.cu", "combine.cu", "combine_pull.cu")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_traced_kernels_compile(tmp_path: Path) -> None:
    flags = ["-DUCCL_MOE_TRACE_DISPATCH", "-DUCCL_MOE_WITH_CUDA=1", "-DUCCL_MOE_WITH_INTRANODE_KERNELS=1",
             f"-I{ROOT / 'native' / 'include'}", f"-I{ROOT / 'uccl_moe'}", "-O3", "-DNDEBUG",
             "--generate-code=arch=compute_90,code=sm_90", "-std=c++17", "-x", "cu", "-c"]
    procs = {name: subprocess.Popen(["nvcc", *flags, str(KERNELS / name), "-o", str(tmp_path / f"{name}.o")],
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for name in TRACED}
    for name, proc in procs.items():
        out, _ = proc.communicate(timeout=900)
        assert proc.returncode == 0, f"{name}:\n{out[-4000:]}"
        assert (tmp_path / f"{name}.o").stat().st_size > 0


def test_every_traced_kernel_file_is_compiled_here() -> None:
    """Each kernel file with trace points is in TRACED (a new one must be added to the compile check)."""
    traced = {p.name for p in KERNELS.glob("*.cu") if "UCCL_MOE_TRACE(" in p.read_text()}
    assert traced == set(TRACED), traced
