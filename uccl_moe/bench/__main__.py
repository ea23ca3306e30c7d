"""``uccl-moe bench`` / ``python -m uccl_moe.bench``: HT dispatch/combine throughput inside one node.

By default it measures what users get: the public API exactly as DeepEP clients call it -- ``Buffer.set_num_sms(SMs)``,
the Buffer sized by the default configs' size hints, ``get_dispatch_layout``, a first dispatch for the handle, then
the timed calls with ``config=None`` (each takes ``get_dispatch_config(R)``/``get_combine_config(R)``), FP8 scales in
column-major layout (the transpose of a contiguous [H/128, T] tensor, as DeepGEMM-style casts hand them over) and a
combine of a tensor of the caller's. ``--tuned`` (or any of ``--nvl-send``, ``--nvl-recv``, ``--scales row``,
``--combine-view``) switches to an explicit Config and the other knobs, and the output says TUNED.

For every point of the sweep (tokens x hidden x experts x dispatch dtype x SMs [x chunk x ring]) it times, in one run:
  - ``dispatch``: our cached-handle dispatch (BF16 or FP8 + float32 scales),
  - ``combine``: our combine of BF16 rows from a tensor of the caller's; with ``--combine-view`` also from the
    Buffer's own memory (``combv_*``: ``get_combine_buffer``, where Megatron's unpermute writes the rows; checked
    to give the same bits),
  - ``nccl_a2a``: NCCL ``all_to_all_single`` moving exactly the same, already packed rows (dispatch direction;
    for combine the same BF16 rows in the reverse direction) -- NCCL does none of the routing work,
and once per run two ceilings: the one-way peer copy (copy engine, rank 0 -> rank 1, other ranks idle) and the SM
push (torch's copy kernel on all SMs of every GPU storing into its peers' memory over P2P at once).
Method (docs/benchmarks.md, "Method"): L2 flushed (256 MB written) before each run, CUDA events, median of >= 20 runs
after warm-up (the first point also runs once untimed before it is timed), the slowest rank's time. Before each flush
the ranks meet in a one-float NCCL all-reduce (not timed), so each timed call starts at nearly the same moment on every
rank (``--no-align`` turns it off; then a rank's time also counts how late its peers launched). Metrics:
``logical_GBps`` = all rows a rank receives (own rows included) x row bytes / time; ``nvlink_GBps`` = rows received from
other ranks only. FP8 rows count hidden bytes + 4 bytes per scale; combine counts BF16. A ``NOTE`` names each op whose
host time per call outgrew the flush's GPU time (``flush_us``): the GPU may then have waited for the host inside the
timed window (a loaded host); of that host time only the part before the op's launch counts, the rest runs while the
GPU works (docs/benchmarks.md, "The default mode pays the host time"). A ``host`` line gives each rank's CPU and how
fast its core ran a fixed Python loop at the start and end of the run, with a ``NOTE`` where its samples (ranks,
start or end) differed by 1.5x or more: the default mode's figures may then depend on where the ranks ran
(``--bind-cores`` binds them, as a training launcher does).

The command spawns one process per GPU itself (``--ranks``, default all GPUs). Prints a table per op (ours, NCCL,
ours/NCCL speed ratio, host time per call, ceilings) and one with every column, writes JSON (``--json``) and a PNG
(``--png``, if matplotlib is importable; both by default into ``runs/bench/<time>/``, which git ignores), and shows
a progress bar on rank 0.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from ._host import host_lines, parse_bind_cores
from ._plot import plot
from ._run import _kernel_lines, _table, _worker, op_summary, op_table, spawn


def _parse_ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The bench flags (shared by ``python -m uccl_moe.bench`` and ``uccl-moe bench``)."""
    p.add_argument("--ranks", type=int, default=0, help="processes (one per GPU); 0 = all visible GPUs")
    p.add_argument("--tokens", type=_parse_ints, default=[4096], help="tokens per rank, comma list")
    p.add_argument("--hidden", type=_parse_ints, default=[7168], help="hidden sizes, comma list")
    p.add_argument("--experts", type=_parse_ints, default=[256], help="expert counts, comma list")
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--dtypes", default="fp8,bf16", help="dispatch dtypes: fp8,bf16")
    p.add_argument("--sms", type=_parse_ints, default=[24], help="SM counts (even), comma list")
    p.add_argument("--nvl-send", type=_parse_ints, default=None,
                   help="explicit num_max_nvl_chunked_send_tokens, comma list (default: the API's config)")
    p.add_argument("--nvl-recv", type=_parse_ints, default=None,
                   help="explicit num_max_nvl_chunked_recv_tokens, comma list (default: the API's config)")
    p.add_argument("--scales", choices=("col", "row"), default=None,
                   help="FP8 scale layout: col = column-major [T, H/128] (DeepGEMM-style callers; the default), "
                        "row = row-major (contiguous)")
    p.add_argument("--combine-view", action="store_true",
                   help="also time combine from the Buffer's own memory (get_combine_buffer; a uccl-moe extension)")
    p.add_argument("--combine-staged", action="store_true",
                   help="also time the same combine through each path, forced on every rank: 'combine ring' "
                        "(pushed through the rings), 'combine staged' (UCCL_MOE_COMBINE_STAGED=1: the other ranks' "
                        "rows copied into the Buffer, then pulled) and 'combine copy engines' (UCCL_MOE_COMBINE_CE=1: "
                        "the copy engines move the rows back while the SMs sum); the last two need a Buffer with "
                        "room for the rows; the plain 'combine' line is the default's path (uccl_moe/tuning.py's "
                        "CE_COMBINE, then STAGED_COMBINE)")
    p.add_argument("--dispatch-direct", action="store_true",
                   help="also time the same cached dispatch through the ring-free path (UCCL_MOE_DISPATCH_DIRECT=1 "
                        "on every rank: rows written straight to where they end up, then unpacked; a Buffer with "
                        "room for the rows from other ranks), as 'dispatch direct'")
    p.add_argument("--dispatch-ce", action="store_true",
                   help="also time the same cached dispatch through each path, forced on every rank: 'dispatch ring' "
                        "(UCCL_MOE_DISPATCH_CE=0) and 'dispatch copy engines' (=1: each rank's copy engines move its "
                        "whole x to every peer, the SMs gather; a Buffer with room for the other ranks' x)")
    p.add_argument("--tuned", action="store_true",
                   help=f"the tuned path instead of the API defaults: explicit Config(sms, {TUNED_NVL_SEND}, "
                        f"{TUNED_NVL_RECV}) (unless --nvl-send/--nvl-recv say otherwise), row-major scales, "
                        f"--combine-view")
    p.add_argument("--sweep", action="store_true",
                   help="full sweep: tokens 128..16384, hidden 2048/4096/7168, experts 64/256")
    p.add_argument("--iters", type=int, default=30, help="timed runs per op (median; >= 20)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--no-nccl", action="store_true", help="skip the NCCL all_to_all_single comparison")
    p.add_argument("--no-align", action="store_true",
                   help="do not align the ranks (tiny NCCL all-reduce, untimed) before each timed run")
    p.add_argument("--device-time", action="store_true",
                   help="hold each GPU in a ~1 ms sleep kernel before every timed call, so the timed window holds the "
                        "GPU's work only, with the host time of the call hidden (ours and NCCL's alike): for "
                        "comparing kernels on a noisy host; not what a caller sees, and the output says so")
    p.add_argument("--kernel-times", action="store_true",
                   help="also profile --iters more calls of each op and print GPU time per kernel (torch.profiler)")
    p.add_argument("--bind-cores", default=None, metavar="GROUPS",
                   help="bind each rank's process to its own cores, as a launcher binds training ranks (torchrun "
                        "--numa-binding, srun --cpu-bind): one group per rank, '/'-separated, each a comma list of "
                        "cores and ranges, e.g. 0-7/8-15 (default: unbound; the report's host line says how fast "
                        "each rank's core ran Python)")
    p.add_argument("--json", default=None, help="JSON output path ('' = none; default runs/bench/<time>/bench.json)")
    p.add_argument("--png", default=None, help="PNG plot path ('' = none; default runs/bench/<time>/bench.png)")


TUNED_NVL_SEND = 8  # the chunk/ring sizes the bench ran before its default became the API's config
TUNED_NVL_RECV = 256


def resolve_mode(args: argparse.Namespace) -> None:
    """Fill in the measured path: ``args.mode`` is ``"api"`` (the public API as DeepEP clients call it: default
    configs, column-major FP8 scales, combine of the caller's tensor) unless a tuning knob is given, then
    ``"tuned"``. ``args.nvl_send``/``nvl_recv`` stay None in API mode (no explicit Config is passed); where only one
    is given, the other is taken from ``Buffer.get_dispatch_config(R)`` per point."""
    if args.tuned:
        args.nvl_send = args.nvl_send or [TUNED_NVL_SEND]
        args.nvl_recv = args.nvl_recv or [TUNED_NVL_RECV]
        args.scales = args.scales or "row"
        args.combine_view = True
    explicit = args.nvl_send is not None or args.nvl_recv is not None  # a missing one: the API's preset value
    args.scales = args.scales or "col"
    args.mode = "tuned" if (explicit or args.scales != "col" or args.combine_view or args.combine_staged
                            or args.dispatch_direct or args.dispatch_ce) else "api"


def mode_label(args: argparse.Namespace) -> str:
    """One line saying which path the numbers are for."""
    if args.mode == "api":
        return ("API defaults: Buffer.set_num_sms(SMs), get_dispatch_config/get_combine_config(R), cached dispatch, "
                "column-major FP8 scales, combine of the caller's tensor" + _device_time_note(args))
    knobs = []
    if args.nvl_send is not None or args.nvl_recv is not None:
        knobs.append(f"explicit Config(nvl_send={args.nvl_send or 'preset'}, nvl_recv={args.nvl_recv or 'preset'})")
    knobs.append(f"{'row' if args.scales == 'row' else 'column'}-major FP8 scales")
    if args.combine_view:
        knobs.append("combine from the buffer timed too")
    if args.combine_staged:
        knobs.append("ring, staged and copy-engine combine timed too")
    if args.dispatch_direct:
        knobs.append("ring-free dispatch timed too")
    if args.dispatch_ce:
        knobs.append("ring and copy-engine dispatch timed too")
    return "TUNED (not the API defaults): " + ", ".join(knobs) + _device_time_note(args)


DEVICE_TIME_NOTE = "DEVICE TIME (--device-time: host time per call hidden behind a GPU sleep, not what a caller sees)"


def _device_time_note(args: argparse.Namespace) -> str:
    return f"; {DEVICE_TIME_NOTE}" if args.device_time else ""


def output_paths(args: argparse.Namespace, stamp: str | None = None) -> tuple[str, str]:
    """The JSON and PNG paths to write ('' = none): those given, else ``runs/bench/<time>/bench.{json,png}``."""
    out_dir = Path("runs") / "bench" / (stamp or time.strftime("%Y%m%d-%H%M%S"))
    json_path = str(out_dir / "bench.json") if args.json is None else args.json
    png_path = str(out_dir / "bench.png") if args.png is None else args.png
    return json_path, png_path


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="uccl-moe bench", description=__doc__.split("\n")[0])
    add_arguments(p)
    return p


def main(argv: list[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """Run the sweep described by parsed bench arguments."""
    if args.sweep:
        args.tokens = [128, 512, 1024, 2048, 4096, 8192, 16384]
        args.hidden = [2048, 4096, 7168]
        args.experts = [64, 256]
    if args.iters < 20:
        print("--iters must be >= 20 (the median of at least 20 runs is the method)", file=sys.stderr)
        return 2
    resolve_mode(args)
    import torch

    from ._gpus import gpus_or_explain

    if not gpus_or_explain("uccl-moe bench"):
        return 2
    R = args.ranks or torch.cuda.device_count()
    if R > torch.cuda.device_count():
        print(f"note: {R} ranks share {torch.cuda.device_count()} GPU(s); timings are not meaningful",
              file=sys.stderr)
    if args.bind_cores:
        try:
            args.bind = parse_bind_cores(args.bind_cores, R, set(os.sched_getaffinity(0)))
        except ValueError as e:
            print(e, file=sys.stderr)
            return 2
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    args.json, args.png = output_paths(args)
    for path in (args.json, args.png):
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    result = spawn(_worker, R, args)
    if result is None:
        return 1
    report(args, result, R, torch.cuda.get_device_name(0), time.time() - t0)
    return 0


def host_bound_notes(rows: list[dict[str, Any]], device_time: bool) -> list[str]:
    """One note per row where an op's host us per call (ours or NCCL's, slowest rank) exceeded the L2 flush's GPU time
    (``flush_us``, the host time a call surely hides behind): the GPU may have waited for the host inside that op's
    timed window, so its figure may include host time. None in --device-time (the GPU sleep hides the host there)."""
    notes: list[str] = []
    for r in [] if device_time else rows:
        flush = r.get("flush_us") or 0.0
        over = [f"{k[:-8]} {r[k]:.0f}" for k in sorted(r) if k.endswith("_host_us") and flush and r[k] > flush]
        if over:
            notes.append(f"NOTE: EP{r['ranks']} T={r['tokens']} H={r['hidden']} {r['dtype']}: host us per call above "
                         f"the L2 flush's {flush:.0f} us of GPU time ({', '.join(over)}): the GPU may have waited for "
                         f"the host, so those figures may include host time (only the host time before an op's "
                         f"launch counts, tools/device/spin_ab.py; a loaded host? rerun, or compare --device-time)")
    return notes


def report(args: argparse.Namespace, result: dict[str, Any], R: int, dev: str, seconds: float) -> dict[str, Any]:
    """Print the per-op table (and every column), write the JSON and PNG that args name; returns the JSON object.
    `result` is what the workers return: ``rows`` (one per point), ``peer_copy_GBps``, ``sm_push_GBps``."""
    rows = result["rows"]
    print(f"uccl-moe bench on {R} x {dev}; {seconds:.0f} s\nmode: {mode_label(args)}\n"
          f"ceilings: peer copy {result['peer_copy_GBps']:.1f} GB/s (copy engine, one way, rank 0 -> 1); "
          f"SM push {result.get('sm_push_GBps', 0.0):.1f} GB/s per GPU (torch copy kernel on all SMs storing into "
          f"the peers' memory over P2P, every GPU at once; 0 = not measured)")
    ops = op_summary(rows)
    print(op_table(ops))
    print("all columns:")
    print(_table(rows))
    for r in rows:
        for key, what in (("combine_view_equal", "combine from the buffer"),
                          ("combine_staged_equal", "staged combine"), ("combine_ce_equal", "copy-engine combine"),
                          ("dispatch_direct_equal", "ring-free dispatch"),
                          ("dispatch_ce_equal", "copy-engine dispatch")):
            if r.get(key) is False:  # a correctness check, not a timing: say it loudly
                print(f"ERROR: EP{r['ranks']} T={r['tokens']} H={r['hidden']}: {what} differs from the rings' "
                      f"{'dispatch' if 'dispatch' in key else 'combine'}", file=sys.stderr)
        if r.get("dispatch_ce_fits") is False:
            print(f"WARNING: EP{r['ranks']} T={r['tokens']} H={r['hidden']} {r['dtype']}: x does not fit the other "
                  f"ranks' Buffers, so 'dispatch copy engines' timed the rings", file=sys.stderr)
        if r.get("dispatch_direct_fits") is False:
            print(f"WARNING: EP{r['ranks']} T={r['tokens']} H={r['hidden']} {r['dtype']}: the rows from other ranks "
                  f"do not fit the Buffer, so 'dispatch direct' timed the rings", file=sys.stderr)
        for path, what in (("staged", "combine staged"), ("ce", "combine copy engines")):
            if r.get(f"combine_{path}_fits") is False:
                print(f"WARNING: EP{r['ranks']} T={r['tokens']} H={r['hidden']}: the rows do not fit the Buffer (or "
                      f"the handle has no host counts), so '{what}' timed the ring combine", file=sys.stderr)
    for line in host_lines(result.get("host") or {}, args.device_time):
        print(line, file=sys.stderr if line.startswith("NOTE") else sys.stdout)
    for note in host_bound_notes(rows, args.device_time):
        print(note, file=sys.stderr)
    if args.kernel_times:
        print(_kernel_lines(rows))
    out = {"device": dev, "ranks": R, "argv": sys.argv[1:], "mode": args.mode, "mode_label": mode_label(args),
           "ops": ops, "args": {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, list))},
           **result}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {args.json}")
    if args.png and rows and plot(rows, args.png, DEVICE_TIME_NOTE if args.device_time else ""):
        print(f"wrote {args.png}")
    return out

if __name__ == "__main__":
    sys.exit(main())
