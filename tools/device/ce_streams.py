"""Copy-engine bandwidth between GPU 0 and GPU 1 over 1-4 streams per direction, one way and both ways at once: does a
second stream (a second engine) move more than one? (docs/intranode.md, session 43: it does not on 2 x H100.)

Each stream moves an equal share of the bytes with cudaMemcpyAsync under peer access, `--reps` times back to back; the
figure is bytes / (wall time / reps) per direction, the best of three runs. Needs 2 GPUs (a device machine:
tools/device); prints one line per size and direction.
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import os
import sys
import time
from typing import Any

STREAMS = (1, 2, 3, 4)
SIZES = (29_360_128, 58_720_256)  # the FP8 and BF16 dispatches' rows at the bench's headline setting


def _cudart(torch: Any) -> Any:
    """The CUDA runtime torch loaded (its wheel's, else the toolkit's)."""
    here = os.path.dirname(torch.__file__)
    paths = sorted(glob.glob(os.path.join(here, "..", "nvidia", "cuda_runtime", "lib", "libcudart.so*")))
    paths += sorted(glob.glob(os.path.join(here, "lib", "libcudart*.so*")))
    paths += sorted(glob.glob("/usr/local/cuda*/lib64/libcudart.so*"))
    if not paths:
        raise SystemExit("ce_streams.py: no libcudart found next to torch or under /usr/local/cuda*")
    return ctypes.CDLL(paths[0])


def gbps(nbytes: int, streams: int, senders: tuple[int, ...], reps: int, copy: Any, sync: Any) -> float:
    """GB/s per direction of `reps` back-to-back copies of `nbytes` from each GPU in `senders` to the other, split
    over `streams` streams (shares rounded down to 4 KiB)."""
    sync()
    part = (nbytes // streams) // 4096 * 4096
    t0 = time.perf_counter()
    for _ in range(reps):
        for d in senders:
            for j in range(streams):
                copy(d, j, part)
    sync()
    return part * streams * reps / (time.perf_counter() - t0) / 1e9


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=20, help="copies per stream, back to back")
    args = p.parse_args(argv)
    import torch

    if torch.cuda.device_count() < 2:
        print("ce_streams.py needs 2 GPUs (run it on a device machine: tools/device)", file=sys.stderr)
        return 2
    rt = _cudart(torch)
    for a, b in ((0, 1), (1, 0)):
        torch.cuda.set_device(a)
        torch.zeros(1, device=a)
        err = rt.cudaDeviceEnablePeerAccess(b, 0)
        if err not in (0, 704):  # 704: cudaErrorPeerAccessAlreadyEnabled
            raise SystemExit(f"cudaDeviceEnablePeerAccess({b}) on GPU {a}: error {err}")
    n = max(SIZES)
    src = [torch.empty(n, dtype=torch.uint8, device=d) for d in (0, 1)]
    dst = [torch.empty(n, dtype=torch.uint8, device=1 - d) for d in (0, 1)]  # dst[d]: on d's peer
    streams = {d: [torch.cuda.Stream(device=d) for _ in STREAMS] for d in (0, 1)}

    def copy(d: int, j: int, part: int) -> None:
        err = rt.cudaMemcpyAsync(ctypes.c_void_p(dst[d].data_ptr() + j * part),
                                 ctypes.c_void_p(src[d].data_ptr() + j * part), ctypes.c_size_t(part),
                                 4, ctypes.c_void_p(streams[d][j].cuda_stream))  # 4: cudaMemcpyDefault
        if err != 0:
            raise SystemExit(f"cudaMemcpyAsync: error {err}")

    def sync() -> None:
        for d in (0, 1):
            torch.cuda.synchronize(d)

    for nbytes in SIZES:
        for senders, name in (((0,), "one way"), ((0, 1), "both ways")):
            line = []
            for s in STREAMS:
                gbps(nbytes, s, senders, 3, copy, sync)  # warm-up
                best = max(gbps(nbytes, s, senders, args.reps, copy, sync) for _ in range(3))
                line.append(f"{s} streams {best:6.1f}")
            print(f"{nbytes / 1e6:5.1f} MB {name:9s}: " + "  ".join(line) + " GB/s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
