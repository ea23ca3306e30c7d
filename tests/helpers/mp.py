"""Run a function on N spawned ranks and bring back their results, or every failing rank's traceback.

One launcher for every multi-process test:

- ``mode="gloo"``: a gloo group (CPU); ``fn(rank, world, *args)``.
- ``mode="nccl"``: one GPU per rank (rank r uses GPU r % device_count), a NCCL default group plus a gloo group of
  the same ranks passed as the third argument: ``fn(rank, world, gloo_group, *args)``.
- ``mode="shared_gpu"``: a mixed ``cpu:gloo,cuda:nccl`` default group, so several ranks may share one GPU as long
  as they never run a NCCL collective on CUDA tensors (the native kernels talk through CUDA IPC, which works on one
  device too); ``fn(rank, world, gloo_group, *args)``.

Each rank's return value is pickled to a file and returned in rank order. The join is bounded by ``timeout_s`` and
stops early once a rank failed (its peers would otherwise block in a collective until their own timeout).
"""

from __future__ import annotations

import os
import pickle
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port nobody listens on now (for a torchrun --master-port or MASTER_PORT): a fixed one collides with
    whatever else the machine runs."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(rank: int, world: int, mode: str, init_file: str, out_dir: str, fn: Callable[..., Any], args: tuple,
           env: dict) -> None:
    os.environ.update(env)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world)})
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    result: Any = None
    error: str | None = None
    try:
        init = f"file://{init_file}"
        if mode == "gloo":
            dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
            call_args: tuple = args
        else:
            torch.cuda.set_device(rank % torch.cuda.device_count())
            backend = "nccl" if mode == "nccl" else "cpu:gloo,cuda:nccl"
            dist.init_process_group(backend, init_method=init, rank=rank, world_size=world)
            call_args = (dist.new_group(list(range(world)), backend="gloo"), *args)
        try:
            result = fn(rank, world, *call_args)
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - report everything to the parent
        error = traceback.format_exc()
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump((result, error), f)
    # Skip interpreter shutdown: the parent reads only the result file and the exit code, and threads that torch
    # leaves behind (gloo workers of the process groups Megatron keeps) can abort a finalizing interpreter when they
    # still need the GIL (a rank that returned its result would then exit with -6).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if error is None else 1)


def spawn_ranks(fn: Callable[..., Any], world: int, *args: Any, mode: str = "gloo",
                env: dict[str, str] | None = None, timeout_s: float = 300.0) -> list[Any]:
    """Spawn `world` ranks running `fn` (see the module doc for the signature per mode); return their results."""
    if mode not in ("gloo", "nccl", "shared_gpu"):
        raise ValueError(f"mode={mode!r}: expected gloo, nccl or shared_gpu")
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as d:
        init_file = os.path.join(d, "init")
        procs = [ctx.Process(target=_entry, args=(r, world, mode, init_file, d, fn, args, env or {}))
                 for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
            if any(p.exitcode not in (None, 0) for p in procs):
                time.sleep(2.0)  # let the other ranks report too
                break
            for p in procs:
                p.join(0.2)
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
        # Every failing rank's traceback: the first rank's error is often only the echo of a peer's (a collective
        # whose peer exited), and the cause is in the peer's.
        failed = ", ".join(str(r) for r, _ in errors)
        tbs = "\n".join(f"--- rank {r} of {world}:\n{tb}" for r, tb in errors)
        raise AssertionError(f"ranks {failed} of {world} failed (the lowest's error may only echo another's):\n{tbs}")
    if hung:
        raise AssertionError(f"ranks {hung} of {world} did not finish within {timeout_s} s")
    bad = [(i, p.exitcode) for i, p in enumerate(procs) if p.exitcode != 0]
    if bad:
        raise AssertionError(f"ranks exited abnormally (rank, exitcode): {bad}")
    return results


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, env: dict[str, str] | None = None,
              timeout_s: float = 240.0) -> list[Any]:
    """gloo ranks on CPU: fn(rank, world, *args)."""
    return spawn_ranks(fn, world, *args, mode="gloo", env=env, timeout_s=timeout_s)


def run_gpu_ranks(fn: Callable[..., Any], world: int, *args: Any, env: dict[str, str] | None = None,
                  timeout_s: float = 300.0) -> list[Any]:
    """One GPU per rank, NCCL + gloo groups: fn(rank, world, gloo_group, *args)."""
    return spawn_ranks(fn, world, *args, mode="nccl", env=env, timeout_s=timeout_s)


def run_shared_gpu_ranks(fn: Callable[..., Any], world: int, *args: Any, env: dict[str, str] | None = None,
                         timeout_s: float = 600.0) -> list[Any]:
    """Ranks that may share GPUs (mixed gloo/NCCL default group): fn(rank, world, gloo_group, *args)."""
    return spawn_ranks(fn, world, *args, mode="shared_gpu", env=env, timeout_s=timeout_s)


def _without_group(rank: int, world: int, gloo: Any, fn: Callable[..., Any], *args: Any) -> Any:
    return fn(rank, world, *args)


def run_ranks_on(fn: Callable[..., Any], world: int, *args: Any, backend: str = "gloo",
                 env: dict[str, str] | None = None, timeout_s: float = 300.0) -> list[Any]:
    """fn(rank, world, *args) on gloo (CPU) or NCCL (one GPU per rank) default groups."""
    if backend == "gloo":
        return spawn_ranks(fn, world, *args, mode="gloo", env=env, timeout_s=timeout_s)
    return spawn_ranks(_without_group, world, fn, *args, mode="nccl", env=env, timeout_s=timeout_s)
