"""Validation rules of the model and its parallel layout: sizes and schema ranges, model shape, how TP/PP/CP/EP
divide the world, the model and the pipeline, the global batch and recompute (run in this order)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

from omegaconf import OmegaConf

from ..errors import InvalidUsageError
from . import schema
from .memory import parse_moe_layer_freq
from .pipeline import middle_stages, parse_pipeline_layout
from .rules import RuleSet

RULESET = RuleSet()
_rule = RULESET.rule


@_rule("sizes", "parallel sizes, nodes and ranks per node are >= 1")
def _check_sizes(cfg: Any, s: dict[str, Any]) -> list[str]:
    bad = [f"parallel.{k}={v}" for k, v in cfg.parallel.items()
           if k.endswith("_size") and v is not None and isinstance(v, int) and v < 1]
    bad += [f"{k}={v}" for k, v in (("nodes", cfg.nodes), ("platform.gpus_per_node", cfg.platform.gpus_per_node))
            if v < 1]
    for k in ("micro_batch_size", "global_batch_size"):
        if cfg.parallel[k] < 1:
            bad.append(f"parallel.{k}={cfg.parallel[k]}")
    return [f"{', '.join(bad)} must be >= 1"] if bad else []


_SIZES_KEYS = {"nodes", "platform.gpus_per_node", "parallel.micro_batch_size", "parallel.global_batch_size"}
"""Keys whose range the 'sizes' rule reports (with every ``parallel.*_size``); 'ranges' skips them."""

_RANGE_TEXT = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}


def _bounded_fields(cls: type, prefix: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(full key, {"ge": 1, ...})`` of every field of schema `cls` (and of its nested dataclasses) with bounds."""
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        bounds = {k: f.metadata[k] for k in schema.RANGE_KEYS if k in f.metadata}
        if bounds:
            yield key, bounds
        elif isinstance(f.default_factory, type) and dataclasses.is_dataclass(f.default_factory):  # slurm, primus
            yield from _bounded_fields(f.default_factory, key + ".")


def _bounded_keys() -> list[tuple[str, dict[str, Any]]]:
    out = list(_bounded_fields(schema.Config, ""))
    for group, cls in schema.GROUPS.items():
        out += list(_bounded_fields(cls, group + "."))
    return out


def range_problem(key: str, value: Any, bounds: dict[str, Any]) -> str | None:
    """The message for `value` of `key` outside `bounds` ({"ge": 1, "lt": 1.0}), or None when inside."""
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    ok = all({"ge": value >= b, "gt": value > b, "le": value <= b, "lt": value < b}[k] for k, b in bounds.items())
    if ok:
        return None
    rule = " and ".join(f"{_RANGE_TEXT[k]} {b}" for k, b in bounds.items())
    return f"{key}={value} must be {rule}; set {key} to a value {rule}"


@_rule("ranges", "every bounded number of the schema (ge/gt/le/lt field metadata) is in its range")
def _check_ranges(cfg: Any, s: dict[str, Any]) -> list[str]:
    out = []
    for key, bounds in _bounded_keys():
        if key in _SIZES_KEYS or (key.startswith("parallel.") and key.endswith("_size")):
            continue
        msg = range_problem(key, OmegaConf.select(cfg, key), bounds)
        if msg:
            out.append(msg)
    return out


@_rule("hidden_per_head", "without kv_channels, hidden_size is a multiple of num_attention_heads (Megatron's head dim)")
def _check_hidden_per_head(cfg: Any, s: dict[str, Any]) -> list[str]:
    m = cfg.model
    if m.multi_latent_attention or m.kv_channels is not None or m.num_attention_heads < 1:
        return []
    if m.hidden_size % m.num_attention_heads:
        return [(f"model.hidden_size={m.hidden_size} is not divisible by model.num_attention_heads="
                 f"{m.num_attention_heads}; use a multiple of {m.num_attention_heads} or set model.kv_channels")]
    return []


@_rule("lr_schedule", "min_lr <= lr")
def _check_lr(cfg: Any, s: dict[str, Any]) -> list[str]:
    t = cfg.train
    if t.min_lr is not None and t.lr >= 0 and t.min_lr > t.lr:
        return [f"train.min_lr={t.min_lr} is above train.lr={t.lr}; set train.min_lr <= train.lr"]
    return []


@_rule("uccl_hidden_alignment", "dispatcher uccl: a token row (hidden x element bytes) is a multiple of 16 bytes")
def _check_uccl_hidden(cfg: Any, s: dict[str, Any]) -> list[str]:
    # native/src/core/config.cc checks hidden_bytes % 16 == 0 (rows move in 16-byte vectors); fp32 on CPU, else bf16
    if cfg.dispatcher.moe_token_dispatcher_type != schema.DispatcherType.uccl or not cfg.model.num_experts:
        return []
    elem = 2 if cfg.platform.bf16 else 4
    h = cfg.model.hidden_size
    if h >= 1 and (h * elem) % 16:
        step = 16 // elem
        return [(f"model.hidden_size={h} gives {h * elem}-byte token rows ({elem} bytes per element) but the uccl "
                 f"dispatcher moves 16-byte vectors; use a multiple of {step} (e.g. {h + step - h % step})")]
    return []


@_rule("model_parallel_divides_world", "nodes x gpus_per_node is a multiple of TP x PP x CP")
def _check_world_mp(cfg: Any, s: dict[str, Any]) -> list[str]:
    mp = s["mp"]
    if s["world"] % mp:
        return [(f"world size {s['world']} (nodes={cfg.nodes} x platform.gpus_per_node={cfg.platform.gpus_per_node})"
                f" is not a multiple of TP x PP x CP = {s['tp']} x {s['pp']} x {s['cp']} = {mp}; change nodes or "
                f"the layout")]
    return []


@_rule("expert_parallel_divides_world", "nodes x gpus_per_node is a multiple of ETP x EP x PP")
def _check_world_ep(cfg: Any, s: dict[str, Any]) -> list[str]:
    emp = s["emp"]
    if s["world"] % emp:
        return [(f"world size {s['world']} is not a multiple of ETP x EP x PP = {s['etp']} x {s['ep']} x {s['pp']} = "
                f"{emp}; change parallel.expert_model_parallel_size or nodes")]
    return []


@_rule("ep_needs_experts", "EP > 1 only for MoE models")
def _check_ep_needs_experts(cfg: Any, s: dict[str, Any]) -> list[str]:
    if s["ep"] > 1 and not cfg.model.num_experts:
        return [f"parallel.expert_model_parallel_size={s['ep']} but model {cfg.model.name} has no experts"]
    return []


@_rule("experts_divisible_by_ep", "num_experts is a multiple of EP")
def _check_experts_ep(cfg: Any, s: dict[str, Any]) -> list[str]:
    e = cfg.model.num_experts
    if e and e % s["ep"]:
        return [(f"model.num_experts={e} is not divisible by parallel.expert_model_parallel_size={s['ep']}; "
                f"use an EP that divides {e}")]
    return []


@_rule("router_topk", "1 <= moe_router_topk <= num_experts")
def _check_topk(cfg: Any, s: dict[str, Any]) -> list[str]:
    m = cfg.model
    if m.num_experts and not 1 <= m.moe_router_topk <= m.num_experts:
        return [f"model.moe_router_topk={m.moe_router_topk} must be in [1, model.num_experts={m.num_experts}]"]
    return []


@_rule("router_groups", "group-limited routing: groups divide the experts and leave >= top-k candidates")
def _check_groups(cfg: Any, s: dict[str, Any]) -> list[str]:
    m = cfg.model
    g, gk = m.moe_router_num_groups, m.moe_router_group_topk
    if not m.num_experts or (g is None and gk is None):
        return []
    if g is None or gk is None:
        return ["model.moe_router_num_groups and model.moe_router_group_topk must be set together"]
    out = []
    if m.num_experts % g:
        out.append(f"model.num_experts={m.num_experts} is not divisible by model.moe_router_num_groups={g}")
    elif not 1 <= gk <= g:
        out.append(f"model.moe_router_group_topk={gk} must be in [1, moe_router_num_groups={g}]")
    elif gk * (m.num_experts // g) < m.moe_router_topk:
        out.append(f"group_topk {gk} x {m.num_experts // g} experts per group < moe_router_topk {m.moe_router_topk}")
    return out


@_rule("moe_layer_freq", "moe_layer_freq gives one 0/1 per layer")
def _check_freq(cfg: Any, s: dict[str, Any]) -> list[str]:
    m = cfg.model
    if not m.num_experts:
        return []
    try:
        freq = parse_moe_layer_freq(m.moe_layer_freq, m.num_layers)
    except InvalidUsageError as e:
        return [str(e)]
    if len(freq) != m.num_layers:
        return [f"model.moe_layer_freq gives {len(freq)} entries but model.num_layers={m.num_layers}"]
    if not any(freq):
        return ["model.moe_layer_freq makes no layer MoE but model.num_experts is set"]
    return []


@_rule("heads_divisible_by_tp", "attention heads (and query groups) are multiples of TP")
def _check_heads(cfg: Any, s: dict[str, Any]) -> list[str]:
    m = cfg.model
    out = []
    if m.num_attention_heads % s["tp"]:
        out.append(f"model.num_attention_heads={m.num_attention_heads} is not divisible by "
                   f"parallel.tensor_model_parallel_size={s['tp']}")
    if m.group_query_attention and m.num_query_groups and m.num_query_groups % s["tp"]:
        out.append(f"model.num_query_groups={m.num_query_groups} is not divisible by TP={s['tp']}")
    return out


@_rule("sequence_parallel_with_tp_and_ep", "MoE with TP > 1 and EP > 1 needs sequence_parallel (Megatron asserts it)")
def _check_sp(cfg: Any, s: dict[str, Any]) -> list[str]:
    if cfg.model.num_experts and s["tp"] > 1 and s["ep"] > 1 and not cfg.parallel.sequence_parallel:
        return [f"TP={s['tp']} and EP={s['ep']} need parallel.sequence_parallel=true"]
    return []


@_rule("sequence_length", "seq_length <= max_position_embeddings")
def _check_seq(cfg: Any, s: dict[str, Any]) -> list[str]:
    m = cfg.model
    if m.seq_length > m.max_position_embeddings:
        return [f"model.seq_length={m.seq_length} > model.max_position_embeddings={m.max_position_embeddings}"]
    return []


@_rule("context_parallel_sequence", "with CP > 1 the sequence splits into 2 x CP chunks")
def _check_cp(cfg: Any, s: dict[str, Any]) -> list[str]:
    if s["cp"] > 1 and cfg.model.seq_length % (2 * s["cp"]):
        return [f"model.seq_length={cfg.model.seq_length} is not divisible by 2 x CP = {2 * s['cp']}"]
    return []


@_rule("virtual_pipeline", "VPP needs PP > 1 and divides each rank's layers")
def _check_vpp(cfg: Any, s: dict[str, Any]) -> list[str]:
    p = cfg.parallel
    v = p.num_layers_per_virtual_pipeline_stage
    if v is None:
        return []
    if v < 1:
        return [f"parallel.num_layers_per_virtual_pipeline_stage={v} must be >= 1"]
    if s["pp"] == 1:
        return ["parallel.num_layers_per_virtual_pipeline_stage needs pipeline_model_parallel_size > 1"]
    if p.pipeline_model_parallel_layout:
        return ["set either parallel.pipeline_model_parallel_layout or num_layers_per_virtual_pipeline_stage"]
    per_rank = cfg.model.num_layers / s["pp"]
    if per_rank != int(per_rank) or int(per_rank) % v:
        return [(f"layers per PP rank ({cfg.model.num_layers}/{s['pp']}) is not a multiple of "
                f"num_layers_per_virtual_pipeline_stage={v}")]
    return []


@_rule("layers_divisible_by_pp", "the decoder layers split evenly over the pipeline stages")
def _check_pp_layers(cfg: Any, s: dict[str, Any]) -> list[str]:
    p = cfg.parallel
    if p.pipeline_model_parallel_layout:
        return []
    L, pp = cfg.model.num_layers, s["pp"]
    first, last = p.decoder_first_pipeline_num_layers, p.decoder_last_pipeline_num_layers
    if first is None and last is None:
        if L % pp:
            return [(f"model.num_layers={L} is not divisible by parallel.pipeline_model_parallel_size={pp}; use a PP "
                    f"that divides it, decoder_first/last_pipeline_num_layers, or pipeline_model_parallel_layout")]
        return []
    rest, rest_stages = middle_stages(L, pp, first, last)
    if rest < 0 or (rest_stages <= 0 and rest != 0) or (rest_stages > 0 and rest % rest_stages):
        return [(f"after decoder_first/last_pipeline_num_layers ({first}/{last}) the remaining {rest} layers do not "
                f"split evenly over {rest_stages} middle stage(s)")]
    return []


@_rule("pipeline_layout", "an explicit pipeline layout has PP x VPP stages, num_layers 't' and mtp_num_layers 'm'")
def _check_layout(cfg: Any, s: dict[str, Any]) -> list[str]:
    layout = cfg.parallel.pipeline_model_parallel_layout
    if not layout:
        return []
    try:
        stages = parse_pipeline_layout(layout)
    except InvalidUsageError as e:
        return [str(e)]
    out = []
    if len(stages) % s["pp"]:
        out.append(f"layout has {len(stages)} stages, not a multiple of PP={s['pp']}")
    n_t = sum(st.count("t") for st in stages)
    if n_t != cfg.model.num_layers:
        out.append(f"layout has {n_t} decoder layers ('t') but model.num_layers={cfg.model.num_layers}")
    n_m = sum(st.count("m") for st in stages)
    if n_m != (cfg.model.mtp_num_layers or 0):
        out.append(f"layout has {n_m} MTP layers ('m') but model.mtp_num_layers={cfg.model.mtp_num_layers}")
    if not stages[0].startswith("E"):
        out.append("layout must start with the embedding 'E'")
    if not stages[-1].endswith("L"):
        out.append("layout must end with the loss 'L'")
    return out


@_rule("global_batch_divisible", "global_batch_size is a multiple of micro_batch_size x DP")
def _check_gbs(cfg: Any, s: dict[str, Any]) -> list[str]:
    if s["world"] % s["mp"]:
        return []  # reported by model_parallel_divides_world
    dp = s["world"] // s["mp"]
    p = cfg.parallel
    if p.global_batch_size % (p.micro_batch_size * dp):
        return [(f"parallel.global_batch_size={p.global_batch_size} is not a multiple of micro_batch_size x DP = "
                f"{p.micro_batch_size} x {dp} = {p.micro_batch_size * dp}")]
    return []


@_rule("recompute", "full recompute names a method and a layer count; a method needs full granularity")
def _check_recompute(cfg: Any, s: dict[str, Any]) -> list[str]:
    p = cfg.parallel
    g, meth, n = p.recompute_granularity, p.recompute_method, p.recompute_num_layers
    full = g == schema.RecomputeGranularity.full
    if meth is not None and not full:
        return [f"parallel.recompute_method={meth.name} needs recompute_granularity=full"]
    if full and (meth is None or n is None):
        return ["parallel.recompute_granularity=full needs recompute_method and recompute_num_layers"]
    if full and meth == schema.RecomputeMethod.block and n is not None:
        per_rank = cfg.model.num_layers // s["pp"]
        if n > max(per_rank, 1):
            return [f"parallel.recompute_num_layers={n} > layers per pipeline rank {per_rank}"]
    return []
