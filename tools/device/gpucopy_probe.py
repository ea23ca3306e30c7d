"""Probe of the GPU-copy loopback hangs (PROBE_T tokens x PROBE_H hidden, 2 ranks as 2 nodes): cached dispatches
with the host either blocking in torch.cuda.synchronize() (SYNC=block) or polling an event without blocking
(SYNC=poll)."""
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from helpers.mp import run_shared_gpu_ranks  # noqa: E402


def worker(rank, world, gloo, mode):
    from uccl_moe import Buffer, Config

    cfg = Config(24, 8, 256, 6, 128)
    T, H = int(os.environ.get("PROBE_T", "256")), int(os.environ.get("PROBE_H", "2048"))
    nat = Buffer(dist.group.WORLD, cfg.get_nvl_buffer_size_hint(2 * H, world), 1 << 30, backend="native",
                 explicitly_destroy=True)
    E, K = 4 * world, 2
    idx = torch.randint(0, E, (T, K), device="cuda")
    x = torch.randn((T, H), device="cuda").bfloat16()
    w = torch.rand((T, K), device="cuda")
    lay = nat.get_dispatch_layout(idx, E)

    def wait():
        if mode == "block":
            torch.cuda.synchronize()
        else:
            ev = torch.cuda.Event()
            ev.record()
            while not ev.query():
                time.sleep(0.0005)

    r = nat.dispatch(x, num_tokens_per_rank=lay.num_tokens_per_rank, is_token_in_rank=lay.is_token_in_rank,
                     num_tokens_per_expert=lay.num_tokens_per_expert, topk_idx=idx, topk_weights=w, config=cfg)
    wait()
    for i in range(5):
        t0 = time.time()
        nat.dispatch(x, handle=r.handle, config=cfg)
        nat.combine(r.recv_x, r.handle, config=cfg)
        wait()
        nat._backend._check_alive()
        print(f"rank {rank} {mode}: call {i} ok in {time.time() - t0:.3f}s", flush=True)
    dist.barrier(group=gloo)
    nat.destroy()


if __name__ == "__main__":
    mode = os.environ.get("SYNC", "block")
    env = {"UCCL_MOE_EMULATE_NODES": "2", "UCCL_MOE_TIMEOUT_S": os.environ.get("UCCL_MOE_TIMEOUT_S", "8"),
           "UCCL_MOE_LOOPBACK_GPU_COPY": "1", "UCCL_MOE_PROXY_THREADS": os.environ.get("UCCL_MOE_PROXY_THREADS", "1"),
           "CUDA_MODULE_LOADING": os.environ.get("CUDA_MODULE_LOADING", "EAGER")}
    run_shared_gpu_ranks(worker, 2, mode, env=env, timeout_s=90)
