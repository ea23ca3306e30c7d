"""The uccl-moe CLI: subcommand registry, --dry-run, usage errors exit 2 naming the key or rule."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers.requires import missing

from uccl_moe import cli
from uccl_moe.errors import InvalidUsageError

ROOT = Path(__file__).resolve().parents[2]
needs_hydra = pytest.mark.skipif(missing("omegaconf") is not None, reason=str(missing("omegaconf")))


@needs_hydra
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


@needs_hydra
def test_train_dry_run_prints_env_and_command(capsys):
    assert cli.main(["train", "recipe=tiny_cpu_moe", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "UCCL_MOE_BACKEND=reference" in out and "GLOO_SOCKET_IFNAME=lo" in out
    assert "-m torch.distributed.run --nproc-per-node=2 --standalone -m uccl_moe.train.train_gpt" in out
    assert "--moe-token-dispatcher-type uccl" in out and "--distributed-backend gloo" in out
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in out  # CPU: no hardware queues to choose
    assert cli.main(["train", "recipe=dsv3_proxy_local", "parallel.tensor_model_parallel_size=2",
                     "parallel.sequence_parallel=true", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "CUDA_DEVICE_MAX_CONNECTIONS=1\n" in out and "# CUDA_DEVICE_MAX_CONNECTIONS set to 1: TP 2, CP 1" in out


@needs_hydra
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


@needs_hydra
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


@needs_hydra
def test_overrides_may_follow_options(capsys):
    assert cli.main(["train", "--dry-run", "recipe=tiny_cpu_moe", "--quiet", "train.train_iters=7"]) == 0
    assert "--train-iters 7" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.main(["train", "recipe=tiny_cpu_moe", "--no-such-option"])
    with pytest.raises(SystemExit):
        cli.main(["render-recipes", "recipe=tiny_cpu_moe"])  # takes no overrides


# ------------------------------------------------------------------------------ the base install (no extras)

_BLOCK_EXTRAS = textwrap.dedent("""
    import importlib.abc, sys
    class Block(importlib.abc.MetaPathFinder):
        # the base install: none of the extras' packages can be imported
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("torch", "omegaconf", "hydra", "megatron", "matplotlib", "yaml"):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None
    sys.meta_path.insert(0, Block())
    from uccl_moe.cli import main
    try:
        rc = main(sys.argv[1:])
    except SystemExit as e:  # argparse's --help and --version
        rc = e.code
    loaded = sorted(m for m in ("torch", "omegaconf", "hydra") if m in sys.modules)
    print("LOADED", loaded, file=sys.stderr)
    sys.exit(rc)
""")


def _cli_without_extras(*argv: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", _BLOCK_EXTRAS, *argv], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120, check=False)


def test_help_and_version_work_without_the_extras():
    r = _cli_without_extras("--help")
    assert r.returncode == 0, r.stderr
    for name in cli.SUBCOMMANDS:
        assert name in r.stdout
    assert "LOADED []" in r.stderr  # nothing of torch, Hydra or OmegaConf was imported
    r = _cli_without_extras("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"uccl-moe {cli.__version__}", r.stdout + r.stderr


@pytest.mark.parametrize("argv", [["train", "recipe=tiny_cpu_moe"], ["slurm", "recipe=tiny_cpu_moe"],
                                  ["train", "--help"]])
def test_a_subcommand_that_needs_an_extra_says_which_in_one_line(argv):
    r = _cli_without_extras(*argv)
    assert r.returncode == 2, r.stdout + r.stderr
    err = [line for line in r.stderr.splitlines() if not line.startswith("LOADED")]
    assert len(err) == 1 and "Traceback" not in r.stderr, r.stderr
    assert f"uccl-moe {argv[0]}: error: needs the Python package" in err[0]
    assert 'pip install "uccl-moe[train]"' in err[0] and 'pip install -e ".[train]"' in err[0]


def test_a_missing_extra_at_run_time_is_one_line(monkeypatch, capsys):
    monkeypatch.setattr(cli, "_REGISTRY", dict(cli._REGISTRY))

    @cli.subcommand("needs-plot", "imports matplotlib as it runs")
    def run(ns: argparse.Namespace) -> int:
        raise ModuleNotFoundError("No module named 'matplotlib'", name="matplotlib")

    assert cli.main(["needs-plot"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ['uccl-moe needs-plot: error: needs the Python package \'matplotlib\' (extra \'test\'): '
                   'pip install "uccl-moe[test]" (from a checkout: pip install -e ".[test]")']


def test_an_unrelated_missing_module_is_not_disguised(monkeypatch):
    monkeypatch.setattr(cli, "_REGISTRY", dict(cli._REGISTRY))

    @cli.subcommand("broken", "imports a module that is no extra's")
    def run(ns: argparse.Namespace) -> int:
        raise ModuleNotFoundError("No module named 'no_such_mod'", name="no_such_mod")

    with pytest.raises(ModuleNotFoundError):
        cli.main(["broken"])


# --------------------------------------------------------------------- validation before launch: short errors


def _short_error(capsys, argv: list[str]) -> str:
    assert cli.main(argv) == 2
    cap = capsys.readouterr()
    err = cap.err.strip()
    lines = err.splitlines()
    assert 1 <= len(lines) <= 5, err  # nothing before the error either (the summary prints once checks pass)
    assert "Traceback" not in err and "$VALUE" not in err and "full_key" not in err, err
    assert lines[0].startswith(f"uccl-moe {argv[0]}: error: "), err
    return err


@needs_hydra
@pytest.mark.parametrize(
    "override, needles",
    [
        ("model.hidden_size=-64", ["model.hidden_size=-64", ">= 1", "rule 'ranges'"]),
        ("model.hidden_size=66", ["model.hidden_size=66", "rule 'uccl_hidden_alignment'", "multiple of 4"]),
        ("model.vocab_size=0", ["model.vocab_size=0", ">= 1"]),
        ("train.lr=-1", ["train.lr=-1.0", ">= 0"]),
        ("train.train_iters=0", ["train.train_iters=0", ">= 1"]),
        ("model.hidden_dropout=1.5", ["model.hidden_dropout=1.5", "< 1"]),
        ("train.min_lr=1", ["rule 'lr_schedule'", "train.min_lr=1.0"]),
        ("+parallel.foo=1", ["unknown key 'parallel.foo'", "+parallel.foo=1", "fix: remove it"]),
        ("+parallel.micro_batch_sise=2", ["unknown key 'parallel.micro_batch_sise'",
                                          "did you mean 'parallel.micro_batch_size'"]),
        ("parallel.expert_model_paralel_size=2", ["did you mean 'parallel.expert_model_parallel_size'"]),
        ("nodez=2", ["unknown key 'nodez'", "did you mean 'nodes'"]),
        ("platform.env.CUDA_DEVICE_MAX_CONNECTIONS=8", ["'platform.env' is a map",
                                                       "fix: +platform.env.CUDA_DEVICE_MAX_CONNECTIONS=8"]),
        ("model.hidden_size=abc", ["model.hidden_size=abc is not a whole number", "fix:"]),
        ("parallel.micro_batch_size=1.5", ["parallel.micro_batch_size=1.5 is not a whole number"]),
        ("platform.bf16=maybe", ["platform.bf16=maybe is not true or false"]),
        ("train.lr_decay_style=cosin", ["did you mean 'train.lr_decay_style=cosine'", "choose one of constant"]),
        ("dispatcher=alltoal", ["group 'dispatcher' has no option 'alltoal'", "did you mean 'alltoall'"]),
        ("recipe=tiny_cpu_mo", ["did you mean 'tiny_cpu_moe'"]),
    ],
)
def test_bad_values_are_refused_before_launch_in_five_lines(override, needles, capsys, monkeypatch):
    launched = []
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: launched.append(a))
    err = _short_error(capsys, ["train", "recipe=tiny_cpu_moe", override])
    for needle in needles:
        assert needle in err, err
    assert not launched


@needs_hydra
@pytest.mark.parametrize("dry_run", [True, False])
def test_a_bad_knob_in_the_environment_is_refused_at_launch(dry_run, capsys, monkeypatch):
    monkeypatch.setenv("UCCL_MOE_TIMEOUT_S", "abc")
    launched = []
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: launched.append(a))
    err = _short_error(capsys, ["train", "recipe=tiny_cpu_moe", *(["--dry-run"] if dry_run else [])])
    assert 'UCCL_MOE_TIMEOUT_S="abc" is invalid: expected a number' in err and "uccl-moe env" in err
    assert not launched


@needs_hydra
@pytest.mark.parametrize("version, needle", [(None, "Megatron-Core is not installed"),
                                             ("0.12.0", "megatron-core 0.12.0 is installed but uccl-moe supports"),
                                             ("0.20.1", "megatron-core 0.20.1 is installed but uccl-moe supports")])
def test_megatron_missing_or_unsupported_is_one_line_before_torchrun(version, needle, capsys, monkeypatch, tmp_path):
    from uccl_moe.launch import preflight

    monkeypatch.setattr(preflight, "megatron_version", lambda: version)
    launched = []
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: launched.append(a))
    err = _short_error(capsys, ["train", "recipe=tiny_cpu_moe", "--run-dir", str(tmp_path / "r")])
    assert needle in err and "megatron-core==0.16.1" in err and len(err.splitlines()) == 1, err
    assert not launched and not (tmp_path / "r").exists()


@needs_hydra
def test_train_prints_a_short_summary_not_the_whole_config(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(subprocess, "run", lambda cmd, **k: subprocess.CompletedProcess(cmd, 0))
    assert cli.main(["train", "recipe=tiny_cpu_moe", "--run-dir", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert "recipe tiny_cpu_moe: dispatcher=uccl model=tiny_moe" in err
    assert "model tiny_moe: 3 layers, hidden 64, 8 experts top-2" in err and "4 steps of 8 x 64 tokens" in err
    assert "moe_router_bias_update_rate" not in err and len(err.splitlines()) < 15, err  # no config dump
    assert "moe_router_bias_update_rate" in (tmp_path / "config.yaml").read_text()  # it is in the run dir
    assert "--log-dir " + str(tmp_path / "logs") in (tmp_path / "command.sh").read_text()
    assert "run finished after" in err and "launching 2 rank(s)" in err
    assert cli.main(["train", "recipe=tiny_cpu_moe", "--run-dir", str(tmp_path), "--show-config"]) == 0
    assert "moe_router_bias_update_rate" in capsys.readouterr().err
