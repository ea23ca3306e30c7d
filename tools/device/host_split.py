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
asleep before each call (the bench's --device-time), where the host runs unhurried.

``--trace`` instead profiles the loop (torch.profiler, CPU and CUDA: host and GPU on one clock; the profiler slows the
host) and gives, per rank and op, in us from the L2 flush's end on the GPU (negative: before it): ``copy_call`` the
host's call that enqueued the op's first data copy, ``copy_start`` that copy's start on the GPU, ``kernel_call`` and
``kernel_start`` the same for the op's kernel (gather or sum), ``end`` the op's last kernel's end. A ``copy_call``
past 0 is host time the GPU waits for. ``--profile`` prints rank 0's cProfile of the op calls (functions by own time).
``--floor`` adds each op's floor (``*_floor``): the same native launch with its arguments built once, called straight
from the loop with the outputs allocated as the API allocates them, so no Python check or decision runs (nor the
Buffer's stream joins, a few native calls); what the API's ops take beyond it is mostly their Python.
Figures are per machine and call (docs/benchmarks.md).

    python tools/device/host_split.py [--iters 30] [--tokens 4096] [--hidden 7168] [--trace] [--profile]
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
TRACE_PARTS = ("copy_call", "copy_start", "kernel_call", "kernel_start", "end")
FLAG_BYTES = 4  # a chunk's flag copy


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
    """Median SEGMENTS of fn() over `iters` calls of the bench's timing loop (bench._timing.time_op), each call split
    by its clock marks."""
    from uccl_moe.bench._timing import flush_us, time_op

    for _ in range(3):
        fn()
    rows: list[dict[str, float]] = []

    def marked() -> None:
        marks.clear()
        t0 = time.perf_counter_ns()
        fn()
        rows.append(split(t0, time.perf_counter_ns(), marks))

    gpu, _ = time_op(marked, flush, iters, 0, align, hold)
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    med["gpu"], med["flush"] = gpu, flush_us(flush)
    return med


def trace_parts(trace: dict[str, Any]) -> tuple[dict[str, float], int]:
    """Median TRACE_PARTS over a profiled loop's iterations (each L2 flush and the events up to the next), and how
    many iterations had the op's copies and kernel: GPU events from ce_timeline, their host calls by correlation id."""
    from ce_timeline import gpu_events, iterations

    calls = {e["args"]["correlation"]: float(e["ts"]) for e in trace.get("traceEvents", [])
             if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    rows = []
    for it in iterations(gpu_events(trace)):
        if not it or "fill" not in it[0]["name"].lower():
            continue
        t0 = float(it[0]["ts"]) + float(it[0]["dur"])
        copies = [e for e in it if e["cat"] == "gpu_memcpy" and int(e.get("args", {}).get("bytes", 0)) != FLAG_BYTES]
        kernels = [e for e in it[1:] if e["cat"] == "kernel" and "ce_enter" not in e["name"]]
        if not copies or not kernels:
            continue
        c, k = copies[0], kernels[0]
        cc, kc = calls.get(c["args"].get("correlation")), calls.get(k["args"].get("correlation"))
        if cc is None or kc is None:
            continue
        rows.append({"copy_call": cc - t0, "copy_start": float(c["ts"]) - t0, "kernel_call": kc - t0,
                     "kernel_start": float(k["ts"]) - t0,
                     "end": max(float(e["ts"]) + float(e["dur"]) for e in kernels) - t0})
    if not rows:
        return {k: float("nan") for k in TRACE_PARTS}, 0
    return {k: statistics.median(r[k] for r in rows) for k in TRACE_PARTS}, len(rows)


def traced(fn: Any, flush: Any, align: Any, iters: int) -> tuple[dict[str, float], int]:
    """trace_parts of fn() in the bench's default loop under torch.profiler (CPU and CUDA activities)."""
    import json
    import os
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    from uccl_moe.bench._timing import time_op

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        time_op(fn, flush, iters, 3, align, False)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            return trace_parts(json.load(f))


def profiled(fn: Any, flush: Any, align: Any, iters: int) -> list[str]:
    """The cProfile of `iters` calls of fn() in the bench's default loop: the top functions by own time."""
    import cProfile
    import io
    import pstats

    from uccl_moe.bench._timing import time_op

    prof = cProfile.Profile()

    def profiled_call() -> None:
        prof.enable()
        fn()
        prof.disable()

    time_op(profiled_call, flush, iters, 0, align, False)
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(22)
    return out.getvalue().splitlines()


def floor_calls(buf: Any, h: Any, y: Any, xb: Any, x8: Any) -> dict[str, Any]:
    """The copy-engine ops' native launches with arguments built once (each op's Python floor): the cached FP8 and
    BF16 dispatch and the combine of y, on the caller's stream, outputs allocated per call as the API does."""
    from uccl_moe import _C, env, tuning
    from uccl_moe.backends._buffer_paths import _late_outputs, _ptr
    from uccl_moe.backends._operands import combine_outputs, scale_layout

    be = buf._live()
    sms, rows, T = be._sms_of(h), int(h.recv_src_idx.shape[0]), int(h.is_token_in_rank.shape[0])
    chunks, early, stream = int(env.get("DISPATCH_CE_CHUNKS")), bool(env.get("CE_EARLY")), be._stream()
    poll, dispatch_poll = bool(env.get("CE_POLL")), tuning.dispatch_ce_poll(env.get("DISPATCH_CE_POLL"))
    beside = bool(env.get("CE_END_BESIDE"))  # the op's end as the API path ends it
    calls = {}
    for name, (x, scales) in (("fp8_floor", x8), ("bf16_floor", (xb, None))):
        S, s_tok, s_hid = scale_layout(scales)
        row_bytes = int(x.shape[1]) * x.element_size()
        counts = be._ce_dispatch_counts(h, row_bytes, S)
        assert counts is not None, "the copy-engine dispatch does not fit this Buffer"
        args = _C.DispatchArgs(x=_ptr(x), x_scales=_ptr(scales), rank_prefix=_ptr(h.rank_prefix_matrix),
                               num_tokens=T, row_bytes=row_bytes, num_scales=S, scale_token_stride=s_tok,
                               scale_hidden_stride=s_hid, num_recv_rows=rows, recv_src_idx=_ptr(h.recv_src_idx))
        calls[name] = (lambda a=args, c=counts, x=x, sc=scales: _late_outputs(  # type: ignore[misc]
            lambda outputs: _C.dispatch_ce_intranode(be._rt, sms, a, c[0], c[1], chunks, early, stream, outputs,
                                                     dispatch_poll, beside),
            lambda: be._alloc_recv(rows, x, sc, 0, False)[:2], "floor"))
    H = int(y.shape[1])
    prefix = be._ce_rank_prefix(h, H, 0)
    assert prefix is not None, "the copy-engine combine does not fit this Buffer"
    cargs = _C.CombinePullArgs(
        topk_weights=0, bias0=0, bias1=0, rank_prefix=_ptr(h.rank_prefix_matrix), lane_prefix=_ptr(
            h.channel_prefix_matrix), send_head=_ptr(h.send_head), num_tokens=T, hidden=H, num_topk=0,
        num_lanes=int(h.channel_prefix_matrix.shape[1]), staged=1, own_x=_ptr(y),
        ce_chunks=int(env.get("COMBINE_CE_CHUNKS")))
    combine_sms = int(buf.get_combine_config(buf.group_size).num_sms)  # what the API's combine launches with
    calls["combine_floor"] = lambda: _late_outputs(
        lambda outputs: _C.combine_ce_intranode(be._rt, combine_sms, cargs, prefix, early, stream, outputs, poll,
                                                beside),
        lambda: combine_outputs(y, T, None), "floor")
    return calls


def _worker(rank: int, R: int, init: str, args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from uccl_moe import _C
    from uccl_moe.bench._timing import FLUSH_BYTES

    marks: dict[str, int] = {}
    for name in LAUNCHES:
        setattr(_C, name, timed_launch(getattr(_C, name), marks))
    buf, h, y, xb, x8 = headline(rank, R, init, args.tokens, args.hidden)
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    one = torch.ones(1, device="cuda")
    lines = []
    ops = headline_calls(buf, h, y, xb, x8)
    if args.floor:
        ops.update(floor_calls(buf, h, y, xb, x8))
    for op, fn in ops.items():
        marks.clear()
        fn()
        if "cb_in" not in marks:
            raise RuntimeError(f"{op} did not take the copy-engine path (not EP2, or a knob turned it off)")
        align = lambda: dist.all_reduce(one)  # noqa: E731
        if args.profile:
            got_lines = profiled(fn, flush, align, args.iters)
            if rank == 0:
                lines += [f"== {op}: cProfile of rank 0's calls"] + got_lines
            continue
        if args.trace:
            parts, n = traced(fn, flush, align, args.iters)
            got = [None] * R
            dist.all_gather_object(got, (parts, n))
            for r, (m, cnt) in enumerate(got):
                lines.append(f"{op:8s} rank {r} " + " ".join(f"{k} {m[k]:6.1f}" for k in TRACE_PARTS) + f" (n={cnt})")
            continue
        for held in (False, True):
            med = measure(fn, marks, flush, align, args.iters, held)
            got: list[Any] = [None] * R
            dist.all_gather_object(got, med)
            for r, m in enumerate(got):
                lines.append(f"{op:13s} {'held' if held else 'loop':4s} rank {r} "
                             + " ".join(f"{k} {m[k]:6.1f}" for k in SEGMENTS))
    close_headline(rank, buf, f"{R} ranks, {args.tokens} tokens, hidden {args.hidden}: host us per call by segment "
                   f"(medians of {args.iters}); loop = the bench's default mode, held = --device-time", lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", action="store_true", help="host calls against the GPU's events (torch.profiler)")
    p.add_argument("--profile", action="store_true", help="rank 0's cProfile of the op calls")
    p.add_argument("--floor", action="store_true", help="also each op's native launch with prebuilt arguments")
    return headline_ab_main(p, argv, _worker, "host_split.py", lambda a: None)


if __name__ == "__main__":
    sys.exit(main())
