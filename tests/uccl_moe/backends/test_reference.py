"""uccl_moe/backends/reference.py: host-side behaviour of the reference backend (no process group needed)."""

from __future__ import annotations

import datetime
from types import SimpleNamespace

import pytest
import torch

from uccl_moe.backends.reference import ReferenceBackend
from uccl_moe.errors import CommTimeoutError, InvalidUsageError


def test_reference_backend_resolves_the_timeout_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """UCCL_MOE_TIMEOUT_S is read when the backend is created (as the native runtimes do), not at each wait: a bad
    value is refused then, and a later change of the environment does not move a running Buffer's bound."""
    ctx = SimpleNamespace(group=None, num_ranks=2, rank=0)
    monkeypatch.setenv("UCCL_MOE_TIMEOUT_S", "soon")
    with pytest.raises(InvalidUsageError, match="UCCL_MOE_TIMEOUT_S"):
        ReferenceBackend(ctx)  # type: ignore[arg-type]
    monkeypatch.setenv("UCCL_MOE_TIMEOUT_S", "7.5")
    backend = ReferenceBackend(ctx)  # type: ignore[arg-type]
    monkeypatch.setenv("UCCL_MOE_TIMEOUT_S", "soon")
    waited: list[datetime.timedelta] = []

    class Work:
        def wait(self, timeout: datetime.timedelta) -> None:
            waited.append(timeout)
            raise RuntimeError("Timed out waiting 7500ms for recv operation to complete")

    with pytest.raises(CommTimeoutError, match="timed out after 7.5 s in reference/test") as e:
        backend._collective(lambda: Work(), "test", torch.device("cpu"))
    assert waited == [datetime.timedelta(seconds=7.5)] and e.value.record["waited_s"] == 7.5
