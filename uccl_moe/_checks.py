"""Argument checks of :class:`uccl_moe.Buffer`: each raises ``InvalidTypeError``/``InvalidUsageError`` naming the
argument and the fix, before any backend runs (``backends/base.py``, division of labour).

Notation: T = tokens of this rank, H = hidden, K = top-k, E = experts (all ranks), R = ranks of the group,
T_recv = rows this rank receives.
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from . import _C, env
from .errors import InvalidTypeError, InvalidUsageError
from .results import DispatchHandle
from .utils import EventOverlap, RoutingMemo, host_ints

#: dtype of top-k expert indices (DeepEP's ``topk_idx_t``).
topk_idx_t = torch.int64
MAX_TOPK = 32
MAX_EXPERTS_PER_RANK = 1024
FP8_SCALE_BLOCK = 128
#: Attribute on a handle's first tensor: the Buffer key its layout is valid for (Buffer._handle_key).
HANDLE_KEY_ATTR = "_uccl_moe_handle_key"
FP8_DTYPES = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n))
ROW_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
BACKEND_CHOICES = ("auto", "native", "reference")


def as_int(v: Any) -> int | None:
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


def int_arg(name: str, v: Any) -> int:
    """`v` as a Python int (as_int), or InvalidTypeError naming the argument."""
    n = as_int(v)
    if n is None:
        raise InvalidTypeError(f"{name} must be an int, got {v!r}")
    return n


def err(msg: str) -> InvalidUsageError:
    return InvalidUsageError(msg)


def check_tensor(
    name: str,
    t: Any,
    *,
    dtypes: Sequence[torch.dtype],
    ndim: int | Sequence[int],
    device: torch.device,
    contiguous: bool = True,
) -> torch.Tensor:
    """`t` if it is a tensor of one of `dtypes`, with `ndim` dimensions (one of them), on `device`, contiguous."""
    if not isinstance(t, torch.Tensor):
        raise InvalidTypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        want = " or ".join(str(d).replace("torch.", "") for d in dtypes)
        raise InvalidTypeError(f"{name} must have dtype {want}, got {str(t.dtype).replace('torch.', '')}")
    dim = t.dim()
    if dim != ndim and (isinstance(ndim, int) or dim not in ndim):
        dims = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        raise err(f"{name} must be {' or '.join(f'{d}-D' for d in dims)}, got shape {tuple(t.shape)}")
    on = t.device
    if on != device and (on.type != device.type or device.index is not None):  # (a CPU Buffer has no index)
        raise err(f"{name} is on {on} but this Buffer works on {device}; move it with .to({str(device)!r})")
    if contiguous and not t.is_contiguous():
        raise err(f"{name} must be contiguous; call .contiguous() first")
    return t


# ---------------------------------------------------------------- construction
def check_buffer_args(comm: Any, group: Any, num_nvl_bytes: Any, num_rdma_bytes: Any, low_latency_mode: bool) -> None:
    """The Buffer constructor's arguments, in the order DeepEP users meet them."""
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
        raise err(f"num_nvl_bytes={num_nvl_bytes} must be a multiple of 128 (the size hints are)")
    if low_latency_mode:
        raise NotImplementedError(
            "uccl-moe implements DeepEP's high-throughput (HT) mode only; low_latency_mode=True is not "
            "implemented yet. Construct Buffer with low_latency_mode=False and use dispatch/combine"
        )


def nvl_bytes_with_floor(num_nvl_bytes: int) -> int:
    """`num_nvl_bytes` raised to ``UCCL_MOE_NVL_BYTES_MIN`` where the Buffer has an NVL buffer at all (> 0): for
    Buffers that a framework sizes by the configs' hints alone."""
    floor = int(env.get("NVL_BYTES_MIN"))
    if floor % 128 != 0:
        raise err(f"UCCL_MOE_NVL_BYTES_MIN={floor} must be a multiple of 128 (the size hints are)")
    return num_nvl_bytes if num_nvl_bytes == 0 else max(num_nvl_bytes, floor)


def choose_backend(backend: str | None, group: Any) -> tuple[str, torch.device]:
    """(backend name, device) for a Buffer over `group`: `backend`, else ``UCCL_MOE_BACKEND``; ``auto`` takes the
    native kernels on CUDA groups and the reference backend otherwise."""
    choice = backend if backend is not None else env.get("BACKEND")
    if choice not in BACKEND_CHOICES:
        raise err(f"backend={choice!r} is not one of 'auto', 'native', 'reference'")
    group_backend = str(dist.get_backend(group)).lower()
    uses_cuda = "nccl" in group_backend or "rccl" in group_backend
    if choice == "auto":
        choice = "native" if uses_cuda and torch.cuda.is_available() else "reference"
    if uses_cuda:
        if not torch.cuda.is_available():
            raise err(f"the group uses {group_backend} but CUDA is not available")
        return str(choice), torch.device("cuda", torch.cuda.current_device())
    if choice == "native":
        raise err(
            f"backend='native' needs a NCCL process group on GPUs; this group uses {group_backend}. Use "
            f"backend='reference' (or UCCL_MOE_BACKEND=reference) on CPU"
        )
    return str(choice), torch.device("cpu")


def check_staging_args(max_tokens: Any, hidden: Any, num_topk: Any, num_nodes: Any,
                       num_scales: Any) -> tuple[int, int, int, int, int]:
    """The arguments of ``Buffer.get_internode_rdma_size_hint`` as ints: hidden and num_nodes > 0, the rest >= 0."""
    names = ("max_tokens", "hidden", "num_topk", "num_nodes", "num_scales")
    args = {n: int_arg(n, v) for n, v in zip(names, (max_tokens, hidden, num_topk, num_nodes, num_scales))}
    if args["hidden"] <= 0 or args["num_nodes"] <= 0 or min(args.values()) < 0:
        raise err(f"get_internode_rdma_size_hint({args}): need hidden > 0, num_nodes > 0 and the rest >= 0")
    return args["max_tokens"], args["hidden"], args["num_topk"], args["num_nodes"], args["num_scales"]


# ---------------------------------------------------------------- shared by the ops
def check_async(async_finish: Any, allocate_on_comm_stream: Any) -> None:
    if type(async_finish) is bool and type(allocate_on_comm_stream) is bool:  # (bool has no subclasses)
        return
    for name, v in (("async_finish", async_finish), ("allocate_on_comm_stream", allocate_on_comm_stream)):
        if not isinstance(v, bool):
            raise InvalidTypeError(f"{name} must be a bool, got {v!r}")


def check_previous_event(previous_event: Any) -> None:
    if previous_event is not None and not isinstance(previous_event, EventOverlap):
        raise InvalidTypeError(
            f"previous_event must be an EventOverlap (e.g. Buffer.capture()), got {type(previous_event).__name__}"
        )


def topk_checks_on() -> bool:
    """UCCL_MOE_CHECK_INPUTS: whether topk_idx value ranges are checked (on the device or on the host)."""
    return bool(env.get("CHECK_INPUTS"))


def value_checks_on(device: torch.device, on_device: bool = False) -> bool:
    """Whether the host checks topk_idx values. Off where the backend's kernels check them (`on_device`: the native
    backend records a bad id on the GPU and raises without a device sync), while capturing a CUDA graph (a host
    check costs a device sync on GPUs), and when UCCL_MOE_CHECK_INPUTS=0 (shape, dtype and device checks always
    run)."""
    if on_device or not topk_checks_on():
        return False
    return not (device.type == "cuda" and torch.cuda.is_current_stream_capturing())


class TopkIdxCheck:
    """Checks top-k indices, reading their range from the device once per routing: get_dispatch_layout and dispatch
    get the same tensor, and a second read would drain the GPU queue again. Same object at the same version
    (in-place writes bump it) and expert count = checked."""

    __slots__ = ("_passed", "on_device")

    def __init__(self) -> None:
        self._passed = RoutingMemo()  # the last tensor whose values passed the range check
        # The backend's kernels check the values (Backend.checks_topk_idx_on_device): no host check then.
        self.on_device = False

    def __call__(self, topk_idx: Any, num_experts: int | None, device: torch.device,
                 name: str = "topk_idx") -> torch.Tensor:
        t = check_tensor(name, topk_idx, dtypes=(topk_idx_t,), ndim=2, device=device)
        if t.shape[1] < 1 or t.shape[1] > MAX_TOPK:
            raise err(f"{name} has {t.shape[1]} columns (top-k); supported: 1..{MAX_TOPK}")
        if num_experts is not None and t.numel() > 0 and value_checks_on(device, self.on_device):
            if self._passed.holds(t, num_experts):
                return t
            lo, hi = host_ints(torch.stack([t.min(), t.max()]))
            if lo < -1 or hi >= num_experts:
                bad = lo if lo < -1 else hi
                raise err(
                    f"{name} holds expert id {bad}, outside [-1, {num_experts}); -1 marks an unused slot and ids "
                    f"must be < num_experts={num_experts}"
                )
            self._passed.remember(t, num_experts)
        return t


def check_num_experts(num_experts: Any, group_size: int) -> int:
    n = as_int(num_experts)
    if n is None or n <= 0:
        raise InvalidTypeError(f"num_experts must be a positive int, got {num_experts!r}")
    if n % group_size != 0:
        raise err(
            f"num_experts={n} is not divisible by the group size {group_size}; every rank must hold the "
            f"same number of experts"
        )
    if n // group_size > MAX_EXPERTS_PER_RANK:
        raise err(f"{n // group_size} experts per rank is more than the supported {MAX_EXPERTS_PER_RANK}")
    return n


def check_config(config: Any, default: Callable[[], Any]) -> Any:
    """`config`, or ``default()`` when it is None (built only then: Megatron passes none on every call)."""
    if config is None:
        return default()
    if not isinstance(config, _C.Config):
        raise InvalidTypeError(f"config must be a uccl_moe.Config, got {type(config).__name__}")
    return config


def check_buffer_size(buf: Any, hidden_bytes: int, config: Any, op: str, handle: DispatchHandle | None = None,
                      rows_dtype: torch.dtype | None = None) -> None:
    """Raise if `op` with `config` does not fit the buffers of `buf` (a live Buffer). With a handle (a cached dispatch
    or a combine), the op runs on the handle's lanes: the SM count its dispatch laid them out with, not config's.
    `rows_dtype`: the rows' dtype, named in the error where it is wider than 2 bytes (an upcast the caller may not
    have meant)."""
    backend = buf._live()
    sms = backend.handle_num_sms(handle) if handle is not None else None
    # What the answer depends on (a Config is read-only, the topology fixed at construction); the Buffer keeps the
    # keys that passed, so an op with the same config and rows (a preset: one shared object) pays a set lookup.
    key = (backend, config, hidden_bytes, sms, buf.num_nvl_bytes, buf.num_rdma_bytes, buf.group_size)
    fits = buf._fits
    if key in fits:
        return
    per_node = buf.topology.ranks_per_node
    ran_on = ""
    if sms is not None and sms != config.num_sms:
        config = _C.Config(
            num_sms=sms,
            num_max_nvl_chunked_send_tokens=config.num_max_nvl_chunked_send_tokens,
            num_max_nvl_chunked_recv_tokens=config.num_max_nvl_chunked_recv_tokens,
            num_max_rdma_chunked_send_tokens=config.num_max_rdma_chunked_send_tokens,
            num_max_rdma_chunked_recv_tokens=config.num_max_rdma_chunked_recv_tokens,
        )
        ran_on = f" (num_sms={sms}: it runs on the lanes of the dispatch that made the handle)"
    need = config.get_nvl_buffer_size_hint(hidden_bytes, buf.group_size, per_node)
    if need > buf.num_nvl_bytes:
        wide = ""
        if rows_dtype is not None and rows_dtype.itemsize > 2:
            wide = (f"; x is {str(rows_dtype).replace('torch.', '')} ({rows_dtype.itemsize} bytes per value): if that "
                    f"was not meant, cast it to bfloat16, whose rows take half the room")
        raise err(
            f"{op} with hidden_bytes={hidden_bytes} and {config}{ran_on} needs {need} bytes of NVL buffer per "
            f"rank, but the Buffer has num_nvl_bytes={buf.num_nvl_bytes}; construct Buffer with num_nvl_bytes >= "
            f"{need} (config.get_nvl_buffer_size_hint(hidden_bytes, {buf.group_size})){wide}"
        )
    if buf.topology.num_nodes > 1:
        need = backend.required_rdma_bytes(config, hidden_bytes, buf.group_size, per_node)
        if need > buf.num_rdma_bytes:
            raise err(
                f"{op} across {buf.topology.num_nodes} nodes with hidden_bytes={hidden_bytes} needs {need} bytes "
                f"of RDMA buffer per rank, but the Buffer has num_rdma_bytes={buf.num_rdma_bytes}; construct "
                f"Buffer with num_rdma_bytes >= {need} (config.get_rdma_buffer_size_hint(hidden_bytes, "
                f"{buf.group_size}))"
            )
    if len(fits) >= 16:
        fits.clear()
    fits.add(key)


def check_handle(handle: Any, key: Any) -> DispatchHandle:
    """`handle` as a DispatchHandle if a dispatch on a Buffer with handle key `key` made it."""
    # (handle_field's DeepEP order, read directly: this runs on every cached dispatch and combine)
    rank_prefix = handle[0] if isinstance(handle, tuple) and len(handle) == 6 else None
    if not isinstance(rank_prefix, torch.Tensor):
        raise InvalidTypeError(
            f"handle must be the 6-tuple a dispatch returned, got {type(handle).__name__}"
        )
    got = getattr(rank_prefix, HANDLE_KEY_ATTR, None)
    if got is None:
        raise err(
            "handle was not returned by a uccl_moe Buffer's dispatch (a rebuilt or cloned handle loses its tag); "
            "pass the handle the dispatch returned"
        )
    if got != key:
        raise err(
            f"handle was made by a Buffer over another group or backend ({got[0]}, ranks {list(got[1])}) than "
            f"this one ({key[0]}, ranks {list(key[1])}); pass a handle from a dispatch "
            f"on a Buffer over the same ranks"
        )
    return handle if isinstance(handle, DispatchHandle) else DispatchHandle(*handle)


def split_x(x: Any, device: torch.device, name: str = "x") -> tuple[torch.Tensor, torch.Tensor | None]:
    """(data, scales) of a dispatch's `x`: a [T, H] tensor, or an FP8 (x_fp8, x_scales) pair."""
    if isinstance(x, tuple):
        if len(x) != 2:
            raise InvalidTypeError(
                f"{name} as a tuple must be (x_fp8 [T, H], x_scales [T, H/128]), got {len(x)} items"
            )
        data = check_tensor(f"{name}[0]", x[0], dtypes=FP8_DTYPES, ndim=2, device=device)
        scales = check_tensor(f"{name}[1] (scales)", x[1], dtypes=(torch.float32, torch.int32), ndim=(1, 2),
                              device=device, contiguous=False)
        if scales.shape[0] != data.shape[0]:
            raise err(f"{name} scales have {scales.shape[0]} rows but {name} has {data.shape[0]} tokens")
        if scales.dim() == 2:
            block = FP8_SCALE_BLOCK if scales.dtype == torch.float32 else FP8_SCALE_BLOCK * 4
            want = -(-data.shape[1] // block)
            if scales.shape[1] != want:
                kind = "float32 scales (one per 128 channels)" if scales.dtype == torch.float32 else \
                    "int32 packed UE8M0 scales (four per int, one per 128 channels)"
                raise err(
                    f"{name} scales have shape {tuple(scales.shape)}; {kind} for hidden={data.shape[1]} must be "
                    f"[{data.shape[0]}, {want}]"
                )
        return data, scales
    data = check_tensor(name, x, dtypes=ROW_DTYPES + FP8_DTYPES, ndim=2, device=device)
    if data.dtype in FP8_DTYPES:
        raise InvalidTypeError(f"FP8 {name} must come with its scales: pass ({name}_fp8, {name}_scales)")
    return data, None


def hidden_bytes(x: torch.Tensor) -> int:
    """Bytes of one row as the size hints count them (``H * max(element_size, 2)``); rows must be 16-byte multiples."""
    hidden, size = x.shape[1], x.element_size()
    if (hidden * size) % 16 != 0:
        raise err(
            f"a row of x is {hidden * size} bytes (hidden={hidden}, {x.dtype}); rows must be "
            f"a multiple of 16 bytes"
        )
    return hidden * (size if size > 2 else 2)


# ---------------------------------------------------------------- dispatch
def check_dispatch_counts(expert_alignment: Any, num_worst_tokens: Any) -> tuple[int, int]:
    if type(expert_alignment) is int and type(num_worst_tokens) is int and expert_alignment >= 1 \
            and num_worst_tokens >= 0:  # the usual plain ints, as int_arg would return them
        return expert_alignment, num_worst_tokens
    expert_alignment = int_arg("expert_alignment", expert_alignment)
    num_worst_tokens = int_arg("num_worst_tokens", num_worst_tokens)
    if expert_alignment < 1:
        raise err(f"expert_alignment={expert_alignment} must be >= 1")
    if num_worst_tokens < 0:
        raise err(f"num_worst_tokens={num_worst_tokens} must be >= 0")
    return expert_alignment, num_worst_tokens


def check_cached_dispatch(h: DispatchHandle, num_tokens: int, topk_idx: Any, topk_weights: Any) -> None:
    if topk_idx is not None or topk_weights is not None:
        raise err("a cached dispatch (handle=...) reuses the layout: pass topk_idx=None and topk_weights=None")
    if num_tokens != h.is_token_in_rank.shape[0]:
        raise err(
            f"x has {num_tokens} tokens but the handle was made for {h.is_token_in_rank.shape[0]}; a cached "
            f"dispatch must send the same tokens"
        )


def check_layout(num_tokens_per_rank: Any, num_tokens_per_rdma_rank: Any, is_token_in_rank: Any,
                 num_tokens_per_expert: Any, num_tokens: int, group_size: int,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, int]:
    """The layout a non-cached dispatch takes (get_dispatch_layout's): the four tensors and E."""
    if num_tokens_per_rank is None or is_token_in_rank is None or num_tokens_per_expert is None:
        missing = [n for n, v in (("num_tokens_per_rank", num_tokens_per_rank), ("is_token_in_rank", is_token_in_rank),
                                  ("num_tokens_per_expert", num_tokens_per_expert)) if v is None]
        raise err(
            f"dispatch without handle needs the layout: {', '.join(missing)} missing; pass what "
            f"get_dispatch_layout(topk_idx, num_experts) returned (or handle= for a cached dispatch)"
        )
    R = group_size
    per_rank = check_tensor("num_tokens_per_rank", num_tokens_per_rank, dtypes=(torch.int32,), ndim=1, device=device)
    if per_rank.shape[0] != R:
        raise err(
            f"num_tokens_per_rank has {per_rank.shape[0]} entries but the group has {R} ranks; the "
            f"layout was computed for another group"
        )
    in_rank = check_tensor("is_token_in_rank", is_token_in_rank, dtypes=(torch.bool,), ndim=2, device=device)
    if in_rank.shape[0] != num_tokens and in_rank.shape[1] == R:
        raise err(
            f"x has {num_tokens} tokens but is_token_in_rank has {in_rank.shape[0]} rows: pass x, topk_idx and the "
            f"layout (get_dispatch_layout of that topk_idx) of the same tokens"
        )
    if tuple(in_rank.shape) != (num_tokens, R):
        raise err(
            f"is_token_in_rank has shape {tuple(in_rank.shape)}, expected [{num_tokens}, {R}] (tokens, "
            f"ranks of the group)"
        )
    per_expert = check_tensor("num_tokens_per_expert", num_tokens_per_expert, dtypes=(torch.int32,), ndim=1,
                              device=device)
    num_experts = check_num_experts(int(per_expert.shape[0]), group_size)
    per_rdma_rank = None
    if num_tokens_per_rdma_rank is not None:
        per_rdma_rank = check_tensor("num_tokens_per_rdma_rank", num_tokens_per_rdma_rank, dtypes=(torch.int32,),
                                     ndim=1, device=device)
    return per_rank, per_rdma_rank, in_rank, per_expert, num_experts


def check_topk_pair(topk_idx: Any, topk_weights: Any, num_tokens: int, num_experts: int, num_worst_tokens: int,
                    check_idx: TopkIdxCheck, device: torch.device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """A non-cached dispatch's topk_idx [T, K] int64 and topk_weights [T, K] float32: both, or neither."""
    if (topk_idx is None) != (topk_weights is None):
        raise err("topk_idx and topk_weights must be given together (or both None)")
    if topk_idx is None:
        if num_worst_tokens > 0:
            raise err("num_worst_tokens > 0 needs topk_idx/topk_weights (padding rows are marked by topk_idx == -1)")
        return None, None
    idx = check_idx(topk_idx, num_experts, device)
    weights = check_tensor("topk_weights", topk_weights, dtypes=(torch.float32,), ndim=2, device=device)
    if idx.shape[0] != num_tokens or weights.shape != idx.shape:
        raise err(
            f"topk_idx {tuple(idx.shape)} and topk_weights {tuple(weights.shape)} must both be "
            f"[{num_tokens}, K] (one row per token of x)"
        )
    return idx, weights


# ---------------------------------------------------------------- combine
def check_combine_x(x: Any, h: DispatchHandle, supported: Sequence[torch.dtype], backend_name: str,
                    device: torch.device) -> torch.Tensor:
    """A combine's x: [T_recv, H], one row per token the dispatch that made `h` received."""
    rows = check_tensor("x", x, dtypes=ROW_DTYPES, ndim=2, device=device)
    if rows.dtype not in supported:
        want = ", ".join(str(d).replace("torch.", "") for d in supported)
        raise InvalidTypeError(f"the {backend_name} backend combines {want}, got {rows.dtype}")
    num_rows = h.recv_src_idx.shape[0]
    if rows.shape[0] != num_rows:
        raise err(
            f"x has {rows.shape[0]} rows but the dispatch that made this handle received {num_rows}; combine takes "
            f"one row per received token, in recv order"
        )
    return rows


def check_combine_topk_weights(topk_weights: Any, num_rows: int, device: torch.device) -> torch.Tensor | None:
    if topk_weights is None:
        return None
    w = check_tensor("topk_weights", topk_weights, dtypes=(torch.float32,), ndim=2, device=device)
    if w.shape[0] != num_rows or w.shape[1] > MAX_TOPK:
        raise err(f"topk_weights has shape {tuple(w.shape)}, expected [{num_rows}, K<={MAX_TOPK}]")
    return w


def check_bias(bias: Any, x: torch.Tensor, num_tokens: int,
               device: torch.device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """A combine's bias (None, a [T, H] tensor, or a tuple of up to two) as a pair."""
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
            check_tensor(f"bias[{i}]", b, dtypes=(x.dtype,), ndim=2, device=device)
            if tuple(b.shape) != (num_tokens, x.shape[1]):
                raise err(f"bias[{i}] has shape {tuple(b.shape)}, expected [{num_tokens}, {x.shape[1]}] (T, H)")
    return biases[0], biases[1]


def check_combine_view(view: tuple[int, int, weakref.ref[torch.Tensor]] | None, op_seq: int, x: torch.Tensor,
                       h: DispatchHandle) -> bool:
    """Whether combine's x is the get_combine_buffer view (`view`: its storage address, the op count then and the
    handle it was taken for); refuses a view another op overwrote or one taken for another handle."""
    from_view = view is not None and x.untyped_storage().data_ptr() == view[0]
    if from_view and view is not None and view[1] != op_seq:
        raise err(
            f"combine: x is the tensor get_combine_buffer returned, but {op_seq - view[1]} dispatch/combine "
            f"call(s) of this Buffer ran since and overwrote it; call get_combine_buffer again after the last "
            f"dispatch or combine and write the rows into that, right before this combine"
        )
    if from_view and view is not None and view[2]() is not h.rank_prefix_matrix:
        raise err(
            "combine: x is the tensor get_combine_buffer returned, but it was last taken for another handle (the "
            "views of all handles are the same memory, so it holds that handle's rows); call "
            "get_combine_buffer(handle) for this combine's handle and write its rows into that"
        )
    return from_view
