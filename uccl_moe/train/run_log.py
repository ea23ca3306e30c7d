"""What a training run tells: one log file per rank, progress lines from the start, and a closing summary.

* :func:`tee_to_file` copies everything this process writes to stdout and stderr (Python, C++ and CUDA alike: the
  file descriptors are redirected) into ``<log_dir>/rank<N>.log``, through a ``tee`` child that outlives a crash;
* :func:`progress` prints a timestamped line on one rank (what is happening while nothing else prints);
* :func:`run_summary` / :func:`format_summary`: steps, loss first -> last, tokens/s, wall time, and the versions of
  uccl-moe, torch, Megatron-Core, CUDA/ROCm and the devices used.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

_T0 = time.monotonic()

#: The starts of the UserWarnings Megatron-Core gives once per module and rank, as it is imported, where
#: TransformerEngine/Apex are absent, as they always are on a CPU: a CPU run silences them (train_gpt's filters, the
#: launcher's ``PYTHONWARNINGS``).
CPU_ABSENT_WARNINGS = ("Transformer Engine and Apex are not installed", "Apex is not installed")


def tee_to_file(log_dir: Path, rank: int) -> Path | None:
    """Send fds 1 and 2 through ``tee -a -i <log_dir>/rank<rank>.log`` (stdout to stdout, stderr to stderr).

    Returns the log path, or None when ``tee`` is not on PATH (the output then only goes to the console).
    ``-i``: tee ignores SIGINT so a Ctrl-C still leaves the whole log; ``-a``: both streams append to one file.
    """
    tee = shutil.which("tee")
    if tee is None:
        return None
    log_dir.mkdir(parents=True, exist_ok=True)
    path = log_dir / f"rank{rank}.log"
    path.write_text("")
    sys.stdout.flush()
    sys.stderr.flush()
    for fd in (1, 2):
        console = os.dup(fd)
        child = subprocess.Popen([tee, "-a", "-i", str(path)], stdin=subprocess.PIPE, stdout=console, close_fds=True)
        os.close(console)
        assert child.stdin is not None
        os.dup2(child.stdin.fileno(), fd)
        child.stdin.close()  # fd `fd` is now the only writer: tee sees EOF when this process exits
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - line-buffered over the new fd 1
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    return path


def progress(message: str, rank: int = 0, on_rank: int = 0) -> None:
    """``[train_gpt +3.2s] message`` on rank `on_rank` only, flushed at once."""
    if rank == on_rank:
        print(f"[train_gpt +{time.monotonic() - _T0:.1f}s] {message}", flush=True)


def versions(device_type: str) -> dict[str, str]:
    """Versions of the stack and the devices this rank sees: uccl-moe, torch, megatron-core, cuda/rocm, devices."""
    import torch

    import uccl_moe

    try:
        from megatron.core import package_info

        mcore = str(package_info.__version__)
    except Exception:  # noqa: BLE001 - a Megatron build without package_info
        mcore = "unknown"
    out = {"uccl_moe": uccl_moe.__version__, "torch": torch.__version__, "megatron_core": mcore,
           "cuda": str(torch.version.cuda or "none"), "rocm": str(getattr(torch.version, "hip", None) or "none")}
    if device_type == "cuda" and torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        kinds = sorted(set(names))
        out["devices"] = ", ".join(f"{names.count(k)} x {k}" for k in kinds)
    else:
        out["devices"] = f"CPU ({os.cpu_count()} cores)"
    return out


def run_summary(rows: list[dict[str, Any]], wall_s: float, world_size: int, device_type: str) -> dict[str, Any]:
    """The closing numbers of a run from its per-step rows (``iteration``, ``loss``, ``tokens_per_s``, ``seconds``).

    tokens/s is the mean over the steps after the first (the first compiles and warms up) when there are several.
    """
    losses = [r["loss"] for r in rows if math.isfinite(r.get("loss", math.nan))]
    steady = rows[1:] if len(rows) > 1 else rows
    tps = [r["tokens_per_s"] for r in steady]
    return {
        "steps": len(rows),
        "loss_first": losses[0] if losses else None,
        "loss_last": losses[-1] if losses else None,
        "tokens_per_s": sum(tps) / len(tps) if tps else None,
        "first_step_s": rows[0]["seconds"] if rows else None,
        "wall_s": wall_s,
        "world_size": world_size,
        "versions": versions(device_type),
    }


def format_summary(s: dict[str, Any]) -> str:
    """The summary as three lines for the console."""
    loss = (f"lm loss {s['loss_first']:.4f} -> {s['loss_last']:.4f}" if s["loss_first"] is not None
            else "lm loss n/a (not the last pipeline stage)")
    tps = f"{s['tokens_per_s']:.0f} tokens/s" if s["tokens_per_s"] is not None else "tokens/s n/a"
    steady = " (steps 2+)" if s["steps"] > 1 else ""
    first = f", first step {s['first_step_s']:.1f} s" if s["first_step_s"] is not None else ""
    v = s["versions"]
    accel = (f"torch built for CUDA {v['cuda']}" if v["cuda"] != "none" else
             f"torch built for ROCm {v['rocm']}" if v["rocm"] != "none" else "torch built without CUDA/ROCm")
    return "\n".join([
        f"[train_gpt] done: {s['steps']} steps in {s['wall_s']:.1f} s wall{first} | {loss} | {tps}{steady}",
        f"[train_gpt] versions: uccl-moe {v['uccl_moe']}, torch {v['torch']}, megatron-core {v['megatron_core']}, "
        f"{accel}",
        f"[train_gpt] devices: {v['devices']}, {s['world_size']} rank(s)",
    ])


def write_summary(log_dir: Path, s: dict[str, Any]) -> Path:
    """``<log_dir>/summary.json``."""
    path = log_dir / "summary.json"
    path.write_text(json.dumps(s, indent=1) + "\n")
    return path
