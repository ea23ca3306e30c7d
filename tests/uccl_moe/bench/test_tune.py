"""CPU checks of ``python -m uccl_moe.bench.tune``: the grid filter, the picking logic on synthetic timings, and
the rewrite of one row of the preset table (on a copy of uccl_moe/tuning.py)."""

from __future__ import annotations

import json
import shutil
from dataclasses import astuple
from pathlib import Path

import pytest
import torch

from uccl_moe import Buffer, _checks, tuning
from uccl_moe.bench import _run
from uccl_moe.bench.tune import (
    build_parser,
    candidate_grid,
    experts_for,
    finalists,
    load_table,
    measured_on,
    pick,
    rewrite_table,
    row_line,
    slowest_rank,
    write_row,
)

TABLE = Path(tuning.__file__)


def test_defaults_are_the_headline_setting_and_the_grid() -> None:
    a = build_parser().parse_args([])
    assert (a.tokens, a.hidden, a.experts, a.topk, a.sms) == (4096, 7168, 256, 8, 24)
    assert (a.nvl_send, a.nvl_recv) == ([1, 2, 4, 8, 16], [128, 256, 512])
    assert (a.iters, a.final_iters, a.top, a.write, a.json) == (10, 20, 2, False, None)
    assert not a.device_time and build_parser().parse_args(["--device-time"]).device_time


@pytest.mark.parametrize("ranks, want", [(1, 256), (2, 256), (3, 255), (4, 256), (5, 255), (6, 252), (7, 252),
                                         (8, 256)])
def test_experts_split_evenly(ranks: int, want: int) -> None:
    assert experts_for(ranks, 256) == want and want % ranks == 0


def test_grid_keeps_valid_points_and_says_why_it_drops_the_others() -> None:
    kept, dropped = candidate_grid(2, 24, [1, 2, 4, 8, 16, 128], [128, 256, 512], 7168, 1 << 30)
    pts = [(k["nvl_send"], k["nvl_recv"]) for k in kept]
    reasons = {(d["nvl_send"], d["nvl_recv"]): d["reason"] for d in dropped}
    assert len(pts) == len(set(pts)) == 17 and (2, 256) in pts and (16, 512) in pts
    assert "must be smaller" in reasons[(128, 128)]  # Config: nvl_send < nvl_recv
    # EP2: ring 256 leaves 21 slots per lane, so chunk 128 runs as chunk 21 (no smaller chunk of the grid does)
    assert (128, 256) in pts and [k["chunk_tokens"] for k in kept if k["nvl_send"] == 128] == [21, 42]
    for k in kept:  # every kept point is a valid Config with its size hint
        cfg = tuning.Chunks(k["nvl_send"], k["nvl_recv"]).config(24)
        assert k["hint_bytes"] == cfg.get_nvl_buffer_size_hint(7168 * 2, 2)


def test_grid_drops_equal_effective_chunks_and_too_large_buffers() -> None:
    # EP1: 24 lanes per channel, ring 128 gives 5 slots per lane: chunks 8 and 16 both run as 5
    kept, dropped = candidate_grid(1, 24, [4, 8, 16], [128], 7168, 1 << 30)
    assert [(k["nvl_send"], k["chunk_tokens"]) for k in kept] == [(4, 4), (8, 5)]
    assert [(d["nvl_send"], d["reason"]) for d in dropped] == [(16, "effective chunk 5 = nvl_send 8's")]
    hint_256 = tuning.Chunks(2, 256).config(24).get_nvl_buffer_size_hint(7168 * 2, 2)
    kept, dropped = candidate_grid(2, 24, [2], [128, 256, 512], 7168, hint_256)
    assert [k["nvl_recv"] for k in kept] == [128, 256]
    assert dropped[0]["nvl_recv"] == 512 and "--max-nvl-mb" in dropped[0]["reason"]
    # too few slots per lane: EP1 ring 32 gives 1 slot per lane
    kept, dropped = candidate_grid(1, 24, [1], [32], 7168, 1 << 30)
    assert not kept and "slots per lane" in dropped[0]["reason"]


def test_slowest_rank_and_finalists() -> None:
    r0 = {"combine": {(2, 256): 10.0, (4, 256): 12.0}}
    r1 = {"combine": {(2, 256): 15.0, (4, 256): 11.0}}
    assert slowest_rank([r0, r1]) == {"combine": {(2, 256): 15.0, (4, 256): 12.0}}
    sweep = {"dispatch_fp8": {(1, 128): 5.0, (2, 256): 3.0, (4, 256): 4.0, (8, 512): 9.0},
             "dispatch_bf16": {(1, 128): 7.0, (2, 256): 8.0, (4, 256): 9.0, (8, 512): 6.0},
             "combine": {(1, 128): 1.0, (2, 256): 2.0, (4, 256): 3.0, (8, 512): 1.0}}
    f = finalists(sweep, 2)
    assert f["dispatch_fp8"] == f["dispatch_bf16"] == [(1, 128), (2, 256), (4, 256), (8, 512)]
    assert f["combine"] == [(1, 128), (8, 512)]  # tie: the smaller ring first
    f1 = finalists(sweep, 1)
    assert f1["dispatch_fp8"] == [(2, 256), (8, 512)] and f1["combine"] == [(1, 128)]


def test_pick_per_op_and_the_fp8_field() -> None:
    final = {"dispatch_bf16": {(2, 256): 100.0, (8, 256): 110.0, (4, 512): 105.0},
             "dispatch_fp8": {(2, 256): 60.0, (8, 256): 50.0, (4, 512): 40.0},
             "combine": {(2, 256): 90.0, (4, 128): 80.0}}
    p = pick(final, 0.02)
    # FP8's fastest has ring 512 > BF16's 256: not allowed (the client's Buffer is sized for 256); next is (8, 256)
    assert p == {"dispatch": (2, 256), "dispatch_fp8": (8, 256), "combine": (4, 128)}
    final["dispatch_fp8"][(8, 256)] = 59.0  # within 2% of FP8 at BF16's pick: no FP8 field
    assert pick(final, 0.02)["dispatch_fp8"] is None
    assert pick(final, 0.0)["dispatch_fp8"] == (8, 256)
    final["dispatch_fp8"][(2, 256)] = 30.0  # FP8 is fastest at BF16's pick itself
    assert pick(final, 0.0)["dispatch_fp8"] is None
    # ties: the smaller ring, then the smaller chunk
    assert pick({"dispatch_bf16": {(4, 512): 1.0, (8, 256): 1.0, (2, 256): 1.0}, "dispatch_fp8": {(2, 256): 1.0},
                 "combine": {(1, 512): 2.0, (16, 128): 2.0}}, 0.02) == {
        "dispatch": (2, 256), "dispatch_fp8": None, "combine": (16, 128)}
    # a larger ring must pay for its memory: within min_gain of the fastest, the smallest ring wins
    lean = {"dispatch_bf16": {(8, 512): 555.5, (4, 256): 556.1, (8, 256): 556.9, (8, 128): 580.0},
            "dispatch_fp8": {(8, 512): 320.0, (4, 256): 330.0, (8, 256): 321.9, (8, 128): 322.9},
            "combine": {(1, 256): 635.0, (4, 128): 678.3}}
    assert pick(lean, 0.02) == {"dispatch": (4, 256), "dispatch_fp8": (8, 128), "combine": (1, 256)}
    # dispatch's ring is never below combine's (the dispatch hint must hold the combine)
    wide = {"dispatch_bf16": {(2, 128): 204.0, (2, 256): 204.1}, "dispatch_fp8": {(2, 128): 134.8, (2, 256): 134.1},
            "combine": {(1, 256): 266.8, (2, 512): 270.7}}
    assert pick(wide, 0.02) == {"dispatch": (2, 256), "dispatch_fp8": None, "combine": (1, 256)}
    assert pick(lean, 0.0) == {"dispatch": (8, 512), "dispatch_fp8": None, "combine": (1, 256)}


def test_repick_rewrites_a_row_from_a_saved_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from uccl_moe.bench.tune import main

    table = _copy(tmp_path)
    where = "NVIDIA H200 x 3, 2026-11-26, python -m uccl_moe.bench.tune --ranks 3"
    saved = {"ranks": 3, "measured_on": where, "bad_points": [], "final": {
        "combine": [{"nvl_send": 2, "nvl_recv": 256, "us": 452.4}, {"nvl_send": 2, "nvl_recv": 512, "us": 449.5}],
        "dispatch_fp8": [{"nvl_send": 4, "nvl_recv": 128, "us": 216.2},
                         {"nvl_send": 8, "nvl_recv": 128, "us": 215.8}],
        "dispatch_bf16": [{"nvl_send": 4, "nvl_recv": 128, "us": 394.0},
                          {"nvl_send": 4, "nvl_recv": 512, "us": 389.8}]}}
    path = tmp_path / "tune.json"
    path.write_text(json.dumps(saved))
    assert main(["--repick", str(path), "--write", "--table", str(table)]) == 0
    row = load_table(table).preset_for(3)
    assert (row.dispatch.nvl_send, row.dispatch.nvl_recv) == (4, 512)  # the only ring >= combine's 256
    assert row.dispatch_fp8 is not None and (row.dispatch_fp8.nvl_send, row.dispatch_fp8.nvl_recv) == (8, 128)
    assert (row.combine.nvl_send, row.combine.nvl_recv) == (2, 256) and row.measured_on == where
    saved["bad_points"] = [[2, 256]]
    path.write_text(json.dumps(saved))
    assert main(["--repick", str(path), "--write", "--table", str(table)]) == 1


def _copy(tmp_path: Path) -> Path:
    dst = tmp_path / "tuning.py"
    shutil.copy(TABLE, dst)
    return dst


def test_rewrite_changes_only_row_r_and_reads_back(tmp_path: Path) -> None:
    path = _copy(tmp_path)
    old = path.read_text().split("\n")
    where = measured_on("NVIDIA H100 80GB HBM3", 2, "2026-11-26")
    picks = {"dispatch": (4, 512), "dispatch_fp8": (16, 256), "combine": (1, 128)}
    line = write_row(path, 2, picks, where)
    new = path.read_text().split("\n")
    assert len(new) == len(old)
    changed = [i for i, (a, b) in enumerate(zip(old, new)) if a != b]
    assert len(changed) == 1 and new[changed[0]] == line and old[changed[0]].strip().startswith("2:")
    mod = load_table(path)
    p = mod.preset_for(2)
    assert (p.dispatch, p.dispatch_fp8, p.combine) == (mod.Chunks(4, 512), mod.Chunks(16, 256), mod.Chunks(1, 128))
    assert p.measured_on == "NVIDIA H100 80GB HBM3 x 2, 2026-11-26, python -m uccl_moe.bench.tune --ranks 2"
    for r in (1, 3, 4, 5, 6, 7, 8):  # the other rows are the installed table's
        assert astuple(mod.preset_for(r)) == astuple(tuning.preset_for(r))
    assert astuple(mod.preset_for(16)) == astuple(tuning.preset_for(16))
    # a second write without an FP8 field takes it away again; the file stays one line per row
    write_row(path, 2, {"dispatch": (2, 256), "dispatch_fp8": None, "combine": (2, 256)}, where)
    p = load_table(path).preset_for(2)
    assert p.dispatch_fp8 is None and p.dispatch_chunks(True) == p.dispatch
    assert len(path.read_text().split("\n")) == len(old)


def test_rewrite_inserts_a_missing_row_in_order_and_needs_the_markers() -> None:
    text = "X = {\n    # tune-rows: begin\n    1: a,\n    3: c,\n    # tune-rows: end\n}\n"
    assert rewrite_table(text, 2, "    2: b,") == "X = {\n    # tune-rows: begin\n    1: a,\n    2: b,\n    3: c,\n" \
                                                 "    # tune-rows: end\n}\n"
    assert rewrite_table(text, 4, "    4: d,").split("\n")[4] == "    4: d,"
    with pytest.raises(ValueError, match="tune-rows"):
        rewrite_table("X = {\n    1: a,\n}\n", 1, "    1: b,")


def test_a_bad_rewrite_leaves_the_file_unchanged(tmp_path: Path) -> None:
    path = _copy(tmp_path)
    before = path.read_text()
    with pytest.raises(ValueError, match="unchanged"):  # Config refuses chunk 16 >= ring 16 when the row is read
        write_row(path, 2, {"dispatch": (16, 16), "dispatch_fp8": None, "combine": (2, 256)}, "x")
    assert path.read_text() == before
    marker_less = tmp_path / "other.py"
    marker_less.write_text("X = 1\n")
    with pytest.raises(ValueError, match="tune-rows"):
        write_row(marker_less, 2, {"dispatch": (2, 256), "dispatch_fp8": None, "combine": (2, 256)}, "x")
    assert marker_less.read_text() == "X = 1\n"


def test_row_line_is_one_readable_line() -> None:
    line = row_line(3, {"dispatch": (8, 256), "dispatch_fp8": None, "combine": (2, 256)}, "dev x 3, d, cmd")
    assert line == '    3: Preset(dispatch=Chunks(8, 256), combine=Chunks(2, 256), measured_on="dev x 3, d, cmd"),'
    assert "dispatch_fp8=Chunks(4, 128)" in row_line(
        3, {"dispatch": (8, 256), "dispatch_fp8": (4, 128), "combine": (2, 256)}, "x")


def test_installed_table_rows_are_valid() -> None:
    for r in range(1, tuning.MAX_INTRANODE_RANKS + 1):
        p = tuning.preset_for(r)
        for c in (p.dispatch, p.combine, p.dispatch_fp8):
            if c is not None:
                c.config(24)  # Config validates
        if p.dispatch_fp8 is not None:  # a Buffer sized by get_dispatch_config's hint holds the FP8 chunks
            assert p.dispatch_fp8.nvl_recv <= p.dispatch.nvl_recv


def test_fp8_dispatch_without_config_takes_the_fp8_chunks(monkeypatch: pytest.MonkeyPatch, group) -> None:
    """Buffer.dispatch(config=None) of FP8 rows runs the row's dispatch_fp8 chunks, BF16 rows the dispatch ones;
    get_dispatch_config and the bench's record of the config follow the same row."""
    row = tuning.INTRANODE[1]
    monkeypatch.setitem(tuning.INTRANODE, 1, tuning.Preset(row.dispatch, row.combine, "test",
                                                             dispatch_fp8=tuning.Chunks(1, 128)))
    d8 = _run.point_configs(1, 24, None, None, "fp8")[2]
    db = _run.point_configs(1, 24, None, None, "bf16")[2]
    assert (d8.num_max_nvl_chunked_send_tokens, d8.num_max_nvl_chunked_recv_tokens) == (1, 128)
    want_b = (row.dispatch.nvl_send, row.dispatch.nvl_recv)
    assert (db.num_max_nvl_chunked_send_tokens, db.num_max_nvl_chunked_recv_tokens) == want_b
    assert Buffer.get_dispatch_config(1).num_max_nvl_chunked_send_tokens == row.dispatch.nvl_send
    seen = []

    class Probe(Exception):
        pass

    def check_config(config, default):  # record the config Buffer.dispatch would run, then stop
        seen.append(default() if config is None else config)
        raise Probe

    monkeypatch.setattr(_checks, "check_config", check_config)
    buf = Buffer(group, 0, backend="reference", explicitly_destroy=True)
    try:
        H = 256
        xb = torch.zeros((4, H), dtype=torch.bfloat16)
        x8 = (xb.to(torch.float8_e4m3fn), torch.ones((4, H // 128), dtype=torch.float32))
        for x in (x8, xb):
            with pytest.raises(Probe):
                buf.dispatch(x)
    finally:
        buf.destroy()
    got = [(c.num_max_nvl_chunked_send_tokens, c.num_max_nvl_chunked_recv_tokens) for c in seen]
    assert got == [(1, 128), want_b]


@pytest.mark.mp
@pytest.mark.timeout(300)
def test_the_whole_flow_on_the_cpu_reference_backend(tmp_path: Path) -> None:
    """--cpu: 2 gloo ranks, the reference backend, a 2 x 2 grid: every point checked and timed, picks from the
    finalists, the JSON of every point; --write is refused there."""
    from uccl_moe.bench.tune import OPS, main

    path = tmp_path / "tune.json"
    assert main(["--cpu", "--ranks", "2", "--tokens", "32", "--hidden", "256", "--experts", "8", "--topk", "2",
                 "--nvl-send", "2,8", "--nvl-recv", "128,256", "--iters", "1", "--top", "1", "--warmup", "0",
                 "--json", str(path)]) == 0
    data = json.loads(path.read_text())
    grid = {(g["nvl_send"], g["nvl_recv"]) for g in data["grid"]}
    assert grid == {(2, 128), (8, 128), (2, 256), (8, 256)} and data["bad_points"] == []
    for op in OPS:
        assert {(e["nvl_send"], e["nvl_recv"]) for e in data["sweep"][op]} == grid
    assert len(data["final"]["combine"]) == 1 and 1 <= len(data["final"]["dispatch_fp8"]) <= 2
    assert tuple(data["picks"]["combine"]) == (data["final"]["combine"][0]["nvl_send"],
                                              data["final"]["combine"][0]["nvl_recv"])
    assert data["row"].startswith("2: Preset(dispatch=Chunks(") and data["written"] is None
    assert main(["--cpu", "--write"]) == 2
