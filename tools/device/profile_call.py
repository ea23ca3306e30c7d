"""Host-side cost of one dispatch / combine call (one process, one GPU): us per call without syncing, then the
cProfile top entries. Usage: python tools/device/profile_call.py [--tokens 128] [--calls 500] [--timeline]

Small token counts keep the GPU ahead of the host, so the loop's time per call is the host's; at large ones the
launch queue fills and the loop waits for the GPU instead."""
from __future__ import annotations

import argparse
import cProfile
import pstats
import time
from collections.abc import Callable
from typing import Any

import torch
from one_gpu_case import one_gpu_case


def _timeline(name: str, fn: Callable[[], Any], flush: torch.Tensor) -> None:
    """The bench's loop (flush, events, call) under the profiler: what the GPU and the host did between the flush and
    the end event, for the last two iterations."""
    from torch.profiler import ProfilerActivity, profile

    from uccl_moe.bench._timing import time_op

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        time_op(fn, flush, 6, 0)
    evs = sorted(prof.events(), key=lambda ev: ev.time_range.start)
    marks = [ev for ev in evs if "Fill" in ev.name and ev.device_type.name == "CUDA"]
    t0 = marks[-2].time_range.start
    print(f"--- {name}: events of the last two iterations (us from the flush kernel's start)")
    for ev in evs:
        if ev.time_range.start >= t0 and ev.name not in ("aten::empty",):
            dev = "GPU" if ev.device_type.name == "CUDA" else "cpu"
            print(f"{ev.time_range.start - t0:9.1f} {ev.time_range.end - t0:9.1f} {dev} {ev.name[:90]}")


def _on_comm(fn: Callable[..., Any], buf: Any) -> None:
    """`fn` with Megatron's stream arguments (the comm stream, an event the caller's stream then waits for)."""
    fn(previous_event=buf.capture(), async_finish=True, allocate_on_comm_stream=True)[-1].current_stream_wait()


def _host_profile(name: str, fn: Callable[[], Any], calls: int, top: int) -> None:
    """Host us per call of `calls` back-to-back calls, then where that time goes (cProfile, by own time)."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t0) / calls * 1e6
    torch.cuda.synchronize()
    print(f"{name}: {host:.1f} us host time per call")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(top)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--calls", type=int, default=500)
    p.add_argument("--top", type=int, default=25, help="cProfile entries to print per op")
    p.add_argument("--timeline", action="store_true", help="also print the profiler timeline of the bench loop")
    p.add_argument("--plain", action="store_true", help="only run --calls calls of each op (for ncu / nsys)")
    p.add_argument("--caller-stream", choices=("comm", "caller", "both"), default="both",
                   help="synchronous ops on the comm stream, on the caller's (UCCL_MOE_CALLER_STREAM_OPS=1), or each "
                        "op both ways, one after the other")
    args = p.parse_args()
    with one_gpu_case(args.tokens, args.hidden) as c:
        from uccl_moe.bench._timing import FLUSH_BYTES, time_op

        buf, cfg, idx, w, x, layout, r, T = c.buf, c.cfg, c.idx, c.w, c.x, c.layout, c.result, args.tokens
        E, y, view = 256, r.recv_x, c.view
        x8 = (x.float().clamp(-440, 440).to(torch.float8_e4m3fn),
              (torch.rand((T, args.hidden // 128), device="cuda") + 0.01).T.contiguous().T)
        ops = {"cached dispatch": lambda: buf.dispatch(x, handle=r.handle, config=cfg),
               "cached dispatch fp8": lambda: buf.dispatch(x8, handle=r.handle, config=cfg),
               "combine": lambda: buf.combine(y, r.handle, config=cfg),
               "combine from the buffer": lambda: buf.combine(view, r.handle, config=cfg),
               "combine with weights": lambda: buf.combine(y, r.handle, topk_weights=r.recv_topk_weights, config=cfg),
               "dispatch (worst)": lambda: buf.dispatch(x, topk_idx=idx, topk_weights=w, config=cfg,
                                                        num_worst_tokens=T, **layout),
               "dispatch (worst, Megatron's args)": lambda: _on_comm(lambda **kw: buf.dispatch(
                   x, topk_idx=idx, topk_weights=w, config=cfg, num_worst_tokens=T, **layout, **kw), buf),
               "combine (Megatron's args)": lambda: _on_comm(
                   lambda **kw: buf.combine(y, r.handle, config=cfg, **kw), buf),
               "layout": lambda: buf.get_dispatch_layout(idx, E),
               "empty (baseline)": lambda: torch.empty((T, args.hidden), dtype=torch.bfloat16, device="cuda")}
        flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")
        modes = {"comm": [False], "caller": [True], "both": [False, True]}[args.caller_stream]
        for caller_ops, (name, fn) in ((m, op) for op in ops.items() for m in modes):
            buf._comm._caller_ops = caller_ops  # UCCL_MOE_CALLER_STREAM_OPS, as the Buffer read it
            if len(modes) > 1:
                name += " [caller's stream]" if caller_ops else " [comm stream]"
            if name.startswith("combine from the buffer"):  # the other ops' rings ran over the view: refill it
                view = buf.get_combine_buffer(r.handle, args.hidden)
                view.copy_(y)
            if args.plain:
                for _ in range(args.calls):
                    flush.zero_()
                    fn()
                torch.cuda.synchronize()
            else:
                med, med_host = time_op(fn, flush, 20, 0)
                print(f"--- {name}: event time, flushed, not profiled: median {med:.1f} us (host {med_host:.1f} us)")
                if args.timeline:
                    _timeline(name, fn, flush)
                _host_profile(name, fn, args.calls, args.top)


if __name__ == "__main__":
    main()
