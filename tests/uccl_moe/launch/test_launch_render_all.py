"""The committed recipes/ folder equals a fresh render of configs/ (drift check)."""

from __future__ import annotations

from pathlib import Path

from helpers.requires import require

require("omegaconf")

import yaml

from uccl_moe.launch.render_all import FILES, HEADLINE, check, default_out, render_all


def test_committed_recipes_match_the_configs():
    problems = check()
    assert not problems, "recipes/ drifted from configs/; run `uccl-moe render-recipes`:\n" + "\n".join(problems)


def test_every_headline_recipe_is_committed_and_lints(lint_bash):
    out = default_out()
    for name, overrides in HEADLINE:
        for f in FILES:
            assert (out / name / f).is_file(), f"recipes/{name}/{f} missing"
        for script in ("job.sbatch", "primus.sbatch"):
            lint_bash(out / name / script)
        exp = yaml.safe_load((out / name / "primus_exp.yaml").read_text())
        assert exp["modules"]["pre_trainer"]["framework"] == "megatron"
        cfg = yaml.safe_load((out / name / "config.yaml").read_text())
        assert cfg["meta"]["overrides"] == overrides  # the resolved config records where it came from


def test_check_reports_drift_missing_and_stale(tmp_path: Path):
    render_all(tmp_path)
    assert check(tmp_path) == []
    job = tmp_path / HEADLINE[0][0] / "job.sbatch"
    job.write_text(job.read_text().replace("--num-layers 32", "--num-layers 31"))
    (tmp_path / HEADLINE[1][0] / "primus_exp.yaml").unlink()
    (tmp_path / "old_recipe.yaml").write_text("x: 1\n")
    problems = "\n".join(check(tmp_path))
    assert "drift" in problems and "--num-layers 31" in problems
    assert "missing" in problems and "stale" in problems


def test_the_check_says_so_when_recipes_are_in_step(capsys):
    from uccl_moe.cli import main

    assert main(["render-recipes", "--check"]) == 0
    assert "recipes/ is in step with the configs" in capsys.readouterr().out
