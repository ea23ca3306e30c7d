"""The device tools (tools/device/*.py: scripts, not package modules) loaded as modules for their CPU tests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

DEVICE_TOOLS = Path(__file__).resolve().parents[2] / "tools" / "device"


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
