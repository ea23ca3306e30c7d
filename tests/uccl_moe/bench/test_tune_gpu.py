"""``python -m uccl_moe.bench.tune`` end to end on 2 GPUs with a tiny grid: the JSON of every point, the picks, the
correctness check of every point, and the row it writes (into a copy of the table)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.mp, pytest.mark.timeout(600)]


def test_tune_two_ranks_tiny_grid(tmp_path) -> None:
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    from uccl_moe import tuning
    from uccl_moe.bench.tune import OPS, load_table, main

    table = tmp_path / "tuning.py"
    shutil.copy(tuning.__file__, table)
    path = tmp_path / "tune.json"
    assert main(["--ranks", "2", "--tokens", "1024", "--nvl-send", "2,8", "--nvl-recv", "128,256", "--iters", "3",
                 "--json", str(path), "--write", "--table", str(table)]) == 0
    data = json.loads(path.read_text())
    grid = {(g["nvl_send"], g["nvl_recv"]) for g in data["grid"]}
    assert grid == {(2, 128), (8, 128), (2, 256), (8, 256)} and data["ranks"] == 2
    assert data["setting"] == {"tokens": 1024, "hidden": 7168, "experts": 256, "topk": 8, "num_sms": 24,
                               "scales": "col"}
    assert data["bad_points"] == []
    for op in OPS:
        assert {(e["nvl_send"], e["nvl_recv"]) for e in data["sweep"][op]} == grid
        assert all(e["us"] > 0 for e in data["sweep"][op] + data["final"][op])
        assert len(data["sweep_per_rank"]) == 2
    final_dispatch = {(e["nvl_send"], e["nvl_recv"]) for e in data["final"]["dispatch_bf16"]}
    assert len(data["final"]["combine"]) == 2 and 2 <= len(final_dispatch) <= 4
    picks = data["picks"]

    def check_lean(entries, chosen, min_ring=0):
        """The memory rule, restated: among the finalists with a ring >= min_ring (all of them where none has),
        `chosen` is within 2% of the fastest and no smaller ring is. The JSON's times are rounded to 0.1 us, the
        pick used the raw ones: 0.1 us of slack either way."""
        pool = [e for e in entries if e["nvl_recv"] >= min_ring] or entries
        best = min(e["us"] for e in pool)
        us = {(e["nvl_send"], e["nvl_recv"]): e["us"] for e in pool}
        assert tuple(chosen) in us and us[tuple(chosen)] <= best * 1.02 + 0.1, (chosen, pool)
        assert not any(e["us"] < best * 1.02 - 0.1 and e["nvl_recv"] < chosen[1] for e in pool), (chosen, pool)

    check_lean(data["final"]["combine"], picks["combine"])
    check_lean(data["final"]["dispatch_bf16"], picks["dispatch"], min_ring=picks["combine"][1])
    if any(e["nvl_recv"] >= picks["combine"][1] for e in data["final"]["dispatch_bf16"]):
        assert picks["dispatch"][1] >= picks["combine"][1]  # the dispatch hint alone sizes a Buffer for both ops
    assert data["written"] == str(table) and data["measured_on"].endswith("python -m uccl_moe.bench.tune --ranks 2")
    p = load_table(table).preset_for(2)
    assert (p.dispatch.nvl_send, p.dispatch.nvl_recv) == tuple(picks["dispatch"])
    assert (p.combine.nvl_send, p.combine.nvl_recv) == tuple(picks["combine"])
    assert p.measured_on == data["measured_on"] and torch.cuda.get_device_name(0) in p.measured_on
    assert (picks["dispatch_fp8"] is None) == (p.dispatch_fp8 is None)
