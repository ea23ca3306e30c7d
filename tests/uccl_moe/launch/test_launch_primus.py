"""Primus experiment YAML: loads, has Primus's required keys, carries our overrides/env; its sbatch lints."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.requires import require

require("omegaconf")

import yaml

from uccl_moe.cli import main
from uccl_moe.config import available, compose
from uccl_moe.launch.megatron_args import launch_env, megatron_args
from uccl_moe.launch.primus import REQUIRED_KEYS, primus_command, primus_experiment, primus_overrides


@pytest.mark.parametrize("recipe", available("recipe"))
def test_primus_yaml_loads_with_required_keys(recipe, tmp_path: Path, lint_bash):
    assert main(["primus", f"recipe={recipe}", "--run-dir", str(tmp_path), "--quiet"]) == 0
    text = (tmp_path / "primus_exp.yaml").read_text()
    exp = yaml.safe_load(text)
    for key in REQUIRED_KEYS:
        assert key in exp, key
    assert exp["exp_name"] == f"${{PRIMUS_EXP_NAME:{recipe}}}"
    assert exp["work_group"] == "${PRIMUS_TEAM:amd}" and exp["workspace"] == "${PRIMUS_WORKSPACE:./output}"
    pre = exp["modules"]["pre_trainer"]
    assert pre["framework"] == "megatron" and pre["config"] == "pre_trainer.yaml" and pre["model"].endswith(".yaml")
    cfg = compose([f"recipe={recipe}"])
    ov = pre["overrides"]
    for name, value in megatron_args(cfg):
        assert name in ov, name
        if name != "moe_layer_freq":
            assert ov[name] == value, name
    assert ov["moe_token_dispatcher_type"] == "uccl" and ov["moe_router_dtype"] == "fp32"
    assert ov["layernorm_epsilon"] == ov["norm_epsilon"] and ov["add_bias_linear"] is (not ov["disable_bias_linear"])
    assert exp.get("env", {}) == launch_env(cfg)
    # provenance and the command are in the header
    assert f"# Rendered by uccl-moe from recipe '{recipe}'" in text
    assert "# regenerate: uccl-moe primus recipe=" in text
    assert "primus-cli direct --script" in text
    sb = tmp_path / "primus.sbatch"
    lint_bash(sb)
    assert f"GPUS_PER_NODE={cfg.platform.gpus_per_node}" in sb.read_text()


def test_booleans_and_ints_keep_their_yaml_types():
    cfg = compose(["recipe=dsv3_mi300x_broadcom_16n", "dispatcher=alltoall"])
    ov = primus_overrides(cfg)
    assert ov["moe_layer_freq"] == 1  # an int, not "1": Primus bypasses argparse types
    assert ov["moe_shared_expert_overlap"] is False  # explicit False beats Primus's preset (true there)
    assert ov["gradient_accumulation_fusion"] is True and ov["bf16"] is True
    assert compose(["recipe=dsv3_proxy_local"]).model.moe_layer_freq == "([0]*1+[1]*3)"
    assert primus_overrides(compose(["recipe=dsv3_proxy_local"]))["moe_layer_freq"] == "([0]*1+[1]*3)"
    extra = primus_overrides(compose(["recipe=tiny_cpu_moe", "train.extra_args=[--exit-interval,3,--no-rope-fusion]"]))
    assert extra["exit_interval"] == 3 and extra["no_rope_fusion"] is True


def test_primus_command_uses_our_entry_script():
    cfg = compose(["recipe=dsv3_mi300x_broadcom_16n"])
    cmd = primus_command(cfg, "exp.yaml")
    assert cmd[:4] == ["primus-cli", "direct", "--script", '"$UCCL_MOE_PRIMUS_ENTRY"']
    assert cmd[4:] == ["--", "train", "pretrain", "--config", '"exp.yaml"']
    assert primus_experiment(cfg)["modules"]["pre_trainer"]["overrides"]["expert_model_parallel_size"] == 16


def test_the_entry_variable_is_not_an_unknown_knob() -> None:
    """The launchers export the entry script's path in a UCCL_MOE_* variable: uccl_moe.env must not warn about it."""
    from uccl_moe import env
    from uccl_moe.launch import primus

    assert primus.ENTRY_VAR.startswith("UCCL_MOE_") and primus.ENTRY_VAR[len("UCCL_MOE_"):] in env.LAUNCHER_VARS
