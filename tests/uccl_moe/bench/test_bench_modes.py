"""CPU checks of the bench's default mode (the public API as DeepEP clients call it) against its tuned mode: argument
resolution, the configs each point passes, the FP8 scale layouts, and the per-op table and JSON from a fake result."""

from __future__ import annotations

import json

import pytest
import torch

from uccl_moe import Buffer
from uccl_moe.bench.__main__ import TUNED_NVL_RECV, TUNED_NVL_SEND, build_parser, mode_label, report, resolve_mode
from uccl_moe.bench._run import config_fields, fp8_scales, op_summary, op_table, point_configs


def _args(*argv: str):
    args = build_parser().parse_args(list(argv))
    resolve_mode(args)
    return args


@pytest.fixture(autouse=True)
def _keep_num_sms():
    saved = Buffer.num_sms
    yield
    Buffer.num_sms = saved


def test_no_flags_is_the_api_default_mode_with_the_deepseek_v3_setting() -> None:
    args = _args()
    assert args.mode == "api" and "API defaults" in mode_label(args)
    assert args.nvl_send is None and args.nvl_recv is None  # no explicit Config is passed
    assert args.scales == "col" and not args.combine_view
    assert (args.tokens, args.hidden, args.experts, args.topk, args.sms) == ([4096], [7168], [256], 8, [24])
    assert args.dtypes == "fp8,bf16"


@pytest.mark.parametrize("argv", [["--device-time"], ["--tuned", "--device-time"]])
def test_device_time_is_labelled_as_not_what_a_caller_sees(argv) -> None:
    args = _args(*argv)
    assert args.device_time and "DEVICE TIME" in mode_label(args) and "not what a caller sees" in mode_label(args)
    assert "DEVICE TIME" not in mode_label(_args(*[a for a in argv if a != "--device-time"]))


@pytest.mark.parametrize("argv, nvl_send, nvl_recv, scales, view", [
    (["--tuned"], [TUNED_NVL_SEND], [TUNED_NVL_RECV], "row", True),
    (["--tuned", "--nvl-send", "2", "--scales", "col"], [2], [TUNED_NVL_RECV], "col", True),
    (["--nvl-send", "4"], [4], None, "col", False),
    (["--scales", "row"], None, None, "row", False),
    (["--combine-view"], None, None, "col", True),
    (["--combine-staged"], None, None, "col", False),
    (["--dispatch-direct"], None, None, "col", False),
])
def test_any_tuning_knob_is_the_tuned_mode_and_says_so(argv, nvl_send, nvl_recv, scales, view) -> None:
    args = _args(*argv)
    assert args.mode == "tuned" and mode_label(args).startswith("TUNED")
    assert (args.nvl_send, args.nvl_recv, args.scales, args.combine_view) == (nvl_send, nvl_recv, scales, view)


def test_api_mode_passes_no_config_and_runs_the_presets_at_the_asked_sm_count() -> None:
    dcfg, ccfg, d_run, c_run = point_configs(2, 24, None, None)
    assert dcfg is None and ccfg is None  # each call takes get_dispatch_config/get_combine_config itself
    assert Buffer.num_sms == 24  # Buffer.set_num_sms(24), as a client does
    assert config_fields(d_run) == config_fields(Buffer.get_dispatch_config(2))
    assert config_fields(c_run) == config_fields(Buffer.get_combine_config(2))
    assert d_run.num_sms == 24 and c_run.num_sms == 24
    _, _, d_run, _ = point_configs(2, 32, None, None)
    assert d_run.num_sms == 32 and Buffer.num_sms == 32


def test_explicit_sizes_make_one_config_and_a_missing_size_comes_from_the_preset() -> None:
    preset = Buffer.get_dispatch_config(2)
    dcfg, ccfg, d_run, c_run = point_configs(2, 24, 4, None)
    assert dcfg is ccfg is d_run is c_run
    assert config_fields(dcfg) == [24, 4, int(preset.num_max_nvl_chunked_recv_tokens)]
    dcfg, *_ = point_configs(2, 20, 300, 256)  # the chunk is kept below the ring
    assert config_fields(dcfg) == [20, 255, 256]


def test_fp8_scales_are_column_major_by_default_and_row_major_on_request() -> None:
    gen = torch.Generator().manual_seed(0)
    T, H = 48, 7168
    col = fp8_scales(T, H, "col", gen, "cpu")
    assert col.shape == (T, H // 128) and col.dtype == torch.float32
    assert col.stride() == (1, T) and not col.is_contiguous() and col.T.is_contiguous()
    assert bool((col > 0).all())
    row = fp8_scales(T, H, "row", gen, "cpu")
    assert row.shape == (T, H // 128) and row.is_contiguous() and row.stride() == (H // 128, 1)
    assert build_parser().parse_args([]).scales is None and _args().scales == "col"
    with pytest.raises(ValueError, match="scale layout"):
        fp8_scales(T, H, "diag", gen, "cpu")


def _row(dtype: str, disp: float, nccl_disp: float, **extra) -> dict:
    return {"ranks": 2, "tokens": 4096, "hidden": 7168, "experts": 256, "topk": 8, "dtype": dtype, "num_sms": 24,
            "nvl_send": 2, "nvl_recv": 256, "mode": "api", "dispatch_us": disp, "nccl_dispatch_us": nccl_disp,
            "dispatch_host_us": 30.0, "nccl_dispatch_host_us": 10.0, "dispatch_nvlink_GBps": 100.0,
            "combine_us": 400.0 if dtype == "bf16" else 999.0, "nccl_combine_us": 300.0, "combine_host_us": 20.0,
            "peer_copy_GBps": 150.0, "sm_push_GBps": 300.0, **extra}


def test_per_op_summary_ratio_combine_row_and_fp8_over_bf16() -> None:
    ops = op_summary([_row("fp8", 300.0, 200.0), _row("bf16", 400.0, 400.0)])
    assert [e["op"] for e in ops] == ["dispatch fp8", "dispatch bf16", "combine"]
    fp8, bf16, comb = ops
    assert fp8["speedup"] == round(200.0 / 300.0, 2) and bf16["speedup"] == 1.0  # NCCL us / ours us
    assert comb["ours_us"] == 400.0 and comb["speedup"] == 0.75  # combine from the BF16 point
    assert all(e["fp8_over_bf16_dispatch"] == 0.75 for e in ops)
    assert fp8["ours_host_us"] == 30.0 and fp8["nccl_host_us"] == 10.0
    assert fp8["peer_copy_GBps"] == 150.0 and fp8["sm_push_GBps"] == 300.0 and fp8["mode"] == "api"
    # a point without NCCL (--no-nccl) has no ratio; the combine from the buffer gets its own line when timed
    ops = op_summary([_row("bf16", 400.0, None, combine_view_us=200.0)])
    assert [e["op"] for e in ops] == ["dispatch bf16", "combine", "combine from the buffer"]
    assert ops[0]["speedup"] is None and ops[2]["ours_us"] == 200.0 and ops[2]["speedup"] == 1.5
    # --combine-staged: each path forced gets its line (the plain combine is the default's path)
    ops = op_summary([_row("bf16", 400.0, 300.0, combine_ring_us=420.0, combine_staged_us=250.0,
                           combine_ce_us=240.0)])
    assert [e["op"] for e in ops] == ["dispatch bf16", "combine", "combine ring", "combine staged",
                                      "combine copy engines"]
    assert ops[2]["ours_us"] == 420.0 and ops[2]["speedup"] == round(300.0 / 420.0, 2)
    assert ops[3]["ours_us"] == 250.0 and ops[3]["speedup"] == round(300.0 / 250.0, 2)
    assert ops[4]["ours_us"] == 240.0 and ops[4]["speedup"] == round(300.0 / 240.0, 2)


def test_per_op_table_lists_each_op_with_ours_nccl_ratio_host_and_ceilings() -> None:
    lines = op_table(op_summary([_row("fp8", 300.0, 200.0), _row("bf16", 400.0, 400.0)])).splitlines()
    header = lines[0].split()
    for col in ("ours_us", "nccl_us", "ours/nccl", "ours_host", "nccl_host", "copy_ceil", "push_ceil"):
        assert col in header, col
    body = [ln for ln in lines[1:4]]
    assert body[0].split()[header.index("ours_us") + 1] == "300.0"  # "dispatch fp8" is two words
    assert body[0].split()[header.index("ours/nccl") + 1] == "0.67"
    assert any(ln.startswith("FP8 / BF16 dispatch time") and ln.endswith("0.75") for ln in lines)


def test_report_prints_the_tables_and_writes_the_json(tmp_path, capsys) -> None:
    args = _args("--json", str(tmp_path / "b.json"), "--png", "")
    rows = [_row("fp8", 300.0, 200.0), _row("bf16", 400.0, 400.0)]
    out = report(args, {"rows": rows, "peer_copy_GBps": 150.0, "sm_push_GBps": 300.0}, 2, "fake GPU", 1.0)
    text = capsys.readouterr().out
    assert "mode: API defaults" in text and "SM push 300.0 GB/s" in text and "all columns:" in text
    data = json.loads((tmp_path / "b.json").read_text())
    assert data == json.loads(json.dumps(out))
    assert data["mode"] == "api" and data["device"] == "fake GPU" and data["ranks"] == 2
    assert data["sm_push_GBps"] == 300.0 and data["peer_copy_GBps"] == 150.0 and len(data["rows"]) == 2
    assert [e["op"] for e in data["ops"]] == ["dispatch fp8", "dispatch bf16", "combine"]
    assert data["args"]["scales"] == "col" and data["args"]["tokens"] == [4096]


def test_report_prints_each_ranks_host_speed_and_keeps_it_in_the_json(tmp_path, capsys) -> None:
    args = _args("--json", str(tmp_path / "b.json"), "--png", "")
    host = {"start": [{"loop_us": 60.0, "cpu": 3}, {"loop_us": 130.0, "cpu": 0}],
            "end": [{"loop_us": 62.0, "cpu": 3}, {"loop_us": 125.0, "cpu": 8}]}
    rows = [_row("fp8", 300.0, 200.0), _row("bf16", 400.0, 400.0)]
    out = report(args, {"rows": rows, "peer_copy_GBps": 150.0, "sm_push_GBps": 300.0, "host": host}, 2, "fake", 1.0)
    captured = capsys.readouterr()
    assert "host: a 2000-step Python loop" in captured.out and "rank 1 cpu 0 130/125 us" in captured.out
    assert "NOTE: the host loop ran up to 2.2x slower" in captured.err
    assert json.loads((tmp_path / "b.json").read_text())["host"] == host == out["host"]
