"""Timing of one op for the benchmarks: CUDA events around the Python call with L2 flushed, the ranks aligned, and
optionally the host time hidden (--device-time); the per-kernel view from torch.profiler."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

FLUSH_BYTES = 256 << 20  # written before each timed run: more than the L2 of any supported GPU
HOLD_CYCLES = 2_000_000  # --device-time: the GPU sleep before each timed call (~1 ms at H100/H200 clocks)


def time_op(fn: Callable[[], Any], flush: Any, iters: int, warmup: int,
            align: Callable[[], Any] | None = None, hold: bool = False) -> tuple[float, float]:
    """(GPU, host) median microseconds of fn() with L2 flushed before each run. GPU: CUDA events on the current
    stream around the call. Host: the CPU time the Python call takes to return (it enqueues work and does not wait
    for the GPU, so this is what a caller pays per call on its own thread, e.g. at decode size where the GPU waits for
    it). `align` (a tiny NCCL all-reduce) runs before the flush so every rank starts the timed call at nearly the
    same moment: without it a rank's time includes how late its peers launched, which is host noise, not
    communication. `hold` (--device-time): the GPU sleeps for HOLD_CYCLES after the flush and before the alignment,
    so the call is enqueued before the timed window opens and the GPU time excludes the host's. The alignment comes
    after the sleep: a sleep counts clock cycles, and two GPUs at different clocks leave the same sleep tens of us
    apart, which would count in the earlier rank's time (and the slowest rank's is the one reported)."""
    import torch

    for _ in range(warmup):
        fn()
    times, host = [], []
    for _ in range(iters):
        if hold:  # the host enqueues the alignment and the call while the GPU sleeps
            flush.zero_()
            torch.cuda._sleep(HOLD_CYCLES)
        if align is not None:
            align()
        if not hold:
            flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t0) * 1e6)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return float(statistics.median(times)), float(statistics.median(host))


def flush_us(flush: Any, runs: int = 11) -> float:
    """Median GPU microseconds of one L2 flush (time_op's, before each timed run): the host time per call it hides.
    A call whose host time exceeds it leaves the GPU waiting for the host inside the timed window."""
    import torch

    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        flush.zero_()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return float(statistics.median(times))


def kernel_us(fn: Callable[[], Any], flush: Any, iters: int, align: Callable[[], Any] | None) -> dict[str, float]:
    """GPU time per call of each kernel fn() launches: time_op's loop under torch.profiler (the flush's and the
    alignment's kernels are left out), the kernel-only view next to the event time of the whole Python call."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        time_op(fn, flush, iters, 0, align)
    events = [(e.name, e.time_range.end - e.time_range.start) for e in prof.events() if e.device_type.name == "CUDA"]
    return kernel_table(events, iters, skip=("AllReduce",) if align is not None else ())


def kernel_table(events: list[tuple[str, float]], calls: int, skip: tuple[str, ...] = ()) -> dict[str, float]:
    """Microseconds per call by short kernel name ("dispatch_intranode_kernel", "ncclDevKernel_SendRecv", ...)
    from (profiler name, duration us) per launch: the median launch times launches per call. Fill kernels (the L2
    flush) and names containing a `skip` entry are dropped; names that shorten alike are pooled."""
    durations: dict[str, list[float]] = {}
    for name, us in events:
        if "FillFunctor" in name or "fill_kernel" in name or any(k in name for k in skip):
            continue
        bare = name.replace("(anonymous namespace)::", "").split("(")[0].split("<")[0]
        short = bare.split("::")[-1].split()[-1] if bare.split() else name
        durations.setdefault(short, []).append(us)
    return {n: round(statistics.median(d) * len(d) / calls, 1) for n, d in durations.items()}
