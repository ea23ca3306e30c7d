"""Render a Slurm batch script: one srun task per node, torchrun forks the node's ranks.

Shape (shared/reference/primus_recipes.md §5): ``--ntasks-per-node=1``, ``--exclusive``, all the node's CPUs
to the one task (NCCL/RCCL network proxies and uccl-moe's CPU proxy threads starve on the default single core),
``MASTER_ADDR`` = first host of ``scontrol show hostnames``, node rank from ``$SLURM_NODEID``, the platform env
exported before srun. The Megatron arguments sit in a bash array, one per line, so the script stays readable and
quoting-safe.
"""

from __future__ import annotations

import shlex
from typing import Any

from ..config import schema
from .megatron_args import entry_command, launch_env, megatron_argv, queues_comment
from .provenance import comment_block, provenance_lines


def _sbatch_header(cfg: Any) -> list[str]:
    s, pl = cfg.slurm, cfg.platform
    lines = [
        f"--job-name={s.job_name}",
        f"--nodes={cfg.nodes}",
        "--ntasks-per-node=1",
    ]
    if pl.accelerator != schema.Accelerator.cpu:
        lines.append(f"--gpus-per-node={pl.gpus_per_node}")
    if pl.cpus_per_node > 0:
        lines.append(f"--cpus-per-task={pl.cpus_per_node}")
    if s.exclusive:
        lines.append("--exclusive")
    lines += [f"--time={s.time}", f"--output={s.output}"]
    for key in ("partition", "account", "qos"):
        if s[key]:
            lines.append(f"--{key}={s[key]}")
    lines += [str(a) for a in s.sbatch_args]
    return [f"#SBATCH {x}" for x in lines]


def _preamble(cfg: Any, summary: str, subcommand: str) -> list[str]:
    out = ["#!/bin/bash"]
    out += _sbatch_header(cfg)
    out.append(comment_block(provenance_lines(subcommand, cfg, summary)).rstrip("\n"))
    out += ["set -euo pipefail", ""]
    out += [str(x) for x in cfg.slurm.setup]
    out += [
        'MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"',
        f'MASTER_PORT="${{MASTER_PORT:-{cfg.slurm.master_port}}}"',
        f'PYTHON="${{PYTHON:-{cfg.slurm.python}}}"',
        "export MASTER_ADDR MASTER_PORT PYTHON",
    ]
    return out


def _preflight(cfg: Any) -> list[str]:
    """The slurm.preflight step: ``uccl-moe doctor --pair`` on every rank, with the platform env in force, on a port
    next to the training job's; its failure (exit 1, each failed test named with its fix) stops the script."""
    cmd = (
        '"$PYTHON" -m torch.distributed.run --nnodes="$SLURM_NNODES" '
        f"--nproc-per-node={cfg.platform.gpus_per_node} "
        '--node-rank="$SLURM_NODEID" --master-addr="$MASTER_ADDR" --master-port="$((MASTER_PORT + 1))" '
        "-m uccl_moe.cli doctor --pair"
    )
    return [
        "# pre-flight (slurm.preflight): transport self-test on every rank before training (uccl-moe doctor --pair)",
        "# shellcheck disable=SC2016  # expanded inside each srun task, not here",
        'srun --ntasks="$SLURM_NNODES" --ntasks-per-node=1 --kill-on-bad-exit=1 \\',
        f"  bash -c 'exec {cmd}'",
    ]


def render_sbatch(cfg: Any, summary: str = "") -> str:
    """The sbatch script text for composed config `cfg` (``summary``: validation summary recorded as comments)."""
    out = _preamble(cfg, summary, "slurm")
    env = launch_env(cfg)
    if env:
        out += ["", f"# platform {cfg.platform.name} environment (+ dispatcher {cfg.dispatcher.name} knobs)"]
        out += [f"export {k}={shlex.quote(v)}" for k, v in env.items()]
    queues = queues_comment(cfg)
    if queues is not None:
        out.append(queues)
    if cfg.slurm.preflight:
        out += ["", *_preflight(cfg)]
    head = entry_command(cfg)  # -m module | -m uccl_moe.megatron.pretrain script
    out += ["", "MEGATRON_ARGS=("]
    argv = megatron_argv(cfg)
    i = 0
    while i < len(argv):  # one "--flag value" per line
        if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            out.append(f"  {shlex.quote(argv[i])} {shlex.quote(argv[i + 1])}")
            i += 2
        else:
            out.append(f"  {shlex.quote(argv[i])}")
            i += 1
    out += [")", ""]
    node_cmd = (
        '"$PYTHON" -m torch.distributed.run --nnodes="$SLURM_NNODES" '
        f"--nproc-per-node={cfg.platform.gpus_per_node} "
        '--node-rank="$SLURM_NODEID" --master-addr="$MASTER_ADDR" --master-port="$MASTER_PORT" '
        + " ".join(shlex.quote(t) for t in head)
        + ' "$@"'
    )
    out += [
        "# one task per node; torchrun forks the node's ranks ($SLURM_NODEID is the task's node)",
        "# shellcheck disable=SC2016  # expanded inside each srun task, not here",
        'srun --ntasks="$SLURM_NNODES" --ntasks-per-node=1 --kill-on-bad-exit=1 \\',
        f"  bash -c 'exec {node_cmd}' _ \"${{MEGATRON_ARGS[@]}}\"",
    ]
    return "\n".join(out) + "\n"


def render_primus_sbatch(cfg: Any, exp_yaml: str, summary: str = "") -> str:
    """An sbatch script that runs ``primus-cli direct`` with our entry script on every node of the allocation.

    ``primus-cli direct`` reads NNODES / NODE_RANK / GPUS_PER_NODE / MASTER_ADDR / MASTER_PORT; the platform env
    travels in the experiment YAML's ``env:`` block. `exp_yaml` is the experiment's path from the submit directory.
    """
    from .primus import entry_lookup, primus_command

    out = _preamble(cfg, summary, "primus")
    command = primus_command(cfg, "$EXP_YAML")
    out += [
        f'EXP_YAML="${{EXP_YAML:-{exp_yaml}}}"  # from the submit directory',
        entry_lookup(cfg),
        f"GPUS_PER_NODE={cfg.platform.gpus_per_node}",
        "export EXP_YAML GPUS_PER_NODE UCCL_MOE_PRIMUS_ENTRY",
        "",
        "# one primus-cli launcher per node ($SLURM_NODEID is the task's node)",
        "# shellcheck disable=SC2016  # expanded inside each srun task, not here",
        'srun --ntasks="$SLURM_NNODES" --ntasks-per-node=1 --kill-on-bad-exit=1 \\',
        "  bash -c 'NNODES=\"$SLURM_NNODES\" NODE_RANK=\"$SLURM_NODEID\" exec " + " ".join(command) + "'",
    ]
    return "\n".join(out) + "\n"
