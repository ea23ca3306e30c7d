"""STYLE R16: all CUDA/HIP differences live in platform.cuh (plus compiler detection in compiler.hpp).

Fails on HIP/CUDA platform macros, inline assembly or vendor intrinsics anywhere else under native/, and checks
that the GPU sources compile for ROCm with hipcc when it is installed (CI installs Debian's hipcc).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NATIVE = ROOT / "native"
SEAM = {NATIVE / "include/uccl_moe/platform.cuh", NATIVE / "include/uccl_moe/compiler.hpp"}
#: CUDA-only device probes run by hand on the device machines (measure NVLink/PTX paths; never built into the library).
PROBES = NATIVE / "bench" / "probes"
PLATFORM_MACROS = re.compile(r"__HIP_PLATFORM_AMD__|__HIP_DEVICE_COMPILE__|__HIPCC__|__CUDACC__|__CUDA_ARCH__")
GPU_INTRINSICS = re.compile(r"\basm\s*(volatile\s*)?\(|__builtin_amdgcn|__shfl|__ballot|__syncwarp|__activemask|"
                            r"__hip_atomic|atomicAdd_system|__nanosleep")


def _sources(exts: tuple[str, ...]) -> list[Path]:
    return [p for p in NATIVE.rglob("*") if p.suffix in exts and p not in SEAM and "build" not in p.parts
            and PROBES not in p.parents]


def test_platform_macros_only_in_the_seam():
    bad = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}" for p in _sources((".cu", ".cuh", ".hpp", ".cc", ".h"))
           for i, line in enumerate(p.read_text().splitlines(), 1) if PLATFORM_MACROS.search(line)]
    assert not bad, "CUDA/HIP platform macros outside platform.cuh/compiler.hpp:\n" + "\n".join(bad)


def test_gpu_intrinsics_only_in_the_seam():
    bad = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}" for p in _sources((".cu", ".cuh"))
           for i, line in enumerate(p.read_text().splitlines(), 1) if GPU_INTRINSICS.search(line)]
    assert not bad, "inline PTX or vendor intrinsics outside platform.cuh:\n" + "\n".join(bad)


def test_seam_detector_catches_a_violation(tmp_path):
    line = "#if defined(__HIP_PLATFORM_AMD__)"
    assert PLATFORM_MACROS.search(line) and GPU_INTRINSICS.search('asm volatile("membar.sys;");')


GPU_SOURCES = sorted((NATIVE / "src").glob("kernels/*/*.cu")) + sorted((NATIVE / "src").glob("runtime/*.cu")) + \
    [NATIVE / "src/core/device_wait.cu", NATIVE / "bench/fifo_gpu_bench.cu"]


@pytest.mark.skipif(shutil.which("hipcc") is None, reason="hipcc not installed (CI installs Debian's hipcc)")
@pytest.mark.parametrize("src", GPU_SOURCES, ids=lambda p: str(p.relative_to(NATIVE)))
def test_gpu_sources_compile_for_rocm(src: Path, tmp_path: Path):
    # Debian's hipcc (HIP 5.2, clang 15) cannot target gfx942 (MI300X); gfx90a (MI200) is the newest it knows,
    # and exercises the same 64-wide wavefront paths.
    cmd = ["hipcc", "-x", "hip", "--offload-arch=gfx90a", "-std=c++17", "-O1", f"-I{NATIVE / 'include'}",
           f"-I{ROOT / 'uccl_moe'}", "-DUCCL_MOE_WITH_HIP=1", "-c", str(src), "-o", str(tmp_path / "out.o")]
    out = subprocess.run(cmd, capture_output=True, text=True, env={"HIP_PLATFORM": "amd", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, f"{' '.join(cmd)}\n{out.stderr[-4000:]}"
