"""Megatron-Core version drift, in one place (0.15 .. 0.19 are supported; 0.13/0.14 are best effort).

What moves between versions and how we absorb it:

- the dispatcher base constructor keyword: ``model_comm_pgs`` (0.13/0.14) vs ``pg_collection`` (0.15+);
- ``moe_utils.permute`` returns a 3-tuple up to 0.16 and a 5-tuple from 0.17 (we use the first three);
- ``SharedExpertMLP`` gained ``wait_current_stream()`` and ``pre_forward_comm(..., wait_current_stream=)`` (0.18+);
- ``megatron.training`` is not shipped in the <= 0.16 wheels (argument patches are skipped there);
- 0.16.x references ``te_general_gemm`` in router gating even without TransformerEngine (see ``cpu.py``).
"""

from __future__ import annotations

import inspect
from typing import Any, Optional

import torch


def megatron_version() -> str:
    """The installed megatron-core version string, e.g. ``"0.16.1"``."""
    from megatron.core import package_info

    return str(package_info.__version__)


def version_tuple() -> tuple[int, int]:
    """(major, minor) of the installed megatron-core."""
    parts = megatron_version().split(".")
    return int(parts[0]), int("".join(ch for ch in parts[1] if ch.isdigit()) or 0)


def base_dispatcher_kwargs(pg_collection: Any) -> dict[str, Any]:
    """Keyword arguments for ``MoETokenDispatcher.__init__`` besides ``config``, for this version."""
    from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher

    params = inspect.signature(MoETokenDispatcher.__init__).parameters
    if "pg_collection" in params:
        return {"pg_collection": pg_collection}
    if "model_comm_pgs" in params:
        return {"model_comm_pgs": pg_collection}
    return {}


def default_pg_collection() -> Any:
    """The process groups MoELayer would use when its caller passed none."""
    from megatron.core.transformer.moe import moe_utils

    if hasattr(moe_utils, "get_default_pg_collection"):
        return moe_utils.get_default_pg_collection()
    from megatron.core.process_groups_config import ModelCommProcessGroups  # 0.13/0.14

    return ModelCommProcessGroups.use_mpu_process_groups()


def permute(
    tokens: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor, num_out_tokens: int, fused: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Megatron's ``moe_utils.permute`` (TE fused when ``fused``), normalised to (tokens, probs, sorted_indices).

    Unfused, the rows are ordered as Megatron orders them (by expert, then by row) with a stable argsort of the
    transposed map cut at `num_out_tokens` (the count the dispatch returned on the host), not ``masked_select``:
    Megatron <= 0.18's unfused permute takes ``masked_select``, whose output size makes the host wait for the
    device, and that wait in the expert node would stall the CPU's enqueuing of the other micro-batch's nodes under
    the 1F1B EP overlap (Megatron-LM megatron/core/transformer/moe/moe_utils.py, permute: 0.19 made the same change
    for CUDA graphs). Same indices, same values, same gradients.
    """
    if fused:
        from megatron.core.transformer.moe.moe_utils import permute as mc_permute

        res = mc_permute(tokens, routing_map, probs=probs, num_out_tokens=num_out_tokens, fused=True)
        permuted_probs = res[1]
        assert permuted_probs is not None  # probs were given
        return res[0], permuted_probs, res[2]
    num_tokens = routing_map.shape[0]
    # [T, E] -> [E * T], expert-major; the selected entries first, each expert's rows in ascending order
    flat = routing_map.bool().T.contiguous().reshape(-1)
    order = flat.to(torch.int8).argsort(descending=True, stable=True)[:num_out_tokens]
    sorted_indices = order % num_tokens
    permuted_probs = probs.T.contiguous().reshape(-1).index_select(0, order)
    return tokens.index_select(0, sorted_indices), permuted_probs, sorted_indices


def unpermute(
    tokens: torch.Tensor,
    sorted_indices: torch.Tensor,
    restore_shape: torch.Size,
    routing_map: torch.Tensor,
    fused: bool,
) -> torch.Tensor:
    """Megatron's ``moe_utils.unpermute`` without probs: sums the rows of each token (the experts applied probs)."""
    from megatron.core.transformer.moe.moe_utils import unpermute as mc_unpermute

    return mc_unpermute(tokens, sorted_indices, restore_shape=restore_shape, routing_map=routing_map, fused=fused)


def unpermute_into(out: torch.Tensor, tokens: torch.Tensor, sorted_indices: torch.Tensor) -> torch.Tensor:
    """Megatron's unfused ``moe_utils.unpermute`` without probs (the experts applied them), summing the rows of each
    token into `out` ([N, H], e.g. the Buffer's combine input) instead of a new tensor: the same ops in the same order
    (zeros, then ``index_add_`` under deterministic algorithms, else ``scatter_add_``), so the same values and
    gradient."""
    out.zero_()
    if torch.are_deterministic_algorithms_enabled():
        out.index_add_(0, sorted_indices, tokens)
    else:
        out.scatter_add_(0, sorted_indices.unsqueeze(1).expand(-1, out.shape[1]), tokens)
    return out


def shared_expert_wait_current_stream(shared_experts: Any) -> None:
    """``SharedExpertMLP.wait_current_stream()`` where it exists (0.18+); older ones wait in pre_forward_comm."""
    fn = getattr(shared_experts, "wait_current_stream", None)
    if fn is not None:
        fn()


def shared_expert_pre_forward_comm(shared_experts: Any, x: torch.Tensor) -> None:
    """``pre_forward_comm`` without a second stream wait where the version lets us say so."""
    fn = shared_experts.pre_forward_comm
    if "wait_current_stream" in inspect.signature(fn).parameters:
        fn(x, wait_current_stream=False)
    else:
        fn(x)


def training_args() -> Optional[Any]:
    """Megatron-LM's parsed global args if ``megatron.training`` is importable and args were parsed, else None."""
    try:
        from megatron.training import global_vars
    except Exception:  # noqa: BLE001 - not shipped in <= 0.16 wheels, or broken optional deps
        return None
    return getattr(global_vars, "_GLOBAL_ARGS", None)
