"""tools/device/ce_sm_probe.py: refuses bad shares before touching a GPU, and refuses to run without two GPUs."""

from __future__ import annotations

import pytest
from helpers.tools import device_tool

probe = device_tool("ce_sm_probe")


@pytest.mark.parametrize("shares", ["1.5", "-0.1", ","])
def test_shares_outside_zero_one_are_refused(shares: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        probe.main(["--shares", shares])
    assert e.value.code == 2 and "--shares" in capsys.readouterr().err


def test_refuses_without_two_gpus(capsys: pytest.CaptureFixture[str]) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.device_count() >= 2:
        pytest.skip("this machine has 2 GPUs: the refusal is for machines without")
    assert probe.main(["--iters", "1"]) == 2
    assert "needs 2 GPUs" in capsys.readouterr().err
