"""Where the time of the copy-engine ops goes, per GPU (2+ GPUs): the API-default cached dispatch (FP8 with
column-major scales, BF16) and combine at the bench's headline setting, timed by the bench's loop (ranks aligned, L2
flushed) under torch.profiler; from each iteration's GPU events, in us:

- ``lead``: the enter kernel's start to the first copy's start (the enter hand-shake, the copy stream's wait); an
  early op (UCCL_MOE_CE_EARLY: no enter kernel) starts at its first copy or kernel, whichever comes first;
- ``copies``: the first copy's start to the last copy's end (the rows in chunks, each chunk's 4-byte flag);
- ``tail``: the last copy's end (our last flag) to the end of the op's last kernel (the work on the peers' last
  chunks, the done hand-shake);
- ``span``: the enter kernel's start to that end; ``kernel_start``: the enter kernel's start to the gather / sum
  kernel's (late where the host enqueues more slowly than the GPU runs: the profiler slows the host, too);
- ``boundary``: the median gap between one data copy's end and the next data copy's start (the flag between them
  included);
- ``flushed``: the L2 flush's end to the op's end: what the bench's event time holds where the host enqueued the op
  during the flush (early and enter-kernel ops compare here, since their spans start at different events).

Medians over iterations, one line per rank and op. ``--listing`` also prints the last iteration's events of rank 0.
Figures are per GPU clock; compare variants inside one call (docs/benchmarks.md). ``--ops`` picks some of the ops,
``--scales row`` lays the FP8 scales out row-major, ``--hold`` hides the host as the bench's
``--device-time`` does. With ``UCCL_MOE_DISPATCH_CE_CHUNKS=1`` a dispatch's tail is its
whole gather after the one chunk landed: the gather's own pace, per row type and scales layout.

    python tools/device/ce_timeline.py [--ranks 2] [--tokens 4096] [--hidden 7168] [--iters 14] [--listing]
        [--ops "dispatch fp8,dispatch bf16,combine"] [--scales col|row]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from typing import Any

PARTS = ("lead", "copies", "tail", "span", "kernel_start", "boundary", "flushed")
OPS = ("dispatch fp8", "dispatch bf16", "combine")
FLAG_BYTES = 4  # a chunk's flag copy (enqueue_ce_block)
# the alignment's all-reduce, --hold's GPU sleep (torch.cuda._sleep) and the polled ops' watch on the side stream
# after the op (ce_gate_watch_kernel: not part of the op); an op's end beside its kernel (UCCL_MOE_CE_END_BESIDE:
# ce_end_kernel, on the side stream: the caller's stream does not wait for it)
SKIPPED = ("AllReduce", "spin_kernel", "ce_gate_watch", "ce_end_kernel")


def _end(e: dict[str, Any]) -> float:
    return float(e["ts"]) + float(e["dur"])


def gpu_events(trace: dict[str, Any]) -> list[dict[str, Any]]:
    """The kernels, copies and memsets (the polled ops' sentinel: listed, not part of an op's span) of a chrome trace
    (torch.profiler's export), by start time."""
    evs = [e for e in trace.get("traceEvents", []) if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
           and "dur" in e]
    return sorted(evs, key=lambda e: float(e["ts"]))


def _is_fill(e: dict[str, Any]) -> bool:
    return "fill" in e["name"].lower() and e["cat"] == "kernel"


def iterations(events: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Each L2 flush (torch's fill kernel) and the events after it up to the next one: one timed call each; the
    alignment's all-reduce is left out."""
    fills = [i for i, e in enumerate(events) if _is_fill(e)]
    out = []
    for n, i in enumerate(fills):
        stop = fills[n + 1] if n + 1 < len(fills) else len(events)
        out.append([e for e in events[i:stop] if not any(n in e["name"] for n in SKIPPED)])
    return out


def parts(it: list[dict[str, Any]]) -> dict[str, float] | None:
    """PARTS of one copy-engine op's iteration (its flush first); None where it has no op kernel or copy (another path
    ran)."""
    flushed = _end(it[0]) if it and _is_fill(it[0]) else float("nan")
    enter = [e for e in it if e["cat"] == "kernel" and "ce_enter" in e["name"]]
    kernels = [e for e in it if e["cat"] == "kernel" and "ce_enter" not in e["name"] and not _is_fill(e)]
    copies = [e for e in it if e["cat"] == "gpu_memcpy"]
    if not (kernels and copies):
        return None
    t0 = float(enter[0]["ts"]) if enter else min(float(copies[0]["ts"]), float(kernels[0]["ts"]))
    end = max(_end(e) for e in kernels)
    data = [e for e in copies if int(e.get("args", {}).get("bytes", FLAG_BYTES + 1)) != FLAG_BYTES]
    gaps = [float(b["ts"]) - _end(a) for a, b in zip(data, data[1:])]
    return {"lead": float(copies[0]["ts"]) - t0, "copies": _end(copies[-1]) - float(copies[0]["ts"]),
            "tail": end - _end(copies[-1]), "span": end - t0, "kernel_start": float(kernels[0]["ts"]) - t0,
            "boundary": statistics.median(gaps) if gaps else float("nan"), "flushed": end - flushed}


def summarise(trace: dict[str, Any]) -> tuple[dict[str, float], int]:
    """Median of each of PARTS over the trace's copy-engine iterations, and how many there were."""
    got = [p for p in (parts(it) for it in iterations(gpu_events(trace))) if p is not None]
    if not got:
        return {k: float("nan") for k in PARTS}, 0
    return {k: statistics.median(p[k] for p in got) for k in PARTS}, len(got)


def listing(trace: dict[str, Any]) -> list[str]:
    """The last iteration's events: start and end in us from its first event, stream, name, bytes."""
    its = [[e for e in it if not _is_fill(e)] for it in iterations(gpu_events(trace))]
    if not its or not its[-1]:
        return []
    t0 = float(its[-1][0]["ts"])
    return [f"{float(e['ts']) - t0:8.1f} {_end(e) - t0:8.1f} s{e.get('args', {}).get('stream', '?')} "
            f"{e['name'][:70]} {e.get('args', {}).get('bytes', '')}" for e in its[-1]]


def select_ops(spec: str) -> list[str]:
    """The ops named in `spec` (comma-separated, from OPS), in OPS order; ValueError names an unknown one."""
    names = [s.strip() for s in spec.split(",") if s.strip()]
    unknown = [n for n in names if n not in OPS]
    if unknown or not names:
        raise ValueError(f"--ops {spec!r}: pick from {', '.join(OPS)} (comma-separated)")
    return [op for op in OPS if op in names]


def headline(rank: int, R: int, init: str, tokens: int, hidden: int, scales: str = "col") -> tuple[Any, ...]:
    """A rank's process group and API-default Buffer at the bench's headline setting (256 experts, top-8, 24 SMs, the
    bench's inputs), after a first dispatch: (Buffer, handle, combine input, BF16 x, (FP8 x, scales))."""
    import torch
    import torch.distributed as dist

    from uccl_moe import Buffer
    from uccl_moe.bench._run import point_inputs

    torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group("cpu:gloo,cuda:nccl", init_method=f"file://{init}", rank=rank, world_size=R)
    E, K = 256, 8
    Buffer.set_num_sms(24)
    buf = Buffer(dist.group.WORLD, Buffer.get_dispatch_config(R).get_nvl_buffer_size_hint(hidden * 2, R),
                 explicitly_destroy=True)
    gen = torch.Generator(device="cuda").manual_seed(1234 + rank)  # the bench's inputs
    idx, w, xb, x8 = point_inputs(tokens, hidden, E, K, scales, gen, "cuda")
    lay = buf.get_dispatch_layout(idx, E)
    r = buf.dispatch(xb, topk_idx=idx, topk_weights=w, num_tokens_per_rank=lay.num_tokens_per_rank,
                     is_token_in_rank=lay.is_token_in_rank, num_tokens_per_expert=lay.num_tokens_per_expert)
    recv_x = r.recv_x
    assert isinstance(recv_x, torch.Tensor)  # BF16 rows: one tensor (FP8 would be a pair)
    return buf, r.handle, recv_x.clone(), xb, x8


def headline_calls(buf: Any, h: Any, y: Any, xb: Any, x8: Any) -> dict[str, Any]:
    """The API-default calls of headline()'s Buffer and inputs, by the A/B tools' op names: the cached FP8 and BF16
    dispatch and the combine of a tensor of the caller's."""
    return {"fp8": lambda: buf.dispatch(x8, handle=h), "bf16": lambda: buf.dispatch(xb, handle=h),
            "combine": lambda: buf.combine(y, h)}


def slowest_time(fn: Any, flush: Any, iters: int, hold: bool) -> tuple[float, float]:
    """The bench's (us, host us per call) of fn() (bench._timing.time_op: 3 warm-up calls, the ranks aligned by a
    one-float all-reduce, L2 flushed by `flush`, held where `hold`), each the slowest rank's."""
    import torch
    import torch.distributed as dist

    from uccl_moe.bench._timing import time_op

    one = torch.ones(1, device="cuda")
    us, host = time_op(fn, flush, iters, 3, lambda: dist.all_reduce(one), hold)
    both = torch.tensor([us, host], device="cuda")
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    return float(both[0]), float(both[1])


def add_headline_args(p: argparse.ArgumentParser) -> None:
    """--ranks, --tokens and --hidden of the bench's headline setting (the device tools that call headline())."""
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=7168)


def spawn_headline(worker: Any, args: argparse.Namespace, min_gpus: int, refusal: str) -> int:
    """Runs worker(rank, args.ranks, init file, args) in args.ranks processes and returns 0; or, where this machine
    has fewer than `min_gpus` GPUs, prints `refusal` to stderr and returns 2 before any process starts."""
    import torch
    import torch.multiprocessing as mp

    if torch.cuda.device_count() < min_gpus:
        print(refusal, file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(args.ranks, os.path.join(tmp, "init"), args), nprocs=args.ranks)
    return 0


def close_headline(rank: int, buf: Any, header: str, lines: list[str]) -> None:
    """The end of an A/B tool's rank: rank 0 prints `header` and `lines`, then every rank meets the others, destroys
    its Buffer and leaves the process group."""
    import torch.distributed as dist

    if rank == 0:
        print(header)
        print("\n".join(lines), flush=True)
    dist.barrier()
    buf.destroy()
    dist.destroy_process_group()


def headline_ab_main(p: argparse.ArgumentParser, argv: Any, worker: Any, tool: str, parse: Any) -> int:
    """The main() of an A/B tool over the bench's timing loop (flush_ab.py, spin_ab.py): adds --iters and the headline
    arguments to `p`, parses `argv`, runs `parse(args)` (its ValueError is the parser's error, before anything starts)
    and then `worker` on every rank (spawn_headline: 2 GPUs at least, else 2)."""
    p.add_argument("--iters", type=int, default=20, help="timed calls per measurement (median)")
    add_headline_args(p)
    args = p.parse_args(argv)
    try:
        parse(args)
    except ValueError as e:
        p.error(str(e))
    return spawn_headline(worker, args, 2, f"{tool} needs 2 GPUs: run it on a 2-GPU machine (docs/benchmarks.md, "
                                           f"Regenerate)")


def _worker(rank: int, R: int, init: str, args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from uccl_moe.bench._timing import FLUSH_BYTES, time_op

    buf, h, y, xb, x8 = headline(rank, R, init, args.tokens, args.hidden, args.scales)
    one = torch.ones(1, device="cuda")
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    ops = {"dispatch fp8": lambda: buf.dispatch(x8, handle=h), "dispatch bf16": lambda: buf.dispatch(xb, handle=h),
           "combine": lambda: buf.combine(y, h)}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.ops:  # main() made it a list (select_ops)
            fn = ops[name]
            for _ in range(5):  # warm-up
                fn()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                time_op(fn, flush, args.iters, 0, align=lambda: dist.all_reduce(one), hold=args.hold)
            path = os.path.join(tmp, f"trace_{rank}.json")
            prof.export_chrome_trace(path)
            with open(path) as f:
                trace = json.load(f)
            med, n = summarise(trace)
            print(f"rank {rank} {name:13s} " + " ".join(f"{k} {med[k]:6.1f}" for k in PARTS) + f" (n={n})",
                  flush=True)
            if args.listing and rank == 0:
                print("\n".join(listing(trace)), flush=True)
            dist.barrier()
    buf.destroy()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_headline_args(p)
    p.add_argument("--iters", type=int, default=14)
    p.add_argument("--listing", action="store_true", help="also print rank 0's last iteration, event by event")
    p.add_argument("--ops", default=",".join(OPS), help=f"comma-separated, of: {', '.join(OPS)}")
    p.add_argument("--scales", choices=("col", "row"), default="col", help="the FP8 scales' layout (default col)")
    p.add_argument("--hold", action="store_true",
                   help="the bench's --device-time: the GPU sleeps before each op, so the host enqueued all of it "
                        "first and the timeline is the GPU's alone (`flushed` then holds the sleep)")
    args = p.parse_args(argv)
    try:
        args.ops = select_ops(args.ops)
    except ValueError as e:
        p.error(str(e))
    return spawn_headline(_worker, args, 1, "ce_timeline needs GPUs (the copy-engine ops run between GPUs)")


if __name__ == "__main__":
    sys.exit(main())
