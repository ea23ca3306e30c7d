"""A tiny GPT-MoE trains with --moe-token-dispatcher-type uccl through Megatron's GPTModel, DDP and loop (CPU).

Two ranks, EP 2: the loss must fall, and every step must match the same run with Megatron's allgather dispatcher.
"""

from __future__ import annotations

import math

import pytest

pytest.importorskip("megatron.core", reason='megatron-core is not installed: pip install -e ".[train]"')

from helpers.mp import run_ranks_on as run_ranks  # noqa: E402

pytestmark = [pytest.mark.mp, pytest.mark.timeout(600)]

ARGS = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--num-experts", "4",
    "--moe-router-topk", "2", "--expert-model-parallel-size", "2", "--moe-ffn-hidden-size", "32",
    "--moe-router-dtype", "fp32", "--moe-aux-loss-coeff", "0.01", "--moe-shared-expert-intermediate-size", "32",
    "--disable-bias-linear",
    "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "8", "--vocab-size", "64",
    "--train-iters", "12", "--lr", "3e-3", "--hidden-dropout", "0", "--attention-dropout", "0",
]


def _train_rank(rank, world, dispatcher):
    from uccl_moe.megatron.dispatcher import UCCLTokenDispatcher
    from uccl_moe.train import train_gpt

    extra = ["--moe-uccl-backend", "reference"] if dispatcher == "uccl" else []
    rows = train_gpt.train(ARGS + ["--moe-token-dispatcher-type", dispatcher] + extra)
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    return [r["loss"] for r in rows], UCCLTokenDispatcher.__name__


def test_tiny_gpt_moe_trains_with_uccl_and_matches_allgather():
    uccl = run_ranks(_train_rank, 2, "uccl")
    ref = run_ranks(_train_rank, 2, "allgather")
    losses = uccl[0][0]
    assert len(losses) == 12 and all(math.isfinite(x) for x in losses)
    assert sum(losses[-3:]) / 3 < losses[0] - 0.3, f"loss did not fall: {losses}"
    for a, b in zip(losses, ref[0][0]):
        assert abs(a - b) <= 1e-4 * max(1.0, abs(b)), f"uccl {losses} vs allgather {ref[0][0]}"


def test_cli_rejects_unknown_flags_and_bad_batch(capsys):
    from uccl_moe.errors import InvalidUsageError
    from uccl_moe.train import train_gpt

    p = train_gpt.build_parser()
    with pytest.raises(SystemExit):
        p.parse_args(["--num-layers", "2", "--no-such-flag", "1"])
    a = p.parse_args(["--num-experts", "8", "--swiglu", "--disable-bias-linear", "--moe-layer-freq", "([0]*1+[1]*3)",
                      "--moe-token-dispatcher-type", "uccl", "--no-masked-softmax-fusion"])
    assert a.cfg__num_moe_experts == 8 and a.alias__swiglu is True and a.alias__add_bias_linear is False
    assert a.cfg__moe_layer_freq == [0, 1, 1, 1] and a.cfg__masked_softmax_fusion is False
    with pytest.raises(SystemExit):
        p.parse_args(["--moe-layer-freq", "__import__('os')"])
    del InvalidUsageError, capsys


def test_every_recipe_renders_flags_train_gpt_accepts():
    """The launcher (`uccl-moe train`) renders Megatron argv from the Hydra recipes; train_gpt must take all of it."""
    compose = pytest.importorskip("uccl_moe.config.compose")
    from uccl_moe.launch.megatron_args import megatron_argv
    from uccl_moe.train import train_gpt

    recipes = compose.available("recipe")
    assert recipes
    for recipe in recipes:
        argv = megatron_argv(compose.compose([f"recipe={recipe}"]))
        args = train_gpt.build_parser().parse_args(argv)  # SystemExit on any unknown flag
        assert args.cfg__moe_token_dispatcher_type in ("uccl", "alltoall", "flex", "allgather"), recipe


def test_lr_schedule_shapes():
    import argparse

    from uccl_moe.train.train_gpt import lr_at

    a = argparse.Namespace(lr=1.0, min_lr=0.1, lr_warmup_iters=2, lr_decay_style="cosine", train_iters=12)
    assert [round(lr_at(a, i), 6) for i in (1, 2)] == [0.5, 1.0]
    assert lr_at(a, 12) == pytest.approx(0.1) and 0.1 < lr_at(a, 7) < 1.0
    a.lr_decay_style = "linear"
    assert lr_at(a, 7) == pytest.approx(0.1 + 0.9 * 0.5)
    a.lr_decay_style = "constant"
    assert lr_at(a, 9) == 1.0


def test_a_cpu_run_is_quiet_about_what_a_cpu_never_has():
    """Without CUDA, importing train_gpt (which imports Megatron-Core) prints no TransformerEngine/Apex warnings, and
    Megatron's CUDA RNG tracker does not log its CPU-RNG warning (a caller's PYTHONWARNINGS keeps the warnings)."""
    import os
    import subprocess
    import sys

    import torch

    if torch.cuda.is_available():
        pytest.skip("checks the CPU run's filters; this machine has CUDA")
    code = ("import logging, uccl_moe.train.train_gpt; "
            "print(logging.getLogger('megatron.core.tensor_parallel.random').isEnabledFor(logging.WARNING))")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    quiet = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stdout.strip() == "False" and "Apex" not in quiet.stderr, quiet.stderr
    loud = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**env, "PYTHONWARNINGS": "default"})
    assert loud.returncode == 0 and "Apex" in loud.stderr, loud.stderr
