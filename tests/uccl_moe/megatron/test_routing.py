"""routing_to_topk: Megatron's dense routing -> the TPxEP comm group's top-k (single process, no comm)."""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core", reason='megatron-core is not installed: pip install -e ".[train]"')

import torch  # noqa: E402

from uccl_moe.megatron.buffer_manager import buffer_sizes, hidden_bytes_of  # noqa: E402
from uccl_moe.megatron.dispatcher import routing_to_topk  # noqa: E402


def _routing(num_tokens, num_experts, topk, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_tokens, num_experts, generator=g)
    sel = torch.topk(logits, topk, dim=1).indices
    rm = torch.zeros(num_tokens, num_experts, dtype=torch.bool).scatter_(1, sel, True)
    probs = torch.where(rm, torch.softmax(logits, 1), torch.zeros_like(logits))
    return rm, probs


def test_ep_only_matches_routing_map():
    rm, probs = _routing(10, 8, 2)
    idx, w = routing_to_topk(rm, probs, tp_size=1, ep_size=4, num_local_experts=2, topk=2)
    assert idx.dtype == torch.int64 and w.dtype == torch.float32 and idx.shape == (10, 2)
    for t in range(10):
        assert sorted(idx[t].tolist()) == torch.nonzero(rm[t]).flatten().tolist()
        assert torch.equal(w[t], probs[t, idx[t]].float())


def test_expert_tp_copies_each_expert_to_every_tp_rank():
    # EP 2 x TP 2, 2 local experts: comm expert id = (ep * TP + tp) * L + l
    rm, probs = _routing(6, 4, 1)
    idx, w = routing_to_topk(rm, probs, tp_size=2, ep_size=2, num_local_experts=2, topk=1)
    assert idx.shape == (6, 2)
    for t in range(6):
        e = int(torch.nonzero(rm[t]))
        ep, local = divmod(e, 2)
        assert idx[t].tolist() == [(ep * 2 + 0) * 2 + local, (ep * 2 + 1) * 2 + local]
        assert torch.equal(w[t], probs[t, e].float().repeat(2))


def test_dropped_slots_are_minus_one_with_zero_weight():
    rm, probs = _routing(5, 4, 2)
    rm[0] = False  # token 0 dropped everywhere (capacity)
    rm[1, torch.nonzero(rm[1])[0]] = False  # token 1 lost one of its experts
    probs = probs * rm
    idx, w = routing_to_topk(rm, probs, tp_size=1, ep_size=2, num_local_experts=2, topk=2)
    assert idx[0].tolist() == [-1, -1] and w[0].tolist() == [0.0, 0.0]
    assert (idx[1] == -1).sum() == 1 and w[1][idx[1] == -1].item() == 0.0


def test_weights_are_differentiable_to_probs():
    rm, probs = _routing(4, 4, 2)
    probs = probs.double().requires_grad_(True)
    _, w = routing_to_topk(rm, probs, tp_size=1, ep_size=2, num_local_experts=2, topk=2)
    w.sum().backward()
    assert torch.equal(probs.grad, rm.double())


def test_hidden_bytes_and_size_hint_defaults():
    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    assert hidden_bytes_of(x) == 128
    assert hidden_bytes_of(x.float()) == 256
    assert hidden_bytes_of(torch.zeros(1, 64, dtype=torch.float8_e4m3fn)) == 128
    nvl, rdma = buffer_sizes(2, 128, 4096, 0)
    assert (nvl, rdma) == (4096, 0)
    nvl, rdma = buffer_sizes(2, 128, None, None)
    from uccl_moe import Buffer

    configs = (Buffer.get_dispatch_config(2), Buffer.get_combine_config(2))
    want = max(c.get_nvl_buffer_size_hint(128, 2) for c in configs)
    assert nvl == want > 0 and rdma == 0
    # Two nodes of one rank: the hints of that layout, with an RDMA buffer.
    nvl, rdma = buffer_sizes(2, 128, None, None, ranks_per_node=1)
    assert nvl == max(c.get_nvl_buffer_size_hint(128, 2, 1) for c in configs)
    assert rdma == max(c.get_rdma_buffer_size_hint(128, 2, 1) for c in configs) > 0
    # ... and with a token count, room to stage any routing of them (2 nodes x 4096 tokens of hidden 7168, top-8).
    from uccl_moe import _C

    _, rdma = buffer_sizes(4, 7168 * 2, None, None, ranks_per_node=2, max_tokens=4096, num_topk=8)
    assert rdma % 4096 == 0
    assert _C.internode_dispatch_layout(rdma, 7168 * 2, 0, 8, 2)["cap"] >= 2 * 4096
    assert _C.internode_combine_layout(rdma, 7168, 8)["cap"] >= 2 * 4096
    assert buffer_sizes(4, 7168 * 2, None, 123, ranks_per_node=2, max_tokens=4096, num_topk=8)[1] == 123
