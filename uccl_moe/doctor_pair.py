"""``uccl-moe doctor --pair``: the transport self-test between every rank and the next one, through the real proxy
and transport (``uccl_moe.proxy.Proxy``), with the fix of each failure."""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from typing import Any

from . import env as _env
from .doctor_host import _compact, _native, _thor2_bytes_per_gpu, _torch_gpus
from .errors import CommTimeoutError, TransportError, UcclMoeError


def _fix_for(e: BaseException) -> str:
    msg = str(e)
    if "RETRY_EXC" in msg or "retry" in msg.lower():
        return (f"transport retries exhausted (CQE 12): lower UCCL_MOE_MAX_INFLIGHT_BYTES/WRITES (Thor-2: "
                f"{_thor2_bytes_per_gpu()}/1), check PFC/ECN and that UCCL_MOE_IB_TC maps to the lossless class")
    if "RNR" in msg:
        return "receiver not ready: the peer posted no receive (EFA: a provider without unsolicited receive); report it"
    if "reg_mr" in msg or "dmabuf" in msg or "REM_ACCESS" in msg or "access" in msg.lower():
        return "memory registration: load nvidia_peermem / efa_nv_peermem or use dma-buf; check ulimit -l unlimited"
    if isinstance(e, CommTimeoutError) or "timed out" in msg.lower() or "timeout" in msg.lower():
        return ("the peer never saw the data: RoCE: check UCCL_MOE_IB_GID_INDEX (same subnet or routed RoCE v2) and "
                "UCCL_MOE_IB_TC; EFA: the security group must allow all traffic to itself; IB: the subnet manager")
    if isinstance(e, TransportError):
        return "see the transport error above; `uccl-moe doctor` (without --pair) lists the NIC, GID and settings"
    return "unexpected failure: rerun with UCCL_MOE_LOG_LEVEL=INFO and report it"


def _wait_counter(arr: Any, idx: int, want: int, timeout_s: float, what: str, at_least: bool = False) -> None:
    end = time.monotonic() + timeout_s
    while not (int(arr[idx]) >= want if at_least else int(arr[idx]) == want):
        if time.monotonic() > end:
            raise CommTimeoutError(f"{what}: counter {idx} is {int(arr[idx])}, expected {want} after {timeout_s:.0f} s")
        time.sleep(0)


# long: the self-test steps are closures over one live proxy (start, writes, atomic, barrier, latency, bandwidth)
def run_pair(rank: int, world: int, store: Any, *, local_rank: int, ranks_per_node: int, transport: str,
             job: str, gpu_pci_bus_id: str = "", bw_bytes: int = 1 << 20, bw_iters: int = 32, lat_iters: int = 200,
             timeout_s: float = 30.0, barrier: Any = None) -> dict[str, Any]:
    """The self-test of one rank: rank r writes to r+1 and hears from r-1. Returns {"nic", "transport", "tests":
    [{name, ok, detail, fix}]}. `barrier()` synchronizes the ranks outside the transport (a gloo barrier)."""
    import numpy as np

    from .proxy import Proxy

    peer, src = (rank + 1) % world, (rank - 1) % world
    chunk = max(4096, bw_bytes)
    data_bytes = 4 * chunk
    recv = chunk  # [0, chunk): what we send; [chunk, 2 chunk): what src writes to us
    tests: list[dict[str, Any]] = []
    result: dict[str, Any] = {"rank": rank, "transport": transport, "tests": tests}
    sync = barrier or (lambda: None)

    def step(name: str, fn: Any) -> bool:
        if proxy is not None and tests and not tests[-1]["ok"]:
            try:
                proxy.check()
            except UcclMoeError as e:  # a failed proxy fails every later test at once: name the first cause only
                tests.append({"name": name, "ok": False, "detail": f"not run: the proxy failed ({type(e).__name__})",
                              "fix": "see the first failure"})
                return False
        t0 = time.perf_counter()
        try:
            detail = fn() or "ok"
            tests.append({"name": name, "ok": True, "detail": detail, "fix": "",
                          "ms": round(1e3 * (time.perf_counter() - t0), 2)})
            return True
        except Exception as e:  # noqa: BLE001 - every failure is reported with its fix
            tests.append({"name": name, "ok": False, "detail": f"{type(e).__name__}: {e}", "fix": _fix_for(e)})
            return False

    proxy: Any = None

    def start() -> str:
        nonlocal proxy
        proxy = Proxy(rank, world, store, transport=transport, data_bytes=data_bytes, job=job, timeout_s=timeout_s,
                      ranks_per_node=ranks_per_node, gpu_pci_bus_id=gpu_pci_bus_id or None, local_rank=local_rank)
        proxy.start()
        nic = proxy.nic()
        result["nic"] = nic
        return f"{proxy.transport_name}, {proxy.num_threads} threads, NIC {'+'.join(nic['devices']) or '-'}"

    if not step("connect", start):
        return result
    data, ctr = proxy.data(), proxy.counter_array()
    pattern = ((np.arange(4096, dtype=np.int64) * 7 + rank * 13) % 251).astype(np.uint8)
    expect = ((np.arange(4096, dtype=np.int64) * 7 + src * 13) % 251).astype(np.uint8)

    def write() -> str:
        data[:4096] = pattern
        proxy.wait(0, proxy.push_write(0, peer, 4096, 0, recv))
        sync()
        if not np.array_equal(data[recv:recv + 4096], expect):
            raise TransportError(f"write: the bytes from rank {src} did not land (or landed corrupted)")
        return "4 KiB landed intact"

    def write_imm() -> str:
        data[:4096] = pattern[::-1]
        proxy.push_write(0, peer, 4096, 0, recv + 4096, counter_slot=1, counter_add=1)
        _wait_counter(ctr, src * 256 + 1, 1, timeout_s, "write-with-immediate")
        if not np.array_equal(data[recv + 4096:recv + 8192], expect[::-1]):
            raise TransportError("write-with-immediate: the counter moved but the bytes are wrong")
        return "counter after data"

    def atomic() -> str:
        proxy.push_atomic(0, peer, 2, 5)
        proxy.push_atomic(0, peer, 2, -2)
        _wait_counter(ctr, src * 256 + 2, 3, timeout_s, "software atomic")
        return "5 - 2 = 3"

    def barrier_test() -> str:
        proxy.wait(0, proxy.push_barrier(0))
        return "all ranks met"

    def latency() -> str:
        samples = []
        for i in range(1, lat_iters + 1):
            t0 = time.perf_counter()
            proxy.push_write(0, peer, 8, 0, recv, counter_slot=3, counter_add=1)
            _wait_counter(ctr, src * 256 + 3, i, timeout_s, "latency", at_least=True)  # the peer may be a step ahead
            samples.append(time.perf_counter() - t0)
        samples.sort()
        return f"latency {1e6 * samples[len(samples) // 2]:.1f} us (ring step, 8 B write + counter, median)"

    def bandwidth() -> str:
        sync()
        t0 = time.perf_counter()
        idx = 0
        for _ in range(bw_iters):
            idx = proxy.push_write(0, peer, chunk, 0, recv)
        proxy.wait(0, idx)
        dt = time.perf_counter() - t0
        return f"bandwidth {bw_iters * chunk / dt / 1e9:.2f} GB/s ({bw_iters} x {chunk >> 10} KiB writes)"

    try:
        for name, fn in (("write", write), ("write_with_imm", write_imm), ("software_atomic", atomic),
                         ("barrier", barrier_test), ("latency", latency), ("bandwidth", bandwidth)):
            step(name, fn)
        sync()
        step("stop", lambda: proxy.stop() or "clean")
    finally:
        if proxy is not None and proxy.running:
            try:
                proxy.stop()
            except UcclMoeError:
                pass
    return result


def _pair_env() -> tuple[int, int, int, int]:
    """(rank, world, local_rank, local_world) from torchrun or srun."""
    e = os.environ
    if "RANK" in e and "WORLD_SIZE" in e:
        return (int(e["RANK"]), int(e["WORLD_SIZE"]), int(e.get("LOCAL_RANK", 0)),
                int(e.get("LOCAL_WORLD_SIZE", e["WORLD_SIZE"])))
    if "SLURM_PROCID" in e:
        world = int(e["SLURM_NTASKS"])
        local_world = int(e.get("SLURM_NTASKS_PER_NODE", "0").split("(")[0] or world)
        return int(e["SLURM_PROCID"]), world, int(e.get("SLURM_LOCALID", 0)), local_world
    return -1, 0, 0, 0


def pair_main(args: argparse.Namespace) -> int:
    rank, world, local_rank, local_world = _pair_env()
    if world < 2:
        print("uccl-moe doctor --pair: needs 2+ ranks: run it as `torchrun --nproc-per-node 2 -m uccl_moe.cli doctor "
              "--pair` (one host), or under srun with RANK/WORLD_SIZE or SLURM_PROCID/SLURM_NTASKS and "
              "MASTER_ADDR/MASTER_PORT set", file=sys.stderr)
        return 2
    import torch.distributed as dist

    os.environ.setdefault("RANK", str(rank))
    os.environ.setdefault("WORLD_SIZE", str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        hosts: list[Any] = [None] * world
        dist.all_gather_object(hosts, socket.gethostname())
        nodes = len(set(hosts))
        C = _native()
        transport = args.transport or str(_env.get("TRANSPORT"))
        note = ""
        if transport == "auto":
            usable = [n for n, ok in C.proxy_transports() if ok and n != "loopback"]
            if not usable:
                transport, note = "loopback", "no RDMA devices here: the self-test runs over the loopback transport"
            else:
                transport = usable[0]
        if transport == "loopback" and nodes > 1:
            if rank == 0:
                print(f"uccl-moe doctor --pair: {nodes} nodes but no RDMA transport usable "
                      f"({note or 'UCCL_MOE_TRANSPORT=loopback'}): loopback does not leave a host. Fix: install the "
                      "NIC driver and rdma-core (run `uccl-moe doctor` on a node)", file=sys.stderr)
            return 1
        gpu_bus = ""
        try:
            gpus = _torch_gpus()
            if gpus:
                gpu_bus = gpus[local_rank % len(gpus)]["pci_bus_id"]
        except Exception:  # noqa: BLE001 - a broken CUDA setup must not hide the transport test
            gpu_bus = ""
        token: list[Any] = [os.urandom(4).hex()]
        dist.broadcast_object_list(token, src=0)
        from .proxy import StoreBootstrap

        store = StoreBootstrap(dist.distributed_c10d._get_default_store(), prefix=f"uccl_moe/doctor{token[0]}/")
        res = run_pair(rank, world, store, local_rank=local_rank,
                       ranks_per_node=local_world if world % max(local_world, 1) == 0 else world,
                       transport=transport, job=f"doctor{token[0]}", gpu_pci_bus_id=gpu_bus,
                       bw_bytes=args.bytes, bw_iters=args.iters, timeout_s=args.timeout,
                       barrier=lambda: dist.barrier())
        res["host"] = socket.gethostname()
        results: list[Any] = [None] * world
        dist.all_gather_object(results, res)
    finally:
        dist.destroy_process_group()
    failed = [t for r in results for t in r["tests"] if not t["ok"]]
    if rank == 0:
        if args.json:
            print(json.dumps({"nodes": nodes, "transport": transport, "note": note, "ranks": results}, indent=1))
        else:
            print(f"uccl-moe doctor --pair: {world} ranks on {nodes} node(s) over {transport}" +
                  (f" ({note})" if note else ""))
            for r in results:  # one line per rank; failures spelled out with their fix
                nic = r.get("nic") or {}
                nic_s = "+".join(nic.get("devices", [])) or "-"
                cpus = _compact(nic.get("pinned_cpus", [])) or "unpinned"
                ok = [t for t in r["tests"] if t["ok"]]
                figures = {t["name"]: t["detail"] for t in ok if t["name"] in ("latency", "bandwidth")}
                print(f"  rank {r['rank']:<3} {r['host']} nic {nic_s} cpus {cpus}: {len(ok)}/{len(r['tests'])} ok"
                      + "".join(f" | {v}" for v in figures.values()))
                skipped = [t["name"] for t in r["tests"] if not t["ok"] and t["detail"].startswith("not run")]
                for t in r["tests"]:
                    if not t["ok"] and t["name"] not in skipped:
                        print(f"      FAIL {t['name']}: {t['detail']}\n           fix: {t['fix']}")
                if skipped:
                    print(f"      not run after that failure: {', '.join(skipped)}")
            print("PASS" if not failed else f"FAIL: {len(failed)} test(s) failed")
    return 1 if failed else 0
