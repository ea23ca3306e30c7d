"""A small, self-contained GPT-MoE training entry on Megatron-Core's own model, DDP, optimizer and schedules.

    python -m uccl_moe.train.train_gpt --num-layers 2 --hidden-size 64 --num-attention-heads 4 \\
        --num-experts 8 --moe-router-topk 2 --expert-model-parallel-size 2 \\
        --moe-token-dispatcher-type uccl --seq-length 32 --micro-batch-size 2 --global-batch-size 4 \\
        --train-iters 20 --lr 1e-3

Launch one process per rank (``torchrun --nproc-per-node N -m uccl_moe.train.train_gpt ...``); a plain
``python -m`` runs one rank. GPUs use NCCL; without CUDA it runs on CPU with gloo (``uccl_moe.megatron.cpu`` shims).

Why this exists: ``pretrain_gpt.py`` is part of the Megatron-LM repository, not of the megatron-core wheel. This entry
needs only the wheel and trains on a synthetic next-token task (each sequence counts up modulo the vocabulary from
a random start, so the loss must fall quickly when training works). For real data use Megatron-LM's own script
through ``python -m uccl_moe.megatron.pretrain pretrain_gpt.py ...``.

Flags use Megatron's names (:mod:`uccl_moe.train.args`). Every ``TransformerConfig`` field is a flag
(``--moe-router-topk 2``, ``--expert-model-parallel-size 4``, ``--moe-shared-expert-overlap``, ``--no-<field>`` for a
field that defaults to True), plus Megatron's aliases listed in ``args._ALIASES`` (``--num-experts``, ``--swiglu``,
``--disable-bias-linear``, ...), the training flags of :func:`~uccl_moe.train.args.build_parser`, and the
``--moe-uccl-*`` knobs. Unknown flags are an error.
``--loss-log FILE`` writes one JSON line per step (iteration, loss, grad norm, seconds) on the last rank.
``--log-throughput``, ``--log-memory``, ``--log-cpu`` and ``--log-moe-timing`` add tokens/s, peak memory, the step's
CPU seconds and forward dispatch/combine ms per MoE layer to each log line (:mod:`uccl_moe.train.step_stats`);
``--profile`` records a torch.profiler trace of a few steps (:mod:`uccl_moe.train.profiler`).
``--log-dir DIR`` copies each rank's output into ``DIR/rank<N>.log`` and writes the closing summary (steps, loss
first -> last, tokens/s, wall time, versions, devices) to ``DIR/summary.json`` (:mod:`uccl_moe.train.run_log`).

This module is the loop (synthetic data, learning rate, steps, logging); :mod:`uccl_moe.train.build` makes the process
groups, config, model and optimizer it runs.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import logging
import math
import os
import sys
import time
import warnings
from collections.abc import Iterator, Sequence
from functools import partial
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from ..errors import InvalidUsageError
from . import run_log

# Without CUDA (a CPU run, as `uccl-moe train` makes on a CPU platform): Megatron-Core warns once per module and rank,
# as it is imported (below), that TransformerEngine and Apex are absent, which on a CPU they always are; and its CUDA
# RNG tracker, which on a CPU forks nothing, logs "CPU RNG state changed within GPU RNG context" for every expert
# layer's forward. Both are silenced here (a caller's own PYTHONWARNINGS keeps the first).
if not torch.cuda.is_available():
    if "PYTHONWARNINGS" not in os.environ:
        for _absent in run_log.CPU_ABSENT_WARNINGS:
            warnings.filterwarnings("ignore", message=_absent, category=UserWarning)
    logging.getLogger("megatron.core.tensor_parallel.random").setLevel(logging.ERROR)

from .args import build_parser  # noqa: E402  (imports Megatron-Core: after the filters above)
from .build import TrainSetup, build_model, build_optimizer, setup  # noqa: E402
from .profiler import StepProfiler
from .step_stats import process_cpu_s

__all__ = ["TrainSetup", "build_model", "build_optimizer", "build_parser", "lr_at", "main", "setup",
           "synthetic_batches", "train"]


def synthetic_batches(ts: TrainSetup) -> Iterator[dict[str, torch.Tensor]]:
    """Micro-batches of the counting task: tokens[i] = (start + i) % vocab; labels are the next tokens.

    Every data-parallel rank draws its own samples; ranks of one model replica (TP/PP/EP inside it) see the same.
    """
    from megatron.core import parallel_state

    a = ts.args
    gen = torch.Generator().manual_seed(a.seed * 1000 + parallel_state.get_data_parallel_rank())
    pos = torch.arange(a.seq_length + 1)
    # Causal mask as Megatron's data loaders build it: True = masked out. [1, 1, S, S]
    mask = torch.triu(torch.ones(a.seq_length, a.seq_length, dtype=torch.bool), diagonal=1)[None, None].to(ts.device)
    while True:
        start = torch.randint(0, a.vocab_size, (a.micro_batch_size, 1), generator=gen)
        seq = (start + pos) % a.vocab_size
        yield {
            "tokens": seq[:, :-1].contiguous().to(ts.device),
            "labels": seq[:, 1:].contiguous().to(ts.device),
            "position_ids": pos[:-1].unsqueeze(0).expand(a.micro_batch_size, -1).contiguous().to(ts.device),
            "loss_mask": torch.ones(a.micro_batch_size, a.seq_length, device=ts.device),
            "attention_mask": mask,
        }


def lr_at(args: argparse.Namespace, iteration: int) -> float:
    """Learning rate of `iteration` (1-based): linear warmup over --lr-warmup-iters, then --lr-decay-style from --lr
    to --min-lr over the remaining iterations (Megatron's shapes)."""
    warmup = args.lr_warmup_iters
    if warmup > 0 and iteration <= warmup:
        return args.lr * iteration / warmup
    if args.lr_decay_style == "constant":
        return float(args.lr)
    span = max(1, args.train_iters - warmup)
    frac = min(1.0, max(0.0, (iteration - warmup) / span))
    coeff = 1.0 - frac if args.lr_decay_style == "linear" else 0.5 * (math.cos(math.pi * frac) + 1.0)
    return float(args.min_lr + coeff * (args.lr - args.min_lr))


def _set_lr(optimizer: Any, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def _loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask) / mask.sum()
    # A copy: Megatron's forward_step_calc_loss (pipeline_parallel/schedules.py) divides the returned loss in place
    # by the number of micro-batches, which a detached view would show in the log.
    return loss, {"lm loss": loss.detach().clone()}


@functools.cache
def _takes_loss_mask(build_schedule_plan: Any) -> bool:
    """Whether this Megatron's GPTModel.build_schedule_plan takes loss_mask (read once, not per micro-batch)."""
    return "loss_mask" in inspect.signature(build_schedule_plan).parameters


def _forward_step(data_iterator: Iterator[dict[str, torch.Tensor]], model: Any,
                  return_schedule_plan: bool = False) -> tuple[Any, Any]:
    batch = next(data_iterator)
    if return_schedule_plan:  # --overlap-moe-expert-parallel-comm: Megatron's combined 1F1B runs the model's plan
        build = model.build_schedule_plan
        kw = {"loss_mask": batch["loss_mask"]} if _takes_loss_mask(getattr(build, "__func__", build)) else {}
        plan = model.build_schedule_plan(batch["tokens"], batch["position_ids"], batch["attention_mask"],
                                         labels=batch["labels"], **kw)
        return plan, partial(_loss_func, batch["loss_mask"])
    out = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])
    return out, partial(_loss_func, batch["loss_mask"])


def cpu_forward_backward(*, forward_step_func: Any, data_iterator: Any, model: list[Any], num_microbatches: int,
                         seq_length: int, micro_batch_size: int, forward_only: bool = False) -> list[dict[str, Any]]:
    """Megatron's no-pipelining schedule for CPU runs (megatron-core's own allocates its token counter on 'cuda').

    Same steps: the MoE aux-loss scale is 1/num_microbatches, every micro-batch's loss is divided by
    num_microbatches before backward, gradient sync is deferred to ``config.finalize_model_grads_func``.
    """
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.router import MoEAuxLossAutoScaler

    del seq_length, micro_batch_size
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        raise InvalidUsageError("pipeline parallelism needs CUDA here (Megatron's p2p schedules); use PP=1 on CPU")
    (chunk,) = model
    config = chunk.config
    reduced: list[dict[str, Any]] = []
    with chunk.no_sync():
        for _ in range(num_microbatches):
            if config.num_moe_experts:
                MoEAuxLossAutoScaler.set_loss_scale(torch.ones(1) / num_microbatches)
            output, loss_func = forward_step_func(data_iterator, chunk)
            loss, stats = loss_func(output)
            reduced.append(stats)
            if not forward_only:
                (loss / num_microbatches).backward()
    if not forward_only and config.finalize_model_grads_func is not None:
        config.finalize_model_grads_func([chunk])
    return reduced


def train(argv: Sequence[str]) -> list[dict[str, float]]:
    """Run the training loop; returns the per-step log (loss on the last pipeline stage, NaN elsewhere)."""
    from megatron.core import parallel_state
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    t_start = time.monotonic()
    ts = setup(argv)
    rank = dist.get_rank()
    model, optimizer = _build(ts, rank)
    config = ts.config
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    config.no_sync_func = model.no_sync
    forward_backward = get_forward_backward_func() if ts.device.type == "cuda" else cpu_forward_backward
    data = synthetic_batches(ts)
    log_rows: list[dict[str, float]] = []
    is_last = parallel_state.is_pipeline_last_stage()
    moe_timer = None
    if ts.args.log_moe_timing:
        from .step_stats import MoeTimer

        moe_timer = MoeTimer(model, ts.device)
    if rank == 0:
        _print_start(ts, model)
    profiler = StepProfiler(ts.args, rank, ts.device)
    for it in range(1, ts.args.train_iters + 1):
        profiler.step()  # before the timers: a trace export at the end of the window is not in any step's time
        row, extra = _train_step(ts, model, optimizer, forward_backward, data, it, is_last, moe_timer)
        log_rows.append(row)
        _log_step(ts, row, extra, is_last)
        loss = row["loss"]
        if not math.isfinite(loss) and is_last:
            raise FloatingPointError(f"loss is {loss} at iteration {it}")
    profiler.close()
    _report(ts, log_rows, t_start, is_last)
    return log_rows


def _build(ts: TrainSetup, rank: int) -> tuple[Any, Any]:
    """The model and its optimizer, with progress lines (the first step is the slowest)."""
    c = ts.config
    moe = f", {c.num_moe_experts} experts top-{c.moe_router_topk}" if c.num_moe_experts else ""
    run_log.progress(f"building the model: {c.num_layers} layers, hidden {c.hidden_size}{moe}, on {ts.device} "
                     f"({dist.get_world_size()} ranks)", rank)
    model = build_model(ts)
    optimizer = build_optimizer(ts, model)
    num_params = sum(p.numel() for p in model.parameters())
    run_log.progress(f"model built ({num_params / 1e6:.2f}M parameters on rank 0); step 1 of "
                     f"{ts.args.train_iters} (the first is the slowest: it builds kernels and buffers)...", rank)
    return model, optimizer


def _print_start(ts: TrainSetup, model: Any) -> None:
    """Rank 0's line naming the layout, the dispatcher and how many MoE layers use uccl's."""
    from ..megatron.dispatcher import UCCLTokenDispatcher

    n = sum(isinstance(getattr(m, "token_dispatcher", None), UCCLTokenDispatcher) for m in model.modules())
    print(f"[train_gpt] world {dist.get_world_size()} DP {ts.dp_size} micro-batches/step {ts.num_microbatches} "
          f"dispatcher {ts.config.moe_token_dispatcher_type} (uccl MoE layers on rank 0: {n}) device {ts.device}",
          flush=True)


def _train_step(ts: TrainSetup, model: Any, optimizer: Any, forward_backward: Any, data: Any, it: int,
                is_last: bool, moe_timer: Any) -> tuple[dict[str, float], str]:
    """Step `it`: forward, backward and the optimizer update. Returns its log row and its log line's extra fields."""
    from megatron.core import parallel_state

    t0 = time.perf_counter()
    cpu0 = process_cpu_s() if ts.args.log_cpu else 0.0
    model.train()
    model.zero_grad_buffer()
    optimizer.zero_grad()
    lr = lr_at(ts.args, it)
    _set_lr(optimizer, lr)
    losses = forward_backward(
        forward_step_func=_forward_step, data_iterator=data, model=[model],
        num_microbatches=ts.num_microbatches, seq_length=ts.args.seq_length,
        micro_batch_size=ts.args.micro_batch_size, forward_only=False,
    )
    update_ok, grad_norm, _ = optimizer.step()
    loss = float("nan")
    if is_last and losses:
        loss_t = torch.stack([x["lm loss"] for x in losses]).mean()
        dist.all_reduce(loss_t, group=parallel_state.get_data_parallel_group())
        loss = float(loss_t) / ts.dp_size
    dt = time.perf_counter() - t0
    cpu_s = process_cpu_s() - cpu0 if ts.args.log_cpu else None
    tokens = ts.args.micro_batch_size * ts.num_microbatches * ts.dp_size * ts.args.seq_length
    row = {"iteration": it, "loss": loss, "lr": lr, "tokens_per_s": tokens / dt,
           "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
           "seconds": dt, "update_ok": bool(update_ok)}
    return row, _step_stats(ts, row, cpu_s, moe_timer)


def _step_stats(ts: TrainSetup, row: dict[str, float], cpu_s: float | None, moe_timer: Any) -> str:
    """Adds the --log-* statistics to `row`; returns them as the log line's extra fields."""
    extra = f" | {row['tokens_per_s']:.0f} tokens/s" if ts.args.log_throughput else ""
    if cpu_s is not None:
        row["cpu_s"] = cpu_s
        extra += f" | cpu {cpu_s:.3f} s"
    if ts.args.log_memory:
        from .step_stats import peak_memory_mib

        row["peak_mem_mib"] = peak_memory_mib(ts.device)
        extra += f" | peak mem {row['peak_mem_mib']:.1f} MiB"
    if moe_timer is not None:
        from .step_stats import format_ms_list

        moe_ms = moe_timer.collect()
        row.update(dispatch_ms=moe_ms["dispatch"], combine_ms=moe_ms["combine"])
        extra += (f" | dispatch ms/layer {format_ms_list(moe_ms['dispatch'])}"
                  f" | combine ms/layer {format_ms_list(moe_ms['combine'])}")
    return extra


def _log_step(ts: TrainSetup, row: dict[str, float], extra: str, is_last: bool) -> None:
    """The step's log line (every --log-interval steps) and --loss-log row, from the first rank of the last stage."""
    from megatron.core import parallel_state

    it = int(row["iteration"])
    first_of_stage = (
        parallel_state.get_data_parallel_rank() == 0 and parallel_state.get_tensor_model_parallel_rank() == 0
    )
    if is_last and first_of_stage:
        if it % ts.args.log_interval == 0:
            print(f"[train_gpt] iteration {it}/{ts.args.train_iters} | lm loss {row['loss']:.5f} | "
                  f"lr {row['lr']:.3g} | grad norm {row['grad_norm']:.4f} | {row['seconds'] * 1000:.1f} ms{extra}",
                  flush=True)
        if ts.args.loss_log and parallel_state.get_expert_model_parallel_rank() == 0:
            with open(ts.args.loss_log, "a") as f:
                f.write(json.dumps(row) + "\n")


def _report(ts: TrainSetup, log_rows: list[dict[str, float]], t_start: float, is_last: bool) -> None:
    """The closing summary, printed (and written to --log-dir) by one rank of the last stage."""
    from megatron.core import parallel_state

    reporter = (is_last and parallel_state.get_data_parallel_rank() == 0
                and parallel_state.get_tensor_model_parallel_rank() == 0
                and parallel_state.get_expert_model_parallel_rank() == 0)
    if reporter:
        summary = run_log.run_summary(log_rows, time.monotonic() - t_start, dist.get_world_size(), ts.device.type)
        print(run_log.format_summary(summary), flush=True)
        if ts.args.log_dir:
            run_log.write_summary(Path(ts.args.log_dir), summary)


def _log_dir_of(argv: Sequence[str]) -> Optional[str]:
    """``--log-dir``'s value, read before the parser is built, so the rank log holds everything from setup on."""
    for i, a in enumerate(argv):
        if a == "--log-dir" and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith("--log-dir="):
            return a.split("=", 1)[1]
    return None


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    rank = int(os.environ.get("RANK", "0"))
    log_dir = _log_dir_of(argv)
    if log_dir:
        run_log.tee_to_file(Path(log_dir), rank)
    run_log.progress(f"rank 0 of {os.environ.get('WORLD_SIZE', '1')}: setting up process groups and the "
                     "TransformerConfig...", rank)
    # megatron-core 0.16 deprecates its own default cuda_graph_scope and warns on every TransformerConfig
    warnings.filterwarnings("ignore", message="full scope is deprecated", category=UserWarning)
    train(argv)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
