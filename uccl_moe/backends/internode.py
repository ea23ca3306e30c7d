"""The internode half of the native backend: across nodes through the CPU proxy, then NVLink inside the node.

Notation: N nodes x G GPUs per node, R = N * G ranks, rank = node * G + local; the *rail* of a rank is the set of
ranks with the same local index (one per node). T = tokens of this rank, E = experts, E_loc = E / R.

Dispatch (native/src/kernels/internode/internode.hpp has the kernel side):
  1. notify: an all-gather of every rank's [tokens per rank | tokens per node | tokens per expert] through the
     proxy (kernel-driven, no host sync); every offset below is computed from it with device tensor ops.
  2. pack + post + wait: each token is staged once per destination node; the proxy writes node n's rows into the
     receive area of our rail peer on node n ("x'"): rows from every node of the rail, in node order.
  3. forward: the intranode notify/dispatch kernels treat x' as this GPU's tokens and forward each row over NVLink
     to the local GPUs holding its experts, at its final row (``row_map``: blocks by global source rank, tokens in
     order, exactly like the reference backend) with its origin token index.
Combine reverses it: intranode combine of the expert outputs into x'-ordered partial rows (the reduction inside the
node), rail barrier, post of each node's partial rows back to their origin, wait, and a fixed-order float32
reduction over nodes (plus biases) at the origin. The only host synchronisation is the one a non-cached dispatch
needs for the receive count (none with ``num_worst_tokens``).

Handle: the 6-tuple of the intranode path, where rank_prefix_matrix is global [R, R] and the lane matrices and
send_head belong to the forwarding step ([G, L], [rows of x', G]); the internode plan rides on
``handle.rank_prefix_matrix`` as the attribute ``_uccl_internode``. The offset arithmetic, the RDMA buffer size and
the plan are :mod:`uccl_moe.backends.internode_plan`'s; this module runs the steps.
"""

from __future__ import annotations

import uuid
from typing import Any

import torch
import torch.distributed as dist

from .. import _C
from ..errors import CommTimeoutError, InvalidUsageError
from ..proxy import StoreBootstrap
from ..results import DispatchHandle, handle_field
from ..utils import host_ints, tensor_at
from ._operands import combine_operands, scale_layout
from .base import BufferContext, DispatchRequest

# The sizing names (the `X as X` lines) are re-exported: buffer.py, the docs and the tests import them from here.
from .internode_plan import _NOTIFY_RESERVE as _NOTIFY_RESERVE
from .internode_plan import _PLAN_ATTR, _Plan, _plan_of, plan_offsets, row_map_of
from .internode_plan import MIN_RDMA_BYTES as MIN_RDMA_BYTES
from .internode_plan import rdma_bytes_for as rdma_bytes_for

_SLOT_DISPATCH, _SLOT_COMBINE = 0, 1


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else int(t.data_ptr())


class InternodePath:
    """Runs dispatch/combine for a Buffer whose group spans nodes (NativeBackend delegates here)."""

    def __init__(self, backend: Any, ctx: BufferContext) -> None:
        topo = ctx.topology
        self.backend = backend
        self.ctx = ctx
        self.N, self.G = topo.num_nodes, topo.ranks_per_node
        self.R, self.me = topo.num_ranks, topo.rank
        self.node, self.local = topo.node, topo.local_rank
        if ctx.num_rdma_bytes <= 0 or ctx.num_rdma_bytes % 4096:
            raise InvalidUsageError(
                f"the group spans {self.N} nodes: create Buffer(group, num_nvl_bytes, num_rdma_bytes=...) with "
                f"num_rdma_bytes a positive multiple of 4096 (Config.get_rdma_buffer_size_hint), got "
                f"{ctx.num_rdma_bytes}"
            )
        # One job name for the group (bootstrap keys, shared-memory names): rank 0's random token.
        tokens: list[Any] = [None] * self.R
        dist.all_gather_object(tokens, uuid.uuid4().hex[:12], group=ctx.group)
        job = f"ep{tokens[0]}"
        store = StoreBootstrap(dist.distributed_c10d._get_default_store(), prefix=f"uccl_moe/{job}/")
        self.rt = _C.RdmaRuntime(self.me, self.R, self.G, ctx.num_rdma_bytes, ctx.device.index, job, store.set,
                                 store.get)
        self.rt.start()
        dist.barrier(group=ctx.group)
        dev = ctx.device
        self._shifts = torch.arange(self.G, device=dev, dtype=torch.int32)
        self._node_ids = torch.arange(self.N, dtype=torch.int64, device=dev)
        self._calls = 0  # non-cached dispatches so far (selects the notify region)
        # Benchmarks set this to a list to get (stage, CUDA event) marks on the stream the op runs on.
        self.timeline: list[tuple[str, Any]] | None = None

    def _mark(self, stage: str) -> None:
        if self.timeline is not None:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.timeline.append((stage, ev))

    # ---------------------------------------------------------------- lifecycle and errors
    def proxy_error(self) -> str | None:
        """The proxy's first error (a lost command names itself), or None while it runs fine."""
        if not self.rt.failed():
            return None
        try:
            self.rt.check()
        except Exception as e:  # noqa: BLE001 - the proxy's Timeout/Transport error, as text
            return str(e)
        return None

    def check(self) -> None:
        """Raises the proxy's error as CommTimeoutError (NativeBackend calls this before every operation)."""
        err = self.proxy_error()
        if err is not None:
            rec = {"rank": self.me, "peer": -1, "channel": -1, "phase": "proxy", "message": err}
            raise CommTimeoutError(f"rank {self.me}: the CPU proxy failed: {err}", rec)

    def destroy(self) -> None:
        self.rt.destroy()

    def proxy_counters(self) -> dict[str, int]:
        return dict(self.rt.proxy_counters())

    # ---------------------------------------------------------------- plan
    def _plan(self, req: DispatchRequest, num_sms: int) -> tuple[_Plan, torch.Tensor, list[int], int]:
        """Notify: gathers the counts and derives every offset. Returns (plan, rank_prefix_matrix, per-expert
        counts (host, [] with num_worst_tokens), receive rows)."""
        N, G, R, me = self.N, self.G, self.R, self.me
        E = req.num_experts
        E_loc = E // R
        T = req.x.shape[0]
        dev = req.x.device
        in_node = req.is_token_in_rank.view(T, N, G).any(-1)
        mine = torch.cat([req.num_tokens_per_rank.to(torch.int32), in_node.sum(0, dtype=torch.int32),
                          req.num_tokens_per_expert.to(torch.int32)])
        V = mine.numel()
        if R * V * 4 > (2 << 20):
            raise InvalidUsageError(f"notify rows of {R} ranks x {V} counts exceed the 2 MiB notify region; use fewer "
                                    f"experts ({E}) or ranks")
        # Every rank calls dispatch equally often, so the call parity agrees: alternate between two regions.
        off = _C.internode_notify_offset(self.ctx.num_rdma_bytes, self._calls)
        self._calls += 1
        gathered = tensor_at(self.rt.buffer + off, (R, V), torch.int32, dev)
        gathered[me].copy_(mine)
        _C.rdma_notify(runtime=self.rt, nvl=self.backend._rt, offset=off, row_bytes=V * 4,
                       stream=self.backend._stream())
        matrix = gathered[:, :R].to(torch.int64)            # [src, dst] rows
        ncnt = gathered[:, R:R + N].to(torch.int64)         # [src, node] deduplicated rows
        experts = gathered[:, R + N:]                       # [src, E]
        o = plan_offsets(matrix, ncnt, in_node, N, G, me)
        rank_prefix = torch.cumsum(matrix, 0).to(torch.int32)
        num_recv = o["num_recv"]
        num_xp = o["num_xp"]
        worst = req.num_worst_tokens > 0
        counts: list[int] = []
        if worst:
            rows = req.num_worst_tokens
            cap = self._dispatch_cap(req)
            xp_rows = max_xp = cap
            staged_need = 0  # the device checks the staging
        else:
            ex = experts[:, me * E_loc:(me + 1) * E_loc].sum(0)
            host = host_ints(torch.cat([num_recv.reshape(1), num_xp.to(torch.int64),
                                            o["xp_need"].max().reshape(1), o["send_need"].max().reshape(1),
                                            ex.to(torch.int64)]))
            rows, xp_rows, max_xp, max_send = int(host[0]), int(host[1]), int(host[2]), int(host[3])
            a = max(req.expert_alignment, 1)
            counts = [(int(c) + a - 1) // a * a for c in host[4:]]
            staged_need = max(max_xp, max_send)
            self._check_capacity(req, staged_need)
        plan = _Plan(send_pos=o["send_pos"], pack_dst_row=o["pack_dst_row"], send_rows=o["send_rows"],
                     send_row0=o["send_row0"], peer_row0=o["peer_row0"], seg_rows=o["seg_rows"],
                     seg_row0=o["seg_row0"], back_row0=o["back_row0"], part_row0=o["part_row0"], num_xp=num_xp,
                     xp_rows=xp_rows, mask=torch.empty((0, G), dtype=torch.bool, device=dev),
                     row_map=row_map_of(o, rows), fwd_counts=o["fwd_counts"], num_sms=num_sms,
                     staged_need=staged_need, max_xp=max_xp)
        return plan, rank_prefix, counts, rows

    def _dispatch_layout(self, row_bytes: int, num_scales: int, num_topk: int) -> dict[str, int]:
        return dict(_C.internode_dispatch_layout(self.ctx.num_rdma_bytes, row_bytes, num_scales, num_topk, self.G))

    def _dispatch_cap(self, req: DispatchRequest) -> int:
        x = req.x
        ns = scale_layout(req.x_scales)[0]
        K = req.topk_idx.shape[1] if req.topk_idx is not None else 0
        lay = self._dispatch_layout(x.shape[1] * x.element_size(), ns, K)
        comb = _C.internode_combine_layout(self.ctx.num_rdma_bytes, x.shape[1], max(K, 1))
        return int(min(lay["cap"], comb["cap"]))

    def handle_tensors(self, handle: Any) -> list[torch.Tensor]:
        """The device tensors of `handle`'s plan (the handle's own six are the backend's to list)."""
        plan = getattr(handle_field(handle, "rank_prefix_matrix"), _PLAN_ATTR, None)
        if plan is None:
            return []
        return [v for v in vars(plan).values() if isinstance(v, torch.Tensor)]

    def _check_cached(self, plan: _Plan, x: torch.Tensor, x_scales: torch.Tensor | None) -> None:
        """A cached dispatch stages the rows of the dispatch that made the handle, now of x's width: refused on every
        rank alike (staged_need is the same everywhere) when they no longer fit, e.g. float32 rows after BF16."""
        if plan.staged_need == 0:
            return
        cap = int(self._dispatch_layout(x.shape[1] * x.element_size(), scale_layout(x_scales)[0], 0)["cap"])
        self._refuse_staging("cached dispatch", plan.staged_need, cap, x.shape[1], x.dtype,
                             ", wider than the dispatch that made the handle")

    def _combine_layout(self, plan: _Plan, hidden: int, num_topk: int) -> dict[str, int]:
        """The RDMA layout of a combine of rows of `hidden`; refused on every rank alike (by the largest x' of any
        rank) when its partials do not fit."""
        lay = dict(_C.internode_combine_layout(self.ctx.num_rdma_bytes, hidden, max(num_topk, 1)))
        self._refuse_staging("combine", plan.max_xp, lay["cap"], hidden, torch.bfloat16)
        return lay

    def _check_capacity(self, req: DispatchRequest, need: int) -> None:
        self._refuse_staging("dispatch", need, self._dispatch_cap(req), req.x.shape[1], req.x.dtype)

    def _refuse_staging(self, op: str, need: int, cap: int, hidden: int, dtype: torch.dtype, why: str = "") -> None:
        """InvalidUsageError naming the size to use if `need` rows per RDMA area exceed the `cap` that rows of
        `hidden` x `dtype` fit."""
        if need > cap:
            raise InvalidUsageError(
                f"rank {self.me}: this {op} stages up to {need} rows per RDMA area but num_rdma_bytes="
                f"{self.ctx.num_rdma_bytes} holds {cap} rows of hidden={hidden} ({dtype}){why}; create the "
                f"Buffer with num_rdma_bytes >= {int(self.ctx.num_rdma_bytes * need / max(cap, 1)) + (1 << 20)}"
            )

    # ---------------------------------------------------------------- dispatch
    def _stage(self, plan: _Plan, x: torch.Tensor, x_scales: torch.Tensor | None, topk_idx: torch.Tensor | None,
               topk_weights: torch.Tensor | None, is_token_in_rank: torch.Tensor, num_experts: int,
               barrier: bool) -> dict[str, int]:
        """Pack, post and wait: x' is complete in our receive area afterwards. Returns the layout."""
        stream = self.backend._stream()
        nvl = self.backend._rt
        T = x.shape[0]
        row_bytes = x.shape[1] * x.element_size()
        ns, s_tok, s_hid = scale_layout(x_scales)
        K = topk_idx.shape[1] if topk_idx is not None else 0
        lay = self._dispatch_layout(row_bytes, ns, K)
        self._mark("start")
        if barrier:
            _C.rail_barrier(runtime=self.rt, nvl=nvl, stream=stream)
            self._mark("rail barrier")
        pack = _C.PackArgs(x=_ptr(x), x_scales=_ptr(x_scales), scale_token_stride=s_tok, scale_hidden_stride=s_hid,
                           topk_idx=_ptr(topk_idx), topk_weights=_ptr(topk_weights),
                           is_token_in_rank=_ptr(is_token_in_rank), send_pos=_ptr(plan.send_pos),
                           dst_row=_ptr(plan.pack_dst_row), num_tokens=T, num_experts=num_experts)
        _C.rdma_pack(self.rt, nvl, pack, row_bytes, ns, K, stream)
        half = lay["half_bytes"]
        arrays = [[half + lay["off_x"], lay["off_x"], row_bytes]]
        if ns:
            arrays.append([half + lay["off_scales"], lay["off_scales"], 4 * ns])
        if topk_idx is not None:
            arrays += [[half + lay["off_topk"], lay["off_topk"], 8 * K],
                       [half + lay["off_weights"], lay["off_weights"], 4 * K],
                       [half + lay["off_mask"], lay["off_mask"], 4],
                       [half + lay["off_src"], lay["off_src"], 4]]
        self._post_and_wait(arrays, plan.send_rows, plan.send_row0, plan.peer_row0, _SLOT_DISPATCH, lay["cap"],
                            "pack + post", stream)
        return lay

    def _post_and_wait(self, arrays: list[list[int]], rows: torch.Tensor, src_row: torch.Tensor,
                       dst_row: torch.Tensor, slot: int, peer_cap: int, post_stage: str, stream: int) -> None:
        """Posts the node segments' rows of `arrays` ([dst offset, src offset, bytes per row]) to the rail peers and
        waits for every peer's arrival on `slot`; marks the two stages."""
        nvl = self.backend._rt
        _C.rdma_post(runtime=self.rt, nvl=nvl, rows=_ptr(rows), src_row=_ptr(src_row), dst_row=_ptr(dst_row),
                     arrays=arrays, slot=slot, peer_cap=peer_cap, stream=stream)
        self._mark(post_stage)
        _C.rdma_wait(runtime=self.rt, nvl=nvl, slot=slot, stream=stream)
        self._mark("proxy + copy (wait)")

    def _area_view(self, off: int, rows: int, dtype: torch.dtype, cols: int) -> torch.Tensor:
        """A [rows, cols] tensor over our RDMA buffer (the receive area starts at offset 0)."""
        return tensor_at(self.rt.buffer + off, (rows, cols), dtype, self.ctx.device)

    def dispatch(self, req: DispatchRequest) -> tuple[Any, ...]:
        cfg = req.config
        num_sms = int(cfg.num_sms)
        b = self.backend
        x = req.x.contiguous()
        topk_idx = req.topk_idx.contiguous() if req.topk_idx is not None else None
        topk_weights = req.topk_weights.contiguous() if req.topk_weights is not None else None
        in_rank = req.is_token_in_rank.contiguous()
        plan, rank_prefix, counts, rows = self._plan(req, num_sms)
        # No rank writes into our areas before it received our notify row, i.e. before we reached this call.
        lay = self._stage(plan, x, req.x_scales, topk_idx, topk_weights, in_rank, req.num_experts, barrier=False)
        G = self.G
        bits = self._area_view(lay["off_mask"], plan.xp_rows, torch.int32, 1)
        plan.mask = ((bits >> self._shifts) & 1).bool()
        E_fwd = req.num_experts // self.N
        geo = b.geometry(num_sms, cfg)
        dev = x.device
        lane_prefix = torch.empty((G, geo.num_lanes), dtype=torch.int32, device=dev)
        fwd_prefix = torch.empty((G, G), dtype=torch.int32, device=dev)
        recv_lane_start = torch.empty((G, geo.num_lanes), dtype=torch.int32, device=dev)
        no_experts = torch.zeros(E_fwd, dtype=torch.int32, device=dev)
        # rows_code stays 0 (not compared): nothing waits for these counts, and the rows are the forwarders', not x
        notify = _C.NotifyArgs(
            is_token_in_rank=_ptr(plan.mask), num_tokens_per_rank=_ptr(plan.fwd_counts),
            num_tokens_per_expert=_ptr(no_experts), num_tokens=plan.xp_rows, num_experts=E_fwd, expert_alignment=1,
            write_host_counters=False, lane_prefix=_ptr(lane_prefix), rank_prefix=_ptr(fwd_prefix),
            recv_lane_start=_ptr(recv_lane_start), num_tokens_ptr=_ptr(plan.num_xp))
        _C.notify_dispatch(b._rt, geo, notify, b._stream())
        plan.fwd_prefix = fwd_prefix
        # Global rank prefix, with the forwarding step's lane matrices and send_head ([G, L], [rows of x', G]).
        handle = DispatchHandle(rank_prefix_matrix=rank_prefix, channel_prefix_matrix=lane_prefix,
                                recv_channel_prefix_matrix=recv_lane_start,
                                recv_src_idx=torch.empty((rows,), dtype=torch.int32, device=dev),
                                is_token_in_rank=in_rank,
                                send_head=torch.empty((plan.xp_rows, G), dtype=torch.int32, device=dev))
        K = topk_idx.shape[1] if topk_idx is not None else 0
        recv_x, recv_scales, recv_idx, recv_w = b._alloc_recv(rows, x, req.x_scales, K, True)
        self._forward(plan, geo, lay, x, req.x_scales, K, E_fwd, handle, rows, (recv_x, recv_scales, recv_idx, recv_w),
                      with_meta=True)
        setattr(rank_prefix, _PLAN_ATTR, plan)
        return recv_x, recv_scales, recv_idx, recv_w, counts, handle

    def _forward(self, plan: _Plan, geo: _C.IntranodeGeometry, lay: dict[str, int], x: torch.Tensor,
                 x_scales: torch.Tensor | None, num_topk: int, E_fwd: int, handle: DispatchHandle, rows: int,
                 recv: tuple[Any, ...], with_meta: bool) -> None:
        """NVLink step: the intranode dispatch kernel over x' (our receive area), rows placed by row_map, along the
        forwarding step's lanes of `handle` (whose recv_src_idx and send_head it writes with metadata)."""
        base = self.rt.buffer
        ns = scale_layout(x_scales)[0]
        with_topk = num_topk > 0
        recv_x, recv_scales, recv_idx, recv_w = recv
        assert plan.fwd_prefix is not None
        args = _C.DispatchArgs(
            x=base + lay["off_x"], x_scales=base + lay["off_scales"] if ns else 0,
            topk_idx=base + lay["off_topk"] if with_topk else 0,
            topk_weights=base + lay["off_weights"] if with_topk else 0, is_token_in_rank=_ptr(plan.mask),
            rank_prefix=_ptr(plan.fwd_prefix), recv_lane_start=_ptr(handle.recv_channel_prefix_matrix),
            num_tokens=plan.xp_rows, row_bytes=x.shape[1] * x.element_size(), num_topk=num_topk, num_scales=ns,
            num_experts=E_fwd, scale_token_stride=ns, scale_hidden_stride=1, num_recv_rows=rows,
            recv_x=_ptr(recv_x), recv_scales=_ptr(recv_scales), recv_topk_idx=_ptr(recv_idx),
            recv_topk_weights=_ptr(recv_w), recv_src_idx=_ptr(handle.recv_src_idx if with_meta else None),
            send_head=_ptr(handle.send_head if with_meta else None), num_tokens_ptr=_ptr(plan.num_xp),
            row_map=_ptr(plan.row_map), src_tag=base + lay["off_src"] if with_meta else 0)
        _C.dispatch_intranode(self.backend._rt, geo, args, self.backend._stream())

    def handle_num_sms(self, handle: Any) -> int:
        """The SM count the handle's plan runs its NVLink legs on."""
        return _plan_of(handle).num_sms

    def cached_dispatch(self, x: torch.Tensor, x_scales: torch.Tensor | None, handle: DispatchHandle,
                        config: Any) -> tuple[Any, Any]:
        plan = _plan_of(handle)
        self._check_cached(plan, x, x_scales)
        b = self.backend
        x = x.contiguous()
        lay = self._stage(plan, x, x_scales, None, None, handle.is_token_in_rank, self.R, barrier=True)
        rows = int(handle.recv_src_idx.shape[0])
        recv = b._alloc_recv(rows, x, x_scales, 0, False)
        self._forward(plan, b.geometry(plan.num_sms, config), lay, x, x_scales, 0, self.G, handle, rows, recv,
                      with_meta=False)
        self._mark("nvlink forward")
        return recv[0], recv[1]

    # ---------------------------------------------------------------- combine
    def combine(self, x: torch.Tensor, handle: DispatchHandle, topk_weights: torch.Tensor | None, bias: Any,
                config: Any) -> tuple[Any, Any]:
        plan = _plan_of(handle)
        b = self.backend
        stream = b._stream()
        nvl = b._rt
        x = x.contiguous()
        H = x.shape[1]
        K = topk_weights.shape[1] if topk_weights is not None else 0
        T = int(handle.is_token_in_rank.shape[0])
        lay = self._combine_layout(plan, H, K)
        base = self.rt.buffer
        half = lay["half_bytes"]
        tw, b0, b1, out, out_w = combine_operands(x, T, topk_weights, bias)
        # No origin still reads its combine receive area, no forwarder its partials, once the rail met here.
        self._mark("start")
        _C.rail_barrier(runtime=self.rt, nvl=nvl, stream=stream)
        self._mark("rail barrier")
        geo = b.geometry(plan.num_sms, config)
        args = _C.CombineArgs(
            x=_ptr(x), topk_weights=_ptr(tw), rank_prefix=_ptr(plan.fwd_prefix),
            recv_lane_start=_ptr(handle.recv_channel_prefix_matrix), send_head=_ptr(handle.send_head),
            num_tokens=plan.xp_rows, hidden=H, num_topk=K, out=base + lay["off_x"],
            out_topk_weights=base + lay["off_weights"] if K else 0, num_tokens_ptr=_ptr(plan.num_xp),
            row_map=_ptr(plan.row_map))
        _C.combine_intranode(nvl, geo, args, stream)
        self._mark("nvlink reduce")
        arrays = [[lay["off_x"], half + lay["off_x"], 2 * H]]
        if K:
            arrays.append([lay["off_weights"], half + lay["off_weights"], 4 * K])
        self._post_and_wait(arrays, plan.seg_rows, plan.seg_row0, plan.back_row0, _SLOT_COMBINE, lay["cap"], "post",
                            stream)
        own = self._node_ids == self.node
        area0 = torch.where(own, 0, half)
        part_x = (base + area0 + lay["off_x"] + plan.part_row0 * (2 * H)).to(torch.int64)
        part_w = (base + area0 + lay["off_weights"] + plan.part_row0 * (4 * K)).to(torch.int64)
        _C.combine_reduce(send_pos=_ptr(plan.send_pos), part_x=_ptr(part_x), part_w=_ptr(part_w) if K else 0,
                          bias0=_ptr(b0), bias1=_ptr(b1), num_tokens=T, hidden=H, num_topk=K, num_nodes=self.N,
                          out=_ptr(out), out_topk_weights=_ptr(out_w), stream=stream)
        self._mark("final reduce")
        return out, out_w
