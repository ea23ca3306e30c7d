"""CommStream's choice of path without a GPU: join events the native module cannot create (here: no driver, as on a
machine whose driver is older than the build's runtime) leave it on torch's stream API instead of failing the
Buffer. The joins themselves are GPU-tested in tests/gpu/test_streams_gpu.py."""

from __future__ import annotations

import types

import pytest
import torch

from uccl_moe import _C, streams
from uccl_moe.errors import CudaError


def test_events_the_native_module_cannot_create_fall_back_to_torch(monkeypatch) -> None:
    if _C.gpu_backend() == "none":
        pytest.skip("a build without GPU support never asks for join events")
    if _C.device_count() > 0:
        pytest.skip("the native module can create events here: the GPU test covers that path")
    with pytest.raises(CudaError):  # the real module, with no usable driver
        _C.join_event_create(0)
    fake_stream = types.SimpleNamespace(stream_id=3, device_index=0, device_type=1, cuda_stream=0x1234)
    monkeypatch.setattr(torch.cuda, "Stream", lambda **kw: fake_stream)
    monkeypatch.setattr(torch.cuda, "Event", lambda **kw: object())
    monkeypatch.setattr(streams, "_torch_raw_api", lambda: (lambda i: (0, 0, 1), lambda **kw: None, lambda i: 0))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    cs = streams.CommStream(torch.device("cuda", 0))
    assert cs._events is None and not cs._fast()
    assert cs.stream is fake_stream
    cs.close()
    cs.close()
