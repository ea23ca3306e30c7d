"""Events and overlap helpers, DeepEP-V1 compatible (``deep_ep.utils.EventHandle`` / ``EventOverlap``).

On CUDA an :class:`EventHandle` is a recorded ``torch.cuda.Event``. On CPU (gloo, reference backend) every
operation is synchronous, so a handle is already complete and waiting on it is a no-op: code written for GPUs
(Megatron's ``EventOverlap(EventHandle())`` pattern) runs unchanged on CPU.
"""

from __future__ import annotations

import socket
import weakref
from collections.abc import Iterable
from typing import Any

import torch


def page_bytes(n: int) -> int:
    """`n` bytes rounded up to a multiple of 4096: what the size hints and the default buffer sizes hand out."""
    return -(-int(n) // 4096) * 4096


def current_stream() -> Any:
    """``torch.cuda.current_stream()`` of the current device. Naming the device index skips torch's device lookup
    (availability and environment checks on every call), a measurable share of a small dispatch's host time."""
    return torch.cuda.current_stream(torch.cuda.current_device())


_GET_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # torch's private getter (absent: None)


def current_raw_stream(device_index: int) -> int:
    """The cudaStream_t / hipStream_t of the current stream on `device_index`, as an int for the kernels."""
    if _GET_RAW_STREAM is not None:
        return int(_GET_RAW_STREAM(device_index))
    return int(torch.cuda.current_stream(device_index).cuda_stream)


class EventHandle:
    """A point on a stream.

    ``EventHandle()`` records on the current CUDA stream; ``EventHandle(stream)`` records on ``stream``.
    Without CUDA it stands for "now" and is always complete.
    """

    def __init__(self, stream: Any = None) -> None:
        self.event: torch.cuda.Event | None = None
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            self.event = torch.cuda.Event()
            self.event.record(stream if stream is not None else current_stream())

    def current_stream_wait(self) -> None:
        """Make the current stream wait for this event (no host blocking)."""
        if self.event is not None:
            current_stream().wait_event(self.event)

    def stream_wait(self, stream: Any) -> None:
        """Make `stream` wait for this event."""
        if self.event is not None and stream is not None:
            stream.wait_event(self.event)

    def synchronize(self) -> None:
        """Block the host until the event completed."""
        if self.event is not None:
            self.event.synchronize()

    def query(self) -> bool:
        return True if self.event is None else bool(self.event.query())


class EventOverlap:
    """An optional event plus tensors kept alive until it is waited on.

    ``with ev: work()`` runs ``work`` on the current stream and then waits on the event, so the
    communication it stands for overlaps ``work``. ``extra_tensors`` keeps tensors alive without
    ``record_stream`` (safe under CUDA-graph capture).
    """

    def __init__(self, event: EventHandle | None = None, extra_tensors: Iterable[torch.Tensor] | None = None) -> None:
        self.event = event
        self.extra_tensors = tuple(extra_tensors) if extra_tensors is not None else None

    def current_stream_wait(self) -> None:
        """Make the current stream wait for the event. Raises if there is none (``async_finish=False`` op)."""
        if self.event is None:
            raise ValueError(
                "EventOverlap has no event: the operation ran with async_finish=False and is already complete "
                "on the current stream"
            )
        self.event.current_stream_wait()

    def __enter__(self) -> EventOverlap:
        return self

    def __exit__(self, exc_type: Any, exc_value: Any, traceback: Any) -> None:
        if self.event is not None:
            self.event.current_stream_wait()


_SAME_SIZE_TYPESTR = {1: "|u1", 2: "<i2", 4: "<i4", 8: "<i8"}
_SAME_SIZE_DTYPE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class _DeviceMemory:
    """``__cuda_array_interface__`` (v3) of `nbytes` at device pointer `ptr`, for ``torch.as_tensor``."""

    def __init__(self, ptr: int, shape: tuple[int, ...], typestr: str) -> None:
        self.__cuda_array_interface__ = {"shape": shape, "typestr": typestr, "data": (ptr, False), "version": 3}


def tensor_at(ptr: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A contiguous tensor of `shape` and `dtype` over device memory at `ptr` that torch does not own (no copy, no
    free): valid only while the memory is. Built through an integer type of the same size (the interface has no
    bfloat16), then viewed as `dtype`."""
    size = dtype.itemsize
    raw = torch.as_tensor(_DeviceMemory(int(ptr), tuple(int(s) for s in shape), _SAME_SIZE_TYPESTR[size]),
                          dtype=_SAME_SIZE_DTYPE[size], device=device)
    return raw.view(dtype)


class RoutingMemo:
    """The last top-k tensor a range check passed, so that the layout and the dispatch of one routing check it once:
    it holds a tensor that is the same object, at the same version (in-place writes bump it), for the same expert
    count. A tensor made under torch.inference_mode() keeps no version: it is never held, so it is checked at every
    call."""

    __slots__ = ("_last",)

    def __init__(self) -> None:
        self._last: tuple[weakref.ref[torch.Tensor], int, int] | None = None

    def holds(self, t: torch.Tensor, num_experts: int) -> bool:
        last = self._last
        return (last is not None and not t.is_inference() and last[0]() is t
                and last[1:] == (t._version, num_experts))

    def remember(self, t: torch.Tensor, num_experts: int) -> None:
        if not t.is_inference():
            self._last = (weakref.ref(t), t._version, num_experts)


def host_ints(t: torch.Tensor) -> list[int]:
    """The values of integer tensor `t` (any device) as Python ints, read without a pageable device-to-host copy.

    A pageable copy (``.cpu()``, ``.item()``) holds a CUDA driver lock while it waits for its stream; the loopback
    transport's GPU-copy mode needs that lock in the proxy thread while our kernels wait for its copies. So device
    values go through pinned memory and an event wait.
    """
    if not t.is_cuda:
        return [int(v) for v in t.reshape(-1).tolist()]
    # device="cpu" explicitly: under torch.set_default_device("cuda") (DeepEP's test harness sets it) a bare
    # torch.empty would be a CUDA tensor, which cannot be pinned.
    host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
    host.copy_(t, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    done.synchronize()
    return [int(v) for v in host.reshape(-1).tolist()]


def check_nvlink_connections(group: Any) -> None:
    """DeepEP-compatible check; raises if ranks of `group` on this host cannot reach each other by P2P.

    Only GPUs of the same host are checked (PCIe-only machines support at most 2 ranks, as in DeepEP).
    """
    if not torch.cuda.is_available():
        return
    import torch.distributed as dist

    from . import _C

    devices: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(devices, (torch.cuda.current_device(), socket.gethostname()), group=group)
    me = torch.cuda.current_device()
    host = devices[dist.get_rank(group)][1]
    for dev, h in devices:
        if h == host and not _C.can_access_peer(me, dev):
            raise RuntimeError(f"GPU {me} cannot access GPU {dev} by P2P (no NVLink/xGMI or PCIe P2P)")
