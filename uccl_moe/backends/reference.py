"""The reference backend: DeepEP-V1 HT semantics on ``torch.distributed`` (gloo on CPU, NCCL on GPUs).

It is the correctness oracle for the native kernels and the CPU fallback; it is never the fast path on GPUs.
One collective moves each payload: every (token, destination rank) row is packed into a byte matrix
``[rows, row_bytes]`` (x row, scales, top-k ids, top-k weights, source index) and exchanged with a single
``all_to_all_single``, so any dtype travels on any process-group backend.

Row order (identical to the native kernels): rows from source rank i form block i of ``recv_x`` (blocks in rank
order); inside a block, tokens are in ascending source-token order (= channel order, channels being contiguous
token ranges).
"""

from __future__ import annotations

import datetime
import math
import os
import socket
import time
import zlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .. import _checks, env
from ..errors import CommTimeoutError, InvalidUsageError, TransportError
from ..results import DispatchHandle
from ..utils import RoutingMemo
from .base import Backend, BufferContext, DispatchRequest

# The agreement step: before an op moves data, every rank publishes a fixed-size int64 vector of what it is about to
# do, and every rank checks the whole table. Ranks that disagree would otherwise post collectives of different sizes,
# which gloo answers with an abort (an enforce in its transport thread) or NCCL with a hang.
_OPS = {1: "dispatch", 2: "cached dispatch", 3: "combine"}
_DTYPES: dict[torch.dtype, int] = {
    d: i + 1
    for i, d in enumerate(
        (torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int32, torch.int64, torch.uint8,
         *(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)))
    )
}
_DTYPE_NAMES = {v: str(k).replace("torch.", "") for k, v in _DTYPES.items()}
#: (field, what the fix is about); the vector holds these, then whether this rank's layout tensors are consistent
#: (each rank checks its own; any rank's failure is every rank's error), then its pid and host hash (not compared),
#: then the first top-k id outside [-1, num_experts) this rank found since its last agreement (_TopkFault; zeros:
#: none; any rank's is every rank's error).
_AGREE_FIELDS = (
    ("operation", "call the same Buffer operation on every rank, in the same order"),
    ("num_experts", "pass the same num_experts (num_tokens_per_expert length) on every rank"),
    ("hidden", "send rows of the same hidden size from every rank"),
    ("x dtype", "send x in the same dtype from every rank"),
    ("x_scales dtype", "pass FP8 scales on every rank or on none, in the same dtype"),
    ("x_scales columns", "pass FP8 scales of the same layout on every rank"),
    ("topk columns", "pass topk_idx/topk_weights on every rank or on none, with the same top-k"),
)
_PEER_LOST = ("closed by peer", "connection reset", "broken pipe", "socket closed", "connection refused",
              "read error", "write error", "no route to host")


def _dtype_code(t: torch.Tensor | None) -> int:
    return 0 if t is None else _DTYPES.get(t.dtype, 99)


def _cols(t: torch.Tensor | None) -> int:
    if t is None:
        return 0
    return int(t.shape[1]) if t.dim() == 2 else 1


def _show(field: str, v: int) -> str:
    if field == "operation":
        return _OPS.get(v, str(v))
    if field.endswith("dtype"):
        return "none" if v == 0 else _DTYPE_NAMES.get(v, "other")
    return str(v)


def _host_hash() -> int:
    return zlib.crc32(socket.gethostname().encode())


def _has_exited(pid: int) -> bool:
    """True if process `pid` of this host is gone or a zombie (Linux /proc; else a signal-0 probe)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state in ("Z", "X")
    except FileNotFoundError:
        return True
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except OSError:
            return False
        return False


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """[N, ...] tensor -> [N, row_bytes] uint8 view (copying only if not contiguous)."""
    t = t.contiguous()
    row_bytes = t.element_size() * math.prod(t.shape[1:])
    return t.view(torch.uint8).reshape(t.shape[0], row_bytes)


def _from_bytes(b: torch.Tensor, dtype: torch.dtype, cols: int | None) -> torch.Tensor:
    """Inverse of _bytes: [N, cols * size] uint8 -> [N, cols] dtype (or [N] when cols is None)."""
    # A fresh copy: column slices (and single rows, which count as contiguous) may be misaligned for `dtype`.
    b = torch.empty(b.shape, dtype=torch.uint8, device=b.device).copy_(b)
    out = b.view(dtype)
    return out.reshape(b.shape[0]) if cols is None else out.reshape(b.shape[0], cols)


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


#: A top-k id outside [-1, num_experts) the reference backend found: (found, token, k, value, num_experts, where),
#: `where` an index into _FOUND_BY; the agreement step publishes it.
_TopkFault = tuple[int, int, int, int, int, int]
_NO_FAULT: _TopkFault = (0, 0, 0, 0, 0, 0)
_FOUND_BY = ("", "get_dispatch_layout", "dispatch")


class ReferenceBackend(Backend):
    name = "reference"

    def __init__(self, ctx: BufferContext) -> None:
        super().__init__(ctx)
        self.group = ctx.group
        self.R = ctx.num_ranks
        self.me = ctx.rank
        # UCCL_MOE_TIMEOUT_S, resolved once for this backend (like the native runtimes): every bounded wait uses it.
        self._timeout_s = float(env.get("TIMEOUT_S"))
        # (pid, host hash) of every rank, from the last agreement step: names a peer that exits.
        self._peers: list[tuple[int, int]] | None = None
        # In a group this backend range-checks topk_idx itself: a rank that raised on its own ids in
        # get_dispatch_layout (which moves nothing) would leave its peers waiting in their dispatch until the
        # timeout. It takes a bad id as -1, as the native kernels do, and the next agreement step raises it on every
        # rank. One rank alone: Buffer raises at once.
        self.checks_topk_idx_on_device = self.R > 1
        self._topk_fault: _TopkFault = _NO_FAULT
        self._topk_clean = RoutingMemo()  # the last topk_idx found clean: layout then dispatch read it once

    # ---------------------------------------------------------------- collectives
    def _collective(self, start: Callable[[], Any], phase: str, device: torch.device) -> None:
        """Start a collective (`start` returns its work) and wait for it, bounded on CPU (gloo); on CUDA the wait only
        orders streams.

        A peer that skipped the call would otherwise block for the process group's own timeout (30 min on gloo):
        here the caller gets CommTimeoutError after UCCL_MOE_TIMEOUT_S naming the rank and phase. A peer that exited
        (gloo: "Connection closed by peer") gives TransportError naming it where it can be told.
        """
        try:
            work = start()
            if device.type == "cuda":
                work.wait()
                return
            work.wait(timeout=datetime.timedelta(seconds=self._timeout_s))
        except RuntimeError as e:
            text = str(e).lower()
            if any(m in text for m in _PEER_LOST):
                raise TransportError(
                    f"rank {self.me}: {self._who_left()} during reference/{phase} (the connection to it closed): it "
                    f"exited or crashed; its own log has the cause. ({str(e).splitlines()[0][:300]})"
                ) from None
            if "timed out" not in text and "timeout" not in text:
                raise
            timeout_s = self._timeout_s
            record = {"rank": self.me, "peer": -1, "channel": -1, "phase": f"reference/{phase}", "waited_s": timeout_s}
            dead = self._exited_peers(wait_s=0.0)
            why = (f"{self._ranks(dead)} exited" if dead else "a peer is stuck, dead or skipped this call (an "
                   "exception it raised, e.g. on its own arguments, skips it: its log says)")
            raise CommTimeoutError(
                f"rank {self.me} timed out after {timeout_s:.1f} s in reference/{phase} waiting for all peers of the "
                f"{self.R}-rank group: {why}. Raise UCCL_MOE_TIMEOUT_S only if the job is merely slow. ({e})",
                record,
            ) from None

    @staticmethod
    def _ranks(ranks: list[int]) -> str:
        return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"

    def _exited_peers(self, wait_s: float) -> list[int]:
        """Peers on this host whose process is gone (pids from the last agreement step), polling up to `wait_s`
        for a process that is still tearing down."""
        if self._peers is None:
            return []
        host = _host_hash()
        local = [(r, pid) for r, (pid, h) in enumerate(self._peers) if r != self.me and h == host]
        deadline = time.monotonic() + wait_s
        while True:
            dead = [r for r, pid in local if _has_exited(pid)]
            if dead or time.monotonic() >= deadline:
                return dead
            time.sleep(0.05)

    def _who_left(self) -> str:
        others = [r for r in range(self.R) if r != self.me]
        if len(others) == 1:
            return f"peer rank {others[0]} left"
        dead = self._exited_peers(wait_s=2.0)
        if dead:
            return f"peer {self._ranks(dead)} left"
        if self._peers is not None:
            remote = [r for r, (_, h) in enumerate(self._peers) if r != self.me and h != _host_hash()]
            if remote:
                return f"a peer left (on another host: one of {self._ranks(remote)})"
        return f"a peer left (one of {self._ranks(others)})"

    def _all_gather_vec(self, v: torch.Tensor, phase: str) -> torch.Tensor:
        """[n] -> [R, n], row i = rank i's v."""
        parts = [torch.empty_like(v) for _ in range(self.R)]
        if self.R == 1:
            parts[0].copy_(v)
        else:
            v = v.contiguous()
            self._collective(lambda: dist.all_gather(parts, v, group=self.group, async_op=True), phase, v.device)
        return torch.stack(parts)

    def _scan_topk(self, topk_idx: torch.Tensor | None, num_experts: int, where: int) -> torch.Tensor | None:
        """In a group (checks_topk_idx_on_device): records the first id of `topk_idx` outside [-1, num_experts)
        unless a fault is pending, and returns the ids with every such id as -1 (the tensor itself where all are in
        range). Off where Buffer's host checks are off (UCCL_MOE_CHECK_INPUTS=0, a CUDA graph capture)."""
        if (topk_idx is None or topk_idx.numel() == 0 or not self.checks_topk_idx_on_device
                or not _checks.value_checks_on(topk_idx.device)):
            return topk_idx
        if self._topk_clean.holds(topk_idx, num_experts):
            return topk_idx
        bad = (topk_idx < -1) | (topk_idx >= num_experts)
        at = torch.nonzero(bad.view(-1))[:1].tolist()
        if not at:
            self._topk_clean.remember(topk_idx, num_experts)
            return topk_idx
        token, k = divmod(int(at[0][0]), int(topk_idx.shape[1]))
        if self._topk_fault[0] == 0:
            self._topk_fault = (1, token, k, int(topk_idx[token, k]), num_experts, where)
        return torch.where(bad, torch.full_like(topk_idx, -1), topk_idx)

    def _raise_topk_faults(self, rows: list[list[int]], at: int) -> None:
        """The agreement step's InvalidUsageError for the top-k faults in `rows` (from column `at`), the same on
        every rank; this rank's fault is cleared first (the Buffer stays usable)."""
        faulted = [(r, row[at:at + len(_NO_FAULT)]) for r, row in enumerate(rows) if row[at] != 0]
        self._topk_fault = _NO_FAULT
        if not faulted:
            return
        parts = [f"rank {r}'s topk_idx holds expert id {value}, outside [-1, {experts}) (token {token}, k {k}; "
                 f"found by its {_FOUND_BY[where]})" for r, (_, token, k, value, experts, where) in faulted]
        raise InvalidUsageError(
            "; ".join(parts) + ". -1 marks an unused slot and ids must be < num_experts; every rank raises this "
            "before any row moves, and the Buffer stays usable (fix the routing that produced these ids)"
        )

    def _agree(self, op: int, num_experts: int, x: torch.Tensor, scales: torch.Tensor | None,
               topk: torch.Tensor | None, layout_ok: bool = True) -> None:
        """The agreement step (see _AGREE_FIELDS): every rank raises the same InvalidUsageError, naming the top-k
        ids outside their range that any rank found (_scan_topk), else each field the ranks disagree on and which
        rank holds which value, or the ranks whose layout tensors are inconsistent, before any data moves."""
        mine = [op, num_experts, int(x.shape[1]), _dtype_code(x), _dtype_code(scales), _cols(scales), _cols(topk),
                int(layout_ok), os.getpid(), _host_hash(), *self._topk_fault]
        table = self._all_gather_vec(torch.tensor(mine, dtype=torch.int64, device=x.device), f"{_OPS[op]}/agree")
        rows = [[int(v) for v in row] for row in table.tolist()]
        n = len(_AGREE_FIELDS)
        self._peers = [(row[n + 1], row[n + 2]) for row in rows]
        self._raise_topk_faults(rows, n + 3)
        problems, fixes = [], []
        bad_layout = [r for r, row in enumerate(rows) if row[n] == 0]
        if bad_layout:
            problems.append(f"num_tokens_per_rank does not match is_token_in_rank (column sums) on "
                            f"{self._ranks(bad_layout)}")
            fixes.append("pass the tensors get_dispatch_layout returned for these tokens")
        for i, (field, fix) in enumerate(_AGREE_FIELDS):
            values: dict[int, list[int]] = {}
            for r, row in enumerate(rows):
                values.setdefault(row[i], []).append(r)
            if len(values) > 1:
                problems.append(f"{field}: " + ", ".join(f"{_show(field, v)} on {self._ranks(rs)}"
                                                         for v, rs in values.items()))
                fixes.append(fix)
            if field == "operation" and len(values) > 1:
                break  # the other fields compare different things
        if problems:
            raise InvalidUsageError(
                f"the {self.R} ranks of the group disagree on the arguments of this call (rank {self.me} called "
                f"{_OPS[op]}): " + "; ".join(problems) + ". To fix: " + "; ".join(fixes) + "."
            )

    def _all_to_all_rows(self, send: torch.Tensor, send_counts: list[int], recv_counts: list[int],
                         phase: str) -> torch.Tensor:
        """Rows [sum(send_counts), W] -> rows [sum(recv_counts), W]; block j of send goes to rank j."""
        recv = torch.empty((sum(recv_counts), send.shape[1]), dtype=send.dtype, device=send.device)
        if self.R == 1:
            recv.copy_(send)
            return recv
        send = send.contiguous()
        self._collective(lambda: dist.all_to_all_single(recv, send, recv_counts, send_counts, group=self.group,
                                                        async_op=True), phase, send.device)
        return recv

    # ---------------------------------------------------------------- layout
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int):  # type: ignore[no-untyped-def]
        scanned = self._scan_topk(topk_idx, num_experts, 1)
        assert scanned is not None  # a tensor in, a tensor out
        topk_idx = scanned
        T = topk_idx.shape[0]
        per_rank = num_experts // self.R
        valid = topk_idx >= 0
        experts = topk_idx[valid]
        num_tokens_per_expert = torch.bincount(experts, minlength=num_experts).to(torch.int32)
        is_token_in_rank = torch.zeros((T, self.R), dtype=torch.bool, device=topk_idx.device)
        rows = torch.arange(T, dtype=torch.int64, device=topk_idx.device).unsqueeze(1).expand_as(topk_idx)[valid]
        is_token_in_rank[rows, experts // per_rank] = True
        num_tokens_per_rank = is_token_in_rank.sum(0, dtype=torch.int32)
        topo = self.ctx.topology
        num_tokens_per_rdma_rank = None
        if topo.num_nodes > 1:
            in_node = is_token_in_rank.view(T, topo.num_nodes, topo.ranks_per_node).any(-1)
            num_tokens_per_rdma_rank = in_node.sum(0, dtype=torch.int32)
        return num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank

    # ---------------------------------------------------------------- helpers shared by dispatch paths
    def _send_order(self, is_token_in_rank: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """Token index of every outgoing row, ordered by (destination rank, token), and rows per destination."""
        pairs = torch.nonzero(is_token_in_rank.t(), as_tuple=False)  # [(dst, token)] sorted lexicographically
        counts = is_token_in_rank.sum(0).tolist()
        return pairs[:, 1], [int(c) for c in counts]

    def _recv_counts(self, rank_prefix_matrix: torch.Tensor) -> list[int]:
        col = rank_prefix_matrix[:, self.me].to(torch.int64)
        return torch.diff(col, prepend=col.new_zeros(1)).tolist()

    def _pack(self, parts: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat([_bytes(p) for p in parts], dim=1) if len(parts) > 1 else _bytes(parts[0])

    @staticmethod
    def _unpack(buf: torch.Tensor, widths: list[int]) -> list[torch.Tensor]:
        out, col = [], 0
        for w in widths:
            out.append(buf[:, col:col + w])
            col += w
        return out

    def _move_x(self, x: torch.Tensor, x_scales: torch.Tensor | None, send_idx: torch.Tensor, send_counts: list[int],
                recv_counts: list[int], extra: list[torch.Tensor],
                phase: str) -> tuple[torch.Tensor, torch.Tensor | None, list[torch.Tensor]]:
        """Ship x rows (+scales, + extra per-row tensors already in send order) in one all-to-all."""
        rows = x if x.element_size() > 1 else x.view(torch.uint8)  # FP8 has no index_select on every device
        parts = [rows.index_select(0, send_idx)]
        widths = [x.shape[1] * x.element_size()]
        if x_scales is not None:
            s = x_scales.index_select(0, send_idx)
            parts.append(s)
            widths.append((s.shape[1] if s.dim() == 2 else 1) * s.element_size())
        for e in extra:
            parts.append(e)
            widths.append((e.shape[1] if e.dim() == 2 else 1) * e.element_size())
        recv = self._all_to_all_rows(self._pack(parts), send_counts, recv_counts, phase)
        fields = self._unpack(recv, widths)
        recv_x = _from_bytes(fields[0], x.dtype, x.shape[1])
        recv_scales = None
        rest = fields[1:]
        if x_scales is not None:
            recv_scales = _from_bytes(fields[1], x_scales.dtype, x_scales.shape[1] if x_scales.dim() == 2 else None)
            rest = fields[2:]
        return recv_x, recv_scales, rest

    # ---------------------------------------------------------------- dispatch
    def dispatch(self, req: DispatchRequest):  # type: ignore[no-untyped-def]
        R, me = self.R, self.me
        dev = req.x.device
        T = req.x.shape[0]
        E = req.num_experts
        E_loc = E // R
        # Checked here, raised by the agreement step on every rank (a rank raising alone would leave its peers
        # waiting in the step until the timeout).
        layout_ok = torch.equal(req.is_token_in_rank.sum(0, dtype=torch.int32), req.num_tokens_per_rank)
        self._scan_topk(req.topk_idx, E, 2)
        self._agree(1, E, req.x, req.x_scales, req.topk_idx, layout_ok)
        # Counts: full [R, R] matrix (row i = what rank i sends to each rank) and per-local-expert counts.
        matrix = self._all_gather_vec(req.num_tokens_per_rank.to(torch.int64), "dispatch/rank-counts")
        rank_prefix_matrix = torch.cumsum(matrix, 0).to(torch.int32)
        recv_counts = matrix[:, me].tolist()
        expert_counts = self._all_to_all_rows(req.num_tokens_per_expert.to(torch.int64).view(R, E_loc),
                                              [1] * R, [1] * R, "dispatch/expert-counts")
        per_expert = expert_counts.sum(0).tolist()
        counts_list = [_align(int(c), req.expert_alignment) for c in per_expert]

        send_idx, send_counts = self._send_order(req.is_token_in_rank)
        extra = [send_idx.to(torch.int32)]
        if req.topk_idx is not None:
            assert req.topk_weights is not None  # Buffer checks they come together
            extra += [req.topk_idx.index_select(0, send_idx), req.topk_weights.index_select(0, send_idx)]
        recv_x, recv_scales, rest = self._move_x(req.x, req.x_scales, send_idx, send_counts, recv_counts, extra,
                                                 "dispatch/rows")
        recv_src_idx = _from_bytes(rest[0], torch.int32, None)
        n_recv = recv_x.shape[0]
        recv_idx = recv_w = None
        if req.topk_idx is not None:
            K = req.topk_idx.shape[1]
            g_idx = _from_bytes(rest[1], torch.int64, K)
            w = _from_bytes(rest[2], torch.float32, K)
            local = (g_idx >= me * E_loc) & (g_idx < (me + 1) * E_loc)
            recv_idx = torch.where(local, g_idx - me * E_loc, torch.full_like(g_idx, -1))
            recv_w = torch.where(local, w, torch.zeros_like(w))

        # Channel matrices (DeepEP handle layout): channel c covers tokens [c*ceil(T/C), (c+1)*ceil(T/C)).
        C = req.config.num_channels
        per_channel = -(-T // C) if T > 0 else 1
        padded = torch.zeros((C * per_channel, R), dtype=torch.int64, device=dev)
        padded[:T] = req.is_token_in_rank
        per_dst_channel = padded.view(C, per_channel, R).sum(1).t()  # [R, C] tokens per (destination, channel)
        channel_prefix_matrix = torch.cumsum(per_dst_channel, 1).to(torch.int32)
        from_src = self._all_to_all_rows(channel_prefix_matrix.to(torch.int64), [1] * R, [1] * R,
                                         "dispatch/channel-matrix")  # [R(src), C]
        recv_channel_prefix_matrix = torch.cat([from_src.new_zeros((R, 1)), from_src[:, :-1]], 1).to(torch.int32)
        send_head = torch.where(req.is_token_in_rank, torch.cumsum(req.is_token_in_rank.to(torch.int32), 0) - 1,
                                torch.full((T, R), -1, dtype=torch.int32, device=dev)).to(torch.int32)

        if req.num_worst_tokens > 0:
            if req.num_worst_tokens < n_recv:
                raise InvalidUsageError(
                    f"num_worst_tokens={req.num_worst_tokens} is smaller than the {n_recv} rows rank {me} receives; "
                    f"raise it to the worst case (tokens per rank x ranks = {T * R} covers every routing)"
                )
            pad = req.num_worst_tokens - n_recv
            assert recv_idx is not None and recv_w is not None  # Buffer requires top-k with num_worst_tokens
            recv_x = torch.cat([recv_x, recv_x.new_zeros((pad, recv_x.shape[1]))])
            if recv_scales is not None:
                recv_scales = torch.cat([recv_scales, recv_scales.new_zeros((pad, *recv_scales.shape[1:]))])
            recv_idx = torch.cat([recv_idx, recv_idx.new_full((pad, recv_idx.shape[1]), -1)])
            recv_w = torch.cat([recv_w, recv_w.new_zeros((pad, recv_w.shape[1]))])
            recv_src_idx = torch.cat([recv_src_idx, recv_src_idx.new_full((pad,), -1)])
            counts_list = []
        handle = DispatchHandle(rank_prefix_matrix=rank_prefix_matrix, channel_prefix_matrix=channel_prefix_matrix,
                                recv_channel_prefix_matrix=recv_channel_prefix_matrix, recv_src_idx=recv_src_idx,
                                is_token_in_rank=req.is_token_in_rank, send_head=send_head)
        return recv_x, recv_scales, recv_idx, recv_w, counts_list, handle

    def cached_dispatch(self, x: torch.Tensor, x_scales: torch.Tensor | None, handle: Any, config: Any):  # type: ignore[no-untyped-def]
        self._agree(2, 0, x, x_scales, None)
        send_idx, send_counts = self._send_order(handle.is_token_in_rank)
        recv_counts = self._recv_counts(handle.rank_prefix_matrix)
        recv_x, recv_scales, _ = self._move_x(x, x_scales, send_idx, send_counts, recv_counts, [],
                                              "cached-dispatch/rows")
        return recv_x, recv_scales

    # ---------------------------------------------------------------- combine
    def combine(self, x: torch.Tensor, handle: Any, topk_weights: torch.Tensor | None, bias: Any, config: Any):  # type: ignore[no-untyped-def]
        self._agree(3, 0, x, None, topk_weights)
        recv_counts = self._recv_counts(handle.rank_prefix_matrix)  # rows I got from each source = rows I return
        n_real = sum(recv_counts)
        send_idx, send_counts = self._send_order(handle.is_token_in_rank)  # rows I get back from each rank
        parts = [x[:n_real]]
        widths = [x.shape[1] * x.element_size()]
        if topk_weights is not None:
            parts.append(topk_weights[:n_real])
            widths.append(topk_weights.shape[1] * 4)
        back = self._all_to_all_rows(self._pack(parts), recv_counts, send_counts, "combine/rows")
        fields = self._unpack(back, widths)
        rows = _from_bytes(fields[0], x.dtype, x.shape[1]).float()
        T = handle.is_token_in_rank.shape[0]
        acc = torch.zeros((T, x.shape[1]), dtype=torch.float32, device=x.device)
        acc_w = None
        if topk_weights is not None:
            w_rows = _from_bytes(fields[1], torch.float32, topk_weights.shape[1])
            acc_w = torch.zeros((T, topk_weights.shape[1]), dtype=torch.float32, device=x.device)
        # Fixed order: rank 0 first, then 1, ... (each token appears at most once per rank: no races).
        start = 0
        for count in send_counts:
            if count:
                idx = send_idx[start:start + count]
                acc.index_add_(0, idx, rows[start:start + count])
                if acc_w is not None:
                    acc_w.index_add_(0, idx, w_rows[start:start + count])
            start += count
        for b in bias:
            if b is not None:
                acc += b.float()
        return acc.to(x.dtype), acc_w

