"""tools/device/flush_ab.py: the flush sizes it takes, the modes of a round, the report's lines, and what it refuses
(bad sizes, fewer than 2 GPUs) before it spawns anything."""

from __future__ import annotations

import pytest
from helpers.tools import device_tool, refuses_before_any_rank

fa = device_tool("flush_ab")


def test_flush_sizes_are_positive_megabytes() -> None:
    assert fa.parse_sizes("256,768") == [256, 768]
    assert fa.parse_sizes(" 512 ") == [512]
    for bad in ("", "0", "256,-1", "a", "256,x", "256,256"):
        with pytest.raises(ValueError, match="--flush-mb"):
            fa.parse_sizes(bad)


def test_a_round_times_each_flush_then_held() -> None:
    assert fa.modes([256, 768]) == ["256MB", "768MB", "held"]


def test_the_report_lists_every_round_of_each_op_and_mode() -> None:
    res = {("fp8", "256MB"): [(115.84, 76.1), (160.2, 123.6)], ("fp8", "held"): [(111.7, 135.5), (112.0, 132.4)]}
    lines = fa.report(res)
    assert len(lines) == 2
    assert lines[0].split() == ["fp8", "256MB", "us", "115.8", "160.2", "host", "76.1", "123.6"]
    assert lines[1].split()[:5] == ["fp8", "held", "us", "111.7", "112.0"]


def test_bad_sizes_and_a_machine_without_two_gpus_stop_before_any_rank(capsys: pytest.CaptureFixture[str]) -> None:
    refuses_before_any_rank(fa.main, ["--flush-mb", "0"], "--flush-mb", capsys)
