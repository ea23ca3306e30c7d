"""STYLE R11: the package type-checks with mypy --strict (configuration in pyproject.toml)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(subprocess.run([sys.executable, "-m", "mypy", "--version"], capture_output=True).returncode != 0,
                    reason='mypy is not installed: pip install -e ".[test]"')
def test_mypy_strict():
    out = subprocess.run([sys.executable, "-m", "mypy", "--strict", "uccl_moe"], cwd=ROOT, capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]


@pytest.mark.skipif(subprocess.run([sys.executable, "-m", "ruff", "--version"], capture_output=True).returncode != 0,
                    reason='ruff is not installed: pip install -e ".[test]"')
def test_ruff_clean():
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "uccl_moe", "tests"], cwd=ROOT, capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stdout[-6000:]
