"""tools/device/env_ab.py: variant specs, the environment each variant runs under, the round order, the summary's
paired differences, and what it refuses (bad specs, bad ops, no 2 GPUs) before it spawns anything."""

from __future__ import annotations

import pytest
from helpers.tools import device_tool

ea = device_tool("env_ab")


def test_a_variant_is_a_name_and_its_knobs() -> None:
    assert ea.parse_variant("base") == ("base", {})
    assert ea.parse_variant("c3:UCCL_MOE_COMBINE_CE_CHUNKS=3,UCCL_MOE_CE_EARLY=0") == (
        "c3", {"UCCL_MOE_COMBINE_CE_CHUNKS": "3", "UCCL_MOE_CE_EARLY": "0"})
    for bad in ("", ":UCCL_MOE_X=1", "a b", "x:CUDA_LAUNCH_BLOCKING=1", "x:UCCL_MOE_X", "x:UCCL_MOE_X=1,Y=2"):
        with pytest.raises(ValueError, match="variant"):
            ea.parse_variant(bad)


def test_each_variant_runs_with_its_own_knobs_and_the_others_reset() -> None:
    base = {"UCCL_MOE_A": "7", "PATH": "/bin"}
    environ = dict(base)
    variants = [{}, {"UCCL_MOE_A": "1"}, {"UCCL_MOE_B": "2"}]
    ea.apply_variant(environ, base, variants, variants[1])
    assert environ == {"UCCL_MOE_A": "1", "PATH": "/bin"}
    ea.apply_variant(environ, base, variants, variants[2])
    assert environ == {"UCCL_MOE_A": "7", "UCCL_MOE_B": "2", "PATH": "/bin"}  # A back to the caller's value
    ea.apply_variant(environ, base, variants, {})
    assert environ == base


def test_rounds_alternate_the_order() -> None:
    assert ea.round_order(["a", "b", "c"], 0) == ["a", "b", "c"]
    assert ea.round_order(["a", "b", "c"], 1) == ["c", "b", "a"]


def test_the_summary_pairs_each_round_with_the_first_variants() -> None:
    times = {("base", "bf16"): [100.0, 110.0, 105.0], ("x", "bf16"): [98.0, 109.0, 101.0]}
    host = {("base", "bf16"): [50.0, 60.0, 55.0], ("x", "bf16"): [40.0, 41.0, 42.0]}
    lines = ea.summarize(times, host, ["base", "x"], ["bf16"])
    assert len(lines) == 2
    assert "median   105.0 us" in lines[0] and "vs base:   +0.0" in lines[0] and "host   55.0" in lines[0]
    # per-round differences -2, -1, -4: median -2 (the medians' difference would be -4)
    assert "median   101.0 us" in lines[1] and "range 98.0-109.0" in lines[1] and "vs base:   -2.0" in lines[1]


@pytest.mark.parametrize("argv, message", [
    (["--variant", "a", "--variant", "a"], "must differ"),
    (["--variant", "a", "--ops", "fp16"], "--ops"),
    (["--variant", "a:PATH=1"], "UCCL_MOE_"),
    (["--variant", "a", "--rounds", "0"], "at least 1"),
])
def test_bad_arguments_are_refused_with_the_reason(argv: list[str], message: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        ea.main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_without_two_gpus_it_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(SystemExit, match="needs 2 or more GPUs"):
        ea.main(["--variant", "base"])
