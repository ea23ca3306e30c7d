"""What the GPU benchmarks say on a host without GPUs."""

from __future__ import annotations

import sys

CPU_INSTEAD = ("on a CPU machine, `python examples/buffer_cpu_gloo.py` checks the install and `uccl-moe compare "
               "recipe=tiny_cpu_moe 'dispatchers=[uccl,alltoall,allgather]'` runs the dispatchers end to end")


def gpus_or_explain(what: str) -> bool:
    """True where torch sees a GPU; else prints why `what` cannot run here and what runs on a CPU instead."""
    import torch

    if torch.cuda.is_available():
        return True
    build = "a CPU-only build" if torch.version.cuda is None and torch.version.hip is None else "no GPU visible"
    print(f"{what} needs CUDA or ROCm GPUs, and torch {torch.__version__} here has none ({build}); {CPU_INSTEAD}",
          file=sys.stderr)
    return False
