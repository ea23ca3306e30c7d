"""Typed run configs: Hydra schemas, composition, validation of the parallel layout, memory estimates.

Typical use::

    from uccl_moe.config import compose, validate
    cfg = compose(["recipe=dsv3_h200_efa_4n"])
    report = validate(cfg)          # raises LayoutError naming the failed rule(s)
    print(report.memory.summary())
"""

from __future__ import annotations

from .compose import ConfigError, available, compose, config_dir, expand_sweeps, to_object, to_yaml
from .memory import MemoryEstimate, count_parameters, estimate_memory
from .validate import LayoutError, ValidationReport, validate

__all__ = [
    "ConfigError",
    "LayoutError",
    "MemoryEstimate",
    "ValidationReport",
    "available",
    "compose",
    "config_dir",
    "count_parameters",
    "estimate_memory",
    "expand_sweeps",
    "to_object",
    "to_yaml",
    "validate",
]
