"""The standalone probes run on the device machines compile: native/bench/probes/nvlink_probe.cu (the NVLink
push/pull/copy-engine ceilings), combine_pull_probe.cu (combine designs: SM pull, SM push, copy engines),
call_cost_probe.cu (the host cost of the CUDA calls a copy-engine op makes) and landing_poll_probe.cu (a landing
area polled for a sentinel against chunk flags)."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

PROBES = Path(__file__).resolve().parents[2] / "native" / "bench" / "probes"


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
@pytest.mark.parametrize("probe", ["nvlink_probe", "combine_pull_probe", "call_cost_probe",
                                   "landing_poll_probe"])
def test_probe_compiles(tmp_path: Path, probe: str) -> None:
    out = tmp_path / probe
    include = PROBES.parents[1] / "include"
    cmd = ["nvcc", "-O3", "-arch=sm_90", "-std=c++17", f"-I{include}", "-o", str(out), str(PROBES / f"{probe}.cu")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    assert out.stat().st_size > 0
