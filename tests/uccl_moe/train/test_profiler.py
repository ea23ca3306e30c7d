"""train_gpt's ``--profile`` (Megatron-LM's flags, torch.profiler) and ``--log-cpu``, on CPU: the recorded iteration
window, the trace file per profiled rank, and a 2-rank training run with every step statistic on."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("megatron.core", reason='megatron-core is not installed: pip install -e ".[train]"')

from helpers.mp import run_ranks  # noqa: E402

from uccl_moe.errors import InvalidUsageError  # noqa: E402
from uccl_moe.train.profiler import StepProfiler, check_profile_args, profile_dir  # noqa: E402


def _args(tmp_path: Path, **kw: Any) -> argparse.Namespace:
    base = dict(profile=True, use_pytorch_profiler=False, profile_step_start=2, profile_step_end=4, profile_ranks=[0],
                profile_dir=str(tmp_path / "prof"), loss_log=None, train_iters=6)
    base.update(kw)
    return argparse.Namespace(**base)


def _run_loop(prof: StepProfiler, iters: int) -> None:
    for it in range(1, iters + 1):
        prof.step()
        with torch.profiler.record_function(f"iteration_{it}"):
            torch.mm(torch.ones(16, 16), torch.ones(16, 16))
    prof.close()


def _recorded(path: Path) -> list[int]:
    events = json.loads(path.read_text())["traceEvents"]
    return sorted({int(e["name"].split("_")[1]) for e in events if str(e.get("name", "")).startswith("iteration_")})


@pytest.mark.parametrize("start,end,iters,expected", [
    (2, 4, 6, [2, 3]),  # Megatron-LM's window: iterations start..end-1
    (1, 3, 3, [1, 2]),  # from the first iteration (no warm-up step before it)
    (3, 9, 5, [3, 4, 5]),  # end past the last iteration: written when the loop closes
])
def test_window_and_trace_file(tmp_path: Path, capsys, start: int, end: int, iters: int, expected: list[int]):
    prof = StepProfiler(_args(tmp_path, profile_step_start=start, profile_step_end=end, train_iters=iters), 0,
                        torch.device("cpu"))
    _run_loop(prof, iters)
    path = tmp_path / "prof" / "trace_rank0.json"
    assert prof.path == path and _recorded(path) == expected
    assert f"profile of iterations {expected[0]}..{expected[-1]} written to {path}" in capsys.readouterr().out


def test_rank_not_profiled_and_flag_off(tmp_path: Path):
    for prof in (StepProfiler(_args(tmp_path, profile_ranks=[0, 2]), 1, torch.device("cpu")),
                 StepProfiler(_args(tmp_path, profile=False), 0, torch.device("cpu"))):
        assert not prof.enabled and prof.path is None
        _run_loop(prof, 6)
    assert not (tmp_path / "prof").exists()


def test_profile_dir_defaults_and_checks(tmp_path: Path):
    assert profile_dir(_args(tmp_path)) == tmp_path / "prof"
    assert profile_dir(_args(tmp_path, profile_dir=None, loss_log=str(tmp_path / "run" / "steps.jsonl"))) == \
        tmp_path / "run" / "profile"
    assert profile_dir(_args(tmp_path, profile_dir=None)) == Path("profile")
    check_profile_args(_args(tmp_path, profile=False, profile_step_start=9, profile_step_end=1))  # off: not checked
    with pytest.raises(InvalidUsageError, match="need 0 <= start < end"):
        check_profile_args(_args(tmp_path, profile_step_start=4, profile_step_end=4))
    with pytest.raises(InvalidUsageError, match="nothing would be recorded"):
        check_profile_args(_args(tmp_path, train_iters=8, profile_step_start=10, profile_step_end=12))


def test_parser_takes_megatron_profile_flags():
    from uccl_moe.train import train_gpt

    p = train_gpt.build_parser()
    a = p.parse_args(["--profile", "--use-pytorch-profiler", "--profile-step-start", "3", "--profile-step-end", "5",
                      "--profile-ranks", "0", "3", "--profile-dir", "/tmp/p", "--log-cpu"])
    assert (a.profile, a.use_pytorch_profiler, a.profile_step_start, a.profile_step_end) == (True, True, 3, 5)
    assert a.profile_ranks == [0, 3] and a.profile_dir == "/tmp/p" and a.log_cpu is True
    d = p.parse_args([])
    assert (d.profile, d.profile_step_start, d.profile_step_end, d.profile_ranks, d.profile_dir, d.log_cpu) == \
        (False, 10, 12, [0], None, False)


ARGS = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--num-experts", "4",
    "--moe-router-topk", "2", "--expert-model-parallel-size", "2", "--moe-ffn-hidden-size", "32",
    "--moe-router-dtype", "fp32", "--disable-bias-linear", "--seq-length", "16", "--micro-batch-size", "2",
    "--global-batch-size", "8", "--vocab-size", "64", "--train-iters", "4", "--lr", "3e-3",
    "--moe-token-dispatcher-type", "uccl", "--moe-uccl-backend", "reference",
    "--log-cpu", "--log-moe-timing", "--log-memory",
    "--profile", "--use-pytorch-profiler", "--profile-step-start", "2", "--profile-step-end", "4",
]


def _train_rank(rank: int, world: int, loss_log: str) -> list[dict[str, Any]]:
    from megatron.core import parallel_state

    from uccl_moe.train import train_gpt

    rows = train_gpt.train(ARGS + ["--loss-log", loss_log])
    parallel_state.destroy_model_parallel()
    return rows


@pytest.mark.mp
@pytest.mark.timeout(300)
def test_train_gpt_profiles_rank0_and_logs_cpu(tmp_path: Path):
    from uccl_moe.train import timeline

    loss_log = tmp_path / "run" / "steps.jsonl"
    loss_log.parent.mkdir()
    rows = run_ranks(_train_rank, 2, str(loss_log), timeout_s=280)
    for rank_rows in rows:
        assert [r["iteration"] for r in rank_rows] == [1, 2, 3, 4]
        for r in rank_rows:
            assert 0 < r["cpu_s"] < 60 and len(r["dispatch_ms"]) == 2 and all(v > 0 for v in r["dispatch_ms"])
            assert len(r["combine_ms"]) == 2 and all(v > 0 for v in r["combine_ms"])
    logged = [json.loads(line) for line in loss_log.read_text().splitlines()]
    assert [r["iteration"] for r in logged] == [1, 2, 3, 4] and all(r["cpu_s"] > 0 for r in logged)
    # default --profile-ranks 0 and --profile-dir: "profile" next to --loss-log
    traces = sorted(p.name for p in (tmp_path / "run" / "profile").iterdir())
    assert traces == ["trace_rank0.json"]
    trace = json.loads((tmp_path / "run" / "profile" / "trace_rank0.json").read_text())
    steps = {e["name"] for e in trace["traceEvents"] if str(e.get("name", "")).startswith("ProfilerStep#")}
    assert steps == {"ProfilerStep#2", "ProfilerStep#3"}
    names = {e.get("name") for e in trace["traceEvents"]}
    assert "aten::mm" in names or "aten::addmm" in names
    # a CPU trace has no GPU kernels: the timeline reads it and reports nothing
    assert timeline.analyze(timeline.kernels_of(trace))["totals"]["kernels"] == 0
