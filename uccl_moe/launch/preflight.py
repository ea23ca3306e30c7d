"""Checks that run before torchrun starts, so a missing package or a bad knob is one line, not a traceback per rank.

* torch importable, and Megatron-Core installed in a supported version (for the Megatron entries);
* every ``UCCL_MOE_*`` knob the ranks will see (this environment plus the config's) parses.

Nothing here imports torch or Megatron: versions are read from package metadata or from the source file.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..errors import InvalidUsageError
from .megatron_args import entry_argv

MEGATRON_SUPPORTED: tuple[tuple[int, int], tuple[int, int]] = ((0, 13), (0, 19))
"""Oldest and newest Megatron-Core (major, minor) the dispatcher supports (``uccl_moe/megatron/_compat.py``)."""

MEGATRON_INSTALL_HINT = ('pip install "megatron-core==0.16.1" (Python 3.10/3.11) or "megatron-core>=0.19,<0.20" '
                         '(Python >= 3.12); or: pip install "uccl-moe[train]"')


class PreflightError(InvalidUsageError):
    """The training stack or the environment cannot run the job; the message says what to install or set."""


def megatron_version() -> str | None:
    """The Megatron-Core version that ``import megatron.core`` would load, or None when it cannot be found.

    Read from that package's ``package_info.py`` (MAJOR/MINOR/PATCH, as text: a Megatron-LM checkout on PYTHONPATH
    shadows an installed wheel), else from the ``megatron-core`` distribution's metadata.
    """
    try:
        spec = importlib.util.find_spec("megatron.core")
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        return None
    for location in spec.submodule_search_locations or []:
        info = Path(location) / "package_info.py"
        if info.is_file():
            text = info.read_text()
            parts = [re.search(rf"^{k}\s*=\s*(\d+)", text, re.M) for k in ("MAJOR", "MINOR", "PATCH")]
            if all(parts):
                return ".".join(m.group(1) for m in parts if m)
    try:
        return importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def check_megatron(version: str | None) -> None:
    """Raise :class:`PreflightError` unless `version` (from :func:`megatron_version`) is supported."""
    lo, hi = MEGATRON_SUPPORTED
    supported = f"{lo[0]}.{lo[1]}-{hi[0]}.{hi[1]}"
    if version is None:
        raise PreflightError(f"Megatron-Core is not installed (the training entry needs {supported}): "
                             f"{MEGATRON_INSTALL_HINT}")
    m = re.match(r"(\d+)\.(\d+)", version)
    if m is None:
        return  # a checkout without a readable version: let Megatron itself speak
    have = (int(m.group(1)), int(m.group(2)))
    if not lo <= have <= hi:
        raise PreflightError(f"megatron-core {version} is installed but uccl-moe supports {supported}: "
                             f"{MEGATRON_INSTALL_HINT}")


def check_training_stack(cfg: Any) -> None:
    """torch, and Megatron-Core for the Megatron entries (our ``train_gpt``/``pretrain`` and Megatron-LM scripts)."""
    if importlib.util.find_spec("torch") is None:
        raise PreflightError('torch is not installed: pip install "uccl-moe[train]" (or the torch build for your '
                             "CUDA/ROCm, see pytorch.org)")
    entry = entry_argv(cfg)
    if entry[0] != "-m" or entry[1].startswith(("uccl_moe.megatron", "uccl_moe.train")):
        check_megatron(megatron_version())


def check_env_knobs(env: Mapping[str, str]) -> None:
    """Every known ``UCCL_MOE_*`` knob in `env` parses (the ranks would fail on it later, one traceback each)."""
    from ..env import KNOBS

    for var, value in sorted(env.items()):
        if not var.startswith("UCCL_MOE_"):
            continue
        knob = KNOBS.get(var[len("UCCL_MOE_"):])
        if knob is None:
            continue  # not a knob (UCCL_MOE_CONFIG_DIR, build settings); uccl_moe.env warns about typos
        if str(value) == "":
            continue  # empty means unset, as uccl_moe.env and the C++ knobs read it
        try:
            knob.parse(str(value))
        except InvalidUsageError as e:
            what = knob.doc.split(";")[0]
            raise PreflightError(f"{e}\n  rule: {var} is a uccl-moe knob ({what}); fix: unset it or give a valid "
                                 f"value (every knob and its range: uccl-moe env)") from None
