"""Layout validation: headline recipes pass; each broken layout is rejected naming the rule that failed."""

from __future__ import annotations

import warnings

import pytest
from helpers.requires import require

require("omegaconf")

from uccl_moe.config import LayoutError, compose, validate
from uccl_moe.config.validate import RULES, MemoryWarning, parse_pipeline_layout, pipeline_assignment

HEADLINE = ["dsv3_mi300x_broadcom_16n", "dsv3_h200_efa_4n", "dsv3_proxy_local", "tiny_cpu_moe"]


@pytest.mark.parametrize("recipe", HEADLINE)
def test_headline_recipes_are_valid_and_fit_their_gpus(recipe):
    with warnings.catch_warnings():
        warnings.simplefilter("error", MemoryWarning)
        report = validate(compose([f"recipe={recipe}"]))
    assert report.memory.fits and not report.warnings
    cfg = compose([f"recipe={recipe}"])
    assert report.world_size == cfg.nodes * cfg.platform.gpus_per_node


def test_paper_layouts_of_the_379b_model_are_all_valid():
    for layout, ranks in (("ep8_pp16", 16), ("ep16_pp8", 8), ("ep32_pp4", 4)):
        r = validate(compose(["recipe=dsv3_mi300x_broadcom_16n", f"parallel={layout}"]), warn=False)
        assert r.world_size == 128 and len(r.pipeline) == ranks
        assert r.data_parallel_size == 128 // ranks  # TP 1: the dense part is data-parallel over the rest
        assert r.expert_data_parallel_size == 1  # EP x PP = 128


@pytest.mark.parametrize(
    "overrides, rule",
    [
        (["recipe=tiny_cpu_moe", "parallel.expert_model_parallel_size=3"], "experts_divisible_by_ep"),
        (["recipe=tiny_cpu_moe", "parallel.expert_model_parallel_size=3"], "expert_parallel_divides_world"),
        (["recipe=dsv3_mi300x_broadcom_16n", "parallel.pipeline_model_parallel_size=5"], "layers_divisible_by_pp"),
        (["recipe=dsv3_mi300x_broadcom_16n", "parallel=ep8_pp16", "nodes=1"], "model_parallel_divides_world"),
        (["recipe=dsv3_h200_efa_4n", "nodes=3"], "expert_parallel_divides_world"),
        (["recipe=tiny_cpu_moe", "parallel.tensor_model_parallel_size=3", "nodes=3"], "heads_divisible_by_tp"),
        (["recipe=tiny_cpu_moe", "parallel.global_batch_size=7"], "global_batch_divisible"),
        (["recipe=tiny_cpu_moe", "model.moe_router_num_groups=3"], "router_groups"),
        (["recipe=tiny_cpu_moe", "model.moe_router_topk=9"], "router_topk"),
        (["recipe=tiny_cpu_moe", "model.moe_layer_freq='([0]*1+[1]*5)'"], "moe_layer_freq"),
        (["recipe=tiny_cpu_moe", "model.moe_layer_freq=__import__"], "moe_layer_freq"),
        (["recipe=tiny_cpu_moe", "model.seq_length=128"], "sequence_length"),
        (["recipe=tiny_cpu_moe", "model.moe_router_dtype=null"], "dispatcher_router_dtype"),
        (["recipe=tiny_cpu_moe", "dispatcher=allgather", "dispatcher.moe_shared_expert_overlap=true"],
         "shared_expert_overlap_dispatcher"),
        (["recipe=tiny_cpu_moe", "dispatcher=flex_deepep"], "cpu_platform"),
        (["recipe=tiny_cpu_moe", "platform.transformer_impl=transformer_engine"], "cpu_platform"),
        (["recipe=tiny_cpu_moe", "dispatcher.moe_uccl_backend=native"], "cpu_platform"),
        (["recipe=dsv3_h200_efa_4n", "platform=cpu", "platform.gpus_per_node=8"], "cpu_platform"),  # grouped GEMM
        (["recipe=dsv3_h200_efa_4n", "dispatcher=flex_deepep", "parallel.expert_model_parallel_size=1",
          "parallel.global_batch_size=32"], "flex_dispatcher"),
        (["recipe=dsv3_mi300x_broadcom_16n", "parallel.num_layers_per_virtual_pipeline_stage=3"], "virtual_pipeline"),
        (["recipe=dsv3_h200_efa_4n", "parallel.num_layers_per_virtual_pipeline_stage=2"], "virtual_pipeline"),
        (["recipe=dsv3_mi300x_broadcom_16n", "parallel.recompute_method=null"], "recompute"),
        (["recipe=dsv3_mi300x_broadcom_16n", "parallel.pipeline_model_parallel_layout='Et|(tt|)*7,L'"],
         "pipeline_layout"),
        (["recipe=tiny_cpu_moe", "parallel.tensor_model_parallel_size=2", "nodes=2"],
         "sequence_parallel_with_tp_and_ep"),
        (["recipe=tiny_cpu_moe", "parallel.context_parallel_size=2", "model.seq_length=62", "nodes=2"],
         "context_parallel_sequence"),
        (["recipe=dsv3_mi300x_broadcom_16n", "+platform.uccl_env.UCCL_MOE_MAX_INFLIGHT_BYTE=1"], "env_knobs"),
        (["recipe=dsv3_mi300x_broadcom_16n", "dispatcher.max_inflight_writes=0"], "env_knobs"),
        (["recipe=tiny_cpu_moe", "parallel.micro_batch_size=0"], "sizes"),
    ],
)
def test_bad_layout_is_rejected_naming_the_rule(overrides, rule):
    assert rule in RULES
    with pytest.raises(LayoutError) as ei:
        validate(compose(overrides), warn=False)
    assert rule in ei.value.rules
    assert f"rule '{rule}'" in str(ei.value)
    assert isinstance(ei.value, ValueError)


def test_all_failures_are_reported_together():
    with pytest.raises(LayoutError) as ei:
        validate(compose(["recipe=tiny_cpu_moe", "parallel.expert_model_parallel_size=3",
                          "parallel.global_batch_size=7"]), warn=False)
    assert {"experts_divisible_by_ep", "expert_parallel_divides_world", "global_batch_divisible"} <= set(ei.value.rules)


def test_valid_variants():
    # uneven first/last stages: 61 layers on PP 16 as 3 + 14x4 + 2
    cfg = compose(["recipe=dsv3_mi300x_broadcom_16n", "model=deepseek_v3", "parallel=ep8_pp16",
                   "parallel.decoder_first_pipeline_num_layers=3", "parallel.decoder_last_pipeline_num_layers=2"])
    r = validate(cfg, warn=False)
    assert [len(x) for x in r.pipeline] == [3] + [4] * 14 + [2]
    # an explicit layout with VPP 2 (32 virtual stages) and the MTP layer on the last stage
    layout = "Et|" + "tt|" * 29 + "tt|mL"
    cfg = compose(["recipe=dsv3_mi300x_broadcom_16n", "model=deepseek_v3", "parallel=ep8_pp16",
                   f"parallel.pipeline_model_parallel_layout='{layout}'"])
    r = validate(cfg, warn=False)
    assert sum(len(x) for x in r.pipeline) == 61 and len(r.pipeline) == 16
    # VPP: 32 layers, PP 8, 2 layers per virtual stage -> rank 0 holds layers 0,1,16,17
    cfg = compose(["recipe=dsv3_mi300x_broadcom_16n", "parallel.num_layers_per_virtual_pipeline_stage=2"])
    assert pipeline_assignment(cfg)[0] == [0, 1, 16, 17]


def test_parse_pipeline_layout():
    assert parse_pipeline_layout("Et|(tt|)*2,mL") == ["Et", "tt", "tt", "mL"]
    assert parse_pipeline_layout("Et*2|t*3,L") == ["Ett", "tttL"]
    assert len(parse_pipeline_layout("Et|(tt|)*30,mL")) == 32
    with pytest.raises(ValueError, match="pipeline_model_parallel_layout"):
        parse_pipeline_layout("Ex|L")


def test_memory_warning_when_parameters_do_not_fit():
    # without the distributed optimizer every GPU holds the full Adam state of its parameters
    cfg = compose(["recipe=dsv3_h200_efa_4n", "parallel.use_distributed_optimizer=false"])
    with pytest.warns(MemoryWarning, match="GB per GPU"):
        report = validate(cfg)
    assert not report.memory.fits and report.memory.total_gb > 141
    assert "h200_efa" in report.warnings[0]


def test_dispatcher_knob_ranges_are_the_knob_tables():
    """A dispatcher knob field is bounded by env_knobs.def, as the runtime parses it: 0 in-flight bytes (unlimited)
    passes, a value over the knob's maximum is refused by the ranges rule."""
    validate(compose(["recipe=tiny_cpu_moe", "dispatcher.max_inflight_bytes=0"]), warn=False)
    with pytest.raises(LayoutError, match="proxy_threads"):
        validate(compose(["recipe=tiny_cpu_moe", "dispatcher.proxy_threads=65"]), warn=False)
