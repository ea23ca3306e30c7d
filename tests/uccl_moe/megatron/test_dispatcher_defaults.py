"""UCCLTokenDispatcher under torch's process-wide default device and dtype (issue 29), on CPU (gloo).

Two levels, each against the plain run on the same weights and inputs:
- the dispatcher's six methods alone (what the dispatcher itself creates), under every mode of ``helpers.defaults``,
  ``meta`` ones included (a tensor made without ``device=`` lands on meta and fails);
- a whole MoELayer forward/backward under the modes Megatron itself survives (default dtype, ``cpu`` defaults).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from helpers.defaults import CPU_MODES, torch_defaults  # noqa: E402
from helpers.mp import run_ranks_on as run_ranks  # noqa: E402

from tests.uccl_moe.megatron._moe_cases import Case, forward_backward, init_parallel, make_config, make_layer  # noqa: E402

pytestmark = [pytest.mark.mp, pytest.mark.timeout(600)]

LAYER_MODES = ("dtype_bf16", "dtype_fp64", "set_cpu", "with_cpu")


def six_methods(disp, x: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor) -> dict[str, torch.Tensor]:
    """Dispatch -> rows * probs -> combine, then backward with grad = x; the outputs by name."""
    x = x.detach().clone().requires_grad_(True)
    probs = probs.detach().clone().requires_grad_(True)
    h, p = disp.dispatch_preprocess(x, routing_map, probs)
    h, p = disp.token_dispatch(h, p)
    tokens, tokens_per_expert, permuted_probs = disp.dispatch_postprocess(h, p)
    assert tokens_per_expert.device.type == "cpu" and tokens_per_expert.dtype == torch.int64, tokens_per_expert
    rows = tokens * permuted_probs.unsqueeze(-1).to(tokens.dtype)
    out = disp.combine_postprocess(disp.token_combine(disp.combine_preprocess(rows)))
    out.backward(x.detach())
    return {"out": out.detach(), "tokens_per_expert": tokens_per_expert, "permuted_probs": permuted_probs.detach(),
            "x_grad": x.grad, "probs_grad": probs.grad}


def dispatcher_modes(rank: int, world: int, modes: tuple[str, ...], device_kind: str = "cpu") -> dict[str, str]:
    """Rank body (also of the GPU variant, tests/gpu/test_default_device_gpu.py: BF16 model, native kernels)."""
    import uccl_moe.megatron  # noqa: F401  (installs)

    if device_kind == "cuda":
        case = Case(ep=world, topk=2, aux_loss=False, hidden=128, backend="native", dtype="bf16")
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        case = Case(ep=world, topk=2, aux_loss=False)
        device = torch.device("cpu")
    init_parallel(case)
    disp = make_layer(make_config(case, "uccl"), device).token_dispatcher
    gen = torch.Generator().manual_seed(5 + rank)
    x = torch.randn((8, 2, case.hidden), generator=gen, dtype=torch.float32).to(device, case.torch_dtype)
    logits = torch.randn((16, case.num_experts), generator=gen, dtype=torch.float32)
    sel = torch.topk(logits, case.topk, dim=1).indices
    routing_map = torch.zeros((16, case.num_experts), dtype=torch.bool).scatter_(1, sel, True)
    probs = torch.where(routing_map, torch.softmax(logits, 1), torch.zeros_like(logits))
    routing_map, probs = routing_map.to(device), probs.to(device)
    ref = six_methods(disp, x, routing_map, probs)
    failures: dict[str, str] = {}
    for mode in modes:
        try:
            with torch_defaults(mode):
                got = six_methods(disp, x, routing_map, probs)
            for k, v in ref.items():
                assert got[k].device == v.device and got[k].dtype == v.dtype, f"{k}: {got[k].device}/{got[k].dtype}"
                assert torch.equal(got[k], v), f"{k} differs from the plain run"
        except Exception as e:  # noqa: BLE001 - report every mode
            failures[mode] = f"{type(e).__name__}: {e}"
    return failures


def _layer_modes(rank: int, world: int, modes: tuple[str, ...]) -> dict[str, str]:
    import uccl_moe.megatron  # noqa: F401

    case = Case(ep=world, topk=2, shared_expert=True)
    init_parallel(case)
    torch.manual_seed(1234)
    layer = make_layer(make_config(case, "uccl"), torch.device("cpu"))
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn((case.seq, case.batch, case.hidden), generator=gen, dtype=torch.float32)
    g = torch.randn((case.seq, case.batch, case.hidden), generator=gen, dtype=torch.float32)
    ref = forward_backward(layer, x, g)
    layer.zero_grad()
    failures: dict[str, str] = {}
    for mode in modes:
        try:
            with torch_defaults(mode):
                got = forward_backward(layer, x, g)
            layer.zero_grad()
            for k, v in ref.items():
                assert got[k].dtype == v.dtype and got[k].device == v.device, k
                assert torch.allclose(got[k], v, atol=1e-6, rtol=0), f"{k} differs from the plain run"
        except Exception as e:  # noqa: BLE001
            failures[mode] = f"{type(e).__name__}: {e}"
    return failures


def test_dispatcher_methods_ignore_default_device_and_dtype():
    for rank, failures in enumerate(run_ranks(dispatcher_modes, 2, CPU_MODES)):
        assert not failures, f"rank {rank}: {failures}"


def test_moe_layer_with_uccl_under_default_dtype_and_device():
    for rank, failures in enumerate(run_ranks(_layer_modes, 2, LAYER_MODES)):
        assert not failures, f"rank {rank}: {failures}"
