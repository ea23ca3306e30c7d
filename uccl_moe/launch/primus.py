"""Render a Primus experiment YAML and the ``primus-cli`` command line that runs it with our entry script.

Layout (Primus ``docs/02-user-guide/configuration-system.md``): meta keys ``work_group``, ``user_name``,
``exp_name``, ``workspace`` (written as ``${PRIMUS_X:default}`` so Primus's env overrides keep working), a
top-level ``env:`` block (applied in every worker before distributed init), and ``modules.pre_trainer`` with
``framework: megatron``, the module preset, the model preset and ``overrides``: our Megatron fields with their
argument names (Primus keys are Megatron dests; booleans are YAML booleans).

Primus only imports patch modules under its own package, so the dispatcher is activated by running Primus
through our entry script (``primus-cli direct --script <uccl_moe.megatron.primus_entry's file>``), which imports
the uccl-moe Primus patches and then hands over to Primus's CLI.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

from .megatron_args import arg_fields, extra_args_values, launch_env, megatron_args, megatron_dests
from .provenance import comment_block, provenance_lines

REQUIRED_KEYS: tuple[str, ...] = ("work_group", "user_name", "exp_name", "workspace", "modules")
"""Top-level keys Primus's parser requires (PrimusParser.parse_meta_info) plus the module block."""

ENTRY_VAR = "UCCL_MOE_PRIMUS_ENTRY"


def primus_overrides(cfg: Any) -> dict[str, Any]:
    """``modules.pre_trainer.overrides``: every Megatron field of `cfg` with a value (booleans included, so the
    Primus presets cannot turn on what the recipe left off)."""
    out: dict[str, Any] = {}
    for name, v in megatron_args(cfg):
        if name == "moe_layer_freq" and re.fullmatch(r"[0-9]+", str(v)):
            v = int(v)  # Primus bypasses argparse types: an int stays an int
        out[name] = v
    # Primus fills Megatron's namespace by dest; where the dest differs from the argument name give both (unknown
    # keys are merged, never rejected): norm_epsilon + layernorm_epsilon, disable_bias_linear + add_bias_linear.
    dests = megatron_dests(cfg)
    for f, _ in arg_fields(cfg):
        dest = f.metadata.get("dest")
        if dest:
            out[dest] = dests[dest]
    out.update(extra_args_values(cfg))
    return out


def primus_experiment(cfg: Any) -> dict[str, Any]:
    """The experiment as a dict (what the YAML holds)."""
    p = cfg.primus
    exp: dict[str, Any] = {
        "work_group": f"${{PRIMUS_TEAM:{p.work_group}}}",
        "user_name": f"${{PRIMUS_USER:{p.user_name}}}",
        "exp_name": f"${{PRIMUS_EXP_NAME:{p.exp_name}}}",
        "workspace": f"${{PRIMUS_WORKSPACE:{p.workspace}}}",
    }
    env = launch_env(cfg)
    if env:
        exp["env"] = env
    exp["modules"] = {
        "pre_trainer": {
            "framework": "megatron",
            "config": "pre_trainer.yaml",
            "model": str(cfg.model.primus_model),
            "overrides": primus_overrides(cfg),
        }
    }
    return exp


def primus_command(cfg: Any, exp_yaml: str) -> list[str]:
    """The ``primus-cli direct`` command (one node's launcher; the sbatch script runs it on every node).

    ``$UCCL_MOE_PRIMUS_ENTRY`` holds the path of our entry script (see :func:`entry_lookup`).
    """
    return [str(cfg.primus.primus_cli), "direct", "--script", f'"${ENTRY_VAR}"', "--", "train", "pretrain",
            "--config", f'"{exp_yaml}"']


def entry_lookup(cfg: Any) -> str:
    """Shell line that sets ``$UCCL_MOE_PRIMUS_ENTRY`` to the file of our Primus entry module."""
    mod = str(cfg.primus.entry_module)
    return (f'{ENTRY_VAR}="${{{ENTRY_VAR}:-$("${{PYTHON:-python}}" -c '
            f"'import {mod} as m; print(m.__file__)')}}\"")


def render_primus_yaml(cfg: Any, command_lines: list[str], summary: str = "") -> str:
    """The experiment YAML text, headed by the provenance and the command that runs it."""
    header = provenance_lines("primus", cfg, summary) + ["run it with:"] + [f"  {c}" for c in command_lines]
    body: str = yaml.safe_dump(primus_experiment(cfg), sort_keys=False, default_flow_style=False, width=120)
    return comment_block(header) + body
