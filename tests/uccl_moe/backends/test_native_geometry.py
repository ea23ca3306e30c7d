"""Host-side checks of the native intranode layer (no GPU needed): lane geometry, size math, validation.

Skipped when the build has no intranode kernels (no nvcc/hipcc at build time)."""

from __future__ import annotations

import pytest
import torch

from uccl_moe import _C, Config
from uccl_moe.errors import InvalidUsageError

pytestmark = pytest.mark.skipif(not _C.has_intranode_kernels(), reason="build without intranode kernels")


@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 5, 6, 7, 8])
def test_lanes_cover_the_ring_slots(ranks: int) -> None:
    W = _C.intranode_lanes_per_channel(ranks)
    assert W >= 1
    C, W2, T, Tl, chunk = _C.intranode_geometry(24, ranks, 8, 256)
    assert (C, W2, T) == (12, W, 256)
    assert W * Tl <= T and Tl >= 2 and chunk == min(8, Tl)


def test_chunk_is_clamped_to_the_lane_ring() -> None:
    _, W, _, Tl, chunk = _C.intranode_geometry(24, 2, 1000, 64)
    assert Tl == 64 // W and chunk == Tl


@pytest.mark.parametrize("args, word", [((23, 4, 8, 256), "num_sms"), ((24, 4, 8, 8), "num_max_nvl_chunked_recv"),
                                        ((24, 4, 0, 256), "num_max_nvl_chunked_send"), ((24, 9, 8, 256), "num_ranks")])
def test_bad_geometry_names_the_field(args: tuple, word: str) -> None:
    with pytest.raises(InvalidUsageError, match=word):
        _C.intranode_geometry(*args)


@pytest.mark.parametrize("ranks", [2, 4, 8])
@pytest.mark.parametrize("hidden, elem, topk", [(7168, 2, 8), (7168, 1, 8), (2056, 2, 32), (4096, 4, 8)])
def test_runtime_need_fits_the_config_hint(ranks: int, hidden: int, elem: int, topk: int) -> None:
    """Buffer sizes NVL memory with Config.get_nvl_buffer_size_hint(hidden * max(elem, 2)); the kernels must fit."""
    cfg = Config(24, 8, 256, 6, 128)
    scales = hidden // 128 if elem == 1 else 0
    need = _C.intranode_required_nvl_bytes(24, ranks, 8, 256, hidden * elem, topk, scales)
    assert need <= cfg.get_nvl_buffer_size_hint(hidden * max(elem, 2), ranks)


@pytest.mark.parametrize("ranks", [1, 3, 4, 8])
@pytest.mark.parametrize("hidden, elem, topk", [(7168, 2, 8), (7168, 1, 8), (2056, 2, 32), (4096, 4, 8), (16, 2, 1)])
def test_ring_slots_start_on_128_byte_lines(ranks: int, hidden: int, elem: int, topk: int) -> None:
    """Every lane ring and every slot in it starts on a 128-B line (a warp's row store then covers whole lines
    and sectors), for a Buffer sized by the hint and for an odd num_nvl_bytes."""
    scales = hidden // 128 if elem == 1 else 0
    cfg = Config(24, 8, 256, 6, 128)
    hint = cfg.get_nvl_buffer_size_hint(hidden * max(elem, 2), ranks)
    Tl = _C.intranode_geometry(24, ranks, 8, 256)[3]
    for nvl_bytes in (hint, hint + 4 * 1024 * 1024 + 16 * 37):
        slot, region, meta = _C.intranode_slot_placement(24, ranks, 8, 256, nvl_bytes, hidden * elem, topk, scales)
        assert slot % 128 == 0 and region % 128 == 0 and meta % 128 == 0, (slot, region, meta)
        assert slot >= hidden * elem + 4 + 8 * topk + 4 * scales  # row + src idx + ids + weights + scales
        assert region >= Tl * slot  # the hint leaves room for the aligned slots
    assert _C.nvl_slot_bytes(hidden * max(elem, 2)) % 128 == 0


def test_native_check_config_asks_the_runtime_once_alive():
    """NativeBackend.check_config hands config.num_sms to the runtime's check (GPU-tested: NvlRuntime refuses more
    SMs than the GPU has); a destroyed backend has no runtime and leaves the refusal to dispatch's liveness check."""
    from uccl_moe.backends.native import NativeBackend

    class FakeRuntime:
        def __init__(self) -> None:
            self.asked: list[int] = []

        def check_num_sms(self, num_sms: int) -> None:
            self.asked.append(num_sms)
            if num_sms > 132:
                raise InvalidUsageError(f"Config.num_sms={num_sms} exceeds the 132 SMs")

    backend = object.__new__(NativeBackend)  # no GPU here: only the runtime seam is exercised
    backend._rt = FakeRuntime()
    backend.check_config(Config(24, 8, 256, 6, 128))
    with pytest.raises(InvalidUsageError, match="num_sms=134 exceeds"):
        backend.check_config(Config(134, 8, 256, 6, 128))
    assert backend._rt.asked == [24, 134]
    backend._rt = None
    backend.check_config(Config(134, 8, 256, 6, 128))  # destroyed: nothing to ask


def test_native_handle_num_sms_is_the_handles_lane_layout():
    """Buffer sizes a combine or cached dispatch by NativeBackend.handle_num_sms: within a node, 2 x the channels of
    the handle's lane matrix ([R, L], L = channels x lanes per channel); across nodes, the SM count of the handle's
    plan. A lane count that is no multiple of the lanes per channel is refused."""
    from uccl_moe.backends.native import NativeBackend
    from uccl_moe.backends.reference import ReferenceBackend

    # across nodes it checks each dispatch's staged rows itself, so Buffer holds it to no ring-size hint up front;
    # the default (the reference backend) is DeepEP's hint
    cfg = Config(24, 8, 256, 6, 128)
    assert object.__new__(NativeBackend).required_rdma_bytes(cfg, 7168 * 2, 16, 8) == 0
    want = cfg.get_rdma_buffer_size_hint(7168 * 2, 16, 8)
    assert want > 0 and object.__new__(ReferenceBackend).required_rdma_bytes(cfg, 7168 * 2, 16, 8) == want
    backend = object.__new__(NativeBackend)  # no GPU here: only the handle arithmetic is exercised
    backend._inter = None
    backend.R = 4
    backend.W = _C.intranode_lanes_per_channel(4)
    for sms in (2, 20, 24, 64):
        lanes = torch.zeros((4, sms // 2 * backend.W), dtype=torch.int32)
        assert backend.handle_num_sms((torch.zeros(16, dtype=torch.int32), lanes)) == sms
    with pytest.raises(InvalidUsageError, match="not a multiple of"):
        backend.handle_num_sms((None, torch.zeros((4, backend.W + 1), dtype=torch.int32)))

    class FakeInternode:
        def handle_num_sms(self, handle):
            return 12

    backend._inter = FakeInternode()
    assert backend.handle_num_sms((None, torch.zeros((4, 5), dtype=torch.int32))) == 12
    # the real internode path reads the plan its dispatch tagged onto the handle's rank prefix
    from types import SimpleNamespace

    from uccl_moe.backends.internode import _PLAN_ATTR, InternodePath

    prefix = torch.zeros(16, dtype=torch.int32)
    setattr(prefix, _PLAN_ATTR, SimpleNamespace(num_sms=20))
    assert object.__new__(InternodePath).handle_num_sms((prefix, None)) == 20
    with pytest.raises(InvalidUsageError, match="carries no internode plan"):
        object.__new__(InternodePath).handle_num_sms((torch.zeros(16, dtype=torch.int32), None))


def test_native_combine_buffer_fits_answers_for_the_most_rows():
    """NativeBackend.combine_buffer_fits sizes the view for the most rows any rank received (the count notify tags
    onto the handle's rank prefix, the same on every rank), not this rank's own rows; without the tag (a
    num_worst_tokens handle) for the handle's own rows; False for rows that are not 16-byte multiples; True across
    nodes (no view there). GPU-tested against notify's real count in test_native_combine_from_buffer."""
    from types import SimpleNamespace

    from uccl_moe import Buffer
    from uccl_moe.backends.native import _MOST_ROWS_ATTR, NativeBackend

    class FakeRuntime:
        def aborted(self) -> bool:
            return False

    hidden = 7168
    nvl = Buffer.get_combine_buffer_size_hint(1000, hidden)
    backend = object.__new__(NativeBackend)  # no GPU here: only the size decision is exercised
    backend._rt, backend._inter, backend.ctx = FakeRuntime(), None, SimpleNamespace(num_nvl_bytes=nvl)

    def handle(own_rows: int, most: int | None):
        prefix = torch.zeros((2, 2), dtype=torch.int32)
        if most is not None:
            setattr(prefix, _MOST_ROWS_ATTR, most)
        return (prefix, None, None, torch.zeros(own_rows, dtype=torch.int32))

    assert backend.combine_buffer_fits(handle(10, 1000), hidden, 0)
    assert not backend.combine_buffer_fits(handle(10, 1001), hidden, 0)  # a peer received more: nobody pulls
    assert not backend.combine_buffer_fits(handle(0, 1001), hidden, 0)  # ... not even a rank that received nothing
    assert not backend.combine_buffer_fits(handle(1000, 1000), hidden, 8)  # no room left for the staged weights
    assert backend.combine_buffer_fits(handle(1000, None), hidden, 0)  # num_worst_tokens: its own padded rows
    assert not backend.combine_buffer_fits(handle(1001, None), hidden, 0)
    assert not backend.combine_buffer_fits(handle(1, 1), 12, 0)  # 24-byte rows: the view refuses them
    backend._inter = SimpleNamespace(check=lambda: None)
    assert backend.combine_buffer_fits(handle(10, 10**6), hidden, 0)  # across nodes: a tensor of the caller's


def test_native_combine_buffer_refuses_a_buffer_too_small():
    """NativeBackend.combine_buffer names the rows, the hidden size and the num_nvl_bytes to use when the view does
    not fit (the size the combine-input layout asks for); rows that are not 16-byte multiples are refused first."""
    from types import SimpleNamespace

    from uccl_moe import _C, InvalidUsageError
    from uccl_moe.backends.native import NativeBackend

    if not hasattr(_C, "intranode_combine_input_layout"):
        pytest.skip("this build has no intranode kernels")

    class FakeRuntime:
        def aborted(self) -> bool:
            return False

    hidden, rows = 7168, 1000
    end = int(_C.intranode_combine_input_layout(rows, hidden, 0)[1])
    backend = object.__new__(NativeBackend)  # no GPU here: the refusals happen before any device memory is touched
    backend._rt, backend._inter, backend.ctx = FakeRuntime(), None, SimpleNamespace(num_nvl_bytes=end - 1)
    handle = (None, None, None, torch.zeros(rows, dtype=torch.int32))
    with pytest.raises(InvalidUsageError, match=rf"get_combine_buffer: {rows} rows of hidden {hidden} needs {end} "
                                                rf"bytes .* num_nvl_bytes >= {end}"):
        backend.combine_buffer(handle, hidden, torch.bfloat16)
    with pytest.raises(InvalidUsageError, match="hidden=12: hidden \\* 2 bytes must be a multiple of 16"):
        backend.combine_buffer(handle, 12, torch.bfloat16)


def _split_bounds(num_sms: int, ranks: int) -> tuple[int, int]:
    """(fewest, most) combine sender blocks: one warp per remote (lane, dst) pair, one receiver warp per lane and at
    least one lane per receiver block."""
    warps = _C.intranode_lanes_per_channel(1)
    lanes = num_sms // 2 * _C.intranode_lanes_per_channel(ranks)
    return max(-(-lanes * (ranks - 1) // warps), num_sms - lanes), num_sms - -(-lanes // warps)


@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("num_sms", [2, 20, 24, 132])
def test_combine_split_serves_every_pair_and_lane_once(ranks: int, num_sms: int) -> None:
    """Every split the knob may choose, spelled out by the kernel's own CombineSplit methods: each remote (lane, dst)
    pair has exactly one sender warp, inside its block; each lane has exactly one receiver block, whose lanes are a
    run and whose groups fit its warps. A mapping that dropped or doubled a pair, or
    sent to ourselves, would leave a ring unfed (a hang) or fed twice (corruption)."""
    warps = _C.intranode_lanes_per_channel(1)
    lanes = num_sms // 2 * _C.intranode_lanes_per_channel(ranks)
    lo, hi = _split_bounds(num_sms, ranks)
    for senders in sorted({0, lo, hi, (lo + hi) // 2}):  # 0: the built-in split
        for me in sorted({0, ranks - 1, ranks // 2}):
            (S, R), pairs, recv = _C.intranode_combine_split(num_sms, ranks, senders, me)
            assert S + R == num_sms and S == (senders if senders > 0 else (0 if ranks == 1 else num_sms // 2))
            want = {(lane, d) for lane in range(lanes) for d in range(ranks) if d != me}
            got = [(lane, d) for _, _, lane, d in pairs]
            assert len(got) == len(want) and set(got) == want, (senders, me)
            covered = []
            for b, first, n, group in recv:
                assert n >= 1 and group >= 1 and n * group <= warps, (b, first, n, group)
                covered += range(first, first + n)
            assert covered == list(range(lanes)), senders


@pytest.mark.parametrize("ranks, num_sms, senders", [(2, 24, 5), (2, 24, 19), (4, 24, 8), (8, 2, 2), (1, 24, 24)])
def test_combine_split_refuses_splits_that_leave_work_unserved(ranks: int, num_sms: int, senders: int) -> None:
    lo, hi = _split_bounds(num_sms, ranks)
    assert not lo <= senders <= hi
    with pytest.raises(InvalidUsageError, match=rf"UCCL_MOE_COMBINE_SENDER_SMS={senders}.*needs {lo}\.\.{hi} sender"):
        _C.intranode_combine_split(num_sms, ranks, senders)


def test_combine_split_bounds_at_the_deepseek_setting() -> None:
    """24 SMs: EP2's 144 remote pairs fill 6 sender blocks, so its receivers may get up to 18; EP4's 216 fill 9."""
    assert _split_bounds(24, 2) == (6, 18) and _split_bounds(24, 4) == (9, 21)
    (S, R), _, recv = _C.intranode_combine_split(24, 2, 6)
    assert (S, R) == (6, 18) and {(n, g) for _, _, n, g in recv} == {(8, 3)}
