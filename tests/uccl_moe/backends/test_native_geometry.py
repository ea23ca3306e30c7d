"""Host-side checks of the native intranode layer (no GPU needed): lane geometry, size math, validation.

Skipped when the build has no intranode kernels (no nvcc/hipcc at build time)."""

from __future__ import annotations

import pytest

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


@pytest.mark.parametrize("ranks", [2, 3, 4, 8])
@pytest.mark.parametrize("row_bytes", [7168 + 16, 14336, 2056 * 2, 32])
def test_bulk_shape_fits_the_budget(ranks: int, row_bytes: int) -> None:
    """The senders' bulk-copy path: every remote sender warp gets S stages of P bytes; all of them fit the
    shared-memory budget, and a piece never exceeds a row (rounded up to 128 bytes)."""
    movers = (ranks - 1) * _C.intranode_lanes_per_channel(ranks)
    stages, piece, warp_bytes = _C.intranode_bulk_shape(movers, row_bytes, 90, True)
    assert stages in (2, 4) and piece % 128 == 0 and 0 < piece <= -(-row_bytes // 128) * 128
    assert warp_bytes == 128 + stages * piece and movers * warp_bytes <= 192 * 1024


@pytest.mark.parametrize("movers, arch, enabled", [(12, 80, True), (12, 90, False), (0, 90, True)])
def test_bulk_shape_off(movers: int, arch: int, enabled: bool) -> None:
    """No engine before sm_90, UCCL_MOE_BULK_COPY=0, or no remote sender warps (one rank): register copies."""
    assert _C.intranode_bulk_shape(movers, 14336, arch, enabled) == (0, 0, 0)
