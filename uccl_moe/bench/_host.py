"""The host side of a bench run: how fast each rank's core runs Python, and the cores each rank is bound to.

In the bench's default mode the GPU waits for whatever host time a call takes beyond the L2 flush's GPU time, so a
rank whose core runs Python slower (a core shared with another thread or tenant, a virtual CPU with steal time, a
throttled core) shows as a slower op. The calibration times one fixed pure-Python loop on every rank, at the start
and at the end of the run, so the report can say when the ranks' hosts differed enough to move the default mode's
figures (docs/benchmarks.md, "The default mode pays the host time").
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

from ..doctor_host import _compact  # cores as ranges: 0-2,5

CALIBRATION_STEPS = 2000  # additions per timed loop: tens of microseconds on a server core
CALIBRATION_RUNS = 31  # loops timed; the median is kept
UNEVEN_HOSTS = 1.5  # slowest / fastest sample (any rank, start or end) at or above this: the report says so


def calibrate() -> float:
    """Median microseconds of a fixed pure-Python loop on this thread's core (lower: a faster host)."""
    times = []
    for _ in range(CALIBRATION_RUNS):
        t0 = time.perf_counter_ns()
        total = 0
        for i in range(CALIBRATION_STEPS):
            total += i
        times.append((time.perf_counter_ns() - t0) / 1e3)
    return round(float(statistics.median(times)), 1)


def current_cpu() -> int | None:
    """The CPU this thread last ran on (Linux /proc; None elsewhere)."""
    try:
        with open("/proc/thread-self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[36])  # field 39 of proc(5), counted after the command name's closing parenthesis
    except (OSError, IndexError, ValueError):
        return None


def sample() -> dict[str, Any]:
    """This rank's host sample: its calibration loop (us) and the CPU it ran on."""
    return {"loop_us": calibrate(), "cpu": current_cpu()}


def parse_bind_cores(text: str, ranks: int, allowed: set[int]) -> list[list[int]]:
    """``--bind-cores``: one group of cores per rank, groups separated by '/', each a comma list of cores and
    ranges (``0-7/8-15``, ``2/18``). ValueError saying what is wrong and how to write it."""
    groups = [g.strip() for g in text.split("/")]
    if len(groups) != ranks:
        raise ValueError(f"--bind-cores {text!r} names {len(groups)} core group(s) for {ranks} rank(s): give one "
                         f"group per rank, '/'-separated, e.g. 0-7/8-15 for two ranks")
    out = []
    for rank, group in enumerate(groups):
        cores: set[int] = set()
        for part in (p.strip() for p in group.split(",")):
            lo, sep, hi = part.partition("-")
            if not lo.isdigit() or (sep and not hi.isdigit()) or (sep and int(hi) < int(lo)):
                raise ValueError(f"--bind-cores: rank {rank}'s group {group!r} has {part!r}, which is not a core "
                                 f"number or an ascending range (e.g. 8 or 8-15)")
            cores.update(range(int(lo), int(hi if sep else lo) + 1))
        missing = sorted(cores - allowed)
        if missing:
            raise ValueError(f"--bind-cores: rank {rank}'s cores {missing} are not ones this process may run on "
                             f"(allowed: {_compact(sorted(allowed))}); pick cores from that set")
        out.append(sorted(cores))
    return out


def bind(cores: list[int]) -> None:
    """Bind this process's calling thread, and the threads it starts after (CUDA's, NCCL's), to `cores`."""
    os.sched_setaffinity(0, cores)


def host_lines(host: dict[str, list[dict[str, Any]]], device_time: bool) -> list[str]:
    """The report's host line, and a NOTE where the ranks' calibration loops differ by UNEVEN_HOSTS or more (in the
    default mode, where the GPU may wait for a slow host). `host`: ``start`` and ``end``, one sample per rank."""
    start, end = host.get("start") or [], host.get("end") or []
    if not start:
        return []
    per_rank = []
    for r, s in enumerate(start):
        e = end[r] if r < len(end) else {}
        per_rank.append(f"rank {r} cpu {s.get('cpu')} {s['loop_us']:.0f}/{e.get('loop_us', float('nan')):.0f} us")
    lines = [f"host: a {CALIBRATION_STEPS}-step Python loop (median us, start/end of the run; lower is faster): "
             + ", ".join(per_rank)]
    loops = [s["loop_us"] for s in (*start, *end) if s.get("loop_us")]
    if not device_time and loops and max(loops) >= UNEVEN_HOSTS * min(loops):
        lines.append(f"NOTE: the host loop ran up to {max(loops) / min(loops):.1f}x slower on one rank or at one "
                     f"time than another (a shared, throttled or stolen-from core): in the default mode the GPU waits "
                     f"for the host time a call takes beyond the L2 flush, so these figures may depend on the cores "
                     f"the ranks ran on; rerun, bind the ranks to idle cores (--bind-cores), or compare --device-time")
    return lines
