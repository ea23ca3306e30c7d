"""Does the link between two GPUs take more than the copy engine alone when SM stores run beside it? Both GPUs push
into each other at once (as at EP2); a share of the bytes goes by SM stores (torch's BF16 -> float32 cast kernel on
the sender, storing float32 into the peer: a same-dtype contiguous pair would become an engine copy), the rest by the
copy engine (a same-dtype contiguous peer copy), on two streams per GPU. Prints GB/s per direction for each share
(median of --iters timed rounds, host-timed around a synchronize: the bytes make the rounds long enough).

    python tools/device/ce_sm_probe.py [--mib 192] [--shares 0,1,0.1,0.2,0.3,0.4,0] [--iters 15]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=192, help="MiB per direction and round")
    p.add_argument("--shares", default="0,1,0.1,0.2,0.3,0.4,0", help="the SMs' shares of the bytes, in [0, 1]")
    p.add_argument("--iters", type=int, default=15)
    args = p.parse_args(argv)
    shares = [float(v) for v in args.shares.split(",") if v.strip()]
    if not shares or any(not 0.0 <= v <= 1.0 for v in shares):
        p.error(f"--shares {args.shares!r}: comma-separated values in [0, 1]")
    import torch

    if torch.cuda.device_count() < 2 or not torch.cuda.can_device_access_peer(0, 1):
        print("ce_sm_probe needs 2 GPUs with peer access", file=sys.stderr)
        return 2
    total = args.mib << 20
    devs = (0, 1)
    ce_streams = [torch.cuda.Stream(d) for d in devs]
    sm_streams = [torch.cuda.Stream(d) for d in devs]
    ce_src = [torch.randint(0, 255, (total,), dtype=torch.uint8, device=d) for d in devs]
    ce_dst = [torch.empty(total, dtype=torch.uint8, device=d) for d in devs]
    sm_src = [torch.randn(total // 4, device=d).bfloat16() for d in devs]
    sm_dst = [torch.empty(total // 4, dtype=torch.float32, device=d) for d in devs]

    def push(share: float) -> None:
        n_sm = int(total * share) // 16 * 16  # float32 bytes the SMs store
        n_ce = total - n_sm
        for d in devs:
            peer = 1 - d
            with torch.cuda.device(d):
                if n_ce:
                    with torch.cuda.stream(ce_streams[d]):
                        ce_dst[peer][:n_ce].copy_(ce_src[d][:n_ce], non_blocking=True)
                if n_sm:
                    with torch.cuda.stream(sm_streams[d]):
                        sm_dst[peer][: n_sm // 4].copy_(sm_src[d][: n_sm // 4], non_blocking=True)

    def sync() -> None:
        for d in devs:
            torch.cuda.synchronize(d)

    for share in shares:
        for _ in range(3):
            push(share)
        times = []
        for _ in range(args.iters):
            sync()
            t0 = time.perf_counter()
            push(share)
            sync()
            times.append(time.perf_counter() - t0)
        t = statistics.median(times)
        print(f"SM share {share:.2f}: {total / t / 1e9:6.1f} GB/s per direction ({t * 1e6:8.1f} us)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
