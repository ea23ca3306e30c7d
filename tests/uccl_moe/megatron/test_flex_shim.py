"""Megatron's own flex dispatcher (``--moe-token-dispatcher-type flex --moe-flex-dispatcher-backend deepep``) over our
``deep_ep`` shim, on CPU (gloo; the shim's Buffer takes the reference backend there): a real MoELayer matches
Megatron's allgather dispatcher on identical weights and inputs, with and without a capacity factor; and the flex
dispatcher's FP8 per-expert padding (``--moe-router-padding-for-quantization``) runs through the shim. The GPU side
(1F1B EP overlap, loss parity) is tests/gpu/test_megatron_ep_overlap_gpu.py.
"""

from __future__ import annotations

import pytest
import torch
from helpers.mp import run_ranks_on as run_ranks
from helpers.requires import missing

from tests.uccl_moe.megatron._moe_cases import Case, forward_backward, init_parallel, make_config, make_layer

# Not importorskip: importing megatron.core here would import it into each spawned rank (which unpickles this
# module) before the shim is installed, and Megatron decides whether deep_ep exists when fused_a2a is imported.
pytestmark = [pytest.mark.mp, pytest.mark.timeout(600),
              pytest.mark.skipif(missing("megatron.core") is not None, reason=missing("megatron.core") or "")]

CASES = [Case(ep=2, topk=2), Case(ep=2, topk=1), Case(ep=2, topk=2, capacity_factor=0.5), Case(ep=2, topk=2,
                                                                                               shared_expert=True)]


def _flex_rank(rank: int, world: int, cases: list[Case]) -> dict:
    import uccl_moe.deep_ep_compat as shim

    shim.install()  # before Megatron's fused_a2a looks for deep_ep
    import uccl_moe
    import uccl_moe.megatron  # noqa: F401

    out: dict = {}
    for case in cases:
        init_parallel(case)
        torch.manual_seed(1234)
        ref = make_layer(make_config(case, "allgather"), torch.device("cpu"))
        torch.manual_seed(1234)
        flex = make_layer(make_config(case, "flex", moe_flex_dispatcher_backend="deepep"), torch.device("cpu"))
        flex.load_state_dict(ref.state_dict())
        gen = torch.Generator().manual_seed(100 + rank)
        x = torch.randn((case.seq, case.batch, case.hidden), generator=gen, dtype=torch.float32)
        g = torch.randn((case.seq, case.batch, case.hidden), generator=gen, dtype=torch.float32)
        a, b = forward_backward(ref, x, g), forward_backward(flex, x, g)
        from megatron.core.transformer.moe import fused_a2a

        out[case.id] = {"dispatcher": type(flex.token_dispatcher).__name__,
                        "buffer": type(fused_a2a._buffer).__module__ if fused_a2a._buffer is not None else None,
                        "is_ours": isinstance(fused_a2a._buffer, uccl_moe.Buffer),
                        "diffs": {k: float((a[k] - b[k]).abs().max()) for k in a}, "missing": sorted(set(a) ^ set(b))}
    # FP8 per-expert padding in the flex dispatcher (fp8 set after construction: TransformerConfig wants TE for it).
    case = Case(ep=2, topk=2, aux_loss=False, seq=32)
    init_parallel(case)
    flex = make_layer(make_config(case, "flex", moe_flex_dispatcher_backend="deepep"), torch.device("cpu"))
    flex.config.fp8, flex.config.moe_router_padding_for_quantization = "e4m3", True
    disp = flex.token_dispatcher
    gen = torch.Generator().manual_seed(7 + rank)
    x = torch.randn((case.seq, case.batch, case.hidden), generator=gen, dtype=torch.float32)
    logits = torch.randn((case.seq * case.batch, case.num_experts), generator=gen, dtype=torch.float32)
    sel = torch.topk(logits, case.topk, dim=1).indices
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, sel, True)
    probs = torch.where(routing_map, torch.full_like(logits, 0.5), torch.zeros_like(logits))
    h, p = disp.dispatch_preprocess(x, routing_map, probs)
    h, p = disp.token_dispatch(h, p)
    tokens, tokens_per_expert, permuted_probs = disp.dispatch_postprocess(h, p)
    rows = tokens * permuted_probs.unsqueeze(-1)
    y = disp.combine_postprocess(disp.token_combine(disp.combine_preprocess(rows)))
    out["padding"] = {"counts": [int(c) for c in tokens_per_expert.tolist()], "rows": int(tokens.shape[0]),
                      "roundtrip": float((y - x).abs().max())}
    return out


def test_flex_over_the_shim_matches_allgather():
    for rank, res in enumerate(run_ranks(_flex_rank, 2, CASES, env={"UCCL_MOE_BACKEND": "reference"})):
        for case in CASES:
            r = res[case.id]
            assert r["dispatcher"] == "MoEFlexTokenDispatcher" and r["is_ours"], (rank, case.id, r)
            assert not r["missing"], r
            bad = {k: v for k, v in r["diffs"].items() if v > 1e-5}
            assert not bad, f"rank {rank} {case.id}: {bad}"
        pad = res["padding"]
        assert all(c % 16 == 0 for c in pad["counts"]) and sum(pad["counts"]) == pad["rows"], pad
        assert pad["roundtrip"] < 1e-5, pad
