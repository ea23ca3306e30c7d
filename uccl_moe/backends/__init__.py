"""Backends behind :class:`uccl_moe.Buffer`, registered by name (see :func:`register_backend`)."""

from __future__ import annotations

from .base import (
    Backend,
    BufferContext,
    DispatchRequest,
    available_backends,
    backend_factory,
    create_backend,
    register_backend,
)

__all__ = ["Backend", "BufferContext", "DispatchRequest", "available_backends", "backend_factory", "create_backend",
           "register_backend"]
