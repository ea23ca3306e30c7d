"""Render a composed config into Megatron's argv and the launch environment.

Every schema field marked as a Megatron argument is rendered as ``--name-with-hyphens value`` (see
:mod:`uccl_moe.config.schema` for the rule and its exceptions); ``None`` values are left to Megatron's defaults.
"""

from __future__ import annotations

import dataclasses
import enum
import shlex
from collections.abc import Iterator
from typing import Any

import yaml

from ..config import schema
from ..config.validate import knob_env

ARG_GROUPS: tuple[str, ...] = ("model", "parallel", "dispatcher", "train", "platform")
"""Groups whose fields render as Megatron arguments, in argv order."""


def flag(name: str) -> str:
    """``moe_router_topk`` -> ``--moe-router-topk``."""
    return "--" + name.replace("_", "-")


def _value(v: Any) -> str:
    if isinstance(v, float):
        return repr(v)
    return str(v)


def arg_fields(cfg: Any) -> Iterator[tuple[dataclasses.Field[Any], Any]]:
    """``(schema field, value)`` of every field that renders as a Megatron argument, in argv order; None values
    left out, enum members turned into their plain values."""
    for group in ARG_GROUPS:
        node = cfg[group]
        for f in dataclasses.fields(schema.GROUPS[group]):
            if not f.metadata.get("arg"):
                continue
            v = node[f.name]
            if v is None:
                continue
            yield f, (v.value if isinstance(v, enum.Enum) else v)


def megatron_args(cfg: Any) -> list[tuple[str, Any]]:
    """The ``(dest, value)`` pairs that render as arguments (None left out), in argv order. Enum values are
    plain strings; booleans stay booleans."""
    return [(f.name, v) for f, v in arg_fields(cfg)]


def megatron_dests(cfg: Any) -> dict[str, Any]:
    """What Megatron's parser must produce for `cfg`: ``{args attribute: value}`` (``dest``/``invert`` metadata
    applied). Used by the tests that parse the rendered argv with Megatron's own parser."""
    return {f.metadata.get("dest", f.name): (not v) if f.metadata.get("invert") else v for f, v in arg_fields(cfg)}


def megatron_argv(cfg: Any) -> list[str]:
    """Megatron command-line arguments for `cfg` (no program name)."""
    argv: list[str] = []
    for f, v in arg_fields(cfg):
        if isinstance(v, bool):
            false_flag = f.metadata.get("false_flag")
            if false_flag:
                if not v:
                    argv.append(false_flag)
            elif v:
                argv.append(flag(f.name))
            continue
        argv += [flag(f.name), _value(v)]
    argv += [str(a) for a in cfg.platform.extra_args]
    argv += [str(a) for a in cfg.train.extra_args]
    return argv


QUEUES = "CUDA_DEVICE_MAX_CONNECTIONS"
"""The driver's number of hardware queues per GPU context (read once, when the process makes its context)."""


def hardware_queues(cfg: Any) -> tuple[str | None, str]:
    """``(CUDA_DEVICE_MAX_CONNECTIONS to export or None, why)`` for `cfg`'s layout, where the platform's env does not
    set it. Megatron-Core 0.19 (``megatron/training/arguments.py``) asserts ``1`` with tensor or context parallelism on
    Hopper and older GPUs, unless FSDP (which asserts it is not ``1``) or ``--overlap-moe-expert-parallel-comm`` (its
    MoE README asks for ``32``) is on; every other layout is left to the driver's default (several queues), because
    with one queue the work our copy-engine ops leave beside the caller's stream runs in line with it
    (docs/user_guide.md, "Hardware queues")."""
    if cfg.platform.accelerator == schema.Accelerator.cpu:
        return None, "no GPU"
    extra = extra_args_values(cfg)  # appended last: they win
    if "overlap_moe_expert_parallel_comm" in extra:
        return "32", "--overlap-moe-expert-parallel-comm (Megatron's MoE README asks for 32)"
    if extra.keys() & {"use_torch_fsdp2", "use_megatron_fsdp"}:
        return None, "FSDP (Megatron asserts that it is not 1)"
    tp = _as_int(extra.get("tensor_model_parallel_size"), cfg.parallel.tensor_model_parallel_size)
    cp = _as_int(extra.get("context_parallel_size"), cfg.parallel.context_parallel_size)
    if tp > 1 or cp > 1:
        # The layout is known here, the GPU is not: 1 on Blackwell too, where Megatron would not need it.
        return "1", f"TP {tp}, CP {cp}: Megatron asserts 1 on Hopper and older GPUs"
    return None, "TP = CP = 1: Megatron asks for one queue only with TP or CP > 1"


def queues_comment(cfg: Any) -> str | None:
    """A ``# CUDA_DEVICE_MAX_CONNECTIONS ...`` line saying how the launch chose it (None on CPU)."""
    if QUEUES in cfg.platform.env:
        return f"# {QUEUES} as platform.env sets it (the layout alone: {hardware_queues(cfg)[0] or 'not set'})"
    if cfg.platform.accelerator == schema.Accelerator.cpu:
        return None
    queues, why = hardware_queues(cfg)
    chosen = "not set (several hardware queues)" if queues is None else f"set to {queues}"
    return f"# {QUEUES} {chosen}: {why}"


def extra_args_values(cfg: Any) -> dict[str, Any]:
    """platform.extra_args then train.extra_args by name, the last value winning, as Megatron's parser reads them:
    ``["--foo-bar", "3", "--baz", "--qux=x"]`` -> ``{"foo_bar": 3, "baz": True, "qux": "x"}`` (values parsed as YAML
    scalars)."""
    args = [str(a) for a in [*cfg.platform.extra_args, *cfg.train.extra_args]]
    out: dict[str, Any] = {}
    i = 0
    while i < len(args):
        a = args[i]
        i += 1
        if not a.startswith("--"):
            continue
        name, eq, text = a[2:].partition("=")
        if not eq and i < len(args) and not args[i].startswith("--"):
            text, eq, i = args[i], "=", i + 1
        out[name.replace("-", "_")] = yaml.safe_load(text) if eq else True
    return out


def _as_int(value: Any, default: int) -> int:
    """`value` where it is a whole number (not a bool), else `default` (Megatron's parser names a bad one)."""
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def launch_env(cfg: Any) -> dict[str, str]:
    """Environment a run exports: platform.env, plus platform.uccl_env and the dispatcher's knob fields when the
    dispatcher is uccl (explicit dispatcher fields win), plus ``CUDA_DEVICE_MAX_CONNECTIONS`` as the layout needs it
    (:func:`hardware_queues`) where platform.env does not set it. Sorted by name."""
    env = {str(k): str(v) for k, v in cfg.platform.env.items()}
    if QUEUES not in env:
        queues, _ = hardware_queues(cfg)
        if queues is not None:
            env[QUEUES] = queues
    if cfg.dispatcher.moe_token_dispatcher_type == schema.DispatcherType.uccl:
        env.update({str(k): str(v) for k, v in cfg.platform.uccl_env.items()})
        env.update(knob_env(cfg.dispatcher))
    return dict(sorted(env.items()))


def entry_argv(cfg: Any) -> list[str]:
    """``train.entry`` as argv tokens: ``-m uccl_moe.train.train_gpt`` or ``path/to/pretrain_gpt.py``."""
    tokens = shlex.split(str(cfg.train.entry))
    if not tokens or (tokens[0] == "-m" and len(tokens) != 2) or (tokens[0] != "-m" and len(tokens) != 1):
        from ..errors import InvalidUsageError

        raise InvalidUsageError(
            f"train.entry={cfg.train.entry!r} must be '-m <module>' or one script path, e.g. "
            f"'-m uccl_moe.train.train_gpt' or '/path/to/Megatron-LM/pretrain_gpt.py'"
        )
    return tokens


def entry_command(cfg: Any) -> list[str]:
    """What each rank runs after the python interpreter and before the Megatron arguments.

    * ``train.entry = "-m <module>"`` (default ``-m uccl_moe.train.train_gpt``, our wheel-only GPT-MoE entry, which
      calls ``uccl_moe.megatron.install()`` itself): ``-m <module>``.
    * ``train.entry = <script path>`` (e.g. Megatron-LM's ``pretrain_gpt.py``): the installing wrapper,
      ``-m uccl_moe.megatron.pretrain <script>``, which calls ``install()`` (adds ``--moe-token-dispatcher-type uccl``
      and the ``--moe-uccl-*`` arguments) and then runs the script.
    """
    entry = entry_argv(cfg)
    if entry[0] == "-m":
        return entry
    return ["-m", "uccl_moe.megatron.pretrain", *entry]


def training_command(cfg: Any) -> list[str]:
    """What each rank runs after the python interpreter: :func:`entry_command` + :func:`megatron_argv`."""
    return [*entry_command(cfg), *megatron_argv(cfg)]
