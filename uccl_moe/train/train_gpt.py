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

Flags use Megatron's names. Every ``TransformerConfig`` field is a flag (``--moe-router-topk 2``,
``--expert-model-parallel-size 4``, ``--moe-shared-expert-overlap``, ``--no-<field>`` for a field that defaults to
True), plus Megatron's aliases listed in ``_ALIASES`` (``--num-experts``, ``--swiglu``, ``--disable-bias-linear``, ...),
the training flags of :func:`build_parser`, and the ``--moe-uccl-*`` knobs. Unknown flags are an error.
``--loss-log FILE`` writes one JSON line per step (iteration, loss, grad norm, seconds) on the last rank.
``--log-throughput``, ``--log-memory``, ``--log-cpu`` and ``--log-moe-timing`` add tokens/s, peak memory, the step's
CPU seconds and forward dispatch/combine ms per MoE layer to each log line (:mod:`uccl_moe.train.step_stats`);
``--profile`` records a torch.profiler trace of a few steps (:mod:`uccl_moe.train.profiler`).
``--log-dir DIR`` copies each rank's output into ``DIR/rank<N>.log`` and writes the closing summary (steps, loss
first -> last, tokens/s, wall time, versions, devices) to ``DIR/summary.json`` (:mod:`uccl_moe.train.run_log`).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import inspect
import json
import math
import os
import sys
import time
import typing
import warnings
from collections.abc import Iterator, Sequence
from functools import partial
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from ..errors import InvalidUsageError
from ..megatron import knobs as _knobs
from ..megatron.install import install as _install_uccl
from ..megatron.install import widen_parser
from . import run_log
from .profiler import PROFILE_FLAGS, StepProfiler, check_profile_args
from .step_stats import process_cpu_s

# Megatron-LM flag spellings that are not a TransformerConfig field name: flag -> (dest, value or None = parsed).
_ALIASES: dict[str, tuple[str, Any]] = {
    "--num-experts": ("num_moe_experts", None),
    "--swiglu": ("swiglu", True),
    "--disable-bias-linear": ("add_bias_linear", False),
    "--norm-epsilon": ("layernorm_epsilon", float),
    "--no-bias-linear": ("add_bias_linear", False),
    "--squared-relu": ("squared_relu", True),
}

# Training flags of this entry (argparse kwargs). Accepted-but-ignored Megatron flags are listed in _IGNORED.
_TRAIN_FLAGS: dict[str, dict[str, Any]] = {
    "--micro-batch-size": dict(type=int, default=2),
    "--global-batch-size": dict(type=int, default=None, help="default: micro batch x data-parallel size"),
    "--seq-length": dict(type=int, default=64),
    "--max-position-embeddings": dict(type=int, default=None, help="default: --seq-length"),
    "--vocab-size": dict(type=int, default=128),
    "--train-iters": dict(type=int, default=10),
    "--lr": dict(type=float, default=1e-3),
    "--min-lr": dict(type=float, default=0.0),
    "--lr-decay-style": dict(choices=["constant", "linear", "cosine"], default="constant"),
    "--lr-warmup-iters": dict(type=int, default=0),
    "--rotary-base": dict(type=int, default=10000),
    "--distributed-timeout-minutes": dict(type=int, default=10),
    "--log-throughput": dict(action="store_true", help="add tokens/s to each log line"),
    "--weight-decay": dict(type=float, default=0.01),
    "--clip-grad": dict(type=float, default=1.0),
    "--adam-beta1": dict(type=float, default=0.9),
    "--adam-beta2": dict(type=float, default=0.999),
    "--adam-eps": dict(type=float, default=1e-8),
    "--seed": dict(type=int, default=1234),
    "--log-interval": dict(type=int, default=1),
    "--position-embedding-type": dict(choices=["learned_absolute", "rope"], default="learned_absolute"),
    "--transformer-impl": dict(choices=["local", "transformer_engine"], default=None,
                               help="default: transformer_engine when TE is importable and CUDA is present"),
    "--untie-embeddings-and-output-weights": dict(action="store_true"),
    "--use-distributed-optimizer": dict(action="store_true"),
    "--loss-log": dict(type=str, default=None, help="append one JSON line per step here (last rank)"),
    "--log-memory": dict(action="store_true", help="add this rank's peak memory (MiB) to each log line"),
    "--log-cpu": dict(action="store_true",
                      help="add the CPU seconds (user+sys, all threads) this rank's process spent in the step"),
    "--log-moe-timing": dict(action="store_true",
                             help="add forward dispatch/combine ms per MoE layer to each log line (step_stats)"),
    "--log-dir": dict(type=str, default=None,
                      help="copy each rank's output to DIR/rank<N>.log; write the run summary to DIR/summary.json"),
}
# Accepted for compatibility with Megatron-LM command lines and ignored: the data is synthetic, the backend follows
# the device (NCCL on GPUs, gloo on CPU), and there is no evaluation loop.
_IGNORED = ("--mock-data", "--tokenizer-type", "--no-load-optim", "--no-load-rng", "--distributed-backend",
            "--eval-iters", "--eval-interval")
_IGNORED_WITH_VALUE = ("--tokenizer-type", "--distributed-backend", "--eval-iters", "--eval-interval")


def _field_kwargs(field: dataclasses.Field[Any]) -> Optional[dict[str, Any]]:
    """argparse kwargs for a TransformerConfig field, or None if the field is not CLI-representable."""
    tp = field.type
    if isinstance(tp, str):  # postponed annotations are not used by megatron-core, but be safe
        return None
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if field.name == "moe_layer_freq":  # Union[int, List[int]]: an int or Megatron's list expression
        return {"type": _parse_layer_freq}
    if origin is typing.Union:  # Optional[X], or Union[X, List[X]] (the scalar form is taken from the CLI)
        rest = [a for a in args if a is not type(None)]
        scalars = [a for a in rest if a in (int, float, str, bool) or typing.get_origin(a) is typing.Literal]
        if not scalars:
            return None
        tp = scalars[0]
        origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Literal:
        return {"choices": list(args), "type": type(args[0])}
    if tp is bool:
        return {"bool": True}
    if tp in (int, float, str):
        return {"type": tp}
    return None


def build_parser() -> argparse.ArgumentParser:
    """The parser of this entry: TransformerConfig fields, Megatron aliases, training flags and uccl knobs."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    p = argparse.ArgumentParser(prog="python -m uccl_moe.train.train_gpt", allow_abbrev=False,
                                description=__doc__.split("\n\n")[0] if __doc__ else None)
    train = p.add_argument_group("training (uccl_moe.train.train_gpt)")
    for flag, kw in _TRAIN_FLAGS.items():
        train.add_argument(flag, **kw)
    prof = p.add_argument_group("profiling (Megatron-LM's flags; uccl_moe.train.profiler)")
    for flag, kw in PROFILE_FLAGS.items():
        prof.add_argument(flag, **kw)
    for flag in _IGNORED:
        if flag in _IGNORED_WITH_VALUE:
            train.add_argument(flag, default=None, help=argparse.SUPPRESS)
        else:
            train.add_argument(flag, action="store_true", help=argparse.SUPPRESS)
    model = p.add_argument_group("model / parallelism (TransformerConfig fields)")
    seen = {a.dest for a in p._actions}
    for field in dataclasses.fields(TransformerConfig):
        if field.name in seen or not field.init:
            continue
        field_kw = _field_kwargs(field)
        if field_kw is None:
            continue
        flag = "--" + field.name.replace("_", "-")
        dest = "cfg__" + field.name
        if field_kw.get("bool"):
            model.add_argument(flag, dest=dest, action="store_const", const=True, default=None)
            model.add_argument("--no-" + field.name.replace("_", "-"), dest=dest, action="store_const", const=False)
        else:
            model.add_argument(flag, dest=dest, default=None, **field_kw)
    for flag, (dest, value) in _ALIASES.items():
        if value is None or value is float:
            model.add_argument(flag, dest="cfg__" + dest, type=int if value is None else float, default=None)
        else:
            model.add_argument(flag, dest="alias__" + dest, action="store_const", const=value, default=None)
    return widen_parser(p, dest="cfg__moe_token_dispatcher_type")


def _parse_layer_freq(text: str) -> Any:
    t = text.strip()
    if t.isdigit():
        return int(t)
    if not all(ch in "0123456789[]()*+, " for ch in t):
        raise argparse.ArgumentTypeError(
            f"--moe-layer-freq {text!r}: give an int or a list expression like ([0]*3+[1]*5)"
        )
    value = eval(t, {"__builtins__": {}}, {})  # noqa: S307 - only digits, brackets, * + , survive the filter above
    if not isinstance(value, list):
        raise argparse.ArgumentTypeError(f"--moe-layer-freq {text!r} is not a list")
    return value


@dataclasses.dataclass
class TrainSetup:
    args: argparse.Namespace
    config: Any
    device: torch.device
    dp_size: int
    num_microbatches: int


def _init_distributed(device_kind: str, timeout_minutes: int = 10) -> None:
    if dist.is_initialized():
        return
    if "RANK" not in os.environ:  # plain `python -m`: one rank
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"})
    if device_kind == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    import datetime

    dist.init_process_group("nccl" if device_kind == "cuda" else "gloo",
                            timeout=datetime.timedelta(minutes=timeout_minutes))


def _te_available() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except Exception:  # noqa: BLE001
        return False
    return True


def setup(argv: Sequence[str]) -> TrainSetup:
    """Parse `argv`, initialise torch.distributed and Megatron's parallel state, and build the TransformerConfig."""
    _install_uccl()
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    args = build_parser().parse_args(list(argv))
    check_profile_args(args)
    if args.train_iters < 1:
        raise InvalidUsageError(f"--train-iters {args.train_iters}: give at least 1 step")
    device_kind = "cuda" if torch.cuda.is_available() else "cpu"
    _init_distributed(device_kind, args.distributed_timeout_minutes)
    cfg: dict[str, Any] = {
        k[len("cfg__"):]: v for k, v in vars(args).items() if k.startswith("cfg__") and v is not None
    }
    for k, v in vars(args).items():
        if k.startswith("alias__") and v is not None:
            cfg[k[len("alias__"):]] = v
    if cfg.pop("swiglu", False):
        cfg["gated_linear_unit"] = True
        cfg["activation_func"] = torch.nn.functional.silu
        cfg.setdefault("bias_activation_fusion", False)
    if cfg.pop("squared_relu", False):
        from megatron.core.activations import squared_relu

        cfg["activation_func"] = squared_relu
    for required in ("num_layers", "hidden_size", "num_attention_heads"):
        if required not in cfg:
            raise InvalidUsageError(f"--{required.replace('_', '-')} is required")
    tp = cfg.get("tensor_model_parallel_size", 1)
    pp = cfg.get("pipeline_model_parallel_size", 1)
    ep = cfg.get("expert_model_parallel_size", 1)
    etp = cfg.get("expert_tensor_parallel_size") or tp
    cfg["expert_tensor_parallel_size"] = etp
    if tp > 1 and "sequence_parallel" not in cfg and cfg.get("num_moe_experts"):
        cfg["sequence_parallel"] = True  # Megatron refuses MoE + TP training without it
    world = dist.get_world_size()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
    )
    dp = parallel_state.get_data_parallel_world_size()
    gbs = args.global_batch_size or args.micro_batch_size * dp
    if gbs % (args.micro_batch_size * dp):
        raise InvalidUsageError(
            f"--global-batch-size {gbs} is not a multiple of --micro-batch-size {args.micro_batch_size} x "
            f"data-parallel size {dp} (world {world} = TP {tp} x PP {pp} x DP {dp})"
        )
    torch.manual_seed(args.seed)
    model_parallel_cuda_manual_seed(args.seed)
    dtype = torch.bfloat16 if cfg.get("bf16") else torch.float16 if cfg.get("fp16") else torch.float32
    cfg.setdefault("params_dtype", dtype)
    cfg.setdefault("pipeline_dtype", dtype)
    if device_kind == "cpu":
        cfg.setdefault("use_cpu_initialization", True)
        cfg.setdefault("gradient_accumulation_fusion", False)
        cfg.setdefault("masked_softmax_fusion", False)
        cfg.setdefault("bias_dropout_fusion", False)
    if cfg.get("num_moe_experts") and cfg.get("moe_router_topk", 2) == 1:
        cfg.setdefault("moe_router_pre_softmax", True)
    config = TransformerConfig(**cfg)
    for spec in _knobs.KNOBS:  # the dispatcher reads these from the config
        if getattr(args, spec.name, None) is not None:
            setattr(config, spec.name, getattr(args, spec.name))
    device = torch.device("cuda", torch.cuda.current_device()) if device_kind == "cuda" else torch.device("cpu")
    return TrainSetup(args, config, device, dp, gbs // (args.micro_batch_size * dp))


def build_model(ts: TrainSetup) -> Any:
    """GPTModel (Megatron-Core) on the decoder block spec, wrapped in Megatron's DistributedDataParallel."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    args, config = ts.args, ts.config
    impl = args.transformer_impl or ("transformer_engine" if _te_available() and ts.device.type == "cuda" else "local")
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=impl == "transformer_engine")
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=args.vocab_size,
        max_sequence_length=args.max_position_embeddings or args.seq_length,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_base=args.rotary_base,
    ).to(ts.device)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=config.bf16 or config.fp16,
        use_distributed_optimizer=args.use_distributed_optimizer,
    )
    return DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)


def build_optimizer(ts: TrainSetup, model: Any) -> Any:
    """Megatron's optimizer (``get_megatron_optimizer``) on GPUs; :class:`CpuAdam` without CUDA (Megatron's
    optimizer classes allocate on 'cuda' unconditionally)."""
    a, c = ts.args, ts.config
    if ts.device.type != "cuda":
        return CpuAdam(model, lr=a.lr, betas=(a.adam_beta1, a.adam_beta2), eps=a.adam_eps,
                       weight_decay=a.weight_decay, clip_grad=a.clip_grad)
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    oc = OptimizerConfig(
        optimizer="adam", lr=a.lr, min_lr=a.min_lr, weight_decay=a.weight_decay, adam_beta1=a.adam_beta1,
        adam_beta2=a.adam_beta2, adam_eps=a.adam_eps, clip_grad=a.clip_grad, bf16=c.bf16, fp16=c.fp16,
        params_dtype=c.params_dtype, use_distributed_optimizer=a.use_distributed_optimizer,
    )
    return get_megatron_optimizer(oc, [model])


class CpuAdam:
    """AdamW over the gradients Megatron's DDP accumulates in ``param.main_grad``, for CPU runs.

    Gradient clipping uses the global norm the way Megatron computes it: tensor-parallel duplicates counted once,
    dense parameters reduced over the model-parallel group and expert parameters over the expert
    tensor x model x pipeline group.
    """

    def __init__(self, model: Any, lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
                 clip_grad: float) -> None:
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self.clip_grad = clip_grad

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.opt.param_groups

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def zero_grad(self) -> None:
        self.opt.zero_grad(set_to_none=True)

    def _grad_norm(self) -> float:
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

        dense = torch.zeros(1, dtype=torch.float64)
        expert = torch.zeros(1, dtype=torch.float64)
        for p in self.params:
            if p.grad is None or not param_is_not_tensor_parallel_duplicate(p):
                continue
            sq = p.grad.detach().double().pow(2).sum()
            if getattr(p, "allreduce", True):
                dense += sq
            else:
                expert += sq
        dist.all_reduce(dense, group=parallel_state.get_model_parallel_group())
        dist.all_reduce(expert, group=parallel_state.get_expert_tensor_model_pipeline_parallel_group())
        return float((dense + expert).sqrt())

    def step(self) -> tuple[bool, float, None]:
        for p in self.params:
            g = getattr(p, "main_grad", None)
            if g is not None:
                p.grad = g.to(p.dtype) if g.dtype != p.dtype else g
        norm = self._grad_norm()
        if not math.isfinite(norm):
            return False, norm, None
        if self.clip_grad > 0 and norm > self.clip_grad:
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(self.clip_grad / (norm + 1e-6))
        self.opt.step()
        return True, norm, None


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
    return loss, {"lm loss": loss.detach()}


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
    c = ts.config
    moe = f", {c.num_moe_experts} experts top-{c.moe_router_topk}" if c.num_moe_experts else ""
    run_log.progress(f"building the model: {c.num_layers} layers, hidden {c.hidden_size}{moe}, on {ts.device} "
                     f"({dist.get_world_size()} ranks)", rank)
    model = build_model(ts)
    optimizer = build_optimizer(ts, model)
    num_params = sum(p.numel() for p in model.parameters())
    run_log.progress(f"model built ({num_params / 1e6:.2f}M parameters on rank 0); step 1 of "
                     f"{ts.args.train_iters} (the first is the slowest: it builds kernels and buffers)...", rank)
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
        from ..megatron.dispatcher import UCCLTokenDispatcher

        n = sum(isinstance(getattr(m, "token_dispatcher", None), UCCLTokenDispatcher) for m in model.modules())
        print(f"[train_gpt] world {dist.get_world_size()} DP {ts.dp_size} micro-batches/step {ts.num_microbatches} "
              f"dispatcher {config.moe_token_dispatcher_type} (uccl MoE layers on rank 0: {n}) device {ts.device}",
              flush=True)
    profiler = StepProfiler(ts.args, rank, ts.device)
    for it in range(1, ts.args.train_iters + 1):
        profiler.step()  # before the timers: a trace export at the end of the window is not in any step's time
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
            row.update(dispatch_ms=moe_ms["dispatch"], combine_ms=moe_ms["combine"])  # type: ignore[dict-item]
            extra += (f" | dispatch ms/layer {format_ms_list(moe_ms['dispatch'])}"
                      f" | combine ms/layer {format_ms_list(moe_ms['combine'])}")
        log_rows.append(row)
        first_of_stage = (
            parallel_state.get_data_parallel_rank() == 0 and parallel_state.get_tensor_model_parallel_rank() == 0
        )
        if is_last and first_of_stage:
            if it % ts.args.log_interval == 0:
                print(f"[train_gpt] iteration {it}/{ts.args.train_iters} | lm loss {loss:.5f} | lr {lr:.3g} | "
                      f"grad norm {row['grad_norm']:.4f} | {dt * 1000:.1f} ms{extra}", flush=True)
            if ts.args.loss_log and parallel_state.get_expert_model_parallel_rank() == 0:
                with open(ts.args.loss_log, "a") as f:
                    f.write(json.dumps(row) + "\n")
        if not math.isfinite(loss) and is_last:
            raise FloatingPointError(f"loss is {loss} at iteration {it}")
    profiler.close()
    reporter = (is_last and parallel_state.get_data_parallel_rank() == 0
                and parallel_state.get_tensor_model_parallel_rank() == 0
                and parallel_state.get_expert_model_parallel_rank() == 0)
    if reporter:
        summary = run_log.run_summary(log_rows, time.monotonic() - t_start, dist.get_world_size(), ts.device.type)
        print(run_log.format_summary(summary), flush=True)
        if ts.args.log_dir:
            run_log.write_summary(Path(ts.args.log_dir), summary)
    return log_rows


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
