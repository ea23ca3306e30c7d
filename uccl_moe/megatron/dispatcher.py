"""``UCCLTokenDispatcher``: Megatron-Core's MoE token dispatcher over :class:`uccl_moe.Buffer`.

Selected with ``--moe-token-dispatcher-type uccl`` once :func:`uccl_moe.megatron.install` ran.

Notation: T = tokens of this rank (S/TP * B), H = hidden, E = routed experts of the model, L = experts per EP rank,
TP = expert tensor-parallel size, EP = expert-parallel size, R = TP * EP (the comm group), K = TP * top-k,
N = rows this rank receives.

Semantics (the same as Megatron's flex dispatcher with the DeepEP backend):
- The comm group is the expert TP x EP group. Every token goes to *each* TP rank of the EP rank that owns one of its
  experts; in that group, rank ``ep * TP + tp`` owns "comm experts" ``[(ep * TP + tp) * L, ... + L)``, which are copies
  of model experts ``[ep * L, ep * L + L)``. So the top-k of the comm group is ``K = TP * top-k`` over ``R * L``
  experts.
- ``routing_map`` (not ``probs``) decides the selection; a token that capacity dropping removed from an expert has no
  slot there, and rows with fewer than K selections are padded with -1.
- Experts multiply their outputs by the probs (Megatron's contract), so combine is a plain sum over the ranks a token
  went to (under expert TP the TP ranks' partial sums add up to the full result).
- Autograd: dispatch's backward is a combine that also returns the gradient of the top-k weights; combine's backward
  is a cached-layout dispatch.

Streams (GPU): every Buffer call runs on the Buffer's comm stream with ``previous_event`` = the current stream,
``async_finish=True`` and ``allocate_on_comm_stream=True``. The compute stream waits for the dispatch only in
``dispatch_postprocess`` and for the combine only in ``combine_postprocess``, so with ``--moe-shared-expert-overlap``
the shared expert runs on its own stream while tokens are in flight (the hook order of Megatron's flex dispatcher).
On CPU (gloo) the same code runs; events are already complete there.

Megatron's 1F1B EP overlap (``--overlap-moe-expert-parallel-comm``, megatron/core/models/gpt/fine_grained_callables.py
and pipeline_parallel/utils.py ScheduleNode) calls the six methods from separate schedule nodes: dispatch_preprocess in
the attention node and dispatch_postprocess/combine_preprocess in the expert node on its compute stream,
token_dispatch and token_combine/combine_postprocess in the dispatch and combine nodes on its communication stream,
each node on detached inputs, with one micro-batch's forward nodes interleaved with another's backward nodes. What
this needs from us: per-forward state lives on the dispatcher only between the nodes of one micro-batch's forward
(Megatron never interleaves two forwards of a layer) and the backward uses only what autograd saved; every Buffer call
waits for the stream that calls it (previous_event) and the consuming node waits for the call's event, so the nodes'
own events need not cover our comm stream; and no Buffer memory is held between two nodes, since the other
micro-batch's Buffer calls run in between (so combine-from-buffer is off under the overlap). Every rank runs the same
schedule, so the Buffer calls keep the same order on every rank, as the native kernels require.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Optional

import torch
import torch.distributed as dist
from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher

from ..errors import InvalidTypeError, InvalidUsageError
from . import _compat
from . import knobs as _knobs

log = logging.getLogger("uccl_moe.megatron")

DISPATCHER_TYPE = "uccl"


# ----------------------------------------------------------------------------------------------------------------
# One Buffer per (comm group, hidden bytes), shared by every layer and every step.
# ----------------------------------------------------------------------------------------------------------------
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
    of `max_tokens` tokens per rank with `num_topk` experts each (any routing; see backends/internode.py)."""
    from uccl_moe import Buffer

    configs = (Buffer.get_dispatch_config(group_size), Buffer.get_combine_config(group_size))
    if nvl_bytes is None:
        nvl_bytes = max(int(c.get_nvl_buffer_size_hint(hidden_bytes, group_size, ranks_per_node)) for c in configs)
    if rdma_bytes is None:
        rdma_bytes = max(int(c.get_rdma_buffer_size_hint(hidden_bytes, group_size, ranks_per_node)) for c in configs)
        per_node = ranks_per_node or min(group_size, 8)
        if rdma_bytes > 0 and group_size > per_node and max_tokens > 0:
            from uccl_moe.backends.internode import rdma_bytes_for

            staged = rdma_bytes_for(max_tokens, hidden_bytes // 2, num_topk, group_size // per_node)
            rdma_bytes = max(-(-rdma_bytes // 4096) * 4096, staged)
    return nvl_bytes, rdma_bytes


_FALLBACK_LOGGED: set[torch.dtype] = set()


def backend_for(knob: str, dtype: torch.dtype) -> str:
    """The Buffer backend for hidden states of `dtype` under the ``moe_uccl_backend`` knob `knob`.

    ``auto`` keeps the Buffer's own choice (native kernels on GPUs) for BF16 models and takes ``reference`` (the
    torch.distributed all-to-all, exact in any dtype) for others, saying so once; ``native`` refuses other dtypes.
    """
    # What the native kernels combine (BF16 rows, reduced in float32, as DeepEP's): the dtypes they can move both ways.
    from uccl_moe.backends.native import NativeBackend

    if knob == "reference" or dtype in NativeBackend.supported_combine_dtypes:
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
               backend: Optional[str] = None, combine_tokens: int = 0) -> Any:
    """The process-wide :class:`uccl_moe.Buffer` for (`group`, `hidden_bytes`, `backend`), created on first use;
    `max_tokens` (tokens per rank, with headroom) and `num_topk` size the internode staging when the group spans
    nodes; `combine_tokens` (tokens per rank) sizes the NVL buffer to hold every row a rank may receive and `num_topk`
    weights per row, for combine from the buffer (unless the nvl_bytes knob is set). `backend` defaults to the knob
    (see :func:`backend_for`)."""
    from uccl_moe import Buffer

    backend = knobs.backend if backend is None else backend
    with _BUFFERS_LOCK:
        for g, hb, b, buf in _BUFFERS:
            if g is group and hb == hidden_bytes and b == backend:
                return buf
        from uccl_moe.topology import detect

        size = dist.get_world_size(group)
        # The node layout the Buffer will detect and check the sizes against (a collective, like the Buffer's own).
        topology = detect(group, dist.get_rank(group), size)
        nvl, rdma = buffer_sizes(size, hidden_bytes, knobs.nvl_bytes, knobs.rdma_bytes, topology.ranks_per_node,
                                 max_tokens, num_topk)
        if knobs.nvl_bytes is None and combine_tokens > 0 and topology.num_nodes == 1:
            # Every rank's NVL buffer must have the same size (ring offsets in a peer's buffer are computed from
            # one's own), so the size comes from the largest token count of the group, not this rank's.
            counts: list[Any] = [None] * size
            dist.all_gather_object(counts, int(combine_tokens), group=group)
            # (with room for the top-k weights the dispatch's backward combine stages)
            nvl = max(nvl, Buffer.get_combine_buffer_size_hint(size * max(counts), hidden_bytes // 2, num_topk))
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


# ----------------------------------------------------------------------------------------------------------------
# Autograd functions over the Buffer.
# ----------------------------------------------------------------------------------------------------------------
class _DispatchState:
    """What one forward's dispatch leaves for the later steps (not tensors autograd must see)."""

    __slots__ = ("handle", "recv_topk_idx", "tokens_per_expert", "event", "pull_backward", "backward_view")

    def __init__(self, pull_backward: bool = False) -> None:
        self.handle: Any = None
        self.recv_topk_idx: Optional[torch.Tensor] = None
        self.tokens_per_expert: Optional[torch.Tensor] = None
        self.event: Any = None
        # The dispatch's backward combine takes its rows from the Buffer where every rank's fit (knob on, unfused
        # permute); backward_view is the Buffer memory the gather's backward summed the gradient into, if it did.
        self.pull_backward = pull_backward
        self.backward_view: Optional[torch.Tensor] = None


class UCCLDispatch(torch.autograd.Function):
    """x [T, H], topk_weights [T, K] float32 -> recv_x [N, H], recv_topk_weights [N, K] float32.

    ``topk_idx`` [T, K] int64 (-1 = no expert) is a non-differentiable input; the received local expert ids, the
    per-expert counts (CPU int64 [L]), the handle and the completion event go to ``state``.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_idx: torch.Tensor,
        buffer: Any,
        num_experts: int,
        state: _DispatchState,
        async_finish: bool,
        allocate_on_comm_stream: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        previous_event = buffer.capture() if async_finish else None
        num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank, event = (
            buffer.get_dispatch_layout(
                topk_idx,
                num_experts,
                previous_event=previous_event,
                async_finish=async_finish,
                allocate_on_comm_stream=allocate_on_comm_stream and async_finish,
            )
        )
        recv_x, recv_topk_idx, recv_topk_weights, counts, handle, event = buffer.dispatch(
            x,
            topk_idx=topk_idx,
            topk_weights=topk_weights,
            num_tokens_per_rank=num_tokens_per_rank,
            num_tokens_per_rdma_rank=num_tokens_per_rdma_rank,
            is_token_in_rank=is_token_in_rank,
            num_tokens_per_expert=num_tokens_per_expert,
            previous_event=event if async_finish else None,
            async_finish=async_finish,
            allocate_on_comm_stream=allocate_on_comm_stream and async_finish,
        )
        state.handle = handle
        state.recv_topk_idx = recv_topk_idx
        # The counts are a host list (the Buffer waited for them), so this is a CPU tensor: no device sync later.
        state.tokens_per_expert = torch.tensor(counts, dtype=torch.int64, device="cpu")
        state.event = event if async_finish else None
        ctx.buffer = buffer
        ctx.handle = handle
        ctx.state = state
        ctx.async_finish = async_finish
        ctx.allocate_on_comm_stream = allocate_on_comm_stream
        return recv_x, recv_topk_weights

    @staticmethod
    def backward(
        ctx: Any, grad_recv_x: torch.Tensor, grad_recv_topk_weights: Optional[torch.Tensor]
    ) -> tuple[Any, ...]:
        if grad_recv_topk_weights is not None:
            grad_recv_topk_weights = grad_recv_topk_weights.float().contiguous()
        grad_recv_x = grad_recv_x.contiguous()
        state, ctx.state = ctx.state, None
        if state.pull_backward:
            K = int(grad_recv_topk_weights.shape[1]) if grad_recv_topk_weights is not None else 0
            grad_recv_x = _backward_combine_input(ctx.buffer, ctx.handle, grad_recv_x, K, state.backward_view)
        state.backward_view = None
        # captured after every write above (a copy into the Buffer's view included): the comm stream waits for it
        previous_event = ctx.buffer.capture() if ctx.async_finish else None
        grad_x, grad_topk_weights, event = ctx.buffer.combine(
            grad_recv_x,
            ctx.handle,
            topk_weights=grad_recv_topk_weights,
            previous_event=previous_event,
            async_finish=ctx.async_finish,
            allocate_on_comm_stream=ctx.allocate_on_comm_stream and ctx.async_finish,
        )
        if ctx.async_finish:
            event.current_stream_wait()
        ctx.handle = None
        return grad_x, grad_topk_weights, None, None, None, None, None, None


def _combine_view(buffer: Any, handle: Any, hidden: int, dtype: torch.dtype,
                  num_topk: int = 0) -> Optional[torch.Tensor]:
    """Buffer.get_combine_buffer(handle, hidden) when every rank's rows (and `num_topk` weights per row) fit it, else
    None (a tensor of one's own: the ring combine). Buffer.combine_buffer_fits gives the same answer on every rank, as
    the two paths require."""
    if buffer is None or handle is None or not buffer.combine_buffer_fits(handle, hidden, num_topk):
        return None
    view: torch.Tensor = buffer.get_combine_buffer(handle, hidden, dtype=dtype)
    return view


def _backward_combine_input(buffer: Any, handle: Any, grad: torch.Tensor, num_topk: int,
                            view: Optional[torch.Tensor]) -> torch.Tensor:
    """What the dispatch's backward combine takes: the Buffer's memory when every rank's rows fit (the same answer on
    every rank, so all pull or all push), else a tensor of our own. Normally the gather's backward already summed the
    gradient there (`view`); a gradient that reached the dispatch another way (a hook on its output, a second
    consumer) is copied in, so that this rank still pulls with its peers."""
    lies_there = (view is not None and tuple(grad.shape) == tuple(view.shape)
                  and grad.untyped_storage().data_ptr() == view.untyped_storage().data_ptr())
    if not buffer.combine_buffer_fits(handle, int(grad.shape[1]), num_topk):
        return grad.clone() if lies_there else grad
    if lies_there:
        return grad
    out: torch.Tensor = buffer.get_combine_buffer(handle, int(grad.shape[1]), dtype=grad.dtype)
    return out.copy_(grad)


class _GatherGradIntoBuffer(torch.autograd.Function):
    """tokens [N, H] -> tokens[sorted_indices] (the gather of Megatron's unfused permute). Its gradient is summed per
    token as index_select's own backward sums it (zeros, then index_add_), but into the Buffer's memory when every
    rank's rows fit (_combine_view): the dispatch's backward combine, which takes this gradient next, then pulls the
    rows where they lie instead of pushing them through the rings (_backward_combine_input; `state` tells it)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, tokens: torch.Tensor, sorted_indices: torch.Tensor, buffer: Any, state: _DispatchState,
        num_topk: int,
    ) -> torch.Tensor:
        ctx.save_for_backward(sorted_indices)
        ctx.buffer, ctx.handle, ctx.state, ctx.num_topk = buffer, state.handle, state, num_topk
        ctx.shape = tokens.shape
        return tokens.index_select(0, sorted_indices)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        (sorted_indices,) = ctx.saved_tensors
        rows, hidden = ctx.shape
        out = _combine_view(ctx.buffer, ctx.handle, int(hidden), grad.dtype, ctx.num_topk)
        ctx.state.backward_view = out
        ctx.buffer = ctx.handle = ctx.state = None
        if out is None:
            out = grad.new_zeros((rows, hidden))
        else:
            out.zero_()
        out.index_add_(0, sorted_indices, grad)
        return out, None, None, None, None


class UCCLCombine(torch.autograd.Function):
    """x [N, H] (one row per received token, already summed over local experts) -> [T, H]: the sum over ranks."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, buffer: Any, handle: Any, state: _DispatchState, async_finish: bool, allocate: bool
    ) -> torch.Tensor:
        previous_event = buffer.capture() if async_finish else None
        combined, _, event = buffer.combine(
            x,
            handle,
            previous_event=previous_event,
            async_finish=async_finish,
            allocate_on_comm_stream=allocate and async_finish,
        )
        state.event = event if async_finish else None
        ctx.buffer = buffer
        ctx.handle = handle
        ctx.async_finish = async_finish
        ctx.allocate = allocate
        return combined

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        grad = grad.contiguous()  # (a copy, if any, is enqueued before the event the comm stream waits for)
        previous_event = ctx.buffer.capture() if ctx.async_finish else None
        grad_x, _, _, _, _, event = ctx.buffer.dispatch(
            grad,
            handle=ctx.handle,
            previous_event=previous_event,
            async_finish=ctx.async_finish,
            allocate_on_comm_stream=ctx.allocate and ctx.async_finish,
        )
        if ctx.async_finish:
            event.current_stream_wait()
        ctx.handle = None
        return grad_x, None, None, None, None, None


# ----------------------------------------------------------------------------------------------------------------
# The dispatcher.
# ----------------------------------------------------------------------------------------------------------------
def routing_to_topk(
    routing_map: torch.Tensor, probs: torch.Tensor, tp_size: int, ep_size: int, num_local_experts: int, topk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Turn Megatron's dense routing into the comm group's top-k.

    Args:
        routing_map: [T, E] bool, True where the router (after capacity dropping) selected the expert.
        probs: [T, E] router probabilities (zero off the selection), any float dtype; may require grad.
        tp_size, ep_size, num_local_experts: the expert TP and EP sizes and L (E = EP * L).
        topk: the router's top-k.
    Returns:
        topk_idx: [T, TP * topk] int64, comm-group expert ids in ascending order, -1 for empty slots (dropped tokens).
        topk_weights: [T, TP * topk] float32, the probs of those slots (0 where the id is -1); differentiable.
    """
    num_tokens = routing_map.shape[0]
    k = tp_size * topk

    def expand(t: torch.Tensor) -> torch.Tensor:  # [T, E] -> [T, EP * TP * L]: copy each EP rank's block per TP rank
        return (
            t.reshape(num_tokens, ep_size, 1, num_local_experts)
            .expand(-1, -1, tp_size, -1)
            .reshape(num_tokens, ep_size * tp_size * num_local_experts)
        )

    selected = expand(routing_map).to(torch.int8)
    # Stable descending sort puts the selected experts first, in ascending id order; at most k per row.
    flags, order = torch.sort(selected, dim=1, descending=True, stable=True)
    flags, order = flags[:, :k].bool(), order[:, :k]
    topk_idx = torch.where(flags, order, torch.full_like(order, -1))
    weights = torch.gather(expand(probs), 1, order).float()
    topk_weights = torch.where(flags, weights, torch.zeros_like(weights))
    return topk_idx.contiguous(), topk_weights.contiguous()


class UCCLTokenDispatcher(MoETokenDispatcher):
    """Megatron MoE token dispatcher over :class:`uccl_moe.Buffer` (``--moe-token-dispatcher-type uccl``).

    Args:
        num_local_experts: L, experts on this EP rank.
        local_expert_indices: their global ids, ``ep_rank * L + i``.
        config: the layer's TransformerConfig (``moe_uccl_*`` knobs are read from it or from Megatron's args).
        pg_collection: Megatron's process groups (``ep``, ``expt_tp``, ``tp_ep``); the default groups when None.
    """

    def __init__(
        self,
        num_local_experts: int,
        local_expert_indices: list[int],
        config: Any,
        pg_collection: Optional[Any] = None,
    ) -> None:
        if pg_collection is None:
            pg_collection = _compat.default_pg_collection()
        super().__init__(config=config, **_compat.base_dispatcher_kwargs(pg_collection))
        self.num_local_experts = int(num_local_experts)
        self.local_expert_indices = list(local_expert_indices)
        if self.num_local_experts <= 0 or len(self.local_expert_indices) != self.num_local_experts:
            raise InvalidUsageError(
                f"UCCLTokenDispatcher got num_local_experts={num_local_experts} and {len(self.local_expert_indices)} "
                f"local_expert_indices: they must agree and be > 0"
            )
        self.router_topk = int(config.moe_router_topk)
        self.num_moe_experts = int(config.num_moe_experts)
        if self.num_moe_experts != self.ep_size * self.num_local_experts:
            raise InvalidUsageError(
                f"num_moe_experts={self.num_moe_experts} is not expert_model_parallel_size={self.ep_size} x "
                f"num_local_experts={self.num_local_experts}"
            )
        self.comm_group = self.tp_ep_group
        self.comm_size = dist.get_world_size(self.comm_group)
        ep_rank = dist.get_rank(self.ep_group)
        tp_rank = dist.get_rank(self.tp_group) if self.tp_size > 1 else 0
        comm_rank = dist.get_rank(self.comm_group)
        if self.comm_size != self.tp_size * self.ep_size or comm_rank != ep_rank * self.tp_size + tp_rank:
            raise InvalidUsageError(
                f"the expert TPxEP group does not have the layout uccl needs (rank = ep_rank * TP + tp_rank): "
                f"group size {self.comm_size}, rank {comm_rank}, ep_rank {ep_rank}, "
                f"tp_rank {tp_rank}, TP {self.tp_size}, EP {self.ep_size}"
            )
        self.num_comm_experts = self.comm_size * self.num_local_experts
        self.knobs = _knobs.resolve(config)
        if self.knobs.num_sms is not None:
            from uccl_moe import Buffer

            Buffer.set_num_sms(self.knobs.num_sms)
        self.async_finish = True
        self.allocate_on_comm_stream = True
        self._buffer: Any = None
        self._state = _DispatchState()
        self._topk_idx: Optional[torch.Tensor] = None
        self._routing_map: Optional[torch.Tensor] = None
        self._reversed_mapping: Optional[torch.Tensor] = None
        self._buffer_key: Optional[tuple[int, torch.dtype]] = None  # (hidden bytes, dtype) the Buffer was got for
        self._warned_padding = False
        self.cudagraph_attrs = ["_topk_idx"]

    # -- helpers --------------------------------------------------------------------------------------------------
    def _get_buffer(self, x: torch.Tensor) -> Any:
        hb = hidden_bytes_of(x)
        if self._buffer_key != (hb, x.dtype):
            # Twice this batch's tokens: room for longer sequences without recreating the Buffer.
            tokens = x.numel() // max(int(x.size(-1)), 1)
            # the comm group's top-k: TP x the router's (routing_to_topk)
            self._buffer = get_buffer(self.comm_group, hb, self.knobs, 2 * tokens, self.tp_size * self.router_topk,
                                      backend=backend_for(self.knobs.backend, x.dtype),
                                      combine_tokens=tokens if self._combine_from_buffer() else 0)
            self._buffer_key = (hb, x.dtype)
        return self._buffer

    def _wait(self) -> None:
        """Make the current (compute) stream wait for the last Buffer call of this layer."""
        if self._state.event is not None:
            self._state.event.current_stream_wait()
            self._state.event = None

    def _combine_from_buffer(self) -> bool:
        """Whether both combines take their rows from the Buffer's memory (knob on, unfused (un)permute, and no 1F1B
        EP overlap: there the other micro-batch's Buffer calls run between writing the rows and the combine)."""
        return (bool(self.knobs.combine_from_buffer) and not bool(self.config.moe_permute_fusion)
                and not bool(getattr(self.config, "overlap_moe_expert_parallel_comm", False)))

    def _pad_for_quantization(self, routing_map: torch.Tensor,
                              tokens_per_expert: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``--moe-router-padding-for-quantization``: every local expert's row count rounded up to the FP8/FP4 GEMM
        alignment by routing more received rows to it, at prob 0 (their outputs are zero, so combine is unchanged):
        the flex dispatcher's rule (megatron/core/transformer/moe/token_dispatcher.py, _DeepepManager._pad_routing_map,
        with moe_utils.pad_routing_map). Counts are host values: no device sync. Where a rank received fewer rows than
        a rounded count, the map stays as it is and the experts pad their own input (as flex does, with a warning)."""
        from megatron.core.transformer.moe.moe_utils import get_align_size_for_quantization, pad_routing_map

        multiple = int(get_align_size_for_quantization(self.config))
        target = (tokens_per_expert + multiple - 1) // multiple * multiple
        if target.numel() and int(target.max()) > routing_map.shape[0]:
            if not self._warned_padding:
                self._warned_padding = True
                log.warning("uccl dispatcher: %d rows received, fewer than a padded expert count (%s); the experts "
                            "pad their own input for quantization", routing_map.shape[0], target.tolist())
            return routing_map, tokens_per_expert
        return pad_routing_map(routing_map, multiple), target

    def _combine_input(self, hidden: int, dtype: torch.dtype) -> Optional[torch.Tensor]:
        """Where combine_preprocess writes its [N, H] rows: the Buffer's own memory (get_combine_buffer), or None
        for a tensor of Megatron's (the ring combine). The choice must be the same on every rank of the group (they
        all pull or all push): Buffer.combine_buffer_fits answers it from the most rows any rank received, the same
        number on every rank, whatever this rank's own tokens or rows."""
        if not self._combine_from_buffer():
            return None
        return _combine_view(self._buffer, self._state.handle, hidden, dtype)

    def get_expert_zero_copy_buffers(self) -> tuple[None, None]:
        """No zero-copy expert buffers: experts get fresh permuted tensors (Megatron 0.19 asks every forward)."""
        return None, None

    # -- the six-method contract ---------------------------------------------------------------------------------
    def dispatch_preprocess(
        self, hidden_states: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """[*, H] tokens, [T, E] routing_map/probs -> ([T, H] tokens, [T, K] float32 top-k weights). No comm."""
        self.hidden_shape = hidden_states.shape
        hidden_states = hidden_states.view(-1, self.hidden_shape[-1])
        self._topk_idx, topk_weights = routing_to_topk(
            routing_map, probs, self.tp_size, self.ep_size, self.num_local_experts, self.router_topk
        )
        self._probs_dtype = probs.dtype
        return hidden_states, topk_weights

    def token_dispatch(
        self, hidden_states: torch.Tensor, probs: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Send each token to the ranks of its experts. Returns ([N, H] tokens, [N, K] float32 weights), still in
        flight on GPU (the compute stream waits in dispatch_postprocess)."""
        if self._topk_idx is None:
            raise InvalidUsageError("token_dispatch called before dispatch_preprocess on UCCLTokenDispatcher")
        shared = self.shared_experts
        if shared is not None:
            _compat.shared_expert_wait_current_stream(shared)
        buffer = self._get_buffer(hidden_states)
        self._state = _DispatchState(pull_backward=self._combine_from_buffer())
        recv_x, recv_weights = UCCLDispatch.apply(
            hidden_states.contiguous(),
            probs,
            self._topk_idx,
            buffer,
            self.num_comm_experts,
            self._state,
            self.async_finish,
            self.allocate_on_comm_stream,
        )
        self._topk_idx = None
        if shared is not None:
            _compat.shared_expert_pre_forward_comm(shared, hidden_states.view(self.hidden_shape))
            shared.linear_fc1_forward_and_act(recv_x)
        return recv_x, recv_weights

    def dispatch_postprocess(
        self, hidden_states: torch.Tensor, probs: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Group received rows by local expert.

        Returns (tokens [sum(tokens_per_expert), H], tokens_per_expert CPU int64 [L], probs [sum] float32 (float64 if
        moe_router_dtype is fp64)). A token routed to two local experts appears twice.
        """
        self._wait()
        state = self._state
        recv_idx, tokens_per_expert = state.recv_topk_idx, state.tokens_per_expert
        if recv_idx is None or tokens_per_expert is None:
            raise InvalidUsageError("dispatch_postprocess called before token_dispatch on UCCLTokenDispatcher")
        num_recv = hidden_states.shape[0]
        local = self.num_local_experts
        valid = recv_idx >= 0
        # Column `local` is a sink for empty slots (-1); it is dropped after the scatter.
        slot = torch.where(valid, recv_idx, torch.full_like(recv_idx, local))
        self._routing_map = (
            torch.zeros(num_recv, local + 1, dtype=torch.bool, device=hidden_states.device)
            .scatter_(1, slot, valid)[:, :local]
            .contiguous()
        )
        probs_map = torch.zeros(num_recv, local + 1, dtype=probs.dtype, device=probs.device).scatter(
            1, slot, probs
        )[:, :local]
        if getattr(self.config, "moe_router_padding_for_quantization", False):
            self._routing_map, tokens_per_expert = self._pad_for_quantization(self._routing_map, tokens_per_expert)
        self._hidden_shape_before_permute = hidden_states.shape
        if self._combine_from_buffer() and hidden_states.requires_grad:
            # Megatron's unfused permute on zero columns gives its routing (sorted indices, permuted probs); the
            # gather itself is ours, so that its gradient lands in the Buffer for the dispatch's backward combine.
            _, permuted_probs, self._reversed_mapping = _compat.permute(
                hidden_states.detach()[:, :0], self._routing_map, probs_map.contiguous(),
                num_out_tokens=int(tokens_per_expert.sum()), fused=False,
            )
            permuted = _GatherGradIntoBuffer.apply(hidden_states, self._reversed_mapping, self._buffer, state,
                                                   int(probs.shape[-1]))
        else:
            permuted, permuted_probs, self._reversed_mapping = _compat.permute(
                hidden_states,
                self._routing_map,
                probs_map.contiguous(),
                num_out_tokens=int(tokens_per_expert.sum()),
                fused=bool(self.config.moe_permute_fusion),
            )
        if self.config.moe_router_dtype == "fp64":
            permuted_probs = permuted_probs.to(torch.float64)
        return permuted, tokens_per_expert, permuted_probs

    def combine_preprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Expert outputs [sum(tokens_per_expert), H] -> [N, H]: one row per received token, local experts summed."""
        if self._reversed_mapping is None or self._routing_map is None:
            raise InvalidUsageError("combine_preprocess called before dispatch_postprocess on UCCLTokenDispatcher")
        view = self._combine_input(int(hidden_states.shape[-1]), hidden_states.dtype)
        if view is not None:  # combine from the buffer: the rows are summed where combine reads them
            out = _compat.unpermute_into(view, hidden_states, self._reversed_mapping)
        else:
            out = _compat.unpermute(
                hidden_states,
                self._reversed_mapping,
                restore_shape=self._hidden_shape_before_permute,
                routing_map=self._routing_map,
                fused=bool(self.config.moe_permute_fusion),
            )
        self._reversed_mapping = None
        self._routing_map = None
        return out

    def token_combine(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Send each row back to its token's rank and sum there: [N, H] -> [T, H] (in flight on GPU)."""
        shared = self.shared_experts
        if shared is not None:
            _compat.shared_expert_wait_current_stream(shared)
        state = self._state
        out = UCCLCombine.apply(
            hidden_states.contiguous(),
            self._buffer,
            state.handle,
            state,
            self.async_finish,
            self.allocate_on_comm_stream,
        )
        state.handle = None
        state.recv_topk_idx = None
        return out

    def combine_postprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[T, H] -> the original token shape, plus the shared expert's output when it was overlapped."""
        shared = self.shared_experts
        if shared is not None:
            shared.linear_fc2_forward(hidden_states)
            shared.post_forward_comm()
        self._wait()
        out = hidden_states.view(self.hidden_shape)
        if shared is not None:
            out = out + shared.get_output()
        return out
