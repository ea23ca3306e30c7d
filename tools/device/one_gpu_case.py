"""The one-process, one-GPU case the host-time dev tools (profile_call.py, host_parts.py) time: a world of one rank,
a native Buffer, a routed batch and its first dispatch. Run from those scripts (their folder is on sys.path)."""
from __future__ import annotations

import contextlib
import dataclasses
import os
import tempfile
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist


@dataclasses.dataclass
class Case:
    buf: Any  # uccl_moe.Buffer
    cfg: Any  # uccl_moe.Config
    idx: torch.Tensor  # [T, 8] top-k expert ids of 256 experts
    w: torch.Tensor  # [T, 8] top-k weights
    x: torch.Tensor  # [T, H] BF16 rows
    layout: dict[str, torch.Tensor]  # get_dispatch_layout's tensors, as dispatch's keyword arguments
    result: Any  # the first dispatch's DispatchResult (its handle for cached ops, recv_x for combines)
    view: torch.Tensor  # get_combine_buffer of that handle, holding recv_x


@contextlib.contextmanager
def one_gpu_case(tokens: int, hidden: int) -> Iterator[Case]:
    """A single-rank world on GPU 0 and the case above; the Buffer and the group are torn down after."""
    torch.cuda.set_device(0)
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("cpu:gloo,cuda:nccl", init_method=f"file://{os.path.join(d, 'init')}", rank=0,
                                world_size=1)
        from uccl_moe import Buffer, Config

        cfg = Config(24, 8, 256, 6, 128)
        T, E = tokens, 256
        nvl = max(cfg.get_nvl_buffer_size_hint(hidden * 2, 1), Buffer.get_combine_buffer_size_hint(T, hidden))
        buf = Buffer(dist.group.WORLD, nvl, backend="native", explicitly_destroy=True)
        idx = torch.topk(torch.rand((T, E), device="cuda"), 8, dim=1).indices
        w = torch.rand((T, 8), device="cuda")
        x = torch.randn((T, hidden), device="cuda").bfloat16()
        lay = buf.get_dispatch_layout(idx, E)
        layout = dict(num_tokens_per_rank=lay.num_tokens_per_rank, is_token_in_rank=lay.is_token_in_rank,
                      num_tokens_per_expert=lay.num_tokens_per_expert)
        r = buf.dispatch(x, topk_idx=idx, topk_weights=w, config=cfg, **layout)
        view = buf.get_combine_buffer(r.handle, hidden)
        view.copy_(r.recv_x)
        try:
            yield Case(buf, cfg, idx, w, x, layout, r, view)
        finally:
            torch.cuda.synchronize()
            buf.destroy()
            dist.destroy_process_group()
