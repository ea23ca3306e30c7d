"""tools/device/spin_ab.py: the variants it takes, the spin around a launch, and what it refuses (bad variants, fewer
than 2 GPUs) before it spawns anything."""

from __future__ import annotations

import time

import pytest
from helpers.tools import device_tool, refuses_before_any_rank

sa = device_tool("spin_ab")


def test_variants_are_base_then_each_spin() -> None:
    assert sa.parse_spins("pre:30,post:80") == [("base", None, 0), ("pre30", "pre", 30), ("post80", "post", 80)]
    assert sa.parse_spins(" pre:5 ") == [("base", None, 0), ("pre5", "pre", 5)]
    for bad in ("", "mid:30", "pre:0", "pre:-3", "pre:x", "pre", "pre:30,pre:30"):
        with pytest.raises(ValueError, match="--spin"):
            sa.parse_spins(bad)


def test_the_spin_comes_before_or_after_the_launch_as_set() -> None:
    seen: list[tuple[str, int]] = []

    def launch(*args: int, **kw: int) -> int:
        seen.append(("launch", time.perf_counter_ns()))
        return sum(args) + kw.get("k", 0)

    spin_us = 30_000  # far above what a return takes even on a loaded host
    state = {"where": None, "us": spin_us}
    call = sa.spinning(launch, state)
    for where in ("pre", "post", None):
        state["where"] = where
        t0 = time.perf_counter_ns()
        assert call(1, 2, k=3) == 6  # arguments pass through
        t1 = time.perf_counter_ns()
        before, after = (seen[-1][1] - t0) / 1e3, (t1 - seen[-1][1]) / 1e3
        if where == "pre":
            assert before >= spin_us > after
        elif where == "post":
            assert after >= spin_us > before
        else:
            assert before < spin_us and after < spin_us
    assert state["calls"] == 3  # counted: the tool refuses an op whose launch it never saw


def test_bad_variants_and_a_machine_without_two_gpus_stop_before_any_rank(
        capsys: pytest.CaptureFixture[str]) -> None:
    refuses_before_any_rank(sa.main, ["--spin", "pre:0"], "--spin", capsys)
