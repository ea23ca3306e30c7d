"""Every recipe composes with every platform; bad overrides and bad group files fail at compose time naming the key."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from helpers.requires import require

require("omegaconf")

from uccl_moe.config import ConfigError, available, compose, config_dir, expand_sweeps, schema, to_object, to_yaml

RECIPES = available("recipe")
PLATFORMS = available("platform")


def test_config_tree_has_the_required_options():
    assert {"dsv3_mi300x_broadcom_16n", "dsv3_h200_efa_4n", "dsv3_proxy_local", "tiny_cpu_moe"} <= set(RECIPES)
    assert {"mi300x_broadcom", "h200_efa", "local", "cpu"} <= set(PLATFORMS)
    assert {"deepseek_v3", "deepseek_v3_379b", "deepseek_v3_proxy", "tiny_moe"} <= set(available("model"))
    assert {"uccl", "alltoall", "flex_deepep"} <= set(available("dispatcher"))


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_composes_on_every_platform(recipe, platform):
    cfg = compose([f"recipe={recipe}", f"platform={platform}"])
    assert cfg.meta.recipe == recipe
    assert cfg.meta.choices["platform"] == platform
    assert cfg.platform.name == platform  # the command line wins over the recipe's own platform
    obj = to_object(cfg)
    assert isinstance(obj, schema.Config) and isinstance(obj.model, schema.ModelConfig)
    assert "meta:" in to_yaml(cfg)


def test_recipe_selects_its_groups_and_values():
    cfg = compose(["recipe=dsv3_mi300x_broadcom_16n"])
    assert cfg.meta.choices == {"dispatcher": "uccl", "model": "deepseek_v3_379b", "parallel": "ep16_pp8",
                                "platform": "mi300x_broadcom", "recipe": "dsv3_mi300x_broadcom_16n",
                                "train": "pretrain"}
    assert cfg.nodes == 16 and cfg.model.num_layers == 32 and cfg.model.derived is True
    assert cfg.platform.uccl_env["UCCL_MOE_TRANSPORT"] == "ibverbs"
    h200 = compose(["recipe=dsv3_h200_efa_4n", "nodes=8", "parallel.expert_model_parallel_size=64"])
    assert h200.nodes == 8 and h200.parallel.expert_model_parallel_size == 64 and h200.model.num_layers == 12
    assert h200.meta.overrides == ["recipe=dsv3_h200_efa_4n", "nodes=8", "parallel.expert_model_parallel_size=64"]


def test_without_recipe_the_defaults_are_the_tiny_cpu_model():
    cfg = compose([])
    assert cfg.meta.recipe == "none" and cfg.model.name == "tiny_moe" and cfg.platform.name == "cpu"


def test_cpu_platform_resolves_uccl_backend_to_reference():
    cfg = compose(["recipe=dsv3_proxy_local", "platform=cpu"])
    assert cfg.dispatcher.moe_uccl_backend == schema.UcclBackend.reference
    assert compose(["recipe=dsv3_proxy_local"]).dispatcher.moe_uccl_backend == schema.UcclBackend.auto


@pytest.mark.parametrize(
    "override, key",
    [
        ("parallel.expert_model_paralel_size=4", "expert_model_paralel_size"),  # typo in a key
        ("parallel.expert_model_parallel_size=four", "parallel.expert_model_parallel_size"),  # bad int
        ("model.moe_router_score_function=tanh", "model.moe_router_score_function"),  # bad enum
        ("dispatcher.moe_token_dispatcher_type=deepep", "dispatcher.moe_token_dispatcher_type"),
        ("platform.gpus_per_node=8.5", "platform.gpus_per_node"),
        ("nodes=many", "nodes"),
        ("platform=tpu_pod", "platform"),  # unknown group option
        ("recipe=dsv3_nowhere", "recipe"),
    ],
)
def test_bad_override_fails_naming_the_key(override, key):
    with pytest.raises(ConfigError) as ei:
        compose(["recipe=tiny_cpu_moe", override])
    assert key in str(ei.value)
    assert isinstance(ei.value, ValueError)  # InvalidUsageError is a ValueError


def test_typo_inside_a_group_file_fails_naming_the_key(tmp_path: Path):
    tree = tmp_path / "configs"
    shutil.copytree(config_dir(), tree)
    f = tree / "parallel" / "ep2.yaml"
    f.write_text(f.read_text().replace("micro_batch_size:", "micro_bach_size:"))
    with pytest.raises(ConfigError) as ei:
        compose(["recipe=tiny_cpu_moe"], directory=tree)
    assert "micro_bach_size" in str(ei.value)


def test_missing_mandatory_value_is_named(tmp_path: Path):
    tree = tmp_path / "configs"
    shutil.copytree(config_dir(), tree)
    f = tree / "parallel" / "ep2.yaml"
    f.write_text("\n".join(x for x in f.read_text().splitlines() if not x.startswith("global_batch_size")))
    with pytest.raises(ConfigError) as ei:
        compose(["recipe=tiny_cpu_moe"], directory=tree)
    assert ei.value.key == "parallel.global_batch_size"


def test_config_dir_env_var(monkeypatch, tmp_path: Path):
    monkeypatch.setenv("UCCL_MOE_CONFIG_DIR", str(tmp_path))
    with pytest.raises(ConfigError, match="UCCL_MOE_CONFIG_DIR"):
        config_dir()
    monkeypatch.setenv("UCCL_MOE_CONFIG_DIR", str(Path(__file__).resolve().parents[2] / "configs"))
    assert (config_dir() / "config.yaml").is_file()


def test_expand_sweeps():
    combos = expand_sweeps(["recipe=dsv3_h200_efa_4n", "dispatcher=uccl,alltoall", "nodes=4,8"])
    assert combos == [
        ["recipe=dsv3_h200_efa_4n", "dispatcher=uccl", "nodes=4"],
        ["recipe=dsv3_h200_efa_4n", "dispatcher=uccl", "nodes=8"],
        ["recipe=dsv3_h200_efa_4n", "dispatcher=alltoall", "nodes=4"],
        ["recipe=dsv3_h200_efa_4n", "dispatcher=alltoall", "nodes=8"],
    ]
    assert expand_sweeps(["recipe=tiny_cpu_moe"]) == [["recipe=tiny_cpu_moe"]]
    with pytest.raises(ConfigError):
        expand_sweeps(["nodes=[unclosed"])


def test_every_recipe_file_opens_with_its_command():
    for name in RECIPES:
        text = (config_dir() / "recipe" / f"{name}.yaml").read_text().splitlines()
        assert text[0] == "# @package _global_"
        assert text[1].startswith("# uccl-moe ") and f"recipe={name}" in text[1]
