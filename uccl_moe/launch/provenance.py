"""What every rendered file records: the recipe, the overrides, the group choices and how to regenerate it."""

from __future__ import annotations

import shlex
from typing import Any


def regenerate_command(subcommand: str, cfg: Any) -> str:
    """The ``uccl-moe`` command line that reproduces `cfg` (recipe first, then the overrides as given)."""
    overrides = [str(o) for o in cfg.meta.overrides]
    if cfg.meta.recipe != "none" and not any(o.startswith("recipe=") for o in overrides):
        overrides.insert(0, f"recipe={cfg.meta.recipe}")
    return shlex.join(["uccl-moe", subcommand, *overrides])


def provenance_lines(subcommand: str, cfg: Any, summary: str = "") -> list[str]:
    """Comment lines (without the comment marker) for the top of a rendered file."""
    choices = " ".join(f"{k}={v}" for k, v in cfg.meta.choices.items())
    lines = [
        (f"Rendered by uccl-moe from recipe '{cfg.meta.recipe}' (dispatcher {cfg.dispatcher.name}): "
        f"{cfg.meta.description}"),
        f"overrides: {shlex.join([str(o) for o in cfg.meta.overrides]) or '(none)'}",
        f"config groups: {choices}",
        f"regenerate: {regenerate_command(subcommand, cfg)}",
        "Generated file: change configs/ (or the overrides) and regenerate instead of editing it.",
    ]
    if summary:
        lines += summary.splitlines()
    return lines


def comment_block(lines: list[str], marker: str = "#") -> str:
    return "".join(f"{marker} {line}".rstrip() + "\n" for line in lines)
