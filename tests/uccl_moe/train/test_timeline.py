"""``python -m uccl_moe.train.timeline``: kernel classes, interval arithmetic and the overlap figures, on small
synthetic chrome traces with exact answers (times in µs, multiples of 250 so every ms figure is exact in binary)."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers.requires import require

require("megatron.core")

from uccl_moe.train import timeline as tl

ROOT = Path(__file__).resolve().parents[3]


def _k(name: str, ts: float, dur: float, stream: Any = None, tid: Any = None, device: int = 0,
       cat: str = "kernel") -> dict[str, Any]:
    """A kineto kernel event: stream in args (as torch.profiler writes it) and/or in tid."""
    args: dict[str, Any] = {"device": device, "correlation": 1}
    if stream is not None:
        args["stream"] = stream
    return {"ph": "X", "cat": cat, "name": name, "pid": device, "tid": tid if tid is not None else stream,
            "ts": ts, "dur": dur, "args": args}


GEMM = "ampere_sgemm_128x64_nn"
# Device 0. Stream 7: the main compute stream; 20: uccl's comm stream; 30: a side compute stream (shared expert);
# 40: NCCL.
#
#   µs        0    1000  2000  3000  4000  5000  6000  7000  8000  9000
#   7   gemm  [=====================)            [===========)          + a duplicate gemm and a nested kernel
#   20  uccl        [=================)     [===========)                 dispatch, notify (touching), combine
#   30  fc1            [=====)
#   40  nccl                                           [===========)     AllReduce [7000,8500) + SendRecv [8000,9000)
TRACE = {"traceEvents": [
    _k(GEMM, 0, 4000, stream=7),
    _k(GEMM, 0, 4000, stream=7),  # duplicate
    _k("vectorized_elementwise_kernel<4, add>", 500, 500, stream=7),  # nested in the gemm
    _k(GEMM, 6000, 2000, stream=7),
    _k("void uccl_moe::intranode::dispatch_intranode_kernel<8, 768>(DispatchArgs)", 1000, 2000, stream=20),
    _k("void uccl_moe::intranode::notify_dispatch_kernel<8>(NotifyArgs)", 3000, 1000, stream=20),
    _k("void uccl_moe::intranode::combine_intranode_kernel<8>(CombineArgs)", 5000, 2000, stream=20),
    _k("shared_fc1_" + GEMM, 1500, 1000, stream=30),
    _k("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 7000, 1500, stream=40),
    _k("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", 8000, 1000, stream=40),
    # not kernels nor peer copies: ignored
    {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH", "pid": 0, "tid": 20, "ts": 4000, "dur": 1000,
     "args": {"stream": 20}},
    {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 123, "tid": 123, "ts": 0, "dur": 9000},
    {"ph": "s", "cat": "ac2g", "name": "ac2g", "pid": 0, "tid": 7, "ts": 0, "id": 1},
    {"ph": "M", "name": "thread_name", "pid": 0, "tid": 7, "args": {"name": "stream 7"}},
]}


def test_classify():
    assert tl.classify("void uccl_moe::internode::rdma_dispatch_kernel<8>(Args)") == "uccl"
    assert tl.classify("get_dispatch_layout_kernel<256, 32>") == "uccl"
    assert tl.classify("combine_reduce_kernel") == "uccl" and tl.classify("prepare_round_kernel") == "uccl"
    assert tl.classify("void uccl_moe::internode::rail_barrier_kernel(RdmaContext)") == "uccl"
    assert tl.classify("ncclDevKernel_AllToAll_RING") == "nccl" and tl.classify("NCCLKERNEL_SendRecv") == "nccl"
    assert tl.classify(GEMM) == "compute" and tl.classify("moe_permute_kernel") == "compute"


def test_union_and_intersect():
    assert tl.union([(5, 6), (1, 3), (2, 4), (4, 4.5), (7, 7), (1, 3)]) == [(1, 4.5), (5, 6)]  # touching merges
    assert tl.union([(0, 10), (2, 3), (4, 5)]) == [(0, 10)]  # nested
    a = tl.union([(0, 4), (6, 8)])
    b = tl.union([(1, 2), (3, 7), (8, 9)])
    assert tl.intersect(a, b) == [(1, 2), (3, 4), (6, 7)]  # (8, 8) touches only: empty
    assert tl.intersect(a, []) == [] and tl.total(tl.intersect(a, b)) == 3


def test_overlaps_on_the_reference_trace():
    res = tl.analyze(tl.kernels_of(TRACE))
    assert res["totals"] == {"kernels": 10, "peer_copies": 0, "devices": 1, "streams": 4, "window_ms": 9.0,
                             "uccl_busy_ms": 5.0, "nccl_busy_ms": 2.0, "compute_busy_ms": 6.0}
    by = {s["stream"]: s for s in res["streams"]}
    assert [s["stream"] for s in res["streams"]] == [7, 20, 30, 40]
    assert by[7] == {"device": 0, "stream": 7, "main": True, "kernels": 4, "peer_copies": 0, "busy_ms": 6.0,
                     "uccl_ms": 0.0,
                     "nccl_ms": 0.0, "compute_ms": 6.0, "kernels_by_class": {"uccl": 0, "nccl": 0, "compute": 4},
                     "dominant": "compute"}
    assert (by[20]["kernels"], by[20]["busy_ms"], by[20]["uccl_ms"], by[20]["dominant"]) == (3, 5.0, 5.0, "uccl")
    assert (by[30]["busy_ms"], by[30]["main"], by[30]["dominant"]) == (1.0, False, "compute")
    assert (by[40]["kernels"], by[40]["busy_ms"], by[40]["nccl_ms"], by[40]["dominant"]) == (2, 2.0, 2.0, "nccl")
    # uccl [1000,4000) + [5000,7000) under compute of streams 7/30 [0,4000) + [6000,8000): 3000 + 1000 µs;
    # under the side stream 30 alone: [1500,2500)
    assert res["comm"]["uccl"] == {"busy_ms": 5.0, "overlap_compute_ms": 4.0, "hidden_fraction": 0.8,
                                   "overlap_side_compute_ms": 1.0}
    # nccl [7000,9000) under the gemm [6000,8000): 1000 µs; nothing on the side stream then
    assert res["comm"]["nccl"] == {"busy_ms": 2.0, "overlap_compute_ms": 1.0, "hidden_fraction": 0.5,
                                   "overlap_side_compute_ms": 0.0}
    text = tl.render(res)
    assert "uccl: 5.000 ms busy, 4.000 ms under compute on other streams (80.0% hidden), 1.000 ms under side-stream" \
        in text
    assert "7 (main)" in text and "nccl: 2.000 ms busy, 1.000 ms under compute" in text
    json.dumps(res)


def test_only_other_streams_count_and_tid_streams():
    """Streams taken from tid (int or "stream N" text) when args have none; a comm kernel overlapping compute on its
    own stream does not count as hidden."""
    trace = [
        _k(GEMM, 0, 2000, tid=7),
        _k("dispatch_intranode_kernel", 1000, 2000, tid="stream 7"),  # same stream as the gemm: not hidden
        {**_k(GEMM, 2500, 1000, tid=8), "args": {}},  # no args at all; stream 8, device from pid
    ]
    res = tl.analyze(tl.kernels_of(trace))
    assert [(s["stream"], s["kernels"], s["main"]) for s in res["streams"]] == [(7, 2, True), (8, 1, False)]
    assert res["comm"]["uccl"] == {"busy_ms": 2.0, "overlap_compute_ms": 0.5, "hidden_fraction": 0.25,
                                   "overlap_side_compute_ms": 0.5}  # [2500,3000) under stream 8's gemm
    assert res["streams"][0]["busy_ms"] == 3.0 and res["totals"]["compute_busy_ms"] == 3.0
    # --main-stream 8: stream 7's gemm becomes the side compute, which only overlaps comm on its own stream
    res8 = tl.analyze(tl.kernels_of(trace), main_stream=8)
    assert [s["main"] for s in res8["streams"]] == [False, True]
    assert res8["comm"]["uccl"]["overlap_side_compute_ms"] == 0.0
    assert res8["comm"]["uccl"]["overlap_compute_ms"] == 0.5


def test_no_overlap_and_devices_apart():
    trace = {"traceEvents": [
        _k("combine_intranode_kernel", 0, 1000, stream=20),
        _k(GEMM, 1000, 1000, stream=7),  # right after the comm: touching, not overlapping
        _k(GEMM, 0, 1000, stream=7, device=1),  # same time, other GPU: not an overlap
        _k("ncclDevKernel_AllToAll", 0, 500, stream=9, device=1),  # under device 1's gemm: hidden
    ]}
    res = tl.analyze(tl.kernels_of(trace))
    assert res["totals"]["devices"] == 2 and res["totals"]["window_ms"] == 3.0  # 2 ms on device 0 + 1 ms on device 1
    assert res["totals"]["compute_busy_ms"] == 2.0
    assert res["comm"]["uccl"] == {"busy_ms": 1.0, "overlap_compute_ms": 0.0, "hidden_fraction": 0.0,
                                   "overlap_side_compute_ms": 0.0}
    assert res["comm"]["nccl"]["overlap_compute_ms"] == 0.5 and res["comm"]["nccl"]["hidden_fraction"] == 1.0
    assert [(s["device"], s["stream"]) for s in res["streams"]] == [(0, 7), (0, 20), (1, 7), (1, 9)]


def test_peer_copies_count_as_uccl_comm():
    """The copy-engine ops move their rows in peer-to-peer copies (CUPTI's PtoP): they count as uccl comm on their
    own streams, under compute of another; a local copy (DtoD) is left out."""
    trace = {"traceEvents": [
        _k(GEMM, 0, 4000, stream=7),
        _k("void uccl_moe::intranode::combine_ce_sum_kernel<8>(CeSumArgs)", 3000, 2000, stream=20),
        _k("Memcpy PtoP (Device -> Device)", 1000, 2500, stream=50, cat="gpu_memcpy"),  # a chunk of rows
        _k("Memcpy PtoP (Device -> Device)", 3500, 250, stream=50, cat="gpu_memcpy"),  # its flag
        _k("Memcpy DtoD (Device -> Device)", 0, 4000, stream=60, cat="gpu_memcpy"),  # local: not counted
    ]}
    res = tl.analyze(tl.kernels_of(trace))
    assert [(s["stream"], s["kernels"], s["peer_copies"], s["dominant"]) for s in res["streams"]] == [
        (7, 1, 0, "compute"), (20, 1, 0, "uccl"), (50, 0, 2, "uccl")]
    # uccl busy: [1000,3750) on stream 50 and [3000,5000) on 20, union [1000,5000); under the gemm [0,4000):
    # [1000,4000)
    assert res["comm"]["uccl"] == {"busy_ms": 4.0, "overlap_compute_ms": 3.0, "hidden_fraction": 0.75,
                                   "overlap_side_compute_ms": 0.0}
    assert (res["totals"]["kernels"], res["totals"]["peer_copies"], res["totals"]["compute_busy_ms"]) == (2, 2, 4.0)
    text = tl.render(res)
    assert text.startswith("2 kernels and 2 peer copies on 3 streams") and " copies " in text.splitlines()[1]


def test_empty_trace():
    res = tl.analyze(tl.kernels_of({"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0,
                                                       "dur": 5}]}))
    assert res["totals"]["kernels"] == 0 and res["streams"] == []
    assert res["comm"]["uccl"] == {"busy_ms": 0.0, "overlap_compute_ms": 0.0, "hidden_fraction": None,
                                   "overlap_side_compute_ms": 0.0}
    assert "uccl: no kernels" in tl.render(res)


def test_cli_table_json_and_gzip(tmp_path: Path, capsys):
    trace = tmp_path / "trace_rank0.json.gz"
    with gzip.open(trace, "wt") as f:
        json.dump(TRACE, f)
    out = tmp_path / "timeline.json"
    assert tl.main([str(trace), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "(80.0% hidden)" in text and f"wrote {out}" in text
    res = json.loads(out.read_text())
    assert res["comm"]["uccl"]["overlap_compute_ms"] == 4.0 and res["trace"] == str(trace)
    assert tl.main([str(tmp_path / "missing.json")]) == 2
    (tmp_path / "bad.json").write_text("{not json")
    assert tl.main([str(tmp_path / "bad.json")]) == 2
    assert "not JSON" in capsys.readouterr().err


@pytest.mark.timeout(120)
def test_module_entry(tmp_path: Path):
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps(TRACE))
    proc = subprocess.run([sys.executable, "-m", "uccl_moe.train.timeline", str(trace)], cwd=ROOT,
                          capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "10 kernels on 4 streams of 1 device(s), 9.000 ms" in proc.stdout


def test_every_kernel_of_ours_is_classified_uccl() -> None:
    """Each __global__ kernel under native/src counts as uccl (not compute) in the overlap figures; the combine from
    the buffer's pull kernel once did not. Self-tests that never run in training are the only exception."""
    import re

    root = Path(__file__).resolve().parents[3] / "native" / "src"
    kernel = re.compile(r"__global__\s+(?:void\s+)?(?:__launch_bounds__\([^)]*\)\s*)?(?:void\s+)?([A-Za-z_]\w*)\s*\(")
    names = {m[1] for p in root.rglob("*") if p.suffix in (".cu", ".cuh", ".cc")
             for m in kernel.finditer(p.read_text())}
    assert {"dispatch_intranode_kernel", "combine_pull_kernel", "stage_combine_rows_kernel", "combine_ce_sum_kernel",
            "ce_enter_kernel", "dispatch_ce_gather_kernel"} <= names, names
    unclassified = {n for n in names - {"wait_flag_selftest_kernel"}
                    if not any(pat in n.lower() for pat in tl.UCCL_KERNEL_PATTERNS)}
    assert not unclassified, f"add these to timeline.UCCL_KERNEL_PATTERNS: {sorted(unclassified)}"
