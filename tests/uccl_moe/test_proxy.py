"""Python tests of the CPU proxy bindings: loopback proxies between processes, counters, error propagation."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from datetime import timedelta
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

from uccl_moe import errors  # noqa: E402
from uccl_moe import proxy as uproxy  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("proxy_worker.py")


def _run_ranks(scenario: str, world: int = 2, extra_env: dict[str, str] | None = None,
               env_for_rank: dict[int, dict[str, str]] | None = None) -> list[str]:
    master = dist.TCPStore("127.0.0.1", 0, world_size=None, is_master=True, timeout=timedelta(seconds=60),
                           wait_for_workers=False)
    job = "py" + uuid.uuid4().hex[:10]
    procs = []
    for r in range(world):
        env = dict(os.environ, PYTHONPATH=str(ROOT), **(extra_env or {}), **((env_for_rank or {}).get(r, {})))
        cmd = [sys.executable, str(WORKER), scenario, str(r), str(world), str(master.port), job]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    outs = []
    for r, p in enumerate(procs):
        try:
            out, _ = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
            pytest.fail(f"rank {r} hung:\n{out}")
        assert p.returncode == 0, f"rank {r} failed (exit {p.returncode}):\n{out}"
        outs.append(out)
    return outs


@pytest.mark.mp
def test_loopback_write_counters_barrier_two_processes():
    _run_ranks("write", extra_env={"UCCL_MOE_LOOPBACK_REORDER_WINDOW": "8", "UCCL_MOE_LOOPBACK_DELAY_US": "20"})


@pytest.mark.mp
def test_loopback_three_processes_ring():
    _run_ranks("write", world=3, extra_env={"UCCL_MOE_LOOPBACK_REORDER_WINDOW": "4"})


@pytest.mark.mp
def test_thread_failure_raises_transport_error():
    _run_ranks("error")


@pytest.mark.mp
def test_drop_raises_timeout_naming_the_command():
    outs = _run_ranks("drop", env_for_rank={0: {"UCCL_MOE_LOOPBACK_DROP_EVERY": "2"}})
    assert "lost command" in outs[0]


def test_transports_lists_loopback_last():
    names = uproxy.transports()
    assert names[-1] == ("loopback", True)


def test_bad_arguments_raise_clear_errors():
    store = dist.HashStore()
    with pytest.raises(errors.InvalidUsageError, match="rank=2"):
        uproxy.Proxy(2, 2, store)
    with pytest.raises(errors.InvalidUsageError, match="transport="):
        uproxy.Proxy(0, 1, store, transport="pigeon")
    with pytest.raises(errors.InvalidTypeError):
        uproxy.Proxy(0, 1, object())
    p = uproxy.Proxy(0, 1, store, transport="loopback", num_threads=1, fifos_per_thread=1,
                     job="bad" + uuid.uuid4().hex[:8], cpus="")
    with pytest.raises(errors.InvalidUsageError, match="fifo=3"):
        p.push_quiet(3)
    with pytest.raises(errors.InvalidUsageError, match="bytes="):
        p.push_write(0, 0, 1 << 24, 0, 0)
    with pytest.raises(errors.InvalidUsageError, match="multiples of 4"):
        p.push_write(0, 0, 16, 2, 0)
    with pytest.raises(errors.InvalidUsageError, match="counter_value"):
        p.push_atomic(0, 0, 1, 300)
    with pytest.raises(errors.InvalidUsageError, match="UCCL_MOE_MAX_INFLIGHT_WRITES"):
        uproxy.Proxy(0, 1, store, transport="loopback", max_inflight_writes=1000, job="w" + uuid.uuid4().hex[:8])


def test_single_rank_self_loop_with_hash_store():
    store = dist.HashStore()
    with uproxy.Proxy(0, 1, store, transport="loopback", num_threads=1, fifos_per_thread=2,
                      job="self" + uuid.uuid4().hex[:8], cpus="") as p:
        d = p.data()
        d[:64] = 7
        p.wait(1, p.push_write(1, 0, 64, 0, 4096, counter_slot=3, counter_add=5))
        p.wait(0, p.push_quiet(0))
        assert (d[4096:4160] == 7).all()
        ctr = p.counter_array()
        for _ in range(100000):
            if ctr[3] == 5:
                break
        assert ctr[3] == 5
        assert p.counters().writes == 1
        assert p.running
    assert not p.running


def test_counter_names_are_one_list():
    """ProxyCounters' fields, the binding's dict and the C++ struct all come from uccl_moe/proxy_counters.def."""
    store = dist.HashStore()
    with uproxy.Proxy(0, 1, store, transport="loopback", num_threads=2, fifos_per_thread=1,
                      job="names" + uuid.uuid4().hex[:8], cpus="") as p:
        assert list(p._p.counters()) == list(uproxy.ProxyCounters._fields)
        assert all(list(t) == list(uproxy.ProxyCounters._fields) for t in p._p.thread_counters())
    assert len(uproxy.ProxyCounters._fields) == 12 and uproxy.ProxyCounters._fields[-1] == "peak_inflight_window"


def test_proxy_timeout_is_resolved_once(monkeypatch):
    """An explicit timeout_s wins; without one the proxy resolves UCCL_MOE_TIMEOUT_S when it is created and keeps it."""
    from uccl_moe import _C

    store = dist.HashStore()
    p = uproxy.Proxy(0, 1, store, transport="loopback", num_threads=1, fifos_per_thread=1, timeout_s=7.5,
                     job="to" + uuid.uuid4().hex[:8], cpus="")
    assert p.timeout_s == 7.5
    with pytest.raises(errors.InvalidUsageError, match="timeout_s=0 must be > 0"):
        uproxy.Proxy(0, 1, store, transport="loopback", num_threads=1, timeout_s=0.0, job="t0" + uuid.uuid4().hex[:8])
    monkeypatch.setenv("UCCL_MOE_TIMEOUT_S", "42")
    _C.env_reset_cache()
    try:
        q = uproxy.Proxy(0, 1, store, transport="loopback", num_threads=1, fifos_per_thread=1,
                         job="to" + uuid.uuid4().hex[:8], cpus="")
        assert q.timeout_s == 42.0
        monkeypatch.setenv("UCCL_MOE_TIMEOUT_S", "3")
        _C.env_reset_cache()
        assert q.timeout_s == 42.0  # resolved once, at creation
    finally:
        monkeypatch.delenv("UCCL_MOE_TIMEOUT_S")
        _C.env_reset_cache()
