"""CommStream (uccl_moe/streams.py): its joins order work between the caller's stream and the comm stream, and its
stream switch restores the caller's stream, on the raw path (C++ joins) and on torch's path alike. One process."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

_SLEEP = 50_000_000  # cycles (~30 ms): the write behind it lands long after an unordered reader ran


@pytest.fixture(params=["raw", "torch"])
def comm(request):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (run on a GPU machine: tools/device)")
    from uccl_moe.streams import CommStream

    torch.cuda.set_device(0)
    cs = CommStream(torch.device("cuda", 0))
    assert cs._events is not None, "a GPU build on a CUDA torch must take the raw path"
    if request.param == "torch":
        cs.close()  # without its events it goes through torch's stream API
    yield cs
    cs.close()


@pytest.mark.parametrize("caller_stream", ["side", "default"])
@pytest.mark.parametrize("writer", ["caller", "comm"])
def test_a_join_orders_the_writers_work_before_the_readers(comm, writer: str, caller_stream: str) -> None:
    """The writer's stream fills `a` behind a long sleep; after the join the reader's stream copies it to `b`.
    writer "caller": wait_for_caller, the comm stream reads; "comm": caller_waits, the caller's stream reads. The
    caller is on a stream of its own, or on the legacy default stream (raw handle 0)."""
    caller = torch.cuda.Stream() if caller_stream == "side" else torch.cuda.default_stream()
    a = torch.zeros(1 << 20, device="cuda")
    b = torch.full_like(a, -1.0)
    torch.cuda.synchronize()
    with torch.cuda.stream(caller):
        token = comm.enter() if writer == "comm" else None
        torch.cuda._sleep(_SLEEP)
        a.fill_(7.0)
        if writer == "comm":
            comm.leave(token)
            comm.caller_waits()
            b.copy_(a)  # on the caller's stream
        else:
            comm.wait_for_caller()
            token = comm.enter()
            b.copy_(a)  # on the comm stream
            comm.leave(token)
    torch.cuda.synchronize()
    assert bool((b == 7.0).all())


def test_enter_makes_the_comm_stream_current_and_leave_restores(comm) -> None:
    caller = torch.cuda.Stream()
    with torch.cuda.stream(caller):
        token = comm.enter()
        assert torch.cuda.current_stream() == comm.stream
        comm.leave(token)
        assert torch.cuda.current_stream() == caller
    assert torch.cuda.current_stream() == torch.cuda.default_stream()


def test_caller_is_the_current_stream_and_follows_a_switch(comm) -> None:
    first, second = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(first):
        assert comm.caller() == first
        assert comm.caller() == first
    with torch.cuda.stream(second):
        assert comm.caller() == second
    assert comm.caller() == torch.cuda.default_stream()


def test_a_caller_on_another_device_goes_through_torch(comm) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    with torch.cuda.device(1):
        assert not comm._fast()
        assert comm.caller() == torch.cuda.current_stream(1)
        comm.wait_for_caller()
        token = comm.enter()
        assert torch.cuda.current_stream(0) == comm.stream
        comm.leave(token)
        comm.caller_waits()
        assert torch.cuda.current_device() == 1
    assert torch.cuda.current_stream(0) == torch.cuda.default_stream(0)
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)


def test_join_events_are_freed_on_close_and_on_collection(comm) -> None:
    import gc

    from uccl_moe.streams import CommStream

    cs = CommStream(torch.device("cuda", 0))
    fin = cs._finalizer
    assert fin.alive
    cs.close()
    cs.close()  # idempotent
    assert not fin.alive and not cs._fast()
    dropped = CommStream(torch.device("cuda", 0))  # a Buffer dropped without destroy() drops its CommStream
    fin = dropped._finalizer
    del dropped
    gc.collect()
    assert not fin.alive


# ------------------------------------------------------------------------------------------ ops on the caller's stream
@pytest.fixture(scope="module")
def world1():
    """A native Buffer over a one-rank NCCL group with UCCL_MOE_CALLER_STREAM_OPS=1, a routed batch and its handle:
    (buf, x, handle). Uses the default process group where it is a world of one made by another test (gloo, say),
    through an NCCL group of its own."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (run on a GPU machine: tools/device)")
    import os
    import tempfile

    import torch.distributed as dist

    from uccl_moe import Buffer

    torch.cuda.set_device(0)
    mine = not dist.is_initialized()
    if not mine and dist.get_world_size() != 1:
        pytest.skip("needs a world of one rank")
    store_dir = tempfile.TemporaryDirectory()  # the file store lives as long as the group
    if mine:
        dist.init_process_group("cpu:gloo,cuda:nccl", init_method=f"file://{os.path.join(store_dir.name, 'init')}",
                                rank=0, world_size=1)
    group = dist.group.WORLD if mine else dist.new_group([0], backend="cpu:gloo,cuda:nccl")
    knobs = pytest.MonkeyPatch()
    knobs.setenv("UCCL_MOE_CALLER_STREAM_OPS", "1")  # read when the Buffer is created
    buf = None
    try:
        T, H, E = 512, 2048, 8
        buf = Buffer(group, Buffer.get_dispatch_config(1).get_nvl_buffer_size_hint(H * 2, 1), backend="native",
                     explicitly_destroy=True)
        idx = torch.topk(torch.rand((T, E), device="cuda"), 2, dim=1).indices
        idx[::3, 1] = -1
        x = torch.randn((T, H), device="cuda").bfloat16()
        lay = buf.get_dispatch_layout(idx, E)
        r = buf.dispatch(x, topk_idx=idx, topk_weights=torch.rand((T, 2), device="cuda"),
                         num_tokens_per_rank=lay.num_tokens_per_rank, is_token_in_rank=lay.is_token_in_rank,
                         num_tokens_per_expert=lay.num_tokens_per_expert)
        assert buf._comm is not None and buf._comm.runs_on_caller()
        yield buf, x, r.handle
    finally:
        knobs.undo()
        torch.cuda.synchronize()
        if buf is not None:
            buf.destroy()
        if mine:
            dist.destroy_process_group()
        store_dir.cleanup()


def _timed_mark(stream: torch.cuda.Stream) -> torch.cuda.Event:
    ev = torch.cuda.Event(enable_timing=True)
    ev.record(stream)
    return ev


def _rows(buf, x, handle):
    """recv_x of a synchronous cached dispatch of x (one rank: row i is x[recv_src_idx[i]])."""
    return buf.dispatch(x, handle=handle).recv_x


def test_a_synchronous_op_waits_for_an_async_op_the_caller_did_not_wait_for(world1) -> None:
    """Async op 1 on the comm stream waits (previous_event) for a 30-ms sleep on another stream; synchronous op 2 then
    runs on the caller's stream, and must still come after op 1 (they share the NVL buffer)."""
    from uccl_moe.utils import EventHandle, EventOverlap

    buf, x, handle = world1
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        torch.cuda._sleep(_SLEEP)
    first = buf.dispatch(x, handle=handle, previous_event=EventOverlap(EventHandle(side)), async_finish=True)
    end_first = _timed_mark(buf._comm.stream)
    second = buf.dispatch(x * 2, handle=handle)
    end_second = _timed_mark(torch.cuda.current_stream())
    torch.cuda.synchronize()
    assert end_first.elapsed_time(end_second) > 0, "the synchronous op ran before the async op it must follow"
    recv_src = handle[3].long()
    assert torch.equal(first.recv_x, x[recv_src]) and torch.equal(second.recv_x, (x * 2)[recv_src])


def test_an_async_op_with_an_older_previous_event_waits_for_a_synchronous_op(world1) -> None:
    """Synchronous op 1 runs on the caller's stream behind a 30-ms sleep; async op 2's previous_event predates both,
    yet op 2 (comm stream) must come after op 1."""
    from uccl_moe import Buffer

    buf, x, handle = world1
    torch.cuda.synchronize()
    old = Buffer.capture()
    torch.cuda._sleep(_SLEEP)
    first = buf.dispatch(x, handle=handle)
    end_first = _timed_mark(torch.cuda.current_stream())
    second = buf.dispatch(x * 2, handle=handle, previous_event=old, async_finish=True)
    end_second = _timed_mark(buf._comm.stream)
    second.event.current_stream_wait()
    torch.cuda.synchronize()
    assert end_first.elapsed_time(end_second) > 0, "the async op ran before the synchronous op it must follow"
    recv_src = handle[3].long()
    assert torch.equal(first.recv_x, x[recv_src]) and torch.equal(second.recv_x, (x * 2)[recv_src])


def test_synchronous_ops_on_two_caller_streams_run_in_call_order(world1) -> None:
    buf, x, handle = world1
    a, b = torch.cuda.Stream(), torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(a):
        torch.cuda._sleep(_SLEEP)
        first = _rows(buf, x, handle)
        end_first = _timed_mark(a)
    with torch.cuda.stream(b):
        second = _rows(buf, x * 2, handle)
        end_second = _timed_mark(b)
    torch.cuda.synchronize()
    assert end_first.elapsed_time(end_second) > 0, "the op on stream b ran before the earlier op on stream a"
    recv_src = handle[3].long()
    assert torch.equal(first, x[recv_src]) and torch.equal(second, (x * 2)[recv_src])


def test_a_synchronous_op_marks_no_tensor_used_by_another_stream(world1, monkeypatch) -> None:
    """On the caller's stream a dispatch and a combine need no record_stream (the host time it saves is the point);
    with Megatron's arguments (comm stream, async) they do, the handle made on the caller's stream included."""
    from uccl_moe import Buffer

    buf, x, handle = world1
    marks: list[int] = []
    real = torch.Tensor.record_stream
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda t, s: (marks.append(1), real(t, s))[1])
    y = _rows(buf, x, handle)
    buf.combine(y, handle)
    assert marks == []
    r = buf.dispatch(x, handle=handle, previous_event=Buffer.capture(), async_finish=True, allocate_on_comm_stream=True)
    r.event.current_stream_wait()
    # recv_x for the caller's stream; x and, since the handle was made on the caller's stream, its 6 tensors for the
    # comm stream
    assert len(marks) == 8
    torch.cuda.synchronize()
