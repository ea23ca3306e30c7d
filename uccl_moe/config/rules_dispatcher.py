"""Validation rules of the dispatcher, the CPU platform and the ``UCCL_MOE_*`` knobs (run after
:mod:`uccl_moe.config.rules_layout`'s), and :func:`knob_env`, the env vars the dispatcher's knob fields set."""

from __future__ import annotations

import dataclasses
from typing import Any

from ..errors import InvalidUsageError
from . import schema
from .rules import RuleSet

RULESET = RuleSet()
_rule = RULESET.rule


@_rule("dispatcher_router_dtype", "uccl and flex dispatchers take fp32 top-k weights: model.moe_router_dtype=fp32")
def _check_router_dtype(cfg: Any, s: dict[str, Any]) -> list[str]:
    t = cfg.dispatcher.moe_token_dispatcher_type
    needs_fp32 = t in (schema.DispatcherType.uccl, schema.DispatcherType.flex) and cfg.model.num_experts
    if needs_fp32 and cfg.model.moe_router_dtype != schema.RouterDtype.fp32:
        return [f"dispatcher {t.name} needs model.moe_router_dtype=fp32 (got {cfg.model.moe_router_dtype})"]
    return []


@_rule("shared_expert_overlap_dispatcher", "moe_shared_expert_overlap works with alltoall, flex and uccl only")
def _check_overlap(cfg: Any, s: dict[str, Any]) -> list[str]:
    d = cfg.dispatcher
    if d.moe_shared_expert_overlap:
        if d.moe_token_dispatcher_type == schema.DispatcherType.allgather:
            return ["dispatcher.moe_shared_expert_overlap=true does not work with the allgather dispatcher"]
        if not cfg.model.moe_shared_expert_intermediate_size:
            return ["dispatcher.moe_shared_expert_overlap=true but the model has no shared expert"]
    return []


@_rule("flex_dispatcher", "flex needs TP x EP > 1, a backend, and CUDA")
def _check_flex(cfg: Any, s: dict[str, Any]) -> list[str]:
    d = cfg.dispatcher
    if d.moe_token_dispatcher_type != schema.DispatcherType.flex:
        return []
    out = []
    if s["tp"] * s["ep"] <= 1:
        out.append("the flex dispatcher needs TP x EP > 1")
    if d.moe_flex_dispatcher_backend is None and not d.moe_enable_deepep:
        out.append("set dispatcher.moe_flex_dispatcher_backend (deepep or hybridep)")
    return out


@_rule("cpu_platform", "CPU runs use local layers, no fused CUDA features, and uccl's reference backend")
def _check_cpu(cfg: Any, s: dict[str, Any]) -> list[str]:
    pl, m, d = cfg.platform, cfg.model, cfg.dispatcher
    if pl.accelerator != schema.Accelerator.cpu:
        return []
    out = []
    if pl.distributed_backend != schema.DistributedBackend.gloo:
        out.append("platform.distributed_backend must be gloo on CPU")
    if pl.transformer_impl != schema.TransformerImpl.local:
        out.append("platform.transformer_impl must be local on CPU (TransformerEngine needs CUDA)")
    if pl.gradient_accumulation_fusion:
        out.append("platform.gradient_accumulation_fusion must be false on CPU")
    for k in ("moe_grouped_gemm", "moe_permute_fusion"):
        if m[k]:
            out.append(f"model.{k}=true needs TransformerEngine/CUDA; set model.{k}=false on CPU")
    if d.moe_token_dispatcher_type == schema.DispatcherType.flex:
        out.append("the flex dispatcher (DeepEP) needs CUDA GPUs; use dispatcher=uccl, alltoall or allgather")
    if d.moe_token_dispatcher_type == schema.DispatcherType.uccl and d.moe_uccl_backend == schema.UcclBackend.native:
        out.append("dispatcher.moe_uccl_backend=native needs GPUs; use reference (or auto) on CPU")
    return out


@_rule("env_knobs", "every UCCL_MOE_* value is a knob of uccl_moe/env_knobs.def and parses")
def _check_env(cfg: Any, s: dict[str, Any]) -> list[str]:
    from ..env import KNOBS

    out = []
    for where, env in (("platform.env", cfg.platform.env), ("platform.uccl_env", cfg.platform.uccl_env),
                       ("dispatcher", knob_env(cfg.dispatcher))):
        for k, v in env.items():
            if not k.startswith("UCCL_MOE_"):
                continue
            name = k[len("UCCL_MOE_"):]
            if name not in KNOBS:
                out.append(f"{where}: {k} is not a uccl-moe knob (see `uccl-moe env`)")
                continue
            try:
                KNOBS[name].parse(str(v))
            except InvalidUsageError as e:
                out.append(f"{where}: {e}")
    return out


def knob_env(dispatcher: Any) -> dict[str, str]:
    """The env vars set by the dispatcher's knob fields (those with metadata ``env``), None ones left out."""
    out = {}
    for f in dataclasses.fields(schema.DispatcherConfig):
        env = f.metadata.get("env")
        if env and dispatcher[f.name] is not None:
            out[env] = str(dispatcher[f.name])
    return out
