"""Native internode path (CPU proxy + loopback transport on GPUs + NVLink forwarding) against the reference backend.

Nodes are emulated on one host (UCCL_MOE_EMULATE_NODES): 2 nodes x 2 GPUs, 4 x 1 and 2 x 1, ranks sharing GPUs
when the machine has fewer. Every check draws fresh random inputs and compares with the reference Buffer on a gloo
group: layout (with tokens per node), received rows (BF16 and FP8 with row/column-major float or int scales), local
expert ids, weights, per-expert counts, source indices, the global rank prefix matrix; cached dispatch;
num_worst_tokens; combine with biases and top-k weights (BF16 tolerance; bitwise identical across runs); the round
trip; group-limited routing; back-to-back calls with a hash check. The same runs again with the loopback's most
aggressive reordering and delays, and a dropped command must surface as CommTimeoutError naming it.

Env: UMOE_TEST_ITERS (back-to-back iterations, default 1000).
"""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist
from helpers.mp import run_shared_gpu_ranks
from test_intranode_native import _Case, _dispatch, _eq, _hash, _split

pytestmark = pytest.mark.gpu

RDMA_BYTES = 1 << 30


def _group_limited(case: _Case, nodes: int, groups: int) -> None:
    """DeepSeek-style routing: each token picks experts only inside its `groups` best nodes."""
    gen = case.gen
    scores = torch.rand((case.T, case.E), generator=gen)
    per_node = scores.view(case.T, nodes, -1).amax(-1)
    keep = torch.topk(per_node, groups, dim=1).indices
    mask = torch.zeros((case.T, nodes), dtype=torch.bool).scatter_(1, keep, True)
    scores = scores * mask.repeat_interleave(case.E // nodes, dim=1)
    case.idx = torch.topk(scores, case.K, dim=1).indices.to(torch.int64)


def _close(got: torch.Tensor, want: torch.Tensor, magnitude: torch.Tensor) -> bool:
    got, want = got.detach().cpu().float(), want.float()
    return bool(((got - want).abs() <= 1e-2 + 1e-2 * want.abs() + magnitude * 2.0 ** -8).all())


def _worker(rank: int, world: int, gloo, nodes: int, iters: int) -> None:
    from uccl_moe import Buffer, Config

    R = world
    torch.manual_seed(rank)
    cfg = Config(24, 8, 256, 6, 128)
    nvl = cfg.get_nvl_buffer_size_hint(7168 * 2, R)
    nat = Buffer(dist.group.WORLD, nvl, RDMA_BYTES, backend="native", explicitly_destroy=True)
    ref = Buffer(gloo, nvl, RDMA_BYTES, backend="reference", explicitly_destroy=True)
    assert nat.topology.num_nodes == nodes, nat.topology
    failures: list[str] = []
    verbose = os.environ.get("UMOE_TEST_VERBOSE", "0") == "1"

    def check(name: str, ok: bool) -> None:
        if verbose:
            print(f"rank {rank}/{R}: {'ok ' if ok else 'BAD'} {name}", flush=True)
        if not ok:
            failures.append(name)

    # name, T, H, experts per rank, K, fp8, scales, routing
    cases = [
        ("bf16", 512, 2048, 8, 8, False, "none", "random"),
        ("bf16-neg", 300 + 17 * rank, 4096, 4, 4, False, "none", "neg"),
        ("bf16-skew", 700, 2048, 8, 8, False, "none", "skew"),
        ("bf16-empty-last", 256, 2048, 8, 4, False, "none", "empty_last"),
        ("bf16-group-limited", 640, 2048, 8, 8, False, "none", "group"),
        ("bf16-odd-hidden", 333, 2056, 4, 3, False, "none", "random"),
        ("bf16-1-token", 1, 2048, 4, 4, False, "none", "random"),
        ("bf16-7168", 1024, 7168, 16, 8, False, "none", "random"),
        ("fp8-row", 600, 4096, 8, 8, True, "row", "random"),
        ("fp8-col", 600, 7168, 8, 8, True, "col", "neg"),
        ("fp8-int", 400, 2048, 8, 8, True, "int", "random"),
    ]
    for seed, (name, T, H, per_rank, K, fp8, smode, routing) in enumerate(cases):
        E = per_rank * R
        case = _Case(rank, R, T, H, E, K, fp8, smode, "random" if routing == "group" else routing, seed + 100)
        if routing == "group":
            _group_limited(case, nodes, 1 if nodes == 2 else 2)
        lay_n = nat.get_dispatch_layout(case.idx.cuda(), E)
        lay_r = ref.get_dispatch_layout(case.idx, E)
        check(f"{name}: layout", _eq(lay_n.num_tokens_per_rank, lay_r.num_tokens_per_rank)
              and _eq(lay_n.num_tokens_per_expert, lay_r.num_tokens_per_expert)
              and _eq(lay_n.is_token_in_rank, lay_r.is_token_in_rank)
              and _eq(lay_n.num_tokens_per_rdma_rank, lay_r.num_tokens_per_rdma_rank))
        _, rn = _dispatch(nat, case, "cuda", config=cfg)
        _, rr = _dispatch(ref, case, "cpu", config=cfg)
        xn, sn = _split(rn.recv_x)
        xr, sr = _split(rr.recv_x)
        check(f"{name}: recv_x", _eq(xn, xr))
        check(f"{name}: recv scales", _eq(sn, sr))
        check(f"{name}: recv_topk_idx", _eq(rn.recv_topk_idx, rr.recv_topk_idx))
        check(f"{name}: recv_topk_weights", _eq(rn.recv_topk_weights, rr.recv_topk_weights))
        check(f"{name}: per-expert counts", rn.num_recv_tokens_per_expert_list == rr.num_recv_tokens_per_expert_list)
        check(f"{name}: rank_prefix_matrix", _eq(rn.handle[0], rr.handle[0]))
        check(f"{name}: recv_src_idx", _eq(rn.handle[3], rr.handle[3]))
        if routing == "empty_last" and rank == R - 1:
            check(f"{name}: last rank receives nothing", xn.shape[0] == 0)
        cn = nat.dispatch(case.xin("cuda"), handle=rn.handle, config=cfg)
        cx, cs = _split(cn.recv_x)
        check(f"{name}: cached recv_x", _eq(cx, xn) and _eq(cs, sn))
        worst = T * R if name != "bf16-neg" else 400 * R
        _, wn = _dispatch(nat, case, "cuda", config=cfg, num_worst_tokens=worst)
        wx, ws = _split(wn.recv_x)
        n = xn.shape[0]
        check(f"{name}: worst shape/list", wx.shape[0] == worst and wn.num_recv_tokens_per_expert_list == [])
        check(f"{name}: worst prefix", _eq(wx[:n], xn) and _eq(wn.recv_topk_idx[:n], rn.recv_topk_idx)
              and _eq(wn.recv_topk_weights[:n], rn.recv_topk_weights) and (ws is None or _eq(ws[:n], sn))
              and _eq(wn.handle[3][:n], rn.handle[3]))
        check(f"{name}: worst tail -1", bool((wn.recv_topk_idx[n:] == -1).all()) and
              bool((wn.recv_topk_weights[n:] == 0).all()) and bool((wn.handle[3][n:] == -1).all()))
        if fp8:
            continue
        y = torch.randn((n, H), generator=case.gen).bfloat16()
        b0 = torch.randn((T, H), generator=case.gen).bfloat16()
        b1 = torch.randn((T, H), generator=case.gen).bfloat16()
        on = nat.combine(y.cuda(), rn.handle, topk_weights=rn.recv_topk_weights, bias=(b0.cuda(), b1.cuda()),
                         config=cfg)
        orf = ref.combine(y, rr.handle, topk_weights=rr.recv_topk_weights, bias=(b0, b1), config=cfg)
        # Partials are rounded to BF16 once per node before the cross-node sum (as DeepEP does): allow that
        # rounding (2^-8 of the copies' magnitude) on top of the intranode tolerance.
        mag = ref.combine(y.abs(), rr.handle, config=cfg).combined_x.float()
        check(f"{name}: combine vs reference", _close(on.combined_x, orf.combined_x, mag))
        check(f"{name}: combine weights", torch.allclose(on.combined_topk_weights.cpu(), orf.combined_topk_weights,
                                                         rtol=1e-5, atol=1e-5))
        check(f"{name}: combine without extras", _close(nat.combine(y.cuda(), rn.handle, config=cfg).combined_x,
                                                        ref.combine(y, rr.handle, config=cfg).combined_x, mag))
        first = on.combined_x.clone()
        same = all(torch.equal(nat.combine(y.cuda(), rn.handle, topk_weights=rn.recv_topk_weights,
                                           bias=(b0.cuda(), b1.cuda()), config=cfg).combined_x, first)
                   for _ in range(5))
        check(f"{name}: combine bitwise identical x5", same)
        yw = torch.cat([y.cuda(), torch.randn((worst - n, H), device="cuda").bfloat16()])
        ow = nat.combine(yw, wn.handle, topk_weights=wn.recv_topk_weights, bias=(b0.cuda(), b1.cuda()), config=cfg)
        check(f"{name}: combine via worst handle", torch.equal(ow.combined_x, first))
        back = nat.combine(xn, rn.handle, config=cfg).combined_x.float().cpu()
        cnt = lay_r.is_token_in_rank.sum(1, keepdim=True).float()
        check(f"{name}: round trip", torch.allclose(back, case.x.float() * cnt, rtol=2e-2, atol=2e-2))

    # Back-to-back: dispatch + combine + cached dispatch `iters` times; hashes must not move, memory must not grow.
    case = _Case(rank, R, 1024, 2048, 8 * R, 8, False, "none", "random", 7)
    idx, w, x = case.idx.cuda(), case.w.cuda(), case.x.cuda()
    lay = nat.get_dispatch_layout(idx, 8 * R)
    h0 = None
    mem0 = None
    bad = torch.zeros((), dtype=torch.int64, device="cuda")
    for it in range(iters):
        r = nat.dispatch(x, num_tokens_per_rank=lay.num_tokens_per_rank, is_token_in_rank=lay.is_token_in_rank,
                         num_tokens_per_expert=lay.num_tokens_per_expert, topk_idx=idx, topk_weights=w, config=cfg)
        c = nat.combine(r.recv_x, r.handle, topk_weights=r.recv_topk_weights, config=cfg)
        cd = nat.dispatch(c.combined_x, handle=r.handle, config=cfg)
        h = torch.stack([_hash(r.recv_x), _hash(c.combined_x), _hash(c.combined_topk_weights.view(torch.int16)),
                         _hash(cd.recv_x)])
        if h0 is None:
            h0 = h
        bad += (h != h0).sum()
        if it == 10:
            torch.cuda.synchronize()
            mem0 = torch.cuda.memory_allocated()
    torch.cuda.synchronize()
    check(f"{iters} back-to-back calls: hash stable", int(bad) == 0)
    grown = torch.cuda.memory_allocated() - mem0 if mem0 is not None else 0
    check(f"{iters} back-to-back calls: no memory growth ({grown} B)", grown <= 2 << 20)
    stats = nat._backend._inter.proxy_counters()  # type: ignore[attr-defined]
    if verbose:
        print(f"rank {rank}: proxy counters {stats}", flush=True)
    check("proxy carried the traffic", stats["writes"] > 0 and stats["applied_updates"] > 0)

    dist.barrier(group=gloo)
    nat.destroy()
    ref.destroy()
    assert not failures, f"rank {rank}: {len(failures)} checks failed: {failures}"


_BASE_ENV = {"UCCL_MOE_PROXY_THREADS": "2", "UCCL_MOE_TIMEOUT_S": "60"}
_REORDER_ENV = {"UCCL_MOE_LOOPBACK_REORDER_WINDOW": "64", "UCCL_MOE_LOOPBACK_DELAY_US": "300",
                "UCCL_MOE_LOOPBACK_SEED": "7", "UCCL_MOE_MAX_INFLIGHT_WRITES": "16"}


@pytest.mark.parametrize("world,nodes,reorder", [(4, 2, False), (4, 4, False), (2, 2, False), (4, 2, True),
                                                 (4, 4, True)])
def test_native_internode_matches_reference(world: int, nodes: int, reorder: bool) -> None:
    iters = int(os.environ.get("UMOE_TEST_ITERS", "1000"))
    if reorder:
        iters = min(iters, 100)
    env = {**_BASE_ENV, "UCCL_MOE_EMULATE_NODES": str(nodes), **(_REORDER_ENV if reorder else {})}
    run_shared_gpu_ranks(_worker, world, nodes, iters, env=env, timeout_s=1200)


# ------------------------------------------------------------------------------------------------ a dropped command
def _drop_worker(rank: int, world: int, gloo) -> None:
    from uccl_moe import Buffer, CommTimeoutError, Config

    cfg = Config(24, 8, 256, 6, 128)
    nat = Buffer(dist.group.WORLD, cfg.get_nvl_buffer_size_hint(2048 * 2, world), RDMA_BYTES, backend="native",
                 explicitly_destroy=True)
    case = _Case(rank, world, 256, 2048, 4 * world, 4, False, "none", "random", 5)
    messages: list[str] = []
    for _ in range(6):
        try:
            _, r = _dispatch(nat, case, "cuda", config=cfg)
            nat.combine(r.recv_x, r.handle, config=cfg)
            torch.cuda.synchronize()
        except CommTimeoutError as e:
            messages.append(str(e))
            break
    time.sleep(3)  # the proxy's own timeout check names the lost command
    try:
        nat.get_dispatch_layout(case.idx.cuda(), 4 * world)
    except CommTimeoutError as e:
        messages.append(str(e))
    everyone: list = [None] * world
    dist.all_gather_object(everyone, messages, group=gloo)
    assert all(m for m in everyone), f"a rank never raised CommTimeoutError: {everyone}"
    assert any("lost command" in msg and ("WRITE" in msg or "ATOMIC" in msg) for m in everyone for msg in m), everyone
    dist.barrier(group=gloo)
    nat.destroy()


def test_native_internode_dropped_command_raises() -> None:
    env = {**_BASE_ENV, "UCCL_MOE_EMULATE_NODES": "2", "UCCL_MOE_TIMEOUT_S": "4",
           "UCCL_MOE_LOOPBACK_DROP_EVERY": "5"}
    run_shared_gpu_ranks(_drop_worker, 2, env=env, timeout_s=300)
