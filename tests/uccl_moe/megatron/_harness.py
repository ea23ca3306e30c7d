"""Multi-process harness for the Megatron tests: N ranks (gloo on CPU, NCCL on GPUs), results gathered to the test.

Each rank runs ``fn(rank, world, *args)`` and returns a picklable value; :func:`run_ranks` returns the list of values
in rank order, or raises with the first failing rank's traceback. Every run is bounded by ``timeout_s``.
"""

from __future__ import annotations

import os
import pickle
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


def _entry(rank: int, world: int, backend: str, init_file: str, out_dir: str, fn: Callable[..., Any], args: tuple,
           env: dict) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(env)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world)})
    torch.set_num_threads(1)
    result: Any = None
    error: str | None = None
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
        try:
            result = fn(rank, world, *args)
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - report everything to the parent
        error = traceback.format_exc()
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump((result, error), f)


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, backend: str = "gloo",
              env: dict[str, str] | None = None, timeout_s: float = 300.0) -> list[Any]:
    """Spawn `world` processes running ``fn(rank, world, *args)``; return their results in rank order."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as d:
        init_file = os.path.join(d, "init")
        procs = [
            ctx.Process(target=_entry, args=(r, world, backend, init_file, d, fn, args, env or {}))
            for r in range(world)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout_s)
        hung = [i for i, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        results: list[Any] = []
        errors: list[tuple[int, str]] = []
        for r in range(world):
            path = os.path.join(d, f"rank{r}.pkl")
            if not os.path.exists(path):
                results.append(None)
                continue
            with open(path, "rb") as f:
                res, err = pickle.load(f)
            results.append(res)
            if err is not None:
                errors.append((r, err))
    if errors:
        rank, tb = errors[0]
        raise AssertionError(f"rank {rank} of {world} failed:\n{tb}")
    if hung:
        raise AssertionError(f"ranks {hung} of {world} did not finish within {timeout_s} s")
    bad = [(i, p.exitcode) for i, p in enumerate(procs) if p.exitcode != 0]
    if bad:
        raise AssertionError(f"ranks exited abnormally (rank, exitcode): {bad}")
    return results
