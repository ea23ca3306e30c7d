"""CPU check of the internode offset arithmetic (uccl_moe.backends.internode.plan_offsets / row_map_of).

Simulates every rank of N nodes x G GPUs with random routing (some tokens to no rank, a rank that receives nothing)
and follows each (token, node) pair through pack, post, forward and combine with the offsets each rank computes on
its own: every staged row must land in a distinct slot of the forwarder's x' inside the segment of its origin node,
combine must read back exactly the partial the forwarder produced for that pair, and row_map must put every
received row at its reference position (blocks by global source rank, tokens in order).
"""

from __future__ import annotations

import pytest
import torch

from uccl_moe.backends.internode import plan_offsets, row_map_of


def _ranks(N: int, G: int, seed: int) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    R = N * G
    in_rank = []
    for _ in range(R):
        T = int(torch.randint(0, 40, (1,), generator=gen))
        m = torch.rand((T, R), generator=gen) < 0.3
        m[:, R - 1] = False  # the last rank receives nothing
        in_rank.append(m)
    matrix = torch.stack([m.sum(0) for m in in_rank]).to(torch.int64)
    ncnt = torch.stack([m.view(-1, N, G).any(-1).sum(0) for m in in_rank]).to(torch.int64)
    return in_rank, matrix, ncnt


@pytest.mark.parametrize("N,G,seed", [(2, 1, 0), (2, 2, 1), (4, 1, 2), (3, 2, 3), (2, 4, 4), (5, 3, 5)])
def test_offsets_route_every_pair_consistently(N: int, G: int, seed: int) -> None:
    in_rank, matrix, ncnt = _ranks(N, G, seed)
    R = N * G
    plans = [plan_offsets(matrix, ncnt, in_rank[r].view(-1, N, G).any(-1), N, G, r) for r in range(R)]
    for o in plans:
        assert all(v.is_contiguous() for v in o.values()), "kernels index these tensors as plain arrays"
    # x'[f] as filled by pack (own node) and post (others): slot -> (origin rank, token)
    xp: list[dict[int, tuple[int, int]]] = [{} for _ in range(R)]
    for s in range(R):
        o, m, local = plans[s], s // G, s % G
        in_node = in_rank[s].view(-1, N, G).any(-1)
        for t in range(in_rank[s].shape[0]):
            for n in range(N):
                pos = int(o["send_pos"][t, n])
                assert (pos >= 0) == bool(in_node[t, n])
                if pos < 0:
                    continue
                f = n * G + local
                if n == m:
                    row = int(o["pack_dst_row"][n]) + pos  # straight into our receive area
                else:
                    assert int(o["pack_dst_row"][n]) == int(o["send_row0"][n])
                    assert pos < int(o["send_rows"][n])
                    row = int(o["peer_row0"][n]) + pos     # where post puts send-area row send_row0 + pos
                assert row not in xp[f], (s, t, n, row)
                xp[f][row] = (s, t)
                fo = plans[f]
                lo = int(fo["seg_row0"][m])
                assert lo <= row < lo + int(fo["seg_rows"][m]), "row outside the origin node's segment"
                # combine: forwarder f posts segment m back to s at back_row0[m]; s reads part_row0[n] + pos
                if n == m:
                    assert int(o["part_row0"][n]) + pos == row
                else:
                    assert int(o["part_row0"][n]) + pos == int(fo["back_row0"][m]) + (row - lo)
    for f in range(R):
        assert sorted(xp[f]) == list(range(int(plans[f]["num_xp"]))), "x' has holes or overflows"
    # Forwarding order at receiver d: local source j, then origin node m, then x' order; row_map -> reference order.
    for d in range(R):
        o = plans[d]
        fwd = [(s, t) for j in range(G) for _, (s, t) in sorted(xp[(d // G) * G + j].items())
               if in_rank[s][t, d]]
        fwd.sort(key=lambda st: ((st[0] % G), st[0] // G))  # stable: keeps x' order inside (j, m)
        ref = sorted(fwd)
        assert int(o["num_recv"]) == len(ref)
        rm = row_map_of(o, len(ref) + 3)  # + padding rows of num_worst_tokens map to themselves
        assert [ref[int(rm[i])] for i in range(len(ref))] == fwd
        assert rm[len(ref):].tolist() == list(range(len(ref), len(ref) + 3))
        assert o["fwd_counts"].tolist() == [sum(int(matrix[m * G + d % G, (d // G) * G + g]) for m in range(N))
                                            for g in range(G)]
    # capacity needs: x' rows of each rank and send-area rows of each rank
    for r in range(R):
        assert int(plans[0]["xp_need"][r]) == int(plans[r]["num_xp"])
        assert int(plans[0]["send_need"][r]) == int(plans[r]["send_rows"].sum())


def test_rdma_bytes_for_never_below_the_runtime_minimum() -> None:
    """The RDMA runtime refuses num_rdma_bytes below four notify regions (rdma_runtime.cu); rdma_bytes_for must not
    hand out less for small batches (no kernels needed to check the arithmetic)."""
    from uccl_moe.backends.internode import _NOTIFY_RESERVE, MIN_RDMA_BYTES, rdma_bytes_for

    assert MIN_RDMA_BYTES == 4 * _NOTIFY_RESERVE == 16 << 20
    for T, H, K, N in ((1, 2048, 1, 2), (64, 7168, 4, 2), (128, 7168, 8, 4)):
        b = rdma_bytes_for(T, H, K, N)
        assert b >= MIN_RDMA_BYTES and b % 4096 == 0
    assert rdma_bytes_for(4096, 7168, 8, 2) > MIN_RDMA_BYTES  # big batches are sized by their rows


@pytest.mark.parametrize("T,H,K,N,scales", [(4096, 7168, 8, 2, 0), (4096, 7168, 8, 4, 56), (1, 2048, 1, 2, 0),
                                            (64, 7168, 4, 2, 0), (16384, 4096, 6, 8, 32)])
def test_rdma_bytes_for_holds_the_worst_staging(T: int, H: int, K: int, N: int, scales: int) -> None:
    from uccl_moe import _C
    from uccl_moe.backends.internode import MIN_RDMA_BYTES, rdma_bytes_for

    if not _C.has_internode_kernels():
        pytest.skip("this build has no internode kernels (no GPU compiler at build time)")
    b = rdma_bytes_for(T, H, K, N, scales)
    assert b % 4096 == 0
    row_bytes = H * (1 if scales else 2)
    assert _C.internode_dispatch_layout(b, row_bytes, scales, K, 1)["cap"] >= N * T
    assert _C.internode_combine_layout(b, H, K)["cap"] >= N * T
    assert b >= MIN_RDMA_BYTES, "below the RDMA runtime's minimum: Buffer would refuse it"
    assert b <= max(2 * (N * T + 16) * (2 * H + 12 * K + 4 * scales + 8) + (8 << 20), MIN_RDMA_BYTES), \
        "no gross over-allocation"


def test_cached_dispatch_refuses_rows_wider_than_the_rdma_areas() -> None:
    """A cached dispatch restages its handle's rows at x's width: where the dispatch knew the most rows any rank
    stages (the same on every rank), rows that no longer fit (float32 after BF16) are refused on every rank before
    anything is staged, with the size to use; where it did not (num_worst_tokens), the device check stays. A combine
    is refused by the largest x' of any rank."""
    from types import SimpleNamespace

    from uccl_moe import _C
    from uccl_moe.backends.internode import InternodePath, rdma_bytes_for
    from uccl_moe.errors import InvalidUsageError

    if not _C.has_internode_kernels():
        pytest.skip("this build has no internode kernels (no GPU compiler at build time)")
    path = object.__new__(InternodePath)  # only the host-side check: no runtime
    path.ctx = SimpleNamespace(num_rdma_bytes=rdma_bytes_for(64, 7168, 4, 2))
    path.G, path.me = 1, 0
    bf16_cap = _C.internode_dispatch_layout(path.ctx.num_rdma_bytes, 7168 * 2, 0, 0, 1)["cap"]
    f32_cap = _C.internode_dispatch_layout(path.ctx.num_rdma_bytes, 7168 * 4, 0, 0, 1)["cap"]
    assert f32_cap < bf16_cap
    plan = SimpleNamespace(staged_need=bf16_cap)
    path._check_cached(plan, torch.empty((1, 7168), dtype=torch.bfloat16), None)  # the dispatch's own width fits
    with pytest.raises(InvalidUsageError, match=f"stages up to {bf16_cap} rows.*holds {f32_cap} rows.*wider than"):
        path._check_cached(plan, torch.empty((1, 7168), dtype=torch.float32), None)
    plan.staged_need = 0  # not known on the host (num_worst_tokens)
    path._check_cached(plan, torch.empty((1, 7168), dtype=torch.float32), None)
    # combine: refused by the largest x' of any rank (the same everywhere), not this rank's own
    comb_cap = _C.internode_combine_layout(path.ctx.num_rdma_bytes, 7168, 8)["cap"]
    plan = SimpleNamespace(max_xp=comb_cap, xp_rows=1)
    assert path._combine_layout(plan, 7168, 8)["cap"] == comb_cap
    plan.max_xp = comb_cap + 1
    with pytest.raises(InvalidUsageError, match=f"combine stages up to {comb_cap + 1} rows.*holds {comb_cap} rows"):
        path._combine_layout(plan, 7168, 8)
