"""The Buffer API end to end on CPU: 2-4 spawned ranks over gloo, the reference backend, checked against plain torch.

Run:  python examples/buffer_cpu_gloo.py [--ranks 2]      (prints "buffer_cpu_gloo OK ..." on success)

What it shows, in the order a MoE layer uses it:
  1. get_dispatch_layout: per-rank and per-expert counts from the router's top-k expert ids.
  2. dispatch (BF16): each token goes to every rank that holds one of its experts; returns the handle.
  3. dispatch (FP8 tuple): (x_fp8, scales) move together; the received scales dequantize the received rows.
  4. cached dispatch: a second tensor with the same routing, through the handle (no layout, no count exchange).
  5. combine with weights: the experts' outputs go back to their tokens and are summed; topk_weights sum too.
Every result is compared with the same computation done in plain torch from all ranks' inputs.

`moe_round_trip` takes the device and group, so examples/buffer_gpu.py runs the same code on GPUs.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TOKENS = 64  # tokens per rank
HIDDEN = 256  # multiple of 128: one FP8 scale per 128 channels
EXPERTS_PER_RANK = 4
TOPK = 4


def gather_all(t: torch.Tensor, group: dist.ProcessGroup) -> list[torch.Tensor]:
    """Every rank's copy of a same-shaped tensor, in rank order (plain torch.distributed, for the check)."""
    parts = [torch.empty_like(t) for _ in range(group.size())]
    dist.all_gather(parts, t, group=group)
    return parts


def expected_rows(me: int, xs: list[torch.Tensor], idxs: list[torch.Tensor]) -> torch.Tensor:
    """Rows rank `me` receives: source ranks in order, each source's tokens in order, those with an expert on `me`."""
    rows = []
    for x, idx in zip(xs, idxs):
        mine = ((idx // EXPERTS_PER_RANK == me) & (idx >= 0)).any(dim=1)
        rows.append(x[mine])
    return torch.cat(rows)


def moe_round_trip(rank: int, world: int, device: torch.device, group: dist.ProcessGroup) -> str:
    from uccl_moe import Buffer

    num_experts = EXPERTS_PER_RANK * world
    gen = torch.Generator().manual_seed(rank)

    # Router output: top-k expert ids ([T, K] int64, -1 = unused slot) and their weights ([T, K] float32).
    scores = torch.rand(TOKENS, num_experts, generator=gen)
    topk_weights, topk_idx = scores.topk(TOPK, dim=1)
    topk_idx[torch.rand(TOKENS, TOPK, generator=gen) < 0.1] = -1  # a few unused slots
    topk_idx, topk_weights = topk_idx.to(device), topk_weights.to(device)
    x = torch.randn(TOKENS, HIDDEN, generator=gen).to(device=device, dtype=torch.bfloat16)

    # The buffer is sized by the config's hint for this EP size and row width (BF16: 2 bytes per channel).
    config = Buffer.get_dispatch_config(world)
    buffer = Buffer(group, config.get_nvl_buffer_size_hint(HIDDEN * 2, world), 0)

    # 1. Layout: how many tokens go to each rank and expert, and which ranks each token visits.
    num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank, _ = (
        buffer.get_dispatch_layout(topk_idx, num_experts))

    # 2. Dispatch BF16 rows with their routing. recv_topk_idx holds local expert ids (0..EXPERTS_PER_RANK-1) and -1
    #    where the slot's expert lives on another rank; recv_topk_weights is 0 there.
    recv_x, recv_topk_idx, recv_topk_weights, tokens_per_expert, handle, _ = buffer.dispatch(
        x, topk_idx=topk_idx, topk_weights=topk_weights, num_tokens_per_rank=num_tokens_per_rank,
        num_tokens_per_rdma_rank=num_tokens_per_rdma_rank, is_token_in_rank=is_token_in_rank,
        num_tokens_per_expert=num_tokens_per_expert)

    # 3. Dispatch FP8: a (data [T, H] float8_e4m3fn, scales [T, H/128] float32) tuple comes back as a tuple.
    blocks = x.float().view(TOKENS, HIDDEN // 128, 128)
    scales = blocks.abs().amax(dim=2).clamp(min=1e-4) / 448.0  # 448 = float8_e4m3fn's largest value
    x_fp8 = (blocks / scales.unsqueeze(2)).view(TOKENS, HIDDEN).to(torch.float8_e4m3fn)
    (recv_fp8, recv_scales), *_ = buffer.dispatch(
        (x_fp8, scales), topk_idx=topk_idx, topk_weights=topk_weights, num_tokens_per_rank=num_tokens_per_rank,
        num_tokens_per_rdma_rank=num_tokens_per_rdma_rank, is_token_in_rank=is_token_in_rank,
        num_tokens_per_expert=num_tokens_per_expert)

    # 4. Cached dispatch: same routing, another tensor; only recv_x is returned.
    x2 = (x.float() * 2 + 1).bfloat16()
    recv_x2 = buffer.dispatch(x2, handle=handle).recv_x

    # 5. The "experts": scale each received row by the gate weights of this rank's experts, then combine. Combine sums
    #    the rows of every rank a token visited (in float32, rank order), so the result is x * sum of its weights.
    gate = recv_topk_weights.sum(dim=1, keepdim=True)
    expert_out = (recv_x.float() * gate).bfloat16()
    combined_x, combined_weights, _ = buffer.combine(expert_out, handle, topk_weights=recv_topk_weights)

    # ---- The check, in plain torch from every rank's inputs.
    xs, idxs = gather_all(x, group), gather_all(topk_idx, group)
    assert torch.equal(recv_x, expected_rows(rank, xs, idxs)), "BF16 dispatch rows differ"
    assert sum(tokens_per_expert) == int((recv_topk_idx >= 0).sum()), "per-expert counts differ"
    assert torch.equal(recv_x2, expected_rows(rank, gather_all(x2, group), idxs)), "cached dispatch rows differ"
    fp8_rows = expected_rows(rank, gather_all(x_fp8.view(torch.uint8), group), idxs)  # gloo moves bytes, not FP8
    assert torch.equal(recv_fp8.view(torch.uint8), fp8_rows), "FP8 dispatch rows differ"
    assert torch.equal(recv_scales, expected_rows(rank, gather_all(scales, group), idxs)), "FP8 scales differ"
    dequant = (recv_fp8.float().view(-1, HIDDEN // 128, 128) * recv_scales.unsqueeze(2)).view(-1, HIDDEN)
    torch.testing.assert_close(dequant, recv_x.float(), rtol=0.07, atol=0.02)  # FP8 keeps ~3 mantissa bits

    valid_weights = torch.where(topk_idx >= 0, topk_weights, torch.zeros_like(topk_weights))
    torch.testing.assert_close(combined_weights, valid_weights)
    expected_x = x.float() * valid_weights.sum(dim=1, keepdim=True)
    torch.testing.assert_close(combined_x.float(), expected_x, rtol=0.02, atol=0.02)  # BF16 rounding, twice
    return f"rank {rank}: received {recv_x.shape[0]} of {TOKENS * world} tokens, backend {buffer.backend_name}"


def _rank_main(rank: int, world: int, init_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    line = moe_round_trip(rank, world, torch.device("cpu"), dist.group.WORLD)
    print(line, flush=True)
    dist.destroy_process_group()
    # Leave without interpreter shutdown: a gloo worker thread still holding a finished collective can abort a
    # finalizing interpreter (exit -6 after the work is done); see tests/helpers/mp.py.
    os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2, choices=range(2, 5), help="ranks to spawn (2-4)")
    args = parser.parse_args()
    os.environ.setdefault("UCCL_MOE_BACKEND", "reference")  # gloo groups take the reference backend anyway
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_rank_main, args=(args.ranks, os.path.join(d, "init")), nprocs=args.ranks, join=True)
    print(f"buffer_cpu_gloo OK: {args.ranks} ranks, layout, BF16 + FP8 dispatch, cached dispatch, combine match torch")


if __name__ == "__main__":
    sys.exit(main())
