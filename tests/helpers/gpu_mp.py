"""Run fn(rank, world, *args) on `world` GPU processes with a NCCL group plus a gloo group of the same ranks.

Each rank uses GPU rank % device_count (NCCL needs one GPU per rank; callers pick world <= device_count).
"""

from __future__ import annotations

import os
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


def _entry(rank: int, world: int, init_file: str, fn: Callable[..., Any], args: tuple, env: dict, errq: Any) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(env)
    try:
        torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                device_id=torch.device("cuda", torch.cuda.current_device()))
        gloo = dist.new_group(list(range(world)), backend="gloo")
        try:
            fn(rank, world, gloo, *args)
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001
        errq.put((rank, traceback.format_exc()))
        raise


def run_gpu_ranks(fn: Callable[..., Any], world: int, *args: Any, env: dict[str, str] | None = None,
                  timeout_s: float = 300.0) -> None:
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
