"""CPU checks of the benchmark's bookkeeping (uccl_moe/bench): metrics, table, CLI parsing."""

from __future__ import annotations

from uccl_moe.bench.__main__ import build_parser, main
from uccl_moe.bench._run import _summarise, _table


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
