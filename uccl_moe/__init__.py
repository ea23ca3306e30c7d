"""uccl-moe: portable expert-parallel dispatch/combine for MoE training (DeepEP-V1 compatible).

``from uccl_moe import Buffer`` is a drop-in for ``deep_ep.Buffer``; see README.md.

The heavy exports (``Buffer`` and friends need torch and the native module) load on first use, so the launcher
(``uccl-moe slurm ...`` on a login node) runs without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from . import env as _env
from .errors import (
    CommTimeoutError,
    CudaError,
    InternalError,
    InvalidTypeError,
    InvalidUsageError,
    TransportError,
    UcclMoeError,
)

__version__ = "0.1.0"

_env.configure_logging()
_env.prepare_cuda_module_loading()

_LAZY = {
    "Buffer": "buffer", "Config": "buffer", "DispatchHandle": "buffer", "DispatchResult": "buffer",
    "CombineResult": "buffer", "LayoutResult": "buffer", "SupportedDtypes": "buffer", "topk_idx_t": "buffer",
    "EventHandle": "utils", "EventOverlap": "utils",
}

if TYPE_CHECKING:
    from .buffer import (
        Buffer,
        CombineResult,
        Config,
        DispatchHandle,
        DispatchResult,
        LayoutResult,
        SupportedDtypes,
        topk_idx_t,
    )
    from .utils import EventHandle, EventOverlap


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'uccl_moe' has no attribute {name!r}")
    try:
        loaded = importlib.import_module(f".{module}", __name__)
    except ModuleNotFoundError as e:
        if e.name != "torch":
            raise
        # the launcher runs without torch; the API does not: say what to install instead of a bare import error
        raise ModuleNotFoundError(
            f"uccl_moe.{name} needs PyTorch, which is not installed in this environment: pip install torch (on a "
            f"CPU-only machine: pip install torch --index-url https://download.pytorch.org/whl/cpu), or install "
            f"uccl-moe with its [train] extra", name="torch") from e
    value = getattr(loaded, name)
    globals()[name] = value
    return value


__all__ = [
    "Buffer",
    "Config",
    "DispatchHandle",
    "DispatchResult",
    "CombineResult",
    "LayoutResult",
    "SupportedDtypes",
    "EventHandle",
    "EventOverlap",
    "topk_idx_t",
    "UcclMoeError",
    "InvalidUsageError",
    "InvalidTypeError",
    "CommTimeoutError",
    "TransportError",
    "CudaError",
    "InternalError",
]
