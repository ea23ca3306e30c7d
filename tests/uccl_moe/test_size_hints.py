"""Buffer.get_copy_engine_buffer_size_hint: the NVL bytes with which the copy-engine dispatch and combine fit any
routing of up to T tokens per rank, where the group size takes them (CPU: the kernels' own layout functions)."""

from __future__ import annotations

import random
from typing import Any

import pytest

from uccl_moe import _C, Buffer, InvalidTypeError, InvalidUsageError


def _random_prefix(rng: random.Random, ranks: int, tokens: int) -> list[int]:
    """A rank prefix matrix (flattened [R, R], inclusive over sources) of a routing of up to `tokens` per rank."""
    out, running = [], [0] * ranks
    for _ in range(ranks):
        for d in range(ranks):
            running[d] += rng.randint(0, tokens)
        out += running
    return out


def test_ep2_hint_holds_every_routing_of_that_many_tokens():
    rng = random.Random(7)
    for hidden, topk in ((7168, 8), (2048, 2), (4096, 0)):
        for tokens in (0, 1, 333, 4096, 8192):
            hint = Buffer.get_copy_engine_buffer_size_hint(tokens, hidden, 2, topk)
            assert hint % 4096 == 0
            worst = [tokens, tokens, 2 * tokens, 2 * tokens]
            assert hint >= _C.intranode_ce_landing_bytes(worst, hidden, topk)
            assert hint >= _C.intranode_ce_dispatch_landing_bytes([tokens, tokens], 2 * hidden, 0)
            assert hint - 4096 < max(_C.intranode_ce_landing_bytes(worst, hidden, topk),
                                     _C.intranode_ce_dispatch_landing_bytes([tokens, tokens], 2 * hidden, 0))
            for _ in range(20):
                assert _C.intranode_ce_landing_bytes(_random_prefix(rng, 2, tokens), hidden, topk) <= hint
    # more than the configs' ring hint at DeepSeek-V3's width past about 5000 tokens: why the hint exists
    ring = Buffer.get_dispatch_config(2).get_nvl_buffer_size_hint(7168 * 2, 2)
    assert Buffer.get_copy_engine_buffer_size_hint(4096, 7168, 2, 8) < ring
    assert Buffer.get_copy_engine_buffer_size_hint(8192, 7168, 2, 8) > ring


def test_hint_follows_the_knobs_and_group_sizes(monkeypatch):
    assert Buffer.get_copy_engine_buffer_size_hint(4096, 7168, 4, 8) == 0  # EP4: the rings by default
    assert Buffer.get_copy_engine_buffer_size_hint(4096, 7168, 1, 8) == 0
    monkeypatch.setenv("UCCL_MOE_COMBINE_CE", "1")
    ep4 = Buffer.get_copy_engine_buffer_size_hint(4096, 7168, 4, 8)
    prefix = [(s + 1) * 4096 for s in range(4) for _ in range(4)]
    assert ep4 >= _C.intranode_ce_landing_bytes(prefix, 7168, 8) > 0
    rng = random.Random(3)
    assert all(_C.intranode_ce_landing_bytes(_random_prefix(rng, 4, 4096), 7168, 8) <= ep4 for _ in range(20))
    monkeypatch.setenv("UCCL_MOE_COMBINE_CE", "0")
    only_dispatch = Buffer.get_copy_engine_buffer_size_hint(4096, 7168, 2, 8)
    assert only_dispatch >= _C.intranode_ce_dispatch_landing_bytes([4096, 4096], 7168 * 2, 0) > 0
    monkeypatch.setenv("UCCL_MOE_DISPATCH_CE", "0")
    assert Buffer.get_copy_engine_buffer_size_hint(4096, 7168, 2, 8) == 0


@pytest.mark.parametrize("args, what", [((-1, 7168, 2), "tokens >= 0"), ((64, 0, 2), "hidden > 0"),
                                        ((64, 7168, 9), "num_ranks <= 8"), ((64, 7168, 0), "1 <= num_ranks"),
                                        ((64, 7168, 2, -1), "num_topk >= 0")])
def test_bad_arguments_say_what(args, what):
    with pytest.raises(InvalidUsageError, match="get_copy_engine_buffer_size_hint") as e:
        Buffer.get_copy_engine_buffer_size_hint(*args)
    assert what in str(e.value)
    with pytest.raises(InvalidTypeError, match="num_tokens must be an int"):
        Buffer.get_copy_engine_buffer_size_hint("many", 7168, 2)


def _nvl_bytes_of(rank: int, world: int, asked: list[int]) -> list[Any]:
    import torch.distributed as dist

    out: list[Any] = []
    for n in asked:
        try:
            out.append(Buffer(dist.group.WORLD, n, backend="reference").num_nvl_bytes)
        except InvalidUsageError as e:
            out.append(str(e))
    return out


def test_nvl_bytes_min_raises_every_buffer_that_has_one():
    """UCCL_MOE_NVL_BYTES_MIN: for Buffers a framework sizes by the config hints alone (Megatron's flex dispatcher);
    a Buffer without an NVL buffer (0) or a larger one keeps its size; a floor off the 128-byte grid is refused."""
    from helpers.mp import run_ranks

    floor = 64 << 20
    got = run_ranks(_nvl_bytes_of, 2, [1 << 20, 0, 128 << 20], env={"UCCL_MOE_NVL_BYTES_MIN": str(floor)})
    assert got == [[floor, 0, 128 << 20]] * 2
    assert run_ranks(_nvl_bytes_of, 1, [1 << 20])[0] == [1 << 20]  # unset: the size asked for
    [[msg]] = run_ranks(_nvl_bytes_of, 1, [1 << 20], env={"UCCL_MOE_NVL_BYTES_MIN": str(floor + 1)})
    assert "UCCL_MOE_NVL_BYTES_MIN=67108865 must be a multiple of 128" in msg
    [[msg]] = run_ranks(_nvl_bytes_of, 1, [128 << 20], env={"UCCL_MOE_NVL_BYTES_MIN": "129"})  # checked, if unused
    assert "UCCL_MOE_NVL_BYTES_MIN=129 must be a multiple of 128" in msg
