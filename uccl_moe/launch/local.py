"""Launch on this host: torchrun with the rendered Megatron arguments."""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..config import schema
from ..errors import InvalidUsageError
from ..train.run_log import CPU_ABSENT_WARNINGS
from .megatron_args import launch_env, training_command


def torchrun_command(cfg: Any, python: str | None = None, environ: Mapping[str, str] | None = None) -> list[str]:
    """``python -m torch.distributed.run ... <training command>`` for this host (see
    :func:`uccl_moe.launch.megatron_args.training_command`).

    One node: ``--standalone`` (torchrun picks a free port). Several nodes: this host is node ``$NODE_RANK`` of
    ``nodes`` and ``MASTER_ADDR`` / ``MASTER_PORT`` come from the environment (use ``uccl-moe slurm`` on Slurm).
    """
    environ = os.environ if environ is None else environ
    cmd = [python or sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={cfg.platform.gpus_per_node}"]
    if cfg.nodes == 1:
        cmd.append("--standalone")
    else:
        missing = [k for k in ("MASTER_ADDR", "NODE_RANK") if not environ.get(k)]
        if missing:
            raise InvalidUsageError(
                f"nodes={cfg.nodes} needs {' and '.join(missing)} in the environment on each host (or use "
                f"`uccl-moe slurm`, which sets them)"
            )
        cmd += [f"--nnodes={cfg.nodes}", f"--node-rank={environ['NODE_RANK']}",
                f"--master-addr={environ['MASTER_ADDR']}", f"--master-port={environ.get('MASTER_PORT', '29500')}"]
    return cmd + training_command(cfg)


CPU_QUIET_WARNINGS = ",".join(f"ignore:{start}" for start in CPU_ABSENT_WARNINGS)
"""Megatron-Core warns once per module and rank that TransformerEngine/Apex are absent; on CPU they never exist, so
a CPU run silences those two (``PYTHONWARNINGS`` prefixes; a caller's own PYTHONWARNINGS wins)."""


def child_env(cfg: Any, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables a local run sets on top of the caller's environment: the platform/dispatcher env, and
    PYTHONPATH with this checkout first so the ranks import the same uccl_moe (a no-op for an installed package
    whose parent folder is site-packages)."""
    environ = os.environ if environ is None else environ
    env = launch_env(cfg)
    if cfg.platform.accelerator == schema.Accelerator.cpu and "PYTHONWARNINGS" not in environ:
        env["PYTHONWARNINGS"] = CPU_QUIET_WARNINGS
    root = str(Path(__file__).resolve().parents[2])
    parts = [root] + [p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != root]
    env["PYTHONPATH"] = os.pathsep.join(parts)
    return env


def check_devices(cfg: Any) -> None:
    """Fail before launching when this host lacks the GPUs the platform asks for."""
    if cfg.platform.accelerator == schema.Accelerator.cpu:
        return
    try:
        import torch
    except ImportError:
        raise InvalidUsageError("platform needs GPUs but torch is not installed; pip install torch") from None
    have = torch.cuda.device_count()
    want = cfg.platform.gpus_per_node
    if have == 0 < want:  # gpus_per_node=0 is no platform: say what runs on a CPU-only host instead
        raise InvalidUsageError(
            f"platform {cfg.platform.name} runs {want} ranks per node on GPUs but this host has none; on a CPU-only "
            f"host train a CPU recipe (uccl-moe train recipe=tiny_cpu_moe), or run this one where {want} GPUs are "
            f"visible"
        )
    if have < want:
        raise InvalidUsageError(
            f"platform {cfg.platform.name} runs {want} ranks per node but this host has {have} GPU(s); set "
            f"platform.gpus_per_node={have} (and a layout that fits) or use platform=cpu"
        )


def format_command(cmd: list[str], env: Mapping[str, str]) -> str:
    """A copy-pasteable shell line: ``env K=V ... cmd``."""
    return shlex.join(["env", *(f"{k}={v}" for k, v in env.items()), *cmd])
