"""Parameter counts and per-GPU memory estimates."""

from __future__ import annotations

import pytest
from helpers.requires import require

require("omegaconf")

from uccl_moe.config import compose, count_parameters, validate
from uccl_moe.config.memory import fmt_params, padded_vocab, parse_moe_layer_freq


def _model(*overrides):
    return compose(["recipe=dsv3_mi300x_broadcom_16n", *overrides]).model


@pytest.mark.parametrize(
    "overrides, billions",
    [
        # reference counts (shared/reference/primus_recipes.md §1.2): 61 layers, MLA, no MTP = 671.0B
        (["model=deepseek_v3", "model.mtp_num_layers=null"], 671.0),
        # the paper's 32-layer downscale: all MoE, MLA off, no MTP = 379.1B; with MLA 370.1B; 3 dense + MLA 337.3B
        ([], 379.1),
        (["model=deepseek_v3", "model.mtp_num_layers=null", "model.num_layers=32", "model.moe_layer_freq=1"], 370.1),
        (["model=deepseek_v3", "model.mtp_num_layers=null", "model.num_layers=32",
          "model.moe_layer_freq='([0]*3+[1]*29)'"], 337.3),
    ],
)
def test_deepseek_v3_parameter_counts(overrides, billions):
    assert count_parameters(_model(*overrides)).total / 1e9 == pytest.approx(billions, abs=0.05)


def test_mtp_layer_adds_one_moe_layer_and_the_projection():
    with_mtp = count_parameters(_model("model=deepseek_v3"))
    without = count_parameters(_model("model=deepseek_v3", "model.mtp_num_layers=null"))
    h = 7168
    assert with_mtp.total - without.total == with_mtp.moe_layer + 2 * h * h + 3 * h


def test_tiny_model_count_by_hand():
    c = count_parameters(compose(["recipe=tiny_cpu_moe"]).model)
    h, heads, kv, ffn, e, moe_ffn, vocab = 64, 4, 16, 256, 8, 64, 256
    attention = h * (heads * kv + 2 * heads * kv) + heads * kv * h
    dense = 3 * h * ffn
    moe = h * e + e * 3 * h * moe_ffn + 3 * h * moe_ffn
    assert c.attention == attention and c.dense_mlp == dense
    assert c.total == 2 * vocab * h + (attention + dense + 2 * h) + 2 * (attention + moe + 2 * h) + h


def test_moe_layer_freq_parsing():
    assert parse_moe_layer_freq("1", 3) == [1, 1, 1]
    assert parse_moe_layer_freq("2", 4) == [1, 0, 1, 0]
    assert parse_moe_layer_freq("([0]*3+[1]*2)", 5) == [0, 0, 0, 1, 1]
    for bad in ("__import__('os')", "[2]*3", "0", "x", "[0]*999999999999", "[0]*(1+"):
        with pytest.raises(ValueError, match="moe_layer_freq"):
            parse_moe_layer_freq(bad, 3)


def test_vocab_padding_and_formatting():
    assert padded_vocab(129280, None, 1) == 129280
    assert padded_vocab(129281, None, 1) == 129408
    assert padded_vocab(32000, 128, 8) == 32768
    assert fmt_params(379.1e9) == "379.10B" and fmt_params(4.5e6) == "4.50M" and fmt_params(12) == "12"


def test_per_gpu_bytes_follow_the_optimizer_sharding():
    cfg = compose(["recipe=dsv3_mi300x_broadcom_16n"])
    r = validate(cfg, warn=False)
    m = r.memory
    heavy = m.ranks[m.pp_rank]
    assert m.weights_gb == pytest.approx(heavy.total * 2 / 1e9)  # bf16 weights
    assert m.grads_gb == pytest.approx(heavy.total * 4 / 1e9)  # fp32 main grads
    # distributed optimizer: dense state sharded over DP=16, expert state over expert DP=1
    assert m.optimizer_gb == pytest.approx((heavy.dense * 12 / 16 + heavy.expert * 12 / 1) / 1e9)
    assert m.pp_rank == 7  # the last stage also holds the output layer
    plain = validate(compose(["recipe=dsv3_mi300x_broadcom_16n", "parallel.use_distributed_optimizer=false"]),
                     warn=False).memory
    assert plain.optimizer_gb == pytest.approx(heavy.total * 12 / 1e9)
    # experts are split over EP: doubling EP (halving PP) keeps expert params per GPU about equal
    r32 = validate(compose(["recipe=dsv3_mi300x_broadcom_16n", "parallel=ep32_pp4"]), warn=False).memory
    assert r32.ranks[0].expert == pytest.approx(m.ranks[0].expert, rel=1e-9)
    assert "GB" in m.summary() and "379.13B" in m.summary()


def test_fp32_cpu_bytes():
    m = validate(compose(["recipe=tiny_cpu_moe"]), warn=False).memory
    # on CPU, platform.gpu_memory_gb is a host budget per process, not a GPU's memory
    assert m.per == "CPU rank" and "per CPU rank" in m.summary()
    assert "GB of the 4 GB host memory budget per rank" in m.summary() and "per GPU" not in m.summary()
    gpu = validate(compose(["recipe=dsv3_mi300x_broadcom_16n"]), warn=False).memory
    assert gpu.per == "GPU" and "GB of 192 GB (activations" in gpu.summary()
    heavy = m.ranks[m.pp_rank]
    assert m.weights_gb == pytest.approx(heavy.total * 4 / 1e9)
    assert m.optimizer_gb == pytest.approx(heavy.total * 8 / 1e9)


def test_a_cpu_platform_warns_of_its_host_budget_not_a_gpu():
    r = validate(compose(["recipe=tiny_cpu_moe", "platform.gpu_memory_gb=0.0001"]), warn=False)
    assert not r.memory.fits and len(r.warnings) == 1
    msg = r.warnings[0]
    assert "GB per CPU rank for weights" in msg and "platform cpu's 0.0001 GB host memory budget per rank" in msg, msg
    assert "per GPU" not in msg, msg
