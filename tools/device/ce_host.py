"""Host time per call of the copy-engine ops at EP2 (2 GPUs): the API-default cached dispatch (FP8 with column-major
scales, BF16) and combine at the bench's headline setting, each rank enqueueing behind a sleeping GPU so that the GPU
never pushes back. Per op: the whole Buffer call, its native launch alone (the same arguments, replayed), and its
Python path alone (the native launch replaced by a no-op on every rank); and NCCL's all_to_all_single of the FP8 rows.
Medians of 5 rounds of --calls calls (host_parts.host_us), rank 0's figures. ``--loop bench``: each call timed as
the bench's default mode times it instead (ranks aligned, L2 flushed, the host waiting for the GPU after every call:
bench._timing.time_op's host figure, median of --calls calls), where a call starts on a host that just waited.
``--profile``: then, per op, cProfile's top entries (own time) over the calls of its Python path (the native launch a
no-op) in the chosen loop, and the host us of the primitives the path calls (an output's torch.empty, the current
stream, an event record): where a slow host spends the Python path's time.

    python tools/device/ce_host.py [--tokens 4096] [--hidden 7168] [--calls 40] [--loop sleep|bench] [--profile]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from typing import Any


def _worker(rank: int, R: int, init: str, args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from ce_timeline import headline  # this folder's tools (the script's folder leads sys.path)
    from host_parts import host_us

    from uccl_moe.backends import _buffer_paths

    buf, h, y, xb, x8 = headline(rank, R, init, args.tokens, args.hidden)
    a2a_in = torch.empty(args.tokens * args.hidden, dtype=torch.uint8, device="cuda")
    a2a_out = torch.empty_like(a2a_in)

    from uccl_moe.bench._timing import FLUSH_BYTES, time_op

    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda") if args.loop == "bench" else None
    one = torch.ones(1, device="cuda")

    def timed(fn: Any) -> float:  # every rank enqueues the same rounds, so the ops meet their peers once GPUs wake
        if args.loop == "bench":
            return time_op(fn, flush, args.calls, 3, lambda: dist.all_reduce(one))[1]
        return host_us(fn, args.calls, rounds=5, sync=dist.barrier)

    res = {"NCCL all_to_all_single (FP8 rows)": timed(lambda: dist.all_to_all_single(a2a_out, a2a_in))}
    ops = {"dispatch fp8": (lambda: buf.dispatch(x8, handle=h), "dispatch_ce_intranode"),
           "dispatch bf16": (lambda: buf.dispatch(xb, handle=h), "dispatch_ce_intranode"),
           "combine": (lambda: buf.combine(y, h), "combine_ce_intranode")}
    C = _buffer_paths._C
    for name, (fn, launch) in ops.items():
        real = getattr(C, launch)
        seen: list[tuple[Any, ...]] = []
        setattr(C, launch, lambda *a, real=real, seen=seen: (seen.append(a), real(*a)))
        fn()
        torch.cuda.synchronize()
        setattr(C, launch, real)
        if not seen:
            raise RuntimeError(f"{name} did not take the copy-engine path (not EP2, or a knob turned it off)")
        res[f"{name}: Buffer call"] = timed(fn)
        replay = _replayable(seen[-1], launch)
        res[f"{name}: native launch"] = timed(lambda real=real, a=replay: real(*a))
        setattr(C, launch, _no_launch)
        try:
            res[f"{name}: Python path"] = timed(fn)
        finally:
            setattr(C, launch, real)
    if rank == 0:
        for k, v in res.items():
            print(f"host us per call ({args.loop} loop)  {k:36s} {v:7.1f}", flush=True)
    if args.profile:
        from uccl_moe.utils import current_raw_stream

        dev, event = torch.device("cuda", torch.cuda.current_device()), torch.cuda.Event()
        rows = (2 * xb.shape[0], xb.shape[1])  # an EP2 dispatch's recv_x
        prims = {"torch.empty of recv_x (FP8)": lambda: torch.empty(rows, dtype=torch.float8_e4m3fn, device=dev),
                 "torch.cuda.current_stream()": torch.cuda.current_stream,
                 "uccl_moe.utils.current_raw_stream": lambda: current_raw_stream(dev.index),
                 "torch.cuda.Event.record()": event.record}
        report = _profile(ops, C, timed, prims)
        if rank == 0:
            print(report, flush=True)
    dist.barrier()
    buf.destroy()
    dist.destroy_process_group()


# The output fields of each copy-engine launch's argument struct, which its outputs callback fills (LateOutputs).
_OUTPUT_FIELDS = {"dispatch_ce_intranode": ("recv_x", "recv_scales"),
                  "combine_ce_intranode": ("out", "out_topk_weights")}


def _no_launch(*args: Any) -> None:
    """A copy-engine launch that launches nothing: it only asks for the op's outputs, as the real one does before its
    kernel (its last argument, the outputs callback), so the Python path allocates them as it does for real."""
    if args and callable(args[-1]):
        args[-1]()


def _replayable(args: tuple[Any, ...], launch: str) -> tuple[Any, ...]:
    """A recorded launch's arguments made to replay: its outputs allocated once, now (their addresses into the
    argument struct, args[2]), and no callback, so each replay times the native launch alone and allocates nothing."""
    at = next((i for i, a in enumerate(args) if callable(a)), None)  # the outputs callback (poll may follow it)
    if at is None:
        return args
    for field, address in zip(_OUTPUT_FIELDS[launch], args[at]()):  # the callback keeps the tensors it made alive
        setattr(args[2], field, address)
    return (*args[:at], None, *args[at + 1:])


def _profile(ops: dict[str, Any], C: Any, timed: Any, prims: dict[str, Any]) -> str:
    """cProfile's top entries over the calls `timed` makes of each op's Python path (its native launch, an attribute
    of `C`, a no-op meanwhile on every rank), then the host us of each of `prims`, in the same loop."""
    import cProfile
    import io
    import pstats

    out = []
    for name, (fn, launch) in ops.items():
        real = getattr(C, launch)
        setattr(C, launch, _no_launch)
        prof = cProfile.Profile()

        def profiled(fn: Any = fn, prof: Any = prof) -> None:
            prof.enable()
            try:
                fn()
            finally:
                prof.disable()

        try:
            timed(profiled)
        finally:
            setattr(C, launch, real)
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(20)
        out.append(f"==== {name}: Python path, cProfile (own time first)\n{text.getvalue()}")
    for what, prim in prims.items():
        out.append(f"host us per call  {what:36s} {timed(prim):7.2f}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--calls", type=int, default=40)
    p.add_argument("--loop", choices=("sleep", "bench"), default="sleep",
                   help="enqueue behind a sleeping GPU (default), or as the bench's default mode times a call")
    p.add_argument("--profile", action="store_true",
                   help="then cProfile each op's Python path and time the host primitives it calls")
    args = p.parse_args(argv)
    import torch
    import torch.multiprocessing as mp

    if torch.cuda.device_count() < 2:
        print("ce_host needs 2 GPUs (the copy-engine ops run between GPUs)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(2, os.path.join(tmp, "init"), args), nprocs=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
