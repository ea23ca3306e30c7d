"""What the render subcommands write into a run or recipe folder: the validation summary recorded in a file's header,
and the Primus experiment YAML with its sbatch launcher (used by ``uccl-moe primus`` and ``render-recipes``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..config.validate import ValidationReport
from .primus import entry_lookup, primus_command, render_primus_yaml
from .slurm import render_primus_sbatch


def summary_text(report: ValidationReport) -> str:
    """The validation summary and its warnings, one ``WARNING:`` line each (printed, and recorded in rendered files)."""
    return "\n".join([report.summary(), *(f"WARNING: {w}" for w in report.warnings)])


def write_primus(cfg: Any, report: ValidationReport, out_dir: Path, rel_dir: str) -> tuple[Path, Path, list[str]]:
    """Write ``primus_exp.yaml`` and ``primus.sbatch`` into `out_dir`; `rel_dir` is how scripts refer to it."""
    exp_rel = f"{rel_dir}/primus_exp.yaml"
    lines = [
        f"export {entry_lookup(cfg)}",
        " ".join(primus_command(cfg, exp_rel)) + "   # one node",
        f"sbatch {rel_dir}/primus.sbatch   # {cfg.nodes} node(s); paths are relative to the submit directory",
    ]
    exp = out_dir / "primus_exp.yaml"
    exp.write_text(render_primus_yaml(cfg, lines, summary_text(report)))
    sb = out_dir / "primus.sbatch"
    sb.write_text(render_primus_sbatch(cfg, exp_rel, summary_text(report)))
    return exp, sb, lines
