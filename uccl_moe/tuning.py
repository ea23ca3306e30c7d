"""The tuned :class:`uccl_moe.Config` presets behind ``Buffer.get_dispatch_config``/``get_combine_config``.

One row per EP size inside an NVLink domain (<= 8 ranks), and one for groups that span nodes; ``num_sms`` comes from
``Buffer.num_sms``. Each row names the device it was measured on; the figures are in docs/benchmarks.md.
"""

from __future__ import annotations

import dataclasses

from . import _C

#: The largest group that fits one NVLink domain; larger groups span nodes and take INTERNODE.
MAX_INTRANODE_RANKS = 8


@dataclasses.dataclass(frozen=True)
class Chunks:
    """The chunk and ring sizes of one op (``Config``'s fields other than ``num_sms``)."""

    nvl_send: int
    nvl_recv: int
    rdma_send: int
    rdma_recv: int

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
    """The dispatch and combine chunks for one group size, and where they were measured."""

    dispatch: Chunks
    combine: Chunks
    measured_on: str


# Dispatch takes ring 256 and chunk 8 inside a node, chunk 2 at EP2 (its direct warp releases the tails early);
# combine takes chunk 2 everywhere (its receiver waits for every copy of a token, so early tails pay off).
_RING = Chunks(nvl_send=8, nvl_recv=256, rdma_send=6, rdma_recv=128)
_SHORT = Chunks(nvl_send=2, nvl_recv=256, rdma_send=6, rdma_recv=128)
_UNMEASURED = "not measured at this size: takes the EP3-4 row"

INTRANODE: dict[int, Preset] = {
    1: Preset(dispatch=_RING, combine=_SHORT, measured_on=_UNMEASURED),
    2: Preset(dispatch=_SHORT, combine=_SHORT, measured_on="2 x H200"),
    3: Preset(dispatch=_RING, combine=_SHORT, measured_on="4 x H200"),
    4: Preset(dispatch=_RING, combine=_SHORT, measured_on="4 x H200"),
    5: Preset(dispatch=_RING, combine=_SHORT, measured_on=_UNMEASURED),
    6: Preset(dispatch=_RING, combine=_SHORT, measured_on=_UNMEASURED),
    7: Preset(dispatch=_RING, combine=_SHORT, measured_on=_UNMEASURED),
    8: Preset(dispatch=_RING, combine=_SHORT, measured_on=_UNMEASURED),
}

INTERNODE = Preset(
    dispatch=Chunks(nvl_send=16, nvl_recv=288, rdma_send=16, rdma_recv=128),
    combine=Chunks(nvl_send=8, nvl_recv=288, rdma_send=8, rdma_recv=128),
    measured_on="not tuned by measurement (the first internode defaults)",
)


def preset_for(num_ranks: int) -> Preset:
    """The row for a group of `num_ranks` >= 1 ranks."""
    return INTRANODE[num_ranks] if num_ranks <= MAX_INTRANODE_RANKS else INTERNODE
