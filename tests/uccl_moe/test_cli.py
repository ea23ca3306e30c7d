"""The uccl-moe CLI: subcommand registry, --dry-run, usage errors exit 2 naming the key or rule."""

from __future__ import annotations

import argparse

import pytest

from uccl_moe import cli
from uccl_moe.errors import InvalidUsageError


def test_builtin_subcommands_are_registered():
    cli.load_subcommands()
    assert {"train", "slurm", "primus", "render-recipes"} <= set(cli.registered())
    help_text = cli.build_parser().format_help()
    for name in ("train", "slurm", "primus", "render-recipes"):
        assert name in help_text


def test_a_new_subcommand_plugs_in_without_touching_main(monkeypatch, capsys):
    monkeypatch.setattr(cli, "_REGISTRY", dict(cli._REGISTRY))

    def args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--size", type=int, default=1)

    @cli.subcommand("bench-test", "a test subcommand", args)
    def bench(ns: argparse.Namespace) -> int:
        print(f"bench size={ns.size}")
        return 7

    assert cli.main(["bench-test", "--size", "3"]) == 7
    assert "bench size=3" in capsys.readouterr().out
    with pytest.raises(InvalidUsageError, match="registered twice"):
        cli.subcommand("bench-test", "other")(lambda ns: 0)


def test_train_dry_run_prints_env_and_command(capsys):
    assert cli.main(["train", "recipe=tiny_cpu_moe", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "UCCL_MOE_BACKEND=reference" in out and "GLOO_SOCKET_IFNAME=lo" in out
    assert "-m torch.distributed.run --nproc-per-node=2 --standalone -m uccl_moe.megatron.train_gpt" in out
    assert "--moe-token-dispatcher-type uccl" in out and "--distributed-backend gloo" in out


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["train", "recipe=tiny_cpu_moe", "parallel.expert_model_paralel_size=2", "--dry-run"],
         "parallel.expert_model_paralel_size"),
        (["train", "recipe=tiny_cpu_moe", "parallel.expert_model_parallel_size=3", "--dry-run"],
         "rule 'experts_divisible_by_ep'"),
        (["train", "recipe=tiny_cpu_moe", "dispatcher=uccl,alltoall", "--dry-run"], "sweep"),
        (["primus", "recipe=tiny_cpu_moe", "nodes=1,2"], "sweep"),
    ],
)
def test_usage_errors_exit_2_with_the_reason(argv, needle, capsys):
    assert cli.main(argv) == 2
    assert needle in capsys.readouterr().err


def test_train_checks_gpus_then_launches_with_the_env(monkeypatch, tmp_path, capsys):
    import subprocess

    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert cli.main(["train", "recipe=dsv3_proxy_local", "--quiet", "--run-dir", str(tmp_path)]) == 2
    assert "has 2 GPU(s)" in capsys.readouterr().err  # the platform wants 4

    calls = []

    def fake_run(cmd, env=None, **kw):
        calls.append((cmd, env))
        return subprocess.CompletedProcess(cmd, 5)

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(subprocess, "run", fake_run)
    assert cli.main(["train", "recipe=dsv3_proxy_local", "--quiet", "--run-dir", str(tmp_path)]) == 5  # child's rc
    (cmd, env), = calls
    assert "--nproc-per-node=4" in cmd and env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert (tmp_path / "config.yaml").is_file() and "torch.distributed.run" in (tmp_path / "command.sh").read_text()


def test_overrides_may_follow_options(capsys):
    assert cli.main(["train", "--dry-run", "recipe=tiny_cpu_moe", "--quiet", "train.train_iters=7"]) == 0
    assert "--train-iters 7" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.main(["train", "recipe=tiny_cpu_moe", "--no-such-option"])
    with pytest.raises(SystemExit):
        cli.main(["render-recipes", "recipe=tiny_cpu_moe"])  # takes no overrides
