"""The named tuples :class:`uccl_moe.Buffer` returns: they unpack and index exactly like DeepEP-V1's tuples.

Notation: T = tokens of this rank, H = hidden, K = top-k, R = ranks of the group, C = channels (``num_sms / 2``),
T_recv = rows this rank receives.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, Optional, Union

import torch

from .utils import EventOverlap

TensorOrFp8 = Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]


class DispatchHandle(NamedTuple):
    """What combine and cached dispatch need; indexes like DeepEP's intranode 6-tuple.

    rank_prefix_matrix: [R, R] int32, inclusive prefix over source ranks: [i][j] = tokens sent to rank j by
        ranks 0..i; rows from source i land at recv_x[[i-1][me] : [i][me]].
    channel_prefix_matrix: [R, C] int32, sender side: inclusive prefix over channels of tokens sent to each rank.
    recv_channel_prefix_matrix: [R, C] int32, receiver side: start of each (source, channel) segment inside the
        source's block.
    recv_src_idx: [T_recv] int32: row of each received token in its sender's x (-1 for num_worst_tokens padding).
    is_token_in_rank: [T, R] bool.
    send_head: [T, R] int32: position of token t among the rows sent to rank r, or -1 if not sent there.
    """

    rank_prefix_matrix: torch.Tensor
    channel_prefix_matrix: torch.Tensor
    recv_channel_prefix_matrix: torch.Tensor
    recv_src_idx: torch.Tensor
    is_token_in_rank: torch.Tensor
    send_head: torch.Tensor


_HANDLE_FIELDS = {name: i for i, name in enumerate(DispatchHandle._fields)}


def handle_field(handle: Sequence[Any], name: str) -> Any:
    """Field `name` of a dispatch handle by name: a :class:`DispatchHandle`, or a plain tuple in DeepEP's order (as
    DeepEP-style code rebuilds handles)."""
    return handle[_HANDLE_FIELDS[name]]


class DispatchResult(NamedTuple):
    """DeepEP's dispatch 6-tuple, with names."""

    recv_x: TensorOrFp8
    recv_topk_idx: Optional[torch.Tensor]
    recv_topk_weights: Optional[torch.Tensor]
    num_recv_tokens_per_expert_list: Optional[list[int]]
    handle: Optional[DispatchHandle]
    event: EventOverlap


class CombineResult(NamedTuple):
    """DeepEP's combine 3-tuple, with names."""

    combined_x: torch.Tensor
    combined_topk_weights: Optional[torch.Tensor]
    event: EventOverlap


class LayoutResult(NamedTuple):
    """DeepEP's get_dispatch_layout 5-tuple, with names."""

    num_tokens_per_rank: torch.Tensor
    num_tokens_per_rdma_rank: Optional[torch.Tensor]
    num_tokens_per_expert: torch.Tensor
    is_token_in_rank: torch.Tensor
    event: EventOverlap


class SupportedDtypes(NamedTuple):
    """The dtypes of x a backend dispatches (FP8 always with its scales) and combines (Buffer.get_supported_dtypes)."""

    dispatch: tuple[torch.dtype, ...]
    combine: tuple[torch.dtype, ...]
