"""Run fn(rank, world, gloo_group, *args) on `world` processes that may share GPUs.

The default group is a mixed ``cpu:gloo,cuda:nccl`` group: NCCL (which refuses two ranks on one GPU) is only
initialised by the first collective on CUDA tensors, so the native kernels (CUDA IPC between processes, which
works on one device too) can be tested with several ranks on a single GPU. Rank r uses GPU r % device_count.
"""

from __future__ import annotations

import os
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


def _entry(rank: int, world: int, init_file: str, fn: Callable[..., Any], args: tuple, env: dict, errq: Any) -> None:
    os.environ.update(env)
    import torch
    import torch.distributed as dist

    try:
        torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group("cpu:gloo,cuda:nccl", init_method=f"file://{init_file}", rank=rank,
                                world_size=world)
        gloo = dist.new_group(list(range(world)), backend="gloo")
        try:
            fn(rank, world, gloo, *args)
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001
        errq.put((rank, traceback.format_exc()))
        raise


def run_shared_gpu_ranks(fn: Callable[..., Any], world: int, *args: Any, env: dict[str, str] | None = None,
                         timeout_s: float = 600.0) -> None:
    """Spawns the ranks, joins them (bounded) and raises AssertionError with the first failing rank's trace."""
    ctx = mp.get_context("spawn")
    errq = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as d:
        init_file = os.path.join(d, "init")
        procs = [ctx.Process(target=_entry, args=(r, world, init_file, fn, args, env or {}, errq))
                 for r in range(world)]
        for p in procs:
            p.start()
        # Join, but stop at the first failing rank: its peers would otherwise block in a collective.
        deadline = time.monotonic() + timeout_s
        while any(p.is_alive() for p in procs) and time.monotonic() < deadline and errq.empty():
            for p in procs:
                p.join(0.5)
        if not errq.empty():
            time.sleep(2.0)  # let the other ranks report too
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
