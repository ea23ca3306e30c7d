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
