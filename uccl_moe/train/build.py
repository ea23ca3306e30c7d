"""What one run of :mod:`uccl_moe.train.train_gpt` builds before its first step: process groups, Megatron's parallel
state and TransformerConfig (:func:`setup`), the GPT-MoE model in Megatron's DDP (:func:`build_model`) and the
optimizer (:func:`build_optimizer`; :class:`CpuAdam` without CUDA)."""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..errors import InvalidUsageError
from ..megatron import knobs as _knobs
from ..megatron.install import install as _install_uccl
from .args import build_parser
from .profiler import check_profile_args


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
    """GPTModel (Megatron-Core) on the decoder block spec, in Megatron's Float16Module for BF16/FP16 training (as
    Megatron-LM's get_model), wrapped in Megatron's DistributedDataParallel."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    args, config = ts.args, ts.config
    impl = args.transformer_impl or ("transformer_engine" if _te_available() and ts.device.type == "cuda" else "local")
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=impl == "transformer_engine")
    model: Any = GPTModel(
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
    if config.bf16 or config.fp16:
        # As Megatron-LM's get_model (megatron/training/training.py) does: Float16Module casts every parameter to the
        # training dtype. GPTModel leaves its learned position embedding and torch norms in float32, and a float32
        # embedding sum would reach the BF16 linear layers; the combined-1F1B schedule plan
        # (--overlap-moe-expert-parallel-comm) calls GPTModel's parts directly, past any wrapper's forward.
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(config, model)
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
