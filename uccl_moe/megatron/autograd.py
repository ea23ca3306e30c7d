"""The autograd functions of the Megatron adapter over :class:`uccl_moe.Buffer` (Megatron-Core's ``fused_a2a``).

Notation: T = tokens of this rank, H = hidden, K = the comm group's top-k, L = experts per rank, N = rows this rank
receives.

- :class:`UCCLDispatch`: dispatch; its backward is a combine that also returns the gradient of the top-k weights.
- :class:`UCCLCombine`: combine; its backward is a cached-layout dispatch.
- :class:`_GatherGradIntoBuffer`: the gather of Megatron's unfused permute, with its gradient summed into the
  Buffer's memory where the dispatch's backward combine then reads it.

Streams (GPU): with ``async_finish`` every Buffer call waits for the calling stream (``previous_event`` =
``Buffer.capture()``) and returns an event; the dispatcher makes the compute stream wait for it where it consumes
the result (dispatcher.py's module notes).
"""

from __future__ import annotations

from typing import Any, Optional

import torch


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
