"""Skips for tests whose optional tool is absent, each naming the tool and how to install it.

The Python packages come with the test extra (``pip install -e ".[test]"``); the system tools with apt.
"""

from __future__ import annotations

import shutil
from typing import Any

import pytest

_PY = {
    "omegaconf": 'Hydra/OmegaConf are not installed: pip install -e ".[train]"',
    "hydra": 'Hydra/OmegaConf are not installed: pip install -e ".[train]"',
    "megatron.core": 'megatron-core is not installed: pip install -e ".[train]"',
    "matplotlib": 'matplotlib is not installed: pip install -e ".[test]"',
    "torch": 'torch is not installed: pip install -e ".[train]"',
}
_TOOLS = {
    "shellcheck": "shellcheck is not installed: apt-get install shellcheck",
    "cmake": 'cmake is not installed: apt-get install cmake (or pip install "cmake>=3.24")',
}


def require(module: str) -> Any:
    """``pytest.importorskip(module)`` with a reason that says how to install it; returns the module."""
    return pytest.importorskip(module, reason=_PY.get(module, f"{module} is not installed"))


def missing(module: str) -> str | None:
    """The skip reason when `module` cannot be found, else None (for ``pytest.mark.skipif``)."""
    import importlib.util

    try:
        found = importlib.util.find_spec(module) is not None
    except ImportError:
        found = False
    return None if found else _PY.get(module, f"{module} is not installed")


def require_tool(name: str) -> str:
    """The path of system tool `name`, or skip the test naming the tool and its package."""
    path = shutil.which(name)
    if path is None:
        pytest.skip(_TOOLS.get(name, f"{name} is not installed"))
    return path
