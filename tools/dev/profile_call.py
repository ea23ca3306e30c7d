"""Host-side cost of one cached dispatch / combine call (one process, one GPU): us per call without syncing,
then the cProfile top entries. Usage: python tools/dev/profile_call.py [--tokens 4096] [--calls 500]"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import tempfile
import time

import torch
import torch.distributed as dist


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--calls", type=int, default=500)
    p.add_argument("--plain", action="store_true", help="only run --calls calls of each op (for ncu / nsys)")
    args = p.parse_args()
    torch.cuda.set_device(0)
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("cpu:gloo,cuda:nccl", init_method=f"file://{os.path.join(d, 'init')}", rank=0,
                                world_size=1)
        from uccl_moe import Buffer, Config

        cfg = Config(24, 8, 256, 6, 128)
        buf = Buffer(dist.group.WORLD, cfg.get_nvl_buffer_size_hint(args.hidden * 2, 1), backend="native",
                     explicitly_destroy=True)
        T, E = args.tokens, 256
        idx = torch.topk(torch.rand((T, E), device="cuda"), 8, dim=1).indices
        w = torch.rand((T, 8), device="cuda")
        x = torch.randn((T, args.hidden), device="cuda").bfloat16()
        lay = buf.get_dispatch_layout(idx, E)
        r = buf.dispatch(x, num_tokens_per_rank=lay.num_tokens_per_rank, is_token_in_rank=lay.is_token_in_rank,
                         num_tokens_per_expert=lay.num_tokens_per_expert, topk_idx=idx, topk_weights=w, config=cfg)
        y = r.recv_x
        ops = {"cached dispatch": lambda: buf.dispatch(x, handle=r.handle, config=cfg),
               "combine": lambda: buf.combine(y, r.handle, config=cfg)}
        flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        if args.plain:
            for fn in ops.values():
                for _ in range(args.calls):
                    flush.zero_()
                    fn()
                torch.cuda.synchronize()
            buf.destroy()
            dist.destroy_process_group()
            return
        for name, fn in ops.items():
            # The bench's loop (flush, events, call) under the profiler: what the GPU and the host did between the
            # flush and the end event, for the last two iterations.
            from torch.profiler import ProfilerActivity, profile

            from uccl_moe.bench._run import _time_op

            med = _time_op(fn, flush, 20, 0)
            print(f"--- {name}: event time, flushed, not profiled: median {med:.1f} us")
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                _time_op(fn, flush, 6, 0)  # the same loop, traced
            evs = sorted(prof.events(), key=lambda ev: ev.time_range.start)
            marks = [ev for ev in evs if "Fill" in ev.name and ev.device_type.name == "CUDA"]
            t0 = marks[-2].time_range.start
            print(f"--- {name}: events of the last two iterations (us from the flush kernel's start)")
            for ev in evs:
                if ev.time_range.start >= t0 and ev.name not in ("aten::empty",):
                    dev = "GPU" if ev.device_type.name == "CUDA" else "cpu"
                    print(f"{ev.time_range.start - t0:9.1f} {ev.time_range.end - t0:9.1f} {dev} {ev.name[:90]}")

            for _ in range(20):
                fn()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(args.calls):
                fn()
            host = (time.perf_counter() - t0) / args.calls * 1e6
            torch.cuda.synchronize()
            print(f"{name}: {host:.1f} us host time per call")
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(args.calls):
                fn()
            prof.disable()
            torch.cuda.synchronize()
            pstats.Stats(prof).sort_stats("tottime").print_stats(18)
        buf.destroy()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
