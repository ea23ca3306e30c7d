"""How much of the bench's default-mode time is host time: the API-default cached dispatch (FP8 with column-major
scales, BF16), combine and NCCL's all-to-all of the same rows (as the bench packs them: FP8 rows with their scales,
BF16 rows, the combine's rows back) at the bench's headline setting, each timed by the
bench's loop (``bench._timing.time_op``: ranks aligned, L2 flushed, CUDA events around the Python call) with L2
flushes of several sizes and held (device time: the GPU sleeps while the host enqueues), alternating in one process
per rank, --rounds rounds. A flush's GPU time is the host time per call that the loop hides; where an op's figure
falls as the flush grows, toward its held figure, the GPU waited for the host at the smaller flush.

Prints per op and mode the slowest rank's us of every round and its host us per call. Figures are per machine and
call (docs/benchmarks.md).

    python tools/device/flush_ab.py [--flush-mb 256,768] [--rounds 3] [--iters 20] [--tokens 4096] [--hidden 7168]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from ce_timeline import headline_ab_main  # this folder's tools (its folder leads sys.path)

OPS = ("fp8", "bf16", "combine", "nccl_fp8", "nccl_bf16", "nccl_combine")
HELD = "held"


def parse_sizes(spec: str) -> list[int]:
    """``--flush-mb``: comma-separated positive MB, at least one; ValueError otherwise."""
    try:
        sizes = [int(s) for s in spec.split(",") if s.strip()]
    except ValueError:
        sizes = []
    if not sizes or any(s <= 0 for s in sizes) or len(set(sizes)) != len(sizes):
        raise ValueError(f"--flush-mb {spec!r}: give distinct positive sizes in MB, comma-separated (e.g. 256,768)")
    return sizes


def modes(sizes: Sequence[int]) -> list[str]:
    """The timed modes of one op in a round: each flush size, then held (behind the smallest flush, as the bench's
    --device-time)."""
    return [f"{s}MB" for s in sizes] + [HELD]


def report(res: Mapping[tuple[str, str], Sequence[tuple[float, float]]]) -> list[str]:
    """One line per (op, mode) in insertion order: every round's us, then every round's host us per call."""
    lines = []
    for (op, mode), runs in res.items():
        us = " ".join(f"{t:6.1f}" for t, _ in runs)
        host = " ".join(f"{h:5.1f}" for _, h in runs)
        lines.append(f"{op:12s} {mode:7s} us {us}   host {host}")
    return lines


def _worker(rank: int, R: int, init: str, args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from ce_timeline import close_headline, headline, headline_calls, slowest_time

    buf, h, y, xb, x8 = headline(rank, R, init, args.tokens, args.hidden)
    flushes = {s: torch.empty(s << 20, dtype=torch.uint8, device="cuda") for s in args.sizes}
    col = h.rank_prefix_matrix[:, rank].cpu()
    recv_from = torch.diff(col, prepend=col.new_zeros(1)).tolist()  # rows from each source (the bench's packing)
    send_to = h.is_token_in_rank.sum(0).cpu().tolist()  # rows to each rank

    def nccl(row_bytes: int, back: bool) -> Any:
        rows_out, rows_in = (sum(recv_from), sum(send_to)) if back else (sum(send_to), sum(recv_from))
        send = torch.randint(0, 255, (rows_out, row_bytes), dtype=torch.uint8, device="cuda")
        recv = torch.empty((rows_in, row_bytes), dtype=torch.uint8, device="cuda")
        splits_out, splits_in = (recv_from, send_to) if back else (send_to, recv_from)
        return lambda: dist.all_to_all_single(recv, send, splits_in, splits_out)

    H = args.hidden
    ops = {**headline_calls(buf, h, y, xb, x8), "nccl_fp8": nccl(H + 4 * (H // 128), False),
           "nccl_bf16": nccl(2 * H, False), "nccl_combine": nccl(2 * H, True)}
    res: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for _ in range(args.rounds):
        for name in OPS:
            for mode in modes(args.sizes):
                flush = flushes[min(args.sizes) if mode == HELD else int(mode[:-2])]
                res.setdefault((name, mode), []).append(slowest_time(ops[name], flush, args.iters, mode == HELD))
    sizes = ", ".join(f"{s} MB" for s in args.sizes)
    close_headline(rank, buf, f"{R} ranks, {args.tokens} tokens, hidden {args.hidden}, {args.rounds} rounds; flushes "
                   f"{sizes}; held = device time", report(res))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--flush-mb", default="256,768", help="L2 flush sizes in MB, comma-separated (the bench's: 256)")
    p.add_argument("--rounds", type=int, default=3)
    return headline_ab_main(p, argv, _worker, "flush_ab.py", lambda a: setattr(a, "sizes", parse_sizes(a.flush_mb)))


if __name__ == "__main__":
    sys.exit(main())
