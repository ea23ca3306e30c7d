"""The topk_idx range check without a device sync, on the CPU: which backend checks where, when Buffer asks the
backend for what its kernels recorded, and the error the native backend raises from a recorded fault."""

from __future__ import annotations

import pytest
import torch

from uccl_moe import Buffer, InvalidUsageError, _checks
from uccl_moe.backends.native import NativeBackend


class _Rt:
    def __init__(self, faults):
        self.faults = list(faults)

    def take_topk_fault(self):
        return self.faults.pop(0) if self.faults else None


def _native_with(faults) -> NativeBackend:
    b = NativeBackend.__new__(NativeBackend)  # only the fault path: no GPU runtime behind it
    b._rt = _Rt(faults)
    return b


def test_a_recorded_fault_raises_once_with_token_k_value_and_range():
    b = _native_with([(3, 1, 9, 8)])
    with pytest.raises(InvalidUsageError, match=r"topk_idx holds expert id 9, outside \[-1, 8\) \(token 3, k 1\)"):
        b.raise_device_faults()
    b.raise_device_faults()  # taken: cleared, the Buffer stays usable
    _native_with([]).raise_device_faults()
    dead = _native_with([(0, 0, -5, 4)])
    dead._rt = None  # destroyed: nothing to read
    dead.raise_device_faults()


def test_who_checks_on_the_host(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setenv("UCCL_MOE_CHECK_INPUTS", "1")
    assert _checks.value_checks_on(cpu) and _checks.topk_checks_on()
    assert not _checks.value_checks_on(cpu, on_device=True)  # the kernels check: no host read
    assert NativeBackend.checks_topk_idx_on_device
    monkeypatch.setenv("UCCL_MOE_CHECK_INPUTS", "0")
    assert not _checks.value_checks_on(cpu) and not _checks.topk_checks_on()


def test_a_device_checked_topk_is_not_read_on_the_host(monkeypatch):
    reads = []
    monkeypatch.setattr(_checks, "host_ints", lambda t: reads.append(t) or [0, 0])
    check = _checks.TopkIdxCheck()
    bad = torch.tensor([[0, 9]])
    check.on_device = True
    assert check(bad, 4, torch.device("cpu")) is bad and reads == []  # left to the kernels
    check.on_device = False
    monkeypatch.setattr(_checks, "host_ints", lambda t: reads.append(t) or [0, 9])
    with pytest.raises(InvalidUsageError, match="expert id 9"):
        check(bad, 4, torch.device("cpu"))
    assert len(reads) == 1


def test_buffer_asks_the_backend_after_dispatch_and_combine_not_after_layout(group, monkeypatch):
    buf = Buffer(group, Buffer.get_dispatch_config(1).get_nvl_buffer_size_hint(16 * 2, 1), backend="reference",
                 explicitly_destroy=True)
    assert buf._check_topk_idx.on_device is False and buf._check_values()
    calls = []
    monkeypatch.setattr(buf._backend, "raise_device_faults", lambda: calls.append(len(calls)))
    try:
        idx = torch.tensor([[0, 1], [2, -1]])
        lay = buf.get_dispatch_layout(idx, 4)
        assert calls == []  # not collective: raising here would leave the peers in the dispatch
        x = torch.randn((2, 16)).bfloat16()
        res = buf.dispatch(x, num_tokens_per_rank=lay.num_tokens_per_rank, is_token_in_rank=lay.is_token_in_rank,
                           num_tokens_per_expert=lay.num_tokens_per_expert, topk_idx=idx,
                           topk_weights=torch.ones((2, 2)))
        assert len(calls) == 1
        buf.dispatch(x, handle=res.handle)
        buf.combine(res.recv_x, res.handle)
        assert len(calls) == 3

        def fault():
            raise InvalidUsageError("recorded")

        monkeypatch.setattr(buf._backend, "raise_device_faults", fault)
        with pytest.raises(InvalidUsageError, match="recorded"):
            buf.combine(res.recv_x, res.handle)
    finally:
        buf.destroy()


def test_inference_tensors_are_checked_every_call():
    """A topk_idx made under torch.inference_mode() has no version counter (reading it raises): the once-per-routing
    checks (Buffer's, the reference backend's in a group) check it at every call instead of failing."""
    from uccl_moe.backends.reference import ReferenceBackend
    from uccl_moe.utils import RoutingMemo

    check = _checks.TopkIdxCheck()
    with torch.inference_mode():
        good, bad = torch.tensor([[0, 3], [1, -1]]), torch.tensor([[0, 9]])
    memo, plain = RoutingMemo(), good.clone()
    memo.remember(good, 4)
    assert not memo.holds(good, 4)  # no version: never held
    memo.remember(plain, 4)
    assert memo.holds(plain, 4)
    assert check(good, 4, torch.device("cpu")) is good and check(good, 4, torch.device("cpu")) is good
    with pytest.raises(InvalidUsageError, match="expert id 9"):
        check(bad, 4, torch.device("cpu"))
    ref = ReferenceBackend.__new__(ReferenceBackend)  # the scan alone, as a rank of a group runs it
    ref.checks_topk_idx_on_device, ref._topk_fault, ref._topk_clean = True, (0, 0, 0, 0, 0, 0), RoutingMemo()
    assert ref._scan_topk(good, 4, 1) is good and ref._scan_topk(good, 4, 2) is good
    assert not ref._topk_clean.holds(good, 4)
    taken = ref._scan_topk(bad, 4, 1)
    assert taken is not None and taken.tolist() == [[0, -1]] and ref._topk_fault == (1, 0, 1, 9, 4, 1)
