"""train_gpt's optional step statistics (``--log-memory``, ``--log-moe-timing``) and the CPU shims that let Megatron's
alltoall dispatcher run on CPU (what ``uccl-moe compare dispatchers=[uccl,alltoall]`` needs without GPUs)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from uccl_moe.megatron.step_stats import MoeTimer, format_ms_list, peak_memory_mib

ROOT = Path(__file__).resolve().parents[3]


class _Dispatcher:
    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.calls = 0

    def token_dispatch(self, x: torch.Tensor, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.calls += 1
        time.sleep(self.delay_s)
        return x * 2, probs

    def token_combine(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.delay_s / 2)
        return x + 1


class _Layer(torch.nn.Module):
    def __init__(self, delay_s: float) -> None:
        super().__init__()
        self.token_dispatcher: Any = _Dispatcher(delay_s)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, _ = self.token_dispatcher.token_dispatch(x, x)
        return self.token_dispatcher.token_combine(y)  # type: ignore[no-any-return]


def test_moe_timer_times_each_layer_and_resets():
    model = torch.nn.Sequential(_Layer(0.02), torch.nn.Linear(2, 2), _Layer(0.04))
    other = _Dispatcher(0.0)  # another instance of the class keeps its plain methods
    timer = MoeTimer(model, torch.device("cpu"))
    assert len(timer.layers) == 2
    x = torch.ones(3, 2)
    out = model[0](x)  # results pass through the wrapper unchanged
    assert torch.equal(out, x * 2 + 1)
    model[0](x)
    model[2](x)
    ms = timer.collect()
    assert 40 <= ms["dispatch"][0] < 200 and 40 <= ms["dispatch"][1] < 200  # 2 x 20 ms; 1 x 40 ms
    assert 20 <= ms["combine"][0] < 150 and 20 <= ms["combine"][1] < 150
    assert timer.collect() == {"dispatch": [0.0, 0.0], "combine": [0.0, 0.0]}
    assert "token_dispatch" not in vars(other) and model[0].token_dispatcher.calls == 2


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
