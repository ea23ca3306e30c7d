"""Megatron-Core / Megatron-LM / Primus integration: ``--moe-token-dispatcher-type uccl``.

``import uccl_moe.megatron`` registers the ``uccl`` dispatcher type (see :func:`install`); other ways to launch:
``python -m uccl_moe.megatron.pretrain <megatron pretrain script> <args...>`` and the Primus entry
``uccl_moe/megatron/primus_entry.py``. The training application built on this adapter (``python -m
uccl_moe.train.train_gpt``) lives in :mod:`uccl_moe.train`. See docs/megatron.md.
"""

from __future__ import annotations

try:
    import megatron.core  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised only without megatron-core
    raise ImportError(
        "uccl_moe.megatron needs megatron-core: pip install megatron-core (>= 0.15; 0.17+ needs Python >= 3.12)"
    ) from exc

from .dispatcher import UCCLTokenDispatcher  # noqa: E402
from .install import install, is_installed, validate_config, widen_parser  # noqa: E402

install()

__all__ = ["UCCLTokenDispatcher", "install", "is_installed", "validate_config", "widen_parser"]
