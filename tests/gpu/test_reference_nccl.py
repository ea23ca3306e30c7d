"""The reference backend on NCCL (real comm stream, events, async_finish) equals the same run on gloo/CPU."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from helpers.mp import run_gpu_ranks

pytestmark = pytest.mark.gpu


def _compare(rank: int, world: int, gloo) -> None:
    from uccl_moe import Buffer

    H, E, K, T = 512, 4 * world, 4, 300 + 50 * rank
    nvl = Buffer.get_dispatch_config(world).get_nvl_buffer_size_hint(H * 2, world)
    gpu = Buffer(dist.group.WORLD, nvl, backend="reference")
    cpu = Buffer(gloo, nvl, backend="reference")
    assert gpu.get_comm_stream() is not None and cpu.get_comm_stream() is None
    gen = torch.Generator().manual_seed(rank)
    idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    idx[torch.rand(idx.shape, generator=gen) < 0.2] = -1
    w = torch.rand(idx.shape, generator=gen)
    x = torch.randn((T, H), generator=gen).bfloat16()
    outs = []
    for buf, dev in ((gpu, "cuda"), (cpu, "cpu")):
        i, ww, xx = idx.to(dev), w.to(dev), x.to(dev)
        prev = Buffer.capture()
        lay = buf.get_dispatch_layout(i, E, previous_event=prev, async_finish=True, allocate_on_comm_stream=True)
        lay.event.current_stream_wait()
        res = buf.dispatch(xx, num_tokens_per_rank=lay.num_tokens_per_rank, is_token_in_rank=lay.is_token_in_rank,
                           num_tokens_per_expert=lay.num_tokens_per_expert, topk_idx=i, topk_weights=ww,
                           previous_event=Buffer.capture(), async_finish=True, allocate_on_comm_stream=True)
        with res.event:  # overlap region: compute on the current stream while comm runs
            scale = torch.full((1,), rank + 1.0, device=dev)
        res.event.current_stream_wait()
        back = (res.recv_x.float() * scale).bfloat16()
        comb = buf.combine(back, res.handle, topk_weights=res.recv_topk_weights, async_finish=True,
                           previous_event=Buffer.capture())
        comb.event.current_stream_wait()
        cached = buf.dispatch(xx, handle=res.handle)
        outs.append([res.recv_x, res.recv_topk_idx, res.recv_topk_weights, comb.combined_x, comb.combined_topk_weights,
                     cached.recv_x, *res.handle])
        assert res.num_recv_tokens_per_expert_list is not None
    torch.cuda.synchronize()
    for a, b in zip(*outs):
        assert torch.equal(a.cpu(), b), (rank, a.shape, b.shape)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_reference_on_nccl_equals_gloo(world: int) -> None:
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    run_gpu_ranks(_compare, world)
