"""``--profile`` of :mod:`uccl_moe.train.train_gpt`: a ``torch.profiler`` trace of a few steps, Megatron-LM's flags.

    --profile --profile-step-start 10 --profile-step-end 12 --profile-ranks 0 1 --profile-dir runs/x/profile

Iterations ``start <= i < end`` (numbered as in the ``[train_gpt] iteration i/N`` lines) are recorded on each rank of
``--profile-ranks``, and iteration ``start - 1`` is the profiler's warm-up step (it starts CUPTI, so that cost is not in
the recorded steps); this is what Megatron-LM's ``--use-pytorch-profiler`` schedule records
(``wait=start-1, warmup=1, active=end-start``). Activities: CPU, plus CUDA on GPUs. The chrome trace goes to
``<dir>/trace_rank<R>.json`` (R = global rank) when the last recorded step ends, or when training stops earlier; open
it in Perfetto / chrome://tracing, or summarize its GPU streams with ``python -m uccl_moe.train.timeline``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Optional

import torch

from ..errors import InvalidUsageError

# argparse kwargs of the profiling flags (Megatron-LM's names and defaults), added to train_gpt's parser.
PROFILE_FLAGS: dict[str, dict[str, Any]] = {
    "--profile": dict(action="store_true", help="record a torch.profiler trace of --profile-step-start..end"),
    "--use-pytorch-profiler": dict(action="store_true",
                                   help="accepted for Megatron-LM command lines (the profiler is always torch's)"),
    "--profile-step-start": dict(type=int, default=10, help="first recorded iteration (default 10)"),
    "--profile-step-end": dict(type=int, default=12, help="recording stops before this iteration (default 12)"),
    "--profile-ranks": dict(type=int, nargs="+", default=[0], help="global ranks that record (default: 0)"),
    "--profile-dir": dict(type=str, default=None,
                          help="where trace_rank<R>.json goes (default: 'profile' next to --loss-log, else ./profile)"),
}


def profile_dir(args: argparse.Namespace) -> Path:
    """``--profile-dir``, else ``profile/`` in the directory of ``--loss-log``, else ``./profile``."""
    if args.profile_dir:
        return Path(args.profile_dir)
    if args.loss_log:
        return Path(args.loss_log).resolve().parent / "profile"
    return Path("profile")


def check_profile_args(args: argparse.Namespace) -> None:
    """Reject a step window that records nothing. No-op without ``--profile``."""
    if not args.profile:
        return
    start, end = args.profile_step_start, args.profile_step_end
    if start < 0 or end <= start:
        raise InvalidUsageError(
            f"--profile-step-start {start} --profile-step-end {end}: need 0 <= start < end (iterations start..end-1 "
            "are recorded)"
        )
    if start > args.train_iters:
        raise InvalidUsageError(
            f"--profile-step-start {start} is after the last iteration (--train-iters {args.train_iters}): nothing "
            "would be recorded; lower it or train longer"
        )


class StepProfiler:
    """Drives one ``torch.profiler.profile`` over the training loop of this rank.

    Call :meth:`step` at the top of every iteration, before the step's work and its timer start (like Megatron-LM's
    ``prof.step()``), and :meth:`close` once after the loop. A rank that is not profiled gets an object whose calls
    do nothing.

    Args:
        args: train_gpt's namespace (``profile``, ``profile_step_start``, ``profile_step_end``, ``profile_ranks``,
            ``profile_dir``, ``loss_log``), already checked by :func:`check_profile_args`.
        rank: this process's global rank.
        device: the training device; CUDA kernels are recorded when it is a CUDA device.
    """

    def __init__(self, args: argparse.Namespace, rank: int, device: torch.device) -> None:
        self.rank = rank
        self.enabled = bool(args.profile) and rank in args.profile_ranks
        self.path: Optional[Path] = None
        self.iteration = 0  # the iteration running now (step() calls so far)
        self._prof: Optional[torch.profiler.profile] = None
        if not self.enabled:
            return
        self.start, self.end = int(args.profile_step_start), int(args.profile_step_end)
        out_dir = profile_dir(args)
        out_dir.mkdir(parents=True, exist_ok=True)
        self.path = out_dir / f"trace_rank{rank}.json"
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        # prof.step() at the top of iteration i makes it the profiler's step i (its "ProfilerStep#i"), so iteration
        # i runs under schedule(i): nothing before start-1, warm-up at start-1, recording at start..end-1, then done
        # (the export runs in the step() call at the top of iteration `end`, before this rank's timer starts; ranks
        # that do not profile wait for it in that iteration's first collective, so their iteration `end` is slower).
        self._prof = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(wait=max(self.start - 1, 0), warmup=1 if self.start > 0 else 0,
                                             active=self.end - self.start, repeat=1),
            on_trace_ready=self._export,
        )
        self._prof.start()

    def _export(self, prof: torch.profiler.profile) -> None:
        assert self.path is not None
        prof.export_chrome_trace(str(self.path))
        first, last = max(self.start, 1), min(self.end - 1, self.iteration)
        print(f"[train_gpt] rank {self.rank}: profile of iterations {first}..{last} written to {self.path}", flush=True)

    def step(self) -> None:
        """Top of an iteration: advance the profiler's schedule (starts, or stops and exports, the recording)."""
        self.iteration += 1
        if self._prof is not None:
            self._prof.step()

    def close(self) -> None:
        """After the loop: stop the profiler; a recording still running (end past the last iteration) is exported."""
        if self._prof is not None:
            self._prof.stop()
            self._prof = None
