"""tests/helpers/mp.py, the helper every multi-rank test runs through: where ranks fail, its error holds every failing
rank's traceback, so a cause on one rank is not hidden behind the error it leaves on another (a collective whose peer
exited)."""

from __future__ import annotations

import pytest
from helpers.mp import run_ranks


def _both_fail(rank: int, world: int) -> None:
    import time

    import torch.distributed as dist

    dist.barrier()  # both ranks finished joining the group: rank 0 cannot fail there on rank 1's exit instead
    if rank == 1:
        raise ValueError("the cause, on rank 1")
    time.sleep(0.3)  # rank 0 fails after it, well within the 2 s the helper waits for the others to report
    raise RuntimeError("an echo, on rank 0")


def test_every_failing_ranks_traceback_is_reported() -> None:
    with pytest.raises(AssertionError) as info:
        run_ranks(_both_fail, 2, timeout_s=120)
    msg = str(info.value)
    assert "ranks 0, 1 of 2 failed" in msg, msg
    assert "--- rank 0 of 2:" in msg and "RuntimeError: an echo, on rank 0" in msg, msg
    assert "--- rank 1 of 2:" in msg and "ValueError: the cause, on rank 1" in msg, msg
