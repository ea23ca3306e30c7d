"""Validation of a composed config: does the parallel layout divide the model and fit the nodes?

Every check is a named rule; :func:`validate` runs all of them and raises one :class:`LayoutError` that lists each
rule that failed with the numbers involved and a fix. The rules live in :mod:`uccl_moe.config.rules_layout` and
:mod:`uccl_moe.config.rules_dispatcher`, in this order (``RULES`` documents each one):

* sizes: parallel sizes, nodes and ranks per node are >= 1;
* ranges: every other bounded number of the schema (``ge``/``gt``/``le``/``lt`` field metadata) is in its range;
* hidden_per_head, lr_schedule;
* model_parallel_divides_world: nodes x ranks-per-node is a multiple of TP x PP x CP;
* expert_parallel_divides_world: ... and of ETP x EP x PP (Megatron's MoE parallel folding);
* experts_divisible_by_ep, ep_needs_experts, router_topk, router_groups, moe_layer_freq;
* heads_divisible_by_tp, sequence_parallel_with_tp_and_ep, sequence_length, context_parallel_sequence;
* layers_divisible_by_pp, virtual_pipeline, pipeline_layout;
* global_batch_divisible;
* recompute;
* dispatcher_router_dtype, shared_expert_overlap_dispatcher, flex_dispatcher;
* cpu_platform;
* env_knobs (every UCCL_MOE_* value is a known knob and parses).

Memory for weights + grads + optimizer state is estimated (:mod:`uccl_moe.config.memory`); going over the
platform's GPU memory is a warning, not an error (activation recompute, offload or a bigger layout may be
intended), printed by the launchers.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, field
from typing import Any

from ..errors import InvalidUsageError
from . import rules_dispatcher, rules_layout
from .memory import MemoryEstimate, estimate_memory
from .pipeline import parse_pipeline_layout, pipeline_assignment
from .rules import sizes
from .rules_dispatcher import knob_env
from .rules_layout import range_problem

log = logging.getLogger("uccl_moe.config")


@dataclass
class RuleFailure:
    rule: str
    message: str


class MemoryWarning(UserWarning):
    """The estimated weights + grads + optimizer state exceed the platform's GPU memory."""


class LayoutError(InvalidUsageError):
    """One or more validation rules failed; ``failures`` lists them (``.rule``, ``.message``)."""

    def __init__(self, failures: list[RuleFailure], recipe: str) -> None:
        self.failures = failures
        lines = [f"config for recipe '{recipe}' is invalid ({len(failures)} rule(s) failed):"]
        lines += [f"  rule '{f.rule}': {f.message}" for f in failures]
        super().__init__("\n".join(lines))

    @property
    def rules(self) -> list[str]:
        return [f.rule for f in self.failures]


@dataclass
class ValidationReport:
    """What a valid config works out to."""

    world_size: int
    data_parallel_size: int
    expert_data_parallel_size: int
    pipeline: list[list[int]]  # layer indices per PP rank
    memory: MemoryEstimate
    warnings: list[str] = field(default_factory=list)

    def summary(self) -> str:
        return (
            f"world {self.world_size} ranks: DP {self.data_parallel_size}, expert DP "
            f"{self.expert_data_parallel_size}; layers per PP rank "
            f"{[len(x) for x in self.pipeline]}\n{self.memory.summary()}"
        )


RULES: dict[str, str] = {**rules_layout.RULESET.docs, **rules_dispatcher.RULESET.docs}
"""Every rule's name and one-line statement, in the order :func:`validate` runs them."""
_CHECKS = rules_layout.RULESET.checks + rules_dispatcher.RULESET.checks


def validate(cfg: Any, *, warn: bool = True) -> ValidationReport:
    """Run every rule on composed config `cfg`; raise :class:`LayoutError` naming each failed rule.

    Returns the derived sizes and the memory estimate. When the estimate exceeds ``platform.gpu_memory_gb`` a
    warning is added to the report (and issued through ``warnings`` when `warn`).
    """
    s = sizes(cfg)
    failures: list[RuleFailure] = []
    for check in _CHECKS:
        try:
            msgs = check(cfg, s)
        except ZeroDivisionError:
            msgs = []  # a size < 1 reported by 'sizes'
        failures += [RuleFailure(check.rule_name, msg) for msg in msgs]  # type: ignore[attr-defined]
    if failures:
        raise LayoutError(failures, str(cfg.meta.recipe))
    assignment = pipeline_assignment(cfg)
    memory = estimate_memory(cfg, assignment, s["world"])
    report = ValidationReport(
        world_size=s["world"],
        data_parallel_size=s["world"] // s["mp"],
        expert_data_parallel_size=s["world"] // s["emp"],
        pipeline=assignment,
        memory=memory,
    )
    if not memory.fits:
        msg = (f"memory: recipe '{cfg.meta.recipe}' needs ~{memory.total_gb:.1f} GB per {memory.per} for weights, "
               f"grads and optimizer state alone, more than platform {cfg.platform.name}'s {memory.capacity}; use "
               f"more nodes / a larger EP or PP, parallel.use_distributed_optimizer=true, or a smaller model")
        report.warnings.append(msg)
        if warn:
            warnings.warn(msg, MemoryWarning, stacklevel=2)
    return report


__all__ = ["RULES", "LayoutError", "MemoryWarning", "RuleFailure", "ValidationReport", "knob_env",
           "parse_pipeline_layout", "pipeline_assignment", "range_problem", "validate"]
