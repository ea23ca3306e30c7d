"""Summary of a device_ab.sh call: the bench JSONs of its runs (``ab<i>_<variant>.json``, one per run of AB_ORDER),
grouped by variant. Per op: each variant's median time over its runs, its spread, and the ratio to the baseline
(`base` us / variant us: > 1 means the variant is faster); NCCL's time over all runs says how quiet the host was,
since NCCL is the same in every run. A variant is called faster or slower only when its range of times and the
baseline's do not overlap, and the verdict says "noisy host" when NCCL moved more than --noise (default 10%) between
runs.

    python tools/device/ab_summary.py DIR [--base base] [--noise 0.10]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path
from typing import Any

_NAME = re.compile(r"^ab(\d+)_(.+)\.json$")


def load_runs(folder: Path) -> list[tuple[int, str, dict[str, Any]]]:
    """(run number, variant, bench JSON) of every ab<i>_<variant>.json in `folder`, in run order. The variant is the
    AB_ORDER entry with its env part (`new@VAR=1` was written as `new_VAR_1`) kept: each spelling is its own variant."""
    runs = []
    for path in folder.iterdir():
        m = _NAME.match(path.name)
        if m:
            runs.append((int(m.group(1)), m.group(2), json.loads(path.read_text())))
    return sorted(runs, key=lambda r: r[0])


_SETTING = ("ranks", "tokens", "hidden", "experts", "num_sms")


def _setting(op: dict[str, Any]) -> str:
    return " ".join(f"{k}={op[k]}" for k in _SETTING if k in op)


def summarise(runs: list[tuple[int, str, dict[str, Any]]], base: str, noise: float) -> list[dict[str, Any]]:
    """One entry per (op, variant): median/min/max of ours_us over the variant's runs, NCCL's median, the ratio to
    `base` and a verdict (`faster`, `slower` or `same`; "(noisy host: rerun)" added when NCCL moved more than
    `noise`)."""
    per: dict[tuple[str, str], list[float]] = {}
    nccl: dict[str, list[float]] = {}
    # Only the same op at the same setting is pooled; the setting joins the name where the runs have several.
    several = len({_setting(op) for _, _, data in runs for op in data.get("ops", [])}) > 1
    for _, variant, data in runs:
        for op in data.get("ops", []):
            name = op["op"] + (f" [{_setting(op)}]" if several else "")
            per.setdefault((name, variant), []).append(float(op["ours_us"]))
            if op.get("nccl_us"):
                nccl.setdefault(name, []).append(float(op["nccl_us"]))
    out = []
    for (op, variant), times in per.items():
        entry: dict[str, Any] = {"op": op, "variant": variant, "runs": len(times),
                                 "median_us": round(statistics.median(times), 1), "min_us": min(times),
                                 "max_us": max(times)}
        n = nccl.get(op, [])
        entry["nccl_median_us"] = round(statistics.median(n), 1) if n else None
        entry["nccl_spread"] = round((max(n) - min(n)) / min(n), 3) if n else None
        ref = per.get((op, base))
        if ref is None or variant == base:
            entry["vs_base"], entry["verdict"] = None, "baseline" if variant == base else "no baseline"
        else:
            entry["vs_base"] = round(statistics.median(ref) / entry["median_us"], 3)
            if max(times) < min(ref):
                entry["verdict"] = "faster"
            elif min(times) > max(ref):
                entry["verdict"] = "slower"
            else:
                entry["verdict"] = "same"
            if min(len(times), len(ref)) < 2:
                entry["verdict"] += " (1 run: rerun)"
            if entry["nccl_spread"] is not None and entry["nccl_spread"] > noise:
                entry["verdict"] += " (noisy host: rerun)"
        out.append(entry)
    return sorted(out, key=lambda e: (e["op"], e["variant"] != base, e["variant"]))


def table(entries: list[dict[str, Any]]) -> str:
    w = max([15] + [len(e["op"]) for e in entries])
    lines = [f"{'op':<{w}} {'variant':<18} {'runs':>4} {'median_us':>9} {'range_us':>15} {'vs_base':>7} "
             f"{'nccl_us':>8} {'nccl_moved':>10}  verdict"]
    for e in entries:
        rng = f"{e['min_us']:.1f}-{e['max_us']:.1f}"
        vs = f"{e['vs_base']:.3f}" if e["vs_base"] is not None else "-"
        nm = f"{e['nccl_median_us']:.1f}" if e["nccl_median_us"] is not None else "-"
        ns = f"{100 * e['nccl_spread']:.1f}%" if e["nccl_spread"] is not None else "-"
        lines.append(f"{e['op']:<{w}} {e['variant']:<18} {e['runs']:>4} {e['median_us']:>9.1f} {rng:>15} {vs:>7} "
                     f"{nm:>8} {ns:>10}  {e['verdict']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folder", type=Path)
    p.add_argument("--base", default="base", help="the variant the others are compared with")
    p.add_argument("--noise", type=float, default=0.10,
                   help="relative spread of NCCL's time over the runs above which a verdict says 'noisy host' "
                        "(default 0.10)")
    args = p.parse_args(argv)
    runs = load_runs(args.folder)
    if not runs:
        print(f"no ab<i>_<variant>.json in {args.folder}", file=sys.stderr)
        return 1
    print(table(summarise(runs, args.base, args.noise)))
    print(f"vs_base = {args.base} median us / variant median us (> 1: the variant is faster); faster/slower needs the "
          f"ranges apart; 'noisy host' where NCCL moved > {100 * args.noise:.0f}% between runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
