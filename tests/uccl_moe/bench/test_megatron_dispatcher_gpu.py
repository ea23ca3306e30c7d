"""The Megatron dispatcher benchmark on 2 GPUs (uccl native, alltoall, flex over the deep_ep shim), small shapes."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.requires import missing

pytestmark = [pytest.mark.gpu, pytest.mark.mp, pytest.mark.timeout(600),
              pytest.mark.skipif(missing("megatron.core") is not None, reason=missing("megatron.core") or "")]


def test_every_dispatcher_on_two_gpus(tmp_path) -> None:
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    from uccl_moe.bench.megatron_dispatcher import main

    path = tmp_path / "md.json"
    assert main(["--ranks", "2", "--tokens", "512", "--hidden", "2048", "--experts", "16", "--json", str(path)]) == 0
    rows = json.loads(path.read_text())["dispatchers"]
    assert [r["dispatcher"] for r in rows] == ["uccl", "alltoall", "flex"]
    for r in rows:
        assert r["total_us"] > 0 and r["fwd_err"] <= 2e-2 and r["bwd_err"] <= 2e-2, r
