"""One rank of the Python proxy tests (run as a subprocess by test_proxy.py).

    python tests/uccl_moe/proxy_worker.py <scenario> <rank> <world> <store_port> <job>

Exit code 0 = the scenario's checks passed; otherwise the failure is printed.
"""

from __future__ import annotations

import sys
import time
from datetime import timedelta


def main() -> int:
    scenario, rank, world, port, job = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    import torch.distributed as dist

    from uccl_moe.errors import CommTimeoutError, TransportError
    from uccl_moe.proxy import Proxy

    store = dist.TCPStore("127.0.0.1", port, world_size=None, is_master=False, timeout=timedelta(seconds=60))
    timeout = 1.0 if scenario == "drop" else 20.0
    p = Proxy(rank, world, store, transport="loopback", num_threads=2, fifos_per_thread=2, fifo_capacity=64,
              data_bytes=1 << 20, job=job, cpus="", timeout_s=timeout)
    p.start()
    peer = (rank + 1) % world
    data = p.data()
    ctr = p.counter_array()
    if scenario == "write":
        data[:4096] = (rank + 1) & 0xFF
        last = {}
        for i in range(16):
            f = i % p.num_fifos
            last[f] = p.push_write(f, peer, 256, i * 256, 65536 + i * 256, counter_slot=f, counter_add=1)
        for f, idx in last.items():
            p.wait(f, idx)
        src = (rank - 1) % world
        deadline = time.time() + 20
        while sum(int(ctr[src * 256 + f]) for f in range(p.num_fifos)) != 16:
            assert time.time() < deadline, f"counters stuck: {ctr[src * 256: src * 256 + 4]}"
            time.sleep(0.001)
        assert (data[65536:65536 + 4096] == ((src + 1) & 0xFF)).all(), "payload mismatch"
        p.wait(0, p.push_barrier(0))
        c = p.counters()
        assert c.writes == 16 and c.applied_updates == 16 and c.barriers == 1, c
        assert c.bytes == 16 * 256, c
        p.stop()
        print(f"rank {rank} ok {c}")
        return 0
    if scenario == "error":
        if rank == 0:
            idx = p.push_write(1, peer, 4096, 0, (1 << 20) - 256)  # past the peer's region
            try:
                p.wait(1, idx)
            except TransportError as e:
                assert "remote access error" in str(e) and "proxy thread 1 of rank 0" in str(e), str(e)
            else:
                raise AssertionError("expected TransportError")
            try:
                p.check()
            except TransportError:
                pass
            else:
                raise AssertionError("the error must stick")
            store.set(f"{job}/done", b"1")
        else:
            store.wait([f"{job}/done"])
            p.stop()
        print(f"rank {rank} ok")
        return 0
    if scenario == "drop":
        if rank == 0:
            last = 0
            for _ in range(4):
                last = p.push_write(0, peer, 64, 0, 4096)
            try:
                p.wait(0, last)
            except CommTimeoutError as e:
                assert "lost command" in str(e) and "WRITE dst_rank=1 bytes=64" in str(e), str(e)
                print(f"rank 0 got: {e}")
            else:
                raise AssertionError("expected CommTimeoutError")
            store.set(f"{job}/done", b"1")
        else:
            store.wait([f"{job}/done"])
            p.stop()
        return 0
    raise SystemExit(f"unknown scenario {scenario}")


if __name__ == "__main__":
    sys.exit(main())
