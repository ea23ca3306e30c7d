"""GPU stream timeline of a torch.profiler chrome trace: what ran where, and how much communication hid under compute.

    python -m uccl_moe.train.timeline profile/trace_rank0.json [--json timeline.json] [--main-stream 7]

Reads the kernel events of a chrome trace (``train_gpt --profile`` writes one per profiled rank; any
``torch.profiler`` ``export_chrome_trace`` file works, also gzipped): complete events (``ph`` ``X``) with ``cat`` ==
``kernel``, and the peer-to-peer copies (``cat`` == ``gpu_memcpy``, a name with ``PtoP``, as CUPTI names a copy
between two GPUs). A kernel's stream is ``args["stream"]``, else its ``tid``; its device is ``args["device"]``, else
its ``pid``. Other memcpy and memset events are left out. Each kernel is one of three classes, by name
(case-insensitive):

* ``uccl``: uccl-moe's kernels (:data:`UCCL_KERNEL_PATTERNS`: dispatch/combine/notify/layout kernels and ``rdma_``)
  and the peer-to-peer copies: inside a node the copy-engine dispatch and combine (the EP2 defaults) move their rows
  with the GPUs' copy engines, so their kernels alone would leave most of their traffic out (a user's own copies
  between GPUs count too: nothing in Megatron's training makes them);
* ``nccl``: any name containing ``nccl`` (NCCL's AllToAll/SendRecv/AllReduce/... kernels, e.g. of the alltoall
  dispatcher or the gradient all-reduce);
* ``compute``: everything else.

All times are interval arithmetic over [ts, ts + dur) (sorted union and two-pointer intersection; no sampling), per
device, then summed over devices:

* per stream: kernel and peer-copy counts, busy ms (union of its kernels and copies), busy ms per class, and the
  dominant class (the one with the most busy time there);
* per class: busy ms over all streams;
* for each comm class (uccl, nccl): ``overlap_compute_ms``, the time during which a kernel of that class runs while a
  compute kernel runs on a *different* stream, and ``hidden_fraction`` = that / the class's busy ms ("comm hidden
  under compute"); ``overlap_side_compute_ms``, the time a compute kernel on a side stream (any stream other than the
  main one) runs while a kernel of that class runs on another stream (e.g. the shared expert under the dispatch).

The main stream of a device is the one with the most compute busy time (``--main-stream`` names it instead).
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

from ..errors import InvalidUsageError

# Substrings of uccl-moe's kernel names (STYLE R14: <op>_<scope>_kernel), matched lower-case.
UCCL_KERNEL_PATTERNS = (
    "dispatch_intranode_kernel",
    "dispatch_direct_kernel",  # the ring-free dispatch (UCCL_MOE_DISPATCH_DIRECT) and its unpack
    "dispatch_unpack_kernel",
    "combine_intranode_kernel",
    "combine_pull_kernel",  # combine from the buffer, and the staged combine with its stage kernel
    "stage_combine_rows_kernel",
    "combine_ce_",  # the copy-engine combine's sum (UCCL_MOE_COMBINE_CE), the copy-engine ops' enter hand-shake
    "ce_enter_kernel",
    "ce_gate_watch_kernel",  # the polled ops' side stream: bounds the copy streams' waits for the peers' memsets
    "ce_end_kernel",  # an early polled op's end on the side stream (UCCL_MOE_CE_END_BESIDE)
    "dispatch_ce_",  # the copy-engine dispatch's gather (UCCL_MOE_DISPATCH_CE)
    "check_topk_idx_kernel",  # the device-side topk_idx range check of a dispatch
    "notify_dispatch_kernel",
    "prepare_round_kernel",
    "get_dispatch_layout_kernel",
    "combine_reduce_kernel",
    "rdma_",
    "rail_barrier_kernel",  # internode: the barrier between the ranks of one rail
)
NCCL_KERNEL_PATTERN = "nccl"
# CUPTI's memcpy kind for a copy between two GPUs (kineto names the event "Memcpy PtoP (Device -> Device)"), matched
# lower-case: the copy-engine ops' rows and chunk flags.
PEER_COPY_PATTERN = "ptop"
CLASSES = ("uccl", "nccl", "compute")
COMM_CLASSES = ("uccl", "nccl")

Interval = tuple[float, float]  # [start, end) in microseconds, end > start
StreamId = Union[int, str]


def classify(name: str) -> str:
    """``uccl``, ``nccl`` or ``compute`` for a kernel name (see the module doc)."""
    low = name.lower()
    if any(p in low for p in UCCL_KERNEL_PATTERNS):
        return "uccl"
    if NCCL_KERNEL_PATTERN in low:
        return "nccl"
    return "compute"


# ------------------------------------------------------------------------------------------ interval arithmetic


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, disjoint, non-touching intervals covering the same points as `intervals` (empty ones dropped)."""
    out: list[Interval] = []
    for start, end in sorted(i for i in intervals if i[1] > i[0]):
        if out and start <= out[-1][1]:
            if end > out[-1][1]:
                out[-1] = (out[-1][0], end)
        else:
            out.append((start, end))
    return out


def intersect(a: Sequence[Interval], b: Sequence[Interval]) -> list[Interval]:
    """Intersection of two outputs of :func:`union` (sorted, disjoint), by a two-pointer sweep."""
    out: list[Interval] = []
    i = j = 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if end > start:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def total(intervals: Iterable[Interval]) -> float:
    """Summed length of disjoint intervals."""
    return sum(end - start for start, end in intervals)


# ------------------------------------------------------------------------------------------------------ reading


@dataclass(frozen=True)
class Kernel:
    """One GPU kernel (or peer-to-peer copy) of the trace."""

    name: str
    device: StreamId
    stream: StreamId
    start_us: float
    end_us: float
    cls: str  # one of CLASSES
    copy: bool = False  # a peer-to-peer copy, not a kernel


def _ident(value: Any) -> StreamId:
    """A stream or device id: the int in ``7`` / ``"7"`` / ``"stream 7"``, else the value as text."""
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    text = str(value).strip()
    m = re.fullmatch(r"(?:stream\s*)?(-?\d+)", text, flags=re.IGNORECASE)
    return int(m.group(1)) if m else text


def _event_kind(ev: Any) -> Optional[str]:
    """``kernel`` or ``copy`` (a peer-to-peer copy) for the complete events this module analyses; None for the rest."""
    if not isinstance(ev, dict) or ev.get("ph", "X") != "X":
        return None
    cat = str(ev.get("cat", "")).lower()
    if cat == "kernel":
        return "kernel"
    return "copy" if cat == "gpu_memcpy" and PEER_COPY_PATTERN in str(ev.get("name", "")).lower() else None


def kernels_of(trace: Any) -> list[Kernel]:
    """The kernel events and peer-to-peer copies of a chrome trace (``{"traceEvents": [...]}`` or a bare event
    list); a peer copy is of class ``uccl``."""
    events = trace.get("traceEvents") if isinstance(trace, dict) else trace
    if not isinstance(events, list):
        raise InvalidUsageError("not a chrome trace: expected {'traceEvents': [...]} or a list of events")
    out: list[Kernel] = []
    for ev in events:
        kind = _event_kind(ev)
        if kind is None:
            continue
        try:
            start, dur = float(ev["ts"]), float(ev.get("dur", 0.0))
        except (KeyError, TypeError, ValueError):
            continue
        raw_args = ev.get("args")
        args: dict[str, Any] = raw_args if isinstance(raw_args, dict) else {}
        stream = args.get("stream", ev.get("tid"))
        device = args.get("device", ev.get("pid", 0))
        if stream is None:
            continue
        name = str(ev.get("name", ""))
        copy = kind == "copy"
        out.append(Kernel(name, _ident(device), _ident(stream), start, start + dur, "uccl" if copy else classify(name),
                          copy))
    return out


def load_trace(path: Union[str, Path]) -> Any:
    """The parsed JSON of a chrome trace file (``.gz`` read through gzip)."""
    p = Path(path)
    if not p.is_file():
        raise InvalidUsageError(f"{p}: no such trace file")
    opener = gzip.open if p.suffix == ".gz" else open
    with opener(p, "rt") as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as exc:
            raise InvalidUsageError(f"{p}: not JSON ({exc})") from exc


# ----------------------------------------------------------------------------------------------------- analysis


def _ms(us: float) -> float:
    return us / 1000.0


def _sort_key(value: StreamId) -> tuple[int, int, str]:
    return (0, value, "") if isinstance(value, int) else (1, 0, value)


def _others(per_stream: dict[StreamId, list[Interval]], stream: StreamId) -> list[Interval]:
    return union(iv for s, ivs in per_stream.items() if s != stream for iv in ivs)


def analyze(kernels: Sequence[Kernel], main_stream: Optional[StreamId] = None) -> dict[str, Any]:
    """The timeline summary as a JSON-able dict (see the module doc for the quantities; times in ms).

    Args:
        kernels: from :func:`kernels_of`.
        main_stream: the main (compute) stream on every device; default: per device, the stream with the most
            compute busy time (ties: the lowest id).
    """
    streams_out: list[dict[str, Any]] = []
    busy_us = dict.fromkeys(CLASSES, 0.0)
    comm = {c: {"overlap_compute_us": 0.0, "overlap_side_compute_us": 0.0} for c in COMM_CLASSES}
    window_us = 0.0
    devices = sorted({k.device for k in kernels}, key=_sort_key)
    for device in devices:
        mine = [k for k in kernels if k.device == device]
        window_us += max(k.end_us for k in mine) - min(k.start_us for k in mine)
        raw: dict[str, dict[StreamId, list[Interval]]] = {c: {} for c in CLASSES}
        for k in mine:
            raw[k.cls].setdefault(k.stream, []).append((k.start_us, k.end_us))
        # by_cls[c][stream] = union of class-c kernels on that stream
        by_cls = {c: {s: union(ivs) for s, ivs in raw[c].items()} for c in CLASSES}
        for c in CLASSES:
            busy_us[c] += total(union(iv for ivs in by_cls[c].values() for iv in ivs))
        stream_ids = sorted({k.stream for k in mine}, key=_sort_key)
        compute_busy = {s: total(by_cls["compute"].get(s, [])) for s in stream_ids}
        main = main_stream
        if main is None and any(compute_busy.values()):
            main = min(stream_ids, key=lambda s: (-compute_busy[s], _sort_key(s)))
        for s in stream_ids:
            on_s = [k for k in mine if k.stream == s]
            per_cls = {c: total(by_cls[c].get(s, [])) for c in CLASSES}
            dominant = max(CLASSES, key=lambda c: per_cls[c]) if any(per_cls.values()) else None
            streams_out.append({
                "device": device, "stream": s, "main": s == main, "kernels": sum(not k.copy for k in on_s),
                "peer_copies": sum(k.copy for k in on_s),
                "busy_ms": _ms(total(union((k.start_us, k.end_us) for k in on_s))),
                **{f"{c}_ms": _ms(per_cls[c]) for c in CLASSES},
                "kernels_by_class": {c: sum(k.cls == c and not k.copy for k in on_s) for c in CLASSES},
                "dominant": dominant,
            })
        compute = by_cls["compute"]
        side_compute = {s: ivs for s, ivs in compute.items() if s != main}
        for c in COMM_CLASSES:
            # comm of stream s against compute of every other stream, then the union over s
            hidden = union(iv for s, ivs in by_cls[c].items() for iv in intersect(ivs, _others(compute, s)))
            comm[c]["overlap_compute_us"] += total(hidden)
            side = union(iv for s, ivs in side_compute.items() for iv in intersect(ivs, _others(by_cls[c], s)))
            comm[c]["overlap_side_compute_us"] += total(side)
    totals: dict[str, Any] = {
        "kernels": sum(not k.copy for k in kernels), "peer_copies": sum(k.copy for k in kernels),
        "devices": len(devices), "streams": len(streams_out), "window_ms": _ms(window_us),
        **{f"{c}_busy_ms": _ms(busy_us[c]) for c in CLASSES},
    }
    comm_out = {}
    for c in COMM_CLASSES:
        over = comm[c]["overlap_compute_us"]
        comm_out[c] = {
            "busy_ms": _ms(busy_us[c]),
            "overlap_compute_ms": _ms(over),
            "hidden_fraction": over / busy_us[c] if busy_us[c] > 0 else None,
            "overlap_side_compute_ms": _ms(comm[c]["overlap_side_compute_us"]),
        }
    return {"totals": totals, "comm": comm_out, "streams": streams_out}


def render(result: dict[str, Any]) -> str:
    """The compact human table of :func:`analyze`'s result."""
    t = result["totals"]
    copies = f" and {t['peer_copies']} peer copies" if t["peer_copies"] else ""
    lines = [f"{t['kernels']} kernels{copies} on {t['streams']} streams of {t['devices']} device(s), "
             f"{t['window_ms']:.3f} ms from the first kernel to the last"]
    head = ["device", "stream", "kernels"] + (["copies"] if copies else []) + [
        "busy ms", "uccl ms", "nccl ms", "compute ms", "dominant"]
    rows = [[str(s["device"]), str(s["stream"]) + (" (main)" if s["main"] else ""), str(s["kernels"])]
            + ([str(s["peer_copies"])] if copies else [])
            + [f"{s['busy_ms']:.3f}", f"{s['uccl_ms']:.3f}", f"{s['nccl_ms']:.3f}", f"{s['compute_ms']:.3f}",
               s["dominant"] or "-"] for s in result["streams"]]
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    lines.append("  ".join(h.rjust(w) for h, w in zip(head, widths)))
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows]
    lines.append(f"busy (union over streams): uccl {t['uccl_busy_ms']:.3f} ms | nccl {t['nccl_busy_ms']:.3f} ms | "
                 f"compute {t['compute_busy_ms']:.3f} ms")
    for c in COMM_CLASSES:
        x = result["comm"][c]
        if x["busy_ms"] <= 0:
            lines.append(f"{c}: no kernels")
            continue
        lines.append(f"{c}: {x['busy_ms']:.3f} ms busy, {x['overlap_compute_ms']:.3f} ms under compute on other "
                     f"streams ({100 * x['hidden_fraction']:.1f}% hidden), {x['overlap_side_compute_ms']:.3f} ms "
                     "under side-stream compute")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m uccl_moe.train.timeline",
                                description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("trace", type=Path, help="chrome trace JSON (torch.profiler export_chrome_trace; .gz too)")
    p.add_argument("--json", type=Path, default=None, help="also write the summary here as JSON")
    p.add_argument("--main-stream", type=_ident, default=None,
                   help="the main compute stream id (default: per device, the stream with the most compute time)")
    args = p.parse_args(argv)
    try:
        kernels = kernels_of(load_trace(args.trace))
    except InvalidUsageError as exc:
        print(f"timeline: {exc}", file=sys.stderr)
        return 2
    if not kernels:
        print(f"timeline: {args.trace} has no GPU kernel events (cat 'kernel'); was it recorded on a GPU with the "
              "CUDA activity?", file=sys.stderr)
    result = analyze(kernels, args.main_stream)
    result["trace"] = str(args.trace)
    print(render(result))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
