"""``UCCLTokenDispatcher``: Megatron-Core's MoE token dispatcher over :class:`uccl_moe.Buffer`.

Selected with ``--moe-token-dispatcher-type uccl`` once :func:`uccl_moe.megatron.install` ran.

Notation: T = tokens of this rank (S/TP * B), H = hidden, E = routed experts of the model, L = experts per EP rank,
TP = expert tensor-parallel size, EP = expert-parallel size, R = TP * EP (the comm group), K = TP * top-k,
N = rows this rank receives.

Layout (Megatron-Core's split of ``token_dispatcher.py`` from ``fused_a2a.py``): this module is the dispatcher
strategy; the autograd functions live in ``autograd.py`` and the Buffer management in ``buffer_manager.py``, which
use only ``uccl_moe``'s public API.

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
from typing import Any, Optional

import torch
import torch.distributed as dist
from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher

from uccl_moe import Buffer, InvalidUsageError

from . import _compat
from . import knobs as _knobs
from .autograd import UCCLCombine, UCCLDispatch, _combine_view, _DispatchState, _GatherGradIntoBuffer
from .buffer_manager import backend_for, get_buffer, hidden_bytes_of

log = logging.getLogger("uccl_moe.megatron")

DISPATCHER_TYPE = "uccl"


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
                                      combine_tokens=tokens if self._combine_from_buffer() else 0, ce_tokens=tokens)
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
        if getattr(self.config, "overlap_moe_expert_parallel_comm", False):
            # Megatron's 1F1B schedule plan frees the dispatch node's input storage once the dispatch has run
            # (Megatron-LM megatron/core/models/common/utils.py should_free_input, "moe_dispatch"; 0.16:
            # models/gpt/fine_grained_callables.py). A view would free the pre-MLP norm's output, which the router's
            # and the shared expert's backward still read; alltoall's permute hands the node a fresh tensor too.
            hidden_states = hidden_states.clone()
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
