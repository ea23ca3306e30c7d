"""install(): registration of "uccl" in an unmodified megatron-core, idempotence, and what still fails."""

from __future__ import annotations

import argparse

import pytest

pytest.importorskip("megatron.core", reason='megatron-core is not installed: pip install -e ".[train]"')

import torch  # noqa: E402
from helpers.mp import run_ranks_on as run_ranks  # noqa: E402

import uccl_moe.megatron as um  # noqa: E402  (installs)
from uccl_moe.errors import InvalidUsageError  # noqa: E402
from uccl_moe.megatron import install as install_mod  # noqa: E402,F401
from uccl_moe.megatron import knobs  # noqa: E402

install_module = __import__("uccl_moe.megatron.install", fromlist=["_PATCHED"])


def _config(**kw):
    from megatron.core.transformer.transformer_config import TransformerConfig

    base = dict(num_layers=1, hidden_size=16, num_attention_heads=4, num_moe_experts=4, moe_ffn_hidden_size=32,
                moe_router_topk=2, use_cpu_initialization=True, add_bias_linear=False)
    base.update(kw)
    return TransformerConfig(**base)


def _wrap_depth(fn) -> int:
    depth = 0
    while hasattr(fn, "__wrapped__"):
        fn, depth = fn.__wrapped__, depth + 1
    return depth


def test_install_twice_is_harmless():
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.transformer_config import TransformerConfig

    assert um.is_installed()
    before = (TransformerConfig.__post_init__, MoELayer.__init__)
    um.install()
    um.install()
    assert (TransformerConfig.__post_init__, MoELayer.__init__) == before
    assert _wrap_depth(TransformerConfig.__post_init__) == 1
    assert _wrap_depth(MoELayer.__init__) == 1
    assert getattr(MoELayer.__init__, install_module._PATCHED)


def test_config_accepts_uccl_and_keeps_other_types_unchanged():
    cfg = _config(moe_token_dispatcher_type="uccl", moe_shared_expert_intermediate_size=16,
                  moe_shared_expert_overlap=True)
    assert cfg.moe_token_dispatcher_type == "uccl"
    # allgather still refuses shared-expert overlap, as before install()
    with pytest.raises(ValueError, match="moe_shared_expert_overlap"):
        _config(moe_token_dispatcher_type="allgather", moe_shared_expert_intermediate_size=16,
                moe_shared_expert_overlap=True)
    import typing

    from megatron.core.transformer.transformer_config import TransformerConfig

    field = TransformerConfig.__dataclass_fields__["moe_token_dispatcher_type"]
    assert "uccl" in typing.get_args(field.type) and "alltoall" in typing.get_args(field.type)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True), "pad-expert-input"),
        (dict(moe_enable_deepep=True), "moe_enable_deepep"),
    ],
)
def test_config_rejects_unsupported_features(kw, match):
    with pytest.raises(InvalidUsageError, match=match):
        _config(moe_token_dispatcher_type="uccl", **kw)


def test_config_accepts_ep_overlap_and_delayed_wgrad():
    """Issue 29: --overlap-moe-expert-parallel-comm and --delay-wgrad-compute pass with uccl (Megatron's own gates,
    bf16 and EP > 1, still apply) and still fail for allgather, which Megatron does not overlap."""
    kw = dict(overlap_moe_expert_parallel_comm=True, delay_wgrad_compute=True, bf16=True, expert_model_parallel_size=2)
    cfg = _config(moe_token_dispatcher_type="uccl", **kw)
    assert cfg.moe_token_dispatcher_type == "uccl" and cfg.overlap_moe_expert_parallel_comm and cfg.delay_wgrad_compute
    with pytest.raises(AssertionError, match="alltoall/flex"):
        _config(moe_token_dispatcher_type="allgather", **kw)
    with pytest.raises(AssertionError, match="overlap_moe_expert_parallel_comm must be enabled"):
        _config(moe_token_dispatcher_type="uccl", delay_wgrad_compute=True, bf16=True, expert_model_parallel_size=2)


def test_validate_config_accepts_quantization_padding_and_latent():
    """--moe-router-padding-for-quantization and --moe-latent-size are uccl's to implement (TransformerConfig itself
    needs TransformerEngine for fp8 and latent projections, so uccl's own check is called directly)."""
    import types

    um.validate_config(types.SimpleNamespace(moe_router_padding_for_quantization=True, fp8="e4m3",
                                             moe_latent_size=64, overlap_moe_expert_parallel_comm=True))


def test_knobs_validation():
    class C:
        pass

    c = C()
    k = knobs.resolve(c)
    assert (k.num_sms, k.nvl_bytes, k.rdma_bytes, k.backend) == (None, None, None, "auto")
    c.moe_uccl_num_sms, c.moe_uccl_nvl_bytes, c.moe_uccl_backend = 24, 1 << 20, "reference"
    k = knobs.resolve(c)
    assert (k.num_sms, k.nvl_bytes, k.backend) == (24, 1 << 20, "reference")
    assert k.combine_from_buffer is True  # on by default
    for text, want in (("false", False), ("OFF", False), ("0", False), (False, False), ("yes", True), (True, True)):
        c.moe_uccl_combine_from_buffer = text
        assert knobs.resolve(c).combine_from_buffer is want, text
    for name, bad, msg in [("moe_uccl_num_sms", 23, "even"), ("moe_uccl_nvl_bytes", -1, "byte count"),
                           ("moe_uccl_backend", "fast", "choose one of"),
                           ("moe_uccl_combine_from_buffer", "maybe", "moe_uccl_combine_from_buffer: 'maybe' is not a")]:
        c2 = C()
        setattr(c2, name, bad)
        with pytest.raises(InvalidUsageError, match=msg):
            knobs.resolve(c2)


def test_widen_parser_megatron_015_style():
    """<= 0.15 declares the flag explicitly: install's parser hook must widen those choices and add the knobs."""
    p = argparse.ArgumentParser()
    p.add_argument("--moe-token-dispatcher-type", choices=["allgather", "alltoall", "flex"], default="allgather")
    with pytest.raises(SystemExit):
        p.parse_args(["--moe-token-dispatcher-type", "uccl"])
    um.widen_parser(p)
    um.widen_parser(p)  # twice: no duplicate flags
    a = p.parse_args(["--moe-token-dispatcher-type", "uccl", "--moe-uccl-num-sms", "24", "--moe-uccl-backend",
                      "reference", "--moe-uccl-combine-from-buffer", "false"])
    assert (a.moe_token_dispatcher_type, a.moe_uccl_num_sms, a.moe_uccl_backend) == ("uccl", 24, "reference")
    assert a.moe_uccl_combine_from_buffer is False
    with pytest.raises(SystemExit):
        p.parse_args(["--moe-token-dispatcher-type", "bogus"])


def test_megatron_training_cli_accepts_uccl(monkeypatch):
    """With megatron.training (0.17+ wheels, Megatron-LM checkouts): the stock parser accepts uccl and the knobs."""
    training_args = pytest.importorskip("megatron.training.arguments", reason="megatron.training ships from 0.17")
    monkeypatch.setattr("sys.argv", ["pretrain_gpt.py", "--moe-token-dispatcher-type", "uccl",
                                     "--moe-uccl-num-sms", "24"])
    args = training_args.parse_args()
    assert args.moe_token_dispatcher_type == "uccl" and args.moe_uccl_num_sms == 24
    monkeypatch.setattr("sys.argv", ["pretrain_gpt.py", "--moe-token-dispatcher-type", "bogus"])
    with pytest.raises(SystemExit):
        training_args.parse_args()


def test_cpu_shims_refuse_cuda_hosts(monkeypatch):
    from uccl_moe.megatron import cpu

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(InvalidUsageError, match="without CUDA"):
        cpu.apply()


def _unknown_type_rank(rank, world):
    from megatron.core import parallel_state

    import uccl_moe.megatron  # noqa: F401
    from tests.uccl_moe.megatron._moe_cases import Case, make_config, make_layer

    parallel_state.initialize_model_parallel(expert_model_parallel_size=world)
    case = Case(ep=world, num_experts=4, aux_loss=False)
    try:
        make_layer(make_config(case, "bogus"), torch.device("cpu"))
    except ValueError as e:
        msg = str(e)
    else:
        msg = None
    layer = make_layer(make_config(case, "uccl"), torch.device("cpu"))
    # One Buffer per (group, hidden bytes), shared by layers; the SM knob reaches Buffer.set_num_sms.
    from uccl_moe import Buffer
    from uccl_moe.megatron import buffer_manager as disp

    cfg2 = make_config(case, "uccl")
    cfg2.moe_uccl_num_sms = 24
    layer2 = make_layer(cfg2, torch.device("cpu"))
    x = torch.randn(4, 2, case.hidden)
    layer(x)[0].sum().backward()
    layer2(x)[0].sum().backward()
    shared = layer.token_dispatcher._buffer is layer2.token_dispatcher._buffer and len(disp._BUFFERS) == 1
    return msg, type(layer.token_dispatcher).__name__, layer.config.moe_token_dispatcher_type, shared, Buffer.num_sms


@pytest.mark.mp
def test_unknown_dispatcher_type_still_errors_and_layers_share_one_buffer():
    for msg, cls, typ, shared_buffer, num_sms in run_ranks(_unknown_type_rank, 2):
        assert msg is not None and "Unsupported token dispatcher type: bogus" in msg
        assert cls == "UCCLTokenDispatcher" and typ == "uccl"
        assert shared_buffer and num_sms == 24
