"""native/bench/probes/nvlink_probe.cu (the NVLink push/pull/copy-engine ceiling probe run on the device machines)
compiles."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

PROBE = Path(__file__).resolve().parents[2] / "native" / "bench" / "probes" / "nvlink_probe.cu"


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_nvlink_probe_compiles(tmp_path: Path) -> None:
    out = tmp_path / "nvlink_probe"
    cmd = ["nvcc", "-O3", "-arch=sm_90", "-std=c++17", "-o", str(out), str(PROBE)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    assert out.stat().st_size > 0
