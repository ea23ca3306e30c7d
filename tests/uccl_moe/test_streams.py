"""CommStream's choice of path without a GPU: join events the native module cannot create (here: no driver, as on a
machine whose driver is older than the build's runtime) leave it on torch's stream API instead of failing the
Buffer. The joins themselves are GPU-tested in tests/gpu/test_streams_gpu.py."""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch

from uccl_moe import _C, streams
from uccl_moe.errors import CudaError


def test_events_the_native_module_cannot_create_fall_back_to_torch(monkeypatch) -> None:
    if _C.gpu_backend() == "none":
        pytest.skip("a build without GPU support never asks for join events")
    if _C.device_count() > 0:
        pytest.skip("the native module can create events here: the GPU test covers that path")
    with pytest.raises(CudaError):  # the real module, with no usable driver
        _C.join_event_create(0)
    fake_stream = types.SimpleNamespace(stream_id=3, device_index=0, device_type=1, cuda_stream=0x1234)
    monkeypatch.setattr(torch.cuda, "Stream", lambda **kw: fake_stream)
    monkeypatch.setattr(torch.cuda, "Event", lambda **kw: object())
    monkeypatch.setattr(streams, "_torch_raw_api", lambda: (lambda i: (0, 0, 1), lambda **kw: None, lambda i: 0,
                                                                 lambda: False))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    cs = streams.CommStream(torch.device("cuda", 0))
    assert cs._events is None and not cs._fast()
    assert cs.stream is fake_stream
    cs.close()
    cs.close()


# ------------------------------------------------------------------------------------------------ running on the caller
_COMM, _A, _B = 0x1234, 0, 0x20  # raw streams: the comm stream, two caller streams (the legacy default one is 0)


@pytest.fixture()
def fake_raw(monkeypatch):
    """A CommStream on the raw path over fakes: `state["caller"]` is the caller's raw stream, `state["capturing"]` the
    capture flag, and `joins` records each _C.stream_join as (waiter, stream)."""
    monkeypatch.setenv("UCCL_MOE_CALLER_STREAM_OPS", "1")
    state = {"caller": _A, "capturing": False}
    joins: list[tuple[int, int]] = []
    fake_stream = types.SimpleNamespace(stream_id=3, device_index=0, device_type=1, cuda_stream=_COMM)
    monkeypatch.setattr(torch.cuda, "Stream", lambda **kw: fake_stream)
    monkeypatch.setattr(torch.cuda, "Event", lambda **kw: object())
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(streams, "_torch_raw_api", lambda: (
        lambda i: (state["caller"], 0, 1), lambda **kw: None, lambda i: state["caller"], lambda: state["capturing"]))
    monkeypatch.setattr(_C, "gpu_backend", lambda: "cuda")
    monkeypatch.setattr(_C, "join_event_create", lambda i: 99)
    monkeypatch.setattr(_C, "join_event_destroy", lambda e: None)
    monkeypatch.setattr(_C, "stream_join", lambda waiter, stream, event: joins.append((waiter, stream)))
    cs = streams.CommStream(torch.device("cuda", 0))
    assert cs._fast()
    yield cs, state, joins
    cs.close()


def test_an_op_on_the_callers_stream_joins_only_where_the_comm_stream_may_hold_work(fake_raw) -> None:
    cs, state, joins = fake_raw

    def on_caller(stream: int) -> list[tuple[int, int]]:
        state["caller"] = stream
        joins.clear()
        assert cs.runs_on_caller()
        cs.end_on_caller(cs.begin_on_caller())
        return list(joins)

    # first op: the caller's stream waits for the comm stream, which then waits for the op
    assert on_caller(_A) == [(_A, _COMM), (_COMM, _A)]
    # nothing was enqueued on the comm stream since: only the closing join
    assert on_caller(_A) == [(_COMM, _A)]
    # another caller stream is not ordered after the op on A: it waits for the comm stream (which waited for A)
    assert on_caller(_B) == [(_B, _COMM), (_COMM, _B)]
    # an op on the comm stream that the caller waited for: nothing left to wait for on that caller's stream
    cs.wait_for_caller()
    cs.caller_waits()
    assert on_caller(_B) == [(_COMM, _B)]
    # an asynchronous op (previous_event; the caller did not wait): the next op waits for it
    cs.wait_event(types.SimpleNamespace(stream_wait=lambda s: None))
    assert on_caller(_B) == [(_B, _COMM), (_COMM, _B)]
    cs.wait_for_caller()  # ... as after an op that joined the caller's stream but was not waited for
    assert on_caller(_B) == [(_B, _COMM), (_COMM, _B)]
    # once handed out, the comm stream may hold the caller's own work: every op waits for it
    cs.exposed = True
    assert on_caller(_B) == [(_B, _COMM), (_COMM, _B)]
    # while the caller's stream captures a CUDA graph, ops take the comm stream (fork and join in the capture)
    cs.exposed = False
    state["capturing"] = True
    assert not cs.runs_on_caller()
    # ... and the caller's wait at their end exists only in the graph: the next eager op still waits for the comm
    # stream (where an async op may run meanwhile)
    cs.wait_for_caller()
    cs.caller_waits()
    state["capturing"] = False
    assert on_caller(_B) == [(_B, _COMM), (_COMM, _B)]
    assert cs.ran_on_caller


def test_ops_stay_on_the_comm_stream_unless_the_knob_is_on(fake_raw, monkeypatch) -> None:
    cs, _, _ = fake_raw
    assert cs.runs_on_caller()
    monkeypatch.setenv("UCCL_MOE_CALLER_STREAM_OPS", "0")
    off = streams.CommStream(torch.device("cuda", 0))  # the knob is read when the stream (the Buffer) is made
    assert off._fast() and not off.runs_on_caller()
    off.close()


@pytest.fixture(scope="module")
def gloo_world():
    """The default process group: a gloo world of one rank, destroyed after the module if this fixture made it."""
    import os
    import tempfile

    import torch.distributed as dist

    if dist.is_initialized():
        yield dist.group.WORLD
        return
    with tempfile.TemporaryDirectory() as d:  # the file store lives as long as the group
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(d, 'init')}", rank=0, world_size=1)
        yield dist.group.WORLD
        dist.destroy_process_group()


def _cpu_buffer(group, comm):
    from uccl_moe import Buffer

    buf = Buffer(group, Buffer.get_dispatch_config(1).get_nvl_buffer_size_hint(256 * 4, 1), backend="reference")
    buf._comm = comm  # type: ignore[assignment]
    return buf


class _FakeComm:
    """Records which of CommStream's methods a Buffer op calls."""

    def __init__(self, runs_on_caller: bool) -> None:
        self.calls: list[str] = []
        self._runs = runs_on_caller
        self.stream = None
        self.ran_on_caller = False

    def runs_on_caller(self) -> bool:
        return self._runs

    def begin_on_caller(self) -> int:
        self.calls.append("begin_on_caller")
        self.ran_on_caller = True
        return 0  # the legacy default stream's raw handle: a valid stream, not "no stream"

    def end_on_caller(self, caller: int) -> None:
        self.calls.append(f"end_on_caller({caller})")

    def __getattr__(self, name: str):  # wait_for_caller, wait_event, caller_waits, enter, leave, caller, close
        if name.startswith("__"):
            raise AttributeError(name)
        return lambda *a: self.calls.append(name)


@pytest.mark.parametrize("runs_on_caller", [True, False])
@pytest.mark.parametrize("args", ["sync", "previous_event", "async", "allocate_on_comm_stream"])
def test_buffer_runs_a_synchronous_op_without_previous_event_on_the_callers_stream(gloo_world, runs_on_caller,
                                                                                   args) -> None:
    from uccl_moe.utils import EventHandle, EventOverlap

    comm = _FakeComm(runs_on_caller)
    buf = _cpu_buffer(gloo_world, comm)
    kw = {"sync": {}, "previous_event": {"previous_event": EventOverlap(EventHandle())},
          "async": {"async_finish": True}, "allocate_on_comm_stream": {"allocate_on_comm_stream": True}}[args]
    idx = torch.tensor([[0, 1], [1, -1]], dtype=torch.int64)
    lay = buf.get_dispatch_layout(idx, 2, **kw)
    x = torch.randn((2, 256), dtype=torch.bfloat16)
    r = buf.dispatch(x, topk_idx=idx, topk_weights=torch.rand((2, 2)), num_tokens_per_rank=lay.num_tokens_per_rank,
                     is_token_in_rank=lay.is_token_in_rank, num_tokens_per_expert=lay.num_tokens_per_expert, **kw)
    buf.dispatch(x, handle=r.handle, **kw)
    out = buf.combine(r.recv_x, r.handle, **kw)
    torch.testing.assert_close(out.combined_x, x)  # one rank: each token's one row comes back as it went
    buf._comm = None
    buf.destroy()
    if args == "sync" and runs_on_caller:
        assert comm.calls == ["begin_on_caller", "end_on_caller(0)"] * 4
        return
    assert "begin_on_caller" not in comm.calls and not any(c.startswith("end_on_caller") for c in comm.calls)
    assert comm.calls.count("enter") == 4 and comm.calls.count("leave") == 4
    joins = "wait_event" if args == "previous_event" else "wait_for_caller"
    assert comm.calls.count(joins) == 4
    assert comm.calls.count("caller_waits") == (0 if args == "async" else 4)


@pytest.mark.parametrize("runs_on_caller", [False, True])
def test_the_streams_are_joined_back_when_the_backend_raises(gloo_world, runs_on_caller) -> None:
    """On the comm stream the caller's stream is current again; on the caller's stream the comm stream still waits
    for what the op enqueued before it failed (later ops on the comm stream must not overlap it)."""
    comm = _FakeComm(runs_on_caller)
    buf = _cpu_buffer(gloo_world, comm)

    def fail(*a):
        comm.calls.append("backend")
        raise RuntimeError("kernel launch failed")

    buf._backend.get_dispatch_layout = fail  # type: ignore[union-attr, method-assign]
    with pytest.raises(RuntimeError, match="kernel launch failed"):
        buf.get_dispatch_layout(torch.tensor([[0, 1]], dtype=torch.int64), 2)
    if runs_on_caller:
        assert comm.calls == ["begin_on_caller", "backend", "end_on_caller(0)"]
    else:
        assert comm.calls == ["wait_for_caller", "enter", "backend", "leave"]
    if runs_on_caller:  # a join that fails too (a context a trapped kernel broke) does not hide the op's error
        def broken_join(caller: int) -> None:
            raise RuntimeError("CUDA error: unspecified launch failure")

        comm.end_on_caller = broken_join  # type: ignore[method-assign]
        with pytest.raises(RuntimeError, match="kernel launch failed"):
            buf.get_dispatch_layout(torch.tensor([[0, 1]], dtype=torch.int64), 2)
    buf._comm = None
    buf.destroy()


@pytest.mark.parametrize("ran_on_caller", [False, True])
def test_an_async_op_marks_the_handle_it_reads_once_ops_ran_on_a_callers_stream(gloo_world, ran_on_caller) -> None:
    """A handle made on a caller's stream lives in that stream's memory pool: an async combine or cached dispatch on
    the comm stream must mark its tensors (the backend's handle_tensors) used by the comm stream, as its inputs."""
    comm = _FakeComm(runs_on_caller=False)
    buf = _cpu_buffer(gloo_world, comm)
    idx = torch.tensor([[0, 1], [1, -1]], dtype=torch.int64)
    lay = buf.get_dispatch_layout(idx, 2)
    x = torch.randn((2, 256), dtype=torch.bfloat16)
    r = buf.dispatch(x, topk_idx=idx, topk_weights=torch.rand((2, 2)), num_tokens_per_rank=lay.num_tokens_per_rank,
                     is_token_in_rank=lay.is_token_in_rank, num_tokens_per_expert=lay.num_tokens_per_expert)
    comm.ran_on_caller = ran_on_caller
    asked: list[Any] = []
    real = buf._backend.handle_tensors  # type: ignore[union-attr]
    buf._backend.handle_tensors = lambda h: (asked.append(h), real(h))[1]  # type: ignore[union-attr, method-assign]
    buf.combine(r.recv_x, r.handle, async_finish=True)
    buf.dispatch(x, handle=r.handle, async_finish=True)
    buf.combine(r.recv_x, r.handle)  # synchronous: the caller's stream waits, nothing to mark
    assert len(asked) == (2 if ran_on_caller else 0)
    assert all(h[0] is r.handle[0] for h in asked)
    assert len(real(r.handle)) == 6
    buf._comm = None
    buf.destroy()


def test_internode_handles_list_their_plans_tensors() -> None:
    from uccl_moe.backends.internode import _PLAN_ATTR, InternodePath

    t = [torch.zeros(1) for _ in range(3)]
    plan = types.SimpleNamespace(send_pos=t[0], xp_rows=4, mask=t[1], fwd_prefix=None, row_map=t[2], num_sms=24)
    handle = tuple(torch.zeros(1) for _ in range(6))
    assert InternodePath.handle_tensors(None, handle) == []  # type: ignore[arg-type]
    setattr(handle[0], _PLAN_ATTR, plan)
    got = InternodePath.handle_tensors(None, handle)  # type: ignore[arg-type]
    assert len(got) == 3 and all(any(g is x for x in t) for g in got)
