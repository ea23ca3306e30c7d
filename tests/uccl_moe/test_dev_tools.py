"""The CPU dev tool that times Buffer's own Python path runs and prints a figure per op (it must not rot: the closing
notes quote it)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_python_path_tool_times_every_op() -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, str(ROOT / "tools/device/python_path.py"), "--calls", "20", "--profile",
                          "dispatch"], capture_output=True, text=True, timeout=120, env=env, check=True).stdout
    for op in ("layout", "dispatch", "cached", "combine"):
        m = re.search(rf"^{op}: ([0-9.]+) us per call$", out, re.M)
        assert m and float(m.group(1)) > 0, out
    assert "buffer.py" in out  # the profile of Buffer.dispatch follows


def test_python_path_tool_times_the_native_backends_python_too() -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, str(ROOT / "tools/device/python_path.py"), "--native", "--calls", "20",
                          "--profile", "cached_fp8"], capture_output=True, text=True, timeout=120, env=env,
                         check=True).stdout
    for op in ("cached_fp8", "cached_bf16", "combine_ce"):
        m = re.search(rf"^{op}: ([0-9.]+) us per call$", out, re.M)
        assert m and float(m.group(1)) > 0, out
    assert "_dispatch_ce" in out  # the copy-engine dispatch's Python ran (its launch a stand-in)


def test_python_path_tool_refuses_a_profile_of_the_other_mode() -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for argv, want in ((["--profile", "cached_fp8"], "is an op of --native"),
                       (["--native", "--profile", "cached"], "is an op of the default mode")):
        out = subprocess.run([sys.executable, str(ROOT / "tools/device/python_path.py"), *argv], capture_output=True,
                             text=True, timeout=120, env=env)
        assert out.returncode == 2 and want in out.stderr, out.stderr
