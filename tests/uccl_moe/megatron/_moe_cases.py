"""Rank-side bodies of the Megatron MoELayer tests (run under ``helpers.mp.run_ranks_on``).

A *case* builds two real ``MoELayer``s with the local spec (SequentialMLP experts) on identical weights: one with
Megatron's ``allgather`` dispatcher (the reference) and one with ``uccl``; runs forward and backward on identical
inputs and output grads; and reports, per compared tensor, the largest absolute difference (or the error text).
"""

from __future__ import annotations

import dataclasses
import functools
import traceback
from typing import Any, Optional

import torch


@dataclasses.dataclass(frozen=True)
class Case:
    tp: int = 1
    ep: int = 2
    etp: Optional[int] = None  # expert TP; None = tp
    topk: int = 2
    num_experts: int = 8
    capacity_factor: Optional[float] = None
    shared_expert: bool = False
    shared_expert_overlap: bool = False
    hidden: int = 16
    seq: int = 8
    batch: int = 2
    aux_loss: bool = True
    backend: str = "reference"  # uccl Buffer backend (moe_uccl_backend)
    dtype: str = "fp32"  # model dtype: "fp32", or "bf16" (what the native kernels move)
    combine_from_buffer: Optional[bool] = None  # moe_uccl_combine_from_buffer; None = the knob's default (on)

    @property
    def id(self) -> str:
        s = f"tp{self.tp}-ep{self.ep}-etp{self.etp or self.tp}-top{self.topk}"
        if self.capacity_factor is not None:
            s += f"-cf{self.capacity_factor}"
        if self.shared_expert:
            s += "-shared" + ("-overlap" if self.shared_expert_overlap else "")
        if self.dtype != "fp32":
            s += f"-{self.dtype}"
        if self.backend != "reference":
            s += f"-{self.backend}"
        if self.combine_from_buffer is False:
            s += "-ringcombine"
        return s

    @property
    def torch_dtype(self) -> torch.dtype:
        return {"fp32": torch.float32, "bf16": torch.bfloat16}[self.dtype]


def init_parallel(case: Case) -> None:
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=case.tp,
        expert_model_parallel_size=case.ep,
        expert_tensor_parallel_size=case.etp or case.tp,
    )


def make_config(case: Case, dispatcher: str, **overrides: Any) -> Any:
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw: dict[str, Any] = dict(
        num_layers=1,
        hidden_size=case.hidden,
        num_attention_heads=4,
        num_moe_experts=case.num_experts,
        moe_router_topk=case.topk,
        moe_ffn_hidden_size=2 * case.hidden,
        moe_token_dispatcher_type=dispatcher,
        moe_router_dtype="fp32",
        moe_router_pre_softmax=case.topk == 1,
        moe_router_load_balancing_type="aux_loss" if case.aux_loss else "none",
        moe_aux_loss_coeff=0.01 if case.aux_loss else 0.0,
        tensor_model_parallel_size=case.tp,
        expert_model_parallel_size=case.ep,
        expert_tensor_parallel_size=case.etp or case.tp,
        sequence_parallel=case.tp > 1,
        add_bias_linear=False,
        use_cpu_initialization=True,
        bf16=case.dtype == "bf16",
        params_dtype=case.torch_dtype,
        moe_expert_capacity_factor=case.capacity_factor,
        moe_shared_expert_intermediate_size=case.hidden if case.shared_expert else None,
        # Only uccl (and alltoall) may overlap the shared expert; the allgather reference computes it inline.
        moe_shared_expert_overlap=case.shared_expert_overlap and dispatcher == "uccl",
        gradient_accumulation_fusion=False,
    )
    kw.update(overrides)
    config = TransformerConfig(**kw)
    if dispatcher == "uccl":
        config.moe_uccl_backend = case.backend
        if case.combine_from_buffer is not None:
            config.moe_uccl_combine_from_buffer = case.combine_from_buffer
    return config


def make_layer(config: Any, device: torch.device) -> Any:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.moe.moe_layer import MoELayer

    mlp = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False).submodules.mlp
    # <= 0.18: a ModuleSpec; 0.19: functools.partial(MoELayer, submodules=...).
    submodules = mlp.keywords["submodules"] if isinstance(mlp, functools.partial) else mlp.submodules
    return MoELayer(config, submodules, layer_number=1).to(device)


def _grads(layer: Any) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in layer.named_parameters() if p.grad is not None}


def forward_backward(layer: Any, x: torch.Tensor, grad_out: torch.Tensor) -> dict[str, torch.Tensor]:
    """Run layer forward+backward; return output, input grad and every parameter grad."""
    x = x.clone().requires_grad_(True)
    out, bias = layer(x)
    assert bias is None
    out.backward(grad_out)
    res = {"output": out.detach().clone(), "input_grad": x.grad.detach().clone()}
    res.update({"grad/" + k: v for k, v in _grads(layer).items()})
    return res


def compare_case(rank: int, case: Case, device: torch.device) -> dict[str, Any]:
    """Returns {'diffs': {name: max_abs_diff}, 'missing': [...], 'dispatcher': class name, 'tokens': int}."""
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

    import uccl_moe.megatron  # noqa: F401  (installs)

    init_parallel(case)
    torch.manual_seed(1234)
    ref_layer = make_layer(make_config(case, "allgather"), device)
    torch.manual_seed(1234)
    uccl_layer = make_layer(make_config(case, "uccl"), device)
    uccl_layer.load_state_dict(ref_layer.state_dict())
    gen = torch.Generator().manual_seed(100 + rank)
    seq = case.seq // case.tp if case.tp > 1 else case.seq
    x = torch.randn(seq, case.batch, case.hidden, generator=gen).to(device, case.torch_dtype)
    g = torch.randn(seq, case.batch, case.hidden, generator=gen).to(device, case.torch_dtype)
    # Sequence parallel: TP ranks hold different token shards, as in a real model.
    ref = forward_backward(ref_layer, x, g)
    clear_aux_losses_tracker()
    from uccl_moe import Buffer
    from uccl_moe.backends.native import NativeBackend

    # Which combine ran: get_combine_buffer handing out the NVL buffer (True) or a plain tensor (False), and the
    # native backend's pull kernel actually launched (combine from the buffer).
    views, pulls = [], []
    real_view, real_pull = Buffer.get_combine_buffer, NativeBackend._combine_from_buffer

    def spy_view(self: Any, *a: Any, **k: Any) -> Any:
        out = real_view(self, *a, **k)
        views.append(bool(self._combine_view is not None))
        return out

    def spy_pull(self: Any, *a: Any, **k: Any) -> Any:
        pulls.append(1)
        return real_pull(self, *a, **k)

    Buffer.get_combine_buffer = spy_view  # type: ignore[method-assign]
    NativeBackend._combine_from_buffer = spy_pull  # type: ignore[method-assign]
    try:
        got = forward_backward(uccl_layer, x, g)
    finally:
        Buffer.get_combine_buffer = real_view  # type: ignore[method-assign]
        NativeBackend._combine_from_buffer = real_pull  # type: ignore[method-assign]
    clear_aux_losses_tracker()
    diffs, scales = {}, {}
    for k, v in ref.items():
        if k in got:
            diffs[k] = float((got[k].float() - v.float()).abs().max()) if v.numel() else 0.0
            scales[k] = float(v.float().abs().max()) if v.numel() else 0.0
    return {
        "diffs": diffs,
        "scales": scales,
        "backend": type(uccl_layer.token_dispatcher._buffer._backend).__name__,
        "missing": sorted(set(ref) ^ set(got)),
        "dispatcher": type(uccl_layer.token_dispatcher).__name__,
        "ref_dispatcher": type(ref_layer.token_dispatcher).__name__,
        "tokens": int(x.shape[0] * x.shape[1]),
        "combine_views": views,
        "combine_pulls": len(pulls),
        "grad_names": sorted(k for k in ref if k.startswith("grad/")),
    }


def run_cases(rank: int, world: int, cases: list[Case], device_kind: str = "cpu") -> dict[str, Any]:
    """Run every case on this rank; a failing case reports its traceback instead of stopping the others."""
    device = torch.device("cuda", torch.cuda.current_device()) if device_kind == "cuda" else torch.device("cpu")
    out: dict[str, Any] = {}
    for case in cases:
        try:
            out[case.id] = compare_case(rank, case, device)
        except Exception:  # noqa: BLE001 - reported to the test, which fails that case
            out[case.id] = {"error": traceback.format_exc()}
    return out


def dropless_roundtrip(rank: int, world: int, ep: int, topk: int, device_kind: str = "cpu",
                       backend: str = "reference", dtype: str = "fp32") -> dict[str, float]:
    """Megatron's dropless contract through the dispatcher alone: dispatch -> x * probs (probs = 1/topk) ->
    combine == x, and the backward with grad = x returns x (exact for a power-of-two topk, in either dtype)."""
    from megatron.core.transformer.moe.moe_layer import MoELayer  # noqa: F401

    import uccl_moe.megatron  # noqa: F401

    case = Case(ep=ep, topk=topk, aux_loss=False, backend=backend, dtype=dtype)
    init_parallel(case)
    device = torch.device("cuda", torch.cuda.current_device()) if device_kind == "cuda" else torch.device("cpu")
    layer = make_layer(make_config(case, "uccl"), device)
    disp = layer.token_dispatcher
    gen = torch.Generator().manual_seed(7 + rank)
    x = torch.randn(32, 8, case.hidden, generator=gen).to(device, case.torch_dtype).requires_grad_(True)
    logits = torch.randn(32 * 8, case.num_experts, generator=gen).to(device)
    sel = torch.topk(logits, topk, dim=1).indices
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, sel, True)
    probs = torch.where(routing_map, torch.full_like(logits, 1.0 / topk), torch.zeros_like(logits))
    h, p = disp.dispatch_preprocess(x, routing_map, probs)
    h, p = disp.token_dispatch(h, p)
    tokens, tokens_per_expert, permuted_probs = disp.dispatch_postprocess(h, p)
    assert tokens_per_expert.device.type == "cpu" and tokens_per_expert.dtype == torch.int64
    assert int(tokens_per_expert.sum()) == tokens.shape[0]
    tokens = tokens * permuted_probs.unsqueeze(-1).to(tokens.dtype)
    out = disp.combine_postprocess(disp.token_combine(disp.combine_preprocess(tokens)))
    fwd = float((out - x).abs().max())
    out.backward(x.detach())
    bwd = float((x.grad - x.detach()).abs().max())
    return {"forward": fwd, "backward": bwd, "rows": float(tokens.shape[0]),
            "backend": type(disp._buffer._backend).__name__}
