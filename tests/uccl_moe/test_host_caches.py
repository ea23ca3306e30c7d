"""What Buffer's per-op host path remembers between calls (the shared preset Configs, the buffer-size checks that
passed, the native backend's lane geometries) must never answer for a call it was not computed for: a new SM count,
a replaced preset row, other rows, another handle's lanes, a resized group, a destroyed Buffer."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from uccl_moe import Buffer, InvalidUsageError, _checks, tuning
from uccl_moe.backends.native import NativeBackend

H = 256


@pytest.fixture()
def sms():
    old = Buffer.num_sms
    yield
    Buffer.num_sms = old


def _fields(c):
    return (c.num_sms, c.num_max_nvl_chunked_send_tokens, c.num_max_nvl_chunked_recv_tokens,
            c.num_max_rdma_chunked_send_tokens, c.num_max_rdma_chunked_recv_tokens)


def _dispatch(buf, x, T=6, E=4, K=2):
    idx = torch.randint(0, E, (T, K))
    lay = buf.get_dispatch_layout(idx, E)
    return buf.dispatch(x, num_tokens_per_rank=lay.num_tokens_per_rank, is_token_in_rank=lay.is_token_in_rank,
                        num_tokens_per_expert=lay.num_tokens_per_expert, topk_idx=idx, topk_weights=torch.rand(T, K))


def test_preset_configs_follow_the_sm_count_and_the_table(sms, monkeypatch) -> None:
    Buffer.set_num_sms(20)
    first = Buffer.get_combine_config(2)
    assert Buffer.get_combine_config(2) is first  # one shared (read-only) object per row and SM count
    Buffer.set_num_sms(24)
    assert _fields(Buffer.get_combine_config(2))[0] == 24
    assert _fields(Buffer.get_dispatch_config(2))[0] == 24
    Buffer.num_sms = np.int64(22)  # DeepEP users assign the class attribute; any integer type
    assert _fields(Buffer.get_dispatch_config(2))[0] == 22
    Buffer.set_num_sms(20)
    assert Buffer.get_combine_config(2) is first
    row = tuning.INTRANODE[2]
    monkeypatch.setitem(tuning.INTRANODE, 2, tuning.Preset(row.dispatch, tuning.Chunks(3, 96), "test"))
    assert _fields(Buffer.get_combine_config(2))[1:3] == (3, 96)  # a replaced row is a new Chunks: its own Config
    monkeypatch.setitem(tuning.INTRANODE, 2, row)
    assert Buffer.get_combine_config(2) is first


def test_config_none_runs_the_current_preset(group, sms) -> None:
    """dispatch/combine with config=None read the preset at the current SM count on every call."""
    Buffer.set_num_sms(20)
    need20 = Buffer.get_dispatch_config(1).get_nvl_buffer_size_hint(H * 2, 1)
    Buffer.set_num_sms(40)
    need40 = Buffer.get_dispatch_config(1).get_nvl_buffer_size_hint(H * 2, 1)
    assert need40 > need20
    Buffer.set_num_sms(20)
    buf = Buffer(group, max(need20, Buffer.get_combine_config(1).get_nvl_buffer_size_hint(H * 2, 1)),
                 backend="reference", explicitly_destroy=True)
    x = torch.randn((6, H)).bfloat16()
    res = _dispatch(buf, x)
    buf.dispatch(x, handle=res.handle)
    Buffer.set_num_sms(40)  # the 20-SM preset passed the size check; the 40-SM one does not fit
    with pytest.raises(InvalidUsageError, match="num_sms=40.*needs"):
        _dispatch(buf, x)
    with pytest.raises(InvalidUsageError, match="needs"):
        buf.dispatch(x, handle=res.handle)
    buf.destroy()


def test_the_size_check_is_redone_for_other_rows_handles_and_buffers(group, monkeypatch) -> None:
    cfg = Buffer.get_dispatch_config(1)
    buf = Buffer(group, cfg.get_nvl_buffer_size_hint(H * 2, 1), backend="reference", explicitly_destroy=True)
    x = torch.randn((6, H)).bfloat16()
    res = _dispatch(buf, x)
    buf.combine(res.recv_x, res.handle, config=cfg)
    with pytest.raises(InvalidUsageError, match="hidden_bytes=1024"):  # float32 rows: twice the bytes of a row
        buf.combine(res.recv_x.float(), res.handle, config=cfg)
    # another handle whose lanes were laid out with more SMs needs more bytes, with the same config and rows
    lanes = {id(res.handle.rank_prefix_matrix): cfg.num_sms}
    other = _dispatch(buf, x)
    lanes[id(other.handle.rank_prefix_matrix)] = 2 * cfg.num_sms
    monkeypatch.setattr(buf._backend, "handle_num_sms", lambda h: lanes[id(h.rank_prefix_matrix)])
    buf.combine(res.recv_x, res.handle, config=cfg)
    with pytest.raises(InvalidUsageError, match=f"num_sms={2 * cfg.num_sms}: it runs on the lanes"):
        buf.combine(other.recv_x, other.handle, config=cfg)
    buf.num_nvl_bytes //= 2  # what the check reads is part of what it remembers
    with pytest.raises(InvalidUsageError, match="needs"):
        buf.combine(res.recv_x, res.handle, config=cfg)
    buf.destroy()
    with pytest.raises(InvalidUsageError, match="destroyed"):
        buf.combine(res.recv_x, res.handle, config=cfg)


def test_the_size_check_keeps_a_bounded_record(group) -> None:
    buf = Buffer(group, 64 << 20, backend="reference", explicitly_destroy=True)
    x = torch.randn((6, H)).bfloat16()
    res = _dispatch(buf, x)
    for send in range(1, 40):
        buf.dispatch(x, handle=res.handle, config=Buffer.get_dispatch_config(1).__class__(20, send, 256))
    assert 0 < len(buf._fits) <= 16
    buf.destroy()


def test_value_checks_are_off_without_reading_the_knob_where_the_kernels_check(monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(_checks, "topk_checks_on", lambda: calls.append(1) or True)
    assert not _checks.value_checks_on(torch.device("cpu"), on_device=True) and not calls
    assert _checks.value_checks_on(torch.device("cpu")) and calls


class _GeoRt:
    """NvlRuntime.geometry's contract without a GPU: refuses num_sms over 64, counts the calls."""

    def __init__(self) -> None:
        self.calls = 0

    def geometry(self, num_sms, send, recv):
        self.calls += 1
        if num_sms > 64:
            raise InvalidUsageError(f"num_sms={num_sms} is more than the GPU's SMs")
        return (num_sms, send, recv)


def test_native_geometry_is_asked_once_per_setting_and_errors_every_time() -> None:
    b = NativeBackend.__new__(NativeBackend)  # only geometry(): no GPU runtime behind it
    b._rt = _GeoRt()
    cfg = Buffer.get_dispatch_config(2)
    assert b.geometry(20, cfg) == (20, cfg.num_max_nvl_chunked_send_tokens, cfg.num_max_nvl_chunked_recv_tokens)
    assert b.geometry(20, cfg) is b.geometry(20, cfg) and b._rt.calls == 1
    assert b.geometry(24, cfg)[0] == 24 and b._rt.calls == 2
    other = cfg.__class__(20, 1, 64)
    assert b.geometry(20, other)[1:] == (1, 64) and b._rt.calls == 3
    for _ in range(2):
        with pytest.raises(InvalidUsageError, match="num_sms=80"):
            b.geometry(80, cfg)
    assert b._rt.calls == 5
    for n in range(2, 100, 2):
        b.geometry(min(n, 64), cfg.__class__(n, 1, 256))
    assert len(b._geos) <= 32


def test_knobs_follow_the_environment_on_every_read(monkeypatch) -> None:
    """env.get remembers a knob's parsed value against the variable's current value, however the environment is set
    (os.environ, pytest's monkeypatch, a replaced os.environ), and refuses a bad value on every read."""
    from uccl_moe import env
    from uccl_moe.errors import InvalidUsageError as Bad

    monkeypatch.delenv("UCCL_MOE_CHECK_INPUTS", raising=False)
    assert env.get("CHECK_INPUTS") is True  # the default
    monkeypatch.setenv("UCCL_MOE_CHECK_INPUTS", "0")
    assert env.get("CHECK_INPUTS") is False and env.get("CHECK_INPUTS") is False
    os.environ["UCCL_MOE_CHECK_INPUTS"] = "1"
    assert env.get("CHECK_INPUTS") is True
    monkeypatch.setenv("UCCL_MOE_CHECK_INPUTS", "maybe")
    for _ in range(2):
        with pytest.raises(Bad, match="UCCL_MOE_CHECK_INPUTS"):
            env.get("CHECK_INPUTS")
    monkeypatch.setenv("UCCL_MOE_CHECK_INPUTS", "")
    assert env.get("CHECK_INPUTS") is True  # empty = the default
    monkeypatch.setattr(os, "environ", {"UCCL_MOE_CHECK_INPUTS": "off"})  # a replaced mapping is read as it is
    assert env.get("CHECK_INPUTS") is False
