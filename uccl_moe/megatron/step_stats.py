"""Optional per-step statistics of :mod:`uccl_moe.megatron.train_gpt`: peak memory and MoE dispatch/combine time.

Both are off unless asked for (``--log-memory``, ``--log-moe-timing``); without them nothing here runs and the
MoE layers are untouched.

* Peak memory: ``torch.cuda.max_memory_allocated`` of this rank's device (since the start of the run) on GPUs; the
  process's peak resident set size (``resource.getrusage(RUSAGE_SELF).ru_maxrss``) on CPU. Reported in MiB.
* MoE timing: :class:`MoeTimer` wraps ``token_dispatch`` and ``token_combine`` of every MoE layer's token dispatcher
  (any Megatron dispatcher: uccl, alltoall, allgather, flex) by setting instance attributes, so the class and the
  other instances stay as they are. It times the forward calls only (backward runs inside autograd and is not
  seen), as milliseconds per layer and step: CUDA events on the current stream on GPUs (read after a
  ``torch.cuda.synchronize()`` at the end of the step, which the timed run pays for), ``time.perf_counter`` on CPU.
"""

from __future__ import annotations

import resource
import sys
import time
from collections.abc import Callable
from typing import Any

import torch


def peak_memory_mib(device: torch.device) -> float:
    """Peak memory of this process in MiB: CUDA max allocated on `device` for a CUDA device, else peak RSS."""
    if device.type == "cuda":
        return float(torch.cuda.max_memory_allocated(device)) / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return float(rss) / (2**20 if sys.platform == "darwin" else 2**10)


class MoeTimer:
    """Times the forward ``token_dispatch`` / ``token_combine`` of each MoE layer of `model`.

    Args:
        model: a module tree; every submodule with a ``token_dispatcher`` attribute that has both methods is a layer.
        device: where the layers run; CUDA events are used for a CUDA device.
    """

    def __init__(self, model: Any, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.layers: list[Any] = []
        # Per layer: pending (start, end) pairs this step; CUDA events or perf_counter floats.
        self._pending: dict[str, list[list[tuple[Any, Any]]]] = {"dispatch": [], "combine": []}
        for module in model.modules():
            disp = getattr(module, "token_dispatcher", None)
            if disp is None or not hasattr(disp, "token_dispatch") or not hasattr(disp, "token_combine"):
                continue
            idx = len(self.layers)
            self.layers.append(disp)
            for kind, meth in (("dispatch", "token_dispatch"), ("combine", "token_combine")):
                self._pending[kind].append([])
                setattr(disp, meth, self._wrap(getattr(disp, meth), kind, idx))

    def _wrap(self, fn: Callable[..., Any], kind: str, idx: int) -> Callable[..., Any]:
        pending = self._pending[kind][idx]

        def timed(*args: Any, **kwargs: Any) -> Any:
            if self.cuda:
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                out = fn(*args, **kwargs)
                end.record()
                pending.append((start, end))
            else:
                t0 = time.perf_counter()
                out = fn(*args, **kwargs)
                pending.append((t0, time.perf_counter()))
            return out

        return timed

    def collect(self) -> dict[str, list[float]]:
        """Milliseconds per layer since the last call (summed over micro-batches), and reset.

        Returns:
            {"dispatch": [ms of layer 0, ...], "combine": [...]}, one entry per MoE layer of this rank.
        """
        if self.cuda:
            torch.cuda.synchronize()
        out: dict[str, list[float]] = {}
        for kind, per_layer in self._pending.items():
            values = []
            for pairs in per_layer:
                if self.cuda:
                    ms = sum(float(s.elapsed_time(e)) for s, e in pairs)
                else:
                    ms = sum((e - s) * 1000.0 for s, e in pairs)
                values.append(ms)
                pairs.clear()
            out[kind] = values
        return out


def format_ms_list(values: list[float]) -> str:
    """``[0.123,0.456]``: the log form of per-layer milliseconds (parsed by :mod:`uccl_moe.launch.compare`)."""
    return "[" + ",".join(f"{v:.3f}" for v in values) + "]"
