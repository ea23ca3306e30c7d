"""Debug: which tokens' combine differs from the reference, by the set of nodes they went to."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests", "gpu"))
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from helpers.mp import run_shared_gpu_ranks  # noqa: E402


def worker(rank, world, gloo, nodes):
    from test_intranode_native import _Case, _dispatch

    from uccl_moe import Buffer, Config

    cfg = Config(24, 8, 256, 6, 128)
    nvl = cfg.get_nvl_buffer_size_hint(4096, world)
    nat = Buffer(dist.group.WORLD, nvl, 1 << 30, backend="native", explicitly_destroy=True)
    ref = Buffer(gloo, nvl, 1 << 30, backend="reference", explicitly_destroy=True)
    T, H, E, K = int(os.environ.get("DBG_T", "64")), 2048, 8 * world, 8
    case = _Case(rank, world, T, H, E, K, False, "none", "random", 1)
    _, rn = _dispatch(nat, case, "cuda", config=cfg)
    _, rr = _dispatch(ref, case, "cpu", config=cfg)
    n = rn.recv_x.shape[0]
    y = torch.randn((n, H), generator=case.gen).bfloat16()
    for it in range(3):
        on = nat.combine(y.cuda(), rn.handle, config=cfg).combined_x.cpu().float()
        orf = ref.combine(y, rr.handle, config=cfg).combined_x.float()
        bad = ((on - orf).abs() > 0.05 + 0.02 * orf.abs()).any(1)
        G = world // nodes
        in_node = rr.handle[4].view(T, nodes, G).any(-1)
        lines = []
        for t in bad.nonzero().flatten().tolist()[:6]:
            ratio = (on[t] / orf[t]).median().item()
            lines.append(f"t={t} nodes={in_node[t].nonzero().flatten().tolist()} ratio~{ratio:.2f}")
        print(f"rank {rank} it {it}: {int(bad.sum())}/{T} bad; {lines}", flush=True)
    dist.barrier(group=gloo)
    nat.destroy()
    ref.destroy()


if __name__ == "__main__":
    world, nodes = int(sys.argv[1]), int(sys.argv[2])
    run_shared_gpu_ranks(worker, world, nodes, env={"UCCL_MOE_EMULATE_NODES": str(nodes), "UCCL_MOE_TIMEOUT_S": "20",
                                                    "UCCL_MOE_PROXY_THREADS": os.environ.get("THREADS", "2")},
                         timeout_s=120)
