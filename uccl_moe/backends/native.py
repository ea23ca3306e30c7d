"""The native backend: our NVLink/xGMI kernels inside a node (``native/src/kernels``, ``native/src/runtime``).

Notation: T = tokens of this rank, H = hidden, K = top-k, E = experts, R = ranks (all in one node here),
E_loc = E / R, T_recv = rows this rank receives, C = channels (``num_sms / 2``), W = lanes per channel
(``_C.intranode_lanes_per_channel(R)``: warps per block / R), L = C * W lanes.

Handle (DeepEP-V1 positions; fields 1 and 2 are per *lane* here, not per channel):
    rank_prefix_matrix [R, R] int32: inclusive prefix over source ranks of the rows each rank receives.
    lane_prefix_matrix [R, L] int32: sender side, inclusive prefix over lanes of the rows sent to each rank.
    recv_lane_start [R, L] int32: receiver side, first row of each (source, lane) inside the source's block.
    recv_src_idx [T_recv] int32: token index at the source (-1 in num_worst_tokens padding rows).
    is_token_in_rank [T, R] bool.
    send_head [T, R] int32: position of token t in its lane's stream to rank r, -1 where not sent.
A cached dispatch or combine reuses the lane geometry recorded in the handle (its channel count is
L / W), whatever ``config.num_sms`` says; the other config fields (chunk sizes) still apply.

Geometry: C, W, L, the ring slots and the ring placement in the NVL buffer are computed once per op by the runtime
(``NvlRuntime.geometry``, C++); this module sizes the lane matrices from it and hands the same object to notify,
dispatch and combine, each of which takes one argument struct built by field name (``_C.DispatchArgs`` ...).

Across nodes (``ctx.topology.num_nodes > 1``), R and the lane matrices above are those of the node's G local
ranks, and dispatch/combine go through :class:`uccl_moe.backends.internode.InternodePath` (CPU proxy + NVLink
forwarding); see that module.

Streams: every method enqueues on the current stream (the one Buffer chose for the op) and allocates there.
Only a non-cached dispatch without ``num_worst_tokens`` waits on the host (for the receive counts).
A wait that expires (``UCCL_MOE_TIMEOUT_S``) aborts the whole launch and raises ``CommTimeoutError`` naming
rank, peer and phase; the Buffer is unusable afterwards (every later call raises the same error).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .. import _C, _checks, env, tuning
from ..errors import CommTimeoutError, InvalidUsageError
from ..results import DispatchHandle, handle_field
from ..utils import RoutingMemo, current_raw_stream
from ._buffer_paths import (
    _MOST_REMOTE_ATTR,
    _MOST_ROWS_ATTR,
    _RANK_PREFIX_HOST_ATTR,
    _RANK_TOKENS_HOST_ATTR,
    BufferPaths,
    _ptr,
)
from ._operands import combine_operands, scale_layout
from .base import Backend, BufferContext, DispatchRequest


class NativeBackend(BufferPaths, Backend):
    name = "native"
    supported_combine_dtypes = (torch.bfloat16,)
    checks_topk_idx_on_device = True
    #: geometry()'s answers by (num_sms, nvl send, nvl recv); made on first use
    _geos: dict[tuple[int, int, int], _C.IntranodeGeometry] | None = None

    def __init__(self, ctx: BufferContext) -> None:
        super().__init__(ctx)
        self._rt: Any = None
        missing = []
        if _C.gpu_backend() == "none":
            missing.append("this build has no GPU support (no nvcc/hipcc was found at install time)")
        elif not _C.has_intranode_kernels():
            missing.append("the native intranode HT kernels are not compiled into this build")
        elif ctx.topology.num_nodes > 1 and not _C.has_internode_kernels():
            missing.append("the internode kernels are not compiled into this build")
        if missing:
            raise NotImplementedError(
                "uccl-moe native backend unavailable: " + "; ".join(missing) + ". Use backend='reference' "
                "(or UCCL_MOE_BACKEND=reference) to run on torch.distributed all-to-all meanwhile"
            )
        if ctx.device.type != "cuda":
            raise InvalidUsageError("the native backend needs CUDA/HIP tensors and a NCCL/RCCL process group")
        if ctx.num_nvl_bytes <= 0:
            raise InvalidUsageError(
                "the native backend needs an NVL buffer: create Buffer(group, num_nvl_bytes=...) with at least "
                "Config.get_nvl_buffer_size_hint(hidden_bytes, num_ranks) bytes"
            )
        topo = ctx.topology
        self.R_all = ctx.num_ranks
        self.R = topo.ranks_per_node if topo.num_nodes > 1 else ctx.num_ranks  # ranks sharing the NVL buffers
        self.me = topo.local_rank if topo.num_nodes > 1 else ctx.rank
        self.W = _C.intranode_lanes_per_channel(self.R)
        self._inter: Any = None
        self._layout_checked = RoutingMemo()  # the topk_idx the last layout kernel range-checked
        self._rt = _C.NvlRuntime(self.me, self.R, ctx.num_nvl_bytes, ctx.device.index)
        self._rt.set_global_rank(ctx.rank)
        handles: list[Any] = [None] * self.R_all
        dist.all_gather_object(handles, (topo.node, self._rt.ipc_handle(), ctx.num_nvl_bytes), group=ctx.group)
        sizes = {r: n for r, (node, _, n) in enumerate(handles) if node == topo.node}
        if len(set(sizes.values())) > 1:  # every rank raises: the lane rings sit at offsets computed from the size
            self._rt.destroy()
            self._rt = None
            raise InvalidUsageError(
                f"num_nvl_bytes differs between the ranks of a node "
                f"({', '.join(f'rank {r}: {n}' for r, n in sizes.items())}); "
                f"every rank must create its Buffer with the same num_nvl_bytes (ring offsets in a peer's buffer are "
                f"computed from one's own size)"
            )
        self._rt.connect([h for node, h, _ in handles if node == topo.node])
        # Every rank has opened every peer before anyone launches a kernel that writes into peers.
        dist.barrier(group=ctx.group)
        if topo.num_nodes > 1:
            from .internode import InternodePath

            self._inter = InternodePath(self, ctx)

    # ---------------------------------------------------------------- helpers
    def _stream(self) -> int:
        return current_raw_stream(self.ctx.device.index)

    def _check_alive(self) -> None:
        if self._rt is None:
            raise InvalidUsageError("this Buffer's native backend was destroyed; create a new Buffer")
        if self._rt.aborted():
            self._raise_timeout()
        if self._inter is not None:
            self._inter.check()

    def _raise_timeout(self) -> None:
        rec = self._rt.diag()
        if rec["error"] == "InvalidUsage":  # the device saw a wrong argument (native diag_error_code), not a timeout
            raise InvalidUsageError(rec["message"] + " (this Buffer is unusable now; create a new one)")
        msg = rec["message"]
        proxy = self._inter.proxy_error() if self._inter is not None else None
        if proxy is not None:
            msg += f"; the CPU proxy failed first: {proxy}"
        raise CommTimeoutError(msg, rec)

    def _topk_fault(self) -> int:
        """Device address the kernels record a bad top-k id at (UCCL_MOE_CHECK_INPUTS), else 0."""
        return int(self._rt.topk_fault_device) if _checks.topk_checks_on() else 0

    def _check_topk_on_device(self, topk_idx: torch.Tensor | None, num_experts: int) -> None:
        """Range-check a dispatch's topk_idx on the GPU (no sync) unless the last layout kernel read this very tensor
        (same version, same expert count): the usual layout-then-dispatch of one routing is checked once."""
        fault = self._topk_fault()
        if not fault or topk_idx is None or topk_idx.numel() == 0:
            return
        if self._layout_checked.holds(topk_idx, num_experts):
            return
        t = topk_idx.contiguous()
        _C.check_topk_idx(topk_idx=_ptr(t), num_tokens=t.shape[0], num_topk=t.shape[1], num_experts=num_experts,
                          topk_fault=fault, stream=self._stream())

    def raise_device_faults(self) -> None:
        """InvalidUsageError for the first top-k id outside [-1, E) a kernel of this rank recorded (cleared, so the
        Buffer stays usable: the kernels skipped the id as if it were -1)."""
        if self._rt is None:
            return
        fault = self._rt.take_topk_fault()
        if fault is None:
            return
        token, k, value, num_experts = fault
        raise InvalidUsageError(
            f"topk_idx holds expert id {value}, outside [-1, {num_experts}) (token {token}, k {k}); -1 marks an "
            f"unused slot and ids must be < num_experts={num_experts}. Recorded on the GPU by a layout or dispatch "
            f"of this rank since its last dispatch/combine returned (with num_worst_tokens or a layout computed "
            f"earlier, possibly one before this call), which treated it as -1: the peers' results are sound, this "
            f"rank's results of that routing are not what it meant; the Buffer stays usable"
        )

    def _sms_of(self, handle: Any) -> int:
        """num_sms the handle's lanes were laid out with (2 * channels)."""
        lanes = int(handle_field(handle, "channel_prefix_matrix").shape[1])
        if lanes % self.W:
            raise InvalidUsageError(
                f"handle has {lanes} lanes, not a multiple of {self.W} lanes per channel for {self.R} ranks; pass a "
                f"handle produced by this Buffer's dispatch"
            )
        return 2 * (lanes // self.W)

    def required_rdma_bytes(self, config: Any, hidden_bytes: int, num_ranks: int, ranks_per_node: int) -> int:
        # InternodePath checks each dispatch's staged rows against num_rdma_bytes, on every rank alike: the ring
        # hint would refuse a Buffer sized for small batches and accept one too small for big ones.
        return 0

    def handle_num_sms(self, handle: Any) -> int:
        if self._inter is not None:
            return int(self._inter.handle_num_sms(handle))
        return self._sms_of(handle)

    def handle_tensors(self, handle: Any) -> list[torch.Tensor]:
        tensors = super().handle_tensors(handle)
        if self._inter is not None:
            tensors += self._inter.handle_tensors(handle)
        return tensors

    def check_config(self, config: Any) -> None:
        # dispatch() runs _check_alive next (a destroyed backend has no runtime and is refused there)
        if self._rt is not None:
            self._rt.check_num_sms(int(config.num_sms))

    # ---------------------------------------------------------------- layout
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int):  # type: ignore[no-untyped-def]
        self._check_alive()
        given = topk_idx
        topk_idx = topk_idx.contiguous()
        T, K = topk_idx.shape
        dev = topk_idx.device
        R, nodes = self.R_all, self.ctx.topology.num_nodes
        per_rank = torch.empty(R, dtype=torch.int32, device=dev)
        per_node = torch.empty(nodes, dtype=torch.int32, device=dev) if nodes > 1 else None
        per_expert = torch.empty(num_experts, dtype=torch.int32, device=dev)
        in_rank = torch.empty((T, R), dtype=torch.bool, device=dev)
        fault = self._topk_fault()
        _C.get_dispatch_layout(topk_idx=_ptr(topk_idx), num_tokens=T, num_topk=K, num_experts=num_experts,
                               num_ranks=R, ranks_per_node=self.ctx.topology.ranks_per_node,
                               num_tokens_per_rank=_ptr(per_rank), num_tokens_per_node=_ptr(per_node),
                               num_tokens_per_expert=_ptr(per_expert), is_token_in_rank=_ptr(in_rank),
                               stream=self._stream(), topk_fault=fault)
        if fault:
            self._layout_checked.remember(given, num_experts)
        return per_rank, per_node, per_expert, in_rank

    def geometry(self, num_sms: int, config: Any) -> _C.IntranodeGeometry:
        """The lane geometry of an op with `num_sms` blocks and `config`'s chunk sizes on this rank's NVL buffer, as
        the runtime computes it (the only place it is computed; invalid settings raise InvalidUsageError naming the
        Config field)."""
        key = (num_sms, config.num_max_nvl_chunked_send_tokens, config.num_max_nvl_chunked_recv_tokens)
        geos = self._geos
        if geos is None:
            geos = self._geos = {}
        geo: _C.IntranodeGeometry | None = geos.get(key)
        if geo is None:  # a function of the key and this runtime's fixed ranks and bytes: computed once per key
            geo = self._rt.geometry(*key)
            if len(geos) >= 32:
                geos.clear()
            geos[key] = geo
        return geo

    # ---------------------------------------------------------------- dispatch
    @staticmethod
    def _dispatch_args(x: torch.Tensor, x_scales: torch.Tensor | None, topk_idx: torch.Tensor | None,
                       topk_weights: torch.Tensor | None, in_rank: torch.Tensor, rank_prefix: torch.Tensor,
                       recv_lane_start: torch.Tensor, num_experts: int,
                       send_head: torch.Tensor | None) -> _C.DispatchArgs:
        """A dispatch's arguments but for what the received rows decide (_launch_dispatch sets those): a fresh
        dispatch builds them while notify runs, since after its count wait the GPU waits for the host's launch."""
        num_scales, s_tok, s_hid = scale_layout(x_scales)
        return _C.DispatchArgs(
            x=_ptr(x), x_scales=_ptr(x_scales), topk_idx=_ptr(topk_idx), topk_weights=_ptr(topk_weights),
            is_token_in_rank=_ptr(in_rank), rank_prefix=_ptr(rank_prefix), recv_lane_start=_ptr(recv_lane_start),
            num_tokens=x.shape[0], row_bytes=x.shape[1] * x.element_size(),
            num_topk=topk_idx.shape[1] if topk_idx is not None else 0, num_scales=num_scales,
            num_experts=num_experts, scale_token_stride=s_tok, scale_hidden_stride=s_hid, send_head=_ptr(send_head))

    def _launch_dispatch(self, geo: _C.IntranodeGeometry, args: _C.DispatchArgs, x: torch.Tensor,
                         x_scales: torch.Tensor | None, handle: DispatchHandle, rows: int,
                         with_meta: bool) -> tuple[Any, ...]:
        """The intranode dispatch along `handle` of `args` (_dispatch_args) into `rows` new rows: (recv_x,
        recv_scales, recv_topk_idx, recv_topk_weights); with metadata (a new handle) it also writes recv_src_idx and
        send_head (cached: reads)."""
        recv_x, recv_scales, recv_idx, recv_w = self._alloc_recv(rows, x, x_scales, int(args.num_topk), with_meta)
        args.num_recv_rows, args.recv_x, args.recv_scales = rows, _ptr(recv_x), _ptr(recv_scales)
        args.recv_topk_idx, args.recv_topk_weights = _ptr(recv_idx), _ptr(recv_w)
        args.recv_src_idx = _ptr(handle.recv_src_idx if with_meta else None)
        landing = self._direct_rows(handle, int(args.row_bytes), int(args.num_topk), int(args.num_scales)) \
            if tuning.dispatch_direct(self.R, env.get("DISPATCH_DIRECT")) else None
        if landing is not None:  # the ring-free path (alike on every rank: the knob, the EP size and the fit)
            args.lane_prefix, args.landing_rows = _ptr(handle.channel_prefix_matrix), landing
            _C.dispatch_direct_intranode(self._rt, geo, args, self._stream())
        else:
            _C.dispatch_intranode(self._rt, geo, args, self._stream())
        return recv_x, recv_scales, recv_idx, recv_w

    @staticmethod
    def _alloc_recv(rows: int, x: torch.Tensor, x_scales: torch.Tensor | None, num_topk: int,
                    with_meta: bool) -> tuple[Any, ...]:
        """Outputs of a dispatch receiving `rows` rows: (recv_x, recv_scales, recv_topk_idx, recv_topk_weights);
        the last two are None without metadata (cached) or without top-k. The handle's recv_src_idx is the
        caller's."""
        dev = x.device
        recv_x = torch.empty((rows, x.shape[1]), dtype=x.dtype, device=dev)
        recv_scales = None
        if x_scales is not None:
            shape = (rows,) if x_scales.dim() == 1 else (rows, x_scales.shape[1])
            recv_scales = torch.empty(shape, dtype=x_scales.dtype, device=dev)
        recv_idx = recv_w = None
        if with_meta and num_topk > 0:
            recv_idx = torch.empty((rows, num_topk), dtype=torch.int64, device=dev)
            recv_w = torch.empty((rows, num_topk), dtype=torch.float32, device=dev)
        return recv_x, recv_scales, recv_idx, recv_w

    def dispatch(self, req: DispatchRequest):  # type: ignore[no-untyped-def]
        self._check_alive()
        self._check_topk_on_device(req.topk_idx, req.num_experts)  # before notify: seen by the count wait below
        if self._inter is not None:
            return self._inter.dispatch(req)
        R = self.R
        x = req.x.contiguous()
        T = x.shape[0]
        dev = x.device
        E = req.num_experts
        geo = self.geometry(int(req.config.num_sms), req.config)
        topk_idx = req.topk_idx.contiguous() if req.topk_idx is not None else None
        topk_weights = req.topk_weights.contiguous() if req.topk_weights is not None else None
        K = topk_idx.shape[1] if topk_idx is not None else 0
        in_rank = req.is_token_in_rank.contiguous()
        lane_prefix = torch.empty((R, geo.num_lanes), dtype=torch.int32, device=dev)
        rank_prefix = torch.empty((R, R), dtype=torch.int32, device=dev)
        recv_lane_start = torch.empty((R, geo.num_lanes), dtype=torch.int32, device=dev)
        worst = req.num_worst_tokens > 0
        if not worst:
            self._rt.reset_recv_counter()
        notify = _C.NotifyArgs(
            is_token_in_rank=_ptr(in_rank), num_tokens_per_rank=_ptr(req.num_tokens_per_rank.contiguous()),
            num_tokens_per_expert=_ptr(req.num_tokens_per_expert.contiguous()), num_tokens=T, num_experts=E,
            expert_alignment=req.expert_alignment, write_host_counters=not worst, lane_prefix=_ptr(lane_prefix),
            rank_prefix=_ptr(rank_prefix), recv_lane_start=_ptr(recv_lane_start),
            rows_code=_C.dispatch_rows_code(x.shape[1] * x.element_size(), K, scale_layout(req.x_scales)[0]))
        _C.notify_dispatch(self._rt, geo, notify, self._stream())
        send_head = torch.empty((T, R), dtype=torch.int32, device=dev)
        args = self._dispatch_args(x, req.x_scales, topk_idx, topk_weights, in_rank, rank_prefix, recv_lane_start, E,
                                   send_head)
        if worst:
            rows, counts = req.num_worst_tokens, []
        else:
            ok, rows, most, most_remote, counts, rank_prefix_host, tokens_host = self._rt.wait_recv_counts(E // R)
            if not ok:
                self._raise_timeout()
            counts = list(counts)
            setattr(rank_prefix, _MOST_ROWS_ATTR, int(most))  # cached dispatches and combines reuse the handle
            setattr(rank_prefix, _MOST_REMOTE_ATTR, int(most_remote))
            setattr(rank_prefix, _RANK_PREFIX_HOST_ATTR, list(rank_prefix_host))
            setattr(rank_prefix, _RANK_TOKENS_HOST_ATTR, list(tokens_host))
        handle = DispatchHandle(rank_prefix_matrix=rank_prefix, channel_prefix_matrix=lane_prefix,
                                recv_channel_prefix_matrix=recv_lane_start,
                                recv_src_idx=torch.empty((rows,), dtype=torch.int32, device=dev),
                                is_token_in_rank=in_rank, send_head=send_head)
        recv_x, recv_scales, recv_idx, recv_w = self._launch_dispatch(geo, args, x, req.x_scales, handle, rows,
                                                                      with_meta=True)
        return recv_x, recv_scales, recv_idx, recv_w, counts, handle

    def cached_dispatch(self, x: torch.Tensor, x_scales: torch.Tensor | None, handle: DispatchHandle, config: Any):  # type: ignore[no-untyped-def]
        self._check_alive()
        if self._inter is not None:
            return self._inter.cached_dispatch(x, x_scales, handle, config)
        x = x.contiguous()
        done = self._dispatch_ce(x, x_scales, handle, self._sms_of(handle))  # the copy engines, else None
        if done is not None:
            return done
        geo = self.geometry(self._sms_of(handle), config)
        rows = int(handle.recv_src_idx.shape[0])
        args = self._dispatch_args(x, x_scales, None, None, handle.is_token_in_rank, handle.rank_prefix_matrix,
                                   handle.recv_channel_prefix_matrix, self.R, None)
        recv_x, recv_scales, _, _ = self._launch_dispatch(geo, args, x, x_scales, handle, rows, with_meta=False)
        return recv_x, recv_scales

    # ---------------------------------------------------------------- combine
    def combine(self, x: torch.Tensor, handle: DispatchHandle, topk_weights: torch.Tensor | None, bias: Any,  # type: ignore[no-untyped-def]
                config: Any):
        self._check_alive()
        if self._inter is not None:
            return self._inter.combine(x, handle, topk_weights, bias, config)
        if self._in_buffer(x):
            return self._combine_from_buffer(x, handle, topk_weights, bias, config)
        x = x.contiguous()
        K = int(topk_weights.shape[1]) if topk_weights is not None else 0
        done = self._combine_tensor(x, handle, topk_weights, bias, config)  # copy engines or staged, else None
        if done is not None:
            return done
        geo = self.geometry(self._sms_of(handle), config)
        T = int(handle.is_token_in_rank.shape[0])
        tw, b0, b1, out, out_w = combine_operands(x, T, topk_weights, bias)
        args = _C.CombineArgs(
            x=_ptr(x), topk_weights=_ptr(tw), bias0=_ptr(b0), bias1=_ptr(b1),
            rank_prefix=_ptr(handle.rank_prefix_matrix), recv_lane_start=_ptr(handle.recv_channel_prefix_matrix),
            send_head=_ptr(handle.send_head), num_tokens=T, hidden=x.shape[1], num_topk=K, out=_ptr(out),
            out_topk_weights=_ptr(out_w))
        _C.combine_intranode(self._rt, geo, args, self._stream())
        return out, out_w

    # ---------------------------------------------------------------- benchmark helpers and lifecycle
    def peer_copy(self, peer: int, num_bytes: int) -> None:
        """Copy-engine copy of `num_bytes` from this rank's NVL buffer into `peer`'s (the bandwidth ceiling)."""
        self._check_alive()
        _C.peer_copy(runtime=self._rt, peer=peer, bytes=num_bytes, stream=self._stream())

    def peer_copies_done(self) -> None:
        """Every rank, after peer_copy's copies (into the peers' buffers, behind their runtimes' backs) completed:
        the next polled copy-engine op sets its whole landing area to the sentinel first (UCCL_MOE_CE_POLL,
        UCCL_MOE_DISPATCH_CE_POLL)."""
        self._check_alive()
        self._rt.forget_sentinel()

    def destroy(self) -> None:
        if self._inter is not None:
            self._inter.destroy()
            self._inter = None
        if self._rt is not None:
            self._rt.destroy()
            self._rt = None

