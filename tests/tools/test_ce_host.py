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

    def python_path_of_the_op() -> None:
        time.sleep(1e-4)
        C.dispatch_ce_intranode(1, 2)

    loops: list[int] = []

    def timed(fn: Any) -> float:  # the tool's loop: calls fn a few times, returns host us per call
        for _ in range(3):
            fn()
        loops.append(1)
        return 12.5

    report = ch._profile({"dispatch fp8": (python_path_of_the_op, "dispatch_ce_intranode")}, C, timed,
                         {"a primitive": lambda: None})
    assert launched == []  # the launch was a no-op throughout
    assert C.dispatch_ce_intranode is launch  # and is back
    assert "==== dispatch fp8: Python path" in report and "python_path_of_the_op" in report
    assert "host us per call  a primitive" in report and "12.50" in report and len(loops) == 2


def test_without_two_gpus_it_refuses(capsys: Any) -> None:
    import torch

    if torch.cuda.device_count() >= 2:
        return  # a GPU machine runs the tool for real (tools/device)
    assert ch.main(["--profile"]) == 2
    assert "needs 2 GPUs" in capsys.readouterr().err
