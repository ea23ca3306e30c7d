"""train_gpt's optional step statistics (``--log-memory``, ``--log-cpu``, ``--log-moe-timing``) and the CPU shims that
let Megatron's alltoall dispatcher run on CPU (what ``uccl-moe compare dispatchers=[uccl,alltoall]`` needs without
GPUs)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from helpers.requires import require

require("megatron.core")

import torch

from uccl_moe.train.step_stats import MoeTimer, format_ms_list, peak_memory_mib, process_cpu_s

ROOT = Path(__file__).resolve().parents[3]


class _Clock:
    """A fake time line in ms: the dispatcher methods advance it by fixed amounts, so spans come out exact."""

    def __init__(self) -> None:
        self.now_ms = 0.0

    def advance(self, ms: float) -> None:
        self.now_ms += ms


class _Dispatcher:
    """Megatron's six-method contract. Each method takes `cost_ms[name]` of (fake or real) time."""

    def __init__(self, cost_ms: dict[str, float], clock: _Clock | None = None) -> None:
        self.cost_ms = cost_ms
        self.clock = clock
        self.calls = 0

    def _spend(self, name: str) -> None:
        ms = self.cost_ms.get(name, 0.0)
        if self.clock is not None:
            self.clock.advance(ms)
        elif ms:
            time.sleep(ms / 1000.0)

    def dispatch_preprocess(self, x: torch.Tensor, routing_map: torch.Tensor,
                            probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self._spend("dispatch_preprocess")
        return x, probs

    def token_dispatch(self, x: torch.Tensor, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.calls += 1
        self._spend("token_dispatch")
        return x * 2, probs

    def dispatch_postprocess(self, x: torch.Tensor, probs: torch.Tensor) -> tuple[torch.Tensor, None, torch.Tensor]:
        self._spend("dispatch_postprocess")
        return x, None, probs

    def combine_preprocess(self, x: torch.Tensor) -> torch.Tensor:
        self._spend("combine_preprocess")
        return x

    def token_combine(self, x: torch.Tensor) -> torch.Tensor:
        self._spend("token_combine")
        return x + 1

    def combine_postprocess(self, x: torch.Tensor) -> torch.Tensor:
        self._spend("combine_postprocess")
        return x


class _Layer(torch.nn.Module):
    """MoELayer's call order: dispatch_preprocess -> token_dispatch -> dispatch_postprocess -> experts ->
    combine_preprocess -> token_combine -> combine_postprocess."""

    def __init__(self, cost_ms: dict[str, float], clock: _Clock | None = None) -> None:
        super().__init__()
        self.token_dispatcher: Any = _Dispatcher(cost_ms, clock)
        self.clock = clock
        self.expert_ms = cost_ms.get("experts", 0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = self.token_dispatcher
        h, probs = d.dispatch_preprocess(x, x > 0, x)
        h, probs = d.token_dispatch(h, probs)
        h, _, probs = d.dispatch_postprocess(h, probs)
        if self.clock is not None:  # the experts: between the two spans, in neither
            self.clock.advance(self.expert_ms)
        h = d.combine_preprocess(h)
        h = d.token_combine(h)
        return d.combine_postprocess(h)  # type: ignore[no-any-return]


# uccl's shape of the forward: token_dispatch/token_combine only issue the comm; the wait is in *_postprocess.
_ASYNC_MS = {"dispatch_preprocess": 1.0, "token_dispatch": 2.0, "dispatch_postprocess": 4.0, "experts": 8.0,
             "combine_preprocess": 16.0, "token_combine": 32.0, "combine_postprocess": 64.0}


class _FakeEvent:
    """torch.cuda.Event on the fake clock (record() reads it, elapsed_time() subtracts)."""

    clock = _Clock()

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.t_ms: float | None = None

    def record(self) -> None:
        self.t_ms = self.clock.now_ms

    def elapsed_time(self, end: _FakeEvent) -> float:
        assert self.t_ms is not None and end.t_ms is not None
        return end.t_ms - self.t_ms


@pytest.fixture
def fake_cuda(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(_FakeEvent, "clock", clock)
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    synced = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: synced.append(1))
    return clock, synced


def test_moe_timer_spans_preprocess_to_postprocess_exactly(fake_cuda):
    """dispatch = dispatch_preprocess + token_dispatch + dispatch_postprocess, combine likewise; the experts between
    the phases are in neither. Timing token_dispatch/token_combine alone (the old timer) gives 2 and 32."""
    clock, synced = fake_cuda
    model = torch.nn.Sequential(_Layer(_ASYNC_MS, clock), torch.nn.Linear(2, 2), _Layer(_ASYNC_MS, clock))
    timer = MoeTimer(model, torch.device("cuda"))
    assert len(timer.layers) == 2
    x = torch.ones(3, 2)
    assert torch.equal(model[0](x), x * 2 + 1)  # results pass through the wrappers unchanged
    model[0](x)  # a second micro-batch of layer 0
    model[2](x)
    assert timer.collect() == {"dispatch": [14.0, 7.0], "combine": [224.0, 112.0]}
    assert synced  # events are read after a synchronize
    assert timer.collect() == {"dispatch": [0.0, 0.0], "combine": [0.0, 0.0]}
    assert model[0].token_dispatcher.calls == 2


def test_moe_timer_pairs_spans_per_layer(fake_cuda):
    clock, _ = fake_cuda
    a, b = _Layer(_ASYNC_MS, clock), _Layer(_ASYNC_MS, clock)
    timer = MoeTimer(torch.nn.ModuleList([a, b]), torch.device("cuda"))
    da, db = a.token_dispatcher, b.token_dispatcher
    x = torch.ones(1, 2)
    # interleaved layers: a's span [0, 10) holds b's whole span [1, 6); each layer gets its own
    da.dispatch_preprocess(x, x, x)
    db.dispatch_preprocess(x, x, x)
    db.dispatch_postprocess(x, x)
    da.dispatch_postprocess(x, x)
    assert timer.collect()["dispatch"] == [10.0, 5.0]
    # a postprocess without an open span is not timed; a span left open at collect() is dropped, so it cannot pair
    # with the next step's postprocess
    da.dispatch_postprocess(x, x)
    db.combine_preprocess(x)
    assert timer.collect() == {"dispatch": [0.0, 0.0], "combine": [0.0, 0.0]}
    clock.advance(1000.0)
    b(x)
    assert timer.collect() == {"dispatch": [0.0, 7.0], "combine": [0.0, 112.0]}


def test_moe_timer_cpu_clock_and_untouched_instances():
    cost = {"dispatch_preprocess": 15.0, "dispatch_postprocess": 15.0, "combine_postprocess": 20.0}
    model = torch.nn.Sequential(_Layer(cost), torch.nn.Linear(2, 2))
    other = _Dispatcher({})  # another instance of the class keeps its plain methods
    timer = MoeTimer(model, torch.device("cpu"))
    model[0](torch.ones(3, 2))
    ms = timer.collect()
    assert 30 <= ms["dispatch"][0] < 200 and 20 <= ms["combine"][0] < 200  # token_dispatch/combine take no time
    assert not any(m in vars(other) for m in ("dispatch_preprocess", "dispatch_postprocess", "token_dispatch"))
    plain = torch.nn.Sequential(torch.nn.Linear(2, 2))
    assert MoeTimer(plain, torch.device("cpu")).layers == []


def test_process_cpu_s_counts_every_thread():
    def spin(seconds: float) -> None:
        # Burn CPU time of this thread (not wall time), so a loaded machine cannot starve the count.
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    t0 = process_cpu_s()
    worker = threading.Thread(target=spin, args=(0.3,))
    worker.start()
    worker.join()  # this thread waits (no CPU); the worker burns ~0.3 s
    assert process_cpu_s() - t0 >= 0.2


def test_peak_memory_and_format():
    before = peak_memory_mib(torch.device("cpu"))
    assert before > 10  # a Python process with torch loaded
    assert format_ms_list([1.0, 0.12345]) == "[1.000,0.123]"


@pytest.mark.timeout(120)
def test_cpu_shims_let_alltoall_run_host_side():
    script = textwrap.dedent("""
        import numpy as np, torch
        from uccl_moe.megatron import cpu
        cpu.apply()
        from megatron.core.transformer.moe import moe_utils, token_dispatcher
        s = torch.cuda.Stream()
        assert isinstance(s, cpu.HostStream) and s is torch.cuda.current_stream()
        with torch.cuda.stream(s):
            ev = s.record_event()
        ev.synchronize()
        assert ev.query()
        t = torch.tensor([3, 5])
        a = token_dispatcher.maybe_move_tensor_to_cpu(t, as_numpy=True)
        assert isinstance(a, np.ndarray) and a.tolist() == [3, 5]
        assert token_dispatcher.maybe_move_tensor_to_cpu(t) is t
        cpu.apply()  # idempotent
        assert moe_utils.maybe_move_tensor_to_cpu is token_dispatcher.maybe_move_tensor_to_cpu
        print("ok")
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=110,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
