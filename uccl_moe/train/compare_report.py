"""What ``uccl-moe compare`` reports from its runs: per-run summaries, loss parity against the baseline, the Markdown
table and the PNG."""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..launch.local import format_command
from .log_parse import Step


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
    lines.append(f"over the steps after the first {result['warmup_steps']}: step ms the median, tokens/s (and the "
                 f"speedup, its ratio to the baseline's), cpu cores and dispatch/combine means; cpu cores: CPU "
                 "seconds (user+sys, all threads) of the logging rank's process / step seconds; dispatch/combine: "
                 "forward, per MoE layer of the logging rank, from *_preprocess to *_postprocess (the comm phase as "
                 "the compute stream sees it)")
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
