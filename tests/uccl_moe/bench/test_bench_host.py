"""The bench's host side: each rank's Python calibration and CPU, the report's host line and its NOTE when the ranks'
cores ran unevenly, and --bind-cores (parsing, refusals, the binding itself)."""

from __future__ import annotations

import os

import pytest

from uccl_moe.bench import _host
from uccl_moe.bench.__main__ import build_parser, run


def test_calibration_is_a_positive_median_and_names_a_cpu_this_process_may_use() -> None:
    s = _host.sample()
    assert s["loop_us"] > 0
    if os.path.exists("/proc/thread-self/stat"):
        assert s["cpu"] in os.sched_getaffinity(0)


def test_calibration_reads_slower_when_the_loop_does_more(monkeypatch) -> None:
    fast = _host.calibrate()
    monkeypatch.setattr(_host, "CALIBRATION_STEPS", _host.CALIBRATION_STEPS * 20)
    assert _host.calibrate() > 5 * fast


@pytest.mark.parametrize("text, cores", [("0-2/5", [[0, 1, 2], [5]]), ("3,1/4-5,7", [[1, 3], [4, 5, 7]]),
                                         (" 6 / 2-2 ", [[6], [2]])])
def test_bind_cores_parses_one_group_per_rank(text, cores) -> None:
    assert _host.parse_bind_cores(text, 2, set(range(8))) == cores


@pytest.mark.parametrize("text, ranks, said", [
    ("0-3", 2, "names 1 core group(s) for 2 rank(s)"),
    ("0/1/2", 2, "names 3 core group(s) for 2 rank(s)"),
    ("0/x", 2, "rank 1's group 'x' has 'x'"),
    ("5-3/1", 2, "rank 0's group '5-3' has '5-3'"),
    ("0/1-", 2, "rank 1's group '1-' has '1-'"),
    ("0/6-9", 2, "rank 1's cores [8, 9] are not ones this process may run on (allowed: 0-7)"),
])
def test_bind_cores_refuses_what_it_cannot_bind_saying_why(text, ranks, said) -> None:
    with pytest.raises(ValueError) as e:
        _host.parse_bind_cores(text, ranks, set(range(8)))
    assert said in str(e.value)


def test_ranges_of_cores() -> None:
    assert _host._compact([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    assert _host._compact([4]) == "4"


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux affinity")
def test_bind_sets_this_threads_cores_and_new_threads_inherit_them() -> None:
    import threading

    saved = os.sched_getaffinity(0)
    one = min(saved)
    try:
        _host.bind([one])
        assert os.sched_getaffinity(0) == {one}
        seen: list[set[int]] = []
        t = threading.Thread(target=lambda: seen.append(os.sched_getaffinity(0)))
        t.start()
        t.join()
        assert seen == [{one}]
    finally:
        os.sched_setaffinity(0, saved)


def _host_result(start: list[float], end: list[float]) -> dict:
    return {"start": [{"loop_us": v, "cpu": i} for i, v in enumerate(start)],
            "end": [{"loop_us": v, "cpu": i} for i, v in enumerate(end)]}


def test_host_line_lists_every_rank_and_notes_uneven_cores_in_the_default_mode_only() -> None:
    even = _host.host_lines(_host_result([60.0, 64.0], [61.0, 70.0]), device_time=False)
    assert even == ["host: a 2000-step Python loop (median us, start/end of the run; lower is faster): "
                    "rank 0 cpu 0 60/61 us, rank 1 cpu 1 64/70 us"]
    uneven = _host.host_lines(_host_result([60.0, 64.0], [61.0, 95.0]), device_time=False)
    assert len(uneven) == 2 and uneven[1].startswith("NOTE: the host loop ran up to 1.6x slower")
    assert "--bind-cores" in uneven[1] and "--device-time" in uneven[1]
    assert len(_host.host_lines(_host_result([60.0, 64.0], [61.0, 95.0]), device_time=True)) == 1
    assert _host.host_lines({}, device_time=False) == []


def test_bench_refuses_a_bad_bind_before_any_process_starts(monkeypatch, capsys) -> None:
    import uccl_moe.bench.__main__ as bench

    monkeypatch.setattr("uccl_moe.bench._gpus.gpus_or_explain", lambda _what: True)
    monkeypatch.setattr("torch.cuda.device_count", lambda: 2)
    monkeypatch.setattr(bench, "spawn", lambda *a: pytest.fail("spawned despite a bad --bind-cores"))
    args = build_parser().parse_args(["--ranks", "2", "--bind-cores", "0-1", "--png", "", "--json", ""])
    assert run(args) == 2
    assert "names 1 core group(s) for 2 rank(s)" in capsys.readouterr().err
