"""The native backend checks topk_idx ranges on the GPU (UCCL_MOE_CHECK_INPUTS, on by default) without a device sync.

A rank whose routing holds an id outside [-1, E) gets InvalidUsageError naming the id, token and k from the dispatch
(once every rank has enqueued it); its peers' dispatch is the one of the routing with that id as -1; a following
correct dispatch matches the reference backend, and a layout + cached dispatch + combine of valid ids performs no
host sync. Two ranks, which may share one GPU; fresh random inputs each round (-1s included)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from helpers.mp import run_shared_gpu_ranks

pytestmark = pytest.mark.gpu

T, H, K = 256, 1024, 4


def _inputs(rank: int, E: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed * 977 + rank)
    idx = torch.topk(torch.rand((T, E), generator=gen) + 0.1, K, dim=1).indices.to(torch.int64)
    idx[torch.rand(idx.shape, generator=gen) < 0.2] = -1
    return idx, torch.rand((T, K), generator=gen), torch.randn((T, H), generator=gen).bfloat16()


def _dispatch(buf, E: int, layout_idx, idx, w, x, dev: str):
    """Layout of `layout_idx`, then dispatch of `idx` (one device tensor when they are the same tensor, as a client
    passes one routing to both)."""
    idx_d = idx.to(dev)
    lay = buf.get_dispatch_layout(idx_d if layout_idx is idx else layout_idx.to(dev), E)
    return buf.dispatch(x.to(dev), num_tokens_per_rank=lay.num_tokens_per_rank, is_token_in_rank=lay.is_token_in_rank,
                        num_tokens_per_expert=lay.num_tokens_per_expert, topk_idx=idx_d, topk_weights=w.to(dev))


def _same(nat, ref) -> list[str]:
    """Names of the dispatch outputs where the native result differs from the reference one."""
    bad = []
    for name, a, b in (("recv_x", nat.recv_x, ref.recv_x), ("recv_topk_idx", nat.recv_topk_idx, ref.recv_topk_idx),
                       ("recv_topk_weights", nat.recv_topk_weights, ref.recv_topk_weights),
                       ("rank_prefix_matrix", nat.handle[0], ref.handle[0]),
                       ("recv_src_idx", nat.handle[3], ref.handle[3])):
        if not torch.equal(a.cpu(), b.cpu()):
            bad.append(name)
    if nat.num_recv_tokens_per_expert_list != ref.num_recv_tokens_per_expert_list:
        bad.append("per-expert counts")
    return bad


def _worker(rank: int, world: int, gloo) -> None:
    from uccl_moe import Buffer, InvalidUsageError, _checks, utils

    E = 8 * world
    nvl = max(Buffer.get_dispatch_config(world).get_nvl_buffer_size_hint(H * 2, world),
              Buffer.get_combine_config(world).get_nvl_buffer_size_hint(H * 2, world))
    nat = Buffer(dist.group.WORLD, nvl, backend="native", explicitly_destroy=True)
    ref = Buffer(gloo, nvl, backend="reference", explicitly_destroy=True)
    failures: list[str] = []
    # Round 1: rank 0's routing holds E + 5, seen by the layout kernel. Round 2: the last rank's dispatch gets -7
    # in a topk_idx the layout never read (its layout had -1 there), seen by the dispatch's own check kernel.
    for seed, bad_rank, value, in_layout in ((1, 0, E + 5, True), (2, world - 1, -7, False)):
        idx, w, x = _inputs(rank, E, seed)
        gen = torch.Generator().manual_seed(seed)
        t, k = int(torch.randint(T, (1,), generator=gen)), int(torch.randint(K, (1,), generator=gen))
        clean = idx.clone()
        clean[t, k] = -1
        given = clean.clone()
        if rank == bad_rank:
            given[t, k] = value
        want = _dispatch(ref, E, clean, clean, w, x, "cpu")  # what every rank's dispatch is: the id taken as -1
        try:
            got = _dispatch(nat, E, given if in_layout else clean.clone(), given, w, x, "cuda")
        except InvalidUsageError as e:
            text = f"expert id {value}, outside [-1, {E}) (token {t}, k {k})"
            if rank != bad_rank or text not in str(e):
                failures.append(f"round {seed}: unexpected {e!r} (wanted {text!r} on rank {bad_rank} only)")
        else:
            if rank == bad_rank:
                failures.append(f"round {seed}: the dispatch of id {value} at ({t}, {k}) raised nothing")
            failures += [f"round {seed}: peer's {n}" for n in _same(got, want)]
        torch.cuda.synchronize()
    # Round 3: valid ids on every rank after the errors: dispatch, cached dispatch and combine match the reference.
    idx, w, x = _inputs(rank, E, 3)
    got, want = _dispatch(nat, E, idx, idx, w, x, "cuda"), _dispatch(ref, E, idx, idx, w, x, "cpu")
    failures += [f"after the errors: {n}" for n in _same(got, want)]
    if not torch.equal(nat.dispatch(x.cuda(), handle=got.handle).recv_x.cpu(), want.recv_x):
        failures.append("after the errors: cached recv_x")
    y = torch.randn(want.recv_x.shape, generator=torch.Generator().manual_seed(rank)).bfloat16()
    cn, cr = nat.combine(y.cuda(), got.handle).combined_x, ref.combine(y, want.handle).combined_x
    if not torch.allclose(cn.cpu().float(), cr.float(), rtol=1e-2, atol=1e-2):
        failures.append("after the errors: combine")

    # No host sync for the check: layout, cached dispatch and combine of valid ids with torch's sync detector set to
    # raise and the library's pinned-copy reads (how the host check read the ids) refused.
    def no_read(t):
        raise AssertionError("a host read of device values")

    saved = (_checks.host_ints, utils.host_ints)
    _checks.host_ints = utils.host_ints = no_read
    try:
        idx, w, x = _inputs(rank, E, 4)
        idx_d, x_d, y_d = idx.cuda(), x.cuda(), y.cuda()  # host-to-device copies of pageable memory sync: before
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            nat.get_dispatch_layout(idx_d, E)
            nat.dispatch(x_d, handle=got.handle)
            nat.combine(y_d, got.handle)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    except (AssertionError, RuntimeError) as e:
        failures.append(f"a sync in layout/cached dispatch/combine: {e!r}")
    finally:
        _checks.host_ints, utils.host_ints = saved
    torch.cuda.synchronize()
    dist.barrier(group=gloo)
    nat.destroy()
    ref.destroy()
    assert not failures, f"rank {rank}: {failures}"


def test_bad_topk_ids_raise_from_the_device_without_a_sync() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (run on a GPU machine: tools/device)")
    run_shared_gpu_ranks(_worker, 2, timeout_s=300)

