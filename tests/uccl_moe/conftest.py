"""Fixtures shared by the tests under tests/uccl_moe."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest
import torch.distributed as dist


@pytest.fixture(scope="module")
def group() -> Iterator[Any]:
    """A world-of-one gloo group (the process's default group, created once per process)."""
    if not dist.is_initialized():
        d = tempfile.mkdtemp()
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(d, 'init')}", rank=0, world_size=1)
    yield dist.group.WORLD
