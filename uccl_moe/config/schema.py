# ruff: noqa: UP006, UP035, UP045, RUF009
# (OmegaConf 2.3 structured configs: typing.Optional/Dict/List annotations and field() helpers in defaults)
"""Typed schemas of the Hydra config tree (``configs/``), registered in Hydra's ConfigStore.

The root schema :class:`Config` is the first entry of ``configs/config.yaml``'s defaults list, so every group
file (``model/*.yaml``, ``platform/*.yaml``, ...) and every command-line override is merged into typed nodes:
a misspelt key or a value of the wrong type fails at compose time, and the error names the full key
(``parallel.expert_model_paralel_size``). Choices are ``Enum`` fields because OmegaConf 2.3 rejects ``Literal``.

Naming rule: a field that is a Megatron argument has exactly the argument's name
(``--expert-model-parallel-size`` -> ``expert_model_parallel_size``), so the renderer needs no mapping table:
``--`` + name with ``_`` -> ``-``. Field metadata tells the renderer the exceptions:

* ``arg=False``: not a Megatron argument (names, notes, sizes used by validation, launcher settings);
* ``false_flag="--no-x"``: a boolean whose Megatron default is True; rendered as that flag when False;
* ``env="UCCL_MOE_X"``: rendered into the environment (a knob of ``uccl_moe/env_knobs.def``), not argv;
* ``dest="x"`` (and ``invert=True``): Megatron stores the argument under another name (``--norm-epsilon`` ->
  ``args.layernorm_epsilon``; ``--disable-bias-linear`` -> ``args.add_bias_linear = False``).

``None`` means "leave Megatron's default" and is never rendered.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from omegaconf import MISSING

# ---------------------------------------------------------------------------------------------------------------
# field helpers


def arg(default: Any = MISSING, doc: str = "", **kw: Any) -> Any:
    """A Megatron argument (rendered as ``--name value``). ``ge``/``gt``/``le``/``lt`` bound a number (checked by
    :func:`uccl_moe.config.validate.validate`, rule ``ranges``)."""
    return _field(default, {"arg": True, "doc": doc, **kw})


def flag_off(default: bool, flag: str, doc: str = "") -> Any:
    """A boolean Megatron argument whose Megatron default is True: rendered as `flag` (e.g. --no-rope-fusion) when
    False, omitted when True."""
    return _field(default, {"arg": True, "false_flag": flag, "doc": doc})


def meta(default: Any = MISSING, doc: str = "", **kw: Any) -> Any:
    """Not a Megatron argument: a name, a note, a size used by validation or by a launcher."""
    return _field(default, {"arg": False, "doc": doc, **kw})


def knob(env: str, doc: str = "") -> Any:
    """An uccl-moe env knob (``env_knobs.def``); None leaves it to the platform or the knob's default. A numeric
    knob's range is the knob table's, so the config refuses exactly what the runtime would."""
    from ..env import KNOBS

    row = KNOBS[env.removeprefix("UCCL_MOE_")]
    bounds: dict[str, Any] = {}
    if row.type in ("INT", "FLOAT"):
        parse: Any = (lambda t: int(t, 0)) if row.type == "INT" else float
        if row.min_or_choices:
            bounds["ge"] = parse(row.min_or_choices)
        if row.max:
            bounds["le"] = parse(row.max)
    return _field(None, {"arg": False, "env": env, "doc": doc, **bounds})


RANGE_KEYS = ("ge", "gt", "le", "lt")
"""Field metadata bounding a number: ``ge=1`` means the value must be >= 1 (None values are not checked)."""


def _field(default: Any, metadata: dict[str, Any]) -> Any:
    if isinstance(default, (list, dict)):
        value = default
        return field(default_factory=lambda: type(value)(value), metadata=metadata)
    return field(default=default, metadata=metadata)


# ---------------------------------------------------------------------------------------------------------------
# enums (names are the values Megatron accepts)


class RouterScoreFunction(enum.Enum):
    softmax = "softmax"
    sigmoid = "sigmoid"


class LoadBalancingType(enum.Enum):
    aux_loss = "aux_loss"
    seq_aux_loss = "seq_aux_loss"
    global_aux_loss = "global_aux_loss"
    sinkhorn = "sinkhorn"
    none = "none"


class RouterDtype(enum.Enum):
    fp32 = "fp32"
    fp64 = "fp64"


class Normalization(enum.Enum):
    LayerNorm = "LayerNorm"
    RMSNorm = "RMSNorm"


class PositionEmbeddingType(enum.Enum):
    learned_absolute = "learned_absolute"
    rope = "rope"
    none = "none"


class DispatcherType(enum.Enum):
    allgather = "allgather"
    alltoall = "alltoall"
    flex = "flex"
    uccl = "uccl"


class FlexBackend(enum.Enum):
    deepep = "deepep"
    hybridep = "hybridep"


class UcclBackend(enum.Enum):
    auto = "auto"
    native = "native"
    reference = "reference"


class RecomputeGranularity(enum.Enum):
    full = "full"
    selective = "selective"


class RecomputeMethod(enum.Enum):
    uniform = "uniform"
    block = "block"


class LrDecayStyle(enum.Enum):
    constant = "constant"
    linear = "linear"
    cosine = "cosine"
    inverse_square_root = "inverse-square-root"
    WSD = "WSD"


class Accelerator(enum.Enum):
    cuda = "cuda"
    rocm = "rocm"
    cpu = "cpu"


class DistributedBackend(enum.Enum):
    nccl = "nccl"
    gloo = "gloo"


class TransformerImpl(enum.Enum):
    local = "local"
    transformer_engine = "transformer_engine"


# ---------------------------------------------------------------------------------------------------------------
# groups


@dataclass
class ModelConfig:
    """``configs/model/*.yaml``: the network shape. Field names are Megatron argument names."""

    name: str = meta(MISSING, "model id, e.g. deepseek_v3")
    description: str = meta("", "one line: what this model is and where its numbers come from")
    derived: bool = meta(False, "True when the shape is our derivation, not a published config (say why in notes)")
    notes: str = meta("", "provenance and caveats")
    primus_model: str = meta("deepseek_v3.yaml", "Primus model preset the experiment YAML extends")

    num_layers: int = arg(MISSING, ge=1)
    hidden_size: int = arg(MISSING, ge=1)
    ffn_hidden_size: int = arg(doc="dense FFN width", ge=1)
    num_attention_heads: int = arg(MISSING, ge=1)
    kv_channels: Optional[int] = arg(None, ge=1)
    num_query_groups: Optional[int] = arg(None, "GQA groups; None = MHA", ge=1)
    group_query_attention: bool = arg(False)
    seq_length: int = arg(MISSING, ge=1)
    max_position_embeddings: int = arg(MISSING, ge=1)

    # MoE
    num_experts: Optional[int] = arg(None, "routed experts; None = dense model", ge=1)
    moe_layer_freq: str = arg("1", "int N (1 MoE layer in N) or a python list expression such as ([0]*3+[1]*58)")
    moe_ffn_hidden_size: Optional[int] = arg(None, ge=1)
    moe_shared_expert_intermediate_size: Optional[int] = arg(None, "shared experts x moe_ffn_hidden_size", ge=1)
    moe_router_topk: int = arg(2, ge=1)
    moe_router_num_groups: Optional[int] = arg(None, "group-limited routing: expert groups", ge=1)
    moe_router_group_topk: Optional[int] = arg(None, "group-limited routing: groups each token may use", ge=1)
    moe_router_topk_scaling_factor: Optional[float] = arg(None, gt=0)
    moe_router_score_function: RouterScoreFunction = arg(RouterScoreFunction.softmax)
    moe_router_enable_expert_bias: bool = arg(False, "aux-loss-free balancing (DeepSeek-V3)")
    moe_router_bias_update_rate: Optional[float] = arg(None, ge=0)
    moe_router_load_balancing_type: LoadBalancingType = arg(LoadBalancingType.aux_loss)
    moe_aux_loss_coeff: Optional[float] = arg(None, ge=0)
    moe_router_pre_softmax: bool = arg(False)
    moe_router_force_load_balancing: bool = arg(False, "benchmarking: route uniformly")
    moe_router_dtype: Optional[RouterDtype] = arg(None, "fp32 needed by uccl and flex (DeepEP-style topk weights);"
                                                  " a model field so dispatcher A/B runs share the numerics")
    moe_grouped_gemm: bool = arg(False, "needs TransformerEngine or Primus-Turbo")
    moe_permute_fusion: bool = arg(False, "needs TransformerEngine >= 2.1")

    # attention
    multi_latent_attention: bool = arg(False)
    q_lora_rank: Optional[int] = arg(None, ge=1)
    kv_lora_rank: Optional[int] = arg(None, ge=1)
    qk_head_dim: Optional[int] = arg(None, ge=1)
    qk_pos_emb_head_dim: Optional[int] = arg(None, ge=0)
    v_head_dim: Optional[int] = arg(None, ge=1)
    qk_layernorm: bool = arg(False)
    position_embedding_type: PositionEmbeddingType = arg(PositionEmbeddingType.rope)
    rotary_base: Optional[int] = arg(None, ge=1)
    rotary_scaling_factor: Optional[float] = arg(None, gt=0)
    mscale: Optional[float] = arg(None, gt=0)
    mscale_all_dim: Optional[float] = arg(None, ge=0)

    # block
    normalization: Normalization = arg(Normalization.RMSNorm)
    norm_epsilon: Optional[float] = arg(None, "stored as args.layernorm_epsilon", dest="layernorm_epsilon", gt=0)
    swiglu: bool = arg(True)
    untie_embeddings_and_output_weights: bool = arg(True)
    disable_bias_linear: bool = arg(True, "stored inverted as args.add_bias_linear", dest="add_bias_linear",
                                    invert=True)
    attention_dropout: float = arg(0.0, ge=0, lt=1)
    hidden_dropout: float = arg(0.0, ge=0, lt=1)
    init_method_std: float = arg(0.02, gt=0)

    # multi-token prediction
    mtp_num_layers: Optional[int] = arg(None, ge=0)
    mtp_loss_scaling_factor: Optional[float] = arg(None, ge=0)

    # vocabulary
    tokenizer_type: str = arg("NullTokenizer")
    tokenizer_model: Optional[str] = arg(None)
    vocab_size: Optional[int] = arg(None, "NullTokenizer vocabulary; DeepSeek-V3 has 129280", ge=1)
    make_vocab_size_divisible_by: Optional[int] = arg(None, ge=1)


@dataclass
class PlatformConfig:
    """``configs/platform/*.yaml``: hardware, network and runtime environment of one kind of node."""

    name: str = meta(MISSING)
    description: str = meta("")
    accelerator: Accelerator = meta(Accelerator.cuda)
    gpus_per_node: int = meta(8, "ranks per node (GPUs; processes on CPU)", ge=1)
    gpu_memory_gb: float = meta(80.0, "memory per GPU in GB (1e9 bytes); host memory budget per rank on CPU", gt=0)
    cpus_per_node: int = meta(0, "cores given to the job per node (sbatch --cpus-per-task); 0 = let Slurm decide", ge=0)
    nic: str = meta("", "NIC model, for the record")
    container_image: Optional[str] = meta(None, "image the Primus / container launchers use")
    env: Dict[str, str] = meta({}, "exported for every run on this platform")
    uccl_env: Dict[str, str] = meta({}, "exported only when dispatcher=uccl (flow control, transport)")

    # Megatron arguments that follow the platform
    distributed_backend: DistributedBackend = arg(DistributedBackend.nccl)
    transformer_impl: TransformerImpl = arg(TransformerImpl.transformer_engine)
    bf16: bool = arg(True)
    gradient_accumulation_fusion: bool = flag_off(True, "--no-gradient-accumulation-fusion", "needs APEX/TE CUDA ext")
    extra_args: List[str] = meta([], "raw Megatron arguments appended for this platform")


@dataclass
class ParallelConfig:
    """``configs/parallel/*.yaml``: the parallel layout and batch sizes."""

    name: str = meta(MISSING)
    tensor_model_parallel_size: int = arg(1, ge=1)
    pipeline_model_parallel_size: int = arg(1, ge=1)
    num_layers_per_virtual_pipeline_stage: Optional[int] = arg(None, "VPP: layers in each virtual stage", ge=1)
    pipeline_model_parallel_layout: Optional[str] = arg(None, "explicit layout, e.g. Et|(tt|)*30,mL")
    decoder_first_pipeline_num_layers: Optional[int] = arg(None, ge=0)
    decoder_last_pipeline_num_layers: Optional[int] = arg(None, ge=0)
    expert_model_parallel_size: int = arg(1, ge=1)
    expert_tensor_parallel_size: Optional[int] = arg(None, "ETP; None = Megatron's default (= TP)", ge=1)
    context_parallel_size: int = arg(1, ge=1)
    sequence_parallel: bool = arg(False)
    micro_batch_size: int = arg(1, ge=1)
    global_batch_size: int = arg(MISSING, ge=1)
    recompute_granularity: Optional[RecomputeGranularity] = arg(None)
    recompute_method: Optional[RecomputeMethod] = arg(None)
    recompute_num_layers: Optional[int] = arg(None, ge=1)
    use_distributed_optimizer: bool = arg(False)
    overlap_grad_reduce: bool = arg(False)
    overlap_param_gather: bool = arg(False)


@dataclass
class DispatcherConfig:
    """``configs/dispatcher/*.yaml``: the MoE token dispatcher and its knobs."""

    name: str = meta(MISSING)
    moe_token_dispatcher_type: DispatcherType = arg(DispatcherType.alltoall)
    moe_flex_dispatcher_backend: Optional[FlexBackend] = arg(None, "flex only")
    moe_enable_deepep: bool = arg(False, "deprecated in megatron-core >= 0.16; forces backend deepep")
    moe_deepep_num_sms: Optional[int] = arg(None, "flex+deepep SMs (megatron-core 0.16-0.18; routed in 0.19)", ge=1)
    moe_shared_expert_overlap: bool = arg(False)
    # uccl-moe dispatcher (arguments added by uccl_moe.megatron.install())
    moe_uccl_num_sms: Optional[int] = arg(None, "SMs the uccl kernels use; None = the Buffer default", ge=1)
    moe_uccl_nvl_bytes: Optional[int] = arg(None, "NVLink buffer bytes; None = sized from the Buffer's hints", ge=0)
    moe_uccl_rdma_bytes: Optional[int] = arg(None, "RDMA buffer bytes; None = sized from the Buffer's hints", ge=0)
    moe_uccl_backend: Optional[UcclBackend] = arg(None, "auto | native | reference; CPU runs use reference")
    # uccl-moe env knobs (env_knobs.def); None = platform.uccl_env or the knob default
    proxy_threads: Optional[int] = knob("UCCL_MOE_PROXY_THREADS", "CPU proxy threads per GPU")
    fifo_capacity: Optional[int] = knob("UCCL_MOE_FIFO_CAPACITY", "slots per GPU->CPU FIFO")
    max_inflight_bytes: Optional[int] = knob("UCCL_MOE_MAX_INFLIGHT_BYTES", "per proxy thread in-flight bytes")
    max_inflight_writes: Optional[int] = knob("UCCL_MOE_MAX_INFLIGHT_WRITES", "per FIFO in-flight writes")
    transport: Optional[str] = knob("UCCL_MOE_TRANSPORT", "auto | ibverbs | efa | loopback")


@dataclass
class TrainConfig:
    """``configs/train/*.yaml``: the training loop, schedule, data and logging."""

    name: str = meta(MISSING)
    entry: str = meta("-m uccl_moe.train.train_gpt", "training entry: '-m module' or a script path")
    train_iters: int = arg(MISSING, ge=1)
    lr: float = arg(1.0e-4, ge=0)
    min_lr: Optional[float] = arg(None, ge=0)
    lr_decay_style: LrDecayStyle = arg(LrDecayStyle.cosine)
    lr_warmup_iters: int = arg(0, ge=0)
    lr_decay_iters: Optional[int] = arg(None, ge=1)
    weight_decay: float = arg(0.1, ge=0)
    clip_grad: float = arg(1.0, ge=0)
    adam_beta1: float = arg(0.9, ge=0, lt=1)
    adam_beta2: float = arg(0.95, ge=0, lt=1)
    seed: int = arg(1234)
    mock_data: bool = arg(True, "synthetic tokens; no dataset needed")
    data_path: Optional[str] = arg(None, "Megatron data prefix (used when mock_data is false)")
    log_interval: int = arg(1, ge=1)
    eval_iters: int = arg(0, ge=0)
    eval_interval: Optional[int] = arg(None, ge=1)
    save: Optional[str] = arg(None)
    load: Optional[str] = arg(None)
    save_interval: Optional[int] = arg(None, ge=1)
    tensorboard_dir: Optional[str] = arg(None)
    log_throughput: bool = arg(False)
    distributed_timeout_minutes: Optional[int] = arg(None, ge=1)
    extra_args: List[str] = meta([], "raw Megatron arguments appended last")


@dataclass
class SlurmConfig:
    """Settings of the rendered sbatch script that are site-specific (partition, account, time)."""

    job_name: str = meta("uccl-moe-${meta.recipe}")
    partition: Optional[str] = meta(None)
    account: Optional[str] = meta(None)
    qos: Optional[str] = meta(None)
    time: str = meta("04:00:00")
    exclusive: bool = meta(True)
    output: str = meta("logs/%x-%j.out")
    master_port: int = meta(29500, ge=1, le=65535)
    python: str = meta("python", "interpreter on the compute nodes ($PYTHON overrides at run time)")
    setup: List[str] = meta([], "shell lines run before srun (module load, conda activate, ...)")
    sbatch_args: List[str] = meta([], "extra '#SBATCH' options, e.g. --constraint=h200")
    preflight: bool = meta(False, "run `uccl-moe doctor --pair` (transport self-test) on every rank before training; "
                                  "a failure ends the job before it spends the allocation (docs/internode.md)")


@dataclass
class PrimusConfig:
    """Settings of the rendered Primus experiment."""

    work_group: str = meta("amd", "rendered as ${PRIMUS_TEAM:<this>}")
    user_name: str = meta("root", "rendered as ${PRIMUS_USER:<this>}")
    exp_name: str = meta("${meta.recipe}", "rendered as ${PRIMUS_EXP_NAME:<this>}")
    workspace: str = meta("./output", "rendered as ${PRIMUS_WORKSPACE:<this>}")
    entry_module: str = meta("uccl_moe.megatron.primus_entry", "module whose file is passed to primus-cli --script")
    primus_cli: str = meta("primus-cli")
    mode: str = meta("slurm", "primus-cli mode: direct | container | slurm")


@dataclass
class MetaConfig:
    """Provenance, filled by the composer: which recipe and overrides produced this config."""

    recipe: str = meta("none")
    description: str = meta("")
    overrides: List[str] = meta([])
    choices: Dict[str, str] = meta({})


@dataclass
class Config:
    """Root of the config tree (``configs/config.yaml``)."""

    model: ModelConfig = MISSING
    platform: PlatformConfig = MISSING
    parallel: ParallelConfig = MISSING
    dispatcher: DispatcherConfig = MISSING
    train: TrainConfig = MISSING
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    primus: PrimusConfig = field(default_factory=PrimusConfig)
    meta: MetaConfig = field(default_factory=MetaConfig)
    nodes: int = _field(1, {"arg": False, "doc": "nodes of the run", "ge": 1})  # `meta` is a field name here


GROUPS: Dict[str, type] = {
    "model": ModelConfig,
    "platform": PlatformConfig,
    "parallel": ParallelConfig,
    "dispatcher": DispatcherConfig,
    "train": TrainConfig,
}
"""The config groups that hold Megatron arguments, by name (the argv order is
:data:`uccl_moe.launch.megatron_args.ARG_GROUPS`)."""


def register() -> None:
    """Store the root schema (``base_config``) in Hydra's ConfigStore; idempotent. Called by the composer."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="base_config", node=Config)

