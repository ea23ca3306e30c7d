"""Issue 29: where the dispatchers' host syncs fall in Megatron's combined-1F1B schedule
(``--overlap-moe-expert-parallel-comm``), on CPU, with Megatron's own ``combined_1f1b_schedule_for_no_pipelining``
on no-op stream stand-ins (tests/uccl_moe/megatron/host_sync_log.py says what is recorded and why it matters).

The uccl dispatcher's only device sync in the schedule is the count wait of its dispatch, in the moe_dispatch
forward node, after Megatron enqueued the other micro-batch's expert backward (b.mlp bwd): the node and the point
where Megatron's alltoall (``d2h_event.synchronize()``) and flex + DeepEP (the count wait in ``buffer.dispatch``)
sync. Nothing in the attention, expert or combine nodes, and nothing in a backward node, waits for the device (on
megatron-core 0.16, Megatron's unfused permute synced in the expert node, until _compat.permute took its place).

    python -m pytest -q tests/uccl_moe/megatron/test_overlap_host_syncs.py
    PYTHONPATH=$PWD:$PWD/tests python -m tests.uccl_moe.megatron.host_sync_log   # the per-node table
"""

from __future__ import annotations

import pytest
from helpers.mp import run_ranks_on as run_ranks
from helpers.requires import missing

from tests.uccl_moe.megatron.test_train_gpt_bf16 import ARGS, DISPATCHERS

# Not importorskip: the spawned ranks unpickle this module, and flex must find the deep_ep shim installed before
# Megatron's MoE modules are imported (as in test_flex_shim.py).
pytestmark = [pytest.mark.mp, pytest.mark.timeout(900),
              pytest.mark.skipif(missing("megatron.core") is not None, reason=missing("megatron.core") or "")]

NUM_LAYERS = 2  # ARGS
BUFFER_MADE = "uccl_moe/megatron/buffer_manager.py:get_buffer"  # the Buffer's creation, in the first dispatch
MICROBATCHES = 2  # ARGS: global batch 8 = micro-batch 2 x DP 2 x 2

# The one device sync of each dispatcher in the schedule: (node, kind, caller).
EXPECTED = {
    "uccl": ("moe_dispatch.fwd", "count_wait", "uccl_moe/megatron/autograd.py:forward"),
    "alltoall": ("moe_dispatch.fwd", "event_synchronize",
                 "megatron/core/transformer/moe/token_dispatcher.py:_maybe_dtoh_and_synchronize"),
    "flex_shim": ("moe_dispatch.fwd", "count_wait", "megatron/core/transformer/moe/fused_a2a.py:forward"),
}


def _rank(rank: int, world: int, dispatcher: str) -> dict:
    del rank, world
    if dispatcher == "flex_shim":
        import uccl_moe.deep_ep_compat as shim

        shim.install()
    from tests.uccl_moe.megatron import host_sync_log

    rec = host_sync_log.run_schedule(ARGS + DISPATCHERS[dispatcher])
    syncs = host_sync_log.device_syncs(rec)
    return {
        "table": host_sync_log.render(dispatcher, rec),
        "syncs": [(s.node, s.microbatch, s.kind, s.site) for s in syncs],
        # the node the CPU ran just before each sync's node
        "before": [rec.nodes[s.step - 1] if s.step > 0 else None for s in syncs],
        "nodes": rec.nodes,
    }


@pytest.mark.parametrize("dispatcher", sorted(EXPECTED))
def test_device_syncs_fall_where_megatron_expects_them(dispatcher):
    for rank, got in enumerate(run_ranks(_rank, 2, dispatcher, env={"UCCL_MOE_BACKEND": "reference"})):
        print(f"rank {rank}:\n{got['table']}")
        node, kind, site = EXPECTED[dispatcher]
        ours = [s for s in got["syncs"] if (s[0], s[2], s[3]) == (node, kind, site)]
        # one per layer and micro-batch forward
        assert len(ours) == NUM_LAYERS * MICROBATCHES, (rank, got["syncs"])
        if dispatcher == "uccl":
            # Megatron's own dispatchers sync elsewhere too: alltoall's unfused permute in the attention node on
            # megatron-core <= 0.18 (masked_select), flex + DeepEP's unfused _indices_to_multihot in the expert node.
            # Ours only where the Buffer is made, once per process, in the first dispatch: the group's token counts
            # are exchanged to size it (buffer_manager.get_buffer), before the first count wait.
            others = [s for s in got["syncs"] if (s[0], s[2], s[3]) != (node, kind, site)]
            made = [i for i, s in enumerate(got["syncs"]) if s[3] == BUFFER_MADE]
            assert [s for s in others if s[3] != BUFFER_MADE] == [], (rank, others)
            first_wait = got["syncs"].index(ours[0])
            assert all(i < first_wait and got["syncs"][i][:2] == (node, 0) for i in made), (rank, got["syncs"])
        # Micro-batch 1's forward overlaps micro-batch 0's backward: there its dispatch's sync comes right after
        # Megatron enqueued micro-batch 0's expert backward (b.mlp bwd, on the compute stream), which the GPU runs
        # while the CPU waits.
        overlapped = [(s, b) for s, b in zip(got["syncs"], got["before"]) if s in ours and s[1] == 1]
        assert len(overlapped) == NUM_LAYERS, (rank, got["syncs"])
        for s, before in overlapped:
            assert tuple(before) == ("mlp.bwd", 0), (rank, s, before, got["nodes"])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_unfused_permute_matches_megatrons(seed):
    """_compat.permute(fused=False), sync-free, gives Megatron's unfused permute's rows, probs, indices and grads."""
    import torch
    from megatron.core.transformer.moe.moe_utils import permute as mc_permute

    from uccl_moe.megatron import _compat

    gen = torch.Generator().manual_seed(seed)
    tokens, experts, hidden = 37, 5, 8
    routing_map = torch.rand((tokens, experts), generator=gen) < 0.4
    routing_map[3] = False  # a row routed nowhere (dropped)
    routing_map[:, 2] = False  # an expert with no rows
    num_out = int(routing_map.sum())
    outs = []
    for impl in ("ours", "megatron"):
        x = torch.randn((tokens, hidden), generator=torch.Generator().manual_seed(7)).requires_grad_(True)
        p = torch.rand((tokens, experts), generator=torch.Generator().manual_seed(8)).requires_grad_(True)
        if impl == "ours":
            rows, probs, idx = _compat.permute(x, routing_map, p, num_out, fused=False)
        else:
            rows, probs, idx = mc_permute(x, routing_map, probs=p, num_out_tokens=num_out, fused=False)[:3]
        g = torch.randn(rows.shape, generator=torch.Generator().manual_seed(9))
        gp = torch.randn(probs.shape, generator=torch.Generator().manual_seed(10))
        torch.autograd.backward([rows, probs], [g, gp])
        outs.append((rows.detach(), probs.detach(), idx, x.grad, p.grad))
    for name, a, b in zip(("rows", "probs", "indices", "x.grad", "probs.grad"), *outs):
        assert torch.equal(a, b), name
