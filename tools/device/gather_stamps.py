"""Where the copy-engine dispatch's gather spends a launch, from a stamped build
(native/src/kernels/intranode/gather_stamps.cuh): each launch prints one ``gather-stamp`` line per rank, in us from
the launch's first block: the rows' start (``ready``), the first row done, the last own row done (``own_end``), the
first peer row begun and the last one done, the last block's arrival (``rows_done``), every peer's last copy flag
seen (``flag``) and the end after the done hand-shake. This runs the API-default cached dispatch at the bench's
headline setting, each rank's output (the kernel's lines) into its own file, and prints the summary; --summary
summarizes such files again.

Where every rank has its own GPU the ranks are aligned as the bench's device time aligns them (a one-float
all-reduce and a GPU sleep before each call). Where ranks share a GPU (one GPU lent: two ranks on it), processes take
it by time slices: a rank's launch that waits for a peer spins out its slice, and the launch of the rank that came
last, whose peers' copies were waiting at its gate, runs alone once they land. The summary then keeps, per call, the
rank with the earliest ``rows_done`` (header ``mode=shared``): the gather's own pace on one GPU, not the link's.
A value the kernel could not stamp (a launch with no own or no peer row) prints as -1 and counts in no median.
The flag and end stamps are taken in the gather's last block, so this runs the in-kernel end
(UCCL_MOE_CE_END_BESIDE=0; the default ends a gated op beside the kernel, where no stamp line would be printed).

    UCCL_MOE_BUILD_DIR=build/stamp tools/build_inplace.sh -DUCCL_MOE_CUDA_ARCHS=90 \\
        -DCMAKE_CUDA_FLAGS=-DUCCL_MOE_STAMP_GATHER     (add -DUCCL_MOE_STAMP_WAIT_ALL inside the quotes of
        "-DUCCL_MOE_STAMP_GATHER -DUCCL_MOE_STAMP_WAIT_ALL": rows start once every peer's copy landed)
    python tools/device/gather_stamps.py [--ops fp8,bf16] [--iters 12] [--ranks 2] [--out DIR] [--skip 3]
    python tools/device/gather_stamps.py --summary DIR/rank*.log [--skip 3]
    tools/build_inplace.sh -DUCCL_MOE_CUDA_ARCHS=90    (the shipped module back in place)
"""

from __future__ import annotations

import argparse
import ctypes
import os
import re
import statistics
import sys
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any
from unittest import mock

# this folder's tools (it leads sys.path)
from ce_timeline import add_headline_args, headline, headline_calls, spawn_headline

FIELDS = ("ready", "first_row", "own_end", "peer_begin", "peer_end", "rows_done", "flag", "end")
OPS = ("fp8", "bf16")
_LINE = re.compile(r"gather-stamp rank=(\d+) launch=(\d+) row_bytes=(\d+) parts=(\d+) ((?:\w+=-?[\d.]+ ?)+)$")
_MODE = re.compile(r"gather-stamps mode=(aligned|shared) ranks=(\d+)")
Kind = tuple[int, int]  # (row_bytes, parts)


def parse(lines: list[str]) -> tuple[str | None, dict[Kind, dict[int, dict[int, dict[str, float]]]]]:
    """(the run's mode from its header, or None; {(row_bytes, parts): {rank: {launch: fields}}}). A line whose fields
    differ from FIELDS raises ValueError (the kernel and this script drifted apart)."""
    mode = None
    out: dict[Kind, dict[int, dict[int, dict[str, float]]]] = defaultdict(lambda: defaultdict(dict))
    for line in lines:
        m = _MODE.search(line)
        if m is not None:
            mode = m[1]
            continue
        m = _LINE.search(line.rstrip())
        if m is None:
            continue
        vals = {k: float(v) for k, v in (kv.split("=") for kv in m[5].split())}
        if tuple(vals) != FIELDS:
            raise ValueError(f"gather-stamp line with fields {list(vals)}, expected {list(FIELDS)}: {line.strip()}")
        out[(int(m[3]), int(m[4]))][int(m[1])][int(m[2])] = vals
    return mode, out


def _median(values: list[float]) -> float:
    """The median of the stamped values (>= 0; -1 is the kernel's "not stamped"), NaN where there is none."""
    kept = [v for v in values if v >= 0]
    return statistics.median(kept) if kept else float("nan")


def summarise(groups: dict[Kind, dict[int, dict[int, dict[str, float]]]], skip: int,
              shared: bool) -> list[dict[str, Any]]:
    """One row per row kind and rank (aligned) or per row kind (shared: per call, the rank whose rows were done
    first): the median of each field over the launches after the first `skip` (all where there are no more), and
    `launches`. A launch number is a call of every rank (each counts its own launches from 0); in shared mode a call
    some rank has no line of is left out."""
    rows: list[dict[str, Any]] = []
    for (row_bytes, parts), by_rank in sorted(groups.items()):
        if shared:
            calls = sorted(set.intersection(*(set(v) for v in by_rank.values())))
            picks = {"late": [min((by_rank[r][k] for r in by_rank), key=lambda f: f["rows_done"]) for k in calls]}
        else:
            picks = {str(r): [v[k] for k in sorted(v)] for r, v in sorted(by_rank.items())}
        for who, launches in picks.items():
            kept = launches[skip:] or launches
            med = {k: _median([f[k] for f in kept]) for k in FIELDS}
            rows.append({"row_bytes": row_bytes, "parts": parts, "rank": who, "launches": len(kept), **med})
    return rows


def _worker(rank: int, R: int, init: str, args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from uccl_moe.bench._timing import FLUSH_BYTES, time_op

    # This rank's output, the kernel's printf with it, into its own file: two processes' lines never interleave.
    log = open(os.path.join(args.out, f"rank{rank}.log"), "w")  # noqa: SIM115 - fd 1 points at it until exit
    sys.stdout.flush()
    os.dup2(log.fileno(), 1)
    shared = torch.cuda.device_count() < R
    buf, h, y, xb, x8 = headline(rank, R, init, args.tokens, args.hidden)
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    gloo = dist.new_group(list(range(R)), backend="gloo")
    if rank == 0:
        print(f"gather-stamps mode={'shared' if shared else 'aligned'} ranks={R}", flush=True)
    ops = headline_calls(buf, h, y, xb, x8)
    one = torch.ones(1, device="cuda")
    for name in args.ops:
        fn = ops[name]
        if shared:  # NCCL takes one rank per GPU: the host aligns the ranks
            for _ in range(args.iters):
                flush.fill_(1)
                torch.cuda.synchronize()
                dist.barrier(group=gloo)
                fn()
            torch.cuda.synchronize()
        else:
            time_op(fn, flush, args.iters, 0, align=lambda: dist.all_reduce(one), hold=True)
        dist.barrier(group=gloo)
    torch.cuda.synchronize()
    buf.destroy()
    dist.destroy_process_group()
    sys.stdout.flush()
    ctypes.CDLL(None).fflush(None)  # the kernel's lines, in the C library's stdout buffer


def _summary(paths: list[str], skip: int) -> int:
    lines = [ln for path in paths for ln in Path(path).read_text(errors="replace").splitlines()]
    try:
        mode, groups = parse(lines)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 1
    if not groups:
        print("no gather-stamp lines: run this on a build with -DUCCL_MOE_STAMP_GATHER (see --help)", file=sys.stderr)
        return 1
    print(f"mode {mode or 'unknown (no header): aligned assumed'}; us from each launch's first block")
    _print_summary(summarise(groups, skip, mode == "shared"))
    return 0


def _print_summary(rows: list[dict[str, Any]]) -> None:
    print(f"{'row_bytes':>9} {'parts':>5} {'rank':>4} {'n':>3} " + " ".join(f"{k:>10}" for k in FIELDS))
    for r in rows:
        print(f"{r['row_bytes']:>9} {r['parts']:>5} {r['rank']:>4} {r['launches']:>3} "
              + " ".join(f"{r[k]:>10.1f}" for k in FIELDS))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_headline_args(p)
    p.add_argument("--iters", type=int, default=12, help="calls per op (each prints one line per rank)")
    p.add_argument("--ops", default=",".join(OPS), help=f"comma-separated, of: {', '.join(OPS)}")
    p.add_argument("--summary", nargs="+", metavar="LOG", help="summarize these files instead of running")
    p.add_argument("--skip", type=int, default=3, help="warm-up launches left out per rank and row kind")
    p.add_argument("--out", help="run: keep each rank's output here (rank<R>.log); default a temporary folder")
    args = p.parse_args(argv)
    if args.skip < 0:
        p.error("--skip must be at least 0")
    if args.summary:
        return _summary(args.summary, args.skip)
    args.ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    if not args.ops or any(o not in OPS for o in args.ops):
        p.error(f"--ops {args.ops}: pick from {', '.join(OPS)}")
    if args.iters < 1:
        p.error("--iters must be at least 1")
    if args.ranks < 2:
        p.error("--ranks must be at least 2")
    from uccl_moe import env

    if os.environ.get("UCCL_MOE_CE_END_BESIDE", "") != "" and env.get("CE_END_BESIDE"):  # set on by the caller
        p.error("the stamps need the end in the gather's last block: unset UCCL_MOE_CE_END_BESIDE or set it to 0")
    # the ranks inherit the in-kernel end; the caller's environment is as it was afterwards
    with mock.patch.dict(os.environ, {"UCCL_MOE_CE_END_BESIDE": "0"}), tempfile.TemporaryDirectory() as tmp:
        if args.out is None:
            args.out = tmp
        os.makedirs(args.out, exist_ok=True)
        rc = spawn_headline(_worker, args, 1, "gather_stamps needs a GPU (ranks may share it)")
        if rc != 0:
            return rc
        return _summary([os.path.join(args.out, f"rank{r}.log") for r in range(args.ranks)], args.skip)


if __name__ == "__main__":
    sys.exit(main())
