"""Plain calls on a short host path: a cached dispatch without config, and a combine without bias or config (what the
bench's default mode calls each time, and Megatron's dispatcher each layer and step: the forward combine, the backward's
cached dispatch and combine with top-k weights), with any stream arguments.

Why: where the host enqueues slower than the GPU runs (the bench's default mode, a host-bound step), the GPU waits for
what the host does before an op's first copy and kernel, and Buffer's checks were most of it (docs/benchmarks.md, "The
default mode pays the host time"). Every check of such a call is a function of the inputs' structure (type, dtype,
shape, strides, device), the handle's shapes, ``Buffer.num_sms``, the group's preset row and the Buffer's fixed state,
never of values; the rows a handle received change with the routing, so the key leaves them out and a combine checks its
row counts (and the contiguity, which a row count can change) per call. So once the full path accepted a structure,
:func:`remember` keeps its key with the config it resolved, and a later call with the same key skips those checks. What
depends on the call itself still runs every time, through the full path's own checks (the stream arguments' types,
the handle's tag, a get_combine_buffer view's validity, each raising what the full path raises where every check before
it passes), and the Buffer is alive, the row counts, the streams' joins and events as the full path makes them, and the
backend's own decisions (knobs, fits). A key not yet seen, a config, a bias or rows the key does not cover take the
full path, which raises what it raises. ``UCCL_MOE_PLAIN_CALLS=0`` sends every call down the full path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from . import _checks, env, streams, tuning
from .results import CombineResult, DispatchResult

if TYPE_CHECKING:
    from .buffer import Buffer

MAX_KEYS = 64  # structures remembered per Buffer (a model has a few per layer shape)


def _tensor_key(t: torch.Tensor, first_dim: int = 0) -> tuple[Any, ...]:
    """What the checks read of `t`: type, dtype, shape (from `first_dim`: 1 drops the row count), strides, device."""
    return type(t), t.dtype, t.shape[first_dim:], t.stride(), t.device


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


def combine_key(x: Any, topk_weights: Any, handle: Any, num_sms: int) -> tuple[Any, ...] | None:
    """The structure a combine's checks depend on, less the row counts of x and the top-k weights (the rows received,
    which change with the routing: the short path checks them and the tensors' contiguity per call); None where they
    are not tensors and a handle."""
    if not isinstance(x, torch.Tensor) or not (topk_weights is None or isinstance(topk_weights, torch.Tensor)):
        return None
    try:
        w = None if topk_weights is None else _tensor_key(topk_weights, 1)
        return ("combine", num_sms, _tensor_key(x, 1), w, handle[1].shape, handle[4].shape)
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


def cached_dispatch(buf: Buffer, x: Any, handle: Any, expert_alignment: Any, num_worst_tokens: Any, num_sms: int,
                    previous_event: Any, async_finish: Any, allocate_on_comm_stream: Any) -> DispatchResult | None:
    """A cached dispatch without config whose structure the full path accepted before (`num_sms`: ``Buffer.num_sms``,
    which the full path's default config takes), on the streams as the full path runs it; None: take the full path."""
    backend = buf._backend
    if backend is None or not env.get("PLAIN_CALLS") or not (
            type(expert_alignment) is int and expert_alignment >= 1 and type(num_worst_tokens) is int
            and num_worst_tokens >= 0):
        return None
    _checks.check_async(async_finish, allocate_on_comm_stream)  # (the full path's first check, the same error)
    config = _config(buf, dispatch_key(x, handle, num_sms))
    if config is None:
        return None
    h = buf._check_handle(handle)  # every earlier check of the full path passed for this structure
    data, scales = x if type(x) is tuple else (x, None)
    on_caller = buf._begin(previous_event, async_finish, allocate_on_comm_stream)
    with streams.op_context(buf._comm, on_caller):
        recv_x, recv_scales = backend.cached_dispatch(data, scales, h, config)
    event = buf._finish(async_finish, [data, scales], [recv_x, recv_scales], on_caller, h)
    return DispatchResult(recv_x if recv_scales is None else (recv_x, recv_scales), None, None, None, None, event)


def combine(buf: Buffer, x: Any, handle: Any, topk_weights: Any, num_sms: int, previous_event: Any,
            async_finish: Any, allocate_on_comm_stream: Any) -> CombineResult | None:
    """A combine without bias or config whose structure the full path accepted before, of contiguous rows (and top-k
    weights), one per received token (`num_sms` as for cached_dispatch); None: take the full path."""
    backend = buf._backend
    if backend is None or not env.get("PLAIN_CALLS"):
        return None
    _checks.check_async(async_finish, allocate_on_comm_stream)
    config = _config(buf, combine_key(x, topk_weights, handle, num_sms))
    if config is None:
        return None
    h = buf._check_handle(handle)
    rows = h.recv_src_idx.shape[0]
    if x.shape[0] != rows or not x.is_contiguous() or topk_weights is not None and (
            topk_weights.shape[0] != rows or not topk_weights.is_contiguous()):
        return None
    from_view = _checks.check_combine_view(buf._combine_view, buf._op_seq, x, h)  # the full path's last check
    on_caller = buf._begin(previous_event, async_finish, allocate_on_comm_stream, uses_nvl_buffer=not from_view)
    with streams.op_context(buf._comm, on_caller):
        combined, combined_w = backend.combine(x, h, topk_weights, (None, None), config)
    event = buf._finish(async_finish, [x, topk_weights, None, None], [combined, combined_w], on_caller, h)
    return CombineResult(combined, combined_w, event)
