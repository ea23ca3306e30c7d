"""Host time of a cached dispatch / combine and of each part of its Python path (one process, one GPU).

The GPU is held by a long sleep kernel while the host enqueues, so the GPU never pushes back and each figure is the
host's alone (median of 7 rounds of --calls calls). Usage: python tools/device/host_parts.py [--tokens 128]"""
from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from one_gpu_case import one_gpu_case


def host_us(fn: Callable[[], Any], calls: int, rounds: int = 7,
            sync: Callable[[], Any] | None = None) -> float:
    """Median over `rounds` rounds of the host us per call of `calls` calls enqueued behind a sleeping GPU. `sync`
    (several ranks: a barrier) runs after the warm-up and after each round, once the GPU is done."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    if sync is not None:
        sync()
    times = []
    for _ in range(rounds):
        torch.cuda._sleep(200_000_000)  # ~0.1 s: longer than any round's enqueueing
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
        if sync is not None:
            sync()
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--calls", type=int, default=100)
    args = p.parse_args()
    with one_gpu_case(args.tokens, args.hidden) as c:
        from uccl_moe import _C
        from uccl_moe.utils import current_raw_stream, current_stream

        buf, cfg, x, r, view, T, H = c.buf, c.cfg, c.x, c.result, c.view, args.tokens, args.hidden
        y, h, be = r.recv_x, r.handle, buf._backend
        ev = torch.cuda.Event()
        comm = buf._comm.stream  # not get_comm_stream(): handing it out makes every later op join the comm stream

        def comm_context() -> None:
            with buf._comm_context(None):
                pass

        def on_caller(fn: Callable[[], Any]) -> Callable[[], Any]:
            """`fn` with synchronous ops on the caller's stream (UCCL_MOE_CALLER_STREAM_OPS=1)."""
            def run() -> Any:
                buf._comm._caller_ops = True
                try:
                    return fn()
                finally:
                    buf._comm._caller_ops = False
            return run

        def plumbing_on_caller() -> None:
            """An op's stream plumbing on the caller's stream, no op inside (the context makes the closing join)."""
            on = buf._begin(None, False, False)
            with buf._comm_context(on):
                pass
            buf._finish(False, [x], [y, None], on)

        def comm_path(fn: Callable[..., Any]) -> Callable[[], Any]:
            """The op on the comm stream, with Megatron's arguments (the caller waits for the returned event)."""
            return lambda: fn(previous_event=buf.capture(), async_finish=True,
                              allocate_on_comm_stream=True).event.current_stream_wait()

        parts = {  # the view first: any later op that writes the NVL buffer makes combine refuse it
            "Buffer.combine (view)": lambda: buf.combine(view, h, config=cfg),
            "NativeBackend._combine_from_buffer": lambda: be._combine_from_buffer(view, h, None, (None, None), cfg),
            "Buffer.dispatch (cached)": lambda: buf.dispatch(x, handle=h, config=cfg),
            "Buffer.combine": lambda: buf.combine(y, h, config=cfg),
            "Buffer.combine (weights)": lambda: buf.combine(y, h, topk_weights=r.recv_topk_weights, config=cfg),
            "Buffer.dispatch (cached, caller's stream)": on_caller(lambda: buf.dispatch(x, handle=h, config=cfg)),
            "Buffer.combine (caller's stream)": on_caller(lambda: buf.combine(y, h, config=cfg)),
            "Buffer.dispatch (cached, Megatron's args)": comm_path(
                lambda **kw: buf.dispatch(x, handle=h, config=cfg, **kw)),
            "Buffer.combine (Megatron's args)": comm_path(lambda **kw: buf.combine(y, h, config=cfg, **kw)),
            "NativeBackend.cached_dispatch": lambda: be.cached_dispatch(x, None, h, cfg),
            "NativeBackend.combine": lambda: be.combine(y, h, None, (None, None), cfg),
            "Buffer._begin + context + _finish (caller's stream)": on_caller(plumbing_on_caller),
            "Buffer._begin (comm stream)": lambda: buf._begin(None, False, True),
            "Buffer._finish (comm stream, 2 outputs)": lambda: buf._finish(False, [x], [y, None], None),
            "Buffer._comm_context": comm_context,
            "Buffer._check_handle": lambda: buf._check_handle(h),
            "utils.current_stream": current_stream,
            "utils.current_raw_stream": lambda: current_raw_stream(0),
            "torch.cuda.current_device": torch.cuda.current_device,
            "Event.record + wait_event": lambda: (ev.record(comm), torch.cuda.current_stream(0).wait_event(ev)),
            "torch.empty [T, H] bf16": lambda: torch.empty((T, H), dtype=torch.bfloat16, device="cuda"),
            "_C.intranode_geometry": lambda: _C.intranode_geometry(24, 1, 8, 256),
            "rt.aborted": be._rt.aborted,
        }
        width = max(len(n) for n in parts)
        for name, fn in parts.items():
            print(f"{name:<{width}}  {host_us(fn, args.calls):7.2f} us", flush=True)


if __name__ == "__main__":
    main()
