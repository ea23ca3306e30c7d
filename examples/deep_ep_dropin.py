"""Code written for DeepEP (`import deep_ep`) running unchanged on uccl-moe through its `deep_ep` shim; CPU/gloo.

Run:  python examples/deep_ep_dropin.py [--ranks 2] [--on-disk]      (prints "deep_ep_dropin OK ...")

`deepep_user_code` below is ordinary DeepEP V1 high-throughput code (the pattern Megatron's fused_a2a uses:
previous_event / async_finish / allocate_on_comm_stream and EventOverlap waits). Nothing in it names uccl-moe. Two ways
to make its `import deep_ep` load uccl-moe:
  - in-process, before deep_ep is imported:   import uccl_moe.deep_ep_compat as c; c.install()      (the default here)
  - on disk, once per environment:            python -m uccl_moe.deep_ep_compat install [--target DIR]
    (--on-disk writes it into a temporary DIR and puts DIR on sys.path). A real DeepEP is never overwritten.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def deepep_user_code(group: dist.ProcessGroup, x: torch.Tensor, topk_idx: torch.Tensor,
                     topk_weights: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Unmodified DeepEP V1 usage: dispatch the tokens, run identity "experts", combine them back."""
    from deep_ep import Buffer, EventOverlap

    hidden_bytes = x.size(1) * max(x.element_size(), 2)
    num_nvl_bytes = Buffer.get_dispatch_config(group.size()).get_nvl_buffer_size_hint(hidden_bytes, group.size())
    buffer = Buffer(group, num_nvl_bytes, 0)

    previous_event = Buffer.capture()
    num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank, event = (
        buffer.get_dispatch_layout(topk_idx, num_experts, previous_event=previous_event, async_finish=True,
                                   allocate_on_comm_stream=True))
    recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle, event = buffer.dispatch(
        x, topk_idx=topk_idx, topk_weights=topk_weights, num_tokens_per_rank=num_tokens_per_rank,
        num_tokens_per_rdma_rank=num_tokens_per_rdma_rank, is_token_in_rank=is_token_in_rank,
        num_tokens_per_expert=num_tokens_per_expert, previous_event=event, async_finish=True,
        allocate_on_comm_stream=True)
    assert isinstance(event, EventOverlap)
    event.current_stream_wait()  # recv_x is ready on this stream from here on
    expert_out = recv_x  # identity experts
    combined_x, _, event = buffer.combine(expert_out, handle, async_finish=True, previous_event=Buffer.capture(),
                                          allocate_on_comm_stream=True)
    event.current_stream_wait()
    return combined_x, is_token_in_rank


def rank_main(rank: int, world: int, init_file: str, on_disk: bool) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    if not on_disk:
        import uccl_moe.deep_ep_compat

        uccl_moe.deep_ep_compat.install()  # from here on, `import deep_ep` is uccl-moe
    import deep_ep

    assert deep_ep.Buffer.__module__.startswith("uccl_moe"), f"deep_ep came from {deep_ep.__file__}"

    num_experts, tokens, hidden = 4 * world, 32, 128
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(tokens, hidden, generator=gen).bfloat16()
    topk_weights, topk_idx = torch.rand(tokens, num_experts, generator=gen).topk(2, dim=1)
    combined, is_token_in_rank = deepep_user_code(dist.group.WORLD, x, topk_idx, topk_weights, num_experts)

    # Combine sums one copy per rank the token visited; with identity experts that is x times that count.
    visits = is_token_in_rank.sum(dim=1, keepdim=True).float()
    torch.testing.assert_close(combined.float(), (x.float() * visits).bfloat16().float(), rtol=0.01, atol=0.01)
    print(f"rank {rank}: deep_ep from {deep_ep.__name__} ({'on disk' if on_disk else 'in-process'}) round trip ok",
          flush=True)
    dist.destroy_process_group()
    os._exit(0)  # skip interpreter shutdown: a gloo thread can abort it after the work is done (tests/helpers/mp.py)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2, choices=range(2, 5))
    parser.add_argument("--on-disk", action="store_true", help="install the shim as a deep_ep package in a temp dir")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as d:
        if args.on_disk:
            target = os.path.join(d, "site")
            subprocess.run([sys.executable, "-m", "uccl_moe.deep_ep_compat", "install", "--target", target],
                           check=True)
            sys.path.insert(0, target)  # spawned ranks start from this sys.path
        mp.spawn(rank_main, args=(args.ranks, os.path.join(d, "init"), args.on_disk), nprocs=args.ranks, join=True)
    print(f"deep_ep_dropin OK: {args.ranks} ranks ran DeepEP code on uccl-moe's deep_ep shim")


if __name__ == "__main__":
    main()
