"""Native internode path (CPU proxy + loopback transport on GPUs + NVLink forwarding) against the reference backend.

Nodes are emulated on one host (UCCL_MOE_EMULATE_NODES): 2 nodes x 2 GPUs, 4 x 1 and 2 x 1, ranks sharing GPUs
when the machine has fewer. Every check draws fresh random inputs and compares with the reference Buffer on a gloo
group: layout (with tokens per node), received rows (BF16 and FP8 with row/column-major float or int scales), local
expert ids, weights, per-expert counts, source indices, the global rank prefix matrix; cached dispatch;
num_worst_tokens; combine with biases and top-k weights (BF16 tolerance; bitwise identical across runs); the round
trip; group-limited routing; back-to-back calls with a hash check. The same runs again with the loopback's most
aggressive reordering and delays, and a dropped command must surface as CommTimeoutError naming it. Both loopback
data paths run (host-staged, the default; GPU copy engines over CUDA IPC, which needs eager kernel loading and no
blocking pageable device-to-host copy while communication is in flight), and GPU copies under lazy kernel loading
must be refused with the remedy.

Env: UMOE_TEST_ITERS (back-to-back iterations, default 1000).
"""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist
from helpers.mp import run_shared_gpu_ranks
from test_intranode_native import Checks, _Case, _dispatch, _eq, check_back_to_back, check_case

pytestmark = pytest.mark.gpu

RDMA_BYTES = 1 << 30


def _group_limited(case: _Case, nodes: int, groups: int) -> None:
    """DeepSeek-style routing: each token picks experts only inside its `groups` best nodes."""
    gen = case.gen
    scores = torch.rand((case.T, case.E), generator=gen)
    per_node = scores.view(case.T, nodes, -1).amax(-1)
    keep = torch.topk(per_node, groups, dim=1).indices
    mask = torch.zeros((case.T, nodes), dtype=torch.bool).scatter_(1, keep, True)
    scores = scores * mask.repeat_interleave(case.E // nodes, dim=1)
    case.idx = torch.topk(scores, case.K, dim=1).indices.to(torch.int64)


def _close(got: torch.Tensor, want: torch.Tensor, magnitude: torch.Tensor) -> bool:
    got, want = got.detach().cpu().float(), want.float()
    return bool(((got - want).abs() <= 1e-2 + 1e-2 * want.abs() + magnitude * 2.0 ** -8).all())


def _synchronize_before_host_reads() -> None:
    """GPU-copy loopback rule for applications (docs/internode.md): no blocking pageable device-to-host copy while
    communication is in flight. The checks below read results with .cpu()/.tolist()/int(); make each of them wait for
    the device first, as such an application must."""
    def wrap(name: str) -> None:
        original = getattr(torch.Tensor, name)

        def synced(self: torch.Tensor, *args, **kwargs):
            if self.is_cuda:
                torch.cuda.synchronize()
            return original(self, *args, **kwargs)

        setattr(torch.Tensor, name, synced)

    for name in ("cpu", "tolist", "item", "__int__", "__float__", "__bool__"):
        wrap(name)


def _worker(rank: int, world: int, gloo, nodes: int, iters: int, host_staged: bool) -> None:
    from uccl_moe import Buffer, Config

    R = world
    torch.manual_seed(rank)
    cfg = Config(24, 8, 256, 6, 128)
    nvl = cfg.get_nvl_buffer_size_hint(7168 * 2, R)
    nat = Buffer(dist.group.WORLD, nvl, RDMA_BYTES, backend="native", explicitly_destroy=True)
    ref = Buffer(gloo, nvl, RDMA_BYTES, backend="reference", explicitly_destroy=True)
    assert nat.topology.num_nodes == nodes, nat.topology
    assert nat._backend._inter.rt.host_staged == host_staged, "the loopback ran the other data path"
    if not host_staged:
        _synchronize_before_host_reads()
    check = Checks(rank, R)

    # name, T, H, experts per rank, K, fp8, scales, routing
    cases = [
        ("bf16", 512, 2048, 8, 8, False, "none", "random"),
        ("bf16-neg", 300 + 17 * rank, 4096, 4, 4, False, "none", "neg"),
        ("bf16-skew", 700, 2048, 8, 8, False, "none", "skew"),
        ("bf16-empty-last", 256, 2048, 8, 4, False, "none", "empty_last"),
        ("bf16-group-limited", 640, 2048, 8, 8, False, "none", "group"),
        ("bf16-odd-hidden", 333, 2056, 4, 3, False, "none", "random"),
        ("bf16-1-token", 1, 2048, 4, 4, False, "none", "random"),
        ("bf16-7168", 1024, 7168, 16, 8, False, "none", "random"),
        ("fp8-row", 600, 4096, 8, 8, True, "row", "random"),
        ("fp8-col", 600, 7168, 8, 8, True, "col", "neg"),
        ("fp8-int", 400, 2048, 8, 8, True, "int", "random"),
    ]
    for seed, (name, T, H, per_rank, K, fp8, smode, routing) in enumerate(cases):
        E = per_rank * R
        case = _Case(rank, R, T, H, E, K, fp8, smode, "random" if routing == "group" else routing, seed + 100)
        if routing == "group":
            _group_limited(case, nodes, 1 if nodes == 2 else 2)
        lay_n = nat.get_dispatch_layout(case.idx.cuda(), E)
        lay_r = ref.get_dispatch_layout(case.idx, E)
        check(f"{name}: layout", _eq(lay_n.num_tokens_per_rank, lay_r.num_tokens_per_rank)
              and _eq(lay_n.num_tokens_per_expert, lay_r.num_tokens_per_expert)
              and _eq(lay_n.is_token_in_rank, lay_r.is_token_in_rank)
              and _eq(lay_n.num_tokens_per_rdma_rank, lay_r.num_tokens_per_rdma_rank))
        check_case(check, name, nat, ref, case, cfg, lay_r, worst=T * R if name != "bf16-neg" else 400 * R,
                   empty_rank=routing == "empty_last", combine_close=_close, repeats=5)

    # Back-to-back: dispatch + combine + cached dispatch `iters` times; hashes must not move, memory must not grow.
    check_back_to_back(check, nat, cfg, 8, iters, cached=True)
    stats = nat._backend._inter.proxy_counters()  # type: ignore[attr-defined]
    if check.verbose:
        print(f"rank {rank}: proxy counters {stats}", flush=True)
    check("proxy carried the traffic", stats["writes"] > 0 and stats["applied_updates"] > 0)

    check.finish(gloo, nat, ref)


_BASE_ENV = {"UCCL_MOE_PROXY_THREADS": "2", "UCCL_MOE_TIMEOUT_S": "60"}
_REORDER_ENV = {"UCCL_MOE_LOOPBACK_REORDER_WINDOW": "64", "UCCL_MOE_LOOPBACK_DELAY_US": "300",
                "UCCL_MOE_LOOPBACK_SEED": "7", "UCCL_MOE_MAX_INFLIGHT_WRITES": "16"}
# The loopback's two data paths: GPU memory copied by copy engines over CUDA IPC (needs eager kernel loading), and
# pinned host memory copied by the proxy.
_DATA_ENV = {"gpu": {"UCCL_MOE_LOOPBACK_GPU_COPY": "1", "CUDA_MODULE_LOADING": "EAGER"},
             "host": {"UCCL_MOE_LOOPBACK_GPU_COPY": "0"}}


@pytest.mark.parametrize("world,nodes,reorder,data", [
    (4, 2, False, "host"), (4, 4, False, "host"), (2, 2, False, "host"), (4, 2, True, "host"), (4, 4, True, "host"),
    (8, 2, False, "host"), (2, 2, False, "gpu"), (4, 2, False, "gpu"), (4, 4, True, "gpu")])
def test_native_internode_matches_reference(world: int, nodes: int, reorder: bool, data: str) -> None:
    iters = int(os.environ.get("UMOE_TEST_ITERS", "1000"))
    if reorder or world > 4 or data == "gpu":  # keep reordering, 8 shared ranks and the opt-in GPU copies short
        iters = min(iters, 100)
    env = {**_BASE_ENV, "UCCL_MOE_EMULATE_NODES": str(nodes), **_DATA_ENV[data], **(_REORDER_ENV if reorder else {})}
    run_shared_gpu_ranks(_worker, world, nodes, iters, data == "host", env=env, timeout_s=1200)


def _data_path_worker(rank: int, world: int, gloo) -> tuple[str, bool | None]:
    from uccl_moe import Buffer, Config, InvalidUsageError

    cfg = Config(24, 8, 256, 6, 128)
    try:
        nat = Buffer(dist.group.WORLD, cfg.get_nvl_buffer_size_hint(4096, world), RDMA_BYTES, backend="native",
                     explicitly_destroy=True)
    except InvalidUsageError as e:
        return str(e), None
    staged = nat._backend._inter.rt.host_staged
    nat.destroy()
    return "", staged


@pytest.mark.parametrize("gpu_copy", ["1", "0"])
def test_native_internode_lazy_loading_data_path(gpu_copy: str) -> None:
    """Under lazy kernel loading GPU copies would deadlock: =1 is refused with the remedy, =0 stages through host."""
    env = {**_BASE_ENV, "UCCL_MOE_EMULATE_NODES": "2", "CUDA_MODULE_LOADING": "LAZY",
           "UCCL_MOE_LOOPBACK_GPU_COPY": gpu_copy}
    results = run_shared_gpu_ranks(_data_path_worker, 2, env=env, timeout_s=300)
    for msg, staged in results:
        if gpu_copy == "1":
            assert "CUDA_MODULE_LOADING=EAGER" in msg and staged is None, (msg, staged)
        else:
            assert msg == "" and staged is True, (msg, staged)


# ------------------------------------------------------------------------------------------------ a dropped command
def _drop_worker(rank: int, world: int, gloo) -> None:
    from uccl_moe import Buffer, CommTimeoutError, Config

    cfg = Config(24, 8, 256, 6, 128)
    nat = Buffer(dist.group.WORLD, cfg.get_nvl_buffer_size_hint(2048 * 2, world), RDMA_BYTES, backend="native",
                 explicitly_destroy=True)
    case = _Case(rank, world, 256, 2048, 4 * world, 4, False, "none", "random", 5)
    messages: list[str] = []
    for _ in range(6):
        try:
            _, r = _dispatch(nat, case, "cuda", config=cfg)
            nat.combine(r.recv_x, r.handle, config=cfg)
            torch.cuda.synchronize()
        except CommTimeoutError as e:
            messages.append(str(e))
            break
    time.sleep(3)  # the proxy's own timeout check names the lost command
    try:
        nat.get_dispatch_layout(case.idx.cuda(), 4 * world)
    except CommTimeoutError as e:
        messages.append(str(e))
    everyone: list = [None] * world
    dist.all_gather_object(everyone, messages, group=gloo)
    assert all(m for m in everyone), f"a rank never raised CommTimeoutError: {everyone}"
    assert any("lost command" in msg and ("WRITE" in msg or "ATOMIC" in msg) for m in everyone for msg in m), everyone
    dist.barrier(group=gloo)
    nat.destroy()


@pytest.mark.parametrize("data", ["gpu", "host"])
def test_native_internode_dropped_command_raises(data: str) -> None:
    env = {**_BASE_ENV, "UCCL_MOE_EMULATE_NODES": "2", "UCCL_MOE_TIMEOUT_S": "4",
           "UCCL_MOE_LOOPBACK_DROP_EVERY": "5", **_DATA_ENV[data]}
    run_shared_gpu_ranks(_drop_worker, 2, env=env, timeout_s=300)


# ------------------------------------------------------------------------------------------------ RDMA buffer too small
def _small_buffer_worker(rank: int, world: int, gloo) -> None:
    from uccl_moe import Buffer, Config, InvalidUsageError

    cfg = Config(24, 8, 256, 6, 128)
    # Just the Config hint (passes the Buffer's own check): ~3150 staged rows of hidden 7168 fit per area.
    rdma = -(-cfg.get_rdma_buffer_size_hint(7168 * 2, world, 1) // 4096) * 4096
    nat = Buffer(dist.group.WORLD, cfg.get_nvl_buffer_size_hint(7168 * 2, world), rdma, backend="native",
                 explicitly_destroy=True)
    case = _Case(rank, world, 6000, 7168, 4 * world, 4, False, "none", "random", 9)  # ~6000 rows to the other node
    try:
        _dispatch(nat, case, "cuda", config=cfg)
    except InvalidUsageError as e:
        assert "num_rdma_bytes" in str(e) and "rows" in str(e), str(e)
    else:
        raise AssertionError("a dispatch that does not fit the RDMA buffer was accepted")
    # The refusal happened before any staging: a dispatch that fits still works on the same Buffer.
    small = _Case(rank, world, 64, 7168, 4 * world, 4, False, "none", "random", 10)
    _, r = _dispatch(nat, small, "cuda", config=cfg)
    torch.cuda.synchronize()
    assert r.recv_x.shape[0] == int(r.handle[0][-1, rank])
    dist.barrier(group=gloo)
    nat.destroy()
    # Sized by the staged rows (README: rdma_bytes_for), far below the ring hint: a batch that fits runs (dispatch
    # checks the staging itself, so Buffer does not hold it to the hint), and one that does not is refused.
    from uccl_moe.backends.internode import rdma_bytes_for

    tight = rdma_bytes_for(64, 7168, 4, 2)  # the runtime's 16 MiB floor: about 420 staged rows of hidden 7168
    assert tight < rdma
    nat = Buffer(dist.group.WORLD, cfg.get_nvl_buffer_size_hint(7168 * 2, world), tight, backend="native",
                 explicitly_destroy=True)
    ref = Buffer(gloo, cfg.get_nvl_buffer_size_hint(7168 * 2, world), rdma, backend="reference",
                 explicitly_destroy=True)
    (_, r), (_, want) = _dispatch(nat, small, "cuda", config=cfg), _dispatch(ref, small, "cpu", config=cfg)
    assert torch.equal(r.recv_x.cpu(), want.recv_x)
    y = r.recv_x * 0.5
    got = nat.combine(y, r.handle, config=cfg).combined_x
    want_c = ref.combine(y.cpu(), want.handle, config=cfg).combined_x
    assert _close(got, want_c, small.x.float().abs() * 4), "combine on the tight RDMA buffer"
    try:
        _dispatch(nat, _Case(rank, world, 1000, 7168, 4 * world, 4, False, "none", "random", 11), "cuda", config=cfg)
    except InvalidUsageError as e:
        assert "num_rdma_bytes" in str(e) and "rows" in str(e), str(e)
    else:
        raise AssertionError("a dispatch that does not fit the tight RDMA buffer was accepted")
    dist.barrier(group=gloo)
    nat.destroy()
    ref.destroy()


def test_native_internode_rdma_buffer_too_small_raises() -> None:
    run_shared_gpu_ranks(_small_buffer_worker, 2, env={**_BASE_ENV, "UCCL_MOE_EMULATE_NODES": "2"}, timeout_s=300)
