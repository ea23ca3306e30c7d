"""Which host time the bench's default mode pays: a busy spin inserted right before (``pre``) or right after
(``post``) the native launch of the API-default copy-engine ops (the cached FP8 dispatch with column-major scales,
the BF16 dispatch, the combine of a caller's tensor), alternating with none (``base``) in one process per rank, each
timed by the bench's loop (``bench._timing.time_op``: ranks aligned, the bench's 256 MB L2 flush, CUDA events around
the Python call), and held (device time) once per round. Where ``pre`` adds its microseconds to the op and ``post``
adds none, only the host time before the launch counts: the GPU waits for it once it outlasts the flush, and the time
after it is hidden behind the op's GPU work.

Prints per op and variant the slowest rank's us of every round and its host us per call. Figures are per machine and
call (docs/benchmarks.md).

    python tools/device/spin_ab.py [--spin pre:30,pre:60,post:80] [--rounds 4] [--iters 20] [--tokens 4096]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from typing import Any

from ce_timeline import headline_ab_main  # this folder's tools (its folder leads sys.path)
from flush_ab import report

LAUNCHES = ("dispatch_ce_intranode", "combine_ce_intranode")  # the native launches of the copy-engine ops
HELD = "held"


def parse_spins(spec: str) -> list[tuple[str, str | None, int]]:
    """``--spin``: comma-separated ``pre:US`` / ``post:US`` (US a positive integer), distinct; the variants of a round
    as (name, where, us), ``base`` (no spin) first. ValueError otherwise."""
    variants: list[tuple[str, str | None, int]] = [("base", None, 0)]
    for item in (s.strip() for s in spec.split(",") if s.strip()):
        where, _, us = item.partition(":")
        if where not in ("pre", "post") or not us.isdigit() or int(us) <= 0:
            raise ValueError(f"--spin {spec!r}: give pre:US or post:US items (US > 0), comma-separated")
        variants.append((f"{where}{int(us)}", where, int(us)))
    if len(variants) == 1 or len({v[0] for v in variants}) != len(variants):
        raise ValueError(f"--spin {spec!r}: give at least one pre:US or post:US item, each once")
    return variants


def spin(us: int) -> None:
    """Busy-wait `us` microseconds on this thread (a slower host, as the GIL-holding Python path is)."""
    end = time.perf_counter_ns() + us * 1000
    while time.perf_counter_ns() < end:
        pass


def spinning(real: Any, state: dict[str, Any]) -> Any:
    """`real` with state["us"] of spin before or after it (state["where"]: "pre", "post" or None); counts its calls in
    state["calls"]."""
    def call(*args: Any, **kw: Any) -> Any:
        state["calls"] = state.get("calls", 0) + 1
        if state["where"] == "pre":
            spin(state["us"])
        out = real(*args, **kw)
        if state["where"] == "post":
            spin(state["us"])
        return out
    return call


def _worker(rank: int, R: int, init: str, args: argparse.Namespace) -> None:
    import torch
    from ce_timeline import close_headline, headline, headline_calls, slowest_time

    from uccl_moe import _C
    from uccl_moe.bench._timing import FLUSH_BYTES

    state: dict[str, Any] = {"where": None, "us": 0}
    for name in LAUNCHES:
        setattr(_C, name, spinning(getattr(_C, name), state))
    buf, h, y, xb, x8 = headline(rank, R, init, args.tokens, args.hidden)
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    ops = headline_calls(buf, h, y, xb, x8)
    for op, fn in ops.items():  # a spin that never runs would time every variant alike: each op must take the path
        before = state.get("calls", 0)
        fn()
        if state.get("calls", 0) == before:
            raise RuntimeError(f"{op} did not take the copy-engine path (not EP2, or a knob turned it off): "
                               f"no spin would run")
    torch.cuda.synchronize()
    res: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for _ in range(args.rounds):
        for op, fn in ops.items():
            for name, where, us in args.variants:
                state["where"], state["us"] = where, us
                res.setdefault((op, name), []).append(slowest_time(fn, flush, args.iters, False))
            state["where"] = None
            res.setdefault((op, HELD), []).append(slowest_time(fn, flush, args.iters, True))
    close_headline(rank, buf, f"{R} ranks, {args.tokens} tokens, hidden {args.hidden}, {args.rounds} rounds, 256 MB "
                   f"flush; spins before (pre) or after (post) the native launch; held = device time", report(res))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--spin", default="pre:30,pre:60,post:80", help="variants beside base: pre:US / post:US, "
                   "comma-separated")
    p.add_argument("--rounds", type=int, default=4)
    return headline_ab_main(p, argv, _worker, "spin_ab.py", lambda a: setattr(a, "variants", parse_spins(a.spin)))


if __name__ == "__main__":
    sys.exit(main())
