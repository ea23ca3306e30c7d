"""Paired A/B of knob settings for the intranode ops, in one process per rank (2+ GPUs): the API-default cached
dispatch (FP8 with column-major scales, BF16) and combine at the bench's headline setting, each variant a set of
UCCL_MOE_* knobs, which the package reads per call (uccl_moe.env.get), so every variant runs on the same Buffer,
inputs and build. First each variant's outputs are compared bit for bit with the first variant's (a line names any
that differ, and the exit status is 1); then --rounds rounds time every variant and op once each, in alternating
order, with the bench's loop (bench._timing.time_op: ranks aligned, L2 flushed; device time unless --default-mode).
Per op and variant: the slowest rank's median us over rounds, its range, the median of the per-round differences to
the first variant (the host's drift is paired out), and the host us per call.

Why: device_ab.sh swaps builds and spawns a bench per run; here every variant shares one process, Buffer and build,
so many paired rounds cost little device time, and what a knob does is told apart from the host's drift. Figures
are per machine and call (docs/benchmarks.md).

    python tools/device/env_ab.py --variant base --variant c3:UCCL_MOE_COMBINE_CE_CHUNKS=3 [--ops fp8,bf16,combine]
        [--rounds 8] [--iters 15] [--tokens 4096] [--hidden 7168] [--default-mode]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any

from ce_timeline import add_headline_args  # this folder's tools (the script's folder leads sys.path)

OPS = ("fp8", "bf16", "combine")
# The runtime's counters of the copy-engine ops' paths (NvlRuntime), printed per call for each op and variant.
COUNTERS = ("ce_early_ops", "ce_polled_ops", "ce_polled_dispatches", "ce_sentinel_sets", "ce_sentinel_side_sets")


def parse_variant(spec: str) -> tuple[str, dict[str, str]]:
    """``NAME`` or ``NAME:VAR=VALUE[,VAR=VALUE...]`` -> (NAME, {VAR: VALUE}); VAR must be a UCCL_MOE_* knob."""
    name, _, rest = spec.partition(":")
    if not name or not name.replace("_", "").replace("-", "").isalnum():
        raise ValueError(f"variant {spec!r}: give NAME or NAME:VAR=VALUE,... (NAME letters, digits, - and _)")
    env: dict[str, str] = {}
    for item in filter(None, rest.split(",")):
        var, eq, value = item.partition("=")
        if not eq or not var.startswith("UCCL_MOE_"):
            raise ValueError(f"variant {spec!r}: {item!r} is not UCCL_MOE_<KNOB>=VALUE")
        env[var] = value
    return name, env


def apply_variant(environ: MutableMapping[str, str], base: Mapping[str, str], variants: Sequence[Mapping[str, str]],
                  chosen: Mapping[str, str]) -> None:
    """Set `environ` to `chosen`'s knobs: every knob any variant names is reset to its value in `base` (removed where
    `base` has none), then `chosen`'s are set."""
    for var in {v for env in variants for v in env}:
        if var in base:
            environ[var] = base[var]
        else:
            environ.pop(var, None)
    environ.update(chosen)


def round_order(names: Sequence[str], r: int) -> list[str]:
    """The variants in round r: forward in even rounds, backward in odd ones (each variant's neighbours alternate)."""
    return list(names) if r % 2 == 0 else list(names)[::-1]


def summarize(times: Mapping[tuple[str, str], Sequence[float]], host: Mapping[tuple[str, str], Sequence[float]],
              names: Sequence[str], ops: Sequence[str]) -> list[str]:
    """One line per op and variant: median, min and max us over rounds, the median per-round difference to the first
    variant, and the median host us per call."""
    lines = []
    for op in ops:
        first = times[(names[0], op)]
        for n in names:
            v = times[(n, op)]
            diff = statistics.median(a - b for a, b in zip(v, first))
            lines.append(f"{op:8s} {n:12s} median {statistics.median(v):7.1f} us  range {min(v):.1f}-{max(v):.1f}  "
                         f"vs {names[0]}: {diff:+6.1f}  host {statistics.median(host[(n, op)]):6.1f}")
    return lines


def _outputs(op: str, out: Any) -> list[Any]:
    """The tensors an op returns (dispatch: recv_x, FP8 its data and scales; combine: the combined rows)."""
    if op == "combine":
        return [out.combined_x]
    return list(out.recv_x) if isinstance(out.recv_x, tuple) else [out.recv_x]


def _worker(rank: int, R: int, init: str, args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from ce_timeline import headline, headline_calls, slowest_time  # this folder's (it leads sys.path)

    from uccl_moe.bench._timing import FLUSH_BYTES

    buf, h, y, xb, x8 = headline(rank, R, init, args.tokens, args.hidden)
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    ops = headline_calls(buf, h, y, xb, x8)
    names = [n for n, _ in args.variants]
    envs = [e for _, e in args.variants]
    base = dict(os.environ)
    reference: dict[str, Any] = {}
    differ = torch.zeros(1, device="cuda")
    for (name, env) in args.variants:
        apply_variant(os.environ, base, envs, env)
        for op in args.ops:
            out = [t.clone() for t in _outputs(op, ops[op]())]
            torch.cuda.synchronize()
            if op not in reference:
                reference[op] = out
            elif not all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(reference[op], out)):
                print(f"rank {rank}: variant {name} {op}: outputs differ from {names[0]}'s", flush=True)
                differ += 1
    times: dict[tuple[str, str], list[float]] = {(n, op): [] for n in names for op in args.ops}
    host: dict[tuple[str, str], list[float]] = {(n, op): [] for n in names for op in args.ops}
    counts: dict[tuple[str, str], list[int]] = {(n, op): [0] * len(COUNTERS) for n in names for op in args.ops}
    rt = buf._live()._rt
    for r in range(args.rounds):
        for n in round_order(names, r):
            apply_variant(os.environ, base, envs, envs[names.index(n)])
            for op in args.ops:
                before = [int(getattr(rt, c)) for c in COUNTERS]
                us, host_us = slowest_time(ops[op], flush, args.iters, not args.default_mode)
                times[(n, op)].append(us)
                host[(n, op)].append(host_us)
                counts[(n, op)] = [t + int(getattr(rt, c)) - b for t, c, b in zip(counts[(n, op)], COUNTERS, before)]
    apply_variant(os.environ, base, envs, {})
    dist.all_reduce(differ)
    if rank == 0:
        mode = "default mode (host included)" if args.default_mode else "device time"
        print(f"{R} ranks, {args.tokens} tokens, hidden {args.hidden}, {args.rounds} rounds, {mode}", flush=True)
        print("\n".join(summarize(times, host, names, args.ops)), flush=True)
        calls = args.rounds * (args.iters + 3)  # slowest_time's warm-up calls count too
        for (n, op), c in counts.items():
            print(f"{op:8s} {n:12s} per call (rank 0): " + ", ".join(
                f"{name[3:]} {v / calls:.2f}" for name, v in zip(COUNTERS, c)), flush=True)
    dist.barrier()
    buf.destroy()
    dist.destroy_process_group()
    if differ.item() > 0:
        sys.exit(1)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--variant", action="append", required=True, help="NAME or NAME:UCCL_MOE_X=V,...; the first is "
                   "the one the others are compared with")
    p.add_argument("--ops", default=",".join(OPS), help=f"comma-separated, of: {', '.join(OPS)}")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--iters", type=int, default=15, help="timed calls per op, variant and round (median)")
    add_headline_args(p)
    p.add_argument("--default-mode", action="store_true", help="time what a caller sees (host included)")
    args = p.parse_args(argv)
    try:
        args.variants = [parse_variant(s) for s in args.variant]
    except ValueError as e:
        p.error(str(e))
    if len({n for n, _ in args.variants}) != len(args.variants):
        p.error("variant names must differ")
    args.ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    bad = [o for o in args.ops if o not in OPS]
    if bad or not args.ops:
        p.error(f"--ops: {bad or 'none'}; choose from {', '.join(OPS)}")
    if args.rounds < 1 or args.iters < 1:
        p.error("--rounds and --iters must be at least 1")
    import torch

    if torch.cuda.device_count() < 2:
        raise SystemExit("env_ab.py needs 2 or more GPUs (run it on a device machine: tools/device)")
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(args.ranks, os.path.join(tmp, "init"), args), nprocs=args.ranks)


if __name__ == "__main__":
    main()
