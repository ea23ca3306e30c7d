"""tests/helpers/mp.py, the helper every multi-rank test runs through: where ranks fail, its error holds every failing
rank's traceback, so a cause on one rank is not hidden behind the echo it leaves on another (a collective whose peer
exited)."""

from __future__ import annotations

import pytest
from helpers.mp import run_ranks


def _rank1_fails(rank: int, world: int) -> None:
    import torch.distributed as dist

    if rank == 1:
        raise ValueError("the cause, on rank 1")
    dist.barrier()  # rank 0 waits here for a peer that already left: its error is only the echo


def test_every_failing_ranks_traceback_is_reported() -> None:
    with pytest.raises(AssertionError) as info:
        run_ranks(_rank1_fails, 2, timeout_s=120)
    msg = str(info.value)
    assert "ValueError: the cause, on rank 1" in msg
    assert "--- rank 1 of 2:" in msg
    assert "failing ranks: 0, 1" in msg or "failing ranks: 1" in msg
