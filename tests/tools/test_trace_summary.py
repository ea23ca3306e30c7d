"""tools/device/trace_summary.py: parses the traced dispatch kernel's lines, averages per (row size, role, rank) after
the warm-up launches and derives `other`; refuses a line whose fields drifted from the kernel's."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.tools import device_tool

ROOT = Path(__file__).resolve().parents[2]
ts = device_tool("trace_summary")


def _line(rank: int, role: str, span: float, copy: float, rb: int = 7392, op: str = "dispatch") -> str:
    return (f"noise uccl-trace {op} rank={rank} row_bytes={rb} role={role} warps=144 span={span:.2f} "
            f"copy={copy:.2f} meta=1.00 wait=2.00 kept=0.00 publish=0.50 select=0.25")


def test_means_after_warmup_and_other(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lines = [_line(0, "recv", 500.0, 99.0), _line(0, "recv", 100.0, 40.0), _line(0, "recv", 120.0, 60.0),
             _line(1, "send_remote", 90.0, 30.0), _line(0, "recv", 300.0, 200.0, 14336, "combine"), "unrelated line"]
    rows = ts.summarise(ts.parse(lines), skip=1)
    by = {(r["op"], r["role"], r["rank"]): r for r in rows}
    assert by[("combine", "recv", 0)]["copy"] == 200.0  # its own group: one launch, kept
    recv = by[("dispatch", "recv", 0)]
    assert recv["launches"] == 1 + 1 and recv["span"] == 110.0 and recv["copy"] == 50.0
    assert recv["other"] == pytest.approx(110.0 - (50.0 + 1.0 + 2.0 + 0.0 + 0.5 + 0.25))
    assert by[("dispatch", "send_remote", 1)]["launches"] == 1  # fewer launches than the skip: all of them
    log = tmp_path / "t.log"
    log.write_text("\n".join(lines))
    assert ts.main([str(log), "--skip", "1"]) == 0
    out = capsys.readouterr().out
    assert "send_remote" in out and "other" in out


def test_no_trace_lines_and_drifted_fields(tmp_path: Path) -> None:
    log = tmp_path / "t.log"
    log.write_text("nothing traced\n")
    assert ts.main([str(log)]) == 1
    with pytest.raises(ValueError, match="expected"):
        ts.parse([_line(0, "recv", 1.0, 1.0).replace(" select=0.25", "")])


def test_lines_garbled_by_another_process_are_skipped_and_counted(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """Two ranks' device printf interleaved inside one line (as seen on 2 x H200): skipped, not an error."""
    good = _line(0, "recv", 100.0, 40.0)
    bad = [good.replace("select=0.25", "select=13.29uccl-trace"), good + " span=1.00",
           good.replace("wait=2.00", "wait")]
    garbled: list[str] = []
    groups = ts.parse([*bad, good], garbled)
    assert garbled == bad and len(groups[("dispatch", 7392, "recv", 0)]) == 1
    log = tmp_path / "t.log"
    log.write_text("\n".join([*bad, good]))
    assert ts.main([str(log)]) == 0
    assert "3 garbled trace lines skipped" in capsys.readouterr().err


def test_only_one_rank_prints() -> None:
    """Device printf of two processes sharing stdout interleaves: the kernel prints for UCCL_MOE_TRACE_RANK only."""
    src = (ROOT / "native/src/kernels/intranode/phase_trace.cuh").read_text()
    assert "rank == UCCL_MOE_TRACE_RANK" in src and "#define UCCL_MOE_TRACE_RANK 0" in src


def test_the_kernel_prints_the_fields_the_summary_reads() -> None:
    """The printf in phase_trace.cuh and PHASES name the same fields, in order."""
    import re

    src = (ROOT / "native/src/kernels/intranode/phase_trace.cuh").read_text()
    fmt = "".join(re.findall(r'"(uccl-trace %s[^"]*)"\s*"([^"]*)"', src)[0])
    assert fmt.startswith("uccl-trace %s rank=%d row_bytes=%d role=%s warps=%u ")
    assert tuple(re.findall(r"(\w+)=%\.2f", fmt)) == ts.PHASES
