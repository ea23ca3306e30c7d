"""``python -m uccl_moe.bench.internode``: emulated-internode HT dispatch/combine (loopback transport).

Spawns ``--ranks`` processes (one per GPU; shared GPUs make the times meaningless) split into ``--nodes``
emulated nodes (UCCL_MOE_EMULATE_NODES), and times cached-handle dispatch and combine of the DeepSeek-V3 setting
by default. Method: docs/architecture.md §6 (CUDA events, median of ``--iters`` runs after warm-up, slowest rank)
without the L2 flush (the loopback's host staging dominates). Reports ``rdma_GBps`` = rows a rank receives from
ranks of other nodes x row bytes / time, and the time split by stage (rail barrier, pack + post, proxy + copy,
NVLink forwarding / reduction), medians over runs.

These are LOOPBACK figures: the "network" is the CPU proxy driving GPU copy engines over CUDA IPC, or copying
through pinned host memory (``--data host``); they say nothing about a NIC.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import Any


def _worker(rank: int, R: int, init_file: str, args: argparse.Namespace, result_file: str) -> None:
    import torch
    import torch.distributed as dist

    os.environ["UCCL_MOE_EMULATE_NODES"] = str(args.nodes)
    os.environ["UCCL_MOE_LOOPBACK_GPU_COPY"] = {"gpu": "1", "host": "0"}[args.data]
    from uccl_moe import Buffer, Config, env

    env.prepare_cuda_module_loading()  # before CUDA starts (the package was imported before the knobs above were set)

    torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group("cpu:gloo,cuda:nccl", init_method=f"file://{init_file}", rank=rank, world_size=R)
    gloo = dist.new_group(list(range(R)), backend="gloo")
    assert isinstance(gloo, dist.ProcessGroup)  # all ranks are members (torch >= 2.14 types non-members as -100)

    cfg = Config(args.sms, 8, 256, 6, 128)
    buf = Buffer(dist.group.WORLD, cfg.get_nvl_buffer_size_hint(args.hidden * 2, R), args.rdma_mb << 20,
                 backend="native", explicitly_destroy=True)
    inter = buf._backend._inter  # type: ignore[union-attr]
    T, H, E, K = args.tokens, args.hidden, args.experts, args.topk
    gen = torch.Generator(device="cuda").manual_seed(rank)
    scores = torch.rand((T, E), dtype=torch.float32, device="cuda", generator=gen)
    idx = torch.topk(scores, K, dim=1).indices
    w = torch.rand((T, K), dtype=torch.float32, device="cuda", generator=gen)
    x = torch.randn((T, H), dtype=torch.float32, device="cuda", generator=gen).bfloat16()
    lay = buf.get_dispatch_layout(idx, E)
    res = buf.dispatch(x, num_tokens_per_rank=lay.num_tokens_per_rank, is_token_in_rank=lay.is_token_in_rank,
                       num_tokens_per_expert=lay.num_tokens_per_expert, topk_idx=idx, topk_weights=w, config=cfg)
    G = R // args.nodes
    node = rank // G
    assert res.handle is not None
    torch.cuda.synchronize()  # GPU copies: no blocking pageable device-to-host copy while communication is in flight
    prefix = res.handle.rank_prefix_matrix[:, rank].long()
    counts = torch.diff(prefix, prepend=torch.zeros(1, dtype=torch.long, device="cuda"))
    remote_rows = int(counts.sum() - counts[node * G:(node + 1) * G].sum())
    y: Any = res.recv_x
    handle: Any = res.handle

    def timed(fn: Any) -> tuple[float, dict[str, float]]:
        inter.timeline = []
        fn()
        torch.cuda.synchronize()
        marks = inter.timeline
        inter.timeline = None
        total = marks[0][1].elapsed_time(marks[-1][1])
        split: dict[str, float] = {}
        for (_, a), (name, b) in zip(marks, marks[1:]):
            split[name] = split.get(name, 0.0) + a.elapsed_time(b)
        return total, split

    results: dict[str, Any] = {}
    for op, fn in (("dispatch", lambda: buf.dispatch(x, handle=res.handle, config=cfg)),
                   ("combine", lambda: buf.combine(y, handle, topk_weights=res.recv_topk_weights, config=cfg))):
        for _ in range(3):
            timed(fn)
        runs = [timed(fn) for _ in range(args.iters)]
        totals = [t for t, _ in runs]
        med = statistics.median(totals)
        split = {k: statistics.median(r[1][k] for r in runs) for k in runs[0][1]}
        everyone: list[Any] = [None] * R
        dist.all_gather_object(everyone, (med, split, remote_rows), group=gloo)
        slow = max(everyone, key=lambda e: e[0])
        rows = min(e[2] for e in everyone)
        results[op] = {"ms": slow[0], "split_ms": slow[1], "remote_rows_min": rows,
                       "rdma_GBps": rows * H * 2 / (slow[0] * 1e-3) / 1e9 if slow[0] > 0 else 0.0}
    results["proxy"] = inter.proxy_counters()
    results["data_path"] = "host-staged" if inter.rt.host_staged else "GPU copy engines"
    if rank == 0:
        with open(result_file, "w") as f:
            json.dump(results, f)
    dist.barrier(group=gloo)
    buf.destroy()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=0, help="processes (0 = all GPUs)")
    p.add_argument("--nodes", type=int, default=2, help="emulated nodes")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--sms", type=int, default=24)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--rdma-mb", type=int, default=1024, help="RDMA buffer per rank (MiB)")
    p.add_argument("--data", choices=["host", "gpu"], default="host",
                   help="loopback data path: host-staged pinned memory (default) or GPU copy engines over CUDA IPC "
                        "(UCCL_MOE_LOOPBACK_GPU_COPY=1)")
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    import torch

    from ._gpus import gpus_or_explain
    from ._run import spawn

    if not gpus_or_explain("python -m uccl_moe.bench.internode (GPU kernels over an emulated-node loopback)"):
        return 2
    R = args.ranks or torch.cuda.device_count()
    res = spawn(_worker, R, args)
    if res is None:
        return 1
    dev = torch.cuda.get_device_name(0)
    print(f"emulated internode (LOOPBACK, not a NIC): {R} ranks as {args.nodes} nodes x {R // args.nodes} on "
          f"{min(R, torch.cuda.device_count())} x {dev}; T={args.tokens} H={args.hidden} E={args.experts} "
          f"top-{args.topk}, BF16; data path: {res['data_path']}")
    for op in ("dispatch", "combine"):
        r = res[op]
        split = ", ".join(f"{k} {v:.3f}" for k, v in r["split_ms"].items())
        print(f"{op:>8}: {r['ms']:.3f} ms, rdma_GBps {r['rdma_GBps']:.2f} ({r['remote_rows_min']} remote rows); "
              f"split ms: {split}")
    print(f"proxy counters (rank 0): {res['proxy']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": dev, "args": vars(args), **res}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
