"""tools/device/ab_summary.py: the per-variant summary of a device_ab.sh call, from bench JSONs written as the bench
writes them (``ops`` entries with ``op``, ``ours_us``, ``nccl_us``)."""

from __future__ import annotations

import json
from pathlib import Path

from helpers.tools import device_tool

ab = device_tool("ab_summary")


def _write(folder: Path, i: int, variant: str, ours: dict[str, float], nccl: dict[str, float],
           tokens: int = 4096) -> None:
    ops = [{"op": op, "ours_us": us, "nccl_us": nccl[op], "ranks": 2, "tokens": tokens} for op, us in ours.items()]
    (folder / f"ab{i}_{variant}.json").write_text(json.dumps({"ops": ops}))


def _by(entries, op, variant):
    return next(e for e in entries if e["op"] == op and e["variant"] == variant)


def test_verdicts_ratios_and_run_order(tmp_path: Path) -> None:
    nccl = {"dispatch fp8": 130.0, "combine": 220.0}
    _write(tmp_path, 1, "base", {"dispatch fp8": 134.0, "combine": 267.0}, nccl)
    _write(tmp_path, 2, "new", {"dispatch fp8": 150.0, "combine": 266.0}, nccl)
    _write(tmp_path, 3, "base", {"dispatch fp8": 135.0, "combine": 268.0}, nccl)
    _write(tmp_path, 4, "new", {"dispatch fp8": 160.0, "combine": 269.0}, nccl)
    _write(tmp_path, 5, "new_UCCL_MOE_X_8", {"dispatch fp8": 120.0, "combine": 200.0}, nccl)
    (tmp_path / "notes.txt").write_text("not a run")
    runs = ab.load_runs(tmp_path)
    assert [(i, v) for i, v, _ in runs] == [(1, "base"), (2, "new"), (3, "base"), (4, "new"), (5, "new_UCCL_MOE_X_8")]
    entries = ab.summarise(runs, "base", 0.10)
    fp8 = _by(entries, "dispatch fp8", "new")
    assert fp8["verdict"] == "slower" and fp8["runs"] == 2 and fp8["median_us"] == 155.0
    assert fp8["vs_base"] == round(134.5 / 155.0, 3)
    assert _by(entries, "combine", "new")["verdict"] == "same"  # ranges overlap
    assert _by(entries, "combine", "new_UCCL_MOE_X_8")["verdict"] == "faster (1 run: rerun)"
    assert _by(entries, "combine", "base")["verdict"] == "baseline"
    text = ab.table(entries)
    assert "slower" in text and "faster" in text and "0.868" in text


def test_a_noisy_host_is_named_and_a_missing_baseline_is_said(tmp_path: Path) -> None:
    _write(tmp_path, 1, "base", {"combine": 267.0}, {"combine": 200.0})
    _write(tmp_path, 2, "new", {"combine": 300.0}, {"combine": 260.0})
    entries = ab.summarise(ab.load_runs(tmp_path), "base", 0.10)
    assert _by(entries, "combine", "new")["verdict"] == "slower (1 run: rerun) (noisy host: rerun)"
    assert _by(entries, "combine", "new")["nccl_spread"] == 0.3
    assert ab.summarise(ab.load_runs(tmp_path), "nobody", 0.10)[0]["verdict"] == "no baseline"


def test_main_prints_the_table_or_fails_on_an_empty_folder(tmp_path: Path, capsys) -> None:
    assert ab.main([str(tmp_path)]) == 1
    _write(tmp_path, 1, "base", {"combine": 267.0}, {"combine": 220.0})
    _write(tmp_path, 2, "new", {"combine": 250.0}, {"combine": 221.0})
    assert ab.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "combine" in out and "faster" in out and "vs_base" in out


def test_points_of_different_settings_are_not_pooled(tmp_path: Path) -> None:
    for i, (variant, tokens, us) in enumerate([("base", 128, 30.0), ("base", 4096, 200.0), ("new", 128, 40.0),
                                               ("new", 4096, 150.0), ("base", 128, 31.0), ("new", 4096, 151.0)]):
        _write(tmp_path, i + 1, variant, {"combine": us}, {"combine": 100.0}, tokens=tokens)
    entries = ab.summarise(ab.load_runs(tmp_path), "base", 0.10)
    small = _by(entries, "combine [ranks=2 tokens=128]", "new")
    big = _by(entries, "combine [ranks=2 tokens=4096]", "new")
    assert small["verdict"].startswith("slower") and big["verdict"].startswith("faster")
    assert big["median_us"] == 150.5 and small["vs_base"] == round(30.5 / 40.0, 3)
