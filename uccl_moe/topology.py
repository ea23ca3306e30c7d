"""Where ranks live: how many share a node (NVLink/xGMI domain) and how many nodes there are.

Order of precedence: ``UCCL_MOE_EMULATE_NODES=N`` (split the group into N emulated nodes over the loopback
transport), then ``LOCAL_WORLD_SIZE`` (torchrun / Slurm launchers set it), then hostnames gathered over the
group, then "one node". Ranks are assumed to be node-major (rank = node * ranks_per_node + local_rank), as
torchrun and Slurm lay them out; anything else is rejected with the rule that failed.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from typing import Any

from . import env
from .errors import InvalidUsageError

MAX_RANKS_PER_NODE = 8


@dataclasses.dataclass(frozen=True)
class Topology:
    rank: int
    num_ranks: int
    ranks_per_node: int
    emulated: bool = False

    @property
    def num_nodes(self) -> int:
        return self.num_ranks // self.ranks_per_node

    @property
    def node(self) -> int:
        return self.rank // self.ranks_per_node

    @property
    def local_rank(self) -> int:
        return self.rank % self.ranks_per_node

    def __post_init__(self) -> None:
        if self.ranks_per_node < 1 or self.num_ranks % self.ranks_per_node != 0:
            raise InvalidUsageError(
                f"{self.num_ranks} ranks cannot be split into nodes of {self.ranks_per_node} ranks: every node "
                f"must hold the same number of ranks (check LOCAL_WORLD_SIZE / UCCL_MOE_EMULATE_NODES)"
            )
        if self.ranks_per_node > MAX_RANKS_PER_NODE:
            raise InvalidUsageError(
                f"{self.ranks_per_node} ranks per node is more than the {MAX_RANKS_PER_NODE} one NVLink domain "
                f"supports here; set UCCL_MOE_EMULATE_NODES or LOCAL_WORLD_SIZE to split them"
            )


def detect(group: Any, rank: int, num_ranks: int) -> Topology:
    """Topology of `group` (a torch.distributed ProcessGroup) as seen by `rank`."""
    emulate = int(env.get("EMULATE_NODES"))
    if emulate > 0:
        if num_ranks % emulate != 0:
            raise InvalidUsageError(
                f"UCCL_MOE_EMULATE_NODES={emulate} does not divide the group of {num_ranks} ranks"
            )
        return Topology(rank, num_ranks, num_ranks // emulate, emulated=True)
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    if local:
        try:
            per_node = int(local)
        except ValueError:
            raise InvalidUsageError(f'LOCAL_WORLD_SIZE="{local}" is not an integer') from None
        # A sub-group (e.g. EP inside TPxEP) may be smaller than a node: then it lives in one node.
        return Topology(rank, num_ranks, min(per_node, num_ranks))
    if group is not None and num_ranks > 1:
        import torch.distributed as dist

        hosts: list[Any] = [None] * num_ranks
        dist.all_gather_object(hosts, socket.gethostname(), group=group)
        per_node = hosts.count(hosts[0])
        expected = [hosts[(r // per_node) * per_node] for r in range(num_ranks)]
        if hosts != expected:
            raise InvalidUsageError(
                f"ranks are not laid out node-major (hosts by rank: {hosts}); launch with torchrun/srun so that "
                f"consecutive ranks share a node, or set UCCL_MOE_EMULATE_NODES"
            )
        return Topology(rank, num_ranks, per_node)
    return Topology(rank, num_ranks, num_ranks)
