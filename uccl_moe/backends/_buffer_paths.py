"""The native backend's paths through the NVL buffer outside the rings: the combine from the buffer (a
get_combine_buffer view), the staged combine and the copy-engine combine of a caller's tensor, and the fit checks of
those and of the ring-free dispatch. A mixin of :class:`uccl_moe.backends.native.NativeBackend` (which owns
``_rt``, ``ctx``, ``R`` and the stream); every decision here is the same on every rank of the node, since it rests
on counts notify published alike to every rank.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar, cast

import torch

from .. import _C, env, tuning
from ..errors import InternalError, InvalidTypeError, InvalidUsageError
from ..results import DispatchHandle, handle_field
from ..utils import tensor_at
from ._operands import combine_inputs, combine_outputs, scale_layout

#: Attribute on a handle's rank_prefix tensor: the most rows any rank of the node received (notify's count).
_MOST_ROWS_ATTR = "_uccl_moe_most_recv_rows"
_MOST_REMOTE_ATTR = "_uccl_moe_most_remote_rows"  # the most rows any rank received from other ranks
#: The handle's [R, R] rank prefix matrix as notify published it to the host (a row-major list): what a copy-engine
#: combine sizes its copies by, without a device sync. Absent on a num_worst_tokens handle (no host counts).
_RANK_PREFIX_HOST_ATTR = "_uccl_moe_rank_prefix_host"
_RANK_TOKENS_HOST_ATTR = "_uccl_moe_rank_tokens_host"  # every rank's token count, as notify published it
_CE_FIT_ATTR = "_uccl_moe_ce_fit"  # the last copy-engine combine fit answered for the handle: (key, rank prefix)
_CE_DISPATCH_FIT_ATTR = "_uccl_moe_ce_dispatch_fit"  # and dispatch's: (key, (rank prefix, tokens, least share))

log = logging.getLogger("uccl_moe.buffer")


def _alike_rows(handle: Any, count_attr: str) -> int:
    """A row count every rank of `handle` agrees on: notify's count `count_attr` on its rank_prefix, or for a
    num_worst_tokens handle (no count) its own padded rows, alike where every rank passed the same num_worst_tokens."""
    rows = getattr(handle_field(handle, "rank_prefix_matrix"), count_attr, None)
    return int(handle_field(handle, "recv_src_idx").shape[0]) if rows is None else int(rows)


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else int(t.data_ptr())


_T = TypeVar("_T")


def _late_outputs(launch: Callable[[Callable[[], tuple[int, int]]], None],
                  alloc: Callable[[], tuple[torch.Tensor, torch.Tensor | None]],
                  what: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Runs `launch(outputs)`, a copy-engine launch that calls `outputs` once its first copies are enqueued
    (LateOutputs): `outputs` allocates the op's two outputs with `alloc` and hands their addresses over. Returns them;
    the launch must have asked exactly once, before its kernel."""
    outs: list[tuple[torch.Tensor, torch.Tensor | None]] = []

    def outputs() -> tuple[int, int]:
        out0, out1 = alloc()
        outs.append((out0, out1))
        return _ptr(out0), _ptr(out1)

    launch(outputs)
    if len(outs) != 1:
        raise InternalError(f"{what}: the native launch asked for its outputs {len(outs)} times, not once; this is a "
                            f"bug in uccl-moe, please report it")
    return outs[0]


def _answered_once(owner: Any, attr: str, key: tuple[int, ...], answer: Callable[[], _T]) -> _T:
    """answer(), kept on the handle's rank_prefix tensor `owner` under `attr` with `key`: every op of a handle asks a
    fit alike, so it is answered once per handle and key (another key answers afresh and replaces it)."""
    known = getattr(owner, attr, None)
    if known is not None and known[0] == key:
        return cast(_T, known[1])
    value = answer()
    setattr(owner, attr, (key, value))
    return value


class BufferPaths:
    """Mixin: the combine from the buffer, the staged and the copy-engine combine, the ring-free dispatch's fit."""

    _rt: Any
    _inter: Any
    ctx: Any
    R: int
    supported_combine_dtypes: ClassVar[tuple[torch.dtype, ...]]
    _ce_unfit_said: frozenset[str] = frozenset()  # the ops _say_ce_unfit spoke of for this Buffer

    if TYPE_CHECKING:  # NativeBackend's
        def _check_alive(self) -> None: ...

        def _stream(self) -> int: ...

        @staticmethod
        def _alloc_recv(rows: int, x: torch.Tensor, x_scales: torch.Tensor | None, num_topk: int,
                        with_meta: bool) -> tuple[Any, ...]: ...

    def _combine_tensor(self, x: torch.Tensor, handle: DispatchHandle, topk_weights: torch.Tensor | None, bias: Any,
                        config: Any) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """A caller's (contiguous) tensor `x` combined through the copy engines or staged, where the knobs
        (UCCL_MOE_COMBINE_CE, then UCCL_MOE_COMBINE_STAGED), the EP size and the fit say so; None: the rings. The
        same choice on every rank (the knobs must be alike; the fits rest on notify's counts)."""
        K = int(topk_weights.shape[1]) if topk_weights is not None else 0
        H = int(x.shape[1])
        if tuning.combine_ce(self.R, env.get("COMBINE_CE")):
            rank_prefix = self._ce_rank_prefix(handle, H, K)
            if rank_prefix is not None:
                return self._pull(x, handle, topk_weights, bias, config, ce_rank_prefix=rank_prefix)
        if tuning.combine_staged(self.R, env.get("COMBINE_STAGED")):
            staged_rows = self._staged_rows(handle, H, K)
            if staged_rows is not None:
                # The other ranks' rows into the buffer with the whole GPU, then the pull, which reads our own
                # rows from x.
                _C.stage_combine_rows_intranode(self._rt, _ptr(x), H, staged_rows, _ptr(handle.rank_prefix_matrix),
                                                self._stream())
                return self._pull(x, handle, topk_weights, bias, config, staged_rows=staged_rows)
        return None

    def _dispatch_ce(self, x: torch.Tensor, x_scales: torch.Tensor | None, handle: DispatchHandle,
                     num_sms: int) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """A cached dispatch of (contiguous) `x` through the copy engines where UCCL_MOE_DISPATCH_CE, the EP size and
        the fit say so (alike on every rank: the fit rests on notify's counts); None: the rings."""
        knob = env.get("DISPATCH_CE")
        if not tuning.dispatch_ce(self.R, knob):
            return None
        num_scales, s_tok, s_hid = scale_layout(x_scales)
        row_bytes = int(x.shape[1]) * x.element_size()
        counts = self._ce_dispatch_counts(handle, row_bytes, num_scales)
        if counts is None or not tuning.dispatch_ce(self.R, knob, counts[2]):
            return None
        rank_prefix, tokens, _ = counts
        if x_scales is not None and x_scales.dim() == 2 and x_scales.stride() not in (
                (1, x_scales.shape[0]), (x_scales.shape[1], 1)):
            x_scales = x_scales.contiguous()  # the SMs store the scales into the peers as one dense block
            _, s_tok, s_hid = scale_layout(x_scales)
        rows = int(handle.recv_src_idx.shape[0])
        args = _C.DispatchArgs(
            x=_ptr(x), x_scales=_ptr(x_scales), rank_prefix=_ptr(handle.rank_prefix_matrix), num_tokens=x.shape[0],
            row_bytes=row_bytes, num_scales=num_scales, scale_token_stride=s_tok, scale_hidden_stride=s_hid,
            num_recv_rows=rows, recv_src_idx=_ptr(handle.recv_src_idx))
        chunks, early, stream = int(env.get("DISPATCH_CE_CHUNKS")), bool(env.get("CE_EARLY")), self._stream()
        poll, beside = tuning.dispatch_ce_poll(env.get("DISPATCH_CE_POLL")), bool(env.get("CE_END_BESIDE"))
        return _late_outputs(
            lambda outputs: _C.dispatch_ce_intranode(self._rt, num_sms, args, rank_prefix, tokens, chunks, early,
                                                     stream, outputs, poll, beside),
            lambda: self._alloc_recv(rows, x, x_scales, 0, False)[:2], "copy-engine dispatch")

    def dispatch_ce_fits(self, handle: Any, row_bytes: int, num_scales: int) -> bool:
        """Whether a cached dispatch along `handle` of rows of `row_bytes` (`num_scales` 4-byte scales each) could go
        through the copy engines: notify published the handle's counts to the host and every rank's whole x fits
        every other rank's landing area. Whether it does: UCCL_MOE_DISPATCH_CE, and for ``auto`` the EP size and
        the least share of its tokens a rank sends to another (tuning.dispatch_ce)."""
        self._check_alive()
        return self._inter is None and self._ce_dispatch_counts(handle, row_bytes, num_scales) is not None

    def _ce_dispatch_counts(self, handle: Any, row_bytes: int,
                            num_scales: int) -> tuple[list[int], list[int], float] | None:
        """(rank prefix, every rank's tokens, the least share of its tokens a rank sends to another) as notify
        published them to the host, where a copy-engine dispatch of such rows fits every rank's buffer; else None
        (alike on every rank). Answered once per handle and row layout (cached dispatches repeat it)."""
        owner = handle_field(handle, "rank_prefix_matrix")
        rank_prefix = getattr(owner, _RANK_PREFIX_HOST_ATTR, None)
        tokens = getattr(owner, _RANK_TOKENS_HOST_ATTR, None)
        if rank_prefix is None or tokens is None:
            return None

        def answer() -> tuple[list[int], list[int], float] | None:
            prefix, counts = list(rank_prefix), list(tokens)
            least = tuning.least_sent_share(prefix, counts)
            need = int(_C.intranode_ce_dispatch_landing_bytes(tokens, row_bytes, num_scales))
            if need <= self.ctx.num_nvl_bytes:
                return prefix, counts, least
            if tuning.dispatch_ce(self.R, env.get("DISPATCH_CE"), least):
                hidden = row_bytes if num_scales else row_bytes // 2  # (FP8 rows and scales take less than BF16's)
                self._say_ce_unfit("cached dispatch", "DISPATCH_CE", need, hidden, 0)
            return None

        return _answered_once(owner, _CE_DISPATCH_FIT_ATTR, (row_bytes, num_scales, self.ctx.num_nvl_bytes),
                              answer)

    def _say_ce_unfit(self, op: str, knob: str, need: int, hidden: int, num_topk: int) -> None:
        """Once per Buffer and op: a copy-engine op the knobs and the EP size take did not fit the NVL buffer, so it
        runs on the rings (alike on every rank: the fit rests on notify's counts), and how to size the Buffer."""
        if op in self._ce_unfit_said:
            return
        self._ce_unfit_said = self._ce_unfit_said | {op}
        log.warning(
            "uccl-moe: the copy-engine %s (on at EP%d with UCCL_MOE_%s=%s: faster than the rings there) needs %.1f "
            "MiB of NVL buffer for this batch and the Buffer has %.1f MiB, so it runs on the rings. Size the Buffer "
            "with the largest of the configs' hints and Buffer.get_copy_engine_buffer_size_hint(tokens_per_rank, %d, "
            "%d, %d) for your largest batch, or where a framework creates the Buffer (Megatron's flex dispatcher) set "
            "UCCL_MOE_NVL_BYTES_MIN=%d (this batch's need) or more on every rank (said once per Buffer and op)", op,
            self.R, knob, env.get(knob), need / 2**20, self.ctx.num_nvl_bytes / 2**20, hidden, self.R, num_topk,
            -(-need // (1 << 20)) << 20)

    def combine_ce_fits(self, handle: Any, hidden: int, num_topk: int) -> bool:
        """Whether a combine of a caller's tensor of `handle`'s rows could go through the copy engines: notify
        published the handle's rank prefix to the host (not a num_worst_tokens handle) and every rank's landing area
        fits its buffer. UCCL_MOE_COMBINE_CE and the EP size decide whether it does."""
        self._check_alive()
        return self._inter is None and self._ce_rank_prefix(handle, hidden, num_topk) is not None

    def _ce_rank_prefix(self, handle: Any, hidden: int, num_topk: int) -> list[int] | None:
        """The handle's rank prefix matrix as notify published it to the host, where a copy-engine combine of rows of
        `hidden` BF16 values (`num_topk` weights each) fits every rank's buffer; else None (alike on every rank)."""
        owner = handle_field(handle, "rank_prefix_matrix")
        rank_prefix = getattr(owner, _RANK_PREFIX_HOST_ATTR, None)
        if rank_prefix is None or (hidden * 2) % 16 != 0:
            return None

        def answer() -> list[int] | None:
            need = int(_C.intranode_ce_landing_bytes(rank_prefix, hidden, num_topk))
            if need <= self.ctx.num_nvl_bytes:
                return list(rank_prefix)
            if tuning.combine_ce(self.R, env.get("COMBINE_CE")):
                self._say_ce_unfit("combine", "COMBINE_CE", need, hidden, num_topk)
            return None

        return _answered_once(owner, _CE_FIT_ATTR, (hidden, num_topk, self.ctx.num_nvl_bytes),
                              answer)

    def combine_buffer(self, handle: DispatchHandle, hidden: int, dtype: torch.dtype) -> torch.Tensor | None:
        """The [T_recv, hidden] view of this rank's NVL buffer that a combine from the buffer reads, or None where
        that path does not exist (across nodes: the caller gets a tensor of its own)."""
        self._check_alive()
        if self._inter is not None:
            return None
        if dtype not in self.supported_combine_dtypes:
            raise InvalidTypeError(f"the native backend combines bfloat16 rows, got get_combine_buffer(dtype={dtype})")
        if (hidden * 2) % 16 != 0:
            raise InvalidUsageError(f"get_combine_buffer: hidden={hidden}: hidden * 2 bytes must be a multiple of 16")
        rows = int(handle_field(handle, "recv_src_idx").shape[0])  # tests pass DeepEP-order tuples
        offset, end = _C.intranode_combine_input_layout(rows, hidden, 0)
        self._refuse_over_buffer(int(end), f"get_combine_buffer: {rows} rows of hidden {hidden}")
        # The caller writes the view on its stream: after the sentinel memset a copy-engine combine may have left
        # running beside it (NvlRuntime::begin_op).
        self._rt.wait_for_sentinel(self._stream())
        # A rank that receives nothing gets a 0-row slice of a 1-row view, so it still points into the buffer and
        # takes the same path as its peers.
        return tensor_at(self._rt.local_buffer + int(offset), (max(rows, 1), hidden), dtype, self.ctx.device)[:rows]

    def combine_buffer_fits(self, handle: Any, hidden: int, num_topk: int) -> bool:
        """Whether every rank's view of `handle`'s rows (and `num_topk` staged weights per row) fits its buffer: the
        same answer on every rank, since it rests on the most rows any rank received (published by notify) and every
        rank's buffer has the same size. A num_worst_tokens handle has no such count: its own rows stand in, which
        agree across ranks only if every rank passed the same num_worst_tokens (Buffer.combine_buffer_fits says so).
        False for rows that are not 16-byte multiples (the view refuses them)."""
        self._check_alive()
        if self._inter is not None:
            return True  # no view: get_combine_buffer hands out a tensor of the caller's
        return self._rows_that_fit(handle, _MOST_ROWS_ATTR, hidden, num_topk) is not None

    def combine_staged_fits(self, handle: Any, hidden: int, num_topk: int) -> bool:
        """Whether a combine of a caller's tensor of `handle`'s rows could take the staged path (its rows fit every
        rank's buffer); UCCL_MOE_COMBINE_STAGED and the EP size decide whether it does."""
        self._check_alive()
        return self._inter is None and self._staged_rows(handle, hidden, num_topk) is not None

    def _staged_rows(self, handle: Any, hidden: int, num_topk: int) -> int | None:
        """Rows every buffer must hold for a staged combine of `handle` (most a rank got from others), or None."""
        return self._rows_that_fit(handle, _MOST_REMOTE_ATTR, hidden, num_topk)

    def _rows_that_fit(self, handle: Any, count_attr: str, hidden: int, num_topk: int) -> int | None:
        """The rows of hidden BF16 values (and `num_topk` staged weights each) every rank's buffer must hold for a
        pull along `handle`: notify's count `count_attr` on its rank_prefix (the same on every rank), or for a
        num_worst_tokens handle its own padded rows; None where they do not fit the buffer or are not 16-byte
        multiples. The same answer on every rank, as the pull's paths require."""
        if (hidden * 2) % 16 != 0:
            return None
        rows = _alike_rows(handle, count_attr)
        fits = int(_C.intranode_combine_input_layout(rows, hidden, num_topk)[1]) <= self.ctx.num_nvl_bytes
        return rows if fits else None

    def dispatch_direct_fits(self, handle: Any, row_bytes: int, num_topk: int, num_scales: int) -> bool:
        """Whether a dispatch along `handle` of rows of `row_bytes` (`num_topk` ids, `num_scales` scales) could take
        the ring-free path (its landing area fits every buffer); UCCL_MOE_DISPATCH_DIRECT and the EP size decide."""
        self._check_alive()
        return self._inter is None and self._direct_rows(handle, row_bytes, num_topk, num_scales) is not None

    def _direct_rows(self, handle: Any, row_bytes: int, num_topk: int, num_scales: int) -> int | None:
        """The rows every landing area must hold for a ring-free dispatch along `handle` (notify's most rows a rank
        receives from others; a num_worst_tokens handle's padded rows), or None where they do not fit: alike on all."""
        rows = _alike_rows(handle, _MOST_REMOTE_ATTR)
        need = int(_C.intranode_direct_landing_bytes(rows, row_bytes, num_topk, num_scales))
        return rows if need <= self.ctx.num_nvl_bytes else None

    def _refuse_over_buffer(self, end: int, what: str) -> None:
        """InvalidUsageError naming `what` and the num_nvl_bytes to use if `end` bytes exceed the NVL buffer."""
        if end > self.ctx.num_nvl_bytes:
            raise InvalidUsageError(
                f"{what} needs {end} bytes of NVL buffer per rank, but the Buffer has num_nvl_bytes="
                f"{self.ctx.num_nvl_bytes}; construct the Buffer with num_nvl_bytes >= {end}, or combine from a "
                f"tensor of your own (the ring path)"
            )

    def _in_buffer(self, x: torch.Tensor) -> bool:
        """True if x's storage lies in this rank's NVL buffer (where only a get_combine_buffer view may come from).
        The storage, not x.data_ptr(): a view with no rows (a rank that receives nothing) has data_ptr() 0."""
        lo = int(self._rt.local_buffer)
        hi = lo + int(self.ctx.num_nvl_bytes)
        storage = x.untyped_storage()
        start = int(storage.data_ptr())
        return start != 0 and start < hi and start + max(int(storage.nbytes()), 1) > lo

    def _combine_from_buffer(self, x: torch.Tensor, handle: DispatchHandle, topk_weights: torch.Tensor | None,
                             bias: Any, config: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Every rank's rows already lie in its buffer: each rank pulls its tokens' copies (combine_pull.cu)."""
        rows, H = int(x.shape[0]), int(x.shape[1])
        K = int(topk_weights.shape[1]) if topk_weights is not None else 0
        offset, end = _C.intranode_combine_input_layout(rows, H, K)
        if not x.is_contiguous() or (rows > 0 and int(x.data_ptr()) != self._rt.local_buffer + offset):
            raise InvalidUsageError(
                "combine: x lies inside this Buffer's NVL buffer but is not the tensor get_combine_buffer(handle, "
                "hidden) returned (a slice or a strided view of it?); pass that tensor itself, or a tensor of your own"
            )
        self._refuse_over_buffer(int(end), f"combine from the buffer with topk_weights of {K} per row (rows, then "
                                           f"the staged weights)")
        return self._pull(x, handle, topk_weights, bias, config)

    def _pull(self, x: torch.Tensor, handle: DispatchHandle, topk_weights: torch.Tensor | None, bias: Any,
              config: Any, staged_rows: int | None = None,
              ce_rank_prefix: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Launches combine_pull over `x`'s rows: the view, or with `staged_rows` (the rows each buffer holds at
        most) a staged caller's tensor whose other ranks' rows were copied into the buffers, compacted; or with
        `ce_rank_prefix` (the handle's, on the host) the copy-engine combine of a caller's tensor."""
        own = staged_rows is not None or ce_rank_prefix is not None
        rows, H = int(x.shape[0]) if staged_rows is None else staged_rows, int(x.shape[1])
        K = int(topk_weights.shape[1]) if topk_weights is not None else 0
        T = int(handle.is_token_in_rank.shape[0])
        lanes = handle.channel_prefix_matrix
        tw, b0, b1 = combine_inputs(topk_weights, bias)
        args = _C.CombinePullArgs(
            topk_weights=_ptr(tw), bias0=_ptr(b0), bias1=_ptr(b1), rank_prefix=_ptr(handle.rank_prefix_matrix),
            lane_prefix=_ptr(lanes), send_head=_ptr(handle.send_head), num_tokens=T, hidden=H, num_topk=K,
            num_lanes=int(lanes.shape[1]), staged=int(own), own_x=_ptr(x) if own else 0,
            ce_chunks=int(env.get("COMBINE_CE_CHUNKS")))
        if ce_rank_prefix is not None:
            early, poll, stream = bool(env.get("CE_EARLY")), bool(env.get("CE_POLL")), self._stream()
            beside = bool(env.get("CE_END_BESIDE"))
            return _late_outputs(
                lambda outputs: _C.combine_ce_intranode(self._rt, int(config.num_sms), args, ce_rank_prefix, early,
                                                        stream, outputs, poll, beside),
                lambda: combine_outputs(x, T, tw), "copy-engine combine")
        out, out_w = combine_outputs(x, T, tw)
        args.out, args.out_topk_weights = _ptr(out), _ptr(out_w)
        _C.combine_pull_intranode(self._rt, int(config.num_sms), rows, args, self._stream())
        return out, out_w

