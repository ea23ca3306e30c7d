"""Megatron argv + env rendering, checked against Megatron's own argument parser.

Which parser: ``megatron.training.arguments.parse_args`` (the one ``pretrain_gpt.py`` uses) when it is importable,
in a child interpreter; ``UCCL_MOE_TEST_MEGATRON_PATH`` may point at an unpacked megatron-core >= 0.17 wheel (+
triton) to get it on a Python 3.11 host whose pip resolves megatron-core 0.16.1, whose wheel does not ship
``megatron.training``. Without it the argument names are checked against the definitions the installed wheel
does have: the fields of megatron-core's config dataclasses (types and ``Literal`` choices), plus the explicit list
of training-loop arguments that only ``megatron.training`` defines. See docs/launch.md.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import typing
from pathlib import Path

import pytest
from helpers.requires import require

require("omegaconf")

from uccl_moe.config import available, compose
from uccl_moe.config.memory import parse_moe_layer_freq
from uccl_moe.errors import InvalidUsageError
from uccl_moe.launch.local import child_env, torchrun_command
from uccl_moe.launch.megatron_args import (
    entry_argv,
    flag,
    launch_env,
    megatron_argv,
    megatron_dests,
    training_command,
)
from uccl_moe.launch.slurm import render_sbatch

ROOT = Path(__file__).resolve().parents[3]
CHILD = Path(__file__).with_name("megatron_parse_child.py")
RECIPES = available("recipe")
BASELINES = ["alltoall", "allgather", "flex_deepep"]


# ------------------------------------------------------------------------------------------ rendering rules


def test_flags_and_values():
    cfg = compose(["recipe=tiny_cpu_moe"])
    argv = megatron_argv(cfg)
    assert flag("expert_model_parallel_size") == "--expert-model-parallel-size"
    i = argv.index("--expert-model-parallel-size")
    assert argv[i + 1] == "2"
    assert "--swiglu" in argv and "--mock-data" in argv  # True bools are bare flags
    assert "--moe-router-pre-softmax" not in argv  # False bools are omitted
    assert "--no-gradient-accumulation-fusion" in argv  # False with a Megatron default of True
    assert argv[argv.index("--moe-router-score-function") + 1] == "sigmoid"  # enums render their value
    assert argv[argv.index("--moe-layer-freq") + 1] == "([0]*1+[1]*2)"
    assert argv[argv.index("--norm-epsilon") + 1] == "1e-06"
    assert "--q-lora-rank" not in argv  # None is Megatron's default
    assert argv[argv.index("--moe-token-dispatcher-type") + 1] == "uccl"
    assert argv[argv.index("--moe-uccl-backend") + 1] == "reference"  # resolved on CPU
    assert argv[argv.index("--distributed-backend") + 1] == "gloo"
    with_gaf = megatron_argv(compose(["recipe=dsv3_h200_efa_4n"]))
    assert "--no-gradient-accumulation-fusion" not in with_gaf and "--bf16" in with_gaf
    base = megatron_argv(compose(["recipe=tiny_cpu_moe", "dispatcher=alltoall"]))
    assert not [a for a in base if a.startswith("--moe-uccl")]


def test_dests_apply_megatron_renames():
    d = megatron_dests(compose(["recipe=tiny_cpu_moe"]))
    assert d["layernorm_epsilon"] == 1e-6 and "norm_epsilon" not in d
    assert d["add_bias_linear"] is False and "disable_bias_linear" not in d
    assert d["gradient_accumulation_fusion"] is False


def test_extra_args_are_appended_last():
    cfg = compose(["recipe=tiny_cpu_moe", "train.extra_args=[--exit-interval,3]",
                   "platform.extra_args=[--no-rope-fusion]"])
    assert megatron_argv(cfg)[-3:] == ["--no-rope-fusion", "--exit-interval", "3"]


def test_env_precedence():
    cfg = compose(["recipe=dsv3_mi300x_broadcom_16n"])
    env = launch_env(cfg)
    assert env["NCCL_IB_GID_INDEX"] == "3" and env["HSA_NO_SCRATCH_RECLAIM"] == "1"
    assert env["UCCL_MOE_TRANSPORT"] == "ibverbs"  # the platform's uccl_env
    # Thor-2's flow-control limits are the proxy's bnxt_re defaults (flow_control.cc), not knobs the platform sets
    assert "UCCL_MOE_MAX_INFLIGHT_BYTES" not in env and "UCCL_MOE_MAX_INFLIGHT_WRITES" not in env
    assert env["UCCL_MOE_PROXY_THREADS"] == "4"  # dispatcher knob field
    # an explicit dispatcher knob beats the platform's uccl_env
    env = launch_env(compose(["recipe=dsv3_mi300x_broadcom_16n", "dispatcher.max_inflight_bytes=2097152"]))
    assert env["UCCL_MOE_MAX_INFLIGHT_BYTES"] == "2097152"
    # baselines get the platform env only
    env = launch_env(compose(["recipe=dsv3_mi300x_broadcom_16n", "dispatcher=alltoall"]))
    assert "NCCL_IB_HCA" in env and not [k for k in env if k.startswith("UCCL_MOE_")]
    efa = launch_env(compose(["recipe=dsv3_h200_efa_4n"]))
    assert efa["NCCL_MAX_NCHANNELS"] == "32" and efa["FI_PROVIDER"] == "efa" and efa["UCCL_MOE_TRANSPORT"] == "efa"
    assert "NCCL_MAX_NCHANNELS" not in launch_env(compose(["recipe=dsv3_h200_efa_4n", "dispatcher=alltoall"]))


def test_hardware_queues_follow_the_layout():
    """CUDA_DEVICE_MAX_CONNECTIONS as Megatron-Core 0.19 asks for it (megatron/training/arguments.py): 1 with TP or
    CP > 1 unless FSDP or the MoE comm overlap (32) is on, else the driver's default; the platform's env wins."""
    def queues(*overrides: str, recipe: str = "dsv3_proxy_local") -> str | None:
        return launch_env(compose([f"recipe={recipe}", *overrides])).get("CUDA_DEVICE_MAX_CONNECTIONS")

    for recipe in RECIPES:  # every layout we ship has TP = CP = 1
        assert queues(recipe=recipe) is None, recipe
    assert queues("parallel.tensor_model_parallel_size=2") == "1"
    assert queues("parallel.context_parallel_size=2") == "1"
    assert queues("parallel.tensor_model_parallel_size=2", "train.extra_args=[--use-megatron-fsdp]") is None
    assert queues("train.extra_args=[--overlap-moe-expert-parallel-comm,--delay-wgrad-compute]") == "32"
    assert queues("platform=cpu", "parallel.tensor_model_parallel_size=2", recipe="tiny_cpu_moe") is None
    assert queues("parallel.tensor_model_parallel_size=2", "+platform.env.CUDA_DEVICE_MAX_CONNECTIONS=8") == "8"
    assert queues("+platform.env.CUDA_DEVICE_MAX_CONNECTIONS=1") == "1"
    # TP or CP in the raw arguments (appended last, so Megatron takes them), either form
    assert queues("train.extra_args=['--tensor-model-parallel-size=2']") == "1"
    assert queues("platform.extra_args=[--context-parallel-size,4]") == "1"
    assert queues("parallel.tensor_model_parallel_size=2", "train.extra_args=[--tensor-model-parallel-size,1]") is None
    assert queues("platform.extra_args=[--overlap-moe-expert-parallel-comm]") == "32"
    script = render_sbatch(compose(["recipe=dsv3_proxy_local", "parallel.tensor_model_parallel_size=2"]))
    assert "export CUDA_DEVICE_MAX_CONNECTIONS=1\n" in script and "set to 1: TP 2, CP 1" in script
    script = render_sbatch(compose(["recipe=dsv3_proxy_local"]))
    assert "export CUDA_DEVICE_MAX_CONNECTIONS" not in script and "CUDA_DEVICE_MAX_CONNECTIONS not set" in script
    script = render_sbatch(compose(["recipe=dsv3_proxy_local", "+platform.env.CUDA_DEVICE_MAX_CONNECTIONS=4"]))
    assert "export CUDA_DEVICE_MAX_CONNECTIONS=4\n" in script and "as platform.env sets it" in script
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in render_sbatch(compose(["recipe=tiny_cpu_moe"]))  # CPU: no GPU queues


def test_every_uccl_env_knob_exists_in_the_knob_table():
    from uccl_moe.env import KNOBS

    for recipe in RECIPES:
        for platform in available("platform"):
            for k, v in launch_env(compose([f"recipe={recipe}", f"platform={platform}"])).items():
                if k.startswith("UCCL_MOE_"):
                    KNOBS[k[len("UCCL_MOE_"):]].parse(v)


def test_entry_and_torchrun_command():
    cfg = compose(["recipe=tiny_cpu_moe"])
    assert entry_argv(cfg) == ["-m", "uccl_moe.train.train_gpt"]
    assert training_command(cfg)[:2] == ["-m", "uccl_moe.train.train_gpt"]
    script = compose(["recipe=tiny_cpu_moe", "train.entry=/opt/Megatron-LM/pretrain_gpt.py"])
    assert training_command(script)[:3] == ["-m", "uccl_moe.megatron.pretrain", "/opt/Megatron-LM/pretrain_gpt.py"]
    with pytest.raises(InvalidUsageError, match="train.entry"):
        entry_argv(compose(["recipe=tiny_cpu_moe", "train.entry='-m a b'"]))
    cmd = torchrun_command(cfg, python="python3")
    assert cmd[:5] == ["python3", "-m", "torch.distributed.run", "--nproc-per-node=2", "--standalone"]
    assert cmd[-len(megatron_argv(cfg)):] == megatron_argv(cfg)
    two = compose(["recipe=dsv3_proxy_local", "nodes=2"])
    with pytest.raises(InvalidUsageError, match="MASTER_ADDR"):
        torchrun_command(two, environ={})
    cmd = torchrun_command(two, python="p", environ={"MASTER_ADDR": "h0", "NODE_RANK": "1"})
    assert "--nnodes=2" in cmd and "--node-rank=1" in cmd and "--master-addr=h0" in cmd
    env = child_env(cfg, environ={"PYTHONPATH": "/x"})
    assert env["PYTHONPATH"].split(os.pathsep)[:2] == [str(ROOT), "/x"] and env["UCCL_MOE_BACKEND"] == "reference"


# ----------------------------------------------------------------------------------- Megatron's own parser


def _items(overrides_list: list[list[str]]) -> list[dict]:
    items = []
    for overrides in overrides_list:
        cfg = compose(overrides)
        items.append({"name": " ".join(overrides), "argv": megatron_argv(cfg), "dests": sorted(megatron_dests(cfg)),
                      "expected": megatron_dests(cfg), "num_layers": cfg.model.num_layers})
    return items


def _run_child(items: list[dict], install: bool) -> dict | None:
    """Parse in a child interpreter; None when megatron.training is not importable there."""
    env = dict(os.environ)
    extra = os.environ.get("UCCL_MOE_TEST_MEGATRON_PATH", "")
    env["PYTHONPATH"] = os.pathsep.join([p for p in (extra, str(ROOT), env.get("PYTHONPATH", "")) if p])
    req = {"install": install, "items": [{k: it[k] for k in ("name", "argv", "dests")} for it in items]}
    proc = subprocess.run([sys.executable, str(CHILD)], input=json.dumps(req), capture_output=True, text=True,
                          env=env, timeout=600, check=False)
    if proc.returncode == 3:
        return None
    assert proc.returncode == 0, f"parser child failed:\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _same(key: str, want, got, num_layers: int) -> bool:
    if key == "moe_layer_freq":
        got_list = parse_moe_layer_freq(str(got), num_layers) if isinstance(got, (int, str)) else list(got)
        return parse_moe_layer_freq(str(want), num_layers) == got_list
    if isinstance(got, list) and not isinstance(want, list) and len(got) == 1:
        got = got[0]
    if isinstance(want, float) and isinstance(got, (int, float)):
        return abs(want - got) <= 1e-12 * max(1.0, abs(want))
    return want == got


def _check_parsed(items: list[dict], parsed: dict) -> None:
    problems = []
    for item, res in zip(items, parsed["results"]):
        assert res["name"] == item["name"]
        if "error" in res:
            problems.append(f"{item['name']}: Megatron's parser rejected the argv: {res['error']}")
            continue
        for k, want in item["expected"].items():
            got = res["values"][k]
            if not _same(k, want, got, item["num_layers"]):
                problems.append(f"{item['name']}: args.{k} = {got!r}, rendered {want!r}")
    assert not problems, "\n".join(problems)


# Arguments only megatron.training defines (no megatron-core config dataclass field mirrors them).
TRAINING_LOOP_ARGS = {
    "train_iters", "lr_decay_style", "lr_warmup_iters", "lr_decay_iters", "seed", "mock_data", "data_path",
    "log_interval", "eval_iters", "eval_interval", "save", "load", "save_interval", "tensorboard_dir",
    "log_throughput", "distributed_timeout_minutes", "micro_batch_size", "global_batch_size", "seq_length",
    "max_position_embeddings", "tokenizer_type", "tokenizer_model", "vocab_size", "make_vocab_size_divisible_by",
    "untie_embeddings_and_output_weights", "position_embedding_type", "num_experts", "swiglu",
    "num_layers_per_virtual_pipeline_stage", "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
    "distributed_backend", "transformer_impl", "min_lr", "group_query_attention",
    "moe_uccl_num_sms", "moe_uccl_nvl_bytes", "moe_uccl_rdma_bytes", "moe_uccl_backend",
}


def _check_against_core_dataclasses(items: list[dict]) -> None:
    """Fallback when megatron.training is absent: every dest is a megatron-core config field (value within its
    Literal choices) or a known training-loop argument."""
    assert importlib.util.find_spec("megatron.core") is not None, (
        "megatron-core is not installed: pip install megatron-core==0.16.1 (Python 3.10/3.11) or >= 0.17 (3.12+)"
    )
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    fields = {}
    for cls in (MLATransformerConfig, OptimizerConfig, DistributedDataParallelConfig):
        fields.update({f.name: f for f in dataclasses.fields(cls)})
    problems = []
    for item in items:
        for k, v in item["expected"].items():
            if k in fields:
                tp = fields[k].type
                args = typing.get_args(tp)
                lits = [a for a in ([tp] + list(args)) if typing.get_origin(a) is typing.Literal]
                choices = set(typing.get_args(lits[0])) if lits else None
                if k == "moe_token_dispatcher_type" and choices is not None:
                    choices.add("uccl")  # added by uccl_moe.megatron.install()
                if choices is not None and v not in choices:
                    problems.append(f"{item['name']}: {k}={v!r} not in megatron-core's choices {sorted(choices)}")
            elif k not in TRAINING_LOOP_ARGS:
                problems.append(f"{item['name']}: {k} is neither a megatron-core config field nor a known "
                                f"training argument")
    assert not problems, "\n".join(problems)


def test_rendered_args_parse_with_megatrons_parser():
    """Every recipe x platform x baseline dispatcher: plain Megatron must accept the argv and store our values."""
    combos = [[f"recipe={r}", f"platform={p}", f"dispatcher={d}"]
              for r in RECIPES for p in available("platform") for d in BASELINES]
    items = _items(combos)
    parsed = _run_child(items, install=False)
    if parsed is None:
        _check_against_core_dataclasses(items)
        return
    _check_parsed(items, parsed)


def test_uccl_args_parse_after_install():
    """With uccl_moe.megatron.install() Megatron accepts --moe-token-dispatcher-type uccl and --moe-uccl-*."""
    if not _has("uccl_moe.megatron"):
        pytest.fail("uccl_moe.megatron is missing: it comes from the Megatron-integration branch (issue 3); merge it "
                    "before running this test")
    combos = [[f"recipe={r}", f"platform={p}", "dispatcher=uccl"] for r in RECIPES for p in available("platform")]
    items = _items(combos)
    parsed = _run_child(items, install=True)
    if parsed is None:
        _check_against_core_dataclasses(items)
        return
    assert parsed["installed"]
    _check_parsed(items, parsed)


def _has(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


def test_default_entry_parses_every_cpu_runnable_recipe():
    """``uccl_moe.train.train_gpt`` (the default train.entry) accepts what the launcher renders."""
    if not _has("uccl_moe.train.train_gpt"):
        pytest.fail("uccl_moe.train.train_gpt is missing: it comes from the Megatron-integration branch (issue 3)")
    from uccl_moe.train.train_gpt import build_parser

    problems = []
    for overrides in (["recipe=tiny_cpu_moe"], ["recipe=dsv3_proxy_local"], ["recipe=dsv3_h200_efa_4n"],
                      ["recipe=tiny_cpu_moe", "dispatcher=alltoall"]):
        argv = megatron_argv(compose(overrides))
        _, unknown = build_parser().parse_known_args(argv)
        if unknown:
            problems.append(f"{' '.join(overrides)}: train_gpt does not accept {unknown}")
    assert not problems, "\n".join(problems)
