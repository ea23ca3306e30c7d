"""Summary of the ring kernels' phase trace (a build with -DUCCL_MOE_TRACE_DISPATCH:
native/src/kernels/intranode/phase_trace.cuh). Each traced launch prints one ``uccl-trace <op>`` line (op: dispatch,
combine, and the staged combine's stage and pull_staged / pull_view, whose phases the header describes) per role
(send_remote, send_direct, recv) and rank: the mean per warp, in us, of its span and of the time it
spent copying rows (combine's receivers: summing them), writing metadata, waiting (for ring room, for rows, for the
senders it publishes for), copying kept rows, publishing positions and selecting tokens. This averages them over
launches per op, row size, role and rank, skipping each group's first `--skip` launches (warm-up), and adds `other`:
the span less the phases. A line garbled by another process's output (two ranks printing at once) is skipped and
counted; a clean line whose fields differ from the kernel's is an error (the two drifted apart).

    python tools/device/trace_summary.py LOG [LOG...] [--skip 2]
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

PHASES = ("span", "copy", "meta", "wait", "kept", "publish", "select")
_LINE = re.compile(r"uccl-trace (\w+) rank=(\d+) row_bytes=(\d+) role=(\w+) warps=(\d+) (.*)$")
_FLOAT = re.compile(r"-?\d+(\.\d+)?")
Key = tuple[str, int, str, int]  # (op, row_bytes, role, rank)


def parse(lines: list[str], garbled: list[str] | None = None) -> dict[Key, list[dict[str, float]]]:
    """{(op, row_bytes, role, rank): [one dict of PHASES (and warps) per launch, in order]}; lines garbled by
    interleaved output go to `garbled` (if given) instead."""
    out: dict[Key, list[dict[str, float]]] = defaultdict(list)
    for line in lines:
        m = _LINE.search(line)
        if m is None:
            continue
        op, rank, row_bytes, role, warps, rest = m[1], int(m[2]), int(m[3]), m[4], int(m[5]), m[6]
        pairs = [kv.split("=") for kv in rest.split()]
        if not all(len(kv) == 2 and _FLOAT.fullmatch(kv[1]) for kv in pairs) or len({k for k, _ in pairs}) < len(pairs):
            if garbled is not None:
                garbled.append(line)
            continue
        vals = {k: float(v) for k, v in pairs}
        if set(vals) != set(PHASES):
            raise ValueError(f"trace line with fields {sorted(vals)}, expected {PHASES}: {line.strip()}")
        out[(op, row_bytes, role, rank)].append({**vals, "warps": float(warps)})
    return out


def summarise(groups: dict[Key, list[dict[str, float]]], skip: int) -> list[dict[str, float | str]]:
    """One row per (op, row size, role, rank): the mean of each phase over the launches after the first `skip` (all
    of them where there are no more), `other` = span - the phases, and `launches`."""
    rows: list[dict[str, float | str]] = []
    for (op, row_bytes, role, rank), launches in sorted(groups.items()):
        kept = launches[skip:] or launches
        mean = {k: statistics.fmean(d[k] for d in kept) for k in (*PHASES, "warps")}
        other = mean["span"] - sum(mean[k] for k in PHASES[1:])
        rows.append({"op": op, "row_bytes": row_bytes, "role": role, "rank": rank, "launches": len(kept), **mean,
                     "other": other})
    return rows


def table(rows: list[dict[str, float | str]]) -> str:
    cols = ("op", "row_bytes", "role", "rank", "launches", "warps", *PHASES, "other")
    lines = ["  ".join(f"{c:>11}" for c in cols)]
    for r in rows:
        lines.append("  ".join(f"{r[c]:>11.2f}" if isinstance(r[c], float) else f"{r[c]!s:>11}" for c in cols))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("logs", nargs="+", type=Path)
    p.add_argument("--skip", type=int, default=2, help="warm-up launches to leave out per group (default 2)")
    args = p.parse_args(argv)
    lines = [ln for path in args.logs for ln in path.read_text(errors="replace").splitlines()]
    garbled: list[str] = []
    rows = summarise(parse(lines, garbled), args.skip)
    if garbled:
        print(f"{len(garbled)} garbled trace lines skipped (interleaved output of two processes)", file=sys.stderr)
    if not rows:
        print("no uccl-trace lines: was the kernel built with -DUCCL_MOE_TRACE_DISPATCH?", file=sys.stderr)
        return 1
    print("us per warp, mean over launches (tools/device/trace_summary.py)")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
