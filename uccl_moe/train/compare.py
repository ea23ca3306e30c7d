"""``uccl-moe compare``: train one recipe once per token dispatcher and compare loss, speed and memory.

    uccl-moe compare recipe=dsv3_proxy_local dispatchers=[uccl,alltoall,allgather] --repeat-baseline
    uccl-moe compare recipe=tiny_cpu_moe dispatchers=[uccl,alltoall] train.train_iters=8 --dry-run

Each run is ``uccl-moe train`` of the recipe with ``dispatcher=<name>`` added to the overrides (same seed, steps and
everything else). The runs go one after another on this host. From each run's log the per-step loss, step time,
tokens/s, peak memory and (with the default entry ``uccl_moe.train.train_gpt``) the CPU seconds per step and the
forward dispatch/combine time per MoE layer are read; for the default entry compare adds ``--log-throughput
--log-memory --log-cpu --log-moe-timing`` to the command (see :mod:`uccl_moe.train.step_stats`); the table
reports CPU use as cores busy (CPU seconds / step seconds). Megatron-LM's ``pretrain_gpt.py`` log lines are read as
well (loss, step time, tokens/s from the global batch size; peak memory from its memory report).

Outputs in the compare directory (``runs/<recipe>/<time>-compare`` or ``--run-dir``): ``<run>/config.yaml``,
``<run>/command.sh`` and ``<run>/train.log`` per run, ``compare.json``, and ``compare.png`` (loss curves and
tokens/s bars; skipped with a note when matplotlib is not importable). The table goes to stdout.

Loss parity: for each run, |loss - baseline loss| at every step both logged, and its maximum. The baseline is the
first dispatcher (``--baseline`` picks another). ``--repeat-baseline`` trains the baseline twice; the max |Δloss|
between those two runs is the run-to-run noise to judge the others by. ``--loss-tolerance X`` makes compare exit 3
when any run's max |Δloss| exceeds X.

The log lines are read by :mod:`uccl_moe.train.log_parse`; the summaries, parity, table and PNG are
:mod:`uccl_moe.train.compare_report`'s; this module composes and runs.

Exit status: 0 all runs succeeded and logged every step; 1 a run failed (non-zero exit, timeout, or missing steps);
2 usage error; 3 loss parity above ``--loss-tolerance``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, TextIO

from ..cli import subcommand
from ..config import expand_sweeps, to_yaml
from ..errors import InvalidUsageError
from ..launch.commands import compose_and_validate, default_run_dir
from ..launch.local import check_devices, child_env, format_command, torchrun_command
from ..launch.megatron_args import entry_command
from ..launch.preflight import check_env_knobs, check_training_stack
from .compare_report import Run, analyze, loss_delta, render_table, summarize_run, write_png
from .log_parse import Step, merge_loss_log, parse_log

DEFAULT_ENTRY = ["-m", "uccl_moe.train.train_gpt"]
#: What `uccl-moe compare recipe=...` compares without dispatchers=: ours against Megatron's default dispatcher.
DEFAULT_DISPATCHERS = ("uccl", "alltoall")
STATS_FLAGS = ["--log-throughput", "--log-memory", "--log-cpu"]
MOE_TIMING_FLAG = "--log-moe-timing"


def parse_dispatchers(overrides: list[str]) -> tuple[list[str], list[str]]:
    """Split ``dispatchers=[a,b]`` (or ``dispatchers=a,b``) off `overrides`: (dispatcher names, other overrides);
    without it, DEFAULT_DISPATCHERS."""
    names: list[str] | None = None
    rest = []
    for o in overrides:
        if o.startswith("dispatchers="):
            if names is not None:
                raise InvalidUsageError("dispatchers= is given twice; give one list, e.g. dispatchers=[uccl,alltoall]")
            body = o[len("dispatchers="):].strip()
            if body.startswith("[") and body.endswith("]"):
                body = body[1:-1]
            names = [n.strip() for n in body.split(",") if n.strip()]
        elif o.split("=", 1)[0].lstrip("+~") == "dispatcher":
            raise InvalidUsageError(f"{o!r}: compare sets dispatcher= itself; list them as dispatchers=[uccl,alltoall]")
        else:
            rest.append(o)
    if names is None:
        names = list(DEFAULT_DISPATCHERS)
    if not names:
        raise InvalidUsageError("dispatchers= lists none; give the dispatchers to compare, e.g. "
                                "dispatchers=[uccl,alltoall,allgather] (or leave it out: uccl and alltoall)")
    if len(set(names)) != len(names):
        raise InvalidUsageError(f"dispatchers={names} lists a dispatcher twice; use --repeat-baseline to repeat one")
    return names, rest


def _stream(pipe: TextIO, log: TextIO, prefix: str, echo: bool) -> None:
    for line in pipe:
        log.write(line)
        log.flush()
        if echo or "[train_gpt] iteration" in line or "Error" in line:
            sys.stderr.write(f"[{prefix}] {line}")
            sys.stderr.flush()


def execute(run: Run, run_dir: Path, seq_length: int | None, timeout_s: float | None, echo: bool) -> None:
    """Run `run.command` (its own process group), tee its output into ``run_dir/train.log`` and parse the steps."""
    run_dir.mkdir(parents=True, exist_ok=True)
    log_path = run_dir / "train.log"
    run.log = str(log_path)
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(run.command, env={**os.environ, **run.env}, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        assert proc.stdout is not None
        reader = threading.Thread(target=_stream, args=(proc.stdout, log, run.name, echo), daemon=True)
        reader.start()
        try:
            run.returncode = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)  # the group this call started: torchrun and its ranks
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            run.returncode = proc.returncode
            run.error = f"timed out after {timeout_s:g} s (--timeout-s)"
        reader.join(timeout=30)
    run.wall_s = time.monotonic() - t0
    run.steps = parse_log(log_path.read_text(errors="replace"), seq_length)
    merge_loss_log(run.steps, run_dir / "steps.jsonl")
    if run.error is None and run.returncode != 0:
        run.error = f"exit status {run.returncode}; see {log_path}"
    if run.error is None and len(run.steps) < run.expected_steps:
        run.error = f"logged {len(run.steps)} of {run.expected_steps} steps; see {log_path}"


def _run_subdir(run: Run) -> str:
    return run.name.replace("#", "-")


def _compare_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("overrides", nargs="*",
                   help="dispatchers=[uccl,alltoall,allgather] (default: uccl and alltoall) and Hydra overrides, e.g. "
                        "recipe=dsv3_proxy_local")
    p.add_argument("--config-dir", type=Path, default=None, help="config tree (default: the checkout's configs/)")
    p.add_argument("--run-dir", type=Path, default=None, help="where to write (default: runs/<recipe>/<time>-compare)")
    p.add_argument("--baseline", default=None, help="dispatcher the others are compared with (default: the first)")
    p.add_argument("--repeat-baseline", action="store_true",
                   help="train the baseline twice and report the max |Δloss| between the two (run-to-run noise)")
    p.add_argument("--loss-tolerance", type=float, default=None,
                   help="exit 3 when a run's max |Δloss| vs the baseline exceeds this")
    p.add_argument("--warmup-steps", type=int, default=1,
                   help="steps left out of the step time / tokens/s / cpu cores / dispatch-combine means (default 1)")
    p.add_argument("--no-moe-timing", action="store_true",
                   help="do not time dispatch/combine (the default entry adds --log-moe-timing otherwise)")
    p.add_argument("--timeout-s", type=float, default=None, help="kill a run after this many seconds (a failure)")
    p.add_argument("--verbose", action="store_true", help="echo every line of the runs (default: the step lines)")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")


def plan(args: argparse.Namespace) -> tuple[list[Run], Any, str, str | None]:
    """Compose and validate every run: (runs, the baseline's config, baseline name, repeat name or None)."""
    names, overrides = parse_dispatchers(list(args.overrides))
    if len(expand_sweeps(overrides)) > 1:
        raise InvalidUsageError("`uccl-moe compare` runs one recipe per dispatcher; sweep syntax (a,b) is not allowed "
                                "in the other overrides")
    baseline = args.baseline or names[0]
    if baseline not in names:
        raise InvalidUsageError(f"--baseline {baseline} is not one of dispatchers={names}")
    if args.warmup_steps < 0:
        raise InvalidUsageError(f"--warmup-steps {args.warmup_steps} must be >= 0")
    order = list(names)
    repeat = f"{baseline}#2" if args.repeat_baseline else None
    if repeat is not None:
        order.insert(names.index(baseline) + 1, repeat)
    runs: list[Run] = []
    cfgs: dict[str, Any] = {}
    for name in order:
        disp = name.split("#", 1)[0]
        cfg, _ = compose_and_validate([*overrides, f"dispatcher={disp}"], args.config_dir, quiet=True)
        cmd = torchrun_command(cfg)
        default_entry = entry_command(cfg) == DEFAULT_ENTRY
        if default_entry:
            cmd += STATS_FLAGS + ([] if args.no_moe_timing else [MOE_TIMING_FLAG])
        log_interval = int(cfg.train.log_interval or 1)
        runs.append(Run(name, disp, cmd, child_env(cfg), int(cfg.train.train_iters) // log_interval, to_yaml(cfg),
                        default_entry))
        cfgs[name] = cfg
    seeds = {(int(c.train.seed), int(c.train.train_iters)) for c in cfgs.values()}
    if len(seeds) != 1:
        raise InvalidUsageError(f"the dispatcher configs change the seed or the step count ({sorted(seeds)}); "
                                "set train.seed and train.train_iters explicitly")
    return runs, cfgs[baseline], baseline, repeat


@subcommand("compare", "train one recipe once per dispatcher (same seed/steps): loss parity, step time, tokens/s, "
            "memory; table, JSON, PNG", _compare_args)
def compare(args: argparse.Namespace) -> int:
    runs, cfg, baseline, repeat = plan(args)
    out_dir = args.run_dir if args.run_dir is not None else default_run_dir(cfg, None, "compare")
    for r in runs:
        if r.default_entry:  # full-precision losses (the log line rounds to 5 decimals)
            r.command += ["--loss-log", str(out_dir / _run_subdir(r) / "steps.jsonl")]
    if args.dry_run:
        for r in runs:
            print(f"# {r.name}")
            print(format_command(r.command, r.env))
        return 0
    for r in runs:
        check_env_knobs({**os.environ, **r.env})
    check_training_stack(cfg)
    check_devices(cfg)
    out_dir.mkdir(parents=True, exist_ok=True)
    print(f"compare directory: {out_dir}", file=sys.stderr)
    seq_length = int(cfg.model.seq_length) if cfg.model.get("seq_length") else None
    for r in runs:
        rdir = out_dir / _run_subdir(r)
        rdir.mkdir(parents=True, exist_ok=True)
        (rdir / "steps.jsonl").unlink(missing_ok=True)  # train_gpt appends
        (rdir / "config.yaml").write_text(r.config_yaml)
        (rdir / "command.sh").write_text("#!/bin/bash\n" + format_command(r.command, r.env) + "\n")
        print(f"=== {r.name}: {rdir}", file=sys.stderr)
        execute(r, rdir, seq_length, args.timeout_s, args.verbose)
        state = "ok" if r.ok else f"FAILED ({r.error})"
        print(f"=== {r.name}: {state}, {len(r.steps)} steps, {r.wall_s:.1f} s", file=sys.stderr)
    result = analyze(runs, baseline, args.warmup_steps, repeat)
    result.update(recipe=str(cfg.meta.recipe), overrides=list(args.overrides),
                  created=_dt.datetime.now().isoformat(timespec="seconds"))
    table = render_table(result)
    (out_dir / "compare.json").write_text(json.dumps(result, indent=1) + "\n")
    (out_dir / "compare.md").write_text(table + "\n")
    note = write_png(result, out_dir / "compare.png")
    print(table)
    print(f"wrote {out_dir / 'compare.json'}")
    print(note if note else f"wrote {out_dir / 'compare.png'}")
    if not all(r.ok for r in runs):
        for r in runs:
            if not r.ok:
                print(f"run {r.name} failed: {r.error}", file=sys.stderr)
        return 1
    if args.loss_tolerance is not None:
        bad = [(r["name"], r["parity"]["max_abs_dloss"]) for r in result["runs"]
               if r["parity"]["max_abs_dloss"] is None or not r["parity"]["max_abs_dloss"] <= args.loss_tolerance]
        if bad:
            print(f"loss parity above --loss-tolerance {args.loss_tolerance:g}: {bad}", file=sys.stderr)
            return 3
    return 0


__all__ = ["Run", "Step", "analyze", "compare", "loss_delta", "parse_dispatchers", "parse_log", "render_table",
           "merge_loss_log", "summarize_run", "write_png"]
