"""The contract between :class:`uccl_moe.Buffer` and its backends.

Notation: T = tokens of this rank, H = hidden, K = top-k, E = experts, R = ranks, E_loc = E / R,
T_recv = rows this rank receives.

Division of labour:
- ``Buffer`` validates every argument (types, shapes, ranges, buffer sizes, handle ownership) *before* a backend
  runs, and implements the DeepEP stream/event semantics: when a backend method runs, the current stream is
  the op's stream, already in order after ``previous_event`` (or the compute stream) and the Buffer's earlier ops:
  the comm stream, or the caller's own stream for a synchronous op (``Buffer``'s module notes). Backends enqueue
  work on the current stream and allocate outputs there. They never validate user input again and never switch
  streams.
- Handles reach a backend as :class:`uccl_moe.DispatchHandle` (fields by name); ``handle_num_sms``,
  ``handle_tensors`` and ``combine_buffer_fits`` also take a plain tuple in DeepEP's order
  (``uccl_moe.results.handle_field``).
- A backend computes exactly DeepEP-V1 semantics (see ``reference.py``, the oracle) and returns plain tensors.
"""

from __future__ import annotations

import abc
import dataclasses
import importlib
from collections.abc import Callable
from typing import Any, ClassVar

import torch

from ..errors import InvalidUsageError
from ..results import DispatchHandle
from ..topology import Topology


@dataclasses.dataclass
class BufferContext:
    """What a backend knows about the Buffer it serves."""

    group: Any  # torch.distributed.ProcessGroup
    topology: Topology
    num_nvl_bytes: int
    num_rdma_bytes: int
    device: torch.device  # backends enqueue on the current stream, which Buffer chose for the op

    @property
    def rank(self) -> int:
        return self.topology.rank

    @property
    def num_ranks(self) -> int:
        return self.topology.num_ranks


@dataclasses.dataclass
class DispatchRequest:
    """A validated non-cached dispatch.

    x: [T, H] bfloat16 (or float8_e4m3fn with x_scales).
    x_scales: None, or [T, H/128] float32 / int32 (any strides), or [T] (one scale per token).
    topk_idx: [T, K] int64, -1 = unused slot; None when dispatching without top-k.
    topk_weights: [T, K] float32, or None (given together with topk_idx).
    num_tokens_per_rank: [R] int32; num_tokens_per_rdma_rank: [num_nodes] int32 or None;
    is_token_in_rank: [T, R] bool; num_tokens_per_expert: [E] int32.
    """

    x: torch.Tensor
    x_scales: torch.Tensor | None
    topk_idx: torch.Tensor | None
    topk_weights: torch.Tensor | None
    num_tokens_per_rank: torch.Tensor
    num_tokens_per_rdma_rank: torch.Tensor | None
    is_token_in_rank: torch.Tensor
    num_tokens_per_expert: torch.Tensor
    expert_alignment: int
    num_worst_tokens: int
    config: Any  # uccl_moe.Config

    @property
    def num_experts(self) -> int:
        return int(self.num_tokens_per_expert.numel())


class Backend(abc.ABC):
    """One implementation of HT dispatch/combine."""

    name: ClassVar[str]
    #: dtypes of x this backend dispatches (FP8 always comes with scales) and combines.
    supported_dispatch_dtypes: ClassVar[tuple[torch.dtype, ...]] = (
        torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2)
    supported_combine_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.bfloat16, torch.float16, torch.float32)
    #: The backend checks topk_idx value ranges itself (UCCL_MOE_CHECK_INPUTS): the native kernels on the GPU
    #: (raise_device_faults reports them), the reference backend of a group in its agreement step (every rank raises);
    #: else Buffer checks them on the host, on the calling rank alone.
    checks_topk_idx_on_device: bool = False

    def __init__(self, ctx: BufferContext) -> None:
        self.ctx = ctx

    @abc.abstractmethod
    def get_dispatch_layout(
        self, topk_idx: torch.Tensor, num_experts: int
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """Returns (num_tokens_per_rank [R] int32, num_tokens_per_rdma_rank [nodes] int32 or None when one node,
        num_tokens_per_expert [E] int32, is_token_in_rank [T, R] bool)."""

    @abc.abstractmethod
    def dispatch(
        self, req: DispatchRequest
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, list[int],
               DispatchHandle]:
        """Returns (recv_x [T_recv, H], recv_x_scales or None, recv_topk_idx [T_recv, K] int64 local ids or -1,
        recv_topk_weights [T_recv, K] float32 (0 where idx is -1), num_recv_tokens_per_expert_list, handle), the
        handle built by field name (Buffer also accepts DeepEP's plain 6-tuple from a registered backend)."""

    @abc.abstractmethod
    def cached_dispatch(
        self, x: torch.Tensor, x_scales: torch.Tensor | None, handle: DispatchHandle, config: Any
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Dispatch along a previous dispatch's layout; returns (recv_x, recv_x_scales or None)."""

    @abc.abstractmethod
    def combine(
        self,
        x: torch.Tensor,
        handle: DispatchHandle,
        topk_weights: torch.Tensor | None,
        bias: tuple[torch.Tensor | None, torch.Tensor | None],
        config: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Sum each token's rows back onto its source rank, in float32, in rank order 0..R-1 (deterministic),
        plus the biases. Returns (combined_x [T, H] x.dtype, combined_topk_weights [T, K] float32 or None)."""

    def raise_device_faults(self) -> None:
        """Raise what this backend's kernels recorded about their inputs, without a device sync (called by Buffer
        at the end of every dispatch and combine, once every rank has enqueued it). Default: nothing recorded."""

    def check_config(self, config: Any) -> None:
        """Raise InvalidUsageError if this backend cannot lay out a dispatch with `config` on its device (called
        by a dispatch without a handle, before the buffer-size check, so the more basic problem is named first;
        cached dispatches and combines run on the handle's lanes). Default: anything goes."""

    def required_rdma_bytes(self, config: Any, hidden_bytes: int, num_ranks: int, ranks_per_node: int) -> int:
        """RDMA bytes per rank an op with `config` needs across nodes, checked by Buffer before the op. Default:
        DeepEP's ring-size hint (Config.get_rdma_buffer_size_hint). A backend whose staging depends on the tokens
        returns 0 and checks each dispatch itself."""
        return int(config.get_rdma_buffer_size_hint(hidden_bytes, num_ranks, ranks_per_node))

    def handle_num_sms(self, handle: tuple[Any, ...]) -> int | None:
        """The SM count that cached dispatches and combines with `handle` run on (the lanes its dispatch laid out),
        or None where they follow the config's (Buffer sizes its buffer check with it). Default: None."""
        return None

    def handle_tensors(self, handle: tuple[Any, ...]) -> list[torch.Tensor]:
        """Every tensor the device reads when a cached dispatch or a combine runs with `handle` (Buffer marks them
        used by the comm stream where that is needed). Default: the handle's own tensors."""
        return [t for t in handle if isinstance(t, torch.Tensor)]

    def combine_buffer(self, handle: DispatchHandle, hidden: int, dtype: torch.dtype) -> torch.Tensor | None:
        """The [T_recv, hidden] memory of this backend's own that a combine reads in place (Buffer.get_combine_buffer),
        or None where there is none and the caller gets a tensor of its own. Default: None."""
        return None

    def combine_buffer_fits(self, handle: tuple[Any, ...], hidden: int, num_topk: int) -> bool:
        """Whether every rank's rows of `handle` (and `num_topk` weights per row) fit that memory, the same answer on
        every rank (Buffer.combine_buffer_fits). Default: True (a tensor of the caller's always fits)."""
        return True

    def destroy(self) -> None:
        """Free native resources. Idempotent."""


_REGISTRY: dict[str, Callable[[BufferContext], Backend]] = {}
# The built-in backends, by name: imported on first use (creating the backend), not when this module is imported.
_BUILTIN = {"native": ("uccl_moe.backends.native", "NativeBackend"),
            "reference": ("uccl_moe.backends.reference", "ReferenceBackend")}


def register_backend(name: str, factory: Callable[[BufferContext], Backend]) -> None:
    """Make `factory` available as Buffer backend `name` (re-registering replaces)."""
    _REGISTRY[name] = factory


def available_backends() -> list[str]:
    """The names a Buffer's ``backend=`` takes (built-in and registered), without importing any backend."""
    return sorted(set(_REGISTRY) | set(_BUILTIN))


def backend_factory(name: str) -> Callable[[BufferContext], Backend]:
    """The factory (a Backend subclass, for the built-in ones) registered as `name`; imports a built-in one on first
    use. An unknown name raises ``InvalidUsageError`` listing the registered ones."""
    factory = _REGISTRY.get(name)
    if factory is not None:
        return factory
    if name not in _BUILTIN:
        raise InvalidUsageError(f"unknown uccl-moe backend {name!r}; registered: {available_backends()}")
    module, attr = _BUILTIN[name]
    cls: type[Backend] = getattr(importlib.import_module(module), attr)
    return _REGISTRY.setdefault(name, cls)


def create_backend(name: str, ctx: BufferContext) -> Backend:
    """A new backend `name` for the Buffer `ctx` describes."""
    return backend_factory(name)(ctx)
