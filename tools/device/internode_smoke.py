"""Smoke/debug run of the internode path: W ranks on the visible GPUs (shared when fewer), emulated nodes.
   python tools/device/internode_smoke.py [world] [nodes]   (prints proxy counters while the first dispatch runs)"""
import os
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from helpers.mp import run_shared_gpu_ranks  # noqa: E402


def worker(rank, world, gloo, nodes):
    from uccl_moe import Buffer, Config

    cfg = Config(24, 8, 256, 6, 128)
    nat = Buffer(dist.group.WORLD, cfg.get_nvl_buffer_size_hint(4096, world), 1 << 30, backend="native",
                 explicitly_destroy=True)
    inter = nat._backend._inter
    print(f"rank {rank}: topology {nat.topology} transport {inter.rt.transport}", flush=True)
    stop = threading.Event()

    def mon():
        while not stop.wait(1.0):
            print(f"rank {rank} t={time.time() % 100:.1f} {inter.proxy_counters()} failed={inter.rt.failed()}",
                  flush=True)
    threading.Thread(target=mon, daemon=True).start()
    T, E, K = 64, 4 * world, 2
    idx = torch.randint(0, E, (T, K), device="cuda")
    x = torch.randn((T, 2048), device="cuda").bfloat16()
    w = torch.rand((T, K), device="cuda")
    lay = nat.get_dispatch_layout(idx, E)
    t0 = time.time()
    r = nat.dispatch(x, num_tokens_per_rank=lay.num_tokens_per_rank, is_token_in_rank=lay.is_token_in_rank,
                     num_tokens_per_expert=lay.num_tokens_per_expert, topk_idx=idx, topk_weights=w, config=cfg)
    torch.cuda.synchronize()
    print(f"rank {rank}: dispatch ok in {time.time() - t0:.3f}s, {r.recv_x.shape[0]} rows", flush=True)
    c = nat.combine(r.recv_x, r.handle, topk_weights=r.recv_topk_weights, config=cfg)
    torch.cuda.synchronize()
    print(f"rank {rank}: combine ok {tuple(c.combined_x.shape)}", flush=True)
    stop.set()
    dist.barrier(group=gloo)
    nat.destroy()


if __name__ == "__main__":
    world = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    nodes = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    os.environ.setdefault("UCCL_MOE_EMULATE_NODES", str(nodes))
    run_shared_gpu_ranks(worker, world, nodes, env={"UCCL_MOE_EMULATE_NODES": str(nodes),
                                                    "UCCL_MOE_TIMEOUT_S": os.environ.get("UCCL_MOE_TIMEOUT_S", "10"),
                                                    "UCCL_MOE_PROXY_THREADS": "1"}, timeout_s=120)
