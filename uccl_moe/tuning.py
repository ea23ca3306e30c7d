"""The tuned :class:`uccl_moe.Config` presets behind ``Buffer.get_dispatch_config``/``get_combine_config``.

One row per EP size inside an NVLink domain (<= 8 ranks), and one for groups that span nodes; ``num_sms`` comes from
``Buffer.num_sms``. Each row names the device, date and command it was measured with; the figures are in
docs/benchmarks.md.

The rows between the ``tune-rows`` markers are written by the bench's sweep: ``python -m uccl_moe.bench.tune --ranks
R --write`` times the headline setting (4096 tokens per rank, hidden 7168, 256 experts, top-8, 24 SMs) through the
public API over a grid of chunk and ring sizes, picks the fastest per op and rewrites row R only (one line per EP
size; the other rows stay as they are). A row's ``dispatch_fp8`` is set where FP8 dispatch measured faster with other
chunks than BF16's: ``Buffer.dispatch(config=None)`` of FP8 rows takes it (its ring is never larger than
``dispatch``'s, so a Buffer sized by ``get_dispatch_config``'s hint holds it); None = ``dispatch`` for every dtype.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Mapping

from . import _C

#: The largest group that fits one NVLink domain; larger groups span nodes and take INTERNODE.
MAX_INTRANODE_RANKS = 8


@dataclasses.dataclass(frozen=True)
class Chunks:
    """The chunk and ring sizes of one op (``Config``'s fields other than ``num_sms``); the RDMA sizes only matter
    across nodes."""

    nvl_send: int
    nvl_recv: int
    rdma_send: int = 6
    rdma_recv: int = 128

    def config(self, num_sms: int) -> _C.Config:
        return _C.Config(
            num_sms=num_sms,
            num_max_nvl_chunked_send_tokens=self.nvl_send,
            num_max_nvl_chunked_recv_tokens=self.nvl_recv,
            num_max_rdma_chunked_send_tokens=self.rdma_send,
            num_max_rdma_chunked_recv_tokens=self.rdma_recv,
        )


@dataclasses.dataclass(frozen=True)
class Preset:
    """The dispatch and combine chunks for one group size, and where they were measured. ``dispatch_fp8``: the
    chunks of an FP8 dispatch where they differ from ``dispatch`` (BF16 and other dtypes), else None."""

    dispatch: Chunks
    combine: Chunks
    measured_on: str
    dispatch_fp8: Chunks | None = None

    def dispatch_chunks(self, fp8: bool) -> Chunks:
        """The dispatch chunks for FP8 rows (`fp8`) or any other dtype."""
        return self.dispatch_fp8 if fp8 and self.dispatch_fp8 is not None else self.dispatch


# One line per EP size; python -m uccl_moe.bench.tune --ranks R --write rewrites line R between these markers.
INTRANODE: dict[int, Preset] = {
    # tune-rows: begin
    1: Preset(dispatch=Chunks(8, 128), combine=Chunks(8, 128), measured_on="NVIDIA H200 x 1, 2026-11-26, python -m uccl_moe.bench.tune --ranks 1"),
    2: Preset(dispatch=Chunks(2, 256), combine=Chunks(1, 256), measured_on="NVIDIA H200 x 2, 2026-11-26, python -m uccl_moe.bench.tune --ranks 2"),
    3: Preset(dispatch=Chunks(4, 512), combine=Chunks(2, 256), measured_on="NVIDIA H200 x 3, 2026-11-26, python -m uccl_moe.bench.tune --ranks 3", dispatch_fp8=Chunks(8, 128)),
    4: Preset(dispatch=Chunks(4, 256), combine=Chunks(1, 256), measured_on="NVIDIA H200 x 4, 2026-11-26, python -m uccl_moe.bench.tune --ranks 4", dispatch_fp8=Chunks(8, 128)),
    5: Preset(dispatch=Chunks(8, 256), combine=Chunks(2, 256), measured_on="not measured (no machine of this size lent): the defaults from before the sweep"),
    6: Preset(dispatch=Chunks(8, 256), combine=Chunks(2, 256), measured_on="not measured (no machine of this size lent): the defaults from before the sweep"),
    7: Preset(dispatch=Chunks(8, 256), combine=Chunks(2, 256), measured_on="not measured (no machine of this size lent): the defaults from before the sweep"),
    8: Preset(dispatch=Chunks(8, 256), combine=Chunks(2, 256), measured_on="not measured (no machine of this size lent): the defaults from before the sweep"),
    # tune-rows: end
}

INTERNODE = Preset(
    dispatch=Chunks(nvl_send=16, nvl_recv=288, rdma_send=16, rdma_recv=128),
    combine=Chunks(nvl_send=8, nvl_recv=288, rdma_send=8, rdma_recv=128),
    measured_on="not tuned by measurement (the first internode defaults)",
)


#: EP sizes whose intranode combine of a caller's tensor is staged by default (``UCCL_MOE_COMBINE_STAGED=auto``): the
#: other ranks' rows are copied into the NVL buffer and pulled, instead of pushed through the rings. Each entry names
#: where the staged combine measured faster than the ring combine in the same runs (``python -m uccl_moe.bench
#: --ranks R --combine-staged --device-time``; the figures are in docs/benchmarks.md). Other sizes keep the rings
#: until measured.
STAGED_COMBINE: dict[int, str] = {
    2: "NVIDIA H200 x 2, 2026-11-26, python -m uccl_moe.bench --ranks 2 --combine-staged --device-time",
}


#: EP sizes whose intranode combine of a caller's tensor goes through the copy engines by default
#: (``UCCL_MOE_COMBINE_CE=auto``; before the staged path), each naming where it measured faster than the staged and
#: the ring combine in the same runs (``python -m uccl_moe.bench --ranks R --combine-staged --device-time``, which
#: times all three; figures in docs/benchmarks.md).
CE_COMBINE: dict[int, str] = {
    2: "NVIDIA H200 x 2, 2026-11-26, python -m uccl_moe.bench --ranks 2 --dtypes bf16 --combine-staged --device-time",
}


#: EP sizes whose intranode cached dispatch goes through the copy engines by default (``UCCL_MOE_DISPATCH_CE=auto``),
#: each naming where it measured faster than the rings in the same runs (``python -m uccl_moe.bench --ranks R
#: --dispatch-ce --device-time``; figures in docs/benchmarks.md), at DeepSeek-V3's routing (top-8 of 256 experts:
#: 99.6% of tokens go to the peer). The engines move every token, so ``auto`` also needs CE_DISPATCH_MIN_SENT.
CE_DISPATCH: dict[int, str] = {
    2: "NVIDIA H100 x 2, 2026-11-26, python -m uccl_moe.bench --ranks 2 --dispatch-ce --device-time",
}

#: ``UCCL_MOE_DISPATCH_CE=auto`` takes the copy engines only where every rank sends at least this share of its tokens
#: to every other rank (from the handle's counts, alike on every rank): the engines move all of x to each peer at
#: about 1.4x the rings' pace of the rows sent (357 against about 250 GB/s at EP2), so below about 0.7 the rings move
#: fewer bytes for less; 0.9 keeps ``auto`` near the routing it was measured at.
CE_DISPATCH_MIN_SENT = 0.9


#: EP sizes whose intranode dispatch takes the ring-free path by default (``UCCL_MOE_DISPATCH_DIRECT=auto``), each
#: naming where it measured faster than the rings (``python -m uccl_moe.bench --ranks R --dispatch-direct
#: --device-time``). None: at EP2 it took about 30 us longer than the rings for FP8 and BF16 alike (2 x H200,
#: session 21; docs/intranode.md).
DIRECT_DISPATCH: dict[int, str] = {}


def combine_staged(num_ranks: int, knob: str) -> bool:
    """Whether an intranode combine of a caller's tensor over `num_ranks` ranks takes the staged path (where its rows
    fit the buffer), given ``UCCL_MOE_COMBINE_STAGED``'s value `knob` (``auto``, ``1`` or ``0``)."""
    return _chosen(knob, num_ranks, STAGED_COMBINE)


def combine_ce(num_ranks: int, knob: str) -> bool:
    """Whether an intranode combine of a caller's tensor over `num_ranks` ranks goes through the copy engines (where
    the handle has host counts and the landing areas fit), given ``UCCL_MOE_COMBINE_CE``'s value `knob`."""
    return _chosen(knob, num_ranks, CE_COMBINE)


def dispatch_ce(num_ranks: int, knob: str, least_sent: float = 1.0) -> bool:
    """Whether an intranode cached dispatch over `num_ranks` ranks goes through the copy engines (where the handle has
    host counts and the landing areas fit), given ``UCCL_MOE_DISPATCH_CE``'s value `knob` and the least share of its
    tokens any rank sends to any other (`least_sent`, ``auto`` only: CE_DISPATCH_MIN_SENT)."""
    return _chosen(knob, num_ranks, CE_DISPATCH) and (knob == "1" or least_sent >= CE_DISPATCH_MIN_SENT)


def least_sent_share(rank_prefix: list[int], tokens: list[int]) -> float:
    """The least share of its tokens any rank with tokens sends to any other rank, from a handle's rank prefix matrix
    (row-major [R, R], inclusive over sources: entry [s][d] counts the rows d receives from sources 0..s) and every
    rank's token count; 1.0 with one rank."""
    R = len(tokens)
    least = 1.0
    for s in range(R):
        if tokens[s] <= 0:
            continue
        for d in range(R):
            if d != s:
                sent = rank_prefix[s * R + d] - (rank_prefix[(s - 1) * R + d] if s > 0 else 0)
                least = min(least, sent / tokens[s])
    return least


def dispatch_direct(num_ranks: int, knob: str) -> bool:
    """Whether an intranode dispatch over `num_ranks` ranks takes the ring-free path (where the rows from other ranks
    fit every landing area), given ``UCCL_MOE_DISPATCH_DIRECT``'s value `knob` (``auto``, ``1`` or ``0``)."""
    return _chosen(knob, num_ranks, DIRECT_DISPATCH)


def queues_variable() -> str:
    """The variable that sets the hardware queues per GPU of this build: ``CUDA_DEVICE_MAX_CONNECTIONS`` (the CUDA
    driver), ``GPU_MAX_HW_QUEUES`` on HIP (the ROCm runtime's own pool of hardware queues per device, clr's
    ``VirtualGPU``)."""
    return "GPU_MAX_HW_QUEUES" if _C.gpu_backend() == "hip" else "CUDA_DEVICE_MAX_CONNECTIONS"


def _one_queue(environ: Mapping[str, str]) -> bool:
    return environ.get(queues_variable(), "").strip() == "1"


@functools.cache
def one_hardware_queue() -> bool:
    """Whether this process's GPU context has one hardware queue (:func:`queues_variable` is ``1``). Read once, at the
    first op that asks: the runtime reads the variable when it makes the context, which precedes any op, and a later
    change does not reach it (``one_hardware_queue.cache_clear()`` for tests)."""
    return _one_queue(os.environ)


def dispatch_ce_poll(knob: str, environ: Mapping[str, str] | None = None) -> bool:
    """Whether a copy-engine cached dispatch polls its landing area, given ``UCCL_MOE_DISPATCH_CE_POLL``'s value `knob`
    (``auto``, ``1`` or ``0``): ``auto`` polls except with one hardware queue (:func:`one_hardware_queue`, or
    :func:`queues_variable` ``=1`` in `environ` where given). With one queue the side stream's memset after each
    polled op runs in the caller's queue, and the chunk flags measured faster there (CUDA, docs/intranode.md, sessions
    49 and 50; HIP follows the same rule, unmeasured); every rank must decide alike (a rank that differs is named in an
    error)."""
    if knob != "auto":
        return knob == "1"
    return not (one_hardware_queue() if environ is None else _one_queue(environ))


def _chosen(knob: str, num_ranks: int, measured: dict[int, str]) -> bool:
    """A path knob's value: ``1`` everywhere, ``auto`` at the EP sizes where the path `measured` faster, else off."""
    return knob == "1" or (knob == "auto" and num_ranks in measured)


def preset_for(num_ranks: int) -> Preset:
    """The row for a group of `num_ranks` >= 1 ranks."""
    return INTRANODE[num_ranks] if num_ranks <= MAX_INTRANODE_RANKS else INTERNODE


def shared_config(chunks: Chunks, num_sms: int) -> _C.Config:
    """``chunks.config(num_sms)`` as one shared object per row and SM count (a Config is read-only): the presets
    that ``config=None`` ops run, which Buffer's per-op checks then recognise by identity. A row replaced in the
    table is a new Chunks value and gets its own Config."""
    if type(num_sms) is not int:  # (anything else: Config's own checks, every time)
        return chunks.config(num_sms)
    return _shared_config(chunks, num_sms)


@functools.lru_cache(maxsize=64)
def _shared_config(chunks: Chunks, num_sms: int) -> _C.Config:
    return chunks.config(num_sms)
