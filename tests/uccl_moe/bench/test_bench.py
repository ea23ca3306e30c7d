"""CPU checks of the benchmark's bookkeeping (uccl_moe/bench): metrics, table, CLI parsing."""

from __future__ import annotations

import pytest

from uccl_moe.bench.__main__ import build_parser, host_bound_notes, main
from uccl_moe.bench._run import _kernel_lines, _summarise, _table
from uccl_moe.bench._timing import kernel_table


def _rank(us: float, n_recv: int, n_remote: int) -> dict:
    return {"dispatch_us": us, "combine_us": us * 2, "n_recv": n_recv, "n_remote": n_remote, "n_sent": n_recv,
            "n_sent_remote": n_remote, "row_bytes": 1000, "combine_row_bytes": 2000}


def test_slowest_rank_and_metric_definitions() -> None:
    row = _summarise([_rank(100.0, 400, 300), _rank(200.0, 500, 400)])
    assert row["dispatch_us"] == 200.0
    assert row["dispatch_logical_GBps"] == round(500 * 1000 / 200e3, 1)  # all rows the slowest rank received
    assert row["dispatch_nvlink_GBps"] == round(400 * 1000 / 200e3, 1)  # only rows from other ranks
    assert row["combine_nvlink_GBps"] == round(400 * 2000 / 400e3, 1)
    assert "nccl_dispatch_us" not in row


def test_table_lists_every_row() -> None:
    rows = [{"ranks": 4, "tokens": t, "hidden": 7168, "experts": 256, "dtype": "fp8", "num_sms": 24, "nvl_send": 8,
             **_summarise([_rank(100.0, 400, 300)])} for t in (128, 4096)]
    text = _table(rows).splitlines()
    assert len(text) == 3 and "disp_nvl" in text[0] and text[2].split()[1] == "4096"


def test_cli_parsing_and_method_guard() -> None:
    args = build_parser().parse_args(["--tokens", "128,4096", "--sms", "16,24"])
    assert args.tokens == [128, 4096] and args.sms == [16, 24] and args.dtypes == "fp8,bf16"
    assert main(["--iters", "5"]) == 2  # fewer than 20 timed runs is refused


def test_kernel_times_per_call_and_slowest_rank() -> None:
    ours = "void uccl_moe::intranode::(anonymous namespace)::dispatch_intranode_kernel(NvlContext, Geometry)"
    fill = "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<unsigned char>>(int)"
    events = [(ours, 30.0), (ours, 31.0), (ours, 500.0), (fill, 80.0), (fill, 80.0), (fill, 80.0),
              ("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", 10.0),
              ("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 7.0)]
    # median launch (an outlier does not move it) x launches per call; the flush and the aligning all-reduce go
    table = kernel_table(events, 3, skip=("AllReduce",))
    assert table == {"dispatch_intranode_kernel": 31.0, "ncclDevKernel_SendRecv": round(10.0 / 3, 1)}
    a = {**_rank(100.0, 400, 300), "dispatch_kernels": {"k": 10.0}, "combine_kernels": {"c": 3.0, "p": 1.0}}
    b = {**_rank(90.0, 400, 300), "dispatch_kernels": {"k": 12.0}, "combine_kernels": {"c": 2.0}}
    row = _summarise([a, b])
    assert row["dispatch_kernels"] == {"k": 12.0} and row["combine_kernels"] == {"c": 3.0, "p": 1.0}
    row.update(ranks=2, tokens=64, dtype="bf16", num_sms=24, nvl_send=8, nvl_recv=256)
    lines = _kernel_lines([row]).splitlines()
    assert len(lines) == 2 and "k 12.0" in lines[0] and lines[1].endswith("kernels us: c 3.0, p 1.0")


def test_combine_from_the_buffer_columns_and_equality_flag() -> None:
    """combine_view (combine from get_combine_buffer) is summarised like combine, gets its table columns, and its
    bitwise check against combine is false if any rank saw a difference."""
    a = {**_rank(100.0, 400, 300), "combine_view_us": 150.0, "combine_view_equal": True}
    b = {**_rank(90.0, 400, 300), "combine_view_us": 170.0, "combine_view_equal": False}
    row = _summarise([a, b])
    assert row["combine_view_us"] == 170.0 and row["combine_view_nvlink_GBps"] == round(300 * 2000 / 170e3, 1)
    assert row["combine_view_equal"] is False
    assert _summarise([a, a])["combine_view_equal"] is True
    row.update(ranks=2, tokens=64, hidden=7168, experts=256, dtype="bf16", num_sms=24, nvl_send=8)
    header = _table([row]).splitlines()[0].split()
    assert header.index("comb_us") < header.index("combv_us") < header.index("combv_nvl")


def test_staged_combine_columns_and_equality_flag() -> None:
    """combine_staged (--combine-staged) is summarised like combine, gets its columns, and its bitwise check against
    the ring combine is false if any rank saw a difference."""
    a = {**_rank(100.0, 400, 300), "combine_staged_us": 120.0, "combine_staged_equal": True, "combine_ring_us": 140.0}
    b = {**_rank(90.0, 400, 300), "combine_staged_us": 130.0, "combine_staged_equal": False, "combine_ring_us": 150.0}
    row = _summarise([a, b])
    assert row["combine_staged_us"] == 130.0 and row["combine_staged_nvlink_GBps"] == round(300 * 2000 / 130e3, 1)
    assert row["combine_ring_us"] == 150.0 and "combr_us" in _table([row]).splitlines()[0].split()
    assert row["combine_staged_equal"] is False and _summarise([a, a])["combine_staged_equal"] is True
    assert _summarise([{**a, "combine_staged_fits": True}, {**b, "combine_staged_fits": False}])[
        "combine_staged_fits"] is False
    row.update(ranks=2, tokens=64, hidden=7168, experts=256, dtype="bf16", num_sms=24, nvl_send=8)
    header = _table([row]).splitlines()[0].split()
    assert header.index("comb_us") < header.index("combs_us") < header.index("combs_nvl")


def test_host_time_per_call_is_the_slowest_ranks_and_tabled() -> None:
    """Each op's host time (CPU us for the Python call to return) is summarised per op as the slowest rank's, next to
    (not mixed into) its GPU time, and gets a table column."""
    a = {**_rank(100.0, 400, 300), "dispatch_host_us": 12.0, "nccl_dispatch_us": 90.0, "nccl_dispatch_host_us": 8.0}
    b = {**_rank(90.0, 400, 300), "dispatch_host_us": 15.5, "nccl_dispatch_us": 80.0, "nccl_dispatch_host_us": 6.0}
    row = _summarise([a, b])
    assert row["dispatch_host_us"] == 15.5 and row["dispatch_us"] == 100.0
    assert row["nccl_dispatch_host_us"] == 8.0 and "combine_host_us" not in row
    row.update(ranks=2, tokens=64, hidden=7168, experts=256, dtype="bf16", num_sms=24, nvl_send=8)
    lines = _table([row]).splitlines()
    header = lines[0].split()
    assert "comb_host" not in header
    assert lines[1].split()[header.index("disp_host")] == "15.5"
    assert lines[1].split()[header.index("nccl_host")] == "8.0"


def test_host_bound_notes_name_the_ops_whose_host_time_outgrew_the_flush() -> None:
    """The flush each timed run starts behind hides at most its own GPU time of host work: an op whose host us per
    call (slowest rank) exceeds the least of the ranks' flush times is named, ours or NCCL's; none in device time."""
    a = {**_rank(100.0, 400, 300), "dispatch_host_us": 95.0, "combine_host_us": 40.0, "nccl_dispatch_us": 90.0,
         "nccl_dispatch_host_us": 30.0, "flush_us": 88.0}
    b = {**_rank(90.0, 400, 300), "dispatch_host_us": 50.0, "combine_host_us": 41.0, "nccl_dispatch_us": 80.0,
         "nccl_dispatch_host_us": 91.0, "flush_us": 86.0}
    row = _summarise([a, b])
    assert row["flush_us"] == 86.0
    row.update(ranks=2, tokens=4096, hidden=7168, dtype="fp8")
    (note,) = host_bound_notes([row], device_time=False)
    assert "EP2 T=4096 H=7168 fp8" in note and "86 us" in note
    assert "dispatch 95" in note and "nccl_dispatch 91" in note and "combine" not in note.replace("--", "")
    assert "only the host time before an op's launch counts" in note
    assert host_bound_notes([row], device_time=True) == []
    calm = {**row, "dispatch_host_us": 50.0, "nccl_dispatch_host_us": 30.0}
    assert host_bound_notes([calm], device_time=False) == []
    assert host_bound_notes([{k: v for k, v in row.items() if k != "flush_us"}], device_time=False) == []


@pytest.mark.parametrize("hold", [False, True])
def test_time_op_orders_flush_align_and_the_hold(monkeypatch: pytest.MonkeyPatch, hold: bool) -> None:
    """time_op on a fake torch.cuda: by default align, flush, then the call inside the events; with hold
    (--device-time) flush, the GPU sleep, align, then the call, so the call is enqueued before the timed window opens
    and the ranks leave the alignment, not the sleep, together (a sleep counts cycles; GPUs at different clocks leave
    it apart). Warm-up calls run untimed first; GPU time comes from the events."""
    import torch

    from uccl_moe.bench import _timing

    log: list[str] = []

    class Event:
        def __init__(self, enable_timing: bool) -> None:
            assert enable_timing
            self.t = 0.0

        def record(self) -> None:
            log.append("record")
            self.t = float(len(log))

        def synchronize(self) -> None:
            pass

        def elapsed_time(self, other: Event) -> float:
            return other.t - self.t

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: log.append(f"sleep {cycles}"))
    flush = type("Flush", (), {"zero_": lambda self: log.append("flush")})()
    gpu, host = _timing.time_op(lambda: log.append("call"), flush, iters=2, warmup=1,
                                align=lambda: log.append("align"), hold=hold)
    one = (["flush", f"sleep {_timing.HOLD_CYCLES}", "align"] if hold else ["align", "flush"]) + \
        ["record", "call", "record"]
    assert log == ["call"] + one + one
    assert gpu == 2e3 and host >= 0.0  # the events are 2 "ms" apart in the fake: microseconds out


def test_direct_dispatch_columns_entries_and_equality_flag() -> None:
    """dispatch_direct (--dispatch-direct) is summarised like dispatch (slowest rank, its byte counts), gets its
    columns and one summary line per dtype, and its bitwise check against the rings fails if any rank's failed."""
    from uccl_moe.bench._run import op_summary

    a = {**_rank(100.0, 400, 300), "dispatch_direct_us": 80.0, "dispatch_direct_equal": True}
    b = {**_rank(90.0, 400, 300), "dispatch_direct_us": 85.0, "dispatch_direct_equal": False}
    row = _summarise([a, b])
    assert row["dispatch_direct_us"] == 85.0 and row["dispatch_direct_nvlink_GBps"] == round(300 * 1000 / 85e3, 1)
    assert row["dispatch_direct_equal"] is False and _summarise([a, a])["dispatch_direct_equal"] is True
    assert _summarise([{**a, "dispatch_direct_fits": True}, {**b, "dispatch_direct_fits": False}])[
        "dispatch_direct_fits"] is False
    row.update(ranks=2, tokens=64, hidden=7168, experts=256, dtype="bf16", num_sms=24, nvl_send=8, nvl_recv=256,
               nccl_dispatch_us=100.0, nccl_combine_us=200.0)
    assert "dispd_us" in _table([row]).splitlines()[0].split()
    ops = op_summary([row])
    direct = next(e for e in ops if e["op"] == "dispatch direct bf16")
    assert direct["ours_us"] == 85.0 and direct["speedup"] == round(100.0 / 85.0, 2)
