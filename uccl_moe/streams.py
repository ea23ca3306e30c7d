"""A Buffer's comm stream and its joins with the caller's stream, at a low host cost: the one owner of an op's
stream joins (:func:`begin_op`, :func:`op_context`, :func:`finish_op`; ``Buffer`` calls them, the native side only
records and waits, ``_C.stream_join``).

Every dispatch and combine joins the comm stream to the caller's stream, makes the comm stream current while it
allocates and launches, and (unless ``async_finish``) makes the caller's stream wait for it. Through torch's Python
stream API that is three ``current_stream()`` lookups, two Event record/wait pairs and two ``set_stream`` calls per
op, a large share of a small op's host time (``tools/device/host_parts.py``; figures: docs/benchmarks.md).

:class:`CommStream` does the same through torch's raw stream getter/setter and one C++ call per join
(``_C.stream_join``: event record, then stream wait) when the caller's current device is the Buffer's and this build
has a GPU backend. Otherwise (a caller on another device, a build without GPU support) it goes through torch's public
API, as before.

A synchronous op without ``previous_event`` (``async_finish=False``, ``allocate_on_comm_stream=False``) needs no comm
stream at all: the caller's stream would wait for it anyway. By default (``UCCL_MOE_CALLER_STREAM_OPS=1``; 0 turns it
off), on the raw path and outside CUDA-graph capture, it runs on the caller's stream itself
(:meth:`CommStream.runs_on_caller`), which saves the stream switch and, above all, the
``record_stream`` of every output (outputs allocated on the comm stream must be marked used by the caller's stream,
and each mark costs the caching allocator an event record when freed and an event query at a later allocation). Two
joins keep such an op in order with the Buffer's other ops, as if it ran on the comm stream: the caller's stream
first waits for the comm stream (skipped when nothing was enqueued there since the caller's stream last waited), and
the comm stream then waits for the op, so later ops, and work a caller puts on ``get_comm_stream()``, come after it.
Such an op runs at the caller's stream priority, not the comm stream's high priority, so concurrent work on other
streams can delay its kernels (the caller's stream waits for them either way).
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from . import env
from .utils import EventHandle, EventOverlap

log = logging.getLogger("uccl_moe.streams")


def _destroy_events(events: tuple[int, ...]) -> None:
    from . import _C

    for e in events:
        _C.join_event_destroy(e)


def _torch_raw_api() -> tuple[Any, Any, Any, Any] | None:
    """torch's private current-stream getters/setter and capture query (stable across torch 2.x; None if this torch
    lacks one)."""
    names = ("_cuda_getCurrentStream", "_cuda_setStream", "_cuda_getCurrentRawStream", "_cuda_isCurrentStreamCapturing")
    fns = tuple(getattr(torch._C, n, None) for n in names)
    return None if any(f is None for f in fns) else fns  # type: ignore[return-value]


class CommStream:
    """The comm stream of one Buffer on `device` (a high-priority ``torch.cuda.Stream``), with the joins and the
    stream switch every op makes. Call :meth:`close` when done (it frees the join events)."""

    def __init__(self, device: torch.device) -> None:
        self.index = int(device.index)
        self.stream = torch.cuda.Stream(device=device, priority=-1)
        self._key = (self.stream.stream_id, self.stream.device_index, self.stream.device_type)
        self._raw = int(self.stream.cuda_stream)
        # Reused for every join (a wait binds to the record made just before it, so reuse is safe).
        self._torch_in, self._torch_out = torch.cuda.Event(), torch.cuda.Event()
        from . import _C  # here, not at import: uccl_moe.buffer explains a missing native module first

        api = _torch_raw_api() if _C.gpu_backend() != "none" else None
        self._events: tuple[int, int] | None = None
        if api is not None:
            self._get, self._set, self._get_raw, self._capturing = api
            # The caller's current device: torch's raw getter where it has one (CUDA is initialised here: this object
            # made a stream, so torch.cuda.current_device's lazy-init checks would only repeat themselves).
            self._device: Any = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device
            self._stream_join = _C.stream_join
            try:
                self._events = self._create_events(_C)
            except Exception as e:  # noqa: BLE001 - e.g. a driver older than this build's runtime: torch's path
                log.debug("CommStream on cuda:%d takes torch's stream API (no join events: %s)", self.index, e)
        # Freed by close(), or when this object is collected (a Buffer dropped without destroy()); not at interpreter
        # exit, when the CUDA context may already be gone.
        self._finalizer = weakref.finalize(self, _destroy_events, self._events or ())
        self._finalizer.atexit = False
        self._caller_cache: tuple[Any, Any] | None = None  # (raw key, torch.cuda.Stream): one attribute, one read
        # The raw caller stream that everything enqueued on the comm stream so far is ordered before (it waited for
        # the comm stream, or an op ran on it last), or None: begin_on_caller skips its join for that stream.
        self._clear_for: int | None = None
        #: Set once get_comm_stream() handed the stream out: a caller may enqueue work there, so every op joins.
        self.exposed = False
        self._caller_ops = bool(env.get("CALLER_STREAM_OPS"))
        #: Set once an op ran on a caller's stream: its outputs (a handle among them) live in that stream's memory
        #: pool, so a later asynchronous op must mark the handle it reads used by the comm stream (Buffer._finish).
        self.ran_on_caller = False

    def _create_events(self, c: Any) -> tuple[int, int]:
        first = int(c.join_event_create(self.index))
        try:
            return first, int(c.join_event_create(self.index))
        except BaseException:
            c.join_event_destroy(first)
            raise

    def close(self) -> None:
        """Free the join events (idempotent); the stream itself is torch's."""
        self._events = None
        self._finalizer()

    def _fast(self) -> bool:
        """The raw path applies: the build and torch support it, and the caller is on this stream's device."""
        return self._events is not None and self._device() == self.index

    def caller(self) -> Any:
        """The caller's current stream on its current device (``torch.cuda.current_stream()``); the object is cached
        while the caller stays on the same stream."""
        if not self._fast():
            return torch.cuda.current_stream(torch.cuda.current_device())
        key = self._get(self.index)
        cache = self._caller_cache  # read once: another thread may replace it meanwhile
        if cache is None or cache[0] != key:
            cache = (key, torch.cuda.Stream(stream_id=key[0], device_index=key[1], device_type=key[2]))
            self._caller_cache = cache
        return cache[1]

    def wait_for_caller(self) -> None:
        """The comm stream waits for the work enqueued on the caller's current stream so far."""
        self._clear_for = None
        if self._fast():
            assert self._events is not None
            self._stream_join(self._raw, int(self._get_raw(self.index)), self._events[0])
        else:
            self._join(self.stream, torch.cuda.current_stream(torch.cuda.current_device()), self._torch_in)

    def wait_event(self, handle: Any) -> None:
        """The comm stream waits for `handle` (a :class:`uccl_moe.utils.EventHandle`: an op's ``previous_event``)."""
        self._clear_for = None
        handle.stream_wait(self.stream)

    def caller_waits(self) -> None:
        """The caller's current stream waits for the work enqueued on the comm stream so far."""
        if self._fast():
            assert self._events is not None
            caller = int(self._get_raw(self.index))
            self._stream_join(caller, self._raw, self._events[1])
            # (a wait made while capturing a CUDA graph exists only in the graph: it orders nothing eagerly)
            self._clear_for = caller if self._caller_ops and not self._capturing() else None
        else:
            self._clear_for = None
            self._join(torch.cuda.current_stream(torch.cuda.current_device()), self.stream, self._torch_out)

    def runs_on_caller(self) -> bool:
        """Whether a synchronous op without ``previous_event`` runs on the caller's stream: UCCL_MOE_CALLER_STREAM_OPS
        is on, the raw path applies, and the caller's stream is not capturing a CUDA graph (there the comm stream forks
        from and joins back into the capture, as for any op)."""
        return self._caller_ops and self._fast() and not self._capturing()

    def begin_on_caller(self) -> int:
        """Start an op on the caller's stream: it waits for the comm stream unless nothing was enqueued there since
        it last did. Returns the caller's raw stream, for :meth:`end_on_caller`."""
        assert self._events is not None
        self.ran_on_caller = True
        caller = int(self._get_raw(self.index))
        if caller != self._clear_for or self.exposed:
            self._stream_join(caller, self._raw, self._events[1])
        return caller

    def end_on_caller(self, caller: int) -> None:
        """End an op that ran on the caller's stream `caller`: the comm stream waits for it."""
        assert self._events is not None
        self._stream_join(self._raw, caller, self._events[0])
        self._clear_for = caller

    def _join(self, waiter: Any, stream: Any, event: Any) -> None:
        """torch's path: through the reused `event` on this device, else through a fresh event bound to the caller's
        device (Stream.wait_stream)."""
        if torch.cuda.current_device() == self.index:
            event.record(stream)
            waiter.wait_event(event)
        else:
            waiter.wait_stream(stream)

    def enter(self) -> Any:
        """Make the comm stream current (allocations and launches go to it); returns what :meth:`leave` restores."""
        if self._fast():
            prev = self._get(self.index)
            self._set(stream_id=self._key[0], device_index=self._key[1], device_type=self._key[2])
            return prev
        ctx = torch.cuda.stream(self.stream)  # restores the current stream of both devices
        ctx.__enter__()
        return ctx

    def leave(self, token: Any) -> None:
        """Restore the caller's stream that :meth:`enter` replaced."""
        if isinstance(token, tuple):
            self._set(stream_id=token[0], device_index=token[1], device_type=token[2])
        else:
            token.__exit__(None, None, None)


# ---------------------------------------------------------------- an op's joins (Buffer's op flow calls these)
def begin_op(comm: CommStream | None, previous_event: EventOverlap | None, async_finish: bool,
             allocate_on_comm_stream: bool) -> int | None:
    """Join the comm stream to the caller's stream (or to `previous_event`) before an op.

    Returns the caller's raw stream if the op runs there instead (synchronous, no previous_event, no
    allocate_on_comm_stream: see the module notes), else None; pass it on to :func:`op_context` and
    :func:`finish_op`. `comm` is None on CPU."""
    if comm is None:
        return None
    if previous_event is None and not async_finish and not allocate_on_comm_stream and comm.runs_on_caller():
        return comm.begin_on_caller()
    if previous_event is not None and previous_event.event is not None:
        comm.wait_event(previous_event.event)
    else:
        comm.wait_for_caller()
    return None


def op_context(comm: CommStream | None, on_caller: int | None) -> contextlib.AbstractContextManager[Any]:
    """The comm stream is current inside (allocations and launches go to it); the caller's stream after. An op
    that runs on the caller's stream (`on_caller`, from :func:`begin_op`) stays there, and the comm stream waits for
    it after. (Classes, not a generator context manager: this runs on every op, and contextlib's machinery costs
    host time.)"""
    if comm is None:
        return _STAY
    if on_caller is not None:
        return _OnCallerStream(comm, on_caller)
    return _OnCommStream(comm)


def finish_op(comm: CommStream | None, async_finish: bool, inputs: Sequence[Any], outputs: Sequence[Any],
              on_caller: int | None, handle_tensors: Callable[[], Sequence[torch.Tensor]] | None = None
              ) -> EventOverlap:
    """Close an op: event on the comm stream, or make the compute stream wait (DeepEP semantics).

    Each tensor is marked used by the stream it was not allocated on: outputs (allocated on the comm stream)
    by the compute stream that consumes them; with async_finish, inputs (allocated on the compute stream) by
    the comm stream that may still be reading them when the caller frees them. An op that ran on the caller's
    stream (`on_caller`, from :func:`begin_op`) used one stream only (its :func:`op_context` joined the comm stream
    after it). The tensors of the handle a cached dispatch or a combine read (`handle_tensors`) count as inputs once
    a dispatch may have made them on a caller's stream (UCCL_MOE_CALLER_STREAM_OPS); on the comm stream, where they
    are made otherwise, they need no mark.
    """
    if comm is None:
        return EventOverlap(EventHandle() if async_finish else None)
    if on_caller is not None:
        return EventOverlap(None)
    if async_finish and handle_tensors is not None and comm.ran_on_caller:
        inputs = [*inputs, *handle_tensors()]
    compute = comm.caller()
    for t in _flatten(outputs):
        if t.device.type == "cuda":
            t.record_stream(compute)
    if async_finish:
        for t in _flatten(inputs):
            if t.device.type == "cuda":
                t.record_stream(comm.stream)
        return EventOverlap(EventHandle(comm.stream))
    comm.caller_waits()
    return EventOverlap(None)


class _OnCommStream:
    """``with _OnCommStream(comm):`` makes the comm stream current inside and restores the caller's stream after."""

    __slots__ = ("comm", "token")

    def __init__(self, comm: CommStream) -> None:
        self.comm = comm

    def __enter__(self) -> None:
        self.token = self.comm.enter()

    def __exit__(self, *exc: Any) -> None:
        self.comm.leave(self.token)


class _OnCallerStream:
    """``with _OnCallerStream(comm, caller):`` around an op on the caller's stream: the comm stream waits for what it
    enqueued there after, also when the op raises (later ops on the comm stream must not overlap it)."""

    __slots__ = ("comm", "caller")

    def __init__(self, comm: CommStream, caller: int) -> None:
        self.comm, self.caller = comm, caller

    def __enter__(self) -> None:
        pass

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if exc_type is None:
            self.comm.end_on_caller(self.caller)
            return
        try:
            self.comm.end_on_caller(self.caller)
        except Exception as e:  # noqa: BLE001 - e.g. a context a trapped kernel broke: the op's error is the news
            log.debug("joining the comm stream after a failed op failed too: %s", e)


_STAY = contextlib.nullcontext()  # an op that stays on the current stream (reusable: it holds no state)


def _flatten(items: Sequence[Any]) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for t in items:
        if isinstance(t, torch.Tensor):
            out.append(t)
        elif isinstance(t, (tuple, list)):
            out.extend(_flatten(t))
    return out
