"""Host time per call of the copy-engine ops at EP2 (2 GPUs): the API-default cached dispatch (FP8 with column-major
scales, BF16) and combine at the bench's headline setting, each rank enqueueing behind a sleeping GPU so that the GPU
never pushes back. Per op: the whole Buffer call, its native launch alone (the same arguments, replayed), and its
Python path alone (the native launch replaced by a no-op on every rank); and NCCL's all_to_all_single of the FP8 rows.
Medians of 5 rounds of --calls calls, rank 0's figures.

    python tools/device/ce_host.py [--tokens 4096] [--hidden 7168] [--calls 40]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any


def host_us(fn: Callable[[], Any], calls: int) -> float:
    """Median over 5 rounds of the host us per call of `calls` calls enqueued behind a sleeping GPU (every rank runs
    the same rounds, so the ops meet their peers once the GPUs wake)."""
    import torch
    import torch.distributed as dist

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    rounds = []
    for _ in range(5):
        torch.cuda._sleep(300_000_000)  # ~0.15 s: longer than a round's enqueueing
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        rounds.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
        dist.barrier()
    return statistics.median(rounds)


def _worker(rank: int, R: int, init: str, args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from uccl_moe import Buffer
    from uccl_moe.backends import _buffer_paths
    from uccl_moe.bench._run import point_inputs

    torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group("cpu:gloo,cuda:nccl", init_method=f"file://{init}", rank=rank, world_size=R)
    T, H, E, K = args.tokens, args.hidden, 256, 8
    Buffer.set_num_sms(24)
    buf = Buffer(dist.group.WORLD, Buffer.get_dispatch_config(R).get_nvl_buffer_size_hint(H * 2, R),
                 explicitly_destroy=True)
    gen = torch.Generator(device="cuda").manual_seed(1234 + rank)  # the bench's inputs
    idx, w, xb, x8 = point_inputs(T, H, E, K, "col", gen, "cuda")
    lay = buf.get_dispatch_layout(idx, E)
    r = buf.dispatch(xb, topk_idx=idx, topk_weights=w, num_tokens_per_rank=lay.num_tokens_per_rank,
                     is_token_in_rank=lay.is_token_in_rank, num_tokens_per_expert=lay.num_tokens_per_expert)
    h, y = r.handle, r.recv_x.clone()
    a2a_in = torch.empty(T * H, dtype=torch.uint8, device="cuda")
    a2a_out = torch.empty_like(a2a_in)
    res = {"NCCL all_to_all_single (FP8 rows)": host_us(lambda: dist.all_to_all_single(a2a_out, a2a_in), args.calls)}
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
        args_seen = seen[-1]
        res[f"{name}: Buffer call"] = host_us(fn, args.calls)
        res[f"{name}: native launch"] = host_us(lambda real=real, a=args_seen: real(*a), args.calls)
        setattr(C, launch, lambda *a: None)
        try:
            res[f"{name}: Python path"] = host_us(fn, args.calls)
        finally:
            setattr(C, launch, real)
    if rank == 0:
        for k, v in res.items():
            print(f"host us per call  {k:36s} {v:7.1f}", flush=True)
    dist.barrier()
    buf.destroy()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--calls", type=int, default=40)
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
