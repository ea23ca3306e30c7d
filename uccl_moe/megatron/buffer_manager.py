"""The process-wide :class:`uccl_moe.Buffer` of the Megatron adapter: one per (comm group, hidden bytes, backend),
shared by every layer and every step, sized from ``uccl_moe``'s public size hints.

The manager touches only ``uccl_moe``'s public API (``Buffer`` and its static helpers), as Megatron-Core's
``fused_a2a`` touches only DeepEP's.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Optional

import torch
import torch.distributed as dist

from uccl_moe import Buffer, InvalidTypeError
from uccl_moe.utils import page_bytes

from . import knobs as _knobs

log = logging.getLogger("uccl_moe.megatron")

_BUFFERS: list[tuple[Any, int, str, Any]] = []  # (group, hidden_bytes, backend, Buffer)
_BUFFERS_LOCK = threading.Lock()


def hidden_bytes_of(x: torch.Tensor) -> int:
    """Bytes of one row as the size hints count them: ``H * max(element_size, 2)`` (DeepEP's rule)."""
    return int(x.size(-1)) * max(x.element_size(), 2)


def buffer_sizes(
    group_size: int,
    hidden_bytes: int,
    nvl_bytes: Optional[int],
    rdma_bytes: Optional[int],
    ranks_per_node: int = 0,
    max_tokens: int = 0,
    num_topk: int = 0,
) -> tuple[int, int]:
    """(num_nvl_bytes, num_rdma_bytes): the given values, else the largest size hint of the dispatch and combine
    configs for a group of `group_size` ranks in nodes of `ranks_per_node` (0: min(group_size, 8), one node up to
    8 ranks), the layout the Buffer checks its sizes against. Across nodes the RDMA default also holds the staging
    of `max_tokens` tokens per rank with `num_topk` experts each (any routing; Buffer.get_internode_rdma_size_hint)."""
    configs = (Buffer.get_dispatch_config(group_size), Buffer.get_combine_config(group_size))
    if nvl_bytes is None:
        nvl_bytes = max(int(c.get_nvl_buffer_size_hint(hidden_bytes, group_size, ranks_per_node)) for c in configs)
    if rdma_bytes is None:
        rdma_bytes = max(int(c.get_rdma_buffer_size_hint(hidden_bytes, group_size, ranks_per_node)) for c in configs)
        per_node = ranks_per_node or min(group_size, 8)
        if rdma_bytes > 0 and group_size > per_node and max_tokens > 0:
            num_nodes = group_size // per_node
            staged = Buffer.get_internode_rdma_size_hint(max_tokens, hidden_bytes // 2, num_topk, num_nodes)
            rdma_bytes = max(page_bytes(rdma_bytes), staged)
    return nvl_bytes, rdma_bytes


_FALLBACK_LOGGED: set[torch.dtype] = set()


def backend_for(knob: str, dtype: torch.dtype) -> str:
    """The Buffer backend for hidden states of `dtype` under the ``moe_uccl_backend`` knob `knob`.

    ``auto`` keeps the Buffer's own choice (native kernels on GPUs) for BF16 models and takes ``reference`` (the
    torch.distributed all-to-all, exact in any dtype) for others, saying so once; ``native`` refuses other dtypes.
    """
    # What the native kernels combine (BF16 rows, reduced in float32, as DeepEP's): the dtypes they can move both ways.
    if knob == "reference" or dtype in Buffer.get_supported_dtypes("native").combine:
        return knob
    if knob == "native":
        raise InvalidTypeError(
            f"moe_uccl_backend=native moves BF16 hidden states only (combine reduces BF16 rows, like DeepEP's), but "
            f"this model's are {str(dtype).replace('torch.', '')}: train with --bf16, or set --moe-uccl-backend auto "
            f"or reference (all_to_all in the model's dtype)"
        )
    if dtype not in _FALLBACK_LOGGED:
        _FALLBACK_LOGGED.add(dtype)
        log.warning("uccl dispatcher: hidden states are %s and the native kernels move BF16 only; using the "
                    "reference backend (all_to_all) for them. Train with --bf16 for the native kernels.",
                    str(dtype).replace("torch.", ""))
    return "reference"


def get_buffer(group: Any, hidden_bytes: int, knobs: _knobs.UCCLKnobs, max_tokens: int = 0, num_topk: int = 0,
               backend: Optional[str] = None, combine_tokens: int = 0, ce_tokens: int = 0) -> Any:
    """The process-wide :class:`uccl_moe.Buffer` for (`group`, `hidden_bytes`, `backend`), created on first use;
    `max_tokens` (tokens per rank, with headroom) and `num_topk` size the internode staging when the group spans
    nodes; `combine_tokens` (tokens per rank) sizes the NVL buffer to hold every row a rank may receive and `num_topk`
    weights per row, for combine from the buffer, and `ce_tokens` (tokens per rank) so that the copy-engine dispatch
    and combine of that many tokens fit where the group size takes them (EP2 by default:
    ``Buffer.get_copy_engine_buffer_size_hint``; not where `backend` is ``reference``); neither where the nvl_bytes
    knob is set. Both sizes come from the largest count of the group (every rank's NVL buffer must have the same
    size), gathered on every rank of a one-node group. `backend` defaults to the knob (see :func:`backend_for`)."""
    backend = knobs.backend if backend is None else backend
    with _BUFFERS_LOCK:
        for g, hb, b, buf in _BUFFERS:
            if g is group and hb == hidden_bytes and b == backend:
                return buf
        size = dist.get_world_size(group)
        # The node layout the Buffer will detect and check the sizes against (a collective, like the Buffer's own).
        topology = Buffer.get_topology(group)
        nvl, rdma = buffer_sizes(size, hidden_bytes, knobs.nvl_bytes, knobs.rdma_bytes, topology.ranks_per_node,
                                 max_tokens, num_topk)
        if backend == "reference":
            ce_tokens = 0  # (no copy engines there)
        if knobs.nvl_bytes is None and topology.num_nodes == 1:
            # Every rank's NVL buffer must have the same size (ring offsets in a peer's buffer are computed from
            # one's own), so the size comes from the largest token count of the group, not this rank's; every rank
            # takes part in the gather, whatever its own counts (a rank with no tokens too).
            counts: list[Any] = [None] * size
            dist.all_gather_object(counts, (int(combine_tokens), int(ce_tokens)), group=group)
            most_combine, most_ce = (max(c[i] for c in counts) for i in range(2))
            if most_combine > 0:  # (with room for the top-k weights the dispatch's backward combine stages)
                nvl = max(nvl, Buffer.get_combine_buffer_size_hint(size * most_combine, hidden_bytes // 2, num_topk))
            if most_ce > 0:
                nvl = max(nvl, Buffer.get_copy_engine_buffer_size_hint(most_ce, hidden_bytes // 2, size, num_topk))
        log.info(
            "creating uccl Buffer: group size %d (%d per node), hidden_bytes %d, nvl %d B, rdma %d B, backend %s",
            size, topology.ranks_per_node, hidden_bytes, nvl, rdma, backend,
        )
        buf = Buffer(group, nvl, rdma, backend=backend)  # type: ignore[arg-type]  # validated by knobs
        _BUFFERS.append((group, hidden_bytes, backend, buf))
        return buf


def clear_buffers() -> None:
    """Forget the cached Buffers (they are destroyed when garbage collected). For tests and re-initialisation."""
    with _BUFFERS_LOCK:
        for *_, buf in _BUFFERS:
            destroy = getattr(buf, "destroy", None)
            if destroy is not None and getattr(buf, "explicitly_destroy", False):
                destroy()
        _BUFFERS.clear()
