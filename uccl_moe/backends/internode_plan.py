"""The offset arithmetic of the internode path (:mod:`uccl_moe.backends.internode`): the RDMA buffer size, every row
offset of one dispatch computed from the gathered counts, and the plan a dispatch leaves on its handle for the cached
dispatch and the combine. Notation as in :mod:`uccl_moe.backends.internode`."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..errors import InvalidUsageError
from ..results import handle_field
from ..utils import page_bytes

_PLAN_ATTR = "_uccl_internode"


def _excl_cumsum(t: torch.Tensor, dim: int = 0) -> torch.Tensor:
    return torch.cumsum(t, dim) - t


_NOTIFY_RESERVE = 4 << 20  # native kernels/internode/internode.hpp kNotifyReserveBytes
MIN_RDMA_BYTES = 4 * _NOTIFY_RESERVE  # the smallest num_rdma_bytes the RDMA runtime takes (rdma_runtime.cu)
_AREA_SLACK = 16 * 256     # alignment of the arrays inside an area (6 arrays, 256-byte aligned) and the 16-row floor


def _plan_of(handle: Any) -> _Plan:
    """The internode plan a dispatch tagged onto its handle's rank prefix."""
    plan = getattr(handle_field(handle, "rank_prefix_matrix"), _PLAN_ATTR, None)
    if plan is None:
        raise InvalidUsageError(
            "handle carries no internode plan: it was made by a dispatch inside one node (a Buffer whose group saw "
            "another node layout); pass a handle from a dispatch on a Buffer with the same nodes"
        )
    return plan  # type: ignore[no-any-return]


def rdma_bytes_for(max_tokens: int, hidden: int, num_topk: int, num_nodes: int, num_scales: int = 0) -> int:
    """num_rdma_bytes with room for any routing of up to `max_tokens` tokens per rank (BF16 rows of `hidden`, or
    smaller FP8 rows with `num_scales` scales): every area holds num_nodes x max_tokens rows (a forwarder's x' when
    every rail peer sends it every token). A multiple of 4096, and at least the RDMA runtime's minimum
    (MIN_RDMA_BYTES: four notify regions), which small batches would otherwise fall below."""
    rows = num_nodes * max(max_tokens, 1) + 16
    dispatch_row = 2 * hidden + 4 * num_scales + 12 * num_topk + 8
    combine_row = 2 * hidden + 4 * max(num_topk, 1)
    half = rows * max(dispatch_row, combine_row) + _AREA_SLACK
    total = max(2 * half + _NOTIFY_RESERVE, MIN_RDMA_BYTES)
    return page_bytes(total)


def plan_offsets(matrix: torch.Tensor, ncnt: torch.Tensor, in_node: torch.Tensor, N: int, G: int,
                 me: int) -> dict[str, torch.Tensor]:
    """Every row offset of one dispatch for rank `me`, from the gathered counts (device tensor ops, no sync).

    matrix [R, R] int64 rows rank s sends to rank d; ncnt [R, N] int64 deduplicated rows rank s sends to node n;
    in_node [T, N] bool: our token t goes to node n. Every tensor returned is contiguous (kernels index them).
    """
    dev = matrix.device
    R = N * G
    n0, local = me // G, me % G
    nodes = torch.arange(N, dtype=torch.int64, device=dev)
    ranks = torch.arange(R, dtype=torch.int64, device=dev)
    rail = nodes * G + local
    ncnt_rail = ncnt[rail]                              # [m, n]: rail peer on node m -> node n
    seg_rows = ncnt_rail[:, n0].contiguous()            # x' rows from node m
    seg_row0 = _excl_cumsum(seg_rows)
    peer_row0 = _excl_cumsum(ncnt_rail, 0)[n0].contiguous()  # [n]: our segment's first row in (n, local)'s x'
    send_rows = ncnt[me].clone()
    send_rows[n0] = 0
    send_row0 = _excl_cumsum(send_rows)
    is_mine = nodes == n0
    # Combine receive areas: origin m keeps one segment per other node n, in node order.
    back = ncnt_rail.clone()
    back[nodes, nodes] = 0
    back_off = _excl_cumsum(back, 1)                   # [m, n]
    # Forwarding order at this receiver: blocks (local source j, node m), m fastest; final order: global source
    # rank s = m * G + j.
    col = matrix[:, me].view(N, G).t().reshape(-1)     # [(j, m)]
    fwd_end = torch.cumsum(col, 0)
    out = {
        "seg_rows": seg_rows.to(torch.int32),
        "seg_row0": seg_row0,
        "num_xp": seg_rows.sum().to(torch.int32).reshape(1),
        "peer_row0": peer_row0,
        "send_rows": send_rows.to(torch.int32),
        "send_row0": send_row0,
        "pack_dst_row": torch.where(is_mine, peer_row0, send_row0),
        "back_row0": back_off[:, n0].contiguous(),     # where our partials go at origin m
        "part_row0": torch.where(is_mine, seg_row0[n0].expand(N), back_off[n0]).contiguous(),
        "send_pos": torch.where(in_node, torch.cumsum(in_node.to(torch.int32), 0) - 1,
                                torch.full_like(in_node, -1, dtype=torch.int32)).to(torch.int32),
        "fwd_counts": matrix[rail][:, n0 * G:(n0 + 1) * G].sum(0).to(torch.int32),
        "fwd_end": fwd_end,
        "fwd_start": fwd_end - col,
        "final_start": _excl_cumsum(matrix[:, me]).view(N, G).t().reshape(-1).contiguous(),
        "num_recv": matrix[:, me].sum(),
        # Per-rank needs of the two RDMA areas (every rank checks every rank: all raise together, none hangs).
        "xp_need": ncnt.view(N, G, N).sum(0).t().reshape(-1),
        "send_need": ncnt.sum(1) - ncnt[ranks, ranks // G],
    }
    return out


def row_map_of(o: dict[str, torch.Tensor], rows: int) -> torch.Tensor:
    """[rows] int32: final row of each received row in forwarding order (rows past the received ones: themselves)."""
    r = torch.arange(rows, device=o["fwd_end"].device, dtype=torch.int64)
    blk = torch.searchsorted(o["fwd_end"], r, right=True).clamp_(max=o["fwd_end"].numel() - 1)
    return torch.where(r < o["num_recv"], r - o["fwd_start"][blk] + o["final_start"][blk], r).to(torch.int32)


@dataclasses.dataclass
class _Plan:
    """Everything a cached dispatch and a combine reuse (device tensors unless noted)."""

    send_pos: torch.Tensor      # [T, N] int32 row of token t in node n's segment, -1 if not sent there
    pack_dst_row: torch.Tensor  # [N] int64 first row of our segment (receive area for our node, else send area)
    send_rows: torch.Tensor     # [N] int32 rows we send to node n (0 for ours)
    send_row0: torch.Tensor     # [N] int64 first row in our send area
    peer_row0: torch.Tensor     # [N] int64 first row of our segment in the peer's receive area
    seg_rows: torch.Tensor      # [N] int32 rows of x' from node m (our rail peer there)
    seg_row0: torch.Tensor      # [N] int64 first row of node m's rows in x'
    back_row0: torch.Tensor     # [N] int64 first row of our partials in origin m's combine receive area
    part_row0: torch.Tensor     # [N] int64 first row of node n's partials for us (x' partials for our node)
    num_xp: torch.Tensor        # [1] int32 rows of x'
    xp_rows: int                # host bound of x' rows the forwarding tensors were sized for
    mask: torch.Tensor          # [xp_rows, G] bool: forwarding targets of each x' row
    row_map: torch.Tensor       # [rows] int32 final row of each row in forwarding order
    fwd_counts: torch.Tensor    # [G] int32 rows of x' each local GPU receives
    num_sms: int
    fwd_prefix: torch.Tensor | None = None  # [G, G] forwarding step's rank prefix matrix
    # Host, the same on every rank: the most rows any rank stages per RDMA area (x' or send area; 0 where the
    # dispatch did not learn it: num_worst_tokens, whose staging the device checks) and the most x' rows of any rank
    # (num_worst_tokens: xp_rows, the capacity).
    staged_need: int = 0
    max_xp: int = 0
