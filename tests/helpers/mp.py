"""Run a function on N gloo ranks (spawned processes) and re-raise any rank's failure in the test process."""

from __future__ import annotations

import os
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


def _entry(rank: int, world: int, init_file: str, fn: Callable[..., Any], args: tuple, env: dict, errq: Any) -> None:
    import torch.distributed as dist

    os.environ.update(env)
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
        try:
            fn(rank, world, *args)
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - report everything to the parent
        errq.put((rank, traceback.format_exc()))
        raise


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, env: dict[str, str] | None = None,
              timeout_s: float = 240.0) -> None:
    """Spawn `world` processes running fn(rank, world, *args) in a gloo group; fail with the first traceback."""
    ctx = mp.get_context("spawn")
    errq = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as d:
        init_file = os.path.join(d, "init")
        procs = [ctx.Process(target=_entry, args=(r, world, init_file, fn, args, env or {}, errq))
                 for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout_s)
        hung = [i for i, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
    errors = []
    while not errq.empty():
        errors.append(errq.get())
    if errors:
        rank, tb = sorted(errors)[0]
        raise AssertionError(f"rank {rank} of {world} failed:\n{tb}")
    if hung:
        raise AssertionError(f"ranks {hung} of {world} did not finish within {timeout_s} s")
    bad = [(i, p.exitcode) for i, p in enumerate(procs) if p.exitcode != 0]
    if bad:
        raise AssertionError(f"ranks exited abnormally (rank, exitcode): {bad}")
