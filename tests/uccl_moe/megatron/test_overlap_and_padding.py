"""Issue 29 Megatron flags with the uccl dispatcher, on CPU (gloo, reference backend):

- ``--overlap-moe-expert-parallel-comm``: Megatron's 1F1B EP overlap needs CUDA streams (its ScheduleNode), so here
  its *call pattern* is replayed by hand: the MoELayer steps it calls from separate nodes (route+preprocess, dispatch,
  routed_experts_compute, combine+postprocess), each on detached inputs with a per-node backward, with micro-batch B's
  forward nodes interleaved with micro-batch A's backward nodes as in combined_1f1b. Outputs, input grads and weight
  grads must equal two plain forward/backward passes. (tests/gpu/test_megatron_ep_overlap_gpu.py runs the real
  schedule on 2 GPUs.)
- ``--moe-router-padding-for-quantization``: every local expert's count is a multiple of the FP8 alignment, their sum
  is the rows handed to the experts, and output and grads equal the unpadded run (padding rows carry prob 0).
- ``--moe-latent-size``: the dispatcher moves rows of the latent width (not hidden_size) and the dropless round trip
  holds.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from helpers.mp import run_ranks_on as run_ranks  # noqa: E402

from tests.uccl_moe.megatron._moe_cases import Case, init_parallel, make_config, make_layer  # noqa: E402

pytestmark = [pytest.mark.mp, pytest.mark.timeout(600)]


class _Node:
    """One schedule node: runs `fn` on detached copies of its inputs; backward(grads) returns the inputs' grads."""

    def __init__(self, fn, *inputs):
        self.inputs = [t.detach().requires_grad_(t.requires_grad) for t in inputs]
        out = fn(*self.inputs)
        self.outputs = out if isinstance(out, tuple) else (out,)

    def backward(self, grads):
        pairs = [(o, g) for o, g in zip(self.outputs, grads) if o.requires_grad and g is not None]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return tuple(t.grad for t in self.inputs)


def _nodes_forward(layer, x):
    """Forward of one micro-batch as the four nodes of fine_grained_callables (attention part omitted)."""
    def attn(h):
        probs, routing_map = layer.route(h)
        return layer.preprocess(h, probs, routing_map)

    n_attn = _Node(attn, x)
    n_disp = _Node(layer.dispatch, *n_attn.outputs)
    n_mlp = _Node(lambda t, p: layer.routed_experts_compute(t, p)[0], *n_disp.outputs)
    n_comb = _Node(lambda o: layer.postprocess(layer.combine(o), None), *n_mlp.outputs)
    return [n_attn, n_disp, n_mlp, n_comb]


def _grads(layer):
    return {n: p.grad.detach().clone() for n, p in layer.named_parameters() if p.grad is not None}


def _overlap_rank(rank: int, world: int) -> dict[str, float]:
    import uccl_moe.megatron  # noqa: F401

    case = Case(ep=world, topk=2, aux_loss=False, shared_expert=False)
    init_parallel(case)
    torch.manual_seed(1234)
    layer = make_layer(make_config(case, "uccl"), torch.device("cpu"))
    layer.config.overlap_moe_expert_parallel_comm = True  # (TransformerConfig would also want bf16 for it)
    gen = torch.Generator().manual_seed(40 + rank)
    xa, xb, ga, gb = (torch.randn((case.seq, case.batch, case.hidden), generator=gen, dtype=torch.float32)
                      for _ in range(4))
    # Plain: A then B, each a whole forward/backward.
    plain = {}
    for name, x, g in (("a", xa, ga), ("b", xb, gb)):
        x = x.clone().requires_grad_(True)
        out, _ = layer(x)
        out.backward(g)
        plain[f"out_{name}"], plain[f"xgrad_{name}"] = out.detach(), x.grad
    plain_w = _grads(layer)
    layer.zero_grad()
    # 1F1B overlap order: A forward; then B's forward nodes interleaved with A's backward nodes; then B backward.
    xa_ = xa.clone().requires_grad_(True)
    xb_ = xb.clone().requires_grad_(True)
    a = _nodes_forward(layer, xa_)
    grads_a: tuple = (ga,)
    b_nodes = []

    def attn_b(h):
        probs, routing_map = layer.route(h)
        return layer.preprocess(h, probs, routing_map)

    b_nodes.append(_Node(attn_b, xb_))
    grads_a = a[3].backward(grads_a)
    b_nodes.append(_Node(layer.dispatch, *b_nodes[0].outputs))
    grads_a = a[2].backward(grads_a)
    b_nodes.append(_Node(lambda t, p: layer.routed_experts_compute(t, p)[0], *b_nodes[1].outputs))
    grads_a = a[1].backward(grads_a)
    b_nodes.append(_Node(lambda o: layer.postprocess(layer.combine(o), None), *b_nodes[2].outputs))
    xgrad_a = a[0].backward(grads_a)[0]
    grads_b: tuple = (gb,)
    for node in reversed(b_nodes):
        grads_b = node.backward(grads_b)
    diffs = {
        "out_a": (a[3].outputs[0] - plain["out_a"]).abs().max(),
        "out_b": (b_nodes[3].outputs[0] - plain["out_b"]).abs().max(),
        "xgrad_a": (xgrad_a - plain["xgrad_a"]).abs().max(),
        "xgrad_b": (grads_b[0] - plain["xgrad_b"]).abs().max(),
    }
    got_w = _grads(layer)
    assert set(got_w) == set(plain_w), (sorted(got_w), sorted(plain_w))
    for k, v in plain_w.items():
        diffs[k] = (got_w[k] - v).abs().max()
    return {k: float(v) for k, v in diffs.items()}


def test_ep_overlap_call_pattern_matches_plain_passes():
    for rank, diffs in enumerate(run_ranks(_overlap_rank, 2)):
        bad = {k: v for k, v in diffs.items() if v > 1e-5}
        assert not bad, f"rank {rank}: {bad}"
        assert len(diffs) > 4  # expert and router weights were compared too


def _six(disp, x, routing_map, probs):
    x = x.detach().clone().requires_grad_(True)
    probs = probs.detach().clone().requires_grad_(True)
    h, p = disp.dispatch_preprocess(x, routing_map, probs)
    h, p = disp.token_dispatch(h, p)
    tokens, tokens_per_expert, permuted_probs = disp.dispatch_postprocess(h, p)
    rows = tokens * permuted_probs.unsqueeze(-1).to(tokens.dtype)
    out = disp.combine_postprocess(disp.token_combine(disp.combine_preprocess(rows)))
    out.backward(x.detach())
    return out.detach(), x.grad, probs.grad, tokens_per_expert, tokens.shape[0]


def _routing(num_tokens: int, num_experts: int, topk: int, gen):
    logits = torch.randn((num_tokens, num_experts), generator=gen, dtype=torch.float32)
    sel = torch.topk(logits, topk, dim=1).indices
    routing_map = torch.zeros((num_tokens, num_experts), dtype=torch.bool).scatter_(1, sel, True)
    return routing_map, torch.where(routing_map, torch.softmax(logits, 1), torch.zeros_like(logits))


def _padding_rank(rank: int, world: int, tokens: int) -> dict:
    import uccl_moe.megatron  # noqa: F401

    case = Case(ep=world, topk=2, aux_loss=False)
    init_parallel(case)
    disp = make_layer(make_config(case, "uccl"), torch.device("cpu")).token_dispatcher
    gen = torch.Generator().manual_seed(9 + rank)
    x = torch.randn((tokens, 1, case.hidden), generator=gen, dtype=torch.float32)
    routing_map, probs = _routing(tokens, case.num_experts, case.topk, gen)
    plain = _six(disp, x, routing_map, probs)
    # FP8 with its per-expert padding (TransformerConfig needs TransformerEngine to accept fp8, so set it after).
    disp.config.fp8, disp.config.moe_router_padding_for_quantization = "e4m3", True
    padded = _six(disp, x, routing_map, probs)
    disp.config.fp8, disp.config.moe_router_padding_for_quantization = None, False
    return {
        "plain_counts": plain[3].tolist(), "padded_counts": padded[3].tolist(), "padded_rows": padded[4],
        "diffs": [float((a - b).abs().max()) for a, b in zip(plain[:3], padded[:3])],
    }


@pytest.mark.parametrize("tokens", [64, 6])
def test_router_padding_for_quantization(tokens):
    for rank, res in enumerate(run_ranks(_padding_rank, 2, tokens)):
        plain, padded = res["plain_counts"], res["padded_counts"]
        assert max(res["diffs"]) <= 1e-6, f"rank {rank}: {res}"
        assert sum(padded) == res["padded_rows"], res
        if tokens == 64:  # enough received rows: every count rounded up to the FP8 alignment (16)
            assert all(p % 16 == 0 and p >= c for p, c in zip(padded, plain)) and padded != plain, res
        else:  # too few rows to pad by routing: unchanged (the experts pad their own input, as with flex)
            assert padded == plain, res


def _latent_rank(rank: int, world: int) -> dict:
    import uccl_moe.megatron  # noqa: F401

    case = Case(ep=world, topk=2, aux_loss=False)
    init_parallel(case)
    disp = make_layer(make_config(case, "uccl"), torch.device("cpu")).token_dispatcher
    latent = 24  # != hidden_size 16: MoELayer's fc1_latent_proj output width
    gen = torch.Generator().manual_seed(3 + rank)
    x = torch.randn((8, 2, latent), generator=gen, dtype=torch.float32)
    routing_map, _ = _routing(16, case.num_experts, case.topk, gen)
    probs = routing_map.float() / case.topk
    out, xgrad, _, _, _ = _six(disp, x, routing_map, probs)
    return {"shape": list(out.shape), "fwd": float((out - x).abs().max()), "bwd": float((xgrad - x).abs().max())}


def test_latent_width_rows_round_trip():
    for rank, res in enumerate(run_ranks(_latent_rank, 2)):
        assert res["shape"] == [8, 2, 24] and res["fwd"] < 1e-6 and res["bwd"] < 1e-6, f"rank {rank}: {res}"
