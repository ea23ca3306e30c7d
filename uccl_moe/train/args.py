"""The command line of :mod:`uccl_moe.train.train_gpt`: every TransformerConfig field as a Megatron-style flag,
Megatron's aliases, the training and profiling flags, and the ``--moe-uccl-*`` knobs."""

from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any, Optional

from ..megatron.install import widen_parser
from .profiler import PROFILE_FLAGS

DESCRIPTION = ("A small, self-contained GPT-MoE training entry on Megatron-Core's own model, DDP, optimizer and "
               "schedules.")

# Megatron-LM flag spellings that are not a TransformerConfig field name: flag -> (dest, value or None = parsed).
_ALIASES: dict[str, tuple[str, Any]] = {
    "--num-experts": ("num_moe_experts", None),
    "--swiglu": ("swiglu", True),
    "--disable-bias-linear": ("add_bias_linear", False),
    "--norm-epsilon": ("layernorm_epsilon", float),
    "--no-bias-linear": ("add_bias_linear", False),
    "--squared-relu": ("squared_relu", True),
}

# Training flags of this entry (argparse kwargs). Accepted-but-ignored Megatron flags are listed in _IGNORED.
_TRAIN_FLAGS: dict[str, dict[str, Any]] = {
    "--micro-batch-size": dict(type=int, default=2),
    "--global-batch-size": dict(type=int, default=None, help="default: micro batch x data-parallel size"),
    "--seq-length": dict(type=int, default=64),
    "--max-position-embeddings": dict(type=int, default=None, help="default: --seq-length"),
    "--vocab-size": dict(type=int, default=128),
    "--train-iters": dict(type=int, default=10),
    "--lr": dict(type=float, default=1e-3),
    "--min-lr": dict(type=float, default=0.0),
    "--lr-decay-style": dict(choices=["constant", "linear", "cosine"], default="constant"),
    "--lr-warmup-iters": dict(type=int, default=0),
    "--rotary-base": dict(type=int, default=10000),
    "--distributed-timeout-minutes": dict(type=int, default=10),
    "--log-throughput": dict(action="store_true", help="add tokens/s to each log line"),
    "--weight-decay": dict(type=float, default=0.01),
    "--clip-grad": dict(type=float, default=1.0),
    "--adam-beta1": dict(type=float, default=0.9),
    "--adam-beta2": dict(type=float, default=0.999),
    "--adam-eps": dict(type=float, default=1e-8),
    "--seed": dict(type=int, default=1234),
    "--log-interval": dict(type=int, default=1),
    "--position-embedding-type": dict(choices=["learned_absolute", "rope"], default="learned_absolute"),
    "--transformer-impl": dict(choices=["local", "transformer_engine"], default=None,
                               help="default: transformer_engine when TE is importable and CUDA is present"),
    "--untie-embeddings-and-output-weights": dict(action="store_true"),
    "--use-distributed-optimizer": dict(action="store_true"),
    "--loss-log": dict(type=str, default=None, help="append one JSON line per step here (last rank)"),
    "--log-memory": dict(action="store_true", help="add this rank's peak memory (MiB) to each log line"),
    "--log-cpu": dict(action="store_true",
                      help="add the CPU seconds (user+sys, all threads) this rank's process spent in the step"),
    "--log-moe-timing": dict(action="store_true",
                             help="add forward dispatch/combine ms per MoE layer to each log line (step_stats)"),
    "--log-dir": dict(type=str, default=None,
                      help="copy each rank's output to DIR/rank<N>.log; write the run summary to DIR/summary.json"),
}
# Accepted for compatibility with Megatron-LM command lines and ignored: the data is synthetic, the backend follows
# the device (NCCL on GPUs, gloo on CPU), and there is no evaluation loop.
_IGNORED = ("--mock-data", "--tokenizer-type", "--no-load-optim", "--no-load-rng", "--distributed-backend",
            "--eval-iters", "--eval-interval")
_IGNORED_WITH_VALUE = ("--tokenizer-type", "--distributed-backend", "--eval-iters", "--eval-interval")


def _field_kwargs(field: dataclasses.Field[Any]) -> Optional[dict[str, Any]]:
    """argparse kwargs for a TransformerConfig field, or None if the field is not CLI-representable."""
    tp = field.type
    if isinstance(tp, str):  # postponed annotations are not used by megatron-core, but be safe
        return None
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if field.name == "moe_layer_freq":  # Union[int, List[int]]: an int or Megatron's list expression
        return {"type": _parse_layer_freq}
    if origin is typing.Union:  # Optional[X], or Union[X, List[X]] (the scalar form is taken from the CLI)
        rest = [a for a in args if a is not type(None)]
        scalars = [a for a in rest if a in (int, float, str, bool) or typing.get_origin(a) is typing.Literal]
        if not scalars:
            return None
        tp = scalars[0]
        origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Literal:
        return {"choices": list(args), "type": type(args[0])}
    if tp is bool:
        return {"bool": True}
    if tp in (int, float, str):
        return {"type": tp}
    return None


def build_parser() -> argparse.ArgumentParser:
    """The parser of this entry: TransformerConfig fields, Megatron aliases, training flags and uccl knobs."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    p = argparse.ArgumentParser(prog="python -m uccl_moe.train.train_gpt", allow_abbrev=False,
                                description=DESCRIPTION)
    train = p.add_argument_group("training (uccl_moe.train.train_gpt)")
    for flag, kw in _TRAIN_FLAGS.items():
        train.add_argument(flag, **kw)
    prof = p.add_argument_group("profiling (Megatron-LM's flags; uccl_moe.train.profiler)")
    for flag, kw in PROFILE_FLAGS.items():
        prof.add_argument(flag, **kw)
    for flag in _IGNORED:
        if flag in _IGNORED_WITH_VALUE:
            train.add_argument(flag, default=None, help=argparse.SUPPRESS)
        else:
            train.add_argument(flag, action="store_true", help=argparse.SUPPRESS)
    model = p.add_argument_group("model / parallelism (TransformerConfig fields)")
    seen = {a.dest for a in p._actions}
    for field in dataclasses.fields(TransformerConfig):
        if field.name in seen or not field.init:
            continue
        field_kw = _field_kwargs(field)
        if field_kw is None:
            continue
        flag = "--" + field.name.replace("_", "-")
        dest = "cfg__" + field.name
        if field_kw.get("bool"):
            model.add_argument(flag, dest=dest, action="store_const", const=True, default=None)
            model.add_argument("--no-" + field.name.replace("_", "-"), dest=dest, action="store_const", const=False)
        else:
            model.add_argument(flag, dest=dest, default=None, **field_kw)
    for flag, (dest, value) in _ALIASES.items():
        if value is None or value is float:
            model.add_argument(flag, dest="cfg__" + dest, type=int if value is None else float, default=None)
        else:
            model.add_argument(flag, dest="alias__" + dest, action="store_const", const=value, default=None)
    return widen_parser(p, dest="cfg__moe_token_dispatcher_type")


def _parse_layer_freq(text: str) -> Any:
    t = text.strip()
    if t.isdigit():
        return int(t)
    if not all(ch in "0123456789[]()*+, " for ch in t):
        raise argparse.ArgumentTypeError(
            f"--moe-layer-freq {text!r}: give an int or a list expression like ([0]*3+[1]*5)"
        )
    value = eval(t, {"__builtins__": {}}, {})  # noqa: S307 - only digits, brackets, * + , survive the filter above
    if not isinstance(value, list):
        raise argparse.ArgumentTypeError(f"--moe-layer-freq {text!r} is not a list")
    return value
