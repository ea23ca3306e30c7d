"""sbatch rendering: valid bash (bash -n, shellcheck), the Slurm shape, the platform env, provenance; sweeps."""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

import pytest
from helpers.requires import require

require("omegaconf")

from uccl_moe.cli import main
from uccl_moe.config import available, compose, validate
from uccl_moe.launch.commands import default_run_dir, summary_text
from uccl_moe.launch.megatron_args import launch_env, megatron_argv
from uccl_moe.launch.slurm import render_sbatch

CASES = [[f"recipe={r}"] for r in available("recipe")] + [
    ["recipe=dsv3_h200_efa_4n", "dispatcher=alltoall"],
    ["recipe=dsv3_mi300x_broadcom_16n", "slurm.partition=gpu", "slurm.account=proj",
     "slurm.setup=['module load rocm','export HF_HOME=/scratch/hf']", "slurm.sbatch_args=['--constraint=mi300x']"],
]


@pytest.mark.parametrize("overrides", CASES, ids=lambda o: " ".join(o))
def test_sbatch_is_valid_bash_and_has_the_slurm_shape(overrides, tmp_path: Path, lint_bash):
    cfg = compose(overrides)
    text = render_sbatch(cfg, summary_text(validate(cfg, warn=False)))
    path = tmp_path / "job.sbatch"
    path.write_text(text)
    lint_bash(path)
    lines = text.splitlines()
    assert lines[0] == "#!/bin/bash"
    assert f"#SBATCH --nodes={cfg.nodes}" in lines and "#SBATCH --ntasks-per-node=1" in lines
    assert "#SBATCH --exclusive" in lines
    if cfg.platform.cpus_per_node:
        assert f"#SBATCH --cpus-per-task={cfg.platform.cpus_per_node}" in lines
    if cfg.platform.accelerator.name != "cpu":
        assert f"#SBATCH --gpus-per-node={cfg.platform.gpus_per_node}" in lines
    assert 'MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"' in lines
    assert '--node-rank="$SLURM_NODEID"' in text and f"--nproc-per-node={cfg.platform.gpus_per_node}" in text
    # every #SBATCH line comes before the first command (sbatch stops reading options there)
    first_cmd = next(i for i, x in enumerate(lines) if x and not x.startswith("#"))
    assert all(i < first_cmd for i, x in enumerate(lines) if x.startswith("#SBATCH"))
    # provenance
    assert f"# Rendered by uccl-moe from recipe '{cfg.meta.recipe}' (dispatcher {cfg.dispatcher.name})" in text
    assert "# overrides: " + shlex.join(overrides) in text  # copy-pasteable
    assert "# regenerate: uccl-moe slurm " in text
    for k in launch_env(cfg):
        assert f"export {k}=" in text
    if "slurm.partition=gpu" in overrides:
        assert "#SBATCH --partition=gpu" in lines and "#SBATCH --account=proj" in lines
        assert "#SBATCH --constraint=mi300x" in lines and "module load rocm" in lines


def test_sbatch_arguments_round_trip_through_bash(tmp_path: Path):
    """The MEGATRON_ARGS array expands to exactly the rendered argv (quoting survives bash)."""
    cfg = compose(["recipe=tiny_cpu_moe"])
    text = render_sbatch(cfg)
    start = text.index("MEGATRON_ARGS=(")
    block = text[start: text.index(")\n", start) + 2]
    script = tmp_path / "args.sh"
    script.write_text(block + 'printf "%s\\n" "${MEGATRON_ARGS[@]}"\n')
    out = subprocess.run(["bash", str(script)], capture_output=True, text=True, check=True).stdout.splitlines()
    assert out == megatron_argv(cfg)


def test_slurm_command_writes_scripts_and_sweeps(tmp_path: Path, capsys):
    assert main(["slurm", "recipe=dsv3_h200_efa_4n", "--run-dir", str(tmp_path / "one"), "--quiet"]) == 0
    assert (tmp_path / "one" / "job.sbatch").is_file() and (tmp_path / "one" / "config.yaml").is_file()
    assert main(["slurm", "recipe=dsv3_h200_efa_4n", "dispatcher=uccl,alltoall", "--run-dir",
                 str(tmp_path / "sweep"), "--quiet"]) == 0
    scripts = sorted((tmp_path / "sweep").glob("*/job.sbatch"))
    assert [s.parent.name for s in scripts] == ["000", "001"]
    assert "dispatcher-type uccl" in scripts[0].read_text().replace("--moe-token-", "")
    assert "--moe-token-dispatcher-type alltoall" in scripts[1].read_text()


def test_submit_without_sbatch_is_a_clear_error(tmp_path: Path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch here
    rc = main(["slurm", "recipe=tiny_cpu_moe", "--run-dir", str(tmp_path / "r"), "--quiet", "--submit"])
    assert rc == 2
    assert "sbatch" in capsys.readouterr().err


def test_submit_calls_sbatch(tmp_path: Path, monkeypatch, capsys):
    fake = tmp_path / "bin" / "sbatch"
    fake.parent.mkdir()
    fake.write_text('#!/bin/bash\necho "Submitted batch job 42 ($1)"\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:/usr/bin:/bin")
    assert main(["slurm", "recipe=tiny_cpu_moe", "--run-dir", str(tmp_path / "r"), "--quiet", "--submit"]) == 0
    assert "Submitted batch job 42" in capsys.readouterr().out


@pytest.mark.parametrize("recipe", ["dsv3_h200_efa_4n", "dsv3_mi300x_broadcom_16n"])
def test_preflight_step_renders_before_training(recipe: str, tmp_path: Path, lint_bash):
    """slurm.preflight=true adds `uccl-moe doctor --pair` on every rank before the training srun; off by default."""
    assert "doctor --pair" not in render_sbatch(compose([f"recipe={recipe}"]))
    cfg = compose([f"recipe={recipe}", "slurm.preflight=true"])
    text = render_sbatch(cfg)
    path = tmp_path / "job.sbatch"
    path.write_text(text)
    lint_bash(path)
    pre = text.index("-m uccl_moe.cli doctor --pair")
    train = text.index("MEGATRON_ARGS=(")
    assert pre < train
    step = text[text.rindex("srun ", 0, pre): pre]
    assert '--nnodes="$SLURM_NNODES"' in step and f"--nproc-per-node={cfg.platform.gpus_per_node}" in step
    assert '--master-port="$((MASTER_PORT + 1))"' in step and "--kill-on-bad-exit=1" in step
    assert "\nexport " in text and text.rindex("\nexport ") < pre  # the platform env applies to the self-test


def test_the_default_run_dir_names_the_recipe_or_default(tmp_path: Path) -> None:
    """runs/<recipe>/<time>; without a recipe (the config's defaults: the tiny CPU model) runs/default/<time>, not
    runs/None; an explicit base wins."""
    assert default_run_dir(compose(["recipe=tiny_cpu_moe"]), None).parts[:2] == ("runs", "tiny_cpu_moe")
    d = default_run_dir(compose([]), None, "x")
    assert d.parts[:2] == ("runs", "default") and d.name.endswith("-x")
    assert default_run_dir(compose([]), tmp_path, "x") == tmp_path / "x"
