"""Every example under examples/ runs and prints what it promises (STYLE.md R13: one test runs every example).

Each example is a subprocess with a timeout, as a user would run it; its output must carry the example's own
success line (each example checks its results against plain torch or Megatron's own dispatcher before printing it).
GPU examples are marked `gpu` and skip without GPUs. A new file under examples/ must get a case here.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


@dataclass(frozen=True)
class Example:
    path: str  # relative to examples/
    args: tuple[str, ...] = ()
    expect: tuple[str, ...] = ()  # regular expressions the output must match
    timeout_s: float = 300.0
    needs: str | None = None  # importable module the example needs
    gpu: bool = False
    out_dir_arg: bool = False  # takes an output folder as first argument (the test's tmp_path)


CASES = [
    Example("buffer_cpu_gloo.py", ("--ranks", "2"), (r"buffer_cpu_gloo OK: 2 ranks", r"rank 1: received \d+ of 128")),
    Example("buffer_cpu_gloo.py", ("--ranks", "3"), (r"buffer_cpu_gloo OK: 3 ranks",)),
    Example("deep_ep_dropin.py", (), (r"deep_ep from uccl_moe\.deep_ep_compat \(in-process\)", r"deep_ep_dropin OK")),
    Example("deep_ep_dropin.py", ("--on-disk",), (r"deep_ep from deep_ep \(on disk\)", r"deep_ep_dropin OK")),
    Example("megatron_moe_layer.py", (), (r"weight grads match allgather", r"megatron_moe_layer OK: EP=2"),
            timeout_s=600.0, needs="megatron.core"),
    Example("buffer_gpu.py", (), (r"buffer_gpu OK: \d+ GPUs, native backend",), gpu=True),
    Example("launch/train_local.sh", (), (r"--moe-token-dispatcher-type uccl", r"torch\.distributed\.run")),
    Example("launch/slurm_render.sh", (), (r"wrote .*job\.sbatch", r"#SBATCH"), out_dir_arg=True),
    Example("launch/primus_render.sh", (), (r"primus-cli direct", r"moe_token_dispatcher_type: uccl"),
            out_dir_arg=True),
]


def _case_id(c: Example) -> str:
    return " ".join((c.path, *c.args))


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["UCCL_MOE"] = f"{sys.executable} -m uccl_moe.cli"  # the launch snippets' command, without relying on PATH
    env.pop("UCCL_MOE_BACKEND", None)
    return env


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def test_every_example_has_a_case():
    files = {p.relative_to(EXAMPLES).as_posix() for p in EXAMPLES.rglob("*") if p.suffix in (".py", ".sh")}
    covered = {c.path for c in CASES}
    assert files == covered, f"examples without a case: {sorted(files - covered)}; stale: {sorted(covered - files)}"


@pytest.mark.parametrize("case", [c for c in CASES if not c.gpu], ids=_case_id)
@pytest.mark.mp
@pytest.mark.timeout(660)
def test_cpu_example(case: Example, tmp_path: Path):
    if case.needs and importlib.util.find_spec(case.needs.split(".")[0]) is None:
        pytest.skip(f"{case.path} needs {case.needs} (pip install megatron-core)")
    cmd = [str(EXAMPLES / case.path)] if case.path.endswith(".sh") else [sys.executable, str(EXAMPLES / case.path)]
    if case.path.endswith(".sh"):
        cmd = ["bash", *cmd]
    if case.out_dir_arg:
        cmd.append(str(tmp_path / "out"))
    _run_and_check(case, [*cmd, *case.args], tmp_path)


@pytest.mark.gpu
@pytest.mark.parametrize("case", [c for c in CASES if c.gpu], ids=_case_id)
@pytest.mark.timeout(660)
def test_gpu_example(case: Example, tmp_path: Path):
    n = min(_gpu_count(), 2)
    if n == 0:
        pytest.skip("needs CUDA/ROCm GPUs")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
           str(EXAMPLES / case.path), *case.args]
    _run_and_check(case, cmd, tmp_path)


def _run_and_check(case: Example, cmd: list[str], cwd: Path) -> None:
    proc = subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=case.timeout_s)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}:\n{out[-4000:]}"
    for pattern in case.expect:
        assert re.search(pattern, out), f"{case.path}: no match for {pattern!r} in the output:\n{out[-4000:]}"


def test_launch_snippets_pass_shellcheck():
    sc = shutil.which("shellcheck")
    if sc is None:
        pytest.skip("needs the shellcheck tool (apt-get install -y shellcheck)")
    scripts = sorted(str(p) for p in (EXAMPLES / "launch").glob("*.sh"))
    assert scripts
    proc = subprocess.run([sc, "-s", "bash", *scripts], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
