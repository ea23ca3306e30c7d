"""Multi-process harness for the Megatron tests: N ranks (gloo on CPU, NCCL on GPUs), results gathered to the test.

Each rank runs ``fn(rank, world, *args)`` and returns a picklable value; :func:`run_ranks` returns the list of values
in rank order, or raises with the first failing rank's traceback. Every run is bounded by ``timeout_s``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from helpers.mp import run_ranks_on


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, backend: str = "gloo",
              env: dict[str, str] | None = None, timeout_s: float = 300.0) -> list[Any]:
    """Spawn `world` processes running ``fn(rank, world, *args)``; return their results in rank order."""
    return run_ranks_on(fn, world, *args, backend=backend, env=env, timeout_s=timeout_s)
