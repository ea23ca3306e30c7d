"""Host microseconds of Buffer's own Python path per op (validation, argument set-up, stream plumbing), on a CPU with
no GPU: a world-of-one gloo Buffer whose backend returns ready-made tensors, so only Buffer's code is timed (plus two
small allocations per non-cached dispatch). Each figure is the median over 7 rounds of --calls / 7 calls (this
machine's other load shows as slow rounds).
Usage: python tools/device/python_path.py [--calls 3000] [--profile dispatch]
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist

T, H, E, K = 128, 7168, 256, 8


def _null_backend(ctx: Any) -> Any:
    from uccl_moe.backends.base import Backend

    class Null(Backend):
        """Returns tensors of the right shapes and does nothing."""

        name = "null"

        def __init__(self, ctx: Any) -> None:
            super().__init__(ctx)
            self.layout = (torch.zeros(1, dtype=torch.int32), None, torch.zeros(E, dtype=torch.int32),
                           torch.ones((T, 1), dtype=torch.bool))
            i32 = torch.int32
            self.handle = (torch.zeros((1, 1), dtype=i32), torch.zeros((1, 4), dtype=i32),
                           torch.zeros((1, 4), dtype=i32), torch.arange(T, dtype=i32),
                           torch.ones((T, 1), dtype=torch.bool), torch.zeros((T, 1), dtype=i32))
            self.rows = torch.zeros((T, H), dtype=torch.bfloat16)

        def get_dispatch_layout(self, topk_idx: Any, num_experts: int) -> Any:
            return self.layout

        def dispatch(self, req: Any) -> Any:
            return (self.rows, None, torch.zeros((T, K), dtype=torch.int64), torch.zeros((T, K)), [0] * E,
                    self.handle)

        def cached_dispatch(self, x: Any, x_scales: Any, handle: Any, config: Any) -> Any:
            return self.rows, None

        def combine(self, x: Any, handle: Any, topk_weights: Any, bias: Any, config: Any) -> Any:
            return self.rows, None

    return Null(ctx)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--calls", type=int, default=3000)
    p.add_argument("--profile", choices=("layout", "dispatch", "cached", "combine"), help="cProfile this op after")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(d, 'init')}", rank=0, world_size=1)
        from uccl_moe import Buffer

        buf = Buffer(dist.group.WORLD, Buffer.get_dispatch_config(1).get_nvl_buffer_size_hint(H * 2, 1),
                     backend="reference")
        buf._backend = _null_backend(buf._backend.ctx)  # type: ignore[union-attr]
        idx, w, x = torch.randint(0, E, (T, K)), torch.rand((T, K)), torch.randn((T, H)).bfloat16()
        lay = buf.get_dispatch_layout(idx, E)
        layout = dict(num_tokens_per_rank=lay.num_tokens_per_rank, is_token_in_rank=lay.is_token_in_rank,
                      num_tokens_per_expert=lay.num_tokens_per_expert)
        r = buf.dispatch(x, topk_idx=idx, topk_weights=w, **layout)
        ops = {"layout": lambda: buf.get_dispatch_layout(idx, E),
               "dispatch": lambda: buf.dispatch(x, topk_idx=idx, topk_weights=w, **layout),
               "cached": lambda: buf.dispatch(x, handle=r.handle),
               "combine": lambda: buf.combine(r.recv_x, r.handle)}
        for name, fn in ops.items():
            for _ in range(200):
                fn()
            n = max(1, args.calls // 7)
            rounds = []
            for _ in range(7):
                t0 = time.perf_counter()
                for _ in range(n):
                    fn()
                rounds.append((time.perf_counter() - t0) / n * 1e6)
            print(f"{name}: {statistics.median(rounds):.1f} us per call")
        if args.profile:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(args.calls):
                ops[args.profile]()
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(18)
        buf.destroy()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
