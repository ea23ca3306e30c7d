"""``python -m uccl_moe.bench.tune``: the sweep that writes the intranode presets (``uccl_moe/tuning.py``).

For the visible GPUs (``--ranks R``, default all; run it once per EP size) it runs the headline setting -- 4096
tokens per rank, hidden 7168, 256 experts (the largest multiple of R below, e.g. 255 at EP3), top-8, ``--sms`` 24 --
through the public API with an explicit ``Config(sms, nvl_send, nvl_recv)`` per grid point (``--nvl-send`` x
``--nvl-recv``, default {1,2,4,8,16} x {128,256,512}; points the Config validation, the lane geometry or
``--max-nvl-mb`` refuse are left out, and so are points whose effective chunk equals a smaller nvl_send's). Per
point: an uncached BF16 dispatch for the handle, then the timed ops as a DeepEP client calls them:

  - ``dispatch_fp8``: cached dispatch of FP8 rows with column-major float32 scales (the bench's API-default input),
  - ``dispatch_bf16``: cached dispatch of BF16 rows,
  - ``combine``: combine of BF16 rows from a tensor of the caller's.

Each point is also checked: every rank combines what it received (FP8 rows dequantised) and must get each token
times the number of ranks it went to, bit for bit; a failing point is reported and the tool does not write.
Timing as ``uccl-moe bench`` (L2 flushed, ranks aligned by an untimed all-reduce, CUDA events): the median of
``--iters`` (10) per point, the slowest rank; the best ``--top`` (2) points per op are timed again with
``--final-iters`` (20), the dispatch ops on the union of both dtypes' finalists, and the fastest of those wins.
Each op takes the smallest ring within ``--min-gain`` (2%) of its fastest point (a larger ring costs every client
memory); ``dispatch`` is BF16's pick among rings no smaller than combine's (a Buffer sized by the dispatch hint
alone holds both); ``dispatch_fp8`` is FP8's pick among rings no larger than that, kept only where
it beats FP8 at BF16's pick by more than ``--min-gain``. ``--repick TUNE_JSON`` picks again from a saved run's
finalists (no GPU). ``--write`` rewrites the ``INTRANODE[R]`` line of
``uccl_moe/tuning.py`` (``--table`` names another file) with the picks and ``measured_on``; the JSON of every point
goes to ``--json`` (default ``runs/tune/<time>/tune.json``).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import re
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

OPS = ("dispatch_fp8", "dispatch_bf16", "combine")
Cand = tuple[int, int]  # (nvl_send, nvl_recv)

BEGIN_MARK = "# tune-rows: begin"
END_MARK = "# tune-rows: end"
ROW_INDENT = "    "


def _parse_ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m uccl_moe.bench.tune", description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, default=0, help="processes (one per GPU) = EP size; 0 = all visible GPUs")
    p.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--experts", type=int, default=256,
                   help="experts; the largest multiple of the rank count not above it is used")
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--sms", type=int, default=24, help="Buffer.set_num_sms (even)")
    p.add_argument("--nvl-send", type=_parse_ints, default=[1, 2, 4, 8, 16], help="chunk sizes, comma list")
    p.add_argument("--nvl-recv", type=_parse_ints, default=[128, 256, 512], help="ring sizes, comma list")
    p.add_argument("--max-nvl-mb", type=int, default=1024,
                   help="leave out points whose NVL buffer size hint exceeds this many MiB per rank")
    p.add_argument("--iters", type=int, default=10, help="timed runs per point in the sweep (median)")
    p.add_argument("--final-iters", type=int, default=20, help="timed runs per finalist (median; >= 20)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--top", type=int, default=2, help="finalists per op, timed again with --final-iters")
    p.add_argument("--min-gain", type=float, default=0.02,
                   help="FP8 dispatch gets chunks of its own only where they beat BF16's pick by this fraction")
    p.add_argument("--no-align", action="store_true", help="do not align the ranks before each timed run")
    p.add_argument("--device-time", action="store_true",
                   help="time each point with its host time hidden behind a GPU sleep (bench --device-time): the "
                        "chunk and ring sizes change the GPU's work only, so on a loaded host this keeps Python "
                        "noise out of the picks")
    p.add_argument("--cpu", action="store_true",
                   help="the same flow on gloo with the reference backend (checks the tool, not timings; no --write)")
    p.add_argument("--write", action="store_true", help="rewrite INTRANODE[R] in the preset table")
    p.add_argument("--table", default=None, help="the table to rewrite (default: uccl_moe/tuning.py)")
    p.add_argument("--json", default=None, help="JSON output path (default runs/tune/<time>/tune.json; '' = none)")
    p.add_argument("--repick", default=None, metavar="TUNE_JSON",
                   help="no GPU run: pick again from the finalists of a saved tune JSON with this version's rule "
                        "(--min-gain); with --write, rewrite its row, keeping the device and date it was measured on")
    return p


def repick(path: str, min_gain: float, write: bool, table: str | None) -> int:
    """--repick: the picks of a saved run's finalists under the current rule, printed and (`write`) written."""
    data = json.loads(Path(path).read_text())
    final = {op: {(e["nvl_send"], e["nvl_recv"]): float(e["us"]) for e in data["final"][op]} for op in OPS}
    picks = pick(final, min_gain)
    R = int(data["ranks"])
    where = data["measured_on"]
    print(f"repick of {path} ({where}): {row_line(R, picks, where).strip()}")
    if data.get("bad_points"):
        print(f"ERROR: that run had wrong results at {data['bad_points']}; nothing written", file=sys.stderr)
        return 1
    if write:
        from uccl_moe import tuning

        target = table or tuning.__file__
        write_row(target, R, picks, where)
        print(f"wrote row {R} of {target}")
    return 0


# ------------------------------------------------------------------------------------------------ GPU-free parts
def experts_for(num_ranks: int, experts: int) -> int:
    """The largest multiple of `num_ranks` <= `experts` (every rank holds as many experts: 255 at EP3)."""
    out = experts - experts % num_ranks
    if out <= 0:
        raise ValueError(f"{experts} experts cannot be split over {num_ranks} ranks")
    return out


def candidate_grid(num_ranks: int, num_sms: int, sends: Iterable[int], recvs: Iterable[int], hidden: int,
                   max_nvl_bytes: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(kept, dropped) points of sends x recvs. A point is dropped where ``Config`` refuses it, the lane geometry
    does (too few slots per lane), its NVL size hint for BF16 rows of `hidden` exceeds `max_nvl_bytes`, or its
    effective chunk (the chunk capped at a lane's slots) equals that of a smaller nvl_send with the same ring. Kept
    entries: nvl_send, nvl_recv, chunk_tokens (effective), hint_bytes; dropped ones: nvl_send, nvl_recv, reason."""
    from uccl_moe import _C
    from uccl_moe.errors import UcclMoeError

    kept: list[dict[str, Any]] = []
    dropped: list[dict[str, Any]] = []
    seen: dict[tuple[int, int], int] = {}
    for nr in sorted(set(recvs)):
        for ns in sorted(set(sends)):
            try:
                cfg = _C.Config(num_sms, ns, nr, 6, 128)
                geo = _C.intranode_geometry(num_sms, num_ranks, ns, nr)
                hint = int(cfg.get_nvl_buffer_size_hint(hidden * 2, num_ranks))
            except UcclMoeError as e:
                dropped.append({"nvl_send": ns, "nvl_recv": nr, "reason": str(e)})
                continue
            chunk = int(geo[4])
            if hint > max_nvl_bytes:
                dropped.append({"nvl_send": ns, "nvl_recv": nr,
                                "reason": f"size hint {hint} B > --max-nvl-mb ({max_nvl_bytes} B)"})
            elif (chunk, nr) in seen:
                dropped.append({"nvl_send": ns, "nvl_recv": nr,
                                "reason": f"effective chunk {chunk} = nvl_send {seen[(chunk, nr)]}'s"})
            else:
                seen[(chunk, nr)] = ns
                kept.append({"nvl_send": ns, "nvl_recv": nr, "chunk_tokens": chunk, "hint_bytes": hint})
    return kept, dropped


def slowest_rank(per_rank: list[dict[str, dict[Cand, float]]]) -> dict[str, dict[Cand, float]]:
    """Per op and point, the largest of the ranks' medians (the time the group waits for)."""
    out: dict[str, dict[Cand, float]] = {}
    for times in per_rank:
        for op, by_cand in times.items():
            dst = out.setdefault(op, {})
            for cand, us in by_cand.items():
                dst[cand] = max(dst.get(cand, 0.0), us)
    return out


def _order(times: dict[Cand, float]) -> list[Cand]:
    """Fastest first; ties go to the smaller ring (less memory), then the smaller chunk."""
    return sorted(times, key=lambda c: (times[c], c[1], c[0]))


def finalists(sweep: dict[str, dict[Cand, float]], top: int) -> dict[str, list[Cand]]:
    """The points each op times again: its `top` fastest; the two dispatch ops both get the union of their
    finalists, so FP8 is timed at BF16's pick (and the other way round) in the same phase."""
    out = {op: _order(times)[:top] for op, times in sweep.items()}
    both = sorted(set(out.get("dispatch_fp8", [])) | set(out.get("dispatch_bf16", [])))
    for op in ("dispatch_fp8", "dispatch_bf16"):
        if op in out:
            out[op] = both
    return out


def _lean(times: dict[Cand, float], tol: float) -> Cand:
    """The point with the smallest ring (the Buffer every client sizes from the hint) among those within `tol` (a
    fraction) of the fastest; then the fastest of that ring."""
    best = min(times.values())
    near = {c: us for c, us in times.items() if us <= best * (1.0 + tol)}
    return min(near, key=lambda c: (c[1], near[c], c[0]))


def pick(final: dict[str, dict[Cand, float]], min_gain: float) -> dict[str, Cand | None]:
    """The preset from the finalists' times. A larger ring must pay for its memory: each op takes the smallest
    ring within `min_gain` (a fraction) of its fastest point (:func:`_lean`). ``combine`` = combine's pick,
    ``dispatch`` = BF16's pick among rings no smaller than combine's (so ``get_dispatch_config``'s size hint covers
    both ops),
    ``combine`` = combine's, ``dispatch_fp8`` = FP8's pick among rings no larger than ``dispatch``'s (so the Buffer
    a client sizes from ``get_dispatch_config``'s hint holds it), or None where that is ``dispatch`` itself or beats
    FP8's time at ``dispatch`` by no more than `min_gain`."""
    c = _lean(final["combine"], min_gain)
    # dispatch's ring no smaller than combine's: a Buffer sized by get_dispatch_config's hint alone (as many clients
    # size it) then holds the combine too
    holds = {cand: us for cand, us in final["dispatch_bf16"].items() if cand[1] >= c[1]}
    d = _lean(holds or final["dispatch_bf16"], min_gain)
    fp8 = final["dispatch_fp8"]
    fits = {cand: us for cand, us in fp8.items() if cand[1] <= d[1]}
    f: Cand | None = _lean(fits, min_gain) if fits else None
    if f == d or f is None or (d in fp8 and fp8[f] >= fp8[d] * (1.0 - min_gain)):
        f = None
    return {"dispatch": d, "dispatch_fp8": f, "combine": c}


def measured_on(device: str, num_ranks: int, date: str) -> str:
    return f"{device} x {num_ranks}, {date}, python -m uccl_moe.bench.tune --ranks {num_ranks}"


def row_line(num_ranks: int, picks: dict[str, Cand | None], where: str) -> str:
    """One table line: ``R: Preset(dispatch=Chunks(s, r), combine=Chunks(s, r), measured_on="...")`` (and
    ``dispatch_fp8=Chunks(s, r)`` where picked)."""
    def chunks(c: Cand | None) -> str:
        assert c is not None
        return f"Chunks({c[0]}, {c[1]})"

    fp8 = f", dispatch_fp8={chunks(picks['dispatch_fp8'])}" if picks.get("dispatch_fp8") else ""
    return (f"{ROW_INDENT}{num_ranks}: Preset(dispatch={chunks(picks['dispatch'])}, "
            f"combine={chunks(picks['combine'])}, measured_on={json.dumps(where)}{fp8}),")


def rewrite_table(text: str, num_ranks: int, line: str) -> str:
    """`text` (the source of uccl_moe/tuning.py) with the row of `num_ranks` between the tune-rows markers replaced
    by `line` (inserted in key order if absent); every other line stays byte for byte."""
    lines = text.split("\n")
    begin = [i for i, s in enumerate(lines) if s.strip() == BEGIN_MARK]
    end = [i for i, s in enumerate(lines) if s.strip() == END_MARK]
    if len(begin) != 1 or len(end) != 1 or begin[0] >= end[0]:
        raise ValueError(f"the table needs exactly one '{BEGIN_MARK}' line before one '{END_MARK}' line")
    key = re.compile(r"^\s*(\d+)\s*:")
    at = end[0]
    for i in range(begin[0] + 1, end[0]):
        m = key.match(lines[i])
        if m is None:
            continue
        k = int(m.group(1))
        if k == num_ranks:
            lines[i] = line
            return "\n".join(lines)
        if k > num_ranks:
            at = i
            break
    lines.insert(at, line)
    return "\n".join(lines)


def load_table(path: str | Path) -> Any:
    """`path` imported as a module inside the uccl_moe package (its relative imports resolve), not registered."""
    name = "uccl_moe._tuning_check"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up while the class body runs
    try:
        spec.loader.exec_module(mod)
    finally:
        del sys.modules[name]
    return mod


def write_row(path: str | Path, num_ranks: int, picks: dict[str, Cand | None], where: str) -> str:
    """Rewrite row `num_ranks` of the table at `path`; the result must import and give the picks back from
    ``preset_for(num_ranks)``, else the file is restored and ValueError raised. Returns the line written."""
    path = Path(path)
    old = path.read_text()
    line = row_line(num_ranks, picks, where)
    path.write_text(rewrite_table(old, num_ranks, line))
    try:
        p = load_table(path).preset_for(num_ranks)
        for c in (p.dispatch, p.combine, p.dispatch_fp8):
            if c is not None:
                c.config(24)  # Config validates the chunk and ring sizes
        got = {"dispatch": (p.dispatch.nvl_send, p.dispatch.nvl_recv),
               "dispatch_fp8": None if p.dispatch_fp8 is None else (p.dispatch_fp8.nvl_send, p.dispatch_fp8.nvl_recv),
               "combine": (p.combine.nvl_send, p.combine.nvl_recv)}
        want = {k: (tuple(v) if v else None) for k, v in picks.items()}
        if got != want or p.measured_on != where:
            raise ValueError(f"read back {got}, {p.measured_on!r}; wrote {want}, {where!r}")
    except Exception as e:
        path.write_text(old)
        raise ValueError(f"rewriting row {num_ranks} of {path} failed ({e}); the file is unchanged") from e
    return line


def _records(times: dict[str, dict[Cand, float]]) -> dict[str, list[dict[str, Any]]]:
    return {op: [{"nvl_send": c[0], "nvl_recv": c[1], "us": round(us, 1)} for c, us in sorted(by.items())]
            for op, by in times.items()}


# ------------------------------------------------------------------------------------------------ per rank
def _op_calls(buf: Any, x_fp8: Any, x_bf16: Any, y: Any, handle: Any, cfg: Any) -> dict[str, Callable[[], Any]]:
    """The timed calls of one point, as a DeepEP client makes them: cached dispatches and a combine of `y`."""
    return {"dispatch_fp8": lambda: buf.dispatch(x_fp8, handle=handle, config=cfg),
            "dispatch_bf16": lambda: buf.dispatch(x_bf16, handle=handle, config=cfg),
            "combine": lambda: buf.combine(y, handle, config=cfg)}


# long: the inputs, the per-point check and the two timing phases share one Buffer and one set of inputs
def _tune_worker(rank: int, R: int, init_file: str, args: argparse.Namespace, result_file: str) -> None:
    import torch
    import torch.distributed as dist

    from ._run import point_inputs
    from ._timing import FLUSH_BYTES, time_op

    if args.cpu:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=R)
        dev = torch.device("cpu")
    else:
        torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group("cpu:gloo,cuda:nccl", init_method=f"file://{init_file}", rank=rank, world_size=R)
        dev = torch.device("cuda", torch.cuda.current_device())
    gloo = dist.new_group(list(range(R)), backend="gloo")
    assert isinstance(gloo, dist.ProcessGroup)
    from uccl_moe import Buffer, Config

    Buffer.set_num_sms(args.sms)
    T, H, K = args.tokens, args.hidden, args.topk
    E = experts_for(R, args.experts)
    grid, _ = candidate_grid(R, args.sms, args.nvl_send, args.nvl_recv, H, args.max_nvl_mb << 20)
    buf = Buffer(dist.group.WORLD, max(g["hint_bytes"] for g in grid), backend="reference" if args.cpu else "native",
                 explicitly_destroy=True)
    gen = torch.Generator(device=dev).manual_seed(1234 + rank)
    idx, w, xb, (x8, s8) = point_inputs(T, H, E, K, "col", gen, dev)
    lay = buf.get_dispatch_layout(idx, E)
    copies = lay.is_token_in_rank.sum(1, dtype=torch.float32)[:, None]

    def dequant(q: Any, s: Any) -> Any:
        return (q.float() * s.repeat_interleave(128, dim=1)).bfloat16()

    want_b = (xb.float() * copies).bfloat16()
    want_8 = (dequant(x8, s8).float() * copies).bfloat16()
    align: Callable[[], Any] | None = None
    if args.cpu:
        def timed(fn: Callable[[], Any], iters: int) -> float:
            for _ in range(args.warmup):
                fn()
            runs = []
            for _ in range(iters):
                t = time.perf_counter()
                fn()
                runs.append((time.perf_counter() - t) * 1e6)
            return float(statistics.median(runs))
    else:
        flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=dev)

        def timed(fn: Callable[[], Any], iters: int) -> float:
            return time_op(fn, flush, iters, args.warmup, align, args.device_time)[0]

    if not args.cpu and 1 < R <= torch.cuda.device_count() and not args.no_align:
        token = torch.zeros(1, dtype=torch.float32, device=dev)

        def align() -> None:
            dist.all_reduce(token)

    bad: list[dict[str, Any]] = []

    def measure(plan: dict[Cand, list[str]], iters: int) -> dict[str, dict[Cand, float]]:
        times: dict[str, dict[Cand, float]] = {}
        for cand, ops in sorted(plan.items()):
            cfg = Config(args.sms, cand[0], cand[1], 6, 128)
            h: Any = buf.dispatch(xb, num_tokens_per_rank=lay.num_tokens_per_rank,
                                  is_token_in_rank=lay.is_token_in_rank,
                                  num_tokens_per_expert=lay.num_tokens_per_expert, topk_idx=idx, topk_weights=w,
                                  config=cfg).handle
            rb: Any = buf.dispatch(xb, handle=h, config=cfg).recv_x
            r8, rs = buf.dispatch((x8, s8), handle=h, config=cfg).recv_x
            ok_b = torch.equal(buf.combine(rb, h, config=cfg).combined_x, want_b)
            ok_8 = torch.equal(buf.combine(dequant(r8, rs), h, config=cfg).combined_x, want_8)
            if not (ok_b and ok_8):
                bad.append({"rank": rank, "nvl_send": cand[0], "nvl_recv": cand[1], "bf16_ok": ok_b, "fp8_ok": ok_8})
            fns = _op_calls(buf, (x8, s8), xb, rb, h, cfg)
            for op in ops:
                times.setdefault(op, {})[cand] = timed(fns[op], iters)
        return times

    def gathered(times: dict[str, dict[Cand, float]]) -> tuple[dict[str, dict[Cand, float]], list[Any]]:
        per_rank: list[Any] = [None] * R
        dist.all_gather_object(per_rank, times, group=gloo)
        return slowest_rank(per_rank), per_rank

    cands = [(g["nvl_send"], g["nvl_recv"]) for g in grid]
    t0 = time.time()
    sweep, sweep_ranks = gathered(measure({c: list(OPS) for c in cands}, args.iters))
    t_sweep = time.time() - t0
    plan: dict[Cand, list[str]] = {}
    for op, cs in finalists(sweep, args.top).items():
        for c in cs:
            plan.setdefault(c, []).append(op)
    final, _ = gathered(measure(plan, args.final_iters))
    bads: list[Any] = [None] * R
    dist.all_gather_object(bads, bad, group=gloo)
    dist.barrier(group=gloo)
    buf.destroy()
    if rank == 0:
        with open(result_file, "w") as f:
            json.dump({"experts": E, "sweep": _records(sweep), "final": _records(final),
                       "sweep_per_rank": [_records(t) for t in sweep_ranks],
                       "picks": pick(final, args.min_gain), "bad_points": [b for bs in bads for b in bs],
                       "sweep_s": round(t_sweep, 1), "final_s": round(time.time() - t0 - t_sweep, 1)}, f)
    dist.destroy_process_group()


# ------------------------------------------------------------------------------------------------ driver
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.repick:
        return repick(args.repick, args.min_gain, args.write, args.table)
    if args.sms <= 0 or args.sms % 2 or args.iters < 1 or args.final_iters < 20 or args.top < 1:
        print("--sms must be positive and even, --iters >= 1, --final-iters >= 20 (the method's median of 20), "
              "--top >= 1", file=sys.stderr)
        return 2
    import torch

    if args.cpu:
        if args.write:
            print("--cpu times the reference backend on the CPU: nothing to write", file=sys.stderr)
            return 2
    elif not torch.cuda.is_available():
        print("python -m uccl_moe.bench.tune needs CUDA GPUs (--cpu: the flow on the CPU)", file=sys.stderr)
        return 2
    n_gpus = torch.cuda.device_count() if not args.cpu else 0
    R = args.ranks or (n_gpus if not args.cpu else 2)
    from uccl_moe import tuning

    if R > tuning.MAX_INTRANODE_RANKS:
        print(f"--ranks {R}: the intranode presets cover 1..{tuning.MAX_INTRANODE_RANKS} ranks", file=sys.stderr)
        return 2
    if R > n_gpus and not args.cpu:
        if args.write:
            print(f"--write: {R} ranks would share {n_gpus} GPU(s); presets need one GPU per rank", file=sys.stderr)
            return 2
        print(f"note: {R} ranks share {n_gpus} GPU(s); timings are not meaningful", file=sys.stderr)
    grid, dropped = candidate_grid(R, args.sms, args.nvl_send, args.nvl_recv, args.hidden, args.max_nvl_mb << 20)
    if not grid:
        print(f"no grid point is accepted: {dropped}", file=sys.stderr)
        return 2
    stamp = time.strftime("%Y%m%d-%H%M%S")
    json_path = str(Path("runs") / "tune" / stamp / "tune.json") if args.json is None else args.json
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    from uccl_moe.bench import tune  # the worker by its module's name, also under python -m (spawn imports it)

    from ._run import spawn

    t0 = time.time()
    result = spawn(tune._tune_worker, R, args)
    if result is None:
        return 1
    dev = "cpu (reference backend)" if args.cpu else torch.cuda.get_device_name(0)
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    picks = {k: (tuple(v) if v else None) for k, v in result["picks"].items()}
    where = measured_on(dev, R, date)
    out: dict[str, Any] = {
        "device": dev, "ranks": R, "date": date, "argv": sys.argv[1:] if argv is None else argv,
        "setting": {"tokens": args.tokens, "hidden": args.hidden, "experts": result["experts"], "topk": args.topk,
                    "num_sms": args.sms, "scales": "col"},
        "iters": {"sweep": args.iters, "final": args.final_iters, "warmup": args.warmup, "top": args.top},
        "grid": grid, "dropped": dropped, **{k: v for k, v in result.items() if k not in ("experts", "picks")},
        "picks": {k: list(v) if v else None for k, v in picks.items()}, "measured_on": where,
        "row": row_line(R, picks, where).strip(), "written": None, "seconds": round(time.time() - t0, 1)}
    print(f"tune on {R} x {dev}: {len(grid)} points, sweep {result['sweep_s']} s, finalists {result['final_s']} s")
    for op in OPS:
        best = sorted(result["final"][op], key=lambda e: e["us"])
        print(f"  {op}: " + ", ".join(f"({e['nvl_send']}, {e['nvl_recv']}) {e['us']} us" for e in best))
    print(f"picks: {out['row']}")
    rc = 0
    if result["bad_points"]:
        print(f"ERROR: wrong results at {result['bad_points']}; nothing written", file=sys.stderr)
        rc = 1
    elif args.write:
        table = args.table or tuning.__file__
        write_row(table, R, picks, where)
        out["written"] = str(table)
        print(f"wrote row {R} of {table}")
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        with open(json_path, "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {json_path}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
