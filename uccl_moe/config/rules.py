"""The rule registry of :func:`uccl_moe.config.validate.validate`: a rule is a named check of a composed config that
returns one message (with the fix) per problem, none when the config passes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Check = Callable[[Any, dict[str, Any]], list[str]]


class RuleSet:
    """Rules in the order they run; ``docs`` maps each rule's name to its one-line statement."""

    def __init__(self) -> None:
        self.docs: dict[str, str] = {}
        self.checks: list[Check] = []

    def rule(self, name: str, doc: str) -> Callable[[Callable[..., list[str]]], Callable[..., list[str]]]:
        def deco(fn: Callable[..., list[str]]) -> Callable[..., list[str]]:
            self.docs[name] = doc
            fn.rule_name = name  # type: ignore[attr-defined]
            self.checks.append(fn)
            return fn

        return deco


def sizes(cfg: Any) -> dict[str, Any]:
    p = cfg.parallel
    tp, pp, cp, ep = (p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.context_parallel_size,
                      p.expert_model_parallel_size)
    etp = p.expert_tensor_parallel_size if p.expert_tensor_parallel_size is not None else tp
    world = cfg.nodes * cfg.platform.gpus_per_node
    # mp: ranks of one dense model replica (TP x PP x CP); emp: of one expert replica (ETP x EP x PP)
    return {"tp": tp, "pp": pp, "cp": cp, "ep": ep, "etp": etp, "world": world, "mp": tp * pp * cp,
            "emp": etp * ep * pp}
