"""The bench's default mode end to end on 2 GPUs: the API defaults path, NCCL on the same rows, both ceilings."""

from __future__ import annotations

import json

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.mp, pytest.mark.timeout(600)]


def test_default_mode_on_two_gpus(tmp_path) -> None:
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    from uccl_moe.bench.__main__ import main

    path = tmp_path / "bench.json"
    assert main(["--ranks", "2", "--tokens", "1024", "--iters", "20", "--warmup", "2", "--json", str(path),
                 "--png", ""]) == 0
    data = json.loads(path.read_text())
    assert data["mode"] == "api" and data["peer_copy_GBps"] > 0 and data["sm_push_GBps"] > 0
    assert all(r["scales"] == "col" and r["config_passed"] is False for r in data["rows"])
    assert [e["op"] for e in data["ops"]] == ["dispatch fp8", "dispatch bf16", "combine"]
    for e in data["ops"]:
        assert e["ours_us"] > 0 and e["nccl_us"] > 0 and e["speedup"] > 0 and e["ours_host_us"] > 0, e
    assert [len(data["host"][k]) for k in ("start", "end")] == [2, 2]
    assert all(s["loop_us"] > 0 for k in ("start", "end") for s in data["host"][k]), data["host"]


def test_bound_ranks_run_on_their_cores(tmp_path) -> None:
    import os

    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 4:
        pytest.skip("needs 4 cores to give each rank two")
    from uccl_moe.bench.__main__ import main

    groups = [cores[-4:-2], cores[-2:]]
    path = tmp_path / "bench.json"
    assert main(["--ranks", "2", "--tokens", "512", "--dtypes", "bf16", "--iters", "20", "--warmup", "2",
                 "--bind-cores", "/".join(",".join(map(str, g)) for g in groups), "--json", str(path),
                 "--png", ""]) == 0
    data = json.loads(path.read_text())
    for k in ("start", "end"):
        assert [s["cpu"] in g for s, g in zip(data["host"][k], groups)] == [True, True], data["host"]
