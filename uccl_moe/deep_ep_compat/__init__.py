"""``deep_ep``-named facade over uccl-moe, so DeepEP users (Megatron, SGLang, vLLM) run unchanged.

Two ways to put it under the name ``deep_ep``:

- in-process::

      import uccl_moe.deep_ep_compat as c; c.install()

  Megatron-Core looks for ``deep_ep`` once, when ``megatron.core`` is first imported (its ``fused_a2a``); if that
  happened before ``install()``, ``install()`` re-runs ``fused_a2a`` and rebinds the names other Megatron modules
  imported from it (``token_dispatcher``'s ``fused_dispatch``/``fused_combine``...), so the order does not matter.

- on disk, once per environment (writes a tiny ``deep_ep`` package that re-exports this one)::

      python -m uccl_moe.deep_ep_compat install [--target SITE_PACKAGES_DIR]

``deep_ep.Buffer``, ``deep_ep.Config``, ``deep_ep.EventOverlap``, ``deep_ep.topk_idx_t`` and
``deep_ep.utils.EventHandle/EventOverlap/check_nvlink_connections`` are provided.
"""

from __future__ import annotations

import importlib
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
    _rebind_megatron()
    return sys.modules[__name__]


_FUSED_A2A = "megatron.core.transformer.moe.fused_a2a"


def _rebind_megatron() -> None:
    """Megatron-Core imported before install(): its fused_a2a found no deep_ep (HAVE_DEEP_EP False, fused_dispatch
    None) and token_dispatcher copied those names. Re-run fused_a2a now that deep_ep is ours, and point every loaded
    Megatron module's copies of its old names at the new ones."""
    fa = sys.modules.get(_FUSED_A2A)
    if fa is None or getattr(fa, "HAVE_DEEP_EP", True):
        return
    old = dict(vars(fa))
    importlib.reload(fa)
    new = vars(fa)
    names = [k for k in old if not k.startswith("__") and k in new and new[k] is not old[k]]
    for mod_name, mod in list(sys.modules.items()):
        if mod is None or mod is fa or not mod_name.startswith("megatron."):
            continue
        glb = getattr(mod, "__dict__", {})
        for k in names:
            if k in glb and glb[k] is old[k]:
                glb[k] = new[k]


def uninstall() -> None:
    """Undo :func:`install` (only if the registered ``deep_ep`` is ours)."""
    if sys.modules.get("deep_ep") is sys.modules[__name__]:
        del sys.modules["deep_ep"]
        sys.modules.pop("deep_ep.utils", None)
