"""``python -m uccl_moe.bench.megatron_dispatcher``: the token dispatcher's own cost inside Megatron-Core.

For each dispatcher (``uccl``; Megatron's ``alltoall``; Megatron's ``flex`` with the DeepEP backend over our
``deep_ep`` shim) it builds the dispatcher as ``MoELayer`` does (EP = the number of ranks, TP = 1), then times per
call, with identity experts (each received row times its prob, Megatron's expert contract):

  - forward ``dispatch``: ``dispatch_preprocess -> token_dispatch -> dispatch_postprocess``,
  - forward ``combine``: ``combine_preprocess -> token_combine -> combine_postprocess``,
  - backward ``combine`` (the combine trio's backward, up to the gradient of the expert output) and backward
    ``dispatch`` (from the gradient of the dispatched tokens to the input's), inside one ``backward()`` call.

Method (as ``uccl-moe bench``): before the forward and before the backward the ranks meet in an untimed one-float
all-reduce and L2 is flushed (256 MB written); CUDA events on the current stream (the dispatchers' own comm streams
join it); the median of ``--iters`` (>= 20) runs after ``--warmup``; the slowest rank's median. Host columns give
the CPU microseconds each trio (and the whole backward) takes to return. Each run also checks the flow: with probs
1/top-k, the combined output equals the input and the input's gradient equals the output's (``fwd_err``/``bwd_err``,
relative to the largest value).

``--cpu`` runs the same path on gloo with the reference Buffer backend (tiny shapes; checks the flow, not timings):
CPU wall time stands in for the events. One process per rank is spawned (``--ranks``, default all GPUs; 2 on CPU).
Prints a table and writes JSON (``--json``; default ``runs/bench/<time>/megatron_dispatcher.json``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ._run import spawn
from ._timing import FLUSH_BYTES

DISPATCHERS = ("uccl", "alltoall", "flex")
SECTIONS = ("fwd_dispatch", "fwd_combine", "bwd_combine", "bwd_dispatch")
HOST = ("host_dispatch", "host_combine", "host_backward")


def _parse_names(text: str) -> list[str]:
    names = [n for n in text.split(",") if n]
    bad = [n for n in names if n not in DISPATCHERS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown dispatcher(s) {bad or text!r}; choose from {', '.join(DISPATCHERS)}")
    return names


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m uccl_moe.bench.megatron_dispatcher",
                                description=__doc__.split("\n")[0] if __doc__ else None)
    p.add_argument("--ranks", type=int, default=0, help="processes = EP size; 0 = all visible GPUs (2 with --cpu)")
    p.add_argument("--dispatchers", type=_parse_names, default=list(DISPATCHERS),
                   help="comma list of uccl, alltoall, flex")
    p.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--sms", type=int, default=24, help="Buffer.set_num_sms for uccl and flex (moe_deepep_num_sms)")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default=None,
                   help="hidden-state dtype (default: bf16 on GPUs, fp32 with --cpu)")
    p.add_argument("--iters", type=int, default=20, help="timed runs per dispatcher (median; >= 20 on GPUs)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--no-align", action="store_true", help="do not align the ranks before each timed run")
    p.add_argument("--cpu", action="store_true", help="gloo + reference backend, CPU wall time (flow check)")
    p.add_argument("--json", default=None,
                   help="JSON output path ('' = none; default runs/bench/<time>/megatron_dispatcher.json)")
    return p


def check_args(args: argparse.Namespace) -> str | None:
    """The reason these arguments cannot run, or None."""
    if args.iters < (1 if args.cpu else 20):
        return "--iters must be >= 20 on GPUs (the median of at least 20 runs is the method)"
    if args.warmup < 0:
        return "--warmup must be >= 0"
    if args.tokens <= 0 or args.hidden <= 0 or args.hidden % 8:
        return f"--tokens must be > 0 and --hidden a positive multiple of 8 (got {args.tokens}, {args.hidden})"
    if not 1 <= args.topk <= args.experts:
        return f"--topk {args.topk} must be in [1, --experts {args.experts}]"
    if args.sms <= 0 or args.sms % 2:
        return f"--sms {args.sms} must be a positive even number"
    return None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    err = check_args(args)
    if err:
        print(err, file=sys.stderr)
        return 2
    args.dtype = args.dtype or ("fp32" if args.cpu else "bf16")
    if args.cpu:
        R = args.ranks or 2
        dev = "cpu (gloo, reference backend)"
    else:
        import torch

        if not torch.cuda.is_available():
            print("needs CUDA GPUs (or --cpu for the flow on CPU)", file=sys.stderr)
            return 2
        R = args.ranks or torch.cuda.device_count()
        dev = torch.cuda.get_device_name(0)
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    if R < 2 or args.experts % R:
        print(f"EP = {R} ranks: need >= 2 (flex needs TPxEP > 1) and --experts {args.experts} divisible by it",
              file=sys.stderr)
        return 2
    if args.json is None:
        args.json = str(Path("runs") / "bench" / time.strftime("%Y%m%d-%H%M%S") / "megatron_dispatcher.json")
    t0 = time.time()
    result = spawn(_worker, R, args)
    if result is None:
        return 1
    report(args, result, R, dev, time.time() - t0)
    bad = [d for d in result["dispatchers"] if max(d["fwd_err"], d["bwd_err"]) > tolerance(args.dtype)]
    if bad:
        print(f"ERROR: the flow check failed for {[d['dispatcher'] for d in bad]} (combined output != input)",
              file=sys.stderr)
        return 1
    return 0


def tolerance(dtype: str) -> float:
    """Largest relative round-trip error accepted: sums of 1/top-k shares are exact in fp32 up to rounding of the
    order of its epsilon; BF16 adds one rounding per partial sum (Megatron's unpermute sums in the model dtype)."""
    return 1e-5 if dtype == "fp32" else 2e-2


def report(args: argparse.Namespace, result: dict[str, Any], R: int, dev: str, seconds: float) -> dict[str, Any]:
    """Print the table, write the JSON args name; returns the JSON object."""
    print(f"Megatron dispatcher cost on {R} x {dev} (EP{R}, T={args.tokens}, H={args.hidden}, E={args.experts}, "
          f"top-{args.topk}, {args.dtype}, {args.sms} SMs, identity experts); {seconds:.0f} s")
    print(table(result["dispatchers"]))
    out = {"device": dev, "ranks": R, "argv": sys.argv[1:],
           "args": {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, list))}, **result}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {args.json}")
    return out


def summarise(name: str, per_rank: list[dict[str, list[float]]]) -> dict[str, Any]:
    """Per section the slowest rank's median (us), the fwd+bwd total of the four sections, and the worst flow error
    of any rank."""
    row: dict[str, Any] = {"dispatcher": name}
    for key in (*SECTIONS, *HOST):
        row[f"{key}_us"] = round(max(statistics.median(r[key]) for r in per_rank), 1)
    row["total_us"] = round(sum(row[f"{s}_us"] for s in SECTIONS), 1)
    for key in ("fwd_err", "bwd_err"):
        row[key] = max(float(r[key][0]) for r in per_rank)
    row["rows_received"] = [int(r["rows"][0]) for r in per_rank]
    return row


def with_ratios(rows: list[dict[str, Any]], baseline: str = "alltoall") -> list[dict[str, Any]]:
    """Adds ``vs_<baseline>`` = total time / the baseline's (< 1: cheaper) where the baseline was measured."""
    base = next((r for r in rows if r["dispatcher"] == baseline), None)
    for r in rows:
        r[f"vs_{baseline}"] = round(r["total_us"] / base["total_us"], 2) if base and base["total_us"] else None
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    cols = [("dispatcher", "dispatcher"), ("fwd_dispatch_us", "fwd_disp"), ("fwd_combine_us", "fwd_comb"),
            ("bwd_combine_us", "bwd_comb"), ("bwd_dispatch_us", "bwd_disp"), ("total_us", "total"),
            ("vs_alltoall", "vs_a2a"), ("host_dispatch_us", "host_disp"), ("host_combine_us", "host_comb"),
            ("host_backward_us", "host_bwd"), ("fwd_err", "fwd_err"), ("bwd_err", "bwd_err")]

    def cell(v: Any) -> str:
        if v is None:
            return "-"
        return f"{v:.1e}" if isinstance(v, float) and 0 < abs(v) < 1e-2 else str(v)

    widths = [max(len(h), *(len(cell(r.get(k))) for r in rows)) for k, h in cols]
    lines = ["  ".join(h.rjust(w) for (_, h), w in zip(cols, widths))]
    lines += ["  ".join(cell(r.get(k)).rjust(w) for (k, _), w in zip(cols, widths)) for r in rows]
    lines.append("us per call, median, slowest rank; total = the four sections; vs_a2a = total / alltoall's total")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ per rank
def _worker(rank: int, R: int, init_file: str, args: argparse.Namespace, result_file: str) -> None:
    code = 0
    try:
        rows = _run_rank(rank, R, init_file, args)
        if rank == 0:
            with open(result_file, "w") as f:
                json.dump({"dispatchers": rows}, f)
    except BaseException:  # noqa: BLE001 - report, then exit non-zero
        traceback.print_exc()
        code = 1
    # Skip interpreter shutdown: gloo threads of Megatron's process groups can abort a finalizing interpreter.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _run_rank(rank: int, R: int, init_file: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    import uccl_moe.deep_ep_compat as shim

    shim.install()  # before Megatron's fused_a2a looks for deep_ep (flex's DeepEP backend)
    import torch
    import torch.distributed as dist

    init = f"file://{init_file}"
    if args.cpu:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=R)
        from uccl_moe.megatron import cpu as megatron_cpu

        megatron_cpu.apply()
        device = torch.device("cpu")
    else:
        torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group("cpu:gloo,cuda:nccl", init_method=init, rank=rank, world_size=R)
        device = torch.device("cuda", torch.cuda.current_device())
    gloo = dist.new_group(list(range(R)), backend="gloo")
    from megatron.core import parallel_state

    import uccl_moe.megatron  # noqa: F401  (registers the "uccl" dispatcher type)

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, expert_model_parallel_size=R)
    rows = []
    for name in args.dispatchers:
        per_rank: list[Any] = [None] * R
        dist.all_gather_object(per_rank, _time_dispatcher(name, rank, R, device, args), group=gloo)
        rows.append(summarise(name, per_rank))
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    return with_ratios(rows)


def make_dispatcher(name: str, R: int, rank: int, args: argparse.Namespace) -> Any:
    """The dispatcher MoELayer would build for `name` (EP = R, TP = 1) on this rank."""
    import torch
    from megatron.core.transformer.moe import token_dispatcher as td
    from megatron.core.transformer.transformer_config import TransformerConfig

    from uccl_moe import Buffer
    from uccl_moe.megatron import _compat
    from uccl_moe.megatron.dispatcher import UCCLTokenDispatcher

    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    kw: dict[str, Any] = dict(
        num_layers=1, hidden_size=args.hidden, num_attention_heads=math.gcd(args.hidden, 8),
        num_moe_experts=args.experts, moe_router_topk=args.topk, moe_ffn_hidden_size=args.hidden,
        moe_token_dispatcher_type=name, moe_router_dtype="fp32", moe_router_load_balancing_type="none",
        expert_model_parallel_size=R, tensor_model_parallel_size=1, add_bias_linear=False,
        bf16=dtype == torch.bfloat16, params_dtype=dtype, gradient_accumulation_fusion=False)
    if name == "flex":
        kw.update(moe_flex_dispatcher_backend="deepep", moe_deepep_num_sms=args.sms)
    config = TransformerConfig(**kw)
    Buffer.set_num_sms(args.sms)
    L = args.experts // R
    local = list(range(rank * L, (rank + 1) * L))
    cls = {"uccl": UCCLTokenDispatcher, "alltoall": td.MoEAlltoAllTokenDispatcher,
           "flex": td.MoEFlexTokenDispatcher}[name]
    return cls(L, local, config=config, pg_collection=_compat.default_pg_collection())


class _Clock:
    """Marks on the current CUDA stream (events), or CPU wall time on CPU."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda

    def mark(self) -> Any:
        import torch

        if not self.cuda:
            return time.perf_counter()
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def us(self, a: Any, b: Any) -> float:
        if not self.cuda:
            return float((b - a) * 1e6)
        b.synchronize()
        return float(a.elapsed_time(b) * 1e3)


def _mark_into(marks: dict[str, Any], key: str, clock: _Clock) -> Callable[[Any], None]:
    """A tensor hook that records a mark under `key` when the tensor's gradient is computed."""
    def hook(_grad: Any) -> None:
        marks[key] = clock.mark()
    return hook


def _time_dispatcher(name: str, rank: int, R: int, device: Any, args: argparse.Namespace) -> dict[str, list[float]]:
    import torch
    import torch.distributed as dist

    disp = make_dispatcher(name, R, rank, args)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    T, H, E, K = args.tokens, args.hidden, args.experts, args.topk
    gen = torch.Generator().manual_seed(1234 + rank)
    x0 = torch.randn(T, 1, H, generator=gen).to(device, dtype)
    g0 = torch.randn(T, 1, H, generator=gen).to(device, dtype)
    sel = torch.topk(torch.rand(T, E, generator=gen), K, dim=1).indices
    routing_map = torch.zeros(T, E, dtype=torch.bool).scatter_(1, sel, True).to(device)
    probs0 = (routing_map.float() / K).contiguous()  # shares 1/K: the combined output is the input again
    cuda = device.type == "cuda"
    clock = _Clock(cuda)
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=device) if cuda else None
    token = torch.zeros(1, device=device)

    def settle() -> None:  # untimed: the ranks start together, L2 holds nothing of the last run
        if not args.no_align:
            dist.all_reduce(token)
        if flush is not None:
            flush.zero_()

    out: dict[str, list[float]] = {k: [] for k in (*SECTIONS, *HOST, "fwd_err", "bwd_err", "rows")}
    for i in range(args.warmup + args.iters):
        x = x0.clone().requires_grad_(True)
        probs = probs0.clone().requires_grad_(True)
        settle()
        m0 = clock.mark()
        h0 = time.perf_counter()
        h, p = disp.dispatch_preprocess(x, routing_map, probs)
        h, p = disp.token_dispatch(h, p)
        tokens, _, permuted_probs = disp.dispatch_postprocess(h, p)
        h1 = time.perf_counter()
        m1 = clock.mark()
        expert_out = tokens * permuted_probs.unsqueeze(-1).to(tokens.dtype)  # identity experts scaled by probs
        m2 = clock.mark()
        h2 = time.perf_counter()
        y = disp.combine_postprocess(disp.token_combine(disp.combine_preprocess(expert_out)))
        h3 = time.perf_counter()
        m3 = clock.mark()
        marks: dict[str, Any] = {}
        expert_out.register_hook(_mark_into(marks, "combine_done", clock))  # its grad: the combine trio's backward done
        tokens.register_hook(_mark_into(marks, "expert_done", clock))  # its grad: the dispatch trio's backward starts
        settle()
        b0 = clock.mark()
        h4 = time.perf_counter()
        y.backward(g0)
        h5 = time.perf_counter()
        b1 = clock.mark()
        if cuda:
            torch.cuda.synchronize()
        if i == 0:  # the flow check, on the first run
            scale = float(x0.float().abs().max()) or 1.0
            out["fwd_err"].append(float((y.detach().float() - x0.float()).abs().max()) / scale)
            gscale = float(g0.float().abs().max()) or 1.0
            assert x.grad is not None
            out["bwd_err"].append(float((x.grad.float() - g0.float()).abs().max()) / gscale)
            out["rows"].append(float(tokens.shape[0]))
        if i < args.warmup:
            continue
        out["fwd_dispatch"].append(clock.us(m0, m1))
        out["fwd_combine"].append(clock.us(m2, m3))
        out["bwd_combine"].append(clock.us(b0, marks["combine_done"]))
        out["bwd_dispatch"].append(clock.us(marks["expert_done"], b1))
        out["host_dispatch"].append((h1 - h0) * 1e6)
        out["host_combine"].append((h3 - h2) * 1e6)
        out["host_backward"].append((h5 - h4) * 1e6)
    return out


if __name__ == "__main__":
    sys.exit(main())
