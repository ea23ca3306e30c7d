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
        pytest.skip("needs a CUDA GPU (run through the device tool)")
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
