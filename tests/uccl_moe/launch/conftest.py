"""Fixtures shared by the launch tests."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers.requires import require_tool


def _lint_bash(path: Path) -> None:
    """Assert that the script at `path` parses as bash (``bash -n``) and passes ``shellcheck -s bash``."""
    r = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stderr
    sc = require_tool("shellcheck")  # skips, naming the package, where it is absent
    r = subprocess.run([sc, "-s", "bash", str(path)], capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.fixture
def lint_bash() -> Callable[[Path], None]:
    """The rendered-script linter: ``lint_bash(path)`` (bash -n, then shellcheck)."""
    return _lint_bash
