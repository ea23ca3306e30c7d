"""tools/device/gather_stamps.py: parses the stamped gather's lines, takes medians after the warm-up launches per rank
(aligned) or per call from the rank done first (shared GPU, calls paired by launch number), leaves the kernel's -1
("not stamped") out of the medians, refuses lines whose fields drifted from the kernel's printf, and checks its
arguments before any rank starts."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
from helpers.tools import device_tool

ROOT = Path(__file__).resolve().parents[2]
gs = device_tool("gather_stamps")


def _line(rank: int, launch: int, rows_done: float, own_end: float = 30.0, rb: int = 7168, parts: int = 1,
          peer_begin: float = 25.0) -> str:
    # the kernel's printf, as a rank's output carries it (device printf can follow other output on the line)
    return (f"x gather-stamp rank={rank} launch={launch} row_bytes={rb} parts={parts} ready=2.0 first_row=3.5 "
            f"own_end={own_end:.1f} peer_begin={peer_begin:.1f} peer_end={rows_done - 1:.1f} "
            f"rows_done={rows_done:.1f} flag={rows_done + 0.5:.1f} end={rows_done + 4:.1f}")


def test_fields_are_the_kernels_printf() -> None:
    src = (ROOT / "native/src/kernels/intranode/gather_stamps.cuh").read_text()
    fmt = "".join(re.findall(r'"([^"]*)"', src[src.index('printf("gather-stamp'):src.index(");", src.index(
        'printf("gather-stamp'))]))
    names = re.findall(r"(\w+)=%", fmt)
    assert names[:4] == ["rank", "launch", "row_bytes", "parts"] and tuple(names[4:]) == gs.FIELDS
    line = fmt.replace("%d", "1").replace("%u", "2").replace("%.1f", "-1.0").rstrip("\\n")
    mode, groups = gs.parse([line])
    assert mode is None and list(groups) == [(1, 1)] and groups[(1, 1)][1][2]["end"] == -1.0


def test_aligned_medians_per_rank_after_warmup() -> None:
    lines = ["gather-stamps mode=aligned ranks=2", _line(0, 0, 500.0), _line(0, 1, 90.0), _line(0, 2, 94.0),
             _line(0, 3, 92.0), _line(1, 0, 400.0), _line(1, 1, 80.0, 40.0), _line(0, 4, 150.0, rb=14336, parts=2),
             "unrelated"]
    mode, groups = gs.parse(lines)
    assert mode == "aligned" and set(groups) == {(7168, 1), (14336, 2)}
    rows = gs.summarise(groups, skip=1, shared=False)
    by = {(r["row_bytes"], r["rank"]): r for r in rows}
    r0 = by[(7168, "0")]
    assert r0["launches"] == 3 and r0["rows_done"] == 92.0 and r0["end"] == 96.0 and r0["flag"] == 92.5
    assert by[(7168, "1")]["launches"] == 1 and by[(7168, "1")]["own_end"] == 40.0  # skip leaves none: all kept
    assert by[(14336, "0")]["rows_done"] == 150.0


def test_shared_pairs_calls_by_launch_and_keeps_the_rank_done_first() -> None:
    # Call k of each rank is the same op: on one GPU the rank whose peers' copies waited for it is done first. Rank
    # 1's line of call 1 is missing: that call is left out, and calls 2 and 3 still pair with their own partners.
    lines = ["gather-stamps mode=shared ranks=2", _line(0, 0, 4500.0, 31.0), _line(1, 0, 100.0, 33.0),
             _line(0, 1, 98.0, 35.0), _line(0, 2, 96.0, 39.0), _line(1, 2, 4400.0, 41.0),
             _line(1, 3, 94.0, 43.0, peer_begin=-1.0), _line(0, 3, 4300.0, 45.0, peer_begin=-1.0)]
    mode, groups = gs.parse(lines)
    assert mode == "shared"
    rows = gs.summarise(groups, skip=0, shared=True)
    assert len(rows) == 1 and rows[0]["rank"] == "late" and rows[0]["launches"] == 3
    assert rows[0]["rows_done"] == 96.0 and rows[0]["own_end"] == 39.0  # calls 0, 2, 3: 100 / 96 / 94, 33 / 39 / 43
    assert rows[0]["peer_begin"] == 25.0  # call 3's -1 (not stamped) counts in no median
    one = gs.summarise(gs.parse([_line(0, 0, 90.0, peer_begin=-1.0)])[1], skip=0, shared=False)
    assert math.isnan(one[0]["peer_begin"])


def test_main_summary_refusals_and_arguments(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "s.log"
    log.write_text("\n".join(["gather-stamps mode=shared ranks=2", _line(0, 0, 90.0), _line(1, 0, 95.0)]))
    assert gs.main(["--summary", str(log), "--skip", "0"]) == 0
    out = capsys.readouterr().out
    assert "mode shared" in out and "late" in out and "rows_done" in out
    log.write_text("nothing stamped\n")
    assert gs.main(["--summary", str(log)]) == 1
    assert "-DUCCL_MOE_STAMP_GATHER" in capsys.readouterr().err
    log.write_text(_line(0, 0, 90.0).replace("ready=2.0 ", ""))
    assert gs.main(["--summary", str(log)]) == 1
    assert "expected" in capsys.readouterr().err
    for bad, named in ((["--ops", "combine"], "--ops"), (["--ranks", "1"], "--ranks"), (["--iters", "0"], "--iters"),
                       (["--skip", "-1"], "--skip")):
        with pytest.raises(SystemExit):
            gs.main(bad)
        assert f"error: {named}" in capsys.readouterr().err
    # the stamps' end is the gather's last block: the end beside the kernel is refused, and the ranks get it off
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("UCCL_MOE_CE_END_BESIDE", "1")
        with pytest.raises(SystemExit):
            gs.main([])
        assert "UCCL_MOE_CE_END_BESIDE" in capsys.readouterr().err
        mp.delenv("UCCL_MOE_CE_END_BESIDE")
        mp.setattr(gs, "spawn_headline", lambda *a: 7 if gs.os.environ.get("UCCL_MOE_CE_END_BESIDE") == "0" else 8)
        assert gs.main([]) == 7
        assert "UCCL_MOE_CE_END_BESIDE" not in gs.os.environ  # the caller's environment as it was
    torch = pytest.importorskip("torch")
    if torch.cuda.device_count() > 0:
        pytest.skip("this machine has a GPU: main() would spawn the ranks")
    assert gs.main(["--out", str(tmp_path / "run")]) == 2
    assert "needs a GPU" in capsys.readouterr().err
