"""The plain calls' short host path (uccl_moe/_plain_ops.py): a cached dispatch without config, or a combine without
bias or config, with any stream arguments, skips the full checks only for an input structure the full path accepted
before on this Buffer, makes the same calls (backend, stream joins, events) and gives the same results as the full
path, and leaves every bad input to the full path's errors."""

from __future__ import annotations

import weakref
from typing import Any

import pytest
import torch

from uccl_moe import Buffer, InvalidTypeError, InvalidUsageError, _checks, _plain_ops, tuning

T, H, E, K = 6, 256, 4, 2


@pytest.fixture()
def buf(group):
    b = Buffer(group, 1 << 22, backend="reference")
    yield b
    b.destroy()


@pytest.fixture()
def sms():
    old = Buffer.num_sms
    yield
    Buffer.num_sms = old


@pytest.fixture()
def full_path_calls(monkeypatch):
    """How many times the full path's first check ran, per op (the short path runs neither)."""
    calls = {"dispatch": 0, "combine": 0}
    split_x, check_combine_x = _checks.split_x, _checks.check_combine_x

    def counting_split_x(*a, **kw):
        calls["dispatch"] += 1
        return split_x(*a, **kw)

    def counting_combine_x(*a, **kw):
        calls["combine"] += 1
        return check_combine_x(*a, **kw)

    monkeypatch.setattr(_checks, "split_x", counting_split_x)
    monkeypatch.setattr(_checks, "check_combine_x", counting_combine_x)
    return calls


def _layout_dispatch(buf, x):
    idx = torch.randint(0, E, (T, K))
    lay = buf.get_dispatch_layout(idx, E)
    return buf.dispatch(x, num_tokens_per_rank=lay.num_tokens_per_rank, is_token_in_rank=lay.is_token_in_rank,
                        num_tokens_per_expert=lay.num_tokens_per_expert, topk_idx=idx, topk_weights=torch.rand(T, K))


def _routed_dispatch(buf, received: int):
    """A dispatch whose handle receives `received` of the T tokens (the others route nowhere: all -1)."""
    idx = torch.randint(0, E, (T, K))
    idx[received:] = -1
    lay = buf.get_dispatch_layout(idx, E)
    r = buf.dispatch(torch.randn(T, H).bfloat16(), num_tokens_per_rank=lay.num_tokens_per_rank,
                     is_token_in_rank=lay.is_token_in_rank, num_tokens_per_expert=lay.num_tokens_per_expert,
                     topk_idx=idx, topk_weights=torch.rand(T, K))
    assert r.recv_x.shape[0] == received
    return r


def _fp8(rows=T):
    return torch.randn(rows, H).to(torch.float8_e4m3fn), torch.rand(rows, H // 128)


def test_a_structure_takes_the_short_path_once_the_full_path_accepted_it(buf, full_path_calls, monkeypatch) -> None:
    r = _layout_dispatch(buf, torch.randn(T, H).bfloat16())
    x, y = torch.randn(T, H).bfloat16(), torch.randn(int(r.recv_x.shape[0]), H).bfloat16()
    first = buf.dispatch(x, handle=r.handle)
    assert full_path_calls["dispatch"] == 2  # the layout dispatch and the first cached one
    again = buf.dispatch(x, handle=r.handle)
    assert full_path_calls["dispatch"] == 2  # short path
    assert torch.equal(first.recv_x, again.recv_x) and again.handle is None and again.recv_topk_idx is None
    fresh = torch.randn(T, H).bfloat16()  # other values, same structure: still the short path, its own result
    short = buf.dispatch(fresh, handle=r.handle).recv_x
    assert full_path_calls["dispatch"] == 2
    with monkeypatch.context() as m:
        m.setenv("UCCL_MOE_PLAIN_CALLS", "0")
        assert torch.equal(short, buf.dispatch(fresh, handle=r.handle).recv_x)
    assert full_path_calls["dispatch"] == 3
    c1 = buf.combine(y, r.handle)
    c2 = buf.combine(y, r.handle)
    assert full_path_calls["combine"] == 1
    assert torch.equal(c1.combined_x, c2.combined_x) and c2.combined_topk_weights is None


def test_fp8_pairs_and_the_knob(buf, full_path_calls, monkeypatch) -> None:
    r = _layout_dispatch(buf, torch.randn(T, H).bfloat16())
    x8 = _fp8()
    got = [buf.dispatch(x8, handle=r.handle) for _ in range(3)]
    assert full_path_calls["dispatch"] == 2
    for g in got[1:]:
        assert all(torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                               b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b)
                   for a, b in zip(g.recv_x, got[0].recv_x))
    col = (x8[0], torch.rand(H // 128, T).t())  # column-major scales: another structure, the full path first
    buf.dispatch(col, handle=r.handle)
    assert full_path_calls["dispatch"] == 3
    buf.dispatch(col, handle=r.handle)
    assert full_path_calls["dispatch"] == 3
    monkeypatch.setenv("UCCL_MOE_PLAIN_CALLS", "0")
    buf.dispatch(x8, handle=r.handle)
    y = torch.randn(int(r.recv_x.shape[0]), H).bfloat16()
    buf.combine(y, r.handle)
    buf.combine(y, r.handle)
    assert full_path_calls == {"dispatch": 4, "combine": 2}


def test_bad_inputs_of_a_known_structure_still_get_the_full_paths_errors(buf, group) -> None:
    r = _layout_dispatch(buf, torch.randn(T, H).bfloat16())
    x = torch.randn(T, H).bfloat16()
    y = torch.randn(int(r.recv_x.shape[0]), H).bfloat16()
    buf.dispatch(x, handle=r.handle)
    buf.combine(y, r.handle)  # both structures known now
    with pytest.raises(InvalidUsageError, match="contiguous"):
        buf.dispatch(torch.randn(H, T).bfloat16().t(), handle=r.handle)  # same shape, other strides
    with pytest.raises(InvalidUsageError, match="tokens but the handle"):
        buf.dispatch(torch.randn(T + 1, H).bfloat16(), handle=r.handle)
    with pytest.raises(InvalidTypeError, match="dtype"):
        buf.dispatch(torch.randn(T, H).to(torch.int16), handle=r.handle)
    with pytest.raises(InvalidUsageError, match="rows but the dispatch"):
        buf.combine(torch.randn(int(r.recv_x.shape[0]) + 1, H).bfloat16(), r.handle)
    rebuilt = tuple(t.clone() for t in r.handle)  # loses its tag
    with pytest.raises(InvalidUsageError, match="not returned by a uccl_moe Buffer"):
        buf.dispatch(x, handle=rebuilt)
    with pytest.raises(InvalidUsageError, match="not returned by a uccl_moe Buffer"):
        buf.combine(y, rebuilt)
    with pytest.raises(InvalidTypeError, match="handle must be"):
        buf.combine(y, "not a handle")
    with pytest.raises((InvalidTypeError, InvalidUsageError)):
        buf.dispatch((x,), handle=r.handle)
    with pytest.raises(InvalidUsageError, match="expert_alignment"):
        buf.dispatch(x, handle=r.handle, expert_alignment=0)
    buf.destroy()
    with pytest.raises(InvalidUsageError, match="destroyed"):
        buf.dispatch(x, handle=r.handle)
    with pytest.raises(InvalidUsageError, match="destroyed"):
        buf.combine(y, r.handle)


def test_config_and_bias_take_the_full_path_stream_arguments_and_weights_the_short_one(buf, full_path_calls) -> None:
    r = _layout_dispatch(buf, torch.randn(T, H).bfloat16())
    x = torch.randn(T, H).bfloat16()
    rows = int(r.recv_x.shape[0])
    y, w = torch.randn(rows, H).bfloat16(), torch.rand(rows, K)
    buf.dispatch(x, handle=r.handle)
    buf.combine(y, r.handle)
    d0, c0 = full_path_calls["dispatch"], full_path_calls["combine"]
    buf.dispatch(x, handle=r.handle, config=Buffer.get_dispatch_config(1))
    buf.combine(y, r.handle, bias=torch.randn(T, H).bfloat16())
    buf.combine(y, r.handle, config=Buffer.get_combine_config(1))
    assert (full_path_calls["dispatch"], full_path_calls["combine"]) == (d0 + 1, c0 + 2)
    # Megatron's calls: every one with previous_event, async_finish and allocate_on_comm_stream (the same structure:
    # short at once); top-k weights are a structure of their own (the full path once, then short).
    ev = buf.capture()
    got = buf.dispatch(x, handle=r.handle, previous_event=ev, async_finish=True, allocate_on_comm_stream=True)
    assert got.event.event is not None  # an async op's event, as the full path returns it
    got = buf.combine(y, r.handle, previous_event=buf.capture(), async_finish=True, allocate_on_comm_stream=True)
    assert got.event.event is not None
    assert buf.combine(y, r.handle).event.event is None  # a synchronous op's: none
    assert (full_path_calls["dispatch"], full_path_calls["combine"]) == (d0 + 1, c0 + 2)
    first = buf.combine(y, r.handle, topk_weights=w, async_finish=True)
    again = buf.combine(y, r.handle, topk_weights=w, async_finish=True)
    assert full_path_calls["combine"] == c0 + 3
    assert torch.equal(first.combined_topk_weights, again.combined_topk_weights)
    # what those calls' own checks refuse still gets the full path's error
    with pytest.raises(InvalidTypeError, match="async_finish"):
        buf.dispatch(x, handle=r.handle, async_finish=1)
    with pytest.raises(InvalidTypeError, match="previous_event"):
        buf.combine(y, r.handle, previous_event="not an event")
    with pytest.raises(InvalidUsageError, match="topk_weights has shape"):
        buf.combine(y, r.handle, topk_weights=torch.rand(rows + 1, K))
    with pytest.raises(InvalidUsageError, match="contiguous"):
        buf.combine(y, r.handle, topk_weights=torch.rand(K, rows).t())


def test_a_valid_view_takes_the_short_path_and_a_stale_one_the_full_paths_error(buf, full_path_calls) -> None:
    r = _layout_dispatch(buf, torch.randn(T, H).bfloat16())
    y = torch.randn(int(r.recv_x.shape[0]), H).bfloat16()
    buf.combine(y, r.handle)  # the structure, known
    c0 = full_path_calls["combine"]
    # The native backend's get_combine_buffer view (the reference backend hands out a plain tensor, so it is recorded
    # here as the native Buffer records it): valid until another op runs over it, and only for its handle.
    buf._combine_view = (int(y.untyped_storage().data_ptr()), buf._op_seq, weakref.ref(r.handle.rank_prefix_matrix))
    seq = buf._op_seq
    from_view = buf.combine(y, r.handle).combined_x
    assert full_path_calls["combine"] == c0 and buf._op_seq == seq  # short, and a view combine leaves the view intact
    assert torch.equal(from_view, buf.combine(torch.clone(y), r.handle).combined_x)
    assert buf._op_seq == seq + 1  # a tensor of the caller's counts (its rows move through the buffer)
    with pytest.raises(InvalidUsageError, match="overwrote it"):
        buf.combine(y, r.handle)
    other = _layout_dispatch(buf, torch.randn(T, H).bfloat16())
    buf._combine_view = (int(y.untyped_storage().data_ptr()), buf._op_seq, weakref.ref(other.handle.rank_prefix_matrix))
    with pytest.raises(InvalidUsageError, match="another handle"):
        buf.combine(y, r.handle)


def test_the_sm_count_and_a_replaced_preset_row_resolve_afresh(buf, sms, full_path_calls, monkeypatch) -> None:
    r = _layout_dispatch(buf, torch.randn(T, H).bfloat16())
    x = torch.randn(T, H).bfloat16()
    buf.dispatch(x, handle=r.handle)
    buf.dispatch(x, handle=r.handle)
    n = full_path_calls["dispatch"]
    Buffer.set_num_sms(Buffer.num_sms + 2)  # another default config: the full path once, then short again
    buf.dispatch(x, handle=r.handle)
    buf.dispatch(x, handle=r.handle)
    assert full_path_calls["dispatch"] == n + 1
    row = tuning.INTRANODE[1]
    monkeypatch.setitem(tuning.INTRANODE, 1, tuning.Preset(tuning.Chunks(4, 64), row.combine, "test"))
    buf.dispatch(x, handle=r.handle)
    assert full_path_calls["dispatch"] == n + 2
    key = _plain_ops.dispatch_key(x, r.handle, Buffer.num_sms)
    assert buf._plain_keys[key][0].num_max_nvl_chunked_send_tokens == 4  # resolved from the new row


def test_keys_are_bounded_and_garbage_has_none(buf) -> None:
    r = _layout_dispatch(buf, torch.randn(T, H).bfloat16())
    for i in range(_plain_ops.MAX_KEYS + 5):
        _plain_ops.remember(buf, ("test", i), None)
    assert len(buf._plain_keys) <= _plain_ops.MAX_KEYS and ("test", _plain_ops.MAX_KEYS + 4) in buf._plain_keys
    assert _plain_ops.dispatch_key([1, 2], r.handle, 24) is None
    assert _plain_ops.dispatch_key((torch.zeros(1), 3), r.handle, 24) is None
    assert _plain_ops.dispatch_key(torch.zeros(2, 2), "handle", 24) is None
    assert _plain_ops.combine_key(torch.zeros(2, 2), None, (1, 2), 24) is None
    assert _plain_ops.combine_key("x", None, r.handle, 24) is None
    assert _plain_ops.combine_key(torch.zeros(2, 2), "w", r.handle, 24) is None


def test_handles_of_other_routings_keep_the_short_path_and_rows_are_checked_per_call(buf, full_path_calls) -> None:
    """Every layer and step routes anew, so a handle's received rows change: the key leaves them out."""
    x = torch.randn(T, H).bfloat16()
    first, second = _routed_dispatch(buf, 3), _routed_dispatch(buf, 5)
    buf.dispatch(x, handle=first.handle)
    buf.combine(torch.randn(3, H).bfloat16(), first.handle)
    d0, c0 = full_path_calls["dispatch"], full_path_calls["combine"]
    buf.dispatch(x, handle=second.handle)
    out = buf.combine(torch.randn(5, H).bfloat16(), second.handle)
    assert (full_path_calls["dispatch"], full_path_calls["combine"]) == (d0, c0)  # both short
    assert out.combined_x.shape == (T, H)
    with pytest.raises(InvalidUsageError, match="rows but the dispatch"):  # rows of another handle
        buf.combine(torch.randn(3, H).bfloat16(), second.handle)
    # One row with any stride is contiguous; the same strides with more rows are not, whatever the key says.
    one = _routed_dispatch(buf, 1)
    buf.combine(torch.randn(5 * 1, H).bfloat16()[::5], one.handle)
    strided = torch.randn(5 * 5, H).bfloat16()[::5]
    assert strided.stride() == (5 * H, 1) and not strided.is_contiguous()
    with pytest.raises(InvalidUsageError, match="contiguous"):
        buf.combine(strided, second.handle)


def _same(f: Any, s: Any) -> bool:
    """Tensors are the very same objects; anything else equal, item by item."""
    if isinstance(f, torch.Tensor) or isinstance(s, torch.Tensor):
        return f is s
    if isinstance(f, (list, tuple)) and isinstance(s, (list, tuple)):
        return len(f) == len(s) and all(_same(a, b) for a, b in zip(f, s))
    return bool(f is s or f == s)


@pytest.mark.parametrize("stream_args", [{}, {"async_finish": True}, {"async_finish": True, "event": True,
                                                                        "allocate_on_comm_stream": True}],
                         ids=["sync", "async", "megatron"])
@pytest.mark.parametrize("weights", [False, True], ids=["rows", "weights"])
@pytest.mark.parametrize("view", [False, True], ids=["tensor", "view"])
def test_the_short_path_makes_the_full_paths_calls(buf, monkeypatch, stream_args, weights, view) -> None:
    """The backend's arguments, the stream joins (Buffer._begin) and the op's close (Buffer._finish: events,
    record_stream of inputs, outputs and handle) are the same on either path, for every kind of call Megatron makes."""
    r = _layout_dispatch(buf, torch.randn(T, H).bfloat16())
    rows = int(r.recv_x.shape[0])
    x8, y, w = _fp8(), torch.randn(rows, H).bfloat16(), torch.rand(rows, K) if weights else None
    seen: list[tuple] = []
    backend = buf._backend
    real_cached, real_combine, real_begin, real_finish = backend.cached_dispatch, backend.combine, buf._begin, \
        buf._finish

    def cached(x, scales, h, config):
        seen.append(("dispatch", x, scales, type(h), h, config))
        return real_cached(x, scales, h, config)

    def combine(x, h, tw, bias, config):
        seen.append(("combine", x, tw, type(h), h, bias, config))
        return real_combine(x, h, tw, bias, config)

    def begin(*a, **kw):
        seen.append(("begin", *a, tuple(sorted(kw.items()))))
        return real_begin(*a, **kw)

    def finish(*a, **kw):
        seen.append(("finish", a[0], a[1], [type(t) for t in a[2]], a[3], a[4] if len(a) > 4 else None,
                     tuple(sorted(kw.items()))))
        return real_finish(*a, **kw)

    monkeypatch.setattr(backend, "cached_dispatch", cached)
    monkeypatch.setattr(backend, "combine", combine)
    monkeypatch.setattr(buf, "_begin", begin)
    monkeypatch.setattr(buf, "_finish", finish)
    ev = buf.capture() if stream_args.get("event") else None
    kw = {k: v for k, v in stream_args.items() if k != "event"}
    seq = buf._op_seq
    for plain in ("0", "1", "1"):  # the full path, then the short one (twice: the first full call remembered)
        monkeypatch.setenv("UCCL_MOE_PLAIN_CALLS", plain)
        buf.dispatch(x8, handle=r.handle, previous_event=ev, **kw)
        if view:  # recorded as the native Buffer records a get_combine_buffer view, right before its combine
            buf._combine_view = (int(y.untyped_storage().data_ptr()), buf._op_seq,
                                 weakref.ref(r.handle.rank_prefix_matrix))
        buf.combine(y, r.handle, topk_weights=w, previous_event=ev, **kw)
    assert buf._op_seq == seq + (3 if view else 6)  # a view's combine leaves the view (and the count) alone
    per_round = len(seen) // 3
    full, short = seen[:per_round], seen[2 * per_round:]
    assert [e[0] for e in full] == ["begin", "dispatch", "finish", "begin", "combine", "finish"]
    for f, s in zip(full, short):
        assert _same(f, s), (f, s)


def test_the_weights_rows_and_contiguity_are_checked_per_call(buf) -> None:
    one, five = _routed_dispatch(buf, 1), _routed_dispatch(buf, 5)
    w1 = torch.rand(1, 2 * K)[:, :K]  # one row: contiguous whatever its stride
    assert w1.is_contiguous()
    buf.combine(torch.randn(1, H).bfloat16(), one.handle, topk_weights=w1)  # its structure, known
    w5 = torch.rand(5, 2 * K)[:, :K]
    assert w5.stride() == w1.stride() and not w5.is_contiguous()
    with pytest.raises(InvalidUsageError, match="contiguous"):
        buf.combine(torch.randn(5, H).bfloat16(), five.handle, topk_weights=w5)
