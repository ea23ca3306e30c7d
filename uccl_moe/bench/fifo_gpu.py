"""``python -m uccl_moe.bench.fifo_gpu``: GPU -> CPU proxy FIFO throughput and latency with GPU producers.

One process, one GPU, one rank whose proxy runs the loopback transport to itself: every command is an ATOMIC
(a zero-byte write-with-immediate carrying a counter add), so each one crosses the whole path — GPU push into
the mapped FIFO, proxy poll, transport post, completion, immediate receipt, ordering engine, counter add, FIFO
retire — without moving payload. For each proxy thread count:
  - ``flood``: ``--producers`` GPU threads per FIFO (in different warps) push its ``--cmds`` commands back to back;
    commands/s = all commands / the slowest producer's time from first push to its last completion (GPU timer);
  - ``pingpong``: one GPU thread pushes a command and waits until the proxy retired it, ``--cmds`` times; p50/p99
    of push -> retirement seen by the GPU (an upper bound of push -> proxy).
Prints a table and writes JSON (``--json``). These are proxy figures of this host's CPU, not NIC figures.
"""

from __future__ import annotations

import argparse
import json
import sys
import uuid
from typing import Any

import torch

from .. import _C


class _DictStore:
    def __init__(self) -> None:
        self.kv: dict[str, bytes] = {}

    def set(self, key: str, value: bytes) -> None:
        self.kv[key] = value

    def get(self, key: str, timeout_s: float) -> bytes:
        return self.kv[key]


_WARMUP_CMDS = 1000  # per FIFO, before the timed flood


def run(threads: int, cmds: int, fifos_per_thread: int, device: int, producers: int = 1) -> dict[str, Any]:
    store = _DictStore()
    rt = _C.RdmaRuntime(0, 1, 1, 64 << 20, device, f"fifo{uuid.uuid4().hex[:8]}", store.set, store.get,
                        num_threads=threads)
    nvl = _C.NvlRuntime(0, 1, 64 << 20, device)
    nvl.connect([nvl.ipc_handle()])
    try:
        rt.start()
        stream = torch.cuda.current_stream().cuda_stream
        num_fifos = threads * fifos_per_thread
        # warm-up, then flood
        warm = torch.zeros(num_fifos, dtype=torch.int64, device="cuda")
        _C.fifo_bench(runtime=rt, nvl=nvl, num_fifos=num_fifos, cmds=_WARMUP_CMDS, dst_rank=0, pingpong=False,
                      out_ns=warm.data_ptr(), stream=stream)
        flood = torch.zeros(num_fifos * producers, dtype=torch.int64, device="cuda")
        _C.fifo_bench(runtime=rt, nvl=nvl, num_fifos=num_fifos, cmds=cmds, dst_rank=0, pingpong=False,
                      out_ns=flood.data_ptr(), stream=stream, producers=producers)
        lat = torch.zeros(cmds, dtype=torch.int64, device="cuda")
        _C.fifo_bench(runtime=rt, nvl=nvl, num_fifos=1, cmds=cmds, dst_rank=0, pingpong=True, out_ns=lat.data_ptr(),
                      stream=stream)
        torch.cuda.synchronize()
        if nvl.aborted():
            raise RuntimeError(nvl.diag()["message"])
        rt.check()
        pushed = num_fifos * (_WARMUP_CMDS + cmds) + cmds  # warm-up, flood, pingpong: one counter add each
        applied = int(rt.proxy_counters()["applied_updates"])
        if applied != pushed:
            raise RuntimeError(f"the proxy applied {applied} counter updates for {pushed} commands pushed")
        slowest = int(flood.max())
        lat_us = lat.double().cpu() / 1e3
        return {"threads": threads, "fifos": num_fifos, "producers_per_fifo": producers, "cmds_per_fifo": cmds,
                "mcmds_per_s": num_fifos * cmds / slowest * 1e3 if slowest > 0 else float("nan"),
                "p50_us": float(lat_us.quantile(0.5)), "p99_us": float(lat_us.quantile(0.99)),
                "mean_us": float(lat_us.mean()), "proxy": dict(rt.proxy_counters())}
    finally:
        rt.destroy()
        nvl.destroy()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", default="1,2,4", help="proxy thread counts, comma list")
    p.add_argument("--fifos-per-thread", type=int, default=8)
    p.add_argument("--cmds", type=int, default=20000, help="commands per FIFO (flood) and pingpong rounds")
    p.add_argument("--producers", type=int, default=1,
                   help="GPU threads pushing into each FIFO in the flood (in different warps; the FIFO is "
                        "multi-producer, as the kernels' warps are)")
    p.add_argument("--json", default="", help="write the results here")
    args = p.parse_args(argv)
    from ._gpus import gpus_or_explain

    if not gpus_or_explain("python -m uccl_moe.bench.fifo_gpu (GPU threads push into the FIFOs)"):
        return 2
    dev = torch.cuda.current_device()
    rows = [run(int(t), args.cmds, args.fifos_per_thread, dev, args.producers) for t in args.threads.split(",") if t]
    print(f"device: {torch.cuda.get_device_name(dev)}; loopback transport to self; ATOMIC commands; "
          f"{args.producers} GPU producer thread(s) per FIFO")
    print(f"{'threads':>7} {'fifos':>5} {'Mcmds/s':>8} {'p50 us':>7} {'p99 us':>7} {'mean us':>8}")
    for r in rows:
        print(f"{r['threads']:>7} {r['fifos']:>5} {r['mcmds_per_s']:>8.2f} {r['p50_us']:>7.2f} {r['p99_us']:>7.2f} "
              f"{r['mean_us']:>8.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
