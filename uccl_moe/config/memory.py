"""Parameter counts and per-GPU memory for weights, gradients and optimizer state of a composed config.

Counts follow Megatron-Core's module structure (bias-free linears, RMSNorm weights, SwiGLU as one fused fc1 of
width 2*ffn, MLA's down/up projections, MTP layers sharing the embedding). Activations are not included: the
estimate answers "do the parameters and the Adam state fit", which is what rules a layout in or out.

Bytes per parameter (mixed precision, Megatron defaults): bf16 weight 2 + fp32 main grad 4 + Adam state 12
(fp32 master copy, exp_avg, exp_avg_sq); fp32 runs: 4 + 4 + 8. With the distributed optimizer the Adam state
is sharded over the data-parallel group of each parameter (dense: DP x CP, experts: expert DP).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from ..errors import InvalidUsageError
from . import schema

GB = 1e9


def parse_moe_layer_freq(expr: str | int, num_layers: int) -> list[int]:
    """Megatron's ``--moe-layer-freq``: an int N (layer i is MoE when i % N == 0) or a python list expression
    of 0/1 such as ``([0]*3+[1]*58)``. Returns one 0/1 per layer.

    Raises InvalidUsageError for anything else (the expression is evaluated without builtins and may contain only
    brackets, digits, ``*``, ``+`` and commas).
    """
    text = str(expr).strip()
    if re.fullmatch(r"[0-9]+", text):
        n = int(text)
        if n < 1:
            raise InvalidUsageError(f"model.moe_layer_freq={text} must be >= 1")
        return [1 if i % n == 0 else 0 for i in range(num_layers)]
    if not re.fullmatch(r"[\[\]()0-9*+, ]+", text):
        raise InvalidUsageError(
            f"model.moe_layer_freq={text!r} is neither an int nor a list expression like ([0]*3+[1]*58)"
        )
    if any(int(n) > 100_000 for n in re.findall(r"[0-9]+", text)):
        raise InvalidUsageError(f"model.moe_layer_freq={text!r}: numbers above 100000 are not layer counts")
    try:
        value = eval(text, {"__builtins__": {}}, {})  # charset and magnitudes checked above
    except (SyntaxError, TypeError, ValueError) as e:
        raise InvalidUsageError(f"model.moe_layer_freq={text!r} does not evaluate: {e}") from None
    if not isinstance(value, (list, tuple)) or any(v not in (0, 1) for v in value):
        raise InvalidUsageError(f"model.moe_layer_freq={text!r} must give a list of 0/1 per layer")
    return [int(v) for v in value]


def moe_layer_flags(m: Any) -> list[int]:
    """One 0/1 per decoder layer of model config `m`: 1 where the layer is MoE (all 0 for a dense model)."""
    return parse_moe_layer_freq(m.moe_layer_freq, m.num_layers) if m.num_experts else [0] * m.num_layers


def fmt_params(n: float) -> str:
    """1.23e9 -> '1.23B', 4.5e6 -> '4.50M', 812 -> '812'."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:.0f}"


@dataclass
class ParamCount:
    """Parameters of one model replica by part (counts, not bytes)."""

    embedding: int
    output_layer: int
    attention: int  # per layer
    dense_mlp: int  # per dense layer
    moe_router: int  # per MoE layer
    moe_experts: int  # per MoE layer, all routed experts
    moe_shared: int  # per MoE layer
    layer_norms: int  # per layer
    final_norm: int
    mtp_per_layer: int
    num_dense_layers: int
    num_moe_layers: int
    num_mtp_layers: int

    @property
    def dense_layer(self) -> int:
        return self.attention + self.dense_mlp + self.layer_norms

    @property
    def moe_layer(self) -> int:
        return self.attention + self.moe_router + self.moe_experts + self.moe_shared + self.layer_norms

    @property
    def total(self) -> int:
        return (
            self.embedding
            + self.output_layer
            + self.num_dense_layers * self.dense_layer
            + self.num_moe_layers * self.moe_layer
            + self.final_norm
            + self.num_mtp_layers * self.mtp_per_layer
        )


def padded_vocab(vocab: int, divisible_by: int | None, tp: int) -> int:
    """Megatron's vocabulary padding: up to a multiple of make_vocab_size_divisible_by (default 128) x TP."""
    multiple = (divisible_by or 128) * tp
    return int(math.ceil(vocab / multiple) * multiple)


def _attention_params(m: Any) -> int:
    h = m.hidden_size
    heads = m.num_attention_heads
    if m.multi_latent_attention:
        qk = m.qk_head_dim + m.qk_pos_emb_head_dim
        if m.q_lora_rank:
            q = h * m.q_lora_rank + (m.q_lora_rank if m.qk_layernorm else 0) + m.q_lora_rank * heads * qk
        else:
            q = h * heads * qk
        kv = h * (m.kv_lora_rank + m.qk_pos_emb_head_dim) + m.kv_lora_rank
        kv += m.kv_lora_rank * heads * (m.qk_head_dim + m.v_head_dim)
        out = heads * m.v_head_dim * h
        return int(q + kv + out)
    kv_ch = m.kv_channels or h // heads
    groups = m.num_query_groups if (m.group_query_attention and m.num_query_groups) else heads
    qkv = h * (heads * kv_ch + 2 * groups * kv_ch)
    norms = 2 * kv_ch if m.qk_layernorm else 0
    return int(qkv + norms + heads * kv_ch * h)


def _mlp_params(h: int, ffn: int, swiglu: bool) -> int:
    return h * ffn * (2 if swiglu else 1) + ffn * h


def count_parameters(m: Any, tp: int = 1) -> ParamCount:
    """Count the parameters of model config `m` (a ``ModelConfig`` or its DictConfig)."""
    h = m.hidden_size
    freq = moe_layer_flags(m)
    num_moe = sum(freq)
    vocab = padded_vocab(m.vocab_size or 0, m.make_vocab_size_divisible_by, tp)
    attention = _attention_params(m)
    experts = shared = router = 0
    if m.num_experts:
        experts = m.num_experts * _mlp_params(h, m.moe_ffn_hidden_size or m.ffn_hidden_size, m.swiglu)
        if m.moe_shared_expert_intermediate_size:
            shared = _mlp_params(h, m.moe_shared_expert_intermediate_size, m.swiglu)
        router = h * m.num_experts
    norms = 2 * h
    mtp_layers = m.mtp_num_layers or 0
    mtp_block = (attention + norms + ((router + experts + shared) if num_moe else _mlp_params(h, m.ffn_hidden_size,
                                                                                             m.swiglu)))
    mtp_per_layer = 2 * h + 2 * h * h + mtp_block + h  # enorm, hnorm, eh_proj, block, final norm
    return ParamCount(
        embedding=vocab * h,
        output_layer=vocab * h if m.untie_embeddings_and_output_weights else 0,
        attention=attention,
        dense_mlp=_mlp_params(h, m.ffn_hidden_size, m.swiglu),
        moe_router=router,
        moe_experts=experts,
        moe_shared=shared,
        layer_norms=norms,
        final_norm=h,
        mtp_per_layer=mtp_per_layer,
        num_dense_layers=m.num_layers - num_moe,
        num_moe_layers=num_moe,
        num_mtp_layers=mtp_layers,
    )


@dataclass
class RankParams:
    """Parameters held by one GPU of one pipeline rank, split by how they are data-parallel."""

    pp_rank: int
    layers: list[int]
    dense: float  # replicated over DP x CP (attention, dense MLP, norms, router, shared expert, embeddings)
    expert: float  # replicated over expert DP (routed experts)

    @property
    def total(self) -> float:
        return self.dense + self.expert


@dataclass
class MemoryEstimate:
    """Memory per GPU for weights + grads + optimizer state (the heaviest pipeline rank); no activations."""

    total_params: int
    params_per_gpu: float
    weights_gb: float
    grads_gb: float
    optimizer_gb: float
    gpu_memory_gb: float
    pp_rank: int
    ranks: list[RankParams] = field(default_factory=list)
    #: "GPU", or "CPU rank" on a CPU platform, where platform.gpu_memory_gb is a host memory budget per process
    per: str = "GPU"

    @property
    def total_gb(self) -> float:
        return self.weights_gb + self.grads_gb + self.optimizer_gb

    @property
    def fits(self) -> bool:
        return self.total_gb <= self.gpu_memory_gb

    @property
    def capacity(self) -> str:
        """platform.gpu_memory_gb as what it is on this platform: a GPU's memory, or a CPU rank's host budget."""
        gb = f"{self.gpu_memory_gb:g} GB"
        return gb if self.per == "GPU" else f"{gb} host memory budget per rank (platform.gpu_memory_gb)"

    def summary(self) -> str:
        return (
            f"model {fmt_params(self.total_params)} params; per {self.per} (pipeline rank {self.pp_rank}, the "
            f"heaviest): {fmt_params(self.params_per_gpu)} params -> weights {self.weights_gb:.1f} GB + grads "
            f"{self.grads_gb:.1f} GB + optimizer {self.optimizer_gb:.1f} GB = {self.total_gb:.1f} GB of "
            f"{'' if self.per == 'GPU' else 'the '}{self.capacity} (activations not included)"
        )


def estimate_memory(cfg: Any, assignment: list[list[int]], world_size: int) -> MemoryEstimate:
    """Estimate per-GPU memory for `cfg` given the layers of each pipeline rank (`assignment[r]` = layer indices
    held by PP rank r, in any order; from :func:`uccl_moe.config.pipeline.pipeline_assignment`)."""
    m, p = cfg.model, cfg.parallel
    tp, pp, cp, ep = (p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.context_parallel_size,
                      p.expert_model_parallel_size)
    etp = p.expert_tensor_parallel_size or tp
    counts = count_parameters(m, tp)
    freq = moe_layer_flags(m)
    ranks: list[RankParams] = []
    for r, layers in enumerate(assignment):
        dense = 0.0
        expert = 0.0
        for i in layers:
            dense += counts.attention / tp + counts.layer_norms
            if freq[i]:
                dense += counts.moe_router + counts.moe_shared / tp
                expert += counts.moe_experts / (ep * etp)
            else:
                dense += counts.dense_mlp / tp
        if r == 0:
            dense += counts.embedding / tp
        if r == pp - 1:
            dense += counts.output_layer / tp + counts.final_norm
            if counts.num_mtp_layers:
                per = counts.mtp_per_layer - (counts.moe_experts if counts.num_moe_layers else 0)
                dense += counts.num_mtp_layers * per / tp
                if counts.num_moe_layers:
                    expert += counts.num_mtp_layers * counts.moe_experts / (ep * etp)
        ranks.append(RankParams(r, sorted(layers), dense, expert))
    heaviest = max(ranks, key=lambda x: x.total)
    dp_dense = max(1, world_size // (tp * pp * cp)) * cp
    dp_expert = max(1, world_size // (etp * ep * pp))
    weight_b = 2 if cfg.platform.bf16 else 4
    grad_b = 4
    opt_b = 12 if cfg.platform.bf16 else 8
    if p.use_distributed_optimizer:
        opt = heaviest.dense * opt_b / dp_dense + heaviest.expert * opt_b / dp_expert
    else:
        opt = heaviest.total * opt_b
    return MemoryEstimate(
        total_params=counts.total,
        params_per_gpu=heaviest.total,
        weights_gb=heaviest.total * weight_b / GB,
        grads_gb=heaviest.total * grad_b / GB,
        optimizer_gb=opt / GB,
        gpu_memory_gb=float(cfg.platform.gpu_memory_gb),
        pp_rank=heaviest.pp_rank,
        ranks=ranks,
        per="CPU rank" if cfg.platform.accelerator == schema.Accelerator.cpu else "GPU",
    )
