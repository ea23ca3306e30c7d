"""The plain calls on a short host path: a cached dispatch and a combine with every optional argument at its default
(what the bench's default mode calls, and DeepEP clients' backward passes: a cached dispatch per layer and step).

Why: where the host enqueues slower than the GPU runs (the bench's default mode, a host-bound step), the GPU waits for
what the host does before an op's first copy and kernel, and Buffer's checks were most of it (docs/benchmarks.md,
"The default mode pays the host time"). Every check of such a call is a function of the inputs' structure (type,
dtype, shape, strides, device), the handle's shapes, ``Buffer.num_sms``, the group's preset row and the Buffer's fixed
state, never of values; the rows a handle received change with the routing, so the key leaves them out and a
combine checks its row count (and x's contiguity, which a row count can change) per call. So
once the full path accepted a structure, :func:`remember` keeps its key with the config it resolved, and a later
call with the same key skips those checks. What depends on the call itself still runs every time: the Buffer is
alive, the handle came from a Buffer over this group (its tag), a combine's rows are not the Buffer's own memory (a
get_combine_buffer view takes the full path), and the backend's own decisions (knobs, fits). A key not yet seen, or
any argument away from its default, takes the full path, which raises what it raises: the short path never raises
a check's error itself. ``UCCL_MOE_PLAIN_CALLS=0`` sends every call down the full path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from . import env, streams, tuning
from ._checks import HANDLE_KEY_ATTR
from .results import CombineResult, DispatchHandle, DispatchResult

if TYPE_CHECKING:
    from .buffer import Buffer

MAX_KEYS = 64  # structures remembered per Buffer (a model has a few per layer shape)


def _tensor_key(t: torch.Tensor) -> tuple[Any, ...]:
    return type(t), t.dtype, t.shape, t.stride(), t.device


def dispatch_key(x: Any, handle: Any, num_sms: int) -> tuple[Any, ...] | None:
    """The structure a cached dispatch's checks depend on: x (or the FP8 pair), the handle's lanes and tokens (not its
    received rows, which change with the routing of every layer and step) and ``Buffer.num_sms``; None where x or
    the handle is not of a shape the API takes (the full path says why)."""
    try:
        if type(x) is tuple:
            if len(x) != 2 or not isinstance(x[0], torch.Tensor) or not isinstance(x[1], torch.Tensor):
                return None
            rows: tuple[Any, ...] = (_tensor_key(x[0]), _tensor_key(x[1]))
        elif isinstance(x, torch.Tensor):
            rows = (_tensor_key(x),)
        else:
            return None
        return ("dispatch", num_sms, *rows, handle[1].shape, handle[4].shape)
    except (AttributeError, TypeError, IndexError, KeyError):  # not a handle: the full path names what it is
        return None


def combine_key(x: Any, handle: Any, num_sms: int) -> tuple[Any, ...] | None:
    """The structure a plain combine's checks depend on, less x's row count (the rows received, which change with the
    routing: the short path checks them and x's contiguity per call); None where it is not a tensor and handle."""
    if not isinstance(x, torch.Tensor):
        return None
    try:
        return ("combine", num_sms, type(x), x.dtype, x.shape[1:], x.stride(), x.device, handle[1].shape,
                handle[4].shape)
    except (AttributeError, TypeError, IndexError, KeyError):
        return None


def remember(buf: Buffer, key: tuple[Any, ...] | None, config: Any) -> None:
    """Keep `key` (a structure the full path just accepted) with the config it resolved from the group's preset row;
    a Buffer that met MAX_KEYS structures starts afresh."""
    if key is None:
        return
    plans = buf._plain_keys
    if key not in plans and len(plans) >= MAX_KEYS:
        plans.clear()
    plans[key] = (config, tuning.preset_for(buf.group_size))


def _config(buf: Buffer, key: tuple[Any, ...] | None) -> Any:
    """The config remembered with `key`, while the group's preset row is still the one it came from (a row replaced
    in uccl_moe.tuning resolves afresh on the full path); None otherwise."""
    plan = buf._plain_keys.get(key) if key is not None else None
    return plan[0] if plan is not None and tuning.preset_for(buf.group_size) is plan[1] else None


def _own_handle(buf: Buffer, handle: Any) -> DispatchHandle | None:
    """`handle` as a DispatchHandle where a dispatch of a Buffer over this group made it (its tag), else None."""
    if type(handle) is DispatchHandle:
        h = handle
    elif type(handle) is tuple and len(handle) == 6:
        h = DispatchHandle(*handle)
    else:
        return None
    return h if getattr(h[0], HANDLE_KEY_ATTR, None) == buf._handle_key else None


def cached_dispatch(buf: Buffer, x: Any, handle: Any, expert_alignment: Any, num_worst_tokens: Any,
                    num_sms: int) -> DispatchResult | None:
    """A cached dispatch with the defaults (config None, no event, synchronous) whose structure the full path
    accepted before (`num_sms`: ``Buffer.num_sms``, which the full path's default config takes); None: take the full
    path."""
    backend = buf._backend
    if backend is None or not (type(expert_alignment) is int and expert_alignment >= 1
                               and type(num_worst_tokens) is int and num_worst_tokens >= 0) \
            or not env.get("PLAIN_CALLS"):
        return None
    config = _config(buf, dispatch_key(x, handle, num_sms))
    h = _own_handle(buf, handle) if config is not None else None
    if h is None:
        return None
    data, scales = x if type(x) is tuple else (x, None)
    on_caller = buf._begin(None, False, False)
    with streams.op_context(buf._comm, on_caller):
        recv_x, recv_scales = backend.cached_dispatch(data, scales, h, config)
    event = buf._finish(False, [data, scales], [recv_x, recv_scales], on_caller, h)
    return DispatchResult(recv_x if recv_scales is None else (recv_x, recv_scales), None, None, None, None, event)


def combine(buf: Buffer, x: Any, handle: Any, num_sms: int) -> CombineResult | None:
    """A combine with the defaults (no top-k weights, bias or event, synchronous) of a contiguous tensor with one row
    per received token that is not the Buffer's view, whose structure the full path accepted before (`num_sms` as
    for cached_dispatch); None: take the full path."""
    backend = buf._backend
    if backend is None or not env.get("PLAIN_CALLS"):
        return None
    config = _config(buf, combine_key(x, handle, num_sms))
    h = _own_handle(buf, handle) if config is not None else None
    if h is None or x.shape[0] != h.recv_src_idx.shape[0] or not x.is_contiguous():
        return None
    view = buf._combine_view
    if view is not None and x.untyped_storage().data_ptr() == view[0]:
        return None  # the view's own rules (overwritten, another handle's) are the full path's
    on_caller = buf._begin(None, False, False)
    with streams.op_context(buf._comm, on_caller):
        combined, combined_w = backend.combine(x, h, None, (None, None), config)
    event = buf._finish(False, [x, None, None, None], [combined, combined_w], on_caller, h)
    return CombineResult(combined, combined_w, event)
