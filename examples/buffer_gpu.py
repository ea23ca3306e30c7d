"""The Buffer API on GPUs: one rank per GPU, NCCL, the native backend (NVLink/xGMI kernels). GPU only.

Run:  torchrun --nproc-per-node 2 examples/buffer_gpu.py      (2-8 GPUs of one host; prints "buffer_gpu OK ...")

The same steps and the same plain-torch check as examples/buffer_cpu_gloo.py (layout, BF16 and FP8 dispatch,
cached dispatch, combine with weights); only the process group, the device and the backend differ.

Streams: every op runs on the Buffer's comm stream. With the defaults used here (async_finish=False, no
previous_event) the caller's current stream waits for it, so the results are ready to use on that stream. To
overlap, pass previous_event=Buffer.capture(), async_finish=True, allocate_on_comm_stream=True and call
event.current_stream_wait() on the returned EventOverlap where the result is first used (DeepEP's rules).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from buffer_cpu_gloo import moe_round_trip  # noqa: E402 - the example next to this one


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("buffer_gpu.py needs CUDA/ROCm GPUs; on CPU run examples/buffer_cpu_gloo.py")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    rank, world = dist.get_rank(), dist.get_world_size()

    os.environ["UCCL_MOE_BACKEND"] = "native"  # refuse a silent fallback: fail if the build has no GPU kernels
    line = moe_round_trip(rank, world, torch.device("cuda", local_rank), dist.group.WORLD)
    torch.cuda.synchronize()
    print(line, flush=True)
    dist.barrier()
    if rank == 0:
        print(f"buffer_gpu OK: {world} GPUs, native backend, layout, BF16 + FP8 dispatch, cached dispatch, combine "
              f"match torch", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
