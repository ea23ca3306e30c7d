"""The device tools (tools/device/*.py: scripts, not package modules) loaded as modules for their CPU tests, and what
those tests share."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

DEVICE_TOOLS = Path(__file__).resolve().parents[2] / "tools" / "device"


def refuses_before_any_rank(main: Callable[[list[str]], Any], bad_argv: list[str], bad_option: str,
                            capsys: Any) -> None:
    """A 2-GPU tool's main(): `bad_argv` is a parser error naming `bad_option`, and on a machine with fewer than 2 GPUs
    the defaults return 2 and say so, both before any rank is spawned (skipped where 2 GPUs would spawn them)."""
    with pytest.raises(SystemExit):
        main(bad_argv)
    assert bad_option in capsys.readouterr().err
    torch = pytest.importorskip("torch")
    if torch.cuda.device_count() >= 2:
        pytest.skip("this machine has 2 GPUs: main() would spawn the ranks")
    assert main([]) == 2
    assert "needs 2 GPUs" in capsys.readouterr().err


def device_tool(name: str) -> ModuleType:
    """tools/device/`name`.py as a module; its folder goes on sys.path first, as when it runs as a script (the tools
    import their folder's helpers, ce_timeline among them)."""
    if str(DEVICE_TOOLS) not in sys.path:
        sys.path.insert(0, str(DEVICE_TOOLS))
    spec = importlib.util.spec_from_file_location(name, DEVICE_TOOLS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
