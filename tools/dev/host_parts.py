"""Host time of a cached dispatch / combine and of each part of its Python path (one process, one GPU).

The GPU is held by a long sleep kernel while the host enqueues, so the GPU never pushes back and each figure is the
host's alone (median of 7 rounds of --calls calls). Usage: python tools/dev/host_parts.py [--tokens 128]"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


def host_us(fn: Callable[[], Any], calls: int) -> float:
    """Median over 7 rounds of the host us per call of `calls` calls enqueued behind a sleeping GPU."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    rounds = []
    for _ in range(7):
        torch.cuda._sleep(200_000_000)  # ~0.1 s: longer than any round's enqueueing
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        rounds.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(rounds)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--calls", type=int, default=100)
    args = p.parse_args()
    torch.cuda.set_device(0)
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("cpu:gloo,cuda:nccl", init_method=f"file://{os.path.join(d, 'init')}", rank=0,
                                world_size=1)
        from uccl_moe import _C, Buffer, Config
        from uccl_moe.utils import current_raw_stream, current_stream

        cfg = Config(24, 8, 256, 6, 128)
        T, E, H = args.tokens, 256, args.hidden
        nvl = max(cfg.get_nvl_buffer_size_hint(H * 2, 1), Buffer.get_combine_buffer_size_hint(T, H))
        buf = Buffer(dist.group.WORLD, nvl, backend="native", explicitly_destroy=True)
        idx = torch.topk(torch.rand((T, E), device="cuda"), 8, dim=1).indices
        w = torch.rand((T, 8), device="cuda")
        x = torch.randn((T, H), device="cuda").bfloat16()
        lay = buf.get_dispatch_layout(idx, E)
        r = buf.dispatch(x, num_tokens_per_rank=lay.num_tokens_per_rank, is_token_in_rank=lay.is_token_in_rank,
                         num_tokens_per_expert=lay.num_tokens_per_expert, topk_idx=idx, topk_weights=w, config=cfg)
        y, h = r.recv_x, r.handle
        be = buf._backend
        view = buf.get_combine_buffer(h, H)
        view.copy_(y)
        ev = torch.cuda.Event()
        comm = buf.get_comm_stream()

        def comm_context() -> None:
            with buf._comm_context():
                pass

        parts = {  # the view first: any later op that writes the NVL buffer makes combine refuse it
            "Buffer.combine (view)": lambda: buf.combine(view, h, config=cfg),
            "NativeBackend._combine_from_buffer": lambda: be._combine_from_buffer(view, h, None, (None, None), cfg),
            "Buffer.dispatch (cached)": lambda: buf.dispatch(x, handle=h, config=cfg),
            "Buffer.combine": lambda: buf.combine(y, h, config=cfg),
            "Buffer.combine (weights)": lambda: buf.combine(y, h, topk_weights=r.recv_topk_weights, config=cfg),
            "NativeBackend.cached_dispatch": lambda: be.cached_dispatch(x, None, h, cfg),
            "NativeBackend.combine": lambda: be.combine(y, h, None, (None, None), cfg),
            "Buffer._begin": lambda: buf._begin(None),
            "Buffer._finish (2 outputs)": lambda: buf._finish(False, [x], [y, None]),
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
        torch.cuda.synchronize()
        buf.destroy()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
