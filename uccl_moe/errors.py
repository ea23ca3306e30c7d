"""The uccl-moe exception tree (short and flat).

Every error raised by uccl-moe derives from :class:`UcclMoeError`. Usage errors also derive from the builtin
``ValueError``/``TypeError`` so callers that catch those keep working. The native module maps its C++ error
codes onto these classes by name (see ``native/src/bindings/module.cc``).
"""

from __future__ import annotations

from typing import Any


class UcclMoeError(Exception):
    """Root of all uccl-moe errors."""


class InvalidUsageError(UcclMoeError, ValueError):
    """A call got arguments it cannot work with; the message names the argument and the fix."""


class InvalidTypeError(UcclMoeError, TypeError):
    """An argument has the wrong type or dtype."""


class CommTimeoutError(UcclMoeError, TimeoutError):
    """A bounded wait expired (``UCCL_MOE_TIMEOUT_S``).

    ``record`` holds the diagnostic record when one was written: rank, peer, channel, phase, the counter value
    waited for (``expected``) and the last one seen (``seen``), and the command involved.
    """

    def __init__(self, message: str, record: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.record = record


class TransportError(UcclMoeError, RuntimeError):
    """A network transport or CPU proxy failed (completion error, QP state, proxy thread died)."""


class CudaError(UcclMoeError, RuntimeError):
    """A CUDA/HIP runtime call failed."""


class SystemCallError(UcclMoeError, OSError):
    """An operating-system call failed."""


class InternalError(UcclMoeError, RuntimeError):
    """An invariant inside uccl-moe broke: a bug, please report it with the message."""


__all__ = [
    "UcclMoeError",
    "InvalidUsageError",
    "InvalidTypeError",
    "CommTimeoutError",
    "TransportError",
    "CudaError",
    "SystemCallError",
    "InternalError",
]
