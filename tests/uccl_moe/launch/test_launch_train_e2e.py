"""End to end on CPU: `uccl-moe train recipe=tiny_cpu_moe platform=cpu` runs real optimizer steps (2 gloo ranks,
EP=2, the uccl dispatcher on the reference backend) through torchrun and the default entry
``uccl_moe.train.train_gpt``.

The entry comes from the Megatron-integration branch (issue 3). Until both branches are merged this test FAILS
(on purpose: a skip would hide that the main CPU job is not proven)."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.requires import require

require("omegaconf")
require("megatron.core")

ROOT = Path(__file__).resolve().parents[3]


def _has(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


@pytest.mark.mp
@pytest.mark.timeout(600)
def test_uccl_moe_train_tiny_cpu_moe_runs_real_steps(tmp_path: Path):
    if not _has("uccl_moe.train.train_gpt"):
        pytest.fail("uccl_moe.train.train_gpt is not importable: the training entry comes from the "
                    "Megatron-integration branch (issue 3); merge it, then this test runs the CPU training job")
    loss_log = tmp_path / "loss.jsonl"
    cmd = [sys.executable, "-m", "uccl_moe.cli", "train", "recipe=tiny_cpu_moe", "platform=cpu", "--quiet",
           "--run-dir", str(tmp_path / "run"), f"train.extra_args=['--loss-log','{loss_log}']"]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=540, check=False)
    wall = time.monotonic() - t0
    assert proc.returncode == 0, f"uccl-moe train failed (rc {proc.returncode}):\n{proc.stdout[-4000:]}\n" \
                                 f"{proc.stderr[-6000:]}"
    steps = [json.loads(line) for line in loss_log.read_text().splitlines() if line.strip()]
    assert len(steps) == 4, steps  # train/smoke.yaml: train_iters 4
    losses = [s["loss"] for s in steps]
    assert all(math.isfinite(x) and x > 0 for x in losses), losses
    run = tmp_path / "run"
    assert (run / "config.yaml").is_file() and (run / "command.sh").is_file()
    # the run tells its story: progress from the start, one log per rank, a closing summary with the versions
    out = proc.stdout + proc.stderr
    assert "building the model: 3 layers, hidden 64" in out and "step 1 of 4" in out, out[-4000:]
    assert "[train_gpt] done: 4 steps in" in out and "lm loss " in out and "tokens/s" in out, out[-4000:]
    assert "versions: uccl-moe " in out and "megatron-core " in out and "devices: CPU" in out, out[-4000:]
    assert "Transformer Engine and Apex are not installed" not in out  # CPU runs silence Megatron's TE/Apex notes
    logs = run / "logs"
    rank0 = (logs / "rank0.log").read_text()
    assert "[train_gpt] iteration 4/4" in rank0 and "[train_gpt] done: 4 steps" in rank0, rank0[-2000:]
    assert "done: 4 steps" not in (logs / "rank1.log").read_text()  # rank 1 has its own log; the summary is rank 0's
    summary = json.loads((logs / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["world_size"] == 2
    assert summary["loss_first"] == pytest.approx(losses[0]) and summary["loss_last"] == pytest.approx(losses[-1])
    assert summary["tokens_per_s"] > 0 and summary["wall_s"] > 0
    assert set(summary["versions"]) >= {"uccl_moe", "torch", "megatron_core", "cuda", "rocm", "devices"}
    print(f"tiny_cpu_moe: 4 steps, losses {losses}, wall {wall:.1f}s")
