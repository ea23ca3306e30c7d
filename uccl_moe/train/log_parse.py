"""The steps of a training log: ``[train_gpt] iteration ...`` lines of :mod:`uccl_moe.train.train_gpt` (with the
``--log-*`` fields of :mod:`uccl_moe.train.step_stats`) and Megatron-LM's ``training_log`` lines; train_gpt's
``--loss-log`` rows replace the rounded figures where present."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
