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

Exit status: 0 all runs succeeded and logged every step; 1 a run failed (non-zero exit, timeout, or missing steps);
2 usage error; 3 loss parity above ``--loss-tolerance``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

from ..cli import subcommand
from ..config import expand_sweeps, to_yaml
from ..errors import InvalidUsageError
from ..launch.commands import compose_and_validate, default_run_dir
from ..launch.local import check_devices, child_env, format_command, torchrun_command
from ..launch.megatron_args import entry_command
from ..launch.preflight import check_env_knobs, check_training_stack

DEFAULT_ENTRY = ["-m", "uccl_moe.train.train_gpt"]
STATS_FLAGS = ["--log-throughput", "--log-memory", "--log-cpu"]
MOE_TIMING_FLAG = "--log-moe-timing"

# ----------------------------------------------------------------------------------------------------- parsing

_FLOAT = r"[-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|nan|inf)"
# uccl_moe.train.train_gpt:
# [train_gpt] iteration 3/4 | lm loss 5.51234 | lr 0.001 | grad norm 1.2345 | 812.3 ms | 630 tokens/s | peak mem ...
_TRAIN_GPT = re.compile(
    rf"\[train_gpt\] iteration (\d+)/(\d+) \| lm loss ({_FLOAT}) \| lr ({_FLOAT}) \| grad norm ({_FLOAT}) \| "
    rf"({_FLOAT}) ms(.*)$"
)
_TOKENS = re.compile(rf"\| ({_FLOAT}) tokens/s")
_PEAK = re.compile(rf"\| peak mem ({_FLOAT}) MiB")
_CPU = re.compile(rf"\| cpu ({_FLOAT}) s\b")
_LAYER_MS = re.compile(r"\| (dispatch|combine) ms/layer \[([^\]]*)\]")
# Megatron-LM (training.py training_log):
#  [2025-01-01 10:00:00] iteration        2/      50 | consumed samples: ... | elapsed time per iteration (ms): 812.3 |
#  ... | global batch size:   256 | lm loss: 1.034567E+01 | ...
_MLM_ITER = re.compile(r"\biteration\s+(\d+)/\s*(\d+) \|")
_MLM_MS = re.compile(rf"elapsed time per iteration \(ms\): ({_FLOAT})")
_MLM_LOSS = re.compile(rf"\blm loss: ({_FLOAT})")
_MLM_GBS = re.compile(r"global batch size:\s+(\d+)")
_MLM_MEM = re.compile(rf"max allocated: ({_FLOAT})")


@dataclass
class Step:
    """One logged training step."""

    iteration: int
    loss: float
    step_ms: float
    tokens_per_s: float | None = None
    peak_mem_mib: float | None = None
    cpu_s: float | None = None  # CPU seconds (user + sys, all threads) of the logging rank's process in the step
    dispatch_ms: list[float] | None = None  # forward, per MoE layer of the logging rank
    combine_ms: list[float] | None = None


def _ms_list(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def parse_log(text: str, seq_length: int | None = None) -> list[Step]:
    """Steps from a training log (``train_gpt`` or Megatron-LM lines), first occurrence of each iteration, in order.

    Args:
        text: the combined stdout/stderr of a run.
        seq_length: tokens per sample, to turn Megatron-LM's global batch size and step time into tokens/s.
    """
    steps: dict[int, Step] = {}
    mlm_peak: float | None = None
    for line in text.splitlines():
        m = _TRAIN_GPT.search(line)
        if m:
            it = int(m.group(1))
            if it in steps:
                continue
            rest = m.group(7)
            st = Step(it, float(m.group(3)), float(m.group(6)))
            if (t := _TOKENS.search(rest)) is not None:
                st.tokens_per_s = float(t.group(1))
            if (p := _PEAK.search(rest)) is not None:
                st.peak_mem_mib = float(p.group(1))
            if (c := _CPU.search(rest)) is not None:
                st.cpu_s = float(c.group(1))
            for kind, values in _LAYER_MS.findall(rest):
                setattr(st, f"{kind}_ms", _ms_list(values))
            steps[it] = st
            continue
        if (mm := _MLM_MEM.search(line)) is not None:  # "[Rank 0] (after 1 iterations) memory (MB) | ... max allocated"
            mlm_peak = max(mlm_peak or 0.0, float(mm.group(1)))
            continue
        mi, ms, ml = _MLM_ITER.search(line), _MLM_MS.search(line), _MLM_LOSS.search(line)
        if mi and ms and ml:
            it = int(mi.group(1))
            if it in steps:
                continue
            st = Step(it, float(ml.group(1)), float(ms.group(1)))
            g = _MLM_GBS.search(line)
            if g and seq_length and st.step_ms > 0:
                st.tokens_per_s = int(g.group(1)) * seq_length / (st.step_ms / 1000.0)
            steps[it] = st
    out = [steps[k] for k in sorted(steps)]
    if mlm_peak is not None:
        for st in out:
            st.peak_mem_mib = st.peak_mem_mib if st.peak_mem_mib is not None else mlm_peak
    return out


# ---------------------------------------------------------------------------------------------------- analysis


@dataclass
class Run:
    """One training run of the comparison."""

    name: str  # the dispatcher, or "<dispatcher>#2" for the repeated baseline
    dispatcher: str
    command: list[str]
    env: dict[str, str]
    expected_steps: int
    config_yaml: str = ""
    default_entry: bool = False  # uccl_moe.train.train_gpt: takes the --log-* flags and --loss-log
    returncode: int | None = None
    wall_s: float | None = None
    log: str | None = None
    error: str | None = None
    steps: list[Step] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.error is None


def loss_delta(run: list[Step], base: list[Step]) -> list[tuple[int, float]]:
    """|loss - baseline loss| at every iteration both logged: [(iteration, |Δ|)]. NaN where either is not finite."""
    by_it = {s.iteration: s.loss for s in base}
    out = []
    for s in run:
        if s.iteration in by_it:
            b = by_it[s.iteration]
            out.append((s.iteration, abs(s.loss - b) if math.isfinite(s.loss) and math.isfinite(b) else math.nan))
    return out


def _max(values: list[float]) -> float | None:
    if not values:
        return None
    return math.nan if any(math.isnan(v) for v in values) else max(values)


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def _layer_means(rows: list[list[float] | None]) -> list[float] | None:
    got = [r for r in rows if r is not None]
    if not got or len({len(r) for r in got}) != 1:
        return None
    return [statistics.fmean(col) for col in zip(*got)]


def summarize_run(run: Run, warmup: int) -> dict[str, Any]:
    """Averages over the steps after the first `warmup` (all steps when the run has no more than `warmup`)."""
    timed = run.steps[warmup:] if len(run.steps) > warmup else run.steps
    tps = [s.tokens_per_s for s in timed if s.tokens_per_s is not None]
    mem = [s.peak_mem_mib for s in run.steps if s.peak_mem_mib is not None]
    cpu = [(s.cpu_s, s.step_ms) for s in timed if s.cpu_s is not None and s.step_ms > 0]
    disp = _layer_means([s.dispatch_ms for s in timed])
    comb = _layer_means([s.combine_ms for s in timed])
    return {
        "steps": len(run.steps),
        "final_loss": run.steps[-1].loss if run.steps else None,
        "mean_step_ms": _mean([s.step_ms for s in timed]),
        "median_step_ms": statistics.median([s.step_ms for s in timed]) if timed else None,
        "tokens_per_s": _mean(tps),
        "peak_mem_mib": max(mem) if mem else None,
        "cpu_s_mean": _mean([c for c, _ in cpu]),
        # mean CPU seconds / mean step seconds: cores the logging rank's process kept busy, time-weighted
        "cpu_cores": sum(c for c, _ in cpu) / (sum(ms for _, ms in cpu) / 1000.0) if cpu else None,
        "dispatch_ms_per_layer": disp,
        "combine_ms_per_layer": comb,
        "dispatch_ms_mean_layer": _mean(disp) if disp else None,
        "combine_ms_mean_layer": _mean(comb) if comb else None,
    }


def analyze(runs: list[Run], baseline: str, warmup: int, repeat_name: str | None) -> dict[str, Any]:
    """The comparison as a JSON-able dict: per run its steps, summary and loss parity vs `baseline`."""
    by_name = {r.name: r for r in runs}
    base = by_name[baseline]
    base_summary = summarize_run(base, warmup)
    out_runs = []
    for r in runs:
        s = summarize_run(r, warmup)
        if base_summary["tokens_per_s"] and s["tokens_per_s"]:
            s["speedup_vs_baseline"] = s["tokens_per_s"] / base_summary["tokens_per_s"]
        else:
            s["speedup_vs_baseline"] = None
        deltas = loss_delta(r.steps, base.steps)
        out_runs.append({
            "name": r.name, "dispatcher": r.dispatcher, "ok": r.ok, "returncode": r.returncode, "error": r.error,
            "wall_s": r.wall_s, "log": r.log, "command": format_command(r.command, r.env),
            "summary": s,
            "parity": {
                "steps_compared": len(deltas),
                "max_abs_dloss": _max([d for _, d in deltas]),
                "per_step_abs_dloss": [[i, d] for i, d in deltas],
            },
            "steps": [asdict(st) for st in r.steps],
        })
    tol = None
    if repeat_name is not None and repeat_name in by_name:
        d = loss_delta(by_name[repeat_name].steps, base.steps)
        tol = {"runs": [baseline, repeat_name], "max_abs_dloss": _max([x for _, x in d]),
               "per_step_abs_dloss": [[i, x] for i, x in d]}
    return {"baseline": baseline, "warmup_steps": warmup, "repeat_baseline": tol, "runs": out_runs}


def _fmt(v: Any, spec: str) -> str:
    if v is None:
        return "-"
    if isinstance(v, float) and math.isnan(v):
        return "nan"
    return format(v, spec)


def render_table(result: dict[str, Any]) -> str:
    """A Markdown table of the runs (one row each) plus the run-to-run noise line."""
    head = ["run", "ok", "steps", "final loss", "max abs(Δloss) vs " + result["baseline"], "step ms (median)",
            "tokens/s", "speedup", "peak mem MiB", "cpu cores", "dispatch ms/layer", "combine ms/layer"]
    rows = []
    for r in result["runs"]:
        s, p = r["summary"], r["parity"]
        rows.append([r["name"], "yes" if r["ok"] else "FAILED", str(s["steps"]), _fmt(s["final_loss"], ".5f"),
                     _fmt(p["max_abs_dloss"], ".3e"), _fmt(s["median_step_ms"], ".1f"), _fmt(s["tokens_per_s"], ".0f"),
                     _fmt(s["speedup_vs_baseline"], ".3f"), _fmt(s["peak_mem_mib"], ".1f"), _fmt(s["cpu_cores"], ".2f"),
                     _fmt(s["dispatch_ms_mean_layer"], ".3f"), _fmt(s["combine_ms_mean_layer"], ".3f")])
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    lines = ["| " + " | ".join(h.ljust(w) for h, w in zip(head, widths)) + " |",
             "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    lines += ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |" for row in rows]
    rep = result.get("repeat_baseline")
    if rep is not None:
        lines.append(f"run-to-run noise ({rep['runs'][0]} vs {rep['runs'][1]}): max |Δloss| "
                     f"{_fmt(rep['max_abs_dloss'], '.3e')} over {len(rep['per_step_abs_dloss'])} steps")
    lines.append(f"step ms, tokens/s, cpu cores and dispatch/combine: means over steps after the first "
                 f"{result['warmup_steps']}; cpu cores: CPU seconds (user+sys, all threads) of the logging rank's "
                 "process / step seconds; dispatch/combine: forward, per MoE layer of the logging rank, from "
                 "*_preprocess to *_postprocess (the comm phase as the compute stream sees it)")
    return "\n".join(lines)


def write_png(result: dict[str, Any], path: Path) -> str | None:
    """Loss curves and tokens/s bars (and dispatch/combine bars when logged) into `path`. Returns a note instead of
    writing when matplotlib is not importable."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not importable: no PNG written (pip install matplotlib)"
    runs = result["runs"]
    timing = [r for r in runs if r["summary"]["dispatch_ms_mean_layer"] is not None]
    ncols = 4 if timing else 3
    fig, axes = plt.subplots(1, ncols, figsize=(5.2 * ncols, 4.2))
    ax = axes[0]
    styles = ["-", "--", "-.", ":"]
    for i, r in enumerate(runs):
        its = [s["iteration"] for s in r["steps"]]
        ax.plot(its, [s["loss"] for s in r["steps"]], styles[i % len(styles)],
                marker="o" if len(its) <= 20 else None, ms=3, label=r["name"])
    ax.set_xlabel("iteration")
    ax.set_ylabel("lm loss")
    ax.set_title("loss")
    ax.legend()
    ax = axes[1]
    for i, r in enumerate(runs):
        if r["name"] == result["baseline"]:
            continue
        d = r["parity"]["per_step_abs_dloss"]
        ax.plot([x[0] for x in d], [x[1] for x in d], styles[i % len(styles)], marker="o" if len(d) <= 20 else None,
                ms=3, color=f"C{i}", label=r["name"])
    ax.set_yscale("symlog", linthresh=1e-7)
    ax.set_xlabel("iteration")
    ax.set_ylabel(f"|loss - loss({result['baseline']})|")
    ax.set_title("loss parity (0 = bitwise equal)")
    if len(runs) > 1:
        ax.legend()
    ax = axes[2]
    names = [r["name"] for r in runs]
    tps = [r["summary"]["tokens_per_s"] or 0.0 for r in runs]
    bars = ax.bar(names, tps, color=[f"C{i}" for i in range(len(runs))])
    for b, r in zip(bars, runs):
        sp = r["summary"]["speedup_vs_baseline"]
        ax.annotate(f"{sp:.2f}x" if sp else "-", (b.get_x() + b.get_width() / 2, b.get_height()),
                    ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("tokens/s")
    ax.set_title(f"throughput (vs {result['baseline']})")
    if timing:
        ax = axes[3]
        tn = [r["name"] for r in timing]
        d = [r["summary"]["dispatch_ms_mean_layer"] for r in timing]
        c = [r["summary"]["combine_ms_mean_layer"] for r in timing]
        ax.bar(tn, d, label="dispatch")
        ax.bar(tn, c, bottom=d, label="combine")
        ax.set_ylabel("ms per MoE layer per step (forward)")
        ax.set_title("dispatch + combine")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


# ------------------------------------------------------------------------------------------------------ running


def parse_dispatchers(overrides: list[str]) -> tuple[list[str], list[str]]:
    """Split ``dispatchers=[a,b]`` (or ``dispatchers=a,b``) off `overrides`: (dispatcher names, other overrides)."""
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
    if not names:
        raise InvalidUsageError("give the dispatchers to compare, e.g. dispatchers=[uccl,alltoall,allgather]")
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


def merge_loss_log(steps: list[Step], path: Path) -> None:
    """Replace the rounded losses, step times and CPU seconds of `steps` by train_gpt's ``--loss-log`` values where
    present (``cpu_s`` is in the file with ``--log-cpu``)."""
    if not path.is_file():
        return
    precise: dict[int, dict[str, Any]] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            precise.setdefault(int(row["iteration"]), row)
    for st in steps:
        row = precise.get(st.iteration)
        if row is not None:
            st.loss = float(row["loss"])
            st.step_ms = float(row["seconds"]) * 1000.0
            if row.get("cpu_s") is not None:
                st.cpu_s = float(row["cpu_s"])


def _run_subdir(run: Run) -> str:
    return run.name.replace("#", "-")


def _compare_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("overrides", nargs="*",
                   help="dispatchers=[uccl,alltoall,allgather] and Hydra overrides, e.g. recipe=dsv3_proxy_local")
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
