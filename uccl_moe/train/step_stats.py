"""Optional per-step statistics of :mod:`uccl_moe.train.train_gpt`: peak memory, CPU time and MoE dispatch/combine
time.

All are off unless asked for (``--log-memory``, ``--log-cpu``, ``--log-moe-timing``); without them nothing here runs
and the MoE layers are untouched.

* Peak memory: ``torch.cuda.max_memory_allocated`` of this rank's device (since the start of the run) on GPUs; the
  process's peak resident set size (``resource.getrusage(RUSAGE_SELF).ru_maxrss``) on CPU. Reported in MiB.
* CPU time: :func:`process_cpu_s`, user + system seconds of this process over all its threads (the Python thread,
  torch's intra-op pool, NCCL/gloo threads and uccl's proxy threads alike), read at the start and end of a step.
  Divided by the step's wall time it is the number of CPU cores the rank kept busy.
* MoE timing: :class:`MoeTimer` times the forward dispatch phase (``dispatch_preprocess`` through
  ``dispatch_postprocess``) and combine phase (``combine_preprocess`` through ``combine_postprocess``) of every MoE
  layer's token dispatcher (any Megatron dispatcher: uccl, alltoall, allgather, flex), as milliseconds per layer and
  step. Backward runs inside autograd and is not seen.
"""

from __future__ import annotations

import collections
import resource
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

# (phase, the dispatcher method that opens its span, the one that closes it): Megatron's six-method contract.
_PHASES = (("dispatch", "dispatch_preprocess", "dispatch_postprocess"),
           ("combine", "combine_preprocess", "combine_postprocess"))


def peak_memory_mib(device: torch.device) -> float:
    """Peak memory of this process in MiB: CUDA max allocated on `device` for a CUDA device, else peak RSS."""
    if device.type == "cuda":
        return float(torch.cuda.max_memory_allocated(device)) / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return float(rss) / (2**20 if sys.platform == "darwin" else 2**10)


def process_cpu_s() -> float:
    """User + system CPU seconds of this process so far, summed over all its threads (``time.process_time``:
    ``CLOCK_PROCESS_CPUTIME_ID`` on Linux). The difference over a step is the step's CPU time."""
    return time.process_time()


class MoeTimer:
    """Times the forward dispatch and combine phases of each MoE layer of `model`, as the compute stream sees them.

    A phase spans three dispatcher calls of Megatron's contract (``MoELayer`` calls them in this order, once per
    micro-batch forward)::

        dispatch: dispatch_preprocess -> token_dispatch -> dispatch_postprocess
        combine:  combine_preprocess  -> token_combine  -> combine_postprocess

    The start mark is taken when ``*_preprocess`` is entered and the end mark when ``*_postprocess`` returns, so the
    span holds the (un)permutation, the communication and the wait for it. That is what makes dispatchers
    comparable: uccl issues its comm on a side stream (``async_finish``) and the compute stream waits only in
    ``*_postprocess``, while alltoall's NCCL call runs on the current stream inside ``token_dispatch``; timing
    ``token_dispatch`` alone would see almost nothing of uccl's comm. With ``--moe-shared-expert-overlap`` the
    shared expert's work issued inside the span (on its own stream) is part of it.

    Pairing: each ``*_preprocess`` call opens a span and the next ``*_postprocess`` call of the same layer closes
    the oldest open one, so a layer may run several times per step and its spans add up (micro-batches; with
    ``--moe-layer-recompute`` the forward that runs again during backward counts too). A ``*_postprocess`` without an
    open span is not timed; spans still open at :meth:`collect` are dropped.

    Args:
        model: a module tree; every submodule whose ``token_dispatcher`` has the four methods above is a layer. The
            methods are wrapped by setting instance attributes, so the class and its other instances stay as they are.
        device: where the layers run. CUDA: events recorded on the current stream, read after a
            ``torch.cuda.synchronize()`` in :meth:`collect`. Otherwise ``time.perf_counter``.
    """

    def __init__(self, model: Any, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.layers: list[Any] = []
        # Per phase, per layer: marks of spans opened and not closed yet (oldest first), and closed (start, end)
        # pairs of this step. A mark is a CUDA event or a perf_counter float.
        self._open: dict[str, list[collections.deque[Any]]] = {phase: [] for phase, _, _ in _PHASES}
        self._spans: dict[str, list[list[tuple[Any, Any]]]] = {phase: [] for phase, _, _ in _PHASES}
        for module in model.modules():
            disp = getattr(module, "token_dispatcher", None)
            if disp is None or not all(hasattr(disp, m) for _, pre, post in _PHASES for m in (pre, post)):
                continue
            idx = len(self.layers)
            self.layers.append(disp)
            for phase, pre, post in _PHASES:
                self._open[phase].append(collections.deque())
                self._spans[phase].append([])
                setattr(disp, pre, self._wrap_start(getattr(disp, pre), self._open[phase][idx]))
                setattr(disp, post, self._wrap_end(getattr(disp, post), self._open[phase][idx],
                                                   self._spans[phase][idx]))

    def _mark(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _wrap_start(self, fn: Callable[..., Any], opened: collections.deque[Any]) -> Callable[..., Any]:
        def start_then_call(*args: Any, **kwargs: Any) -> Any:
            opened.append(self._mark())
            return fn(*args, **kwargs)

        return start_then_call

    def _wrap_end(self, fn: Callable[..., Any], opened: collections.deque[Any],
                  spans: list[tuple[Any, Any]]) -> Callable[..., Any]:
        def call_then_end(*args: Any, **kwargs: Any) -> Any:
            out = fn(*args, **kwargs)
            if opened:
                spans.append((opened.popleft(), self._mark()))
            return out

        return call_then_end

    def collect(self) -> dict[str, list[float]]:
        """Milliseconds per layer since the last call (summed over the layer's spans), and reset.

        Returns:
            {"dispatch": [ms of layer 0, ...], "combine": [...]}, one entry per MoE layer of this rank.
        """
        if self.cuda:
            torch.cuda.synchronize()
        out: dict[str, list[float]] = {}
        for phase, per_layer in self._spans.items():
            values = []
            for spans in per_layer:
                if self.cuda:
                    ms = sum(float(s.elapsed_time(e)) for s, e in spans)
                else:
                    ms = sum((e - s) * 1000.0 for s, e in spans)
                values.append(ms)
                spans.clear()
            out[phase] = values
        for per_layer_open in self._open.values():
            for opened in per_layer_open:
                opened.clear()
        return out


def format_ms_list(values: list[float]) -> str:
    """``[0.123,0.456]``: the log form of per-layer milliseconds (parsed by :mod:`uccl_moe.train.log_parse`)."""
    return "[" + ",".join(f"{v:.3f}" for v in values) + "]"
