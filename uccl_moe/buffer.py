"""``uccl_moe.Buffer``: the DeepEP-V1 high-throughput (HT) expert-parallel API.

Notation: T = tokens of this rank, H = hidden, K = top-k, E = experts (all ranks), R = ranks of the group,
E_loc = E / R local experts, T_recv = rows this rank receives, C = channels (``num_sms / 2``).

Every public method validates its arguments first (``InvalidUsageError``/``InvalidTypeError``, subclasses of
``ValueError``/``TypeError``, naming the argument and the fix), then runs on the Buffer's **comm stream** with
DeepEP's stream rules:

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

import contextlib
import logging
import operator
import weakref
from collections.abc import Sequence
from typing import Any, ClassVar, Literal, NamedTuple, Optional, Union

import torch
import torch.distributed as dist

from . import env
from .backends.base import Backend, BufferContext, DispatchRequest, create_backend
from .errors import InvalidTypeError, InvalidUsageError
from .streams import CommStream
from .topology import Topology, detect
from .utils import EventHandle, EventOverlap, host_ints

try:
    from . import _C
except ImportError as _e:  # pragma: no cover - a broken install
    raise ImportError(
        f"uccl_moe._C (the native module) is missing: {_e}. Install with `pip install -e .` from the source tree"
    ) from _e

log = logging.getLogger("uccl_moe.buffer")

#: dtype of top-k expert indices (DeepEP's ``topk_idx_t``).
topk_idx_t = torch.int64
#: The DeepEP-V1 ``Config`` (native): Config(num_sms=20, num_max_nvl_chunked_send_tokens=6, ...).
Config = _C.Config

MAX_TOPK = 32
MAX_EXPERTS_PER_RANK = 1024
FP8_SCALE_BLOCK = 128
#: Attribute on a handle's first tensor: the Buffer key its layout is valid for (Buffer._handle_key).
_HANDLE_KEY_ATTR = "_uccl_moe_handle_key"
_NVL_META_BYTES = 1 << 20  # kNvlMetaBytes (native/include/uccl_moe/config.hpp): the rings start after it
_FP8_DTYPES = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n))
_ROW_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

BackendName = Literal["auto", "native", "reference"]
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


# Presets: (nvl_send, nvl_recv, rdma_send, rdma_recv); num_sms comes from Buffer.num_sms. Inside one NVLink domain
# (<= 8 ranks) dispatch uses ring 256 and chunk 8 (chunk 16 was slower for every EP2-4 case measured on 4xH200);
# at EP2, chunk 2 since the lane's direct warp releases the tails (FP8/BF16 129.0/210.4 us against 132.5/218.3 at
# chunk 4 on 2xH200; chunk 4 had beaten 8 and 2 before; EP3-4 not re-measured since). Combine takes chunk 2 at
# every size: its receiver waits for every copy of a token, so tails published early pay off; measured at EP2
# (322 us against 337 at chunk 4 and 366 at chunk 8, 4096 tokens; ring size 256-1024 changed nothing) and at EP4
# (4xH200, 24 SMs: 730-733 us against 794-901 at chunk 4 and 896-928 at chunk 8). See docs/performance.md.
# Larger groups span nodes and take the internode presets.
_INTRANODE_DISPATCH_PRESET = (8, 256, 6, 128)
_INTRANODE_COMBINE_PRESET = (2, 256, 6, 128)
_INTRANODE_DISPATCH_PRESET_BY_RANKS = {2: (2, 256, 6, 128)}
_MAX_INTRANODE_RANKS = 8
_INTERNODE_DISPATCH_PRESET = (16, 288, 16, 128)
_INTERNODE_COMBINE_PRESET = (8, 288, 8, 128)


def _as_int(v: Any) -> int | None:
    """`v` as a Python int if it is an integer of any kind (int, numpy or 0-d torch integer), else None (bools
    and floats included): DeepEP takes whatever behaves as an integer."""
    if type(v) is int:  # the common case first (bool is a subclass, not the type)
        return v
    if isinstance(v, bool) or (isinstance(v, torch.Tensor) and v.dtype == torch.bool):
        return None
    try:
        return operator.index(v)
    except TypeError:
        return None


def _int_arg(name: str, v: Any) -> int:
    """`v` as a Python int (_as_int), or InvalidTypeError naming the argument."""
    n = _as_int(v)
    if n is None:
        raise InvalidTypeError(f"{name} must be an int, got {v!r}")
    return n


def _err(msg: str) -> InvalidUsageError:
    return InvalidUsageError(msg)


def _check_tensor(
    name: str,
    t: Any,
    *,
    dtypes: Sequence[torch.dtype],
    ndim: int | Sequence[int],
    device: torch.device,
    contiguous: bool = True,
) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise InvalidTypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        want = " or ".join(str(d).replace("torch.", "") for d in dtypes)
        raise InvalidTypeError(f"{name} must have dtype {want}, got {str(t.dtype).replace('torch.', '')}")
    dim = t.dim()
    if dim != ndim and (isinstance(ndim, int) or dim not in ndim):
        dims = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        raise _err(f"{name} must be {' or '.join(f'{d}-D' for d in dims)}, got shape {tuple(t.shape)}")
    on = t.device
    if on != device and (on.type != device.type or device.index is not None):  # (a CPU Buffer has no index)
        raise _err(f"{name} is on {on} but this Buffer works on {device}; move it with .to({str(device)!r})")
    if contiguous and not t.is_contiguous():
        raise _err(f"{name} must be contiguous; call .contiguous() first")
    return t


class Buffer:
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
        # The last topk_idx whose values passed the range check: (weak reference, (version, num_experts)).
        self._topk_checked: tuple[weakref.ref[torch.Tensor], tuple[int, int]] | None = None
        if comm is not None:
            raise InvalidTypeError(
                "Buffer(comm=...) (an mpi4py communicator) is not supported; pass a torch.distributed ProcessGroup "
                "as `group`"
            )
        if group is None or not isinstance(group, dist.ProcessGroup):
            raise InvalidTypeError(
                f"group must be a torch.distributed.ProcessGroup (e.g. dist.new_group(ranks) or dist.group.WORLD), "
                f"got {type(group).__name__}; call torch.distributed.init_process_group first"
            )
        for name, value in (("num_nvl_bytes", num_nvl_bytes), ("num_rdma_bytes", num_rdma_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidTypeError(f"{name} must be a non-negative int, got {value!r}")
        if num_nvl_bytes % 128 != 0:
            raise _err(f"num_nvl_bytes={num_nvl_bytes} must be a multiple of 128 (the size hints are)")
        if low_latency_mode:
            raise NotImplementedError(
                "uccl-moe implements DeepEP's high-throughput (HT) mode only; low_latency_mode=True is not "
                "implemented yet. Construct Buffer with low_latency_mode=False and use dispatch/combine"
            )
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

        choice = backend if backend is not None else env.get("BACKEND")
        if choice not in ("auto", "native", "reference"):
            raise _err(f"backend={choice!r} is not one of 'auto', 'native', 'reference'")
        group_backend = str(dist.get_backend(group)).lower()
        uses_cuda = "nccl" in group_backend or "rccl" in group_backend
        if choice == "auto":
            choice = "native" if uses_cuda and torch.cuda.is_available() else "reference"
        if uses_cuda:
            if not torch.cuda.is_available():
                raise _err(f"the group uses {group_backend} but CUDA is not available")
            device = torch.device("cuda", torch.cuda.current_device())
        else:
            if choice == "native":
                raise _err(
                    f"backend='native' needs a NCCL process group on GPUs; this group uses {group_backend}. Use "
                    f"backend='reference' (or UCCL_MOE_BACKEND=reference) on CPU"
                )
            device = torch.device("cpu")
        self.device = device
        self.backend_name: str = choice
        # The comm stream with host-cheap joins and switches (uccl_moe/streams.py); None on CPU.
        self._comm: CommStream | None = CommStream(device) if device.type == "cuda" else None
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
        n = _as_int(new_num_sms)
        if n is None or n <= 0 or n % 2:
            raise _err(f"set_num_sms({new_num_sms!r}): the SM count must be a positive even int")
        Buffer.num_sms = n

    @staticmethod
    def capture() -> EventOverlap:
        """An :class:`EventOverlap` recorded on the current stream (pass as ``previous_event``)."""
        return EventOverlap(EventHandle())

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Any:
        """Tuned dispatch :class:`Config` for a group of `num_ranks` (any size >= 1)."""
        return Buffer._preset(num_ranks, _INTRANODE_DISPATCH_PRESET, _INTERNODE_DISPATCH_PRESET,
                              _INTRANODE_DISPATCH_PRESET_BY_RANKS)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Any:
        """Tuned combine :class:`Config` for a group of `num_ranks` (any size >= 1)."""
        return Buffer._preset(num_ranks, _INTRANODE_COMBINE_PRESET, _INTERNODE_COMBINE_PRESET)

    @staticmethod
    def _preset(num_ranks: int, intranode: tuple[int, int, int, int], internode: tuple[int, int, int, int],
                intranode_by_ranks: Optional[dict[int, tuple[int, int, int, int]]] = None) -> Any:
        n = _as_int(num_ranks)
        if n is None or n < 1:
            raise _err(f"num_ranks must be a positive int, got {num_ranks!r}")
        num_ranks = n
        if num_ranks > _MAX_INTRANODE_RANKS:
            preset = internode
        else:
            preset = (intranode_by_ranks or {}).get(num_ranks, intranode)
        nvl_send, nvl_recv, rdma_send, rdma_recv = preset
        return Config(Buffer.num_sms, nvl_send, nvl_recv, rdma_send, rdma_recv)

    @staticmethod
    def get_combine_buffer_size_hint(num_rows: int, hidden: int, num_topk: int = 0) -> int:
        """``num_nvl_bytes`` that :meth:`get_combine_buffer` needs for `num_rows` rows of `hidden` BF16 values (plus
        `num_topk` staged weights per row when combine gets ``topk_weights``): 1 MiB of meta, then the rows, then the
        weights; a multiple of 4096. Take the largest of it and the dispatch/combine configs' size hints."""
        num_rows, hidden, num_topk = _int_arg("num_rows", num_rows), _int_arg("hidden", hidden), \
            _int_arg("num_topk", num_topk)
        if num_rows < 0 or hidden <= 0 or num_topk < 0:
            raise _err(f"get_combine_buffer_size_hint({num_rows}, {hidden}, {num_topk}): need rows >= 0, hidden > 0, "
                       f"num_topk >= 0")
        rows_end = -(-(_NVL_META_BYTES + num_rows * hidden * 2) // 128) * 128
        return -(-(rows_end + num_rows * num_topk * 4) // 4096) * 4096

    @staticmethod
    def get_low_latency_rdma_size_hint(*args: Any, **kwargs: Any) -> int:
        raise NotImplementedError("low-latency mode is not implemented in uccl-moe yet (HT mode only)")

    def get_comm_stream(self) -> Any:
        """The comm stream (``torch.cuda.Stream``), or None on CPU. Every later op then waits for what the caller
        enqueues on it, also an op that runs on the caller's stream (see the module notes)."""
        if self._comm is None:
            return None
        self._comm.exposed = True
        return self._comm.stream

    def get_local_buffer_tensor(self, dtype: torch.dtype, size: Any = None, offset: int = 0,
                                use_rdma_buffer: bool = False) -> torch.Tensor:
        fn = getattr(self._live(), "get_local_buffer_tensor", None)
        if fn is None:
            raise NotImplementedError(f"the {self.backend_name} backend has no registered communication buffer")
        out: torch.Tensor = fn(dtype, size, offset, use_rdma_buffer)
        return out

    def get_combine_buffer(self, handle: tuple[Any, ...], hidden: int,
                           dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """A [T_recv, hidden] tensor to write a combine's input rows into (uccl-moe extension; DeepEP's HT API has
        none). ``combine(x=<this tensor>, handle)`` then reads each row where it lies, over NVLink, instead of
        pushing it through the rings: one NVLink load per remote row, no ring hand-offs (EP2 on 2 x H200: 1.3x the
        ring combine and faster than NCCL's all-to-all; docs/performance.md, round 13).

        The tensor is this rank's NVL buffer itself (the memory the rings use), so:
        - take it (and write it) after the dispatch that made `handle`, and call combine before any other dispatch
          or combine of this Buffer (they overwrite it; combine refuses a view taken before another call ran); the
          caller's stream waits here for any op still running on the comm stream;
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
        hidden = _int_arg("hidden", hidden)
        if hidden <= 0:
            raise _err(f"hidden={hidden}: must be positive")
        if not isinstance(dtype, torch.dtype):
            raise InvalidTypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__}")
        rows = int(h.recv_src_idx.shape[0])
        view = backend.combine_buffer(h, hidden, dtype)
        if view is None:
            self._combine_view = None
            return torch.empty((rows, hidden), dtype=dtype, device=self.device)
        # the storage's address: a view of no rows (a rank that receives nothing) has data_ptr() 0
        self._combine_view = (int(view.untyped_storage().data_ptr()), self._op_seq, weakref.ref(h[0]))
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
        hidden, num_topk = _int_arg("hidden", hidden), _int_arg("num_topk", num_topk)
        if hidden <= 0 or num_topk < 0:
            raise _err(f"combine_buffer_fits(hidden={hidden}, num_topk={num_topk}): need hidden > 0 and num_topk >= 0")
        return bool(backend.combine_buffer_fits(h, hidden, num_topk))

    def low_latency_dispatch(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("low_latency_dispatch is not implemented in uccl-moe yet (HT mode only)")

    def low_latency_combine(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("low_latency_combine is not implemented in uccl-moe yet (HT mode only)")

    def clean_low_latency_buffer(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("low-latency mode is not implemented in uccl-moe yet (HT mode only)")

    # ---------------------------------------------------------------- stream plumbing
    def _live(self) -> Backend:
        if self._backend is None:
            raise _err("this Buffer was destroyed; create a new one")
        return self._backend

    def _begin(self, previous_event: Any, async_finish: bool, allocate_on_comm_stream: bool,
               uses_nvl_buffer: bool = True) -> int | None:
        """Join the comm stream to the caller's (or `previous_event`); count the call if it writes the NVL buffer.

        Returns the caller's raw stream if the op runs there instead (synchronous, no previous_event, no
        allocate_on_comm_stream: see the module notes), else None; pass it on to _comm_context and _finish."""
        if previous_event is not None and not isinstance(previous_event, EventOverlap):
            raise InvalidTypeError(
                f"previous_event must be an EventOverlap (e.g. Buffer.capture()), got {type(previous_event).__name__}"
            )
        if uses_nvl_buffer:  # get_dispatch_layout and a combine from the view do not write it
            self._op_seq += 1
        comm = self._comm
        if comm is None:
            return None
        if previous_event is None and not async_finish and not allocate_on_comm_stream and comm.runs_on_caller():
            return comm.begin_on_caller()
        if previous_event is not None and previous_event.event is not None:
            comm.wait_event(previous_event.event)
        else:
            comm.wait_for_caller()
        return None

    def _finish(self, async_finish: bool, inputs: Sequence[Any], outputs: Sequence[Any],
                on_caller: int | None, handle: DispatchHandle | None = None) -> EventOverlap:
        """Close an op: event on the comm stream, or make the compute stream wait (DeepEP semantics).

        Each tensor is marked used by the stream it was not allocated on: outputs (allocated on the comm stream)
        by the compute stream that consumes them; with async_finish, inputs (allocated on the compute stream) by
        the comm stream that may still be reading them when the caller frees them. An op that ran on the caller's
        stream (`on_caller`, from _begin) used one stream only (its _comm_context joined the comm stream after it).
        The tensors of the `handle` a cached dispatch or a combine read count as inputs once a dispatch may have made
        them on a caller's stream (UCCL_MOE_CALLER_STREAM_OPS); on the comm stream, where they are made otherwise,
        they need no mark.
        """
        comm = self._comm
        if comm is None:
            return EventOverlap(EventHandle() if async_finish else None)
        if on_caller is not None:
            return EventOverlap(None)
        if async_finish and handle is not None and comm.ran_on_caller:
            inputs = [*inputs, *self._live().handle_tensors(handle)]
        compute = comm.caller()
        for t in _flatten(outputs):
            if t.device.type == "cuda":
                t.record_stream(compute)
        if async_finish:
            for t in _flatten(inputs):
                if t.device.type == "cuda":
                    t.record_stream(comm.stream)
            return EventOverlap(EventHandle(comm.stream))
        comm.caller_waits()
        return EventOverlap(None)

    def _comm_context(self, on_caller: int | None) -> contextlib.AbstractContextManager[Any]:
        """The comm stream is current inside (allocations and launches go to it); the caller's stream after. An op
        that runs on the caller's stream (`on_caller`, from _begin) stays there, and the comm stream waits for it
        after. (Classes, not a generator context manager: this runs on every op, and contextlib's machinery costs
        microseconds.)"""
        if self._comm is None:
            return _STAY
        if on_caller is not None:
            return _OnCallerStream(self._comm, on_caller)
        return _OnCommStream(self._comm)

    # ---------------------------------------------------------------- validation helpers
    def _check_topk_idx(self, topk_idx: Any, num_experts: int | None, name: str = "topk_idx") -> torch.Tensor:
        t = _check_tensor(name, topk_idx, dtypes=(topk_idx_t,), ndim=2, device=self.device)
        if t.shape[1] < 1 or t.shape[1] > MAX_TOPK:
            raise _err(f"{name} has {t.shape[1]} columns (top-k); supported: 1..{MAX_TOPK}")
        if num_experts is not None and t.numel() > 0 and self._check_values():
            # One device sync per routing: get_dispatch_layout and dispatch get the same tensor, and a second read
            # would drain the GPU queue again. Same object at the same version (in-place writes bump it) = checked.
            seen = self._topk_checked
            if seen is not None and seen[0]() is t and seen[1] == (t._version, num_experts):
                return t
            lo, hi = host_ints(torch.stack([t.min(), t.max()]))
            if lo < -1 or hi >= num_experts:
                bad = lo if lo < -1 else hi
                raise _err(
                    f"{name} holds expert id {bad}, outside [-1, {num_experts}); -1 marks an unused slot and ids "
                    f"must be < num_experts={num_experts}"
                )
            self._topk_checked = (weakref.ref(t), (t._version, num_experts))
        return t

    def _check_values(self) -> bool:
        """Host-side value checks cost a device sync on GPUs: skipped while capturing a CUDA graph, and when
        UCCL_MOE_CHECK_INPUTS=0 (shape, dtype and device checks always run)."""
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return False
        return bool(env.get("CHECK_INPUTS"))

    def _check_num_experts(self, num_experts: Any) -> int:
        n = _as_int(num_experts)
        if n is None or n <= 0:
            raise InvalidTypeError(f"num_experts must be a positive int, got {num_experts!r}")
        if n % self.group_size != 0:
            raise _err(
                f"num_experts={n} is not divisible by the group size {self.group_size}; every rank must hold the "
                f"same number of experts"
            )
        if n // self.group_size > MAX_EXPERTS_PER_RANK:
            raise _err(f"{n // self.group_size} experts per rank is more than the supported {MAX_EXPERTS_PER_RANK}")
        return n

    def _check_config(self, config: Any, default: Any) -> Any:
        if config is None:
            return default
        if not isinstance(config, Config):
            raise InvalidTypeError(f"config must be a uccl_moe.Config, got {type(config).__name__}")
        return config

    def _check_buffer_size(self, hidden_bytes: int, config: Any, op: str, handle: DispatchHandle | None = None) -> None:
        """Raise if `op` with `config` does not fit this Buffer's buffers. With a handle (a cached dispatch or a
        combine), the op runs on the handle's lanes: the SM count its dispatch laid them out with, not config's."""
        backend = self._live()
        per_node = self.topology.ranks_per_node
        ran_on = ""
        sms = backend.handle_num_sms(handle) if handle is not None else None
        if sms is not None and sms != config.num_sms:
            config = Config(sms, config.num_max_nvl_chunked_send_tokens, config.num_max_nvl_chunked_recv_tokens,
                            config.num_max_rdma_chunked_send_tokens, config.num_max_rdma_chunked_recv_tokens)
            ran_on = f" (num_sms={sms}: it runs on the lanes of the dispatch that made the handle)"
        need = config.get_nvl_buffer_size_hint(hidden_bytes, self.group_size, per_node)
        if need > self.num_nvl_bytes:
            raise _err(
                f"{op} with hidden_bytes={hidden_bytes} and {config}{ran_on} needs {need} bytes of NVL buffer per "
                f"rank, but the Buffer has num_nvl_bytes={self.num_nvl_bytes}; construct Buffer with num_nvl_bytes >= "
                f"{need} (config.get_nvl_buffer_size_hint(hidden_bytes, {self.group_size}))"
            )
        if self.topology.num_nodes > 1:
            need = backend.required_rdma_bytes(config, hidden_bytes, self.group_size, per_node)
            if need > self.num_rdma_bytes:
                raise _err(
                    f"{op} across {self.topology.num_nodes} nodes with hidden_bytes={hidden_bytes} needs {need} bytes "
                    f"of RDMA buffer per rank, but the Buffer has num_rdma_bytes={self.num_rdma_bytes}; construct "
                    f"Buffer with num_rdma_bytes >= {need} (config.get_rdma_buffer_size_hint(hidden_bytes, "
                    f"{self.group_size}))"
                )

    def _check_handle(self, handle: Any) -> DispatchHandle:
        if not isinstance(handle, tuple) or len(handle) != 6 or not isinstance(handle[0], torch.Tensor):
            raise InvalidTypeError(
                f"handle must be the 6-tuple a dispatch returned, got {type(handle).__name__}"
            )
        key = getattr(handle[0], _HANDLE_KEY_ATTR, None)
        if key is None:
            raise _err(
                "handle was not returned by a uccl_moe Buffer's dispatch (a rebuilt or cloned handle loses its tag); "
                "pass the handle the dispatch returned"
            )
        if key != self._handle_key:
            raise _err(
                f"handle was made by a Buffer over another group or backend ({key[0]}, ranks {list(key[1])}) than "
                f"this one ({self._handle_key[0]}, ranks {list(self._handle_key[1])}); pass a handle from a dispatch "
                f"on a Buffer over the same ranks"
            )
        return handle if isinstance(handle, DispatchHandle) else DispatchHandle(*handle)

    def _split_x(self, x: Any, name: str = "x") -> tuple[torch.Tensor, torch.Tensor | None]:
        if isinstance(x, tuple):
            if len(x) != 2:
                raise InvalidTypeError(
                    f"{name} as a tuple must be (x_fp8 [T, H], x_scales [T, H/128]), got {len(x)} items"
                )
            data = _check_tensor(f"{name}[0]", x[0], dtypes=_FP8_DTYPES, ndim=2, device=self.device)
            scales = _check_tensor(f"{name}[1] (scales)", x[1], dtypes=(torch.float32, torch.int32), ndim=(1, 2),
                                   device=self.device, contiguous=False)
            if scales.shape[0] != data.shape[0]:
                raise _err(f"{name} scales have {scales.shape[0]} rows but {name} has {data.shape[0]} tokens")
            if scales.dim() == 2:
                block = FP8_SCALE_BLOCK if scales.dtype == torch.float32 else FP8_SCALE_BLOCK * 4
                want = -(-data.shape[1] // block)
                if scales.shape[1] != want:
                    kind = "float32 scales (one per 128 channels)" if scales.dtype == torch.float32 else \
                        "int32 packed UE8M0 scales (four per int, one per 128 channels)"
                    raise _err(
                        f"{name} scales have shape {tuple(scales.shape)}; {kind} for hidden={data.shape[1]} must be "
                        f"[{data.shape[0]}, {want}]"
                    )
            return data, scales
        data = _check_tensor(name, x, dtypes=_ROW_DTYPES + _FP8_DTYPES, ndim=2, device=self.device)
        if data.dtype in _FP8_DTYPES:
            raise InvalidTypeError(f"FP8 {name} must come with its scales: pass ({name}_fp8, {name}_scales)")
        return data, None

    @staticmethod
    def _hidden_bytes(x: torch.Tensor) -> int:
        hidden_bytes = x.shape[1] * max(x.element_size(), 2)
        if (x.shape[1] * x.element_size()) % 16 != 0:
            raise _err(
                f"a row of x is {x.shape[1] * x.element_size()} bytes (hidden={x.shape[1]}, {x.dtype}); rows must be "
                f"a multiple of 16 bytes"
            )
        return hidden_bytes

    def _check_async(self, async_finish: bool, allocate_on_comm_stream: bool) -> None:
        for name, v in (("async_finish", async_finish), ("allocate_on_comm_stream", allocate_on_comm_stream)):
            if not isinstance(v, bool):
                raise InvalidTypeError(f"{name} must be a bool, got {v!r}")

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
        num_experts = self._check_num_experts(num_experts)
        self._check_async(async_finish, allocate_on_comm_stream)
        topk_idx = self._check_topk_idx(topk_idx, num_experts)
        on_caller = self._begin(previous_event, async_finish, allocate_on_comm_stream, uses_nvl_buffer=False)
        with self._comm_context(on_caller):
            out = backend.get_dispatch_layout(topk_idx, num_experts)
        event = self._finish(async_finish, [topk_idx], out, on_caller)
        return LayoutResult(*out, event)

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
            config: a :class:`Config`; default ``get_dispatch_config(R)``.
        Returns:
            DispatchResult(recv_x [T_recv, H] (tuple for FP8), recv_topk_idx [T_recv, K] int64 local expert ids in
            [0, E_loc) or -1, recv_topk_weights [T_recv, K] float32 (0 where idx is -1),
            num_recv_tokens_per_expert_list list[int], handle, event). Cached: (recv_x, None, None, None, None, event).
        Runs on the comm stream; the caller's stream waits unless async_finish=True.
        """
        backend = self._live()
        self._check_async(async_finish, allocate_on_comm_stream)
        data, scales = self._split_x(x)
        if data.dtype not in backend.supported_dispatch_dtypes:
            raise InvalidTypeError(f"the {self.backend_name} backend cannot dispatch {data.dtype}")
        hidden_bytes = self._hidden_bytes(data)
        config = self._check_config(config, Buffer.get_dispatch_config(self.group_size))
        h = self._check_handle(handle) if handle is not None else None
        if h is None:  # a cached dispatch (and combine) runs on the handle's lanes, whatever config.num_sms says
            backend.check_config(config)
        self._check_buffer_size(hidden_bytes, config, "dispatch", h)
        expert_alignment = _int_arg("expert_alignment", expert_alignment)
        num_worst_tokens = _int_arg("num_worst_tokens", num_worst_tokens)
        if expert_alignment < 1:
            raise _err(f"expert_alignment={expert_alignment} must be >= 1")
        if num_worst_tokens < 0:
            raise _err(f"num_worst_tokens={num_worst_tokens} must be >= 0")
        num_tokens = data.shape[0]

        if h is not None:
            if topk_idx is not None or topk_weights is not None:
                raise _err("a cached dispatch (handle=...) reuses the layout: pass topk_idx=None and topk_weights=None")
            if num_tokens != h.is_token_in_rank.shape[0]:
                raise _err(
                    f"x has {num_tokens} tokens but the handle was made for {h.is_token_in_rank.shape[0]}; a cached "
                    f"dispatch must send the same tokens"
                )
            on_caller = self._begin(previous_event, async_finish, allocate_on_comm_stream)
            with self._comm_context(on_caller):
                recv_x, recv_scales = backend.cached_dispatch(data, scales, h, config)
            out_x: TensorOrFp8 = recv_x if recv_scales is None else (recv_x, recv_scales)
            event = self._finish(async_finish, [data, scales], [recv_x, recv_scales], on_caller, h)
            return DispatchResult(out_x, None, None, None, None, event)

        missing = [n for n, v in (("num_tokens_per_rank", num_tokens_per_rank), ("is_token_in_rank", is_token_in_rank),
                                  ("num_tokens_per_expert", num_tokens_per_expert)) if v is None]
        if missing:
            raise _err(
                f"dispatch without handle needs the layout: {', '.join(missing)} missing; pass what "
                f"get_dispatch_layout(topk_idx, num_experts) returned (or handle= for a cached dispatch)"
            )
        R = self.group_size
        num_tokens_per_rank = _check_tensor("num_tokens_per_rank", num_tokens_per_rank, dtypes=(torch.int32,),
                                            ndim=1, device=self.device)
        if num_tokens_per_rank.shape[0] != R:
            raise _err(
                f"num_tokens_per_rank has {num_tokens_per_rank.shape[0]} entries but the group has {R} ranks; the "
                f"layout was computed for another group"
            )
        is_token_in_rank = _check_tensor("is_token_in_rank", is_token_in_rank, dtypes=(torch.bool,), ndim=2,
                                         device=self.device)
        if tuple(is_token_in_rank.shape) != (num_tokens, R):
            raise _err(
                f"is_token_in_rank has shape {tuple(is_token_in_rank.shape)}, expected [{num_tokens}, {R}] (tokens, "
                f"ranks of the group)"
            )
        num_tokens_per_expert = _check_tensor("num_tokens_per_expert", num_tokens_per_expert, dtypes=(torch.int32,),
                                              ndim=1, device=self.device)
        num_experts = self._check_num_experts(int(num_tokens_per_expert.shape[0]))
        if num_tokens_per_rdma_rank is not None:
            num_tokens_per_rdma_rank = _check_tensor("num_tokens_per_rdma_rank", num_tokens_per_rdma_rank,
                                                     dtypes=(torch.int32,), ndim=1, device=self.device)
        if (topk_idx is None) != (topk_weights is None):
            raise _err("topk_idx and topk_weights must be given together (or both None)")
        if topk_idx is not None:
            topk_idx = self._check_topk_idx(topk_idx, num_experts)
            topk_weights = _check_tensor("topk_weights", topk_weights, dtypes=(torch.float32,), ndim=2,
                                         device=self.device)
            if topk_idx.shape[0] != num_tokens or topk_weights.shape != topk_idx.shape:
                raise _err(
                    f"topk_idx {tuple(topk_idx.shape)} and topk_weights {tuple(topk_weights.shape)} must both be "
                    f"[{num_tokens}, K] (one row per token of x)"
                )
        elif num_worst_tokens > 0:
            raise _err("num_worst_tokens > 0 needs topk_idx/topk_weights (padding rows are marked by topk_idx == -1)")
        req = DispatchRequest(data, scales, topk_idx, topk_weights, num_tokens_per_rank, num_tokens_per_rdma_rank,
                              is_token_in_rank, num_tokens_per_expert, expert_alignment, num_worst_tokens, config)
        on_caller = self._begin(previous_event, async_finish, allocate_on_comm_stream)
        with self._comm_context(on_caller):
            recv_x, recv_scales, recv_idx, recv_w, counts, raw_handle = backend.dispatch(req)
        out_handle = DispatchHandle(*raw_handle)
        setattr(out_handle[0], _HANDLE_KEY_ATTR, self._handle_key)
        out_x = recv_x if recv_scales is None else (recv_x, recv_scales)
        event = self._finish(async_finish,
                             [data, scales, topk_idx, topk_weights, num_tokens_per_rank, is_token_in_rank,
                              num_tokens_per_expert],
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
        backend = self._live()
        self._check_async(async_finish, allocate_on_comm_stream)
        h = self._check_handle(handle)
        x = _check_tensor("x", x, dtypes=_ROW_DTYPES, ndim=2, device=self.device)
        if x.dtype not in backend.supported_combine_dtypes:
            want = ", ".join(str(d).replace("torch.", "") for d in backend.supported_combine_dtypes)
            raise InvalidTypeError(f"the {self.backend_name} backend combines {want}, got {x.dtype}")
        num_rows = h.recv_src_idx.shape[0]
        if x.shape[0] != num_rows:
            raise _err(
                f"x has {x.shape[0]} rows but the dispatch that made this handle received {num_rows}; combine takes "
                f"one row per received token, in recv order"
            )
        hidden_bytes = self._hidden_bytes(x)
        config = self._check_config(config, Buffer.get_combine_config(self.group_size))
        self._check_buffer_size(hidden_bytes, config, "combine", h)
        num_tokens = h.is_token_in_rank.shape[0]
        if topk_weights is not None:
            topk_weights = _check_tensor("topk_weights", topk_weights, dtypes=(torch.float32,), ndim=2,
                                         device=self.device)
            if topk_weights.shape[0] != num_rows or topk_weights.shape[1] > MAX_TOPK:
                raise _err(f"topk_weights has shape {tuple(topk_weights.shape)}, expected [{num_rows}, K<={MAX_TOPK}]")
        biases: list[torch.Tensor | None]
        if bias is None:
            biases = [None, None]
        elif isinstance(bias, torch.Tensor):
            biases = [bias, None]
        elif isinstance(bias, tuple) and len(bias) <= 2:
            biases = list(bias) + [None] * (2 - len(bias))
        else:
            raise InvalidTypeError("bias must be None, a tensor, or a tuple of at most two tensors")
        for i, b in enumerate(biases):
            if b is not None:
                _check_tensor(f"bias[{i}]", b, dtypes=(x.dtype,), ndim=2, device=self.device)
                if tuple(b.shape) != (num_tokens, x.shape[1]):
                    raise _err(f"bias[{i}] has shape {tuple(b.shape)}, expected [{num_tokens}, {x.shape[1]}] (T, H)")
        view = self._combine_view
        from_view = view is not None and x.untyped_storage().data_ptr() == view[0]
        if from_view and view is not None and view[1] != self._op_seq:
            raise _err(
                f"combine: x is the tensor get_combine_buffer returned, but {self._op_seq - view[1]} dispatch/combine "
                f"call(s) of this Buffer ran since and overwrote it; call get_combine_buffer again after the last "
                f"dispatch or combine and write the rows into that, right before this combine"
            )
        if from_view and view is not None and view[2]() is not h[0]:
            raise _err(
                "combine: x is the tensor get_combine_buffer returned, but it was last taken for another handle (the "
                "views of all handles are the same memory, so it holds that handle's rows); call "
                "get_combine_buffer(handle) for this combine's handle and write its rows into that"
            )
        # a combine from the view leaves it intact
        on_caller = self._begin(previous_event, async_finish, allocate_on_comm_stream, uses_nvl_buffer=not from_view)
        with self._comm_context(on_caller):
            combined, combined_w = backend.combine(x, h, topk_weights, (biases[0], biases[1]), config)
        event = self._finish(async_finish, [x, topk_weights, *biases], [combined, combined_w], on_caller, h)
        return CombineResult(combined, combined_w, event)


class _OnCommStream:
    """``with _OnCommStream(comm):`` makes the comm stream current inside and restores the caller's stream after."""

    __slots__ = ("comm", "token")

    def __init__(self, comm: CommStream) -> None:
        self.comm = comm

    def __enter__(self) -> None:
        self.token = self.comm.enter()

    def __exit__(self, *exc: Any) -> None:
        self.comm.leave(self.token)


class _OnCallerStream:
    """``with _OnCallerStream(comm, caller):`` around an op on the caller's stream: the comm stream waits for what it
    enqueued there after, also when the op raises (later ops on the comm stream must not overlap it)."""

    __slots__ = ("comm", "caller")

    def __init__(self, comm: CommStream, caller: int) -> None:
        self.comm, self.caller = comm, caller

    def __enter__(self) -> None:
        pass

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if exc_type is None:
            self.comm.end_on_caller(self.caller)
            return
        try:
            self.comm.end_on_caller(self.caller)
        except Exception as e:  # noqa: BLE001 - e.g. a context a trapped kernel broke: the op's error is the news
            log.debug("joining the comm stream after a failed op failed too: %s", e)


_STAY = contextlib.nullcontext()  # an op that stays on the current stream (reusable: it holds no state)


def _flatten(items: Sequence[Any]) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for t in items:
        if isinstance(t, torch.Tensor):
            out.append(t)
        elif isinstance(t, (tuple, list)):
            out.extend(_flatten(t))
    return out
