"""``python -m uccl_moe.bench.megatron_dispatcher``: arguments, the summary and table from fake per-rank timings, and
the whole path end to end on CPU (gloo, reference backend, tiny shapes: the flow, not the timings)."""

from __future__ import annotations

import json

import pytest
from helpers.requires import missing

from uccl_moe.bench.megatron_dispatcher import (
    DISPATCHERS,
    build_parser,
    check_args,
    main,
    summarise,
    table,
    with_ratios,
)


def test_defaults_are_deepseek_v3_at_ep_of_all_gpus_and_every_dispatcher() -> None:
    args = build_parser().parse_args([])
    assert (args.tokens, args.hidden, args.experts, args.topk, args.sms) == (4096, 7168, 256, 8, 24)
    assert args.dispatchers == ["uccl", "alltoall", "flex"] == list(DISPATCHERS) and args.ranks == 0
    assert args.iters >= 20 and check_args(args) is None and not args.cpu


def test_bad_arguments_are_refused_with_the_reason(capsys) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--dispatchers", "uccl,deepep"])
    assert "unknown dispatcher" in capsys.readouterr().err
    assert "--iters" in check_args(build_parser().parse_args(["--iters", "5"]))
    assert check_args(build_parser().parse_args(["--iters", "5", "--cpu"])) is None  # CPU checks the flow only
    assert "--sms" in check_args(build_parser().parse_args(["--sms", "23"]))
    assert "--topk" in check_args(build_parser().parse_args(["--topk", "9", "--experts", "8"]))
    assert main(["--iters", "5"]) == 2
    assert main(["--cpu", "--ranks", "3", "--experts", "8"]) == 2  # experts do not split over 3 ranks


def _rank(scale: float, err: float = 0.0) -> dict:
    return {"fwd_dispatch": [10 * scale, 11 * scale, 30 * scale], "fwd_combine": [20 * scale] * 3,
            "bwd_combine": [5 * scale] * 3, "bwd_dispatch": [7 * scale] * 3, "host_dispatch": [3.0] * 3,
            "host_combine": [4.0 * scale] * 3, "host_backward": [6.0] * 3, "fwd_err": [err], "bwd_err": [0.0],
            "rows": [100 * scale]}


def test_summary_is_the_slowest_ranks_median_and_ratios_are_against_alltoall() -> None:
    row = summarise("uccl", [_rank(1.0), _rank(2.0, err=0.5)])
    assert row["fwd_dispatch_us"] == 22.0  # median of rank 1 (an outlier does not move it), the slower rank
    assert row["total_us"] == 22.0 + 40.0 + 10.0 + 14.0
    assert row["host_combine_us"] == 8.0 and row["fwd_err"] == 0.5 and row["rows_received"] == [100, 200]
    rows = with_ratios([row, summarise("alltoall", [_rank(2.0)] * 2), summarise("flex", [_rank(1.0)] * 2)])
    assert [r["vs_alltoall"] for r in rows] == [1.0, 1.0, 0.5]
    assert with_ratios([summarise("uccl", [_rank(1.0)])])[0]["vs_alltoall"] is None
    lines = table(rows).splitlines()
    header = lines[0].split()
    assert header[:6] == ["dispatcher", "fwd_disp", "fwd_comb", "bwd_comb", "bwd_disp", "total"]
    assert lines[3].split()[0] == "flex" and lines[3].split()[header.index("vs_a2a")] == "0.5"


@pytest.mark.mp
@pytest.mark.timeout(600)
@pytest.mark.skipif(missing("megatron.core") is not None, reason=missing("megatron.core") or "")
def test_every_dispatcher_end_to_end_on_cpu(tmp_path) -> None:
    path = tmp_path / "md.json"
    assert main(["--cpu", "--tokens", "16", "--hidden", "32", "--experts", "8", "--topk", "2", "--iters", "2",
                 "--warmup", "1", "--json", str(path)]) == 0
    data = json.loads(path.read_text())
    assert data["ranks"] == 2 and data["args"]["dtype"] == "fp32"
    rows = data["dispatchers"]
    assert [r["dispatcher"] for r in rows] == ["uccl", "alltoall", "flex"]
    for r in rows:
        for key in ("fwd_dispatch_us", "fwd_combine_us", "bwd_combine_us", "bwd_dispatch_us", "host_dispatch_us",
                    "host_combine_us", "host_backward_us"):
            assert r[key] > 0, (r["dispatcher"], key, r[key])
        # probs 1/top-k and identity experts: the combined output is the input, the input's grad the output's
        assert r["fwd_err"] <= 1e-5 and r["bwd_err"] <= 1e-5, r
        assert len(r["rows_received"]) == 2 and min(r["rows_received"]) > 0, r
    assert rows[1]["vs_alltoall"] == 1.0
