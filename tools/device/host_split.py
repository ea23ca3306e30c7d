"""Where a copy-engine op's host time goes, in the bench's default loop (ranks aligned, 256 MB L2 flush, CUDA events
around the Python call; ``bench._timing.time_op``): the API-default cached FP8 dispatch (column-major scales), BF16
dispatch and combine of a caller's tensor at the bench's headline setting, each call split by clock reads at the
native launch's entry, its outputs callback (called once the first copies are enqueued) and their returns:

- ``py_pre``: the call's start to the native launch (Buffer's and the backend's Python: checks, fits, arguments);
- ``native_pre``: the launch's entry to its outputs callback (the copy streams' wait, the first chunks and flags);
- ``alloc``: the callback (the outputs' allocation);
- ``native_post``: the callback's return to the launch's return (the kernel, the other chunks, the join);
- ``py_post``: the launch's return to the call's return;
- ``before_copy`` = py_pre + native_pre: what the GPU waits for once it outlasts the flush (``flush``, its GPU us);
- ``gpu``: the call's event time (the bench's figure).

Medians over --iters calls per rank; one line per rank and op. A ``held`` line per op repeats the loop with the GPU
asleep before each call (the bench's --device-time), where the host runs unhurried. Figures are per machine and call
(docs/benchmarks.md).

    python tools/device/host_split.py [--iters 30] [--tokens 4096] [--hidden 7168]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

from ce_timeline import close_headline, headline, headline_ab_main, headline_calls  # this folder's tools

LAUNCHES = ("dispatch_ce_intranode", "combine_ce_intranode")  # the native launches of the copy-engine ops
SEGMENTS = ("py_pre", "native_pre", "alloc", "native_post", "py_post", "before_copy", "total", "gpu", "flush")


def timed_launch(real: Any, marks: dict[str, int]) -> Any:
    """`real` (a native copy-engine launch whose last argument is its outputs callback) noting in `marks` the clock at
    its entry (``enter``), the callback's entry and return (``cb_in``, ``cb_out``) and its own return (``leave``)."""
    def call(*args: Any) -> Any:
        marks["enter"] = time.perf_counter_ns()
        *head, outputs = args

        def timed_outputs() -> Any:
            marks["cb_in"] = time.perf_counter_ns()
            out = outputs()
            marks["cb_out"] = time.perf_counter_ns()
            return out

        try:
            return real(*head, timed_outputs)
        finally:
            marks["leave"] = time.perf_counter_ns()
    return call


def split(start: int, end: int, m: dict[str, int]) -> dict[str, float]:
    """One call's segments in us from its clock marks (SEGMENTS less gpu and flush). KeyError where the launch or
    its callback did not run (another path took the call)."""
    us = {"py_pre": m["enter"] - start, "native_pre": m["cb_in"] - m["enter"], "alloc": m["cb_out"] - m["cb_in"],
          "native_post": m["leave"] - m["cb_out"], "py_post": end - m["leave"], "total": end - start}
    out = {k: v / 1e3 for k, v in us.items()}
    out["before_copy"] = out["py_pre"] + out["native_pre"]
    return out


def measure(fn: Any, marks: dict[str, int], flush: Any, align: Any, iters: int, hold: bool) -> dict[str, float]:
    """Median SEGMENTS of fn() over `iters` calls of the bench's timing loop (time_op's steps, with clock marks)."""
    import torch

    from uccl_moe.bench._timing import HOLD_CYCLES, flush_us

    for _ in range(3):
        fn()
    rows = []
    for _ in range(iters):
        if hold:
            flush.zero_()
            torch.cuda._sleep(HOLD_CYCLES)
        align()
        if not hold:
            flush.zero_()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        marks.clear()
        t0 = time.perf_counter_ns()
        fn()
        t1 = time.perf_counter_ns()
        b.record()
        b.synchronize()
        row = split(t0, t1, marks)
        row["gpu"] = a.elapsed_time(b) * 1e3
        rows.append(row)
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    med["flush"] = flush_us(flush)
    return med


def _worker(rank: int, R: int, init: str, args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from uccl_moe import _C

    marks: dict[str, int] = {}
    for name in LAUNCHES:
        setattr(_C, name, timed_launch(getattr(_C, name), marks))
    buf, h, y, xb, x8 = headline(rank, R, init, args.tokens, args.hidden)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    one = torch.ones(1, device="cuda")
    lines = []
    for op, fn in headline_calls(buf, h, y, xb, x8).items():
        marks.clear()
        fn()
        if "cb_in" not in marks:
            raise RuntimeError(f"{op} did not take the copy-engine path (not EP2, or a knob turned it off)")
        for held in (False, True):
            med = measure(fn, marks, flush, lambda: dist.all_reduce(one), args.iters, held)
            got: list[Any] = [None] * R
            dist.all_gather_object(got, med)
            for r, m in enumerate(got):
                lines.append(f"{op:8s} {'held' if held else 'loop':4s} rank {r} "
                             + " ".join(f"{k} {m[k]:6.1f}" for k in SEGMENTS))
    close_headline(rank, buf, f"{R} ranks, {args.tokens} tokens, hidden {args.hidden}: host us per call by segment "
                   f"(medians of {args.iters}); loop = the bench's default mode, held = --device-time", lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    return headline_ab_main(p, argv, _worker, "host_split.py", lambda a: None)


if __name__ == "__main__":
    sys.exit(main())
