"""Where host syncs fall in Megatron's combined-1F1B schedule (``--overlap-moe-expert-parallel-comm``), per schedule
node, on CPU: a recorder for tests and for ``python -m tests.uccl_moe.megatron.host_sync_log`` (a table per
dispatcher).

Megatron's plan (megatron/core/models/common/model_chunk_schedule_plan.py, TransformerLayerSchedulePlan.run) enqueues
one layer of micro-batch f's forward with one of micro-batch b's backward in this CPU order: b.moe_combine bwd (comm
stream), f.pre_dispatch_computation fwd (comp), b.mlp bwd (comp), f.moe_dispatch fwd (comm), b.mlp bwd_dw,
b.moe_dispatch bwd (comm), f.mlp fwd (comp), f.moe_combine fwd (comm), b.pre_dispatch_computation bwd (comp). A host
sync stops the CPU from enqueuing the nodes after it until the GPU work it waits for is done, so where it falls
decides what the other micro-batch can run meanwhile. Megatron's own dispatchers sync in f.moe_dispatch fwd, after
b.mlp bwd was enqueued: alltoall's ``d2h_event.synchronize()`` at its ``before_ep_alltoall`` point
(transformer/moe/token_dispatcher.py, _maybe_dtoh_and_synchronize), flex + DeepEP's count wait inside
``buffer.dispatch`` (transformer/moe/fused_a2a.py, FusedDispatch.forward: "the CPU will wait for GPU's signal").

On CPU nothing is a device sync, so the recorder logs the calls that are one on a GPU when their tensor lives there:
tensor reads to the host (``item``, ``tolist``, ``cpu``, ``numpy``, ``int()``/``float()``/``bool()``), ops whose
output size depends on values (``nonzero``, ``masked_select``, ``repeat_interleave`` without ``output_size``, boolean
indexing), event/stream/device ``synchronize``, and a Buffer ``dispatch`` that waits for the received counts on the
host (no handle, no ``num_worst_tokens``: DeepEP's and our native backend's count wait). Each record names the node
(name, fwd/bwd/bwd_dw, micro-batch) and the first caller frame in ``uccl_moe`` or ``megatron``.
"""

from __future__ import annotations

import contextlib
import sys
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

# The streams and events the schedule plan touches, as CPU no-ops (everything has finished when a call returns).


class _Event:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        del args, kwargs

    def record(self, stream: Any = None) -> None:
        del stream

    def wait(self, stream: Any = None) -> None:
        del stream

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class _Stream:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        del args, kwargs

    def wait_stream(self, other: Any) -> None:
        del other

    def wait_event(self, event: Any) -> None:
        del event

    def record_event(self, event: Any = None) -> _Event:
        return event if event is not None else _Event()

    def synchronize(self) -> None:
        pass


@dataclass(frozen=True)
class Sync:
    """One host-sync candidate: the node it ran in (``outside`` when in none), its kind and its caller."""

    node: str  # e.g. "moe_dispatch.fwd"
    microbatch: int  # -1 outside a node
    kind: str
    site: str  # "uccl_moe/megatron/autograd.py:forward" (the first uccl_moe or megatron frame)
    step: int  # index of the node in Recorder.nodes (-1 outside a node)


_INTERESTING = ("uccl_moe", "megatron")


def _site() -> str:
    for fr in reversed(traceback.extract_stack()[:-2]):
        f = fr.filename.replace("\\", "/")
        if "/tests/" in f or f.endswith("host_sync_log.py"):
            continue
        for pkg in _INTERESTING:
            i = f.rfind(f"/{pkg}/")
            if i >= 0:
                return f"{f[i + 1:]}:{fr.name}"
    return "?"


class Recorder:
    """Patches the sync candidates and the schedule nodes while active (:meth:`active`); :attr:`records` in order,
    :attr:`nodes` the node sequence the schedule ran."""

    def __init__(self) -> None:
        self.records: list[Sync] = []
        self.nodes: list[tuple[str, int]] = []
        self._stack: list[tuple[str, int, int]] = []
        self._mb: dict[int, int] = {}
        self._busy = False  # a patched call inside a patched call logs once

    def _microbatch(self, node: Any) -> int:
        key = id(node.event)
        return self._mb.setdefault(key, len(self._mb))

    def log(self, kind: str) -> None:
        if self._busy:
            return
        node, mb, step = self._stack[-1] if self._stack else ("outside", -1, -1)
        self.records.append(Sync(node, mb, kind, _site(), step))

    def _wrap(self, kind: str, fn: Any, when: Any = None) -> Any:
        rec = self

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if rec._busy:
                return fn(*args, **kwargs)
            if when is None or when(*args, **kwargs):
                rec.log(kind)
            rec._busy = True
            try:
                return fn(*args, **kwargs)
            finally:
                rec._busy = False

        return wrapper

    def _node_wrap(self, suffix: str, fn: Any) -> Any:
        rec = self

        def wrapper(node: Any, *args: Any, **kwargs: Any) -> Any:
            label = (f"{node.name}.{suffix}", rec._microbatch(node))
            rec.nodes.append(label)
            rec._stack.append((*label, len(rec.nodes) - 1))
            try:
                return fn(node, *args, **kwargs)
            finally:
                rec._stack.pop()

        return wrapper

    @contextlib.contextmanager
    def active(self) -> Iterator[Recorder]:
        from megatron.core.pipeline_parallel import utils as pp_utils

        try:  # 0.19: models/common/utils.py; 0.16: models/gpt/fine_grained_callables.py
            from megatron.core.models.common.utils import TransformerLayerNode
        except ImportError:
            from megatron.core.models.gpt.fine_grained_callables import TransformerLayerNode
        from megatron.core.transformer.moe import token_dispatcher as td

        import uccl_moe

        def bool_index(t: Any, idx: Any) -> bool:
            items = idx if isinstance(idx, tuple) else (idx,)
            return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)

        def tensor_repeats(*args: Any, **kwargs: Any) -> bool:
            repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
            if repeats is None and args and isinstance(args[0], torch.Tensor) and len(args) == 1:
                return True  # torch.repeat_interleave(repeats): the size is the sum of the values
            return isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None

        def count_wait(buffer: Any, x: Any, handle: Any = None, *args: Any, **kwargs: Any) -> bool:
            worst = kwargs.get("num_worst_tokens", args[9] if len(args) > 9 else 0)
            return handle is None and not worst

        cur = _Stream()
        patches: list[tuple[Any, str, Any]] = [
            (torch.cuda, "Stream", _Stream), (torch.cuda, "Event", _Event),
            (torch.cuda, "stream", lambda s=None: contextlib.nullcontext()),
            (torch.cuda, "current_stream", lambda device=None: cur),
            (torch.cuda.nvtx, "range_push", lambda *a, **k: None), (torch.cuda.nvtx, "range_pop", lambda *a, **k: None),
            (torch.Tensor, "record_stream", lambda self, stream: None),
            (td.MoEAlltoAllTokenDispatcher, "cuda_dtoh_stream", _Stream()),
            (torch.cuda, "synchronize", self._wrap("cuda_synchronize", lambda device=None: None)),
            (_Event, "synchronize", self._wrap("event_synchronize", _Event.synchronize)),
            (_Stream, "synchronize", self._wrap("stream_synchronize", _Stream.synchronize)),
            # Buffer ops are kernels on a GPU: opaque here (the CPU reference backend's own reads are not logged),
            # except the count wait of a dispatch that makes a new handle.
            (uccl_moe.Buffer, "dispatch", self._wrap("count_wait", uccl_moe.Buffer.dispatch, count_wait)),
            (uccl_moe.Buffer, "get_dispatch_layout",
             self._wrap("", uccl_moe.Buffer.get_dispatch_layout, lambda *a, **k: False)),
            (uccl_moe.Buffer, "combine", self._wrap("", uccl_moe.Buffer.combine, lambda *a, **k: False)),
            (pp_utils.ScheduleNode, "_forward", self._node_wrap("fwd", pp_utils.ScheduleNode._forward)),
            (pp_utils.ScheduleNode, "_backward", self._node_wrap("bwd", pp_utils.ScheduleNode._backward)),
            (TransformerLayerNode, "backward_dw", self._node_wrap("bwd_dw", TransformerLayerNode.backward_dw)),
            (torch.Tensor, "__getitem__", self._wrap("bool_index", torch.Tensor.__getitem__, bool_index)),
            (torch.Tensor, "repeat_interleave",
             self._wrap("repeat_interleave", torch.Tensor.repeat_interleave, tensor_repeats)),
            (torch, "repeat_interleave", self._wrap("repeat_interleave", torch.repeat_interleave, tensor_repeats)),
        ]
        for name in ("item", "tolist", "cpu", "numpy", "nonzero", "masked_select", "__int__", "__float__", "__bool__"):
            patches.append((torch.Tensor, name, self._wrap(name.strip("_"), getattr(torch.Tensor, name))))
        for name in ("nonzero", "masked_select", "unique"):
            patches.append((torch, name, self._wrap(name, getattr(torch, name))))
        saved = [(obj, name, obj.__dict__.get(name, _MISSING) if isinstance(obj, type) else getattr(obj, name))
                 for obj, name, _ in patches]
        try:
            for obj, name, value in patches:
                setattr(obj, name, value)
            yield self
        finally:
            for obj, name, value in reversed(saved):
                if value is _MISSING:
                    delattr(obj, name)
                else:
                    setattr(obj, name, value)

    def in_nodes(self) -> list[Sync]:
        """The records inside schedule nodes."""
        return [r for r in self.records if r.microbatch >= 0]


_MISSING = object()

#: Reads that are of host tensors on a GPU too (no device sync there): (site, kind) -> what is read.
HOST_READS: dict[tuple[str, str], str] = {
    ("uccl_moe/megatron/dispatcher.py:dispatch_postprocess", "int"):
        "tokens_per_expert: a CPU tensor of the counts the dispatch returned as a list",
    ("megatron/core/transformer/moe/experts.py:forward", "tolist"):
        "SequentialMLP splits by tokens_per_expert, which every dispatcher here hands over on the host",
    ("megatron/core/tensor_parallel/random.py:fork", "item"): "compares CPU RNG states",
    ("megatron/core/transformer/moe/token_dispatcher.py:get_permuted_hidden_states_by_experts", "item"):
        "flex: tokens_per_expert.sum() of the count list DeepEP's dispatch returned (fused_a2a.py: torch.tensor)",
    ("megatron/core/transformer/moe/moe_utils.py:sort_chunks_by_idxs", "tolist"):
        "alltoall: split sizes its D2H copy brought to the host before the sync point",
    ("uccl_moe/megatron/cpu.py:move_to_cpu", "numpy"):
        "alltoall's D2H copy at cuda_dtoh_point (our CPU stand-in; on a GPU a non-blocking copy on a side stream)",
}


def device_syncs(rec: Recorder) -> list[Sync]:
    """The records inside schedule nodes that wait for the device on a GPU (:data:`HOST_READS` left out)."""
    return [r for r in rec.in_nodes() if (r.site, r.kind) not in HOST_READS]


def run_schedule(argv: list[str]) -> Recorder:
    """Build train_gpt's model from `argv` (plus the overlap flag) and run one step of Megatron's own
    ``combined_1f1b_schedule_for_no_pipelining`` on CPU under a :class:`Recorder`."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import combined_1f1b
    from megatron.core.pipeline_parallel import utils as pp_utils

    from uccl_moe.train import train_gpt

    ts = train_gpt.setup(argv + ["--overlap-moe-expert-parallel-comm", "--train-iters", "1"])
    model = train_gpt.build_model(ts)
    config = ts.config
    config.no_sync_func = model.no_sync
    rec = Recorder()
    model.zero_grad_buffer()
    with rec.active():
        pp_utils._COMP_STREAM = pp_utils._COMM_STREAM = None  # set_streams builds them from the stand-ins
        try:
            combined_1f1b.combined_1f1b_schedule_for_no_pipelining(
                train_gpt._forward_step, train_gpt.synthetic_batches(ts), model, ts.num_microbatches, None, None, [],
                config, False, False, False, model.no_sync, torch.zeros([], dtype=torch.int), lambda first: first,
            )
        finally:
            pp_utils._COMP_STREAM = pp_utils._COMM_STREAM = None
    parallel_state.destroy_model_parallel()
    return rec


def summary(rec: Recorder, only_device: bool = False) -> dict[tuple[str, str, str], int]:
    """Count of each (node, kind, site) inside schedule nodes, over micro-batches and layers (`only_device`: the
    :func:`device_syncs`)."""
    out: dict[tuple[str, str, str], int] = {}
    for r in device_syncs(rec) if only_device else rec.in_nodes():
        key = (r.node, r.kind, r.site)
        out[key] = out.get(key, 0) + 1
    return out


def render(name: str, rec: Recorder) -> str:
    lines = [f"== {name}: {len(rec.nodes)} node calls, {len(rec.in_nodes())} sync candidates in nodes, "
             f"{len(rec.records) - len(rec.in_nodes())} outside"]
    for (node, kind, site), n in sorted(summary(rec).items()):
        host = " (host tensor on GPU too)" if (site, kind) in HOST_READS else ""
        lines.append(f"  {node:30s} {kind:18s} x{n:<3d} {site}{host}")
    return "\n".join(lines)


def _rank(rank: int, world: int, argv: list[str], shim: bool) -> str:
    del world
    if shim:  # before Megatron's fused_a2a looks for deep_ep
        import uccl_moe.deep_ep_compat as deep_ep_compat

        deep_ep_compat.install()
    rec = run_schedule(argv)
    return render(" ".join(argv[-4:]) + f" (rank {rank})", rec)


if __name__ == "__main__":  # python -m tests.uccl_moe.megatron.host_sync_log
    from helpers.mp import run_ranks_on

    from tests.uccl_moe.megatron import host_sync_log as this
    from tests.uccl_moe.megatron.test_train_gpt_bf16 import ARGS, DISPATCHERS

    for disp in sys.argv[1:] or sorted(DISPATCHERS):
        out = run_ranks_on(this._rank, 2, ARGS + DISPATCHERS[disp], disp == "flex_shim",
                           env={"UCCL_MOE_BACKEND": "reference"})
        print(out[0], flush=True)
