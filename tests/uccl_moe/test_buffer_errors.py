"""Bad input raises a clear exception (type and message) before any communication.

A world-of-one gloo group is enough: every check runs before the backend is reached.
"""

from __future__ import annotations

import pytest
import torch

from uccl_moe import Buffer, Config, InvalidTypeError, InvalidUsageError, UcclMoeError

H = 256


@pytest.fixture()
def buf(group):
    return Buffer(group, Buffer.get_dispatch_config(1).get_nvl_buffer_size_hint(H * 4, 1), backend="reference")


def _layout(buf, T=6, E=4, K=2):
    idx = torch.randint(0, E, (T, K))
    ntr, _, nte, itr, _ = buf.get_dispatch_layout(idx, E)
    return idx, ntr, nte, itr


def _raises(exc, match, fn, *a, **k):
    with pytest.raises(exc, match=match) as info:
        fn(*a, **k)
    assert isinstance(info.value, UcclMoeError) or exc in (NotImplementedError,)
    return info.value


# ---- constructor -----------------------------------------------------------------------------------
def test_group_must_be_a_process_group():
    _raises(InvalidTypeError, "ProcessGroup", Buffer, None, 0)


def test_mpi_comm_is_rejected(group):
    _raises(InvalidTypeError, "mpi4py", Buffer, group, 0, comm=object())


def test_nvl_bytes_alignment_and_sign(group):
    _raises(InvalidUsageError, "multiple of 128", Buffer, group, 100)
    _raises(InvalidTypeError, "non-negative int", Buffer, group, -128)


def test_low_latency_is_not_implemented(group):
    with pytest.raises(NotImplementedError, match="low_latency_mode=False"):
        Buffer(group, 0, 0, low_latency_mode=True)


def test_native_on_gloo_is_rejected(group):
    _raises(InvalidUsageError, "backend='reference'", Buffer, group, 0, backend="native")


def test_unknown_backend(group):
    _raises(InvalidUsageError, "not one of", Buffer, group, 0, backend="fast")


def test_bad_backend_env(group, monkeypatch):
    monkeypatch.setenv("UCCL_MOE_BACKEND", "turbo")
    _raises(InvalidUsageError, 'UCCL_MOE_BACKEND="turbo" is invalid: expected one of auto\\|native\\|reference',
            Buffer, group, 0)


# ---- layout ------------------------------------------------------------------------------------------
def test_topk_idx_dtype(buf):
    _raises(InvalidTypeError, "topk_idx must have dtype int64, got int32", buf.get_dispatch_layout,
            torch.zeros((2, 2), dtype=torch.int32), 4)


def test_topk_idx_shape(buf):
    _raises(InvalidUsageError, "topk_idx must be 2-D", buf.get_dispatch_layout, torch.zeros(4, dtype=torch.int64), 4)


def test_topk_idx_out_of_range(buf):
    idx = torch.tensor([[0, 4]])
    _raises(InvalidUsageError, "expert id 4, outside \\[-1, 4\\)", buf.get_dispatch_layout, idx, 4)
    _raises(InvalidUsageError, "expert id -2", buf.get_dispatch_layout, torch.tensor([[-2, 0]]), 4)


def test_num_experts_divisibility(group):
    # world 1 divides everything; check the message through a fake size via the static rule
    b = Buffer(group, 0, backend="reference")
    b.group_size = 3  # as a 3-rank group would see it
    _raises(InvalidUsageError, "num_experts=4 is not divisible by the group size 3", b.get_dispatch_layout,
            torch.zeros((1, 1), dtype=torch.int64), 4)


def test_num_experts_any_integer_type(buf):
    import numpy as np

    idx = torch.randint(0, 4, (6, 2))
    want = buf.get_dispatch_layout(idx, 4)
    for n in (np.int32(4), torch.tensor(4)):
        got = buf.get_dispatch_layout(idx, n)
        assert all(torch.equal(a, b) for a, b in zip(got, want) if isinstance(a, torch.Tensor))
    for bad in (4.0, True, "4"):
        _raises(InvalidTypeError, "num_experts must be a positive int", buf.get_dispatch_layout, idx, bad)


def test_too_many_topk(buf):
    _raises(InvalidUsageError, "supported: 1..32", buf.get_dispatch_layout, torch.zeros((1, 33), dtype=torch.int64), 64)


# ---- dispatch ----------------------------------------------------------------------------------------
def test_x_dtype(buf):
    idx, ntr, nte, itr = _layout(buf)
    _raises(InvalidTypeError, "x must have dtype", buf.dispatch, torch.zeros((6, H), dtype=torch.int32),
            num_tokens_per_rank=ntr, is_token_in_rank=itr, num_tokens_per_expert=nte)


def test_x_not_contiguous(buf):
    idx, ntr, nte, itr = _layout(buf)
    x = torch.zeros((H, 6), dtype=torch.bfloat16).t()
    _raises(InvalidUsageError, "contiguous", buf.dispatch, x, num_tokens_per_rank=ntr, is_token_in_rank=itr,
            num_tokens_per_expert=nte)


def test_fp8_without_scales(buf):
    idx, ntr, nte, itr = _layout(buf)
    _raises(InvalidTypeError, "must come with its scales", buf.dispatch,
            torch.zeros((6, H), dtype=torch.float8_e4m3fn), num_tokens_per_rank=ntr, is_token_in_rank=itr,
            num_tokens_per_expert=nte)


def test_fp8_scale_shape(buf):
    idx, ntr, nte, itr = _layout(buf)
    x = torch.zeros((6, H), dtype=torch.float8_e4m3fn)
    _raises(InvalidUsageError, "must be \\[6, 2\\]", buf.dispatch, (x, torch.ones(6, 3)), num_tokens_per_rank=ntr,
            is_token_in_rank=itr, num_tokens_per_expert=nte)
    _raises(InvalidUsageError, "scales have 5 rows", buf.dispatch, (x, torch.ones(5, 2)), num_tokens_per_rank=ntr,
            is_token_in_rank=itr, num_tokens_per_expert=nte)
    _raises(InvalidTypeError, "dtype float32 or int32", buf.dispatch, (x, torch.ones(6, 2, dtype=torch.float64)),
            num_tokens_per_rank=ntr, is_token_in_rank=itr, num_tokens_per_expert=nte)


def test_row_bytes_multiple_of_16(buf):
    idx = torch.zeros((2, 1), dtype=torch.int64)
    ntr, _, nte, itr, _ = buf.get_dispatch_layout(idx, 4)
    _raises(InvalidUsageError, "multiple of 16 bytes", buf.dispatch, torch.zeros((2, 12), dtype=torch.bfloat16),
            num_tokens_per_rank=ntr, is_token_in_rank=itr, num_tokens_per_expert=nte)


def test_missing_layout(buf):
    _raises(InvalidUsageError, "is_token_in_rank, num_tokens_per_expert missing", buf.dispatch,
            torch.zeros((6, H), dtype=torch.bfloat16), num_tokens_per_rank=torch.zeros(1, dtype=torch.int32))


def test_topk_given_alone(buf):
    idx, ntr, nte, itr = _layout(buf)
    _raises(InvalidUsageError, "given together", buf.dispatch, torch.zeros((6, H), dtype=torch.bfloat16),
            num_tokens_per_rank=ntr, is_token_in_rank=itr, num_tokens_per_expert=nte, topk_idx=idx)


def test_topk_weights_dtype(buf):
    idx, ntr, nte, itr = _layout(buf)
    _raises(InvalidTypeError, "topk_weights must have dtype float32, got bfloat16", buf.dispatch,
            torch.zeros((6, H), dtype=torch.bfloat16), num_tokens_per_rank=ntr, is_token_in_rank=itr,
            num_tokens_per_expert=nte, topk_idx=idx, topk_weights=torch.ones(idx.shape, dtype=torch.bfloat16))


def test_topk_rows_must_match_x(buf):
    """x with fewer rows than the routing it came with: the error names x's token count against the layout's."""
    idx, ntr, nte, itr = _layout(buf)
    _raises(InvalidUsageError, "x has 5 tokens but is_token_in_rank has 6 rows", buf.dispatch,
            torch.zeros((5, H), dtype=torch.bfloat16), num_tokens_per_rank=ntr, is_token_in_rank=itr,
            num_tokens_per_expert=nte, topk_idx=idx, topk_weights=torch.ones(idx.shape))
    _raises(InvalidUsageError, "is_token_in_rank has shape", buf.dispatch, torch.zeros((6, H), dtype=torch.bfloat16),
            num_tokens_per_rank=ntr, is_token_in_rank=itr[:, :0], num_tokens_per_expert=nte)


def test_wrong_group_size_layout(buf):
    idx, ntr, nte, itr = _layout(buf)
    _raises(InvalidUsageError, "group has 1 ranks", buf.dispatch, torch.zeros((6, H), dtype=torch.bfloat16),
            num_tokens_per_rank=torch.zeros(2, dtype=torch.int32), is_token_in_rank=itr, num_tokens_per_expert=nte)


def test_inconsistent_layout(buf):
    idx, ntr, nte, itr = _layout(buf)
    _raises(InvalidUsageError, "does not match is_token_in_rank", buf.dispatch,
            torch.zeros((6, H), dtype=torch.bfloat16), num_tokens_per_rank=ntr + 1, is_token_in_rank=itr,
            num_tokens_per_expert=nte)


def test_buffer_too_small(group):
    b = Buffer(group, 1 << 20, backend="reference")
    idx = torch.zeros((2, 1), dtype=torch.int64)
    ntr, _, nte, itr, _ = b.get_dispatch_layout(idx, 2)
    need = Buffer.get_dispatch_config(1).get_nvl_buffer_size_hint(7168 * 2, 1)
    e = _raises(InvalidUsageError, f"needs {need} bytes of NVL buffer.*num_nvl_bytes >= {need}", b.dispatch,
                torch.zeros((2, 7168), dtype=torch.bfloat16), num_tokens_per_rank=ntr, is_token_in_rank=itr,
                num_tokens_per_expert=nte)
    assert "num_nvl_bytes=1048576" in str(e) and "bytes per value" not in str(e)


def test_buffer_too_small_for_float32_rows_names_the_dtype(group):
    """A combine (or dispatch) of float32 rows that overflows the Buffer says x is float32, whose rows take twice the
    room of bfloat16 ones: an upcast the caller may not have meant, which a bigger Buffer would hide."""
    H2 = 7168
    need_bf16 = Buffer.get_dispatch_config(1).get_nvl_buffer_size_hint(H2 * 2, 1)
    b = Buffer(group, need_bf16, backend="reference")  # room for bfloat16 rows of H2 values, not float32 ones
    idx = torch.zeros((2, 1), dtype=torch.int64)
    ntr, _, nte, itr, _ = b.get_dispatch_layout(idx, 2)
    r = b.dispatch(torch.zeros((2, H2), dtype=torch.bfloat16), num_tokens_per_rank=ntr, is_token_in_rank=itr,
                   num_tokens_per_expert=nte, topk_idx=idx, topk_weights=torch.ones(idx.shape))
    e = _raises(InvalidUsageError, "needs .* bytes of NVL buffer", b.combine, r.recv_x.float(), r.handle)
    assert "x is float32 (4 bytes per value)" in str(e) and "cast it to bfloat16" in str(e)
    b.combine(r.recv_x, r.handle)  # the bfloat16 rows fit


def test_backend_config_check_comes_before_the_size_check(group, monkeypatch):
    """The native backend refuses more SMs than the GPU has (NvlRuntime::check_num_sms, GPU-tested); Buffer asks
    the backend before its buffer-size check on a dispatch that lays out lanes, so that error is the one a user
    sees. A cached dispatch or a combine runs on the handle's lanes, so its config's num_sms is not asked about."""
    # sized by a fixed ring-256 config (not the measured preset, whose ring may shrink) so `small` below fits
    b = Buffer(group, Config(20, 8, 256, 6, 128).get_nvl_buffer_size_hint(H * 2, 1), backend="reference")
    idx, ntr, nte, itr = _layout(b)
    x = torch.randn((idx.shape[0], H)).bfloat16()
    res = b.dispatch(x, num_tokens_per_rank=ntr, is_token_in_rank=itr, num_tokens_per_expert=nte, topk_idx=idx,
                     topk_weights=torch.rand(idx.shape))
    seen = []

    def refuse(config):
        seen.append(config.num_sms)
        raise InvalidUsageError(f"num_sms={config.num_sms} refused by the backend")

    monkeypatch.setattr(b._backend, "check_config", refuse)
    huge = Config(256, 6, 4096, 6, 128)  # also far too big for this Buffer's NVL bytes
    _raises(InvalidUsageError, "num_sms=256 refused", b.dispatch, x, num_tokens_per_rank=ntr, is_token_in_rank=itr,
            num_tokens_per_expert=nte, config=huge)
    assert seen == [256]
    small = Config(256, 6, 12, 6, 128)  # fits the buffer: the handle's lanes run it
    assert torch.equal(b.dispatch(x, handle=res[4], config=small)[0], res[0])
    assert torch.equal(b.combine(res[0], res[4], config=small)[0], b.combine(res[0], res[4])[0])
    assert seen == [256]


def test_num_worst_tokens_too_small(buf):
    idx = torch.zeros((4, 1), dtype=torch.int64)
    ntr, _, nte, itr, _ = buf.get_dispatch_layout(idx, 2)
    _raises(InvalidUsageError, "num_worst_tokens=2 is smaller than the 4 rows", buf.dispatch,
            torch.zeros((4, H), dtype=torch.bfloat16), num_tokens_per_rank=ntr, is_token_in_rank=itr,
            num_tokens_per_expert=nte, topk_idx=idx, topk_weights=torch.ones(4, 1), num_worst_tokens=2)


def test_num_worst_tokens_needs_topk(buf):
    idx, ntr, nte, itr = _layout(buf)
    _raises(InvalidUsageError, "needs topk_idx", buf.dispatch, torch.zeros((6, H), dtype=torch.bfloat16),
            num_tokens_per_rank=ntr, is_token_in_rank=itr, num_tokens_per_expert=nte, num_worst_tokens=100)


def test_expert_alignment(buf):
    idx, ntr, nte, itr = _layout(buf)
    _raises(InvalidUsageError, "expert_alignment=0 must be >= 1", buf.dispatch,
            torch.zeros((6, H), dtype=torch.bfloat16),
            num_tokens_per_rank=ntr, is_token_in_rank=itr, num_tokens_per_expert=nte, expert_alignment=0)


def test_alignment_and_worst_tokens_take_any_integer_type(buf, monkeypatch):
    """As DeepEP, whatever behaves as an integer: numpy and 0-d torch integers act as the same ints and reach the
    backend as Python ints; bools (also 0-d bool tensors), floats and strings are refused."""
    import numpy as np

    torch.manual_seed(0)  # routing whose per-expert counts are not all multiples of 4 already (else flaky, ~2%)
    idx, ntr, nte, itr = _layout(buf, T=24, E=4, K=2)
    x = torch.randn((24, H)).bfloat16()
    kw = dict(num_tokens_per_rank=ntr, is_token_in_rank=itr, num_tokens_per_expert=nte, topk_idx=idx,
              topk_weights=torch.rand(idx.shape))
    seen = []
    real = buf._backend.dispatch

    def spy(req):
        seen.append((req.expert_alignment, req.num_worst_tokens))
        return real(req)

    monkeypatch.setattr(buf._backend, "dispatch", spy)
    want = buf.dispatch(x, **kw, expert_alignment=4)
    assert all(c % 4 == 0 for c in want[3]) and want[3] != buf.dispatch(x, **kw)[3]  # the alignment shows
    for align, worst in ((np.int32(4), np.int64(64)), (torch.tensor(4), torch.tensor(64))):
        assert buf.dispatch(x, **kw, expert_alignment=align)[3] == want[3]
        got = buf.dispatch(x, **kw, expert_alignment=align, num_worst_tokens=worst)
        assert got[0].shape[0] == 64 and torch.equal(got[0][: want[0].shape[0]], want[0])
    assert seen and all(type(a) is int and type(w) is int for a, w in seen)
    for name in ("expert_alignment", "num_worst_tokens"):
        for bad in (True, torch.tensor(True), 4.0, "4"):
            _raises(InvalidTypeError, f"{name} must be an int", buf.dispatch, x, **kw, **{name: bad})


def test_handle_ops_are_sized_by_the_handles_sms(group, monkeypatch):
    """A cached dispatch or a combine runs on the lanes its handle's dispatch laid out (the native backend reports
    their SM count through handle_num_sms), so Buffer's size check takes that count, not config.num_sms: a config
    with more SMs than fit is fine on a handle laid out with few, and a handle laid out with more SMs than the
    Buffer fits is refused whatever the config says, naming the count."""
    narrow, wide = Config(8, 6, 64, 6, 128), Config(64, 6, 64, 6, 128)
    need_narrow, need_wide = (c.get_nvl_buffer_size_hint(H * 2, 1) for c in (narrow, wide))
    assert need_narrow < need_wide
    b = Buffer(group, need_narrow, backend="reference")
    idx, ntr, nte, itr = _layout(b)
    x = torch.randn((idx.shape[0], H)).bfloat16()
    res = b.dispatch(x, num_tokens_per_rank=ntr, is_token_in_rank=itr, num_tokens_per_expert=nte, topk_idx=idx,
                     topk_weights=torch.rand(idx.shape), config=narrow)
    assert b._backend.handle_num_sms(res[4]) is None  # the reference backend follows the config
    _raises(InvalidUsageError, f"needs {need_wide} bytes", b.combine, res[0], res[4], config=wide)
    monkeypatch.setattr(b._backend, "handle_num_sms", lambda handle: 8)
    assert torch.equal(b.combine(res[0], res[4], config=wide)[0], b.combine(res[0], res[4], config=narrow)[0])
    assert torch.equal(b.dispatch(x, handle=res[4], config=wide)[0], res[0])
    monkeypatch.setattr(b._backend, "handle_num_sms", lambda handle: 64)
    for op in (lambda: b.combine(res[0], res[4], config=narrow), lambda: b.dispatch(x, handle=res[4], config=narrow)):
        e = _raises(InvalidUsageError, f"num_sms=64: it runs on the lanes of the dispatch that made the handle.*"
                    f"needs {need_wide} bytes", op)
        assert f"num_nvl_bytes={need_narrow}" in str(e)


def test_previous_event_type(buf):
    idx, ntr, nte, itr = _layout(buf)
    _raises(InvalidTypeError, "previous_event must be an EventOverlap", buf.get_dispatch_layout, idx, 4,
            previous_event=object())


def test_config_type(buf):
    idx, ntr, nte, itr = _layout(buf)
    _raises(InvalidTypeError, "config must be a uccl_moe.Config", buf.dispatch,
            torch.zeros((6, H), dtype=torch.bfloat16),
            num_tokens_per_rank=ntr, is_token_in_rank=itr, num_tokens_per_expert=nte, config={"num_sms": 4})


# ---- cached dispatch and combine ---------------------------------------------------------------------
def _dispatched(buf):
    idx, ntr, nte, itr = _layout(buf)
    x = torch.randn((6, H)).bfloat16()
    res = buf.dispatch(x, num_tokens_per_rank=ntr, is_token_in_rank=itr, num_tokens_per_expert=nte, topk_idx=idx,
                       topk_weights=torch.rand(idx.shape))
    return x, idx, res


def test_cached_dispatch_rejects_topk(buf):
    x, idx, res = _dispatched(buf)
    _raises(InvalidUsageError, "topk_idx=None", buf.dispatch, x, handle=res.handle, topk_idx=idx,
            topk_weights=torch.ones(idx.shape))


def test_cached_dispatch_token_count(buf):
    x, idx, res = _dispatched(buf)
    _raises(InvalidUsageError, "made for 6", buf.dispatch, x[:5].contiguous(), handle=res.handle)


def test_handle_type(buf):
    x, idx, res = _dispatched(buf)
    _raises(InvalidTypeError, "handle must be", buf.combine, res.recv_x, handle=[1, 2])
    forged = tuple(t.clone() for t in res.handle)
    _raises(InvalidUsageError, "not returned by a uccl_moe Buffer's dispatch", buf.combine, res.recv_x, forged)


def test_combine_rows(buf):
    x, idx, res = _dispatched(buf)
    _raises(InvalidUsageError, "one row per received token", buf.combine, res.recv_x[:-1].contiguous(), res.handle)


def test_combine_bias_shape(buf):
    x, idx, res = _dispatched(buf)
    _raises(InvalidUsageError, "bias\\[0\\] has shape", buf.combine, res.recv_x, res.handle,
            bias=torch.zeros((5, H), dtype=torch.bfloat16))
    _raises(InvalidTypeError, "bias must be None, a tensor, or a tuple", buf.combine, res.recv_x, res.handle,
            bias=(None, None, None))


def test_combine_topk_weights_shape(buf):
    x, idx, res = _dispatched(buf)
    _raises(InvalidUsageError, "topk_weights has shape", buf.combine, res.recv_x, res.handle,
            topk_weights=torch.ones((1, 2)))


# ---- combine from the buffer (get_combine_buffer) ---------------------------------------------------------------
def test_get_combine_buffer_without_the_path_is_a_fresh_tensor(buf):
    """The reference backend has no buffer path: the caller gets a tensor of its own, and combine from it is the
    ordinary combine."""
    x, idx, res = _dispatched(buf)
    view = buf.get_combine_buffer(res.handle, H)
    assert view.shape == res.recv_x.shape and view.dtype == torch.bfloat16
    view.copy_(res.recv_x * 2)
    want = buf.combine((res.recv_x * 2).contiguous(), res.handle).combined_x
    assert torch.equal(buf.combine(view, res.handle).combined_x, want)
    assert buf.get_combine_buffer(res.handle, H, dtype=torch.float32).dtype == torch.float32


def test_get_combine_buffer_bad_arguments(buf):
    x, idx, res = _dispatched(buf)
    _raises(InvalidUsageError, "hidden=0", buf.get_combine_buffer, res.handle, 0)
    # the 16-byte row rule is the native kernels' (checked there); a plain tensor takes any width
    assert buf.get_combine_buffer(res.handle, 12, dtype=torch.float32).shape == (res.recv_x.shape[0], 12)
    _raises(InvalidTypeError, "dtype must be a torch.dtype", buf.get_combine_buffer, res.handle, H, "bf16")
    _raises(InvalidTypeError, "handle must be", buf.get_combine_buffer, [1, 2], H)


def test_combine_buffer_fits(buf, monkeypatch):
    """Without the path (reference backend) the view is a plain tensor: always fits. With it, the backend answers
    (NativeBackend: test_native_combine_buffer_fits_answers_for_the_most_rows) for the checked handle, hidden and
    num_topk; bad arguments are refused here."""
    x, idx, res = _dispatched(buf)
    assert buf.combine_buffer_fits(res.handle, H) is True
    asked = []

    def fits(h, hidden, num_topk):
        asked.append((h.recv_src_idx is res.handle[3], hidden, num_topk))
        return hidden < 100

    monkeypatch.setattr(buf._backend, "combine_buffer_fits", fits, raising=False)
    assert buf.combine_buffer_fits(res.handle, 64, 2) is True and buf.combine_buffer_fits(res.handle, 128) is False
    assert asked == [(True, 64, 2), (True, 128, 0)]
    _raises(InvalidUsageError, "need hidden > 0 and num_topk >= 0", buf.combine_buffer_fits, res.handle, 0)
    _raises(InvalidUsageError, "need hidden > 0 and num_topk >= 0", buf.combine_buffer_fits, res.handle, 8, -1)
    _raises(InvalidTypeError, "hidden must be an int", buf.combine_buffer_fits, res.handle, 8.5)
    _raises(InvalidTypeError, "handle must be", buf.combine_buffer_fits, [1, 2], H)


def test_combine_refuses_a_view_another_call_overwrote(buf, monkeypatch):
    """A backend whose view is buffer memory (native): a dispatch, or a combine from another tensor, between
    get_combine_buffer and the combine ran over the rows, so combine refuses; layout calls and combines from the view
    do not count, and a fresh view is accepted. A view last taken for another handle is refused too."""
    x, idx, res = _dispatched(buf)
    memory = torch.zeros_like(res.recv_x)  # stands in for the NVL buffer
    monkeypatch.setattr(buf._backend, "combine_buffer", lambda h, hidden, dtype: memory, raising=False)
    view = buf.get_combine_buffer(res.handle, H)
    assert view.data_ptr() == memory.data_ptr()
    view.copy_(res.recv_x)
    buf.get_dispatch_layout(idx, 4)  # does not touch the NVL buffer
    assert torch.equal(buf.combine(view, res.handle).combined_x, buf.combine(res.recv_x, res.handle).combined_x)
    view = buf.get_combine_buffer(res.handle, H)
    buf.dispatch(x, handle=res.handle)
    _raises(InvalidUsageError, "1 dispatch/combine call\\(s\\) of this Buffer ran since.*call get_combine_buffer again",
            buf.combine, view, res.handle)
    view = buf.get_combine_buffer(res.handle, H)
    view.copy_(res.recv_x)
    first = buf.combine(view, res.handle).combined_x
    assert torch.equal(buf.combine(view, res.handle).combined_x, first)  # a combine from the view leaves it intact
    buf.combine(res.recv_x, res.handle)  # a combine from another tensor runs through the rings
    _raises(InvalidUsageError, "overwrote it", buf.combine, view, res.handle)
    # Every handle's view is the same memory: a view last taken for another handle holds that handle's rows.
    _, _, res2 = _dispatched(buf)
    view = buf.get_combine_buffer(res.handle, H)
    view2 = buf.get_combine_buffer(res2.handle, H)
    assert view2.data_ptr() == view.data_ptr()
    _raises(InvalidUsageError, "last taken for another handle", buf.combine, view, res.handle)
    view2.copy_(res2.recv_x)
    assert torch.equal(buf.combine(view2, res2.handle).combined_x, buf.combine(res2.recv_x, res2.handle).combined_x)


def test_combine_buffer_size_hint_matches_the_kernels_layout():
    """1 MiB of meta, the rows on 128-B lines, then the weights; rounded up to 4096. The same bytes the binding
    the native backend checks against says (when this build has the kernels)."""
    from uccl_moe import _C

    assert Buffer.get_combine_buffer_size_hint(0, 16) == 1 << 20
    assert Buffer.get_combine_buffer_size_hint(8192, 7168) == (1 << 20) + 8192 * 7168 * 2
    assert Buffer.get_combine_buffer_size_hint(3, 8, 2) == (1 << 20) + 4096
    if hasattr(_C, "intranode_combine_input_layout"):
        for rows, hidden, k in ((0, 16, 0), (1, 8, 3), (333, 2056, 3), (8192, 7168, 8)):
            offset, end = _C.intranode_combine_input_layout(rows, hidden, k)
            hint = Buffer.get_combine_buffer_size_hint(rows, hidden, k)
            assert offset == 1 << 20 and end <= hint < end + 4096, (rows, hidden, k, end, hint)
    _raises(InvalidUsageError, "hidden > 0", Buffer.get_combine_buffer_size_hint, 4, 0)
    _raises(InvalidTypeError, "must be", Buffer.get_combine_buffer_size_hint, 4.0, 16)


def test_destroyed_buffer(group):
    b = Buffer(group, 0, explicitly_destroy=True, backend="reference")
    b.destroy()
    b.destroy()  # idempotent
    _raises(InvalidUsageError, "destroyed", b.get_dispatch_layout, torch.zeros((1, 1), dtype=torch.int64), 1)


# ---- static API ----------------------------------------------------------------------------------------
def test_set_num_sms():
    old = Buffer.num_sms
    try:
        Buffer.set_num_sms(24)
        assert Buffer.num_sms == 24 and Buffer.get_dispatch_config(4).num_sms == 24
        _raises(InvalidUsageError, "positive even int", Buffer.set_num_sms, 23)
        for bad in (True, 24.0, "24", None):
            _raises(InvalidUsageError, "positive even int", Buffer.set_num_sms, bad)
        # any integer type, as DeepEP (which only asserts evenness) takes: numpy and 0-d torch integers
        import numpy as np

        for n in (np.int64(26), torch.tensor(28)):
            Buffer.set_num_sms(n)
            assert type(Buffer.num_sms) is int and Buffer.num_sms == int(n)
    finally:
        Buffer.set_num_sms(old)


def test_the_dispatch_preset_hint_holds_the_combine():
    # clients size the Buffer by get_dispatch_config's hint alone (the repository's examples do); bench.tune keeps
    # dispatch's ring no smaller than combine's so that stays enough
    old = Buffer.num_sms
    try:
        for sms in (20, 24, 32):
            Buffer.set_num_sms(sms)
            for r in range(1, 9):
                for hidden_bytes in (512, 4096 * 2, 7168 * 2):
                    d = Buffer.get_dispatch_config(r).get_nvl_buffer_size_hint(hidden_bytes, r)
                    c = Buffer.get_combine_config(r).get_nvl_buffer_size_hint(hidden_bytes, r)
                    assert d >= c, (sms, r, hidden_bytes, d, c)
    finally:
        Buffer.set_num_sms(old)


def test_presets_follow_the_group_size():
    # the rows are measured (python -m uccl_moe.bench.tune --write rewrites them): each size takes its own row
    from uccl_moe import tuning

    def fields(cfg):
        return (cfg.num_sms, cfg.num_max_nvl_chunked_send_tokens, cfg.num_max_nvl_chunked_recv_tokens)

    for r in range(1, 9):
        row = tuning.INTRANODE[r]
        assert fields(Buffer.get_dispatch_config(r)) == (Buffer.num_sms, row.dispatch.nvl_send, row.dispatch.nvl_recv)
        assert fields(Buffer.get_combine_config(r)) == (Buffer.num_sms, row.combine.nvl_send, row.combine.nvl_recv)
    assert Buffer.get_dispatch_config(16).num_max_nvl_chunked_recv_tokens == 288  # across nodes
    assert Buffer.get_combine_config(16).num_max_nvl_chunked_send_tokens == 8
    import numpy as np

    for n in (np.int64(2), torch.tensor(2)):  # any integer type, as for num_sms
        assert fields(Buffer.get_dispatch_config(n)) == fields(Buffer.get_dispatch_config(2))
        assert fields(Buffer.get_combine_config(n)) == fields(Buffer.get_combine_config(2))
    for bad in (True, 2.0, "2", 0):
        _raises(InvalidUsageError, "num_ranks must be a positive int", Buffer.get_dispatch_config, bad)


def test_config_validation():
    c = Config(24, 8, 256)  # DeepEP's positional form
    assert (c.num_sms, c.num_max_nvl_chunked_send_tokens, c.num_max_nvl_chunked_recv_tokens) == (24, 8, 256)
    assert c.num_channels == 12
    c = Config(num_sms=4, num_max_rdma_chunked_send_tokens=6, num_max_rdma_chunked_recv_tokens=100)
    assert c.num_max_rdma_chunked_recv_tokens == 102  # rounded up to a multiple of rdma_send
    _raises(InvalidUsageError, "num_sms must be an even number", Config, num_sms=3)
    _raises(InvalidUsageError, "must be smaller than num_max_nvl_chunked_recv_tokens", Config, 20, 256, 256)
    _raises(InvalidUsageError, "at most half", Config, 20, 6, 256, 100, 100)


def test_size_hints_scale_with_channels_ranks_and_hidden():
    c20, c24 = Config(20), Config(24)
    h = 7168 * 2
    assert c24.get_nvl_buffer_size_hint(h, 4) > c20.get_nvl_buffer_size_hint(h, 4)
    assert c20.get_nvl_buffer_size_hint(h, 8) > c20.get_nvl_buffer_size_hint(h, 4)
    assert c20.get_nvl_buffer_size_hint(h, 4) > c20.get_nvl_buffer_size_hint(4096 * 2, 4)
    assert c20.get_nvl_buffer_size_hint(h, 4) % 128 == 0
    assert c20.get_rdma_buffer_size_hint(h, 8) == 0  # one node
    assert c20.get_rdma_buffer_size_hint(h, 16) > 0  # two nodes of 8
    assert c20.get_rdma_buffer_size_hint(h, 4, 2) > 0  # two nodes of 2
    _raises(InvalidUsageError, "ranks per node must divide", c20.get_nvl_buffer_size_hint, h, 6, 4)
    _raises(InvalidUsageError, "multiple of 16", c20.get_nvl_buffer_size_hint, 7, 4)


def test_low_latency_methods_are_explicit(buf):
    with pytest.raises(NotImplementedError):
        buf.low_latency_dispatch()
    with pytest.raises(NotImplementedError):
        Buffer.get_low_latency_rdma_size_hint(128, 7168, 8, 256)


def test_capture_and_comm_stream_on_cpu(buf):
    ev = Buffer.capture()
    ev.current_stream_wait()  # CPU events are always complete
    with ev:
        pass
    assert buf.get_comm_stream() is None


def test_value_checks_can_be_switched_off(buf, monkeypatch):
    monkeypatch.setenv("UCCL_MOE_CHECK_INPUTS", "0")
    assert buf._check_values() is False
    # shapes and dtypes are still checked
    _raises(InvalidTypeError, "topk_idx must have dtype int64", buf.get_dispatch_layout,
            torch.zeros((2, 2), dtype=torch.int32), 4)
    monkeypatch.setenv("UCCL_MOE_CHECK_INPUTS", "maybe")
    _raises(InvalidUsageError, 'UCCL_MOE_CHECK_INPUTS="maybe" is invalid', buf._check_values)


def test_topk_range_check_reads_the_device_once_per_routing(buf, monkeypatch):
    import uccl_moe._checks as buffer_mod

    reads = []
    real = buffer_mod.host_ints

    def counting(t):
        reads.append(t)
        return real(t)

    monkeypatch.setattr(buffer_mod, "host_ints", counting)
    topk = torch.tensor([[0, 1], [2, -1]], dtype=torch.int64)
    buf.get_dispatch_layout(topk, 4)
    buf.get_dispatch_layout(topk, 4)  # layout, then dispatch, of the same routing: checked once
    assert len(reads) == 1
    buf.get_dispatch_layout(topk, 8)  # another expert count: checked again
    assert len(reads) == 2
    topk[1, 1] = 4  # an in-place write after the check is seen
    _raises(InvalidUsageError, r"topk_idx holds expert id 4, outside \[-1, 4\)", buf.get_dispatch_layout, topk, 4)
    fresh = torch.tensor([[0, 1], [2, -1]], dtype=torch.int64)  # equal values, another tensor: read again
    buf.get_dispatch_layout(fresh, 4)
    assert len(reads) == 4
