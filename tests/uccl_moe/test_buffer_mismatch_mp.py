"""Ranks that disagree, and a rank that dies, on the reference backend (gloo): clear errors, never an abort or a hang.

Issue 29: mismatched ``num_experts``/``hidden``/dtypes or ``topk_weights`` on one rank only made gloo abort the
process (SIGABRT in its transport thread); a peer that exited surfaced as gloo's raw "Connection closed by peer".
Now every rank raises ``InvalidUsageError`` naming the field and the ranks, and the group stays usable; a dead peer
gives ``TransportError`` (or, if the connection does not close, ``CommTimeoutError``) naming the rank.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from helpers.mp import run_ranks

pytestmark = [pytest.mark.mp, pytest.mark.timeout(300)]

ENV = {"UCCL_MOE_BACKEND": "reference", "UCCL_MOE_TIMEOUT_S": "20"}


def _routing(T: int, E: int, K: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]).to(torch.int64)
    return idx, torch.rand((T, K), generator=gen, dtype=torch.float32)


def _dispatch(buf, x, E: int, topk: bool = True, seed: int = 0, scales=None):
    idx, w = _routing(x.shape[0] if not isinstance(x, tuple) else x[0].shape[0], E, 2, seed)
    lay = buf.get_dispatch_layout(idx, E)
    kw = dict(topk_idx=idx, topk_weights=w) if topk else {}
    return buf.dispatch(x, num_tokens_per_rank=lay.num_tokens_per_rank, is_token_in_rank=lay.is_token_in_rank,
                        num_tokens_per_expert=lay.num_tokens_per_expert, **kw)


def _x(T: int, H: int, dtype: torch.dtype, rank: int) -> torch.Tensor:
    return torch.full((T, H), float(rank + 1), dtype=torch.float32).to(dtype)


def _bad_layout_on(buf, rank: int, bad_rank: int):
    """A dispatch whose num_tokens_per_rank is off on `bad_rank` only: its peers must not wait for it."""
    idx, w = _routing(8, 4, 2, 0)
    lay = buf.get_dispatch_layout(idx, 4)
    ntr = lay.num_tokens_per_rank + (1 if rank == bad_rank else 0)
    return buf.dispatch(_x(8, 128, torch.bfloat16, rank), topk_idx=idx, topk_weights=w, num_tokens_per_rank=ntr,
                        is_token_in_rank=lay.is_token_in_rank, num_tokens_per_expert=lay.num_tokens_per_expert)


def _mismatches(rank: int, world: int) -> dict[str, str]:
    from uccl_moe import Buffer
    from uccl_moe.errors import InvalidUsageError

    buf = Buffer(dist.group.WORLD, 1 << 24, 0, backend="reference")
    bf16 = torch.bfloat16
    # name -> what this rank does (each case: rank 0 and rank 1 differ in one thing)
    cases = {
        "num_experts": lambda: _dispatch(buf, _x(8, 128, bf16, rank), 4 if rank == 0 else 6),
        "hidden": lambda: _dispatch(buf, _x(8, 128 if rank == 0 else 64, bf16, rank), 4),
        "topk": lambda: _dispatch(buf, _x(8, 128, bf16, rank), 4, topk=rank == 0),
        "dtype_same_size": lambda: _dispatch(buf, _x(8, 128, bf16 if rank == 0 else torch.float16, rank), 4),
        "dtype": lambda: _dispatch(buf, _x(8, 128, bf16 if rank == 0 else torch.float32, rank), 4),
        "fp8_scales": lambda: _dispatch(
            buf, (_x(8, 128, torch.float8_e4m3fn, rank), torch.ones((8, 1), dtype=torch.float32)) if rank == 0
            else _x(8, 128, bf16, rank), 4),
        "combine_topk_weights": lambda: _combine(buf, rank, weights=rank == 1),
        "combine_hidden": lambda: _combine(buf, rank, hidden=128 if rank == 0 else 64),
        "operation": lambda: _op_mismatch(buf, rank),
        "layout_one_rank": lambda: _bad_layout_on(buf, rank, bad_rank=1),
        "ids_in_layout_one_rank": lambda: _bad_ids(buf, rank, {1: (0, 0, 99)}, before_layout=True),
        "ids_in_dispatch_one_rank": lambda: _bad_ids(buf, rank, {1: (2, 1, -3)}, before_layout=False),
        "ids_on_both_ranks": lambda: _bad_ids(buf, rank, {0: (5, 0, 4), 1: (7, 1, 12)}, before_layout=True),
    }
    want = {
        "num_experts": "num_experts: 4 on rank 0, 6 on rank 1",
        "hidden": "hidden: 128 on rank 0, 64 on rank 1",
        "topk": "topk columns: 2 on rank 0, 0 on rank 1",
        "dtype_same_size": "x dtype: bfloat16 on rank 0, float16 on rank 1",
        "dtype": "x dtype: bfloat16 on rank 0, float32 on rank 1",
        "fp8_scales": "x_scales dtype: float32 on rank 0, none on rank 1",
        "combine_topk_weights": "topk columns: 0 on rank 0, 2 on rank 1",
        "combine_hidden": "hidden: 128 on rank 0, 64 on rank 1",
        "operation": "operation: cached dispatch on rank 0, dispatch on rank 1",
        "layout_one_rank": "num_tokens_per_rank does not match is_token_in_rank (column sums) on rank 1",
        "ids_in_layout_one_rank": "rank 1's topk_idx holds expert id 99, outside [-1, 4) (token 0, k 0; found by its "
                                  "get_dispatch_layout)",
        "ids_in_dispatch_one_rank": "rank 1's topk_idx holds expert id -3, outside [-1, 4) (token 2, k 1; found by "
                                    "its dispatch)",
        "ids_on_both_ranks": "rank 0's topk_idx holds expert id 4, outside [-1, 4) (token 5, k 0; found by its "
                             "get_dispatch_layout); rank 1's topk_idx holds expert id 12",
    }
    out: dict[str, str] = {}
    for name, fn in cases.items():
        try:
            fn()
            out[name] = "no error"
            continue
        except InvalidUsageError as e:
            msg = str(e)
        if want[name] not in msg:
            out[name] = f"message lacks {want[name]!r}: {msg}"
            continue
        # The group is still usable: a matching call works on every rank right after.
        res = _dispatch(buf, _x(8, 128, bf16, rank), 4, seed=1)
        assert res.recv_x.shape[1] == 128
        out[name] = "ok"
    return out


def _bad_ids(buf, rank: int, bad: dict[int, tuple[int, int, int]], before_layout: bool):
    """A dispatch whose topk_idx holds an id outside [-1, E) on the ranks in `bad` ((token, k, id) each), written
    before get_dispatch_layout or after it (in place, before the dispatch): such a rank used to raise alone, in
    whichever call read the id first, and leave its peers waiting in their dispatch until the timeout."""
    idx, w = _routing(8, 4, 2, 0)
    if rank in bad and before_layout:
        t, k, v = bad[rank]
        idx[t, k] = v
    lay = buf.get_dispatch_layout(idx, 4)
    if rank in bad and not before_layout:
        t, k, v = bad[rank]
        idx[t, k] = v
    return buf.dispatch(_x(8, 128, torch.bfloat16, rank), topk_idx=idx, topk_weights=w,
                        num_tokens_per_rank=lay.num_tokens_per_rank, is_token_in_rank=lay.is_token_in_rank,
                        num_tokens_per_expert=lay.num_tokens_per_expert)


def _combine(buf, rank: int, weights: bool = False, hidden: int = 128):
    res = _dispatch(buf, _x(8, hidden, torch.bfloat16, rank), 4, seed=2)
    w = res.recv_topk_weights if weights else None
    return buf.combine(res.recv_x, res.handle, topk_weights=w)


def _op_mismatch(buf, rank: int):
    res = _dispatch(buf, _x(8, 128, torch.bfloat16, rank), 4, seed=3)
    if rank == 0:
        return buf.dispatch(_x(8, 128, torch.bfloat16, rank), handle=res.handle)
    return _dispatch(buf, _x(8, 128, torch.bfloat16, rank), 4, seed=3)


def test_mismatched_arguments_raise_on_every_rank_and_name_the_ranks():
    for rank, out in enumerate(run_ranks(_mismatches, 2, env=ENV, timeout_s=240)):
        bad = {k: v for k, v in out.items() if v != "ok"}
        assert not bad, f"rank {rank}: {bad}"


def _dead_peer(rank: int, world: int) -> str | None:
    from uccl_moe import Buffer
    from uccl_moe.errors import CommTimeoutError, TransportError

    buf = Buffer(dist.group.WORLD, 1 << 24, 0, backend="reference")
    _dispatch(buf, _x(8, 128, torch.bfloat16, rank), 2 * world)  # a good call first
    if rank == world - 1:
        os._exit(0)  # dies without a word (its result file is never written)
    try:
        _dispatch(buf, _x(8, 128, torch.bfloat16, rank), 2 * world, seed=5)
    except (TransportError, CommTimeoutError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


@pytest.mark.parametrize("world", [2, 3])
def test_dead_peer_is_named(world):
    results = run_ranks(_dead_peer, world, env=ENV, timeout_s=120)
    for rank, msg in enumerate(results[:-1]):
        assert msg is not None and msg != "no error", f"rank {rank}: {msg}"
        assert f"rank {world - 1}" in msg and "exited" in msg, f"rank {rank}: {msg}"
        assert "Connection closed" not in msg.split("(")[0], msg
