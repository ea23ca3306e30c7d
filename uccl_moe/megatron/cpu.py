"""The one place where megatron-core's CUDA assumptions are bent so MoE models run on CPU (gloo).

Running Megatron MoE on CPU is a real feature of uccl-moe: development and CI without GPUs, and the main job on a
machine that has none. Megatron-Core assumes CUDA in a few spots; :func:`apply` fixes exactly these, and only when
``torch.cuda.is_available()`` is False (it refuses otherwise, so nothing here can touch a GPU run):

1. ``torch.cuda.current_device()`` returns ``torch.device("cpu")``. Megatron allocates with
   ``device=torch.cuda.current_device()`` (TP/SP gather and reduce-scatter buffers in
   ``tensor_parallel/mappings.py``, the global memory buffer) and moves the router weight there
   (``Router.gating``); on a CPU host that call raises, so answering "cpu" changes no working code path.
2. megatron-core 0.16.x names ``te_general_gemm`` in ``moe_utils.router_gating_linear`` even when TransformerEngine is
   absent (NameError on any device; fixed in 0.17): it is defined as None, which selects the torch matmul path.
3. The model-parallel RNG tracker (``tensor_parallel.random``) saves and restores CUDA generator states: on CPU it
   uses the CPU generator in the CUDA generator's place (``torch.cuda.get_rng_state``/``set_rng_state``/
   ``manual_seed`` act on it), so ``model_parallel_cuda_manual_seed``, the tracker's named states and dropout forks
   work. On a CPU host there is one generator, so seeding "the CUDA generator" seeds the CPU one.
4. ``torch.cuda.current_stream()`` returns a stream stand-in whose waits are no-ops (megatron-core 0.19's DDP grad
   sync waits on CUDA-graph events through it): on CPU all work is synchronous, so there is nothing to wait for.
5. ``torch.cuda.Stream()`` returns the same stand-in and ``torch.cuda.stream(<stand-in>)`` is a no-op context:
   Megatron's ``alltoall`` dispatcher creates a side stream for its device-to-host copies in ``__init__`` (the
   constructor raised on CPU), so with this the CPU runs can compare uccl with alltoall. Its
   ``maybe_move_tensor_to_cpu(t, as_numpy=True)`` converts only CUDA tensors, which left the all-to-all split sizes
   as CPU tensors that ``all_to_all_single`` rejects; on CPU a host tensor with ``as_numpy=True`` becomes the numpy
   array the GPU path yields.

Everything is idempotent.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch

from ..errors import InvalidUsageError

log = logging.getLogger("uccl_moe.megatron")

_applied = False


def apply() -> None:
    """Apply the CPU shims (see the module doc). Raises InvalidUsageError on a host where CUDA is available."""
    global _applied
    if torch.cuda.is_available():
        raise InvalidUsageError(
            "uccl_moe.megatron.cpu.apply() is for hosts without CUDA; this host has CUDA, where Megatron needs no shim"
        )
    if _applied:
        return
    _patch_current_device()
    _patch_te_general_gemm()
    _patch_rng_tracker()
    _patch_current_stream()
    _patch_stream_class()
    _applied = True
    log.info("megatron-core CPU shims applied (no CUDA on this host)")


def is_applied() -> bool:
    return _applied


def _cpu_current_device() -> torch.device:
    return torch.device("cpu")


def _patch_current_device() -> None:
    torch.cuda.current_device = _cpu_current_device  # type: ignore[assignment]


def _patch_te_general_gemm() -> None:
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None  # type: ignore[attr-defined]


def _patch_rng_tracker() -> None:
    """Make the CUDA RNG state calls of ``tensor_parallel.random`` act on the CPU generator."""
    from megatron.core.tensor_parallel import random as mc_random

    def get_state(*_args: Any, **_kwargs: Any) -> torch.Tensor:
        return torch.get_rng_state()

    def set_state(new_state: torch.Tensor, *_args: Any, **_kwargs: Any) -> None:
        torch.set_rng_state(new_state)

    if hasattr(mc_random, "_set_cuda_rng_state"):
        mc_random._set_cuda_rng_state = set_state
    if hasattr(mc_random, "_get_cuda_rng_state"):
        mc_random._get_cuda_rng_state = get_state
    # The tracker calls torch.cuda.{get_rng_state,manual_seed} through the module's `torch` import.
    torch.cuda.get_rng_state = get_state  # type: ignore[assignment]
    torch.cuda.set_rng_state = set_state  # type: ignore[assignment]
    # Not torch.manual_seed: that calls torch.cuda.manual_seed_all, which must stay the (lazy, harmless) original.
    torch.cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))  # type: ignore[assignment]


class HostStream:
    """What ``torch.cuda.current_stream()`` returns on a CPU host: work is synchronous, so every wait is a no-op."""

    device = torch.device("cpu")

    def wait_event(self, event: Any) -> None:
        del event

    def wait_stream(self, stream: Any) -> None:
        del stream

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def record_event(self, event: Any = None) -> Any:
        return event if event is not None else HostEvent()


class HostEvent:
    """What ``HostStream.record_event()`` returns: already complete (CPU work is synchronous)."""

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def wait(self, stream: Any = None) -> None:
        del stream


_HOST_STREAM = HostStream()


def _patch_current_stream() -> None:
    torch.cuda.current_stream = lambda device=None: _HOST_STREAM  # type: ignore[assignment,return-value]


def _patch_stream_class() -> None:
    real_stream_ctx = torch.cuda.stream

    def host_stream(*_args: Any, **_kwargs: Any) -> HostStream:
        return _HOST_STREAM

    def stream_ctx(stream: Any) -> Any:
        if stream is None or isinstance(stream, HostStream):
            return contextlib.nullcontext()
        return real_stream_ctx(stream)

    torch.cuda.Stream = host_stream  # type: ignore[assignment,misc]
    torch.cuda.stream = stream_ctx

    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    real_move = getattr(moe_utils, "maybe_move_tensor_to_cpu", None)
    if real_move is None or getattr(real_move, "_uccl_cpu_shim", False):
        return

    def move_to_cpu(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        if as_numpy and torch.is_tensor(tensor) and tensor.device.type == "cpu":
            return tensor.numpy()
        return real_move(tensor, as_numpy=as_numpy, record_stream=record_stream)

    move_to_cpu._uccl_cpu_shim = True  # type: ignore[attr-defined]
    moe_utils.maybe_move_tensor_to_cpu = move_to_cpu
    if hasattr(token_dispatcher, "maybe_move_tensor_to_cpu"):
        token_dispatcher.maybe_move_tensor_to_cpu = move_to_cpu
