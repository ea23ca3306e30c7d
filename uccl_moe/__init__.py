"""uccl-moe: portable expert-parallel dispatch/combine for MoE training (DeepEP-V1 compatible).

``from uccl_moe import Buffer`` is a drop-in for ``deep_ep.Buffer``; see README.md.
"""

from __future__ import annotations

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

from .buffer import Buffer, Config, DispatchHandle, DispatchResult, topk_idx_t  # noqa: E402
from .utils import EventHandle, EventOverlap  # noqa: E402

__all__ = [
    "Buffer",
    "Config",
    "DispatchHandle",
    "DispatchResult",
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
