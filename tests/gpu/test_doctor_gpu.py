"""`uccl-moe doctor` on a real GPU host: torch's PCI bus ids are the ones the NIC choice reads from sysfs, and
`doctor --pair` runs with the rank's GPU identity (over loopback where the host has no RDMA devices)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.mp import free_port

from uccl_moe import _C
from uccl_moe import doctor as doc

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]
ROOT = Path(__file__).resolve().parents[2]


def test_torch_gpus_are_the_sysfs_gpus() -> None:
    rep = doc.collect("/sys")
    assert rep["gpus_from"] == "torch" and len(rep["gpus"]) == torch.cuda.device_count()
    sysfs = {g["pci_addr"] for g in _C.nic_sysfs("/sys")["gpus"]}
    for g in rep["gpus"]:
        bus = _C.normalize_pci_bus_id(g["pci_bus_id"])
        assert bus in sysfs, f"GPU {g} not among the sysfs GPUs {sorted(sysfs)} (class/vendor filter)"
        assert Path(f"/sys/bus/pci/devices/{bus}").exists()
    for r in rep["local_ranks"]:
        assert r["gpu"] == rep["gpus"][r["local_rank"]]["pci_bus_id"]
        if rep["rdma_devices"]:
            assert r["nic"], r


def test_pair_with_gpu_identity() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCCL_MOE_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    n = min(2, torch.cuda.device_count())
    if n < 2:
        pytest.skip("needs 2 GPUs")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           "-m", "uccl_moe.cli", "doctor", "--pair", "--json", "--bytes", "1048576", "--iters", "16"]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    assert '"ok": false' not in p.stdout
