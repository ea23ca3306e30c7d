"""``uccl_moe.Buffer``: the DeepEP-V1 high-throughput (HT) expert-parallel API.

Notation: T = tokens of this rank, H = hidden, K = top-k, E = experts (all ranks), R = ranks of the group,
E_loc = E / R local experts, T_recv = rows this rank receives, C = channels (``num_sms / 2``).

Every public method validates its arguments first (``_checks.py``: ``InvalidUsageError``/``InvalidTypeError``,
subclasses of ``ValueError``/``TypeError``, naming the argument and the fix), then runs on the Buffer's **comm
stream** with DeepEP's stream rules (the joins: ``streams.py``; the tuned presets: ``tuning.py``):

- the comm stream first waits on ``previous_event`` if given, otherwise on the current (compute) stream;
- ``async_finish=True`` returns an :class:`EventOverlap` recorded on the comm stream, and inputs/outputs are
  marked used by the comm stream (``record_stream``); otherwise the current stream waits for the comm stream
  before the call returns;
- ``allocate_on_comm_stream=True`` allocates outputs while the comm stream is current. Unlike DeepEP it does not
  require ``previous_event``: without one, the comm stream waits on the current stream (UCCL issue #893).
- By default (``UCCL_MOE_CALLER_STREAM_OPS=1``), a synchronous op without ``previous_event`` or
  ``allocate_on_comm_stream`` (the defaults) runs on the caller's stream itself where it can
  (:meth:`uccl_moe.streams.CommStream.runs_on_caller`), ordered with the Buffer's other ops as if it ran on the comm
  stream: what the caller sees is the same (its stream waits for the op either way), at a lower host cost, since
  outputs then need no ``record_stream``.

On CPU (gloo) everything is synchronous and events are always complete.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, ClassVar, Literal, Optional, Union

import torch
import torch.distributed as dist

try:
    from . import _C
except ImportError as _e:  # pragma: no cover - a broken install
    raise ImportError(
        f"uccl_moe._C (the native module) is missing: {_e}. Install with `pip install -e .` from the source tree"
    ) from _e

from . import _checks, _plain_ops, streams, tuning  # noqa: E402 - after the native module's own error
from ._checks import FP8_SCALE_BLOCK, HANDLE_KEY_ATTR, MAX_EXPERTS_PER_RANK, MAX_TOPK, err, int_arg, topk_idx_t  # noqa: E402
from ._low_latency import LowLatencyNotImplemented  # noqa: E402
from ._size_hints import SizeHints  # noqa: E402
from .backends.base import Backend, BufferContext, DispatchRequest, backend_factory, create_backend  # noqa: E402
from .errors import InvalidTypeError  # noqa: E402
from .results import (  # noqa: E402
    CombineResult,
    DispatchHandle,
    DispatchResult,
    LayoutResult,
    SupportedDtypes,
    TensorOrFp8,
)
from .streams import CommStream  # noqa: E402
from .topology import Topology, detect  # noqa: E402
from .utils import EventHandle, EventOverlap  # noqa: E402

log = logging.getLogger("uccl_moe.buffer")

#: The DeepEP-V1 ``Config`` (native), built by keyword: Config(num_sms=20, num_max_nvl_chunked_send_tokens=6, ...).
Config = _C.Config

BackendName = Literal["auto", "native", "reference"]

__all__ = [
    "FP8_SCALE_BLOCK", "MAX_EXPERTS_PER_RANK", "MAX_TOPK", "Buffer", "CombineResult", "Config", "DispatchHandle",
    "DispatchResult", "LayoutResult", "SupportedDtypes", "TensorOrFp8", "topk_idx_t",
]


class Buffer(LowLatencyNotImplemented, SizeHints):
    """Communication buffers for HT expert-parallel dispatch and combine; a drop-in for ``deep_ep.Buffer``.

    Args:
        group: the ``torch.distributed`` process group of the EP ranks (any size >= 1).
        num_nvl_bytes: bytes of the intranode (NVLink/xGMI) buffer per rank; at least
            ``Config.get_nvl_buffer_size_hint(hidden_bytes, group.size())`` of the configs you use.
        num_rdma_bytes: bytes of the internode (RDMA) buffer per rank; needed only when the group spans nodes.
        low_latency_mode: DeepEP's LL mode; not implemented (raises ``NotImplementedError``).
        num_qps_per_rank, allow_nvlink_for_low_latency_mode, allow_mnnvl, use_fabric, enable_shrink: accepted for
            DeepEP compatibility; ignored by the HT path.
        explicitly_destroy: if True, the caller must call :meth:`destroy`; otherwise resources are released when
            the Buffer is garbage-collected.
        comm: an mpi4py communicator instead of ``group``; not supported (raises ``InvalidTypeError``).
        backend: ``"native"`` (our kernels; GPUs), ``"reference"`` (torch.distributed all-to-all; CPU/gloo and the
            correctness oracle) or ``"auto"``/None (``UCCL_MOE_BACKEND``, default: native on CUDA groups,
            reference otherwise). Keyword-only; not a DeepEP argument.
    """

    #: SMs used by HT kernels (DeepEP class attribute; change with :meth:`set_num_sms`).
    num_sms: ClassVar[int] = 20

    def __init__(
        self,
        group: Any,
        num_nvl_bytes: int = 0,
        num_rdma_bytes: int = 0,
        low_latency_mode: bool = False,
        num_qps_per_rank: int = 24,
        allow_nvlink_for_low_latency_mode: bool = True,
        allow_mnnvl: bool = False,
        use_fabric: bool = False,
        explicitly_destroy: bool = False,
        enable_shrink: bool = False,
        comm: Any = None,
        *,
        backend: BackendName | None = None,
    ) -> None:
        self._backend: Backend | None = None
        _checks.check_buffer_args(comm, group, num_nvl_bytes, num_rdma_bytes, low_latency_mode)
        num_nvl_bytes = _checks.nvl_bytes_with_floor(num_nvl_bytes)  # UCCL_MOE_NVL_BYTES_MIN
        self.group = group
        self.rank = dist.get_rank(group)
        self.group_size = dist.get_world_size(group)
        self.num_nvl_bytes = num_nvl_bytes
        self.num_rdma_bytes = num_rdma_bytes
        self.low_latency_mode = low_latency_mode
        self.num_qps_per_rank = num_qps_per_rank
        self.explicitly_destroy = explicitly_destroy
        self.topology: Topology = detect(group, self.rank, self.group_size)
        _C.log_set_rank(self.rank)
        choice, device = _checks.choose_backend(backend, group)
        self.device = device
        self.backend_name: str = choice
        # The comm stream with host-cheap joins and switches (uccl_moe/streams.py); None on CPU.
        self._comm: CommStream | None = CommStream(device) if device.type == "cuda" else None
        self._check_topk_idx = _checks.TopkIdxCheck()
        self._fits: set[tuple[Any, ...]] = set()  # what passed _checks.check_buffer_size
        # structures of cached dispatches and combines without config or bias that the full path accepted (_plain_ops)
        self._plain_keys: dict[tuple[Any, ...], tuple[Any, Any]] = {}
        # What a handle's layout depends on. Any Buffer with the same key runs it (a handle holds only layout
        # tensors): Megatron's fused_a2a replaces its Buffer when it needs a bigger one and passes the forward's
        # handles to the new Buffer in backward, as DeepEP allows.
        self._handle_key = (self.backend_name, tuple(dist.get_process_group_ranks(group)), self.topology.ranks_per_node)
        # dispatch/combine calls so far, and (storage address, calls then, the handle's first tensor) of the last
        # get_combine_buffer view: a view that another call overwrote (its ring slots), or that was last taken for
        # another handle's rows (every handle's view is the same memory), is refused by combine instead of summing
        # garbage.
        self._op_seq = 0
        self._combine_view: tuple[int, int, weakref.ref[torch.Tensor]] | None = None
        ctx = BufferContext(group, self.topology, num_nvl_bytes, num_rdma_bytes, device)
        self._backend = create_backend(choice, ctx)
        self._check_topk_idx.on_device = self._backend.checks_topk_idx_on_device
        log.info("Buffer rank %d/%d backend=%s topology=%s", self.rank, self.group_size, choice, self.topology)

    # ---------------------------------------------------------------- lifecycle and static helpers
    def destroy(self) -> None:
        """Release native resources. Required when ``explicitly_destroy=True``; idempotent."""
        try:
            if self._backend is not None:
                self._backend.destroy()
            self._backend = None
        finally:
            if self._comm is not None:
                self._comm.close()

    def __del__(self) -> None:
        if not getattr(self, "explicitly_destroy", True) and getattr(self, "_backend", None) is not None:
            try:
                self.destroy()
            except Exception:  # noqa: BLE001 - never raise from a finalizer
                pass

    @staticmethod
    def is_sm90_compiled() -> bool:
        """True if this build contains kernels for sm_90 (Hopper)."""
        return _C.gpu_backend() == "cuda" and bool(_C.has_intranode_kernels())

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """Set the SM count used by HT kernels (class-wide, like DeepEP). Must be even (sender + receiver)."""
        n = _checks.as_int(new_num_sms)
        if n is None or n <= 0 or n % 2:
            raise err(f"set_num_sms({new_num_sms!r}): the SM count must be a positive even int")
        Buffer.num_sms = n

    @staticmethod
    def capture() -> EventOverlap:
        """An :class:`EventOverlap` recorded on the current stream (pass as ``previous_event``)."""
        return EventOverlap(EventHandle())

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Any:
        """Tuned dispatch :class:`Config` for a group of `num_ranks` (any size >= 1): the row of
        :data:`uccl_moe.tuning.INTRANODE` (<= 8 ranks) or :data:`uccl_moe.tuning.INTERNODE`, at :attr:`num_sms`."""
        return tuning.shared_config(Buffer._preset(num_ranks).dispatch, Buffer.num_sms)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Any:
        """Tuned combine :class:`Config` for a group of `num_ranks` (any size >= 1), as :meth:`get_dispatch_config`."""
        return tuning.shared_config(Buffer._preset(num_ranks).combine, Buffer.num_sms)

    @staticmethod
    def _preset(num_ranks: Any) -> tuning.Preset:
        n = _checks.as_int(num_ranks)
        if n is None or n < 1:
            raise err(f"num_ranks must be a positive int, got {num_ranks!r}")
        return tuning.preset_for(n)

    @staticmethod
    def get_supported_dtypes(backend: str = "native") -> SupportedDtypes:
        """The dtypes of x that backend `backend` dispatches (FP8 comes with its scales) and combines, without creating
        it (uccl-moe extension). The native kernels combine BF16 rows only; the reference backend any float dtype."""
        factory = backend_factory(backend)
        return SupportedDtypes(
            tuple(getattr(factory, "supported_dispatch_dtypes", Backend.supported_dispatch_dtypes)),
            tuple(getattr(factory, "supported_combine_dtypes", Backend.supported_combine_dtypes)),
        )

    @staticmethod
    def get_topology(group: Any) -> Topology:
        """The node layout of `group` (ranks per node, nodes) that a Buffer over it detects and sizes its checks with;
        a collective over `group`, like the Buffer constructor (uccl-moe extension)."""
        if group is None or not isinstance(group, dist.ProcessGroup):
            raise InvalidTypeError(f"group must be a torch.distributed.ProcessGroup, got {type(group).__name__}")
        return detect(group, dist.get_rank(group), dist.get_world_size(group))

    def get_comm_stream(self) -> Any:
        """The comm stream (``torch.cuda.Stream``), or None on CPU. Every later op then waits for what the caller
        enqueues on it, also an op that runs on the caller's stream (see the module notes)."""
        if self._comm is None:
            return None
        self._comm.exposed = True
        return self._comm.stream

    def get_local_buffer_tensor(self, dtype: torch.dtype, size: Any = None, offset: int = 0,
                                use_rdma_buffer: bool = False) -> torch.Tensor:
        """A view of this rank's registered communication buffer (DeepEP's ``get_local_buffer_tensor``): `size`
        elements (a shape, or the rest of the buffer if None) of `dtype` from byte `offset`, of the RDMA buffer if
        `use_rdma_buffer`. Raises ``NotImplementedError`` where the backend exposes none (no backend does yet; use
        :meth:`get_combine_buffer` for combine's rows)."""
        fn = getattr(self._live(), "get_local_buffer_tensor", None)
        if fn is None:
            raise NotImplementedError(f"the {self.backend_name} backend has no registered communication buffer")
        out: torch.Tensor = fn(dtype, size, offset, use_rdma_buffer)
        return out

    def get_combine_buffer(self, handle: tuple[Any, ...], hidden: int,
                           dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """A [T_recv, hidden] tensor to write a combine's input rows into (uccl-moe extension; DeepEP's HT API has
        none). ``combine(x=<this tensor>, handle)`` then reads each row where it lies, over NVLink, instead of
        pushing it through the rings: one NVLink load per remote row, no ring hand-offs (figures: docs/benchmarks.md).

        The tensor is this rank's NVL buffer itself (the memory the rings use), so:
        - its rows are the next combine's input only: write them after the dispatch that made `handle`, then
          combine before any other op of this Buffer (combine refuses a view taken before another call ran); from
          that combine on, peers' next ops may write this memory first (UCCL_MOE_CE_EARLY's early copies, a cached
          ring dispatch), so never read it after; the caller's stream waits here for ops on the comm stream;
        - every rank of the group must combine from its view for the same call (a rank that passes a tensor of its
          own while the others pass their views ends in a ``CommTimeoutError`` naming it, never a hang);
        - it stays valid while the Buffer lives (like DeepEP's ``get_local_buffer_tensor``); rows past the received
          ones (``num_worst_tokens``) may be overwritten by the combine's staged ``topk_weights``;
        - a combine from it runs on ``config.num_sms`` blocks (any count up to the GPU's SMs), not on the handle's
          channels, and every rank must pass ``topk_weights`` of the same shape, or none (else every rank raises
          ``InvalidUsageError`` and the Buffer is unusable).
        Needs ``num_nvl_bytes >= 1 MiB + T_recv * hidden * 2`` (plus ``T_recv * K * 4`` with topk_weights); a
        smaller Buffer raises ``InvalidUsageError``. Backends without the path (reference, across nodes) return a
        fresh tensor, so code that uses this runs everywhere.
        """
        backend = self._live()
        h = self._check_handle(handle)
        hidden = int_arg("hidden", hidden)
        if hidden <= 0:
            raise err(f"hidden={hidden}: must be positive")
        if not isinstance(dtype, torch.dtype):
            raise InvalidTypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__}")
        rows = int(h.recv_src_idx.shape[0])
        view = backend.combine_buffer(h, hidden, dtype)
        if view is None:
            self._combine_view = None
            return torch.empty((rows, hidden), dtype=dtype, device=self.device)
        # the storage's address: a view of no rows (a rank that receives nothing) has data_ptr() 0
        self._combine_view = (int(view.untyped_storage().data_ptr()), self._op_seq, weakref.ref(h.rank_prefix_matrix))
        if self._comm is not None:  # writes into the view wait for any op still running on the comm stream
            self._comm.caller_waits()
        return view

    def combine_buffer_fits(self, handle: tuple[Any, ...], hidden: int, num_topk: int = 0) -> bool:
        """Whether every rank of the group can combine `handle`'s rows from :meth:`get_combine_buffer` (with
        `num_topk` top-k weights per row): the same answer on every rank, so all of them take the view or all pass
        a tensor of their own, as that path requires. It rests on the most rows any rank received, which the
        dispatch's count exchange publishes (no extra collective, no device sync). A ``num_worst_tokens`` handle
        has no such count and answers for its own padded rows, so it agrees across ranks only if every rank passed
        the same ``num_worst_tokens`` (as a CUDA-graph capture does): pass the same value on every rank.
        False where the view's rows would not be 16-byte multiples (BF16 rows need hidden % 8 == 0). Always True
        where the view is a plain tensor (reference backend, across nodes).
        """
        backend = self._live()
        h = self._check_handle(handle)
        hidden, num_topk = int_arg("hidden", hidden), int_arg("num_topk", num_topk)
        if hidden <= 0 or num_topk < 0:
            raise err(f"combine_buffer_fits(hidden={hidden}, num_topk={num_topk}): need hidden > 0 and num_topk >= 0")
        return bool(backend.combine_buffer_fits(h, hidden, num_topk))

    # ---------------------------------------------------------------- op flow helpers
    def _live(self) -> Backend:
        if self._backend is None:
            raise err("this Buffer was destroyed; create a new one")
        return self._backend

    def _check_values(self) -> bool:
        """Whether host-side value checks run (:func:`uccl_moe._checks.value_checks_on`)."""
        return _checks.value_checks_on(self.device, self._check_topk_idx.on_device)

    def _check_handle(self, handle: Any) -> DispatchHandle:
        return _checks.check_handle(handle, self._handle_key)

    def _begin(self, previous_event: Any, async_finish: bool, allocate_on_comm_stream: bool,
               uses_nvl_buffer: bool = True) -> int | None:
        """Count the call if it writes the NVL buffer, then join the streams (:func:`uccl_moe.streams.begin_op`)."""
        if previous_event is not None:
            _checks.check_previous_event(previous_event)
        if uses_nvl_buffer:  # get_dispatch_layout and a combine from the view do not write it
            self._op_seq += 1
        return streams.begin_op(self._comm, previous_event, async_finish, allocate_on_comm_stream)

    def _finish(self, async_finish: bool, inputs: list[Any], outputs: list[Any], on_caller: int | None,
                handle: DispatchHandle | None = None, collective: bool = True) -> EventOverlap:
        """Close an op (:func:`uccl_moe.streams.finish_op`); `handle` is the one a cached dispatch or combine read.
        A `collective` op (every rank enqueued it, so raising here leaves no peer waiting for this one) then raises
        what the kernels recorded without a device sync (Backend.raise_device_faults: a bad topk_idx)."""
        tensors = None if handle is None else (lambda: self._live().handle_tensors(handle))
        event = streams.finish_op(self._comm, async_finish, inputs, outputs, on_caller, tensors)
        if collective:
            self._live().raise_device_faults()
        return event

    # ---------------------------------------------------------------- the HT API
    def get_dispatch_layout(
        self,
        topk_idx: torch.Tensor,
        num_experts: int,
        previous_event: EventOverlap | None = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> LayoutResult:
        """Count what each rank and expert receives.

        Args:
            topk_idx: [T, K] int64 (``topk_idx_t``), values in [-1, num_experts); -1 marks an unused slot.
            num_experts: E, divisible by the group size.
        Returns:
            LayoutResult(num_tokens_per_rank [R] int32 (distinct tokens), num_tokens_per_rdma_rank [nodes] int32 or
            None within one node, num_tokens_per_expert [E] int32, is_token_in_rank [T, R] bool, event).
        Runs on the comm stream.
        """
        backend = self._live()
        num_experts = _checks.check_num_experts(num_experts, self.group_size)
        _checks.check_async(async_finish, allocate_on_comm_stream)
        topk_idx = self._check_topk_idx(topk_idx, num_experts, self.device)
        on_caller = self._begin(previous_event, async_finish, allocate_on_comm_stream, uses_nvl_buffer=False)
        with streams.op_context(self._comm, on_caller):
            out = backend.get_dispatch_layout(topk_idx, num_experts)
        event = self._finish(async_finish, [topk_idx], list(out), on_caller, collective=False)
        return LayoutResult(*out, event)

    # long: DeepEP's signature and docstring; the short path of plain cached calls, then the checks both paths share
    def dispatch(
        self,
        x: TensorOrFp8,
        handle: tuple[Any, ...] | None = None,
        num_tokens_per_rank: torch.Tensor | None = None,
        num_tokens_per_rdma_rank: torch.Tensor | None = None,
        is_token_in_rank: torch.Tensor | None = None,
        num_tokens_per_expert: torch.Tensor | None = None,
        topk_idx: torch.Tensor | None = None,
        topk_weights: torch.Tensor | None = None,
        expert_alignment: int = 1,
        num_worst_tokens: int = 0,
        config: Any = None,
        previous_event: EventOverlap | None = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> DispatchResult:
        """Send each token to every rank that holds one of its experts.

        Args:
            x: [T, H] bfloat16 (float16/float32 also accepted), contiguous; or (x_fp8 [T, H] float8_e4m3fn,
                x_scales [T, H/128] float32 (any strides) or [T, H/512] int32 packed UE8M0, or [T]).
            handle: a previous dispatch's handle for a cached dispatch (no count exchange, no host sync); then
                topk_idx/topk_weights must be None and only recv_x is returned.
            num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank, num_tokens_per_expert: the layout from
                :meth:`get_dispatch_layout` (required without handle).
            topk_idx: [T, K] int64, -1 = unused; topk_weights: [T, K] float32. Given together or not at all.
            expert_alignment: round each per-expert receive count up to a multiple of this.
            num_worst_tokens: if > 0, skip the host sync and return exactly this many rows (must be >= the real
                count); padding rows have recv_topk_idx == -1, and the per-expert list is empty.
            config: a :class:`Config`; default ``get_dispatch_config(R)`` (FP8 rows: the preset's FP8 chunks where
                :data:`uccl_moe.tuning.INTRANODE` has them for R).
        Returns:
            DispatchResult(recv_x [T_recv, H] (tuple for FP8), recv_topk_idx [T_recv, K] int64 local expert ids in
            [0, E_loc) or -1, recv_topk_weights [T_recv, K] float32 (0 where idx is -1),
            num_recv_tokens_per_expert_list list[int], handle, event). Cached: (recv_x, None, None, None, None, event).
        Runs on the comm stream; the caller's stream waits unless async_finish=True.
        """
        plain = config is None and handle is not None and topk_idx is None and topk_weights is None
        if plain:
            done = _plain_ops.cached_dispatch(self, x, handle, expert_alignment, num_worst_tokens, Buffer.num_sms,
                                              previous_event, async_finish, allocate_on_comm_stream)
            if done is not None:  # a structure the full path below accepted before
                return done
        backend = self._live()
        _checks.check_async(async_finish, allocate_on_comm_stream)
        data, scales = _checks.split_x(x, self.device)
        if data.dtype not in backend.supported_dispatch_dtypes:
            raise InvalidTypeError(f"the {self.backend_name} backend cannot dispatch {data.dtype}")
        hidden_bytes = _checks.hidden_bytes(data)
        # config=None: the preset of the group size, FP8 rows taking the row's dispatch_fp8 chunks where it has them
        config = _checks.check_config(config, lambda: tuning.shared_config(
            tuning.preset_for(self.group_size).dispatch_chunks(data.dtype in _checks.FP8_DTYPES), Buffer.num_sms))
        h = self._check_handle(handle) if handle is not None else None
        if h is None:  # a cached dispatch (and combine) runs on the handle's lanes, whatever config.num_sms says
            backend.check_config(config)
        _checks.check_buffer_size(self, hidden_bytes, config, "dispatch", h, data.dtype)
        expert_alignment, num_worst_tokens = _checks.check_dispatch_counts(expert_alignment, num_worst_tokens)
        num_tokens = data.shape[0]
        if h is not None:
            _checks.check_cached_dispatch(h, num_tokens, topk_idx, topk_weights)
            on_caller = self._begin(previous_event, async_finish, allocate_on_comm_stream)
            with streams.op_context(self._comm, on_caller):
                recv_x, recv_scales = backend.cached_dispatch(data, scales, h, config)
            out_x: TensorOrFp8 = recv_x if recv_scales is None else (recv_x, recv_scales)
            event = self._finish(async_finish, [data, scales], [recv_x, recv_scales], on_caller, h)
            if plain:
                _plain_ops.remember(self, _plain_ops.dispatch_key(x, handle, Buffer.num_sms), config)
            return DispatchResult(out_x, None, None, None, None, event)

        per_rank, per_rdma_rank, in_rank, per_expert, num_experts = _checks.check_layout(
            num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank, num_tokens_per_expert, num_tokens,
            self.group_size, self.device)
        topk_idx, topk_weights = _checks.check_topk_pair(topk_idx, topk_weights, num_tokens, num_experts,
                                                         num_worst_tokens, self._check_topk_idx, self.device)
        req = DispatchRequest(data, scales, topk_idx, topk_weights, per_rank, per_rdma_rank, in_rank, per_expert,
                              expert_alignment, num_worst_tokens, config)
        on_caller = self._begin(previous_event, async_finish, allocate_on_comm_stream)
        with streams.op_context(self._comm, on_caller):
            recv_x, recv_scales, recv_idx, recv_w, counts, raw_handle = backend.dispatch(req)
        # Built-in backends return a DispatchHandle; a registered one may return DeepEP's plain 6-tuple.
        out_handle = raw_handle if isinstance(raw_handle, DispatchHandle) else DispatchHandle._make(raw_handle)
        setattr(out_handle.rank_prefix_matrix, HANDLE_KEY_ATTR, self._handle_key)
        out_x = recv_x if recv_scales is None else (recv_x, recv_scales)
        event = self._finish(async_finish, [data, scales, topk_idx, topk_weights, per_rank, in_rank, per_expert],
                             [recv_x, recv_scales, recv_idx, recv_w, *out_handle], on_caller)
        return DispatchResult(out_x, recv_idx, recv_w, counts, out_handle, event)

    def combine(
        self,
        x: torch.Tensor,
        handle: tuple[Any, ...],
        topk_weights: torch.Tensor | None = None,
        bias: Union[torch.Tensor, tuple[Optional[torch.Tensor], ...], None] = None,
        config: Any = None,
        previous_event: EventOverlap | None = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> CombineResult:
        """Send rows back to the ranks their tokens came from and sum them (no weighting: pre-scale x).

        Args:
            x: [T_recv, H] bfloat16 (float16/float32 accepted by the reference backend), contiguous; row i belongs
                to received token i of the dispatch that made `handle`.
            handle: from a dispatch of this Buffer, or of another Buffer over the same ranks and backend (as
                Megatron passes a forward's handle to the Buffer that replaced it).
            topk_weights: optional [T_recv, K] float32, summed the same way (the dispatch backward pass).
            bias: None, a [T, H] tensor, or a tuple of up to two (None entries allowed), added to the result.
        Returns:
            CombineResult(combined_x [T, H] x.dtype, combined_topk_weights [T, K] float32 or None, event).
            The sum runs in float32 in rank order 0..R-1, so it is deterministic.
        Runs on the comm stream; the caller's stream waits unless async_finish=True.
        """
        plain = bias is None and config is None
        if plain:
            done = _plain_ops.combine(self, x, handle, topk_weights, Buffer.num_sms, previous_event, async_finish,
                                      allocate_on_comm_stream)
            if done is not None:  # a structure the full path below accepted before
                return done
        backend = self._live()
        _checks.check_async(async_finish, allocate_on_comm_stream)
        h = self._check_handle(handle)
        x = _checks.check_combine_x(x, h, backend.supported_combine_dtypes, self.backend_name, self.device)
        hidden_bytes = _checks.hidden_bytes(x)
        config = _checks.check_config(config, lambda: tuning.shared_config(
            tuning.preset_for(self.group_size).combine, Buffer.num_sms))
        _checks.check_buffer_size(self, hidden_bytes, config, "combine", h, x.dtype)
        topk_weights = _checks.check_combine_topk_weights(topk_weights, int(h.recv_src_idx.shape[0]), self.device)
        biases = _checks.check_bias(bias, x, int(h.is_token_in_rank.shape[0]), self.device)
        from_view = _checks.check_combine_view(self._combine_view, self._op_seq, x, h)
        # a combine from the view leaves it intact
        on_caller = self._begin(previous_event, async_finish, allocate_on_comm_stream, uses_nvl_buffer=not from_view)
        with streams.op_context(self._comm, on_caller):
            combined, combined_w = backend.combine(x, h, topk_weights, biases, config)
        event = self._finish(async_finish, [x, topk_weights, *biases], [combined, combined_w], on_caller, h)
        if plain:
            _plain_ops.remember(self, _plain_ops.combine_key(x, topk_weights, handle, Buffer.num_sms), config)
        return CombineResult(combined, combined_w, event)
