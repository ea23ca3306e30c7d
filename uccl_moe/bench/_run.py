"""Worker side of ``uccl-moe bench`` (a module of its own so spawned processes can import it)."""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections.abc import Callable
from typing import Any

from . import _host
from ._ceilings import peer_copy_ceiling, sm_push_ceiling
from ._timing import FLUSH_BYTES, flush_us, kernel_us, time_op


# ------------------------------------------------------------------------------------------------ per rank
def spawn(worker: Callable[..., None], R: int, args: argparse.Namespace) -> dict[str, Any] | None:
    """Runs worker(rank, R, init_file, args, result_file) in R spawned processes; returns the JSON rank 0 wrote to
    result_file, or None (after printing the exit codes) if a process failed."""
    import os
    import tempfile

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as d:
        init_file, result_file = os.path.join(d, "init"), os.path.join(d, "result.json")
        procs = [ctx.Process(target=worker, args=(r, R, init_file, args, result_file)) for r in range(R)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        if any(p.exitcode != 0 for p in procs):
            print(f"bench failed (exit codes {[p.exitcode for p in procs]})", file=sys.stderr)
            return None
        with open(result_file) as f:
            result: dict[str, Any] = json.load(f)
            return result


def point_configs(R: int, sms: int, nvl_send: int | None, nvl_recv: int | None,
                  dtype: str = "bf16") -> tuple[Any, Any, Any, Any]:
    """(dispatch config to pass, combine config to pass, the dispatch and the combine config that run) for a point
    dispatching `dtype` rows. Sets ``Buffer.set_num_sms(sms)`` as a client does. API mode (`nvl_send` and `nvl_recv`
    None): None is passed, so each call takes the preset itself (``get_dispatch_config(R)``, FP8 rows the row's FP8
    chunks where it has them; ``get_combine_config(R)``). Otherwise one explicit Config (a missing size from the
    dispatch preset) for both ops."""
    from uccl_moe import Buffer, Config, tuning

    Buffer.set_num_sms(sms)
    d_default = tuning.preset_for(R).dispatch_chunks(dtype == "fp8").config(sms)
    c_default = Buffer.get_combine_config(R)
    if nvl_send is None and nvl_recv is None:
        return None, None, d_default, c_default
    nr = nvl_recv if nvl_recv is not None else int(d_default.num_max_nvl_chunked_recv_tokens)
    ns = nvl_send if nvl_send is not None else int(d_default.num_max_nvl_chunked_send_tokens)
    cfg = Config(sms, min(ns, nr - 1), nr, 6, 128)
    return cfg, cfg, cfg, cfg


def config_fields(cfg: Any) -> list[int]:
    """[num_sms, nvl send chunk, nvl recv ring] of a Config (for the JSON and the table)."""
    return [int(cfg.num_sms), int(cfg.num_max_nvl_chunked_send_tokens), int(cfg.num_max_nvl_chunked_recv_tokens)]


def fp8_scales(T: int, H: int, layout: str, gen: Any, device: Any) -> Any:
    """[T, H/128] float32 scales > 0. ``col``: column-major, the transpose of a contiguous [H/128, T] tensor (what
    DeepGEMM-style FP8 casts hand over; strides (1, T)); ``row``: contiguous (strides (H/128, 1))."""
    import torch

    n = H // 128
    if layout == "col":
        return (torch.rand((n, T), generator=gen, dtype=torch.float32, device=device) + 0.01).T
    if layout == "row":
        return torch.rand((T, n), generator=gen, dtype=torch.float32, device=device) + 0.01
    raise ValueError(f"scale layout {layout!r}: expected 'col' or 'row'")


def point_inputs(T: int, H: int, E: int, K: int, scales: str, gen: Any, dev: Any) -> tuple[Any, Any, Any, Any]:
    """A point's inputs, drawn from `gen` in this order: top-K of E uniform scores per token (`topk_idx`), their
    weights, BF16 rows `xb` [T, H], then the FP8 rows (`xb` x 100, saturated to e4m3's range) with scales laid out as
    `scales` (fp8_scales). Returns (topk_idx, topk_weights, xb, (x_fp8, scales))."""
    import torch

    scores = torch.rand((T, E), generator=gen, dtype=torch.float32, device=dev) + 0.1
    idx = torch.topk(scores, K, dim=1).indices.to(torch.int64)
    w = torch.rand((T, K), generator=gen, dtype=torch.float32, device=dev)
    xb = torch.randn((T, H), generator=gen, dtype=torch.float32, device=dev).bfloat16()
    x8 = ((xb.float() * 100).clamp(-440, 440).to(torch.float8_e4m3fn), fp8_scales(T, H, scales, gen, dev))
    return idx, w, xb, x8


# long: one benchmark point: inputs, then each op timed against NCCL with the same inputs, in one scope
def _point(buf: Any, rank: int, R: int, gloo: Any, T: int, H: int, E: int, K: int, dtype: str, dcfg: Any, ccfg: Any,
           args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    dev = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator(device=dev).manual_seed(1234 + rank)
    idx, w, xb, x8 = point_inputs(T, H, E, K, args.scales, gen, dev)
    x: Any = x8 if dtype == "fp8" else xb
    row_bytes = H + 4 * (H // 128) if dtype == "fp8" else 2 * H
    lay = buf.get_dispatch_layout(idx, E)
    res = buf.dispatch(x, num_tokens_per_rank=lay.num_tokens_per_rank, is_token_in_rank=lay.is_token_in_rank,
                       num_tokens_per_expert=lay.num_tokens_per_expert, topk_idx=idx, topk_weights=w, config=dcfg)
    h = res.handle
    rank_prefix = h.rank_prefix_matrix.cpu()
    col = rank_prefix[:, rank]
    recv_from = torch.diff(col, prepend=col.new_zeros(1)).tolist()  # rows from each source
    n_recv = int(col[-1])
    n_remote = n_recv - recv_from[rank]
    send_to = lay.num_tokens_per_rank.cpu().tolist()
    n_sent_remote = sum(send_to) - send_to[rank]
    recv_x = res.recv_x[0] if isinstance(res.recv_x, tuple) else res.recv_x
    y = torch.randn((recv_x.shape[0], H), dtype=torch.float32, device=dev).bfloat16()
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=dev)

    nccl_ok = 1 < R <= torch.cuda.device_count()  # NCCL refuses two ranks on one GPU
    align = None
    if nccl_ok and not args.no_align:
        token = torch.zeros(1, dtype=torch.float32, device=dev)

        def align() -> None:
            dist.all_reduce(token)

    out: dict[str, Any] = {"flush_us": flush_us(flush)}
    # combine_view: the same rows combined from the Buffer's own memory (get_combine_buffer), where the producer of
    # the rows (Megatron's unpermute) writes them; each timing loop refills the view first, since the other ops'
    # rings run over it.
    view: list[Any] = [None]  # taken by fill_view before each use

    def fill_view() -> None:
        view[0] = buf.get_combine_buffer(h, H)  # the API's contract: taken after the last dispatch/combine
        view[0].copy_(y)

    ops: dict[str, tuple[Callable[[], Any], Callable[[], Any] | None]] = {
        "dispatch": (lambda: buf.dispatch(x, handle=h, config=dcfg), None),
        "combine": (lambda: buf.combine(y, h, config=ccfg), None)}
    if args.combine_view:
        ops["combine_view"] = (lambda: buf.combine(view[0], h, config=ccfg), fill_view)
    if args.dispatch_direct:  # the ring-free dispatch forced (the plain dispatch is the default's path)
        ops["dispatch_direct"] = (lambda: _forced("UCCL_MOE_DISPATCH_DIRECT", "1",
                                                  lambda: buf.dispatch(x, handle=h, config=dcfg)), None)
    if args.dispatch_ce:  # the rings and the copy engines forced, every rank alike (the plain dispatch: the default)
        for path, on in (("ring", "0"), ("ce", "1")):
            ops[f"dispatch_{path}"] = (lambda v=on: _forced("UCCL_MOE_DISPATCH_CE", v, lambda: buf.dispatch(  # type: ignore[misc]
                x, handle=h, config=dcfg)), None)
    if args.combine_staged:  # each combine path forced, every rank alike (the plain combine is the default's)
        for path in ("ring", "staged", "ce"):
            ops[f"combine_{path}"] = (lambda p=path: _forced_combine(buf, y, h, ccfg, p), None)  # type: ignore[misc]
    for op, (fn, prep) in ops.items():
        if prep is not None:
            prep()
        out[f"{op}_us"], out[f"{op}_host_us"] = time_op(fn, flush, args.iters, args.warmup, align, args.device_time)
    if args.combine_view:
        fill_view()
        from_view = buf.combine(view[0], h, config=ccfg).combined_x
        out["combine_view_equal"] = bool(torch.equal(from_view, buf.combine(y, h, config=ccfg).combined_x))
    # Each forced dispatch path: whether it fits (else it timed the rings), and the same bytes as the rings' (FP8 rows
    # and scales as bytes: x's own rows, 1 or 2 bytes a value, and scales; a cached dispatch lands no ids).
    rb, ns = (H, H // 128) if dtype == "fp8" else (2 * H, 0)
    dispatch_paths: list[tuple[str, str, bool, Callable[[], Any]]] = [
        ("direct", "UCCL_MOE_DISPATCH_DIRECT", args.dispatch_direct,
         lambda: buf._live().dispatch_direct_fits(h, rb, 0, ns)),
        ("ce", "UCCL_MOE_DISPATCH_CE", args.dispatch_ce, lambda: buf._live().dispatch_ce_fits(h, rb, ns))]
    for name, var, timed, fits_fn in dispatch_paths:
        if not timed:
            continue
        out[f"dispatch_{name}_fits"] = bool(fits_fn())
        got, want = (_forced(var, v, lambda: buf.dispatch(x, handle=h, config=dcfg)).recv_x for v in ("1", "0"))
        out[f"dispatch_{name}_equal"] = all(torch.equal(p.view(torch.uint8), q.view(torch.uint8)) for p, q in
                                            zip(got if isinstance(got, tuple) else (got,),
                                                want if isinstance(want, tuple) else (want,)))
    if args.combine_staged:  # each path's fit (else it timed the next path) and bits against the ring's
        ring = _forced_combine(buf, y, h, ccfg, "ring").combined_x
        for path, fits in (("staged", buf._live().combine_staged_fits(h, H, 0)),
                           ("ce", buf._live().combine_ce_fits(h, H, 0))):
            out[f"combine_{path}_fits"] = bool(fits)
            out[f"combine_{path}_equal"] = bool(torch.equal(_forced_combine(buf, y, h, ccfg, path).combined_x, ring))
    if args.kernel_times:
        for op, (fn, prep) in ops.items():
            if prep is not None:
                prep()
            out[f"{op}_kernels"] = kernel_us(fn, flush, args.iters, align)
    if not args.no_nccl and nccl_ok:
        send_rows = sum(send_to)
        send_d = torch.randint(0, 255, (send_rows, row_bytes), dtype=torch.uint8, device=dev)
        recv_d = torch.empty((n_recv, row_bytes), dtype=torch.uint8, device=dev)
        out["nccl_dispatch_us"], out["nccl_dispatch_host_us"] = time_op(
            lambda: dist.all_to_all_single(recv_d, send_d, recv_from, send_to), flush, args.iters, args.warmup, align,
            args.device_time)
        back_send = torch.empty((n_recv, 2 * H), dtype=torch.uint8, device=dev)
        back_recv = torch.empty((send_rows, 2 * H), dtype=torch.uint8, device=dev)
        out["nccl_combine_us"], out["nccl_combine_host_us"] = time_op(
            lambda: dist.all_to_all_single(back_recv, back_send, send_to, recv_from), flush, args.iters, args.warmup,
            align, args.device_time)
    out.update(n_recv=n_recv, n_remote=n_remote, n_sent=sum(send_to), n_sent_remote=n_sent_remote,
               row_bytes=row_bytes, combine_row_bytes=2 * H)
    gathered: list[Any] = [None] * R
    dist.all_gather_object(gathered, out, group=gloo)
    return _summarise(gathered)


def _forced_combine(buf: Any, y: Any, h: Any, cfg: Any, path: str) -> Any:
    """buf.combine(y) through `path` ("ring", "staged" or "ce": UCCL_MOE_COMBINE_STAGED and UCCL_MOE_COMBINE_CE for
    this call, every rank alike; where its rows do not fit, the rings)."""
    return _forced("UCCL_MOE_COMBINE_CE", str(int(path == "ce")), lambda: _forced(
        "UCCL_MOE_COMBINE_STAGED", str(int(path == "staged")), lambda: buf.combine(y, h, config=cfg)))


def _forced(var: str, value: str, fn: Callable[[], Any]) -> Any:
    """fn() with the environment variable `var` set to `value` (every rank alike); the caller's own setting comes
    back after it."""
    import os

    before = os.environ.get(var)
    os.environ[var] = value
    try:
        return fn()
    finally:
        if before is None:
            del os.environ[var]
        else:
            os.environ[var] = before


#: The ops a run may time, for the per-kernel lines (--kernel-times).
_OPS = ("dispatch", "dispatch_direct", "dispatch_ring", "dispatch_ce", "combine", "combine_view", "combine_ring",
        "combine_staged", "combine_ce")


def _summarise(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Slowest rank's time for each op; GB/s from that rank's own byte counts."""
    row: dict[str, Any] = {}
    for op, recv_key, remote_key, bytes_key in (
            ("dispatch", "n_recv", "n_remote", "row_bytes"),
            ("dispatch_direct", "n_recv", "n_remote", "row_bytes"),
            ("dispatch_ring", "n_recv", "n_remote", "row_bytes"),
            ("dispatch_ce", "n_recv", "n_remote", "row_bytes"),
            ("combine", "n_sent", "n_sent_remote", "combine_row_bytes"),
            ("combine_view", "n_sent", "n_sent_remote", "combine_row_bytes"),
            ("combine_ring", "n_sent", "n_sent_remote", "combine_row_bytes"),
            ("combine_staged", "n_sent", "n_sent_remote", "combine_row_bytes"),
            ("combine_ce", "n_sent", "n_sent_remote", "combine_row_bytes"),
            ("nccl_dispatch", "n_recv", "n_remote", "row_bytes"),
            ("nccl_combine", "n_sent", "n_sent_remote", "combine_row_bytes")):
        key = f"{op}_us"
        if key not in per_rank[0]:
            continue
        slowest = max(per_rank, key=lambda d: d[key])
        t = slowest[key]
        row[key] = round(t, 1)
        row[f"{op}_logical_GBps"] = round(slowest[recv_key] * slowest[bytes_key] / (t * 1e3), 1)
        row[f"{op}_nvlink_GBps"] = round(slowest[remote_key] * slowest[bytes_key] / (t * 1e3), 1)
        if f"{op}_host_us" in per_rank[0]:  # the slowest rank's host time per call, on its own
            row[f"{op}_host_us"] = round(max(d[f"{op}_host_us"] for d in per_rank), 1)
    for key in ("combine_view_equal", "combine_staged_equal", "combine_staged_fits", "combine_ce_equal",
                "combine_ce_fits", "dispatch_direct_equal", "dispatch_direct_fits", "dispatch_ce_equal",
                "dispatch_ce_fits"):
        if key in per_rank[0]:
            row[key] = all(d[key] for d in per_rank)
    if "flush_us" in per_rank[0]:  # the least host time any rank's flush hides
        row["flush_us"] = round(min(d["flush_us"] for d in per_rank), 1)
    for op in _OPS:
        key = f"{op}_kernels"
        if key in per_rank[0]:  # slowest rank per kernel
            names = sorted({n for d in per_rank for n in d[key]})
            row[key] = {n: max(d[key].get(n, 0.0) for d in per_rank) for n in names}
    return row


def _worker(rank: int, R: int, init_file: str, args: argparse.Namespace, result_file: str) -> None:
    import torch
    import torch.distributed as dist

    if getattr(args, "bind", None):  # before CUDA and NCCL start their threads, which inherit it
        _host.bind(args.bind[rank])
    torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group("cpu:gloo,cuda:nccl", init_method=f"file://{init_file}", rank=rank, world_size=R)
    gloo = dist.new_group(list(range(R)), backend="gloo")
    assert isinstance(gloo, dist.ProcessGroup)  # all ranks are members (torch >= 2.14 types non-members as -100)
    from uccl_moe import Buffer

    points = list(itertools.product(args.tokens, args.hidden, args.experts, args.dtypes.split(","), args.sms,
                                    args.nvl_send or [None], args.nvl_recv or [None]))
    # sized as a DeepEP client sizes it: the largest size hint of the configs that run (BF16 rows)
    nvl = 0
    for _, h, _, dt, s, ns, nr in points:
        _, _, dc, cc = point_configs(R, s, ns, nr, dt)
        nvl = max(nvl, dc.get_nvl_buffer_size_hint(h * 2, R), cc.get_nvl_buffer_size_hint(h * 2, R))
    if args.combine_view:  # room for the rows: any rank's tokens may come (the staged combine needs less)
        nvl = max(nvl, max(Buffer.get_combine_buffer_size_hint(t * R, h) for t, h, *_ in points))
    buf = Buffer(dist.group.WORLD, nvl, backend="native", explicitly_destroy=True)
    ceiling_bytes = min(1 << 30, nvl - (2 << 20)) // 2
    host: dict[str, list[Any]] = {"start": [None] * R, "end": [None] * R}
    dist.all_gather_object(host["start"], _host.sample(), group=gloo)
    ceiling = peer_copy_ceiling(buf, rank, R, gloo, ceiling_bytes, args)
    push = sm_push_ceiling(rank, R, gloo, ceiling_bytes, args)
    bar: Any = None
    if rank == 0:
        try:
            from tqdm import tqdm

            bar = tqdm(total=len(points), desc="uccl-moe bench", file=sys.stderr)
        except ImportError:
            bar = None
    # One untimed pass over the first point: a process's first timed loops ran up to 25 us slow (FP8 dispatch, device
    # time, 2 x H100), and the first point's NCCL loops, timed after ours, would not pay it.
    if points:  # (its kernel profile, --kernel-times, would be thrown away: not taken)
        T, H, E, dt, sms, ns, nr = points[0]
        _point(buf, rank, R, gloo, T, H, E, args.topk, dt, *point_configs(R, sms, ns, nr, dt)[:2],
               argparse.Namespace(**{**vars(args), "kernel_times": False}))
    rows = []
    for i, (T, H, E, dt, sms, ns, nr) in enumerate(points):
        dcfg, ccfg, d_run, c_run = point_configs(R, sms, ns, nr, dt)
        row = {"ranks": R, "tokens": T, "hidden": H, "experts": E, "topk": args.topk, "dtype": dt, "num_sms": sms,
               "nvl_send": int(d_run.num_max_nvl_chunked_send_tokens),
               "nvl_recv": int(d_run.num_max_nvl_chunked_recv_tokens), "mode": args.mode, "scales": args.scales,
               "dispatch_config": config_fields(d_run), "combine_config": config_fields(c_run),
               "config_passed": dcfg is not None}
        row.update(_point(buf, rank, R, gloo, T, H, E, args.topk, dt, dcfg, ccfg, args))
        row["peer_copy_GBps"] = round(ceiling, 1)
        row["sm_push_GBps"] = round(push, 1)
        rows.append(row)
        if bar is not None:
            bar.update(1)
        elif rank == 0:
            print(f"[{i + 1}/{len(points)}] done", file=sys.stderr, flush=True)
    if bar is not None:
        bar.close()
    dist.all_gather_object(host["end"], _host.sample(), group=gloo)
    dist.barrier(group=gloo)
    buf.destroy()
    if rank == 0:
        with open(result_file, "w") as f:
            json.dump({"rows": rows, "peer_copy_GBps": ceiling, "sm_push_GBps": push, "host": host}, f)
    dist.destroy_process_group()


_SETTING = ("ranks", "tokens", "hidden", "experts", "num_sms", "nvl_send", "nvl_recv")


def op_summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per (setting, op): ``dispatch fp8``/``dispatch bf16`` from each dtype's row, ``combine`` (BF16 rows
    of a tensor of the caller's; taken from the BF16 point where there is one) and ``combine from the buffer`` where
    timed: ours and NCCL's us (slowest rank), ``speedup`` = NCCL us / ours (> 1: ours is faster), host us per call,
    nvlink GB/s, and the run's ceilings."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(tuple(r.get(k) for k in _SETTING), []).append(r)
    out = []
    for key, members in groups.items():
        setting = dict(zip(_SETTING, key))
        comb_row = next((r for r in members if r["dtype"] == "bf16"), members[0])
        entries = [(f"dispatch {r['dtype']}", r, "dispatch", "nccl_dispatch") for r in members]
        for op, what in (("dispatch_direct", "dispatch direct"), ("dispatch_ring", "dispatch ring"),
                         ("dispatch_ce", "dispatch copy engines")):
            entries += [(f"{what} {r['dtype']}", r, op, "nccl_dispatch") for r in members if f"{op}_us" in r]
        entries.append(("combine", comb_row, "combine", "nccl_combine"))
        if "combine_view_us" in comb_row:
            entries.append(("combine from the buffer", comb_row, "combine_view", "nccl_combine"))
        if "combine_staged_us" in comb_row:
            entries.append(("combine ring", comb_row, "combine_ring", "nccl_combine"))
            entries.append(("combine staged", comb_row, "combine_staged", "nccl_combine"))
            entries.append(("combine copy engines", comb_row, "combine_ce", "nccl_combine"))
        for name, r, ours, nccl in entries:
            e: dict[str, Any] = {**setting, "op": name, "mode": r.get("mode", "tuned"),
                                 "ours_us": r.get(f"{ours}_us"), "nccl_us": r.get(f"{nccl}_us"),
                                 "ours_host_us": r.get(f"{ours}_host_us"), "nccl_host_us": r.get(f"{nccl}_host_us"),
                                 "ours_nvlink_GBps": r.get(f"{ours}_nvlink_GBps"),
                                 "nccl_nvlink_GBps": r.get(f"{nccl}_nvlink_GBps"),
                                 "peer_copy_GBps": r.get("peer_copy_GBps"), "sm_push_GBps": r.get("sm_push_GBps")}
            e["speedup"] = round(e["nccl_us"] / e["ours_us"], 2) if e["nccl_us"] and e["ours_us"] else None
            out.append(e)
        fp8 = next((r for r in members if r["dtype"] == "fp8"), None)
        bf16 = next((r for r in members if r["dtype"] == "bf16"), None)
        if fp8 is not None and bf16 is not None and bf16.get("dispatch_us"):
            for e in out[-len(entries):]:
                e["fp8_over_bf16_dispatch"] = round(fp8["dispatch_us"] / bf16["dispatch_us"], 2)
    return out


def op_table(ops: list[dict[str, Any]]) -> str:
    """The per-op table: one line per (setting, op), ours vs NCCL, host time, GB/s and the ceilings."""
    cols = [("ranks", "EP"), ("tokens", "tokens"), ("hidden", "hidden"), ("experts", "E"), ("num_sms", "SMs"),
            ("op", "op"), ("ours_us", "ours_us"), ("nccl_us", "nccl_us"), ("speedup", "ours/nccl"),
            ("ours_host_us", "ours_host"), ("nccl_host_us", "nccl_host"), ("ours_nvlink_GBps", "ours_nvl"),
            ("nccl_nvlink_GBps", "nccl_nvl"), ("peer_copy_GBps", "copy_ceil"), ("sm_push_GBps", "push_ceil")]
    widths = [max(len(h), *(len(_cell(e.get(k))) for e in ops)) for k, h in cols]
    lines = ["  ".join(h.rjust(w) for (_, h), w in zip(cols, widths))]
    for e in ops:
        lines.append("  ".join(_cell(e.get(k)).rjust(w) for (k, _), w in zip(cols, widths)))
    ratios = sorted({(e["tokens"], e["hidden"], e["fp8_over_bf16_dispatch"]) for e in ops
                     if "fp8_over_bf16_dispatch" in e})
    for t, h, v in ratios:
        lines.append(f"FP8 / BF16 dispatch time (T={t}, H={h}): {v}")
    lines.append("ours/nccl = NCCL us / ours us (> 1: ours faster); us: CUDA events, median, slowest rank; "
                 "GB/s: rows from/to other ranks; ceilings per GPU")
    return "\n".join(lines)


def _cell(v: Any) -> str:
    return "-" if v is None else str(v)


def _table(rows: list[dict[str, Any]]) -> str:
    cols = [("ranks", "EP"), ("tokens", "tokens"), ("hidden", "hidden"), ("experts", "E"), ("dtype", "dtype"),
            ("num_sms", "SMs"), ("nvl_send", "chunk"), ("dispatch_us", "disp_us"),
            ("dispatch_nvlink_GBps", "disp_nvl"), ("dispatch_logical_GBps", "disp_log"),
            ("nccl_dispatch_us", "nccl_us"), ("nccl_dispatch_nvlink_GBps", "nccl_nvl"),
            ("combine_us", "comb_us"), ("combine_nvlink_GBps", "comb_nvl"), ("combine_logical_GBps", "comb_log"),
            ("combine_view_us", "combv_us"), ("combine_view_nvlink_GBps", "combv_nvl"),
            ("dispatch_direct_us", "dispd_us"), ("dispatch_direct_nvlink_GBps", "dispd_nvl"),
            ("dispatch_ring_us", "dispr_us"), ("dispatch_ce_us", "dispc_us"), ("dispatch_ce_host_us", "dispc_host"),
            ("combine_ring_us", "combr_us"), ("combine_ring_nvlink_GBps", "combr_nvl"),
            ("combine_staged_us", "combs_us"), ("combine_staged_nvlink_GBps", "combs_nvl"),
            ("combine_ce_us", "combc_us"), ("combine_ce_nvlink_GBps", "combc_nvl"),
            ("nccl_combine_us", "ncclc_us"), ("nccl_combine_nvlink_GBps", "ncclc_nvl"),
            ("dispatch_host_us", "disp_host"), ("combine_host_us", "comb_host"), ("combine_view_host_us", "combv_host"),
            ("combine_ring_host_us", "combr_host"), ("combine_staged_host_us", "combs_host"),
            ("combine_ce_host_us", "combc_host"),
            ("nccl_dispatch_host_us", "nccl_host"), ("nccl_combine_host_us", "ncclc_host")]
    cols = [c for c in cols if any(c[0] in r for r in rows)]
    widths = [max(len(h), *(len(str(r.get(k, ""))) for r in rows)) for k, h in cols]
    lines = ["  ".join(h.rjust(w) for (_, h), w in zip(cols, widths))]
    for r in rows:
        lines.append("  ".join(str(r.get(k, "")).rjust(w) for (k, _), w in zip(cols, widths)))
    return "\n".join(lines)


def _kernel_lines(rows: list[dict[str, Any]]) -> str:
    """One line per row and op: GPU kernel us per call (slowest rank), e.g. for --kernel-times."""
    lines = []
    for r in rows:
        for op in _OPS:
            ks = r.get(f"{op}_kernels")
            if ks:
                body = ", ".join(f"{n} {us:.1f}" for n, us in ks.items())
                lines.append(f"EP{r['ranks']} T={r['tokens']} {r['dtype']} sms={r['num_sms']} chunk={r['nvl_send']} "
                             f"ring={r['nvl_recv']} {op}: {r[f'{op}_us']} us call; kernels us: {body}")
    return "\n".join(lines)
