"""The run's ceilings for ``uccl-moe bench``: the one-way peer copy (copy engine) and the SM push (every GPU's SMs
storing into its peers' memory at once), measured once per run beside the ops."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ._timing import FLUSH_BYTES, time_op


def peer_copy_ceiling(buf: Any, rank: int, R: int, gloo: Any, nbytes: int, args: argparse.Namespace) -> float:
    """One-way copy-engine GB/s from rank 0 into rank 1's NVL buffer (others idle)."""
    import torch
    import torch.distributed as dist

    backend = buf._backend  # the benchmark reaches the native backend on purpose
    gbps = 0.0
    if R > 1 and hasattr(backend, "peer_copy"):
        dev = torch.device("cuda", torch.cuda.current_device())
        flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=dev)
        if rank == 0:
            us = time_op(lambda: backend.peer_copy(1, nbytes), flush, args.iters, args.warmup)[0]
            gbps = nbytes / (us * 1e3)
    vals: list[Any] = [None] * R
    dist.all_gather_object(vals, gbps, group=gloo)  # after rank 0's copies (time_op synchronizes)
    if R > 1 and hasattr(backend, "peer_copies_done"):
        backend.peer_copies_done()
    return float(vals[0])


PUSH_ROUNDS = 3  # medians timed for the SM-push ceiling; the best is kept


def sm_push_ceiling(rank: int, R: int, gloo: Any, nbytes: int, args: argparse.Namespace) -> float:
    """GB/s one GPU stores into its peers' memory with SM stores, every GPU at once (the bare-push ceiling; the
    slowest rank's time). The store is torch's copy kernel on the sender's SMs (all of them: torch sizes the grid)
    writing into a tensor on the peer GPU over P2P: a BF16 -> float32 cast, so that torch cannot hand it to the copy
    engine (PyTorch aten/src/ATen/native/cuda/Copy.cu: only a same-dtype contiguous pair becomes a cudaMemcpyAsync;
    otherwise with peer access the kernel runs on the source device). `nbytes` float32 bytes are stored per GPU, split
    over the peers. The best of PUSH_ROUNDS medians: a ceiling is what the link reached, and a single median
    sometimes reads far below it (docs/benchmarks.md). 0.0 where not measurable (one rank,
    ranks sharing a GPU, or no peer access)."""
    import torch
    import torch.distributed as dist

    n_gpus = torch.cuda.device_count()
    me = torch.cuda.current_device()
    peers = [p % n_gpus for p in range(R) if p != rank]
    ok = 1 < R <= n_gpus and all(torch.cuda.can_device_access_peer(me, p) for p in peers)
    elems = max(nbytes // 4 // max(len(peers), 1), 1)
    dsts: list[Any] = []
    src = torch.randn(elems, device=me).bfloat16()

    def push() -> None:
        for d in dsts:
            d.copy_(src)

    if ok:
        try:  # a trial push, so a rank that cannot push says so before any rank waits in the timed collectives
            dsts.extend(torch.empty(elems, dtype=torch.float32, device=torch.device("cuda", p)) for p in peers)
            push()
            torch.cuda.synchronize()
        except RuntimeError as e:
            print(f"rank {rank}: SM push ceiling not measured: {e}", file=sys.stderr)
            ok = False
    oks: list[Any] = [None] * R
    dist.all_gather_object(oks, ok, group=gloo)
    if not all(oks):
        return 0.0
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=me)
    token = torch.zeros(1, dtype=torch.float32, device=me)

    best = 0.0
    for _ in range(PUSH_ROUNDS):
        us = time_op(push, flush, args.iters, args.warmup, lambda: dist.all_reduce(token))[0]
        times: list[Any] = [None] * R
        dist.all_gather_object(times, us, group=gloo)
        best = max(best, elems * 4 * len(peers) / (max(times) * 1e3))
    dsts.clear()
    torch.cuda.empty_cache()
    return float(best)
