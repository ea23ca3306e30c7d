"""The launch subcommands of ``uccl-moe``: train (this host), slurm (sbatch), primus (experiment YAML),
render-recipes (the committed ``recipes/`` folder)."""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import shutil
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

from ..cli import subcommand
from ..config import compose, expand_sweeps, to_yaml, validate
from ..config.validate import MemoryWarning, ValidationReport
from ..errors import InvalidUsageError
from .local import check_devices, child_env, format_command, torchrun_command
from .megatron_args import entry_argv, queues_comment
from .preflight import check_env_knobs, check_training_stack
from .render import summary_text, write_primus
from .render_all import check, render_all
from .slurm import render_sbatch


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. recipe=dsv3_h200_efa_4n nodes=8")
    p.add_argument("--config-dir", type=Path, default=None, help="config tree (default: the checkout's configs/)")
    p.add_argument("--run-dir", type=Path, default=None, help="where to write (default: runs/<recipe>/<time>)")
    p.add_argument("--quiet", action="store_true", help="do not print the config summary")
    p.add_argument("--show-config", action="store_true",
                   help="print the whole resolved config (it is always written to the run directory's config.yaml)")


def compose_and_validate(overrides: list[str], directory: Path | None, quiet: bool = False,
                         show_config: bool = False) -> tuple[Any, Any]:
    """Compose and validate; print a short summary unless `quiet`, and the whole resolved config if `show_config`."""
    cfg = compose(overrides, directory)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MemoryWarning)
        report = validate(cfg, warn=False)
    if show_config:
        print(f"# resolved config (recipe {cfg.meta.recipe})\n{to_yaml(cfg)}", file=sys.stderr)
    if not quiet:
        print_summary(cfg, report)
    return cfg, report


def print_summary(cfg: Any, report: ValidationReport) -> None:
    """The short config summary and the validation summary, on stderr."""
    print(config_summary(cfg), file=sys.stderr)
    print(summary_text(report), file=sys.stderr)


def config_summary(cfg: Any) -> str:
    """Three lines: the recipe and its groups, the model, the layout and the training loop."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    moe = (f", {m.num_experts} experts top-{m.moe_router_topk}" if m.num_experts else ", dense")
    sizes = {"TP": p.tensor_model_parallel_size, "PP": p.pipeline_model_parallel_size,
             "EP": p.expert_model_parallel_size, "CP": p.context_parallel_size}
    layout = " ".join(f"{k}{v}" for k, v in sizes.items() if v != 1) or "no model parallelism"
    choices = " ".join(f"{k}={v}" for k, v in cfg.meta.choices.items() if k != "recipe")
    return "\n".join([
        f"recipe {cfg.meta.recipe}: {choices}",
        f"model {m.name}: {m.num_layers} layers, hidden {m.hidden_size}{moe}, seq {m.seq_length}; dispatcher "
        f"{cfg.dispatcher.moe_token_dispatcher_type.value} on {cfg.platform.name} ({cfg.platform.accelerator.value})",
        f"{cfg.nodes} node(s) x {cfg.platform.gpus_per_node} ranks, {layout}; {t.train_iters} steps of "
        f"{p.global_batch_size} x {m.seq_length} tokens, lr {t.lr:g}",
    ])


def default_run_dir(cfg: Any, base: Path | None, tag: str = "") -> Path:
    """`base`/`tag` when `base` is given, else ``runs/<recipe>/<time>[-tag]`` (``runs/default/...`` without a recipe:
    compose's meta.recipe "none", the config's defaults, the tiny CPU model)."""
    if base is not None:
        return base / tag if tag else base
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    recipe = "default" if cfg.meta.recipe == "none" else str(cfg.meta.recipe)
    return Path("runs") / recipe / (stamp + (f"-{tag}" if tag else ""))


def _rel(path: Path) -> str:
    """`path` relative to the current directory when inside it (so rendered scripts work from the submit dir)."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path.resolve())


def _no_sweeps(overrides: list[str], what: str) -> None:
    if len(expand_sweeps(overrides)) > 1:
        raise InvalidUsageError(f"`uccl-moe {what}` runs one config; sweep syntax (a,b) works with `uccl-moe slurm`")


# ------------------------------------------------------------------------------------------------------- train


def _train_args(p: argparse.ArgumentParser) -> None:
    _common(p)
    p.add_argument("--dry-run", action="store_true", help="print the command and environment, run nothing")


LOG_DIR = "logs"
"""Folder of the run directory that holds one log per rank (``rank<N>.log``) and ``summary.json``."""


def with_log_dir(cmd: list[str], cfg: Any, log_dir: Path) -> list[str]:
    """`cmd` with ``--log-dir`` for our training entry (``uccl_moe.train.train_gpt`` writes one log per rank
    there and the end-of-run summary); other entries are left as they are."""
    if entry_argv(cfg) == ["-m", "uccl_moe.train.train_gpt"]:
        return [*cmd, "--log-dir", str(log_dir)]
    return cmd


@subcommand("train", "train on this host: torchrun with the rendered Megatron arguments", _train_args)
def train(args: argparse.Namespace) -> int:
    _no_sweeps(args.overrides, "train")
    cfg, report = compose_and_validate(args.overrides, args.config_dir, quiet=True, show_config=args.show_config)
    cmd = torchrun_command(cfg)
    env = child_env(cfg)
    check_env_knobs({**os.environ, **env})
    if not args.dry_run:
        check_training_stack(cfg)
        check_devices(cfg)
        if not args.quiet:
            print_summary(cfg, report)
    if args.dry_run:
        print("# environment")
        for k, v in env.items():
            print(f"{k}={v}")
        queues = queues_comment(cfg)
        if queues is not None:
            print(queues)
        print("# command")
        print(format_command(cmd, {}))
        return 0
    run_dir = default_run_dir(cfg, args.run_dir)
    log_dir = run_dir / LOG_DIR
    log_dir.mkdir(parents=True, exist_ok=True)
    cmd = with_log_dir(cmd, cfg, log_dir)
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    (run_dir / "command.sh").write_text("#!/bin/bash\n" + format_command(cmd, env) + "\n")
    ranks = cfg.nodes * cfg.platform.gpus_per_node
    print(f"run directory: {run_dir} (config.yaml, command.sh, {LOG_DIR}/rank<N>.log)", file=sys.stderr)
    print(f"launching {cfg.platform.gpus_per_node} rank(s) on this host ({ranks} in all) with torchrun; each rank "
          f"first imports torch and Megatron-Core (5-30 s, depending on the machine)...", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    proc = subprocess.run(cmd, env={**os.environ, **env}, check=False)
    state = "finished" if proc.returncode == 0 else f"FAILED (exit {proc.returncode})"
    print(f"run {state} after {time.monotonic() - t0:.1f} s; logs: {log_dir}", file=sys.stderr)
    return proc.returncode


# ------------------------------------------------------------------------------------------------------- slurm


def _slurm_args(p: argparse.ArgumentParser) -> None:
    _common(p)
    p.add_argument("--submit", action="store_true", help="submit the rendered script(s) with sbatch")


def _submit(script: Path) -> None:
    if shutil.which("sbatch") is None:
        raise InvalidUsageError("--submit needs `sbatch` on PATH (run on a Slurm login node) or submit the script "
                                f"by hand: sbatch {script}")
    out = subprocess.run(["sbatch", str(script)], check=True, capture_output=True, text=True)
    print(out.stdout.strip())


@subcommand("slurm", "render an sbatch script (one srun task per node, torchrun per node); --submit sends it",
            _slurm_args)
def slurm(args: argparse.Namespace) -> int:
    combos = expand_sweeps(args.overrides)
    scripts = []
    for i, overrides in enumerate(combos):
        cfg, report = compose_and_validate(overrides, args.config_dir, quiet=args.quiet or len(combos) > 1,
                                           show_config=args.show_config)
        tag = f"{i:03d}" if len(combos) > 1 else ""
        run_dir = default_run_dir(cfg, args.run_dir, tag)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(to_yaml(cfg))
        script = run_dir / "job.sbatch"
        script.write_text(render_sbatch(cfg, summary_text(report)))
        print(f"wrote {script}  ({' '.join(overrides)})")
        scripts.append(script)
    if args.submit:
        for s in scripts:
            _submit(s)
    return 0


# ------------------------------------------------------------------------------------------------------ primus


def _primus_args(p: argparse.ArgumentParser) -> None:
    _common(p)
    p.add_argument("--submit", action="store_true", help="submit the rendered primus.sbatch with sbatch")


@subcommand("primus", "render a Primus experiment YAML + the primus-cli command that uses uccl-moe's entry",
            _primus_args)
def primus(args: argparse.Namespace) -> int:
    _no_sweeps(args.overrides, "primus")
    cfg, report = compose_and_validate(args.overrides, args.config_dir, quiet=args.quiet,
                                       show_config=args.show_config)
    run_dir = default_run_dir(cfg, args.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    exp, sb, lines = write_primus(cfg, report, run_dir, _rel(run_dir))
    print(f"wrote {exp}\nwrote {sb}\n# run it with:")
    for line in lines:
        print(line)
    if args.submit:
        _submit(sb)
    return 0


# ---------------------------------------------------------------------------------------------- render-recipes


def _render_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, default=None, help="output folder (default: recipes/ of the checkout)")
    p.add_argument("--check", action="store_true", help="render to a temp dir and fail if recipes/ differs")


@subcommand("render-recipes", "regenerate the committed recipes/ folder (sbatch + Primus YAML per headline recipe)",
            _render_args)
def render_recipes(args: argparse.Namespace) -> int:
    if args.check:
        diffs = check(args.out)
        for d in diffs:
            print(d, file=sys.stderr)
        if not diffs:
            print(f"{args.out or 'recipes/'} is in step with the configs")
        return 1 if diffs else 0
    for path in render_all(args.out):
        print(f"wrote {path}")
    return 0


__all__ = ["LOG_DIR", "compose_and_validate", "config_summary", "default_run_dir", "summary_text", "with_log_dir",
           "write_primus"]
