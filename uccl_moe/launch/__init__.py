"""Launchers: render a composed config into Megatron argv + env and run it on this host (torchrun), as a Slurm
batch script, or as a Primus experiment. The ``uccl-moe`` subcommands live in :mod:`uccl_moe.launch.commands`
(``compare``, which runs the training application once per dispatcher, in :mod:`uccl_moe.train.compare`)."""

from __future__ import annotations

from .local import torchrun_command
from .megatron_args import launch_env, megatron_args, megatron_argv, training_command
from .primus import primus_experiment, render_primus_yaml
from .slurm import render_primus_sbatch, render_sbatch

__all__ = [
    "launch_env",
    "megatron_args",
    "megatron_argv",
    "primus_experiment",
    "render_primus_sbatch",
    "render_primus_yaml",
    "render_sbatch",
    "torchrun_command",
    "training_command",
]
