"""tools/device/host_split.py: the clock marks around a native launch and its outputs callback, the segments they
give, and the refusal of a machine without two GPUs before any rank starts."""

from __future__ import annotations

import time

import pytest
from helpers.tools import device_tool, refuses_before_any_rank

hs = device_tool("host_split")


def _spin(us: int) -> None:
    end = time.perf_counter_ns() + us * 1000
    while time.perf_counter_ns() < end:
        pass


def test_marks_split_a_call_into_its_segments() -> None:
    def launch(a: int, b: int, outputs) -> int:  # a launch: work, the callback, more work
        _spin(20_000)
        got = outputs()
        _spin(40_000)
        return a + b + got

    def outputs() -> int:
        _spin(10_000)
        return 3

    marks: dict[str, int] = {}
    call = hs.timed_launch(launch, marks)
    t0 = time.perf_counter_ns()
    _spin(5_000)
    assert call(1, 2, outputs) == 6  # arguments and the callback's value pass through
    t1 = time.perf_counter_ns()
    seg = hs.split(t0, t1, marks)
    assert 5_000 <= seg["py_pre"] < 20_000
    assert 20_000 <= seg["native_pre"] < 40_000 and 10_000 <= seg["alloc"] < 20_000
    assert 40_000 <= seg["native_post"] < 80_000
    assert seg["before_copy"] == pytest.approx(seg["py_pre"] + seg["native_pre"])
    parts = sum(seg[k] for k in ("py_pre", "native_pre", "alloc", "native_post", "py_post"))
    assert seg["total"] == pytest.approx(parts)


def test_a_launch_that_raises_still_marks_its_return_and_a_path_without_callback_is_a_key_error() -> None:
    def launch(outputs) -> None:
        raise RuntimeError("launch failed")

    marks: dict[str, int] = {}
    with pytest.raises(RuntimeError, match="launch failed"):
        hs.timed_launch(launch, marks)(lambda: None)
    assert "enter" in marks and "leave" in marks
    with pytest.raises(KeyError):  # the callback never ran: not the copy-engine path
        hs.split(0, 1, marks)


def test_a_machine_without_two_gpus_stops_before_any_rank(capsys: pytest.CaptureFixture[str]) -> None:
    refuses_before_any_rank(hs.main, ["--iters", "x"], "--iters", capsys)


def _ev(cat: str, name: str, ts: float, dur: float, corr: int, nbytes: int | None = None) -> dict:
    args: dict = {"correlation": corr}
    if nbytes is not None:
        args["bytes"] = nbytes
    return {"cat": cat, "name": name, "ts": ts, "dur": dur, "args": args}


def test_trace_parts_places_host_calls_against_the_gpu_events_after_each_flush() -> None:
    events = []
    for i, late in enumerate((30.0, 50.0)):  # two iterations; the host's copy call `late` us after the flush
        base = 1000.0 * i
        events += [
            _ev("kernel", "vectorized_elementwise_kernel fill", base, 100.0, 10 * i + 1),
            _ev("cuda_runtime", "cudaMemcpyAsync", base + 100 + late, 2.0, 10 * i + 2),
            _ev("gpu_memcpy", "Memcpy PtoP", base + 100 + late + 5, 60.0, 10 * i + 2, nbytes=1 << 20),
            _ev("cuda_runtime", "cudaMemcpyAsync", base + 100 + late + 3, 2.0, 10 * i + 3),
            _ev("gpu_memcpy", "Memcpy PtoP", base + 100 + late + 66, 1.0, 10 * i + 3, nbytes=4),
            _ev("cuda_runtime", "cudaLaunchKernel", base + 100 + late + 20, 3.0, 10 * i + 4),
            _ev("kernel", "gather_kernel", base + 100 + late + 25, 90.0, 10 * i + 4),
        ]
    med, n = hs.trace_parts({"traceEvents": events})
    assert n == 2
    assert med["copy_call"] == pytest.approx(40.0)  # the median of 30 and 50
    assert med["copy_start"] == pytest.approx(45.0)
    assert med["kernel_call"] == pytest.approx(60.0) and med["kernel_start"] == pytest.approx(65.0)
    assert med["end"] == pytest.approx(155.0)
    _, none = hs.trace_parts({"traceEvents": [e for e in events if e["cat"] != "gpu_memcpy"]})
    assert none == 0  # no copy: another path ran
