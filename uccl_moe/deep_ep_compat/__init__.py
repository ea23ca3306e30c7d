"""``deep_ep``-named facade over uccl-moe, so DeepEP users (Megatron, SGLang, vLLM) run unchanged.

Two ways to put it under the name ``deep_ep``:

- in-process, before the user imports deep_ep::

      import uccl_moe.deep_ep_compat as c; c.install()

- on disk, once per environment (writes a tiny ``deep_ep`` package that re-exports this one)::

      python -m uccl_moe.deep_ep_compat install [--target SITE_PACKAGES_DIR]

``deep_ep.Buffer``, ``deep_ep.Config``, ``deep_ep.EventOverlap``, ``deep_ep.topk_idx_t`` and
``deep_ep.utils.EventHandle/EventOverlap/check_nvlink_connections`` are provided.
"""

from __future__ import annotations

import sys
import types

from ..buffer import Buffer, Config, topk_idx_t
from ..utils import EventHandle, EventOverlap
from . import utils

__all__ = ["Buffer", "Config", "EventOverlap", "EventHandle", "topk_idx_t", "utils", "install", "uninstall"]


def install(force: bool = False) -> types.ModuleType:
    """Register this module as ``deep_ep`` (and ``deep_ep.utils``) in ``sys.modules``.

    If a real ``deep_ep`` is already imported it is left alone unless ``force=True``. Returns the module that
    ``import deep_ep`` now yields.
    """
    current = sys.modules.get("deep_ep")
    if current is not None and current is not sys.modules[__name__] and not force:
        return current
    sys.modules["deep_ep"] = sys.modules[__name__]
    sys.modules["deep_ep.utils"] = utils
    return sys.modules[__name__]


def uninstall() -> None:
    """Undo :func:`install` (only if the registered ``deep_ep`` is ours)."""
    if sys.modules.get("deep_ep") is sys.modules[__name__]:
        del sys.modules["deep_ep"]
        sys.modules.pop("deep_ep.utils", None)
