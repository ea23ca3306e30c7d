"""tools/device/ce_timeline.py: splits each timed iteration of a copy-engine op (torch.profiler's chrome trace) into
lead, copies, tail, span, kernel start and the data copies' boundary; skips iterations of other paths; refuses to run
without GPUs."""

from __future__ import annotations

import math
from typing import Any

import pytest
from helpers.tools import device_tool

ct = device_tool("ce_timeline")


def _k(name: str, ts: float, dur: float) -> dict[str, Any]:
    return {"cat": "kernel", "name": name, "ts": ts, "dur": dur}


def _c(ts: float, dur: float, nbytes: int) -> dict[str, Any]:
    return {"cat": "gpu_memcpy", "name": "Memcpy PtoP (Device -> Device)", "ts": ts, "dur": dur,
            "args": {"bytes": nbytes, "stream": 7}}


def _iteration(t: float, tail: float) -> list[dict[str, Any]]:
    """align, flush, then an op at t: enter 10 us, two data chunks with a flag after each, the gather kernel ending
    `tail` us after the last flag (t + 82)."""
    return [_k("ncclDevKernel_AllReduce_Sum_f32", t - 100, 5), _k("elementwise_kernel<FillFunctor>", t - 90, 80),
            _k("ce_enter_kernel", t, 10), _c(t + 12, 40, 1 << 20), _k("dispatch_ce_gather_kernel", t + 20, 62 + tail),
            _c(t + 54, 2, 4), _c(t + 58, 20, 1 << 19), _c(t + 80, 2, 4)]


def test_parts_of_each_iteration_and_medians() -> None:
    its = []
    for n, tail in enumerate((5.0, 7.0, 9.0)):
        its += _iteration(1000.0 * (n + 1), tail)
    trace = {"traceEvents": [{"cat": "cpu_op", "name": "aten::zero_", "ts": 0}] + its[::-1]}  # any order
    got = [ct.parts(it) for it in ct.iterations(ct.gpu_events(trace))]
    assert [g["tail"] for g in got if g] == pytest.approx([5.0, 7.0, 9.0])
    med, n = ct.summarise(trace)
    assert n == 3
    assert med["lead"] == pytest.approx(12.0) and med["copies"] == pytest.approx(70.0)
    assert med["span"] == pytest.approx(89.0) and med["kernel_start"] == pytest.approx(20.0)
    assert med["boundary"] == pytest.approx(6.0)  # data end (t + 52) to the next data's start (t + 58), flag between
    assert med["flushed"] == pytest.approx(89.0 + 10.0)  # the flush ended at t - 10
    lines = ct.listing(trace)
    assert len(lines) == 6 and "ce_enter_kernel" in lines[0] and "AllReduce" not in "".join(lines)
    # a polled op's side memset after it (the next op's sentinel) is listed, and is not part of its span or tail
    memset = {"cat": "gpu_memset", "name": "Memset (Device)", "ts": 3000.0 + 95, "dur": 8.0,
              "args": {"bytes": 1 << 20, "stream": 9}}
    with_memset = {"traceEvents": its + [memset]}
    assert ct.summarise(with_memset)[0]["span"] == pytest.approx(89.0)
    assert "Memset" in ct.listing(with_memset)[-1]


def test_other_paths_are_skipped_and_an_empty_trace_says_so() -> None:
    ring = [_k("FillFunctor", 0, 80), _k("dispatch_intranode_kernel", 100, 150)]
    assert ct.parts(ct.iterations(ct.gpu_events({"traceEvents": ring}))[0]) is None
    med, n = ct.summarise({"traceEvents": ring})
    assert n == 0 and all(math.isnan(v) for v in med.values())
    assert ct.listing({"traceEvents": []}) == []


def test_refuses_without_gpus(capsys: pytest.CaptureFixture[str]) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.device_count() > 0:
        pytest.skip("this machine has GPUs: the refusal is for machines without")
    assert ct.main(["--iters", "2"]) == 2
    assert "needs GPUs" in capsys.readouterr().err


def test_ops_are_picked_by_name_in_a_fixed_order() -> None:
    assert ct.select_ops("combine, dispatch fp8") == ["dispatch fp8", "combine"]
    assert ct.select_ops(",".join(ct.OPS)) == list(ct.OPS)
    for bad in ("dispatch", "", "combine,dispatch fp16"):
        with pytest.raises(ValueError, match="pick from"):
            ct.select_ops(bad)
    with pytest.raises(SystemExit):  # argparse names the bad value before anything runs
        ct.main(["--ops", "combine,nope"])
    with pytest.raises(SystemExit):
        ct.main(["--scales", "diagonal"])


def test_an_early_op_starts_at_its_first_copy_or_kernel() -> None:
    """UCCL_MOE_CE_EARLY: no enter kernel; the op starts at its first copy (here before its kernel)."""
    it = [e for e in _iteration(1000.0, 5.0) if "ce_enter" not in e["name"]]
    [got] = [ct.parts(i) for i in ct.iterations(ct.gpu_events({"traceEvents": it}))]
    assert got is not None and got["lead"] == pytest.approx(0.0) and got["span"] == pytest.approx(87.0 - 12.0)
    assert got["kernel_start"] == pytest.approx(8.0) and got["flushed"] == pytest.approx(97.0)  # gather ends t + 87


def test_held_iterations_leave_out_the_gpu_sleep() -> None:
    """--hold (the bench's --device-time): flush, the GPU sleep (torch's spin_kernel), alignment, then the op; the
    sleep is neither the op's kernel nor its start, as the all-reduce is not."""
    t = 5000.0
    it = _iteration(t, 5.0)
    flush = _k("elementwise_kernel<FillFunctor>", t - 1200.0, 80.0)
    held = [flush, _k("at::cuda::(anonymous namespace)::spin_kernel(long)", t - 1110.0, 1000.0), it[0]] + it[2:]
    [got] = [ct.parts(i) for i in ct.iterations(ct.gpu_events({"traceEvents": held}))]
    assert got is not None and got["kernel_start"] == pytest.approx(20.0) and got["span"] == pytest.approx(87.0)
    assert "spin_kernel" not in "".join(ct.listing({"traceEvents": held}))


@pytest.mark.parametrize("side", ["uccl_moe::runtime::(anonymous namespace)::ce_gate_watch_kernel",
                                  "uccl_moe::intranode::(anonymous namespace)::ce_end_kernel"])
def test_the_polled_combines_side_stream_after_the_op_is_not_its_kernel(side: str) -> None:
    """The polled combine's side stream runs a watch after the op (ce_gate_watch_kernel, until the peers' memsets
    ended) and, ending beside (UCCL_MOE_CE_END_BESIDE), the op's end (ce_end_kernel), which the caller's stream does
    not wait for: neither is the op's kernel, nor where the caller's op ends."""
    t = 3000.0
    it = _iteration(t, 5.0) + [_k(side, t + 95.0, 30.0)]
    [got] = [ct.parts(i) for i in ct.iterations(ct.gpu_events({"traceEvents": it}))]
    assert got is not None and got["tail"] == pytest.approx(5.0) and got["span"] == pytest.approx(87.0)
    assert side.rsplit("::", 1)[1] not in "".join(ct.listing({"traceEvents": it}))
