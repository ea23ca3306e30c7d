"""tools/device/ce_host.py: --profile profiles each op's Python path with its native launch a no-op (and puts the
launch back), then times the host primitives in the same loop; the tool refuses to run without 2 GPUs."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

from helpers.tools import device_tool

ch = device_tool("ce_host")


def test_profile_reports_each_ops_python_path_with_the_launch_off_and_puts_it_back() -> None:
    launched: list[str] = []

    def launch(*a: Any) -> None:
        launched.append("real")

    C = SimpleNamespace(dispatch_ce_intranode=launch)

    allocated: list[int] = []

    def outputs() -> tuple[int, int]:  # the op's outputs callback (LateOutputs): the no-op launch still calls it
        allocated.append(1)
        return 0x1000, 0

    def python_path_of_the_op() -> None:
        time.sleep(1e-4)
        C.dispatch_ce_intranode(1, 2, outputs)

    loops: list[int] = []

    def timed(fn: Any) -> float:  # the tool's loop: calls fn a few times, returns host us per call
        for _ in range(3):
            fn()
        loops.append(1)
        return 12.5

    report = ch._profile({"dispatch fp8": (python_path_of_the_op, "dispatch_ce_intranode")}, C, timed,
                         {"a primitive": lambda: None})
    assert launched == []  # the launch was a no-op throughout
    assert len(allocated) == 3  # that asked for the outputs, as the real launch does
    assert C.dispatch_ce_intranode is launch  # and is back
    assert "==== dispatch fp8: Python path" in report and "python_path_of_the_op" in report
    assert "host us per call  a primitive" in report and "12.50" in report and len(loops) == 2


def test_a_recorded_launch_replays_with_its_outputs_made_once() -> None:
    """The native launch alone is timed by replaying a recorded call: its outputs are allocated once, before, into
    the argument struct, and the replay passes no callback (so it allocates nothing per call)."""
    made: list[int] = []

    def outputs() -> tuple[int, int]:
        made.append(1)
        return 0x2000, 0x3000

    args = SimpleNamespace(recv_x=0, recv_scales=0)
    replay = ch._replayable(("rt", 24, args, [1], [2], 3, True, 0, outputs), "dispatch_ce_intranode")
    assert replay == ("rt", 24, args, [1], [2], 3, True, 0, None) and made == [1]
    assert (args.recv_x, args.recv_scales) == (0x2000, 0x3000)
    comb = SimpleNamespace(out=0, out_topk_weights=0)
    replay = ch._replayable(("rt", 24, comb, [1], True, 0, lambda: (0x4000, 0), True), "combine_ce_intranode")
    assert (comb.out, comb.out_topk_weights) == (0x4000, 0)
    assert replay == ("rt", 24, comb, [1], True, 0, None, True)  # poll, after the callback, stays


def test_without_two_gpus_it_refuses(capsys: Any) -> None:
    import torch

    if torch.cuda.device_count() >= 2:
        return  # a GPU machine runs the tool for real (tools/device)
    assert ch.main(["--profile"]) == 2
    assert "needs 2 GPUs" in capsys.readouterr().err


def test_the_streams_probe_splits_bytes_and_refuses_without_two_gpus(capsys: Any) -> None:
    """tools/device/ce_streams.py: every stream moves an equal share rounded down to 4 KiB, and the rate counts what
    moved; on a machine without two GPUs it refuses (exit 2, saying so)."""
    import torch

    cs = device_tool("ce_streams")
    moved: list[tuple[int, int, int]] = []
    rate = cs.gbps(10_000_000, 3, (0, 1), 2, lambda d, j, part: moved.append((d, j, part)), lambda: None)
    assert len(moved) == 2 * 2 * 3 and {m[2] for m in moved} == {(10_000_000 // 3) // 4096 * 4096} and rate > 0
    if torch.cuda.device_count() >= 2:
        return  # a GPU machine runs the tool for real (tools/device)
    assert cs.main([]) == 2
    assert "needs 2 GPUs" in capsys.readouterr().err
