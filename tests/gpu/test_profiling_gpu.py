"""Step timing and profiling on CUDA: MoeTimer's spans with real events and a side-stream "comm", and the timeline of
a real torch.profiler trace with NCCL kernels under compute (2 GPUs)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers.mp import run_gpu_ranks

pytestmark = pytest.mark.gpu

_CYCLES_PER_MS: float | None = None


def _sleep_ms(ms: float) -> None:
    """A kernel that spins for about `ms` on the current stream (cycles calibrated once)."""
    global _CYCLES_PER_MS
    if _CYCLES_PER_MS is None:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(10_000_000)
        end.record()
        end.synchronize()
        _CYCLES_PER_MS = 10_000_000 / start.elapsed_time(end)
    torch.cuda._sleep(int(ms * _CYCLES_PER_MS))


class _AsyncDispatcher:
    """uccl's stream pattern: token_dispatch/token_combine issue the "comm" on a side stream and return; the compute
    stream waits for it in *_postprocess."""

    def __init__(self, comm_ms: float) -> None:
        self.comm_ms = comm_ms
        self.stream = torch.cuda.Stream()
        self.event: Any = None
        self.issued: list[tuple[str, Any, Any]] = []

    def _issue(self, kind: str) -> None:
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            _sleep_ms(self.comm_ms)
            end.record()
            self.event = end
        self.issued.append((kind, start, end))

    def comm_ms_of(self, kind: str) -> float:
        """Side-stream time of the "comm" of `kind` issued since the last call (the spans a timer must cover)."""
        total = sum(s.elapsed_time(e) for k, s, e in self.issued if k == kind)
        self.issued = [x for x in self.issued if x[0] != kind]
        return float(total)

    def _wait(self) -> None:
        torch.cuda.current_stream().wait_event(self.event)

    def dispatch_preprocess(self, x: torch.Tensor, routing_map: Any, probs: Any) -> tuple[torch.Tensor, Any]:
        return x, probs

    def token_dispatch(self, x: torch.Tensor, probs: Any) -> tuple[torch.Tensor, Any]:
        self._issue("dispatch")
        return x, probs

    def dispatch_postprocess(self, x: torch.Tensor, probs: Any) -> tuple[torch.Tensor, None, Any]:
        self._wait()
        return x, None, probs

    def combine_preprocess(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def token_combine(self, x: torch.Tensor) -> torch.Tensor:
        self._issue("combine")
        return x

    def combine_postprocess(self, x: torch.Tensor) -> torch.Tensor:
        self._wait()
        return x


class _Layer(torch.nn.Module):
    def __init__(self, comm_ms: float) -> None:
        super().__init__()
        self.token_dispatcher: Any = _AsyncDispatcher(comm_ms)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = self.token_dispatcher
        h, p = d.dispatch_preprocess(x, None, None)
        h, p = d.token_dispatch(h, p)
        h, _, p = d.dispatch_postprocess(h, p)
        h = d.combine_preprocess(h @ h.T @ h)
        h = d.token_combine(h)
        return d.combine_postprocess(h)  # type: ignore[no-any-return]


def test_moe_timer_sees_side_stream_comm():
    from uccl_moe.train.step_stats import MoeTimer

    layer = _Layer(comm_ms=5.0).cuda()
    timer = MoeTimer(layer, torch.device("cuda"))
    x = torch.randn(256, 256, device="cuda")
    layer(x)  # warm-up (cuBLAS, the sleep calibration)
    timer.collect()
    # what timing token_dispatch alone on the current stream saw: almost nothing of the side-stream work
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    layer.token_dispatcher.token_dispatch(x, None)
    end.record()
    layer.token_dispatcher.dispatch_postprocess(x, None)
    torch.cuda.synchronize()
    assert start.elapsed_time(end) < 1.0
    disp = layer.token_dispatcher
    disp.issued.clear()
    for _ in range(3):
        layer(x)
    ms = timer.collect()
    # Each span covers its side-stream comm (the sleep's length varies with the clock: compare with what it took).
    comm = {k: disp.comm_ms_of(k) for k in ("dispatch", "combine")}
    assert comm["dispatch"] > 3 * 1.0 and comm["combine"] > 3 * 1.0, comm
    assert ms["dispatch"][0] >= 0.98 * comm["dispatch"] and ms["combine"][0] >= 0.98 * comm["combine"], (ms, comm)


def _nccl_under_compute(rank: int, world: int, gloo: Any, out_dir: str) -> dict[str, Any]:
    from uccl_moe.train import timeline
    from uccl_moe.train.profiler import StepProfiler

    args = argparse.Namespace(profile=True, profile_step_start=2, profile_step_end=4, profile_ranks=[0],
                              profile_dir=out_dir, loss_log=None, train_iters=4)
    prof = StepProfiler(args, rank, torch.device("cuda", torch.cuda.current_device()))
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    buf = torch.randn(64 << 20, device="cuda")
    side = torch.cuda.Stream()
    for _ in range(4):
        prof.step()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            recv = torch.empty_like(buf)
            dist.all_to_all_single(recv, buf)
        for _ in range(8):
            a = (a @ a).clamp_(-1, 1)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
    prof.close()
    if rank != 0:
        return {}
    assert prof.path is not None
    return timeline.analyze(timeline.kernels_of(timeline.load_trace(prof.path)))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_timeline_of_real_trace_nccl_under_compute(tmp_path: Path):
    res = run_gpu_ranks(_nccl_under_compute, 2, str(tmp_path), timeout_s=240)[0]
    streams = res["streams"]
    assert any(s["dominant"] == "nccl" for s in streams) and any(s["main"] for s in streams), streams
    nccl = res["comm"]["nccl"]
    assert nccl["busy_ms"] > 0 and nccl["overlap_compute_ms"] > 0, res
    assert res["comm"]["uccl"]["busy_ms"] == 0.0
