"""Native intranode kernels (native/src/kernels/{layout,intranode}, native/src/runtime) against the reference backend.

Every check draws fresh random inputs, runs the native Buffer on the GPU and the reference Buffer on a gloo group
(CPU), and compares: layout tensors, received rows (bit-exact, BF16 and FP8 with float/int scales, row- and
column-major), local expert ids, weights, per-expert counts, source indices, the rank prefix matrix; cached
dispatch; num_worst_tokens; CUDA-graph capture of dispatch + combine; combine (BF16 tolerance vs reference,
bitwise identical across runs, with biases and top-k weights); back-to-back calls with a hash check; and a
timeout when one rank skips a call. Ranks may share one GPU (CUDA IPC between processes on one device).

Env: UMOE_TEST_ITERS (back-to-back iterations, default 1000), UMOE_TEST_BIG (0 skips the 16384-token
and 7168-hidden cases, default 1).
"""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist
from helpers.mp import run_shared_gpu_ranks

pytestmark = pytest.mark.gpu

FP8 = torch.float8_e4m3fn


# ------------------------------------------------------------------------------------------------ inputs
def _routing(gen: torch.Generator, T: int, E: int, K: int, R: int, kind: str) -> torch.Tensor:
    scores = torch.rand((T, E), generator=gen) + 0.1
    per = E // R
    if kind == "empty_last":  # nobody routes to the last rank's experts
        scores[:, (R - 1) * per:] = -1.0
    idx = torch.topk(scores, K, dim=1).indices
    if kind == "empty_last" and R == 1:  # the only rank is the last: every top-k entry is -1
        idx[:] = -1
    if kind == "neg":
        idx[torch.rand(idx.shape, generator=gen) < 0.2] = -1
    if kind == "skew":  # 80% of tokens pick expert 0
        pick = torch.rand(T, generator=gen) < 0.8
        has0 = (idx == 0).any(1)
        idx[pick & ~has0, 0] = 0
    return idx.to(torch.int64)


def _scales(gen: torch.Generator, T: int, H: int, mode: str) -> torch.Tensor | None:
    if mode == "none":
        return None
    if mode == "int":
        return torch.randint(-2**31, 2**31 - 1, (T, -(-H // 512)), generator=gen, dtype=torch.int64).to(torch.int32)
    s = torch.rand((T, -(-H // 128)), generator=gen) + 0.01
    return s.T.contiguous().T if mode == "col" else s


def _x(gen: torch.Generator, T: int, H: int, fp8: bool) -> torch.Tensor:
    x = torch.randn((T, H), generator=gen)
    return (x * 100).clamp(-440, 440).to(FP8) if fp8 else x.bfloat16()


def _eq(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    a, b = a.detach().cpu(), b.detach().cpu()
    if a.shape != b.shape:
        return False
    if a.dtype == FP8 or b.dtype == FP8:
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return torch.equal(a, b)


def _hash(t: torch.Tensor) -> torch.Tensor:
    flat = t.contiguous().view(-1)
    ints = flat.view(torch.int16) if flat.element_size() == 2 else flat.view(torch.uint8)
    pos = torch.arange(ints.numel(), device=t.device, dtype=torch.int64) % 65521 + 1
    return (ints.to(torch.int64) * pos).sum()


class _Case:
    """One set of inputs on this rank, dispatched by both Buffers."""

    def __init__(self, rank: int, R: int, T: int, H: int, E: int, K: int, fp8: bool, scales: str, routing: str,
                 seed: int) -> None:
        gen = torch.Generator().manual_seed(seed * 131 + rank)
        self.T, self.H, self.E, self.K, self.R = T, H, E, K, R
        self.x = _x(gen, T, H, fp8)
        self.s = _scales(gen, T, H, scales) if fp8 else None
        self.idx = _routing(gen, T, E, K, R, routing)
        self.w = torch.rand((T, K), generator=gen)
        self.gen = gen

    def xin(self, dev: str):
        x = self.x.to(dev)
        if self.s is None:
            return x
        s = self.s.to(dev)
        if self.s.stride(0) == 1 and self.s.dim() == 2 and self.s.shape[1] > 1:  # keep column-major on the GPU
            s = self.s.T.contiguous().to(dev).T
        return (x, s)


def _dispatch(buf, case: _Case, dev: str, **kw):
    idx, w = case.idx.to(dev), case.w.to(dev)
    lay = buf.get_dispatch_layout(idx, case.E)
    res = buf.dispatch(case.xin(dev), num_tokens_per_rank=lay.num_tokens_per_rank,
                       is_token_in_rank=lay.is_token_in_rank, num_tokens_per_expert=lay.num_tokens_per_expert,
                       topk_idx=idx, topk_weights=w, **kw)
    return lay, res


def _split(recv_x):
    return recv_x if isinstance(recv_x, tuple) else (recv_x, None)


def _close_bf16(got: torch.Tensor, want: torch.Tensor, magnitude: torch.Tensor) -> bool:
    """Combine tolerance inside a node: one BF16 rounding of the float32 sum."""
    return torch.allclose(got.detach().cpu().float(), want.float(), rtol=1e-2, atol=1e-2)


def check_case(check, name: str, nat, ref, case: _Case, cfg, lay_r, worst: int, empty_rank: bool,
               combine_close, repeats: int) -> None:
    """The per-case checks shared by the intranode and internode GPU tests: dispatch vs the reference (rows, scales,
    ids, weights, counts, prefix matrix, sources), cached dispatch, num_worst_tokens, and for BF16 combine vs the
    reference (with and without weights/biases; `combine_close(got, want, magnitude)` decides closeness), bitwise
    repeatability, combine through the worst handle and the round trip."""
    rank, R, T, H = dist.get_rank(), case.R, case.T, case.H
    _, rn = _dispatch(nat, case, "cuda", config=cfg)
    _, rr = _dispatch(ref, case, "cpu", config=cfg)
    xn, sn = _split(rn.recv_x)
    xr, sr = _split(rr.recv_x)
    check(f"{name}: recv_x", _eq(xn, xr))
    check(f"{name}: recv scales", _eq(sn, sr))
    check(f"{name}: recv_topk_idx", _eq(rn.recv_topk_idx, rr.recv_topk_idx))
    check(f"{name}: recv_topk_weights", _eq(rn.recv_topk_weights, rr.recv_topk_weights))
    check(f"{name}: per-expert counts", rn.num_recv_tokens_per_expert_list == rr.num_recv_tokens_per_expert_list)
    check(f"{name}: rank_prefix_matrix", _eq(rn.handle[0], rr.handle[0]))
    check(f"{name}: recv_src_idx", _eq(rn.handle[3], rr.handle[3]))
    if empty_rank and rank == R - 1:
        check(f"{name}: last rank receives nothing", xn.shape[0] == 0)
    # cached dispatch
    cn = nat.dispatch(case.xin("cuda"), handle=rn.handle, config=cfg)
    cx, cs = _split(cn.recv_x)
    check(f"{name}: cached recv_x", _eq(cx, xn) and _eq(cs, sn))
    # num_worst_tokens
    _, wn = _dispatch(nat, case, "cuda", config=cfg, num_worst_tokens=worst)
    wx, ws = _split(wn.recv_x)
    n = xn.shape[0]
    check(f"{name}: worst shape/list", wx.shape[0] == worst and wn.num_recv_tokens_per_expert_list == [])
    check(f"{name}: worst prefix", _eq(wx[:n], xn) and _eq(wn.recv_topk_idx[:n], rn.recv_topk_idx)
          and _eq(wn.recv_topk_weights[:n], rn.recv_topk_weights) and (ws is None or _eq(ws[:n], sn))
          and _eq(wn.handle[3][:n], rn.handle[3]))
    check(f"{name}: worst tail -1", bool((wn.recv_topk_idx[n:] == -1).all()) and
          bool((wn.recv_topk_weights[n:] == 0).all()) and bool((wn.handle[3][n:] == -1).all()))
    if sn is not None:
        return
    # combine: random expert outputs (same rows on both sides), top-k weights and two biases
    y = torch.randn((n, H), generator=case.gen).bfloat16()
    b0 = torch.randn((T, H), generator=case.gen).bfloat16()
    b1 = torch.randn((T, H), generator=case.gen).bfloat16()
    on = nat.combine(y.cuda(), rn.handle, topk_weights=rn.recv_topk_weights, bias=(b0.cuda(), b1.cuda()),
                     config=cfg)
    orf = ref.combine(y, rr.handle, topk_weights=rr.recv_topk_weights, bias=(b0, b1), config=cfg)
    mag = ref.combine(y.abs(), rr.handle, config=cfg).combined_x.float()
    check(f"{name}: combine vs reference", combine_close(on.combined_x, orf.combined_x, mag))
    check(f"{name}: combine weights", torch.allclose(on.combined_topk_weights.cpu(), orf.combined_topk_weights,
                                                     rtol=1e-5, atol=1e-5))
    check(f"{name}: combine without extras", combine_close(nat.combine(y.cuda(), rn.handle, config=cfg).combined_x,
                                                           ref.combine(y, rr.handle, config=cfg).combined_x, mag))
    first = on.combined_x.clone()
    same = all(torch.equal(nat.combine(y.cuda(), rn.handle, topk_weights=rn.recv_topk_weights,
                                       bias=(b0.cuda(), b1.cuda()), config=cfg).combined_x, first)
               for _ in range(repeats))
    check(f"{name}: combine bitwise identical x{repeats}", same)
    # combine through the num_worst_tokens handle (padding rows are ignored)
    yw = torch.cat([y.cuda(), torch.randn((worst - n, H), device="cuda").bfloat16()])
    ow = nat.combine(yw, wn.handle, topk_weights=wn.recv_topk_weights, bias=(b0.cuda(), b1.cuda()), config=cfg)
    check(f"{name}: combine via worst handle", torch.equal(ow.combined_x, first))
    # the original tokens come back: dispatch then combine of recv_x sums each token once per rank
    back = nat.combine(xn, rn.handle, config=cfg).combined_x.float().cpu()
    cnt = lay_r.is_token_in_rank.sum(1, keepdim=True).float()
    check(f"{name}: round trip", torch.allclose(back, case.x.float() * cnt, rtol=2e-2, atol=2e-2))


class Checks:
    """One rank's named checks: ``check(name, ok)`` records the failed ones (printed as they run with
    UMOE_TEST_VERBOSE=1); :meth:`assert_none_failed` ends the worker."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self.failures: list[str] = []
        self.verbose = os.environ.get("UMOE_TEST_VERBOSE", "0") == "1"

    def __call__(self, name: str, ok: bool) -> None:
        if self.verbose:
            print(f"rank {self.rank}/{self.world}: {'ok ' if ok else 'BAD'} {name}", flush=True)
        if not ok:
            self.failures.append(name)

    def assert_none_failed(self) -> None:
        assert not self.failures, f"rank {self.rank}: {len(self.failures)} checks failed: {self.failures}"

    def refuses(self, name: str, exc: type, text: str | tuple[str, ...], fn, *args, **kw) -> None:
        """Checks that fn(*args, **kw) raises `exc` with `text` (each of them, for a tuple) in its message."""
        try:
            fn(*args, **kw)
        except exc as e:
            self(name, all(t in str(e) for t in ((text,) if isinstance(text, str) else text)))
        else:
            self(name, False)

    def finish(self, gloo, *buffers) -> None:
        """End of a worker: every rank is done with the peers' buffers before any unmaps its own, then the
        Buffers go and the failed checks, if any, fail the test."""
        dist.barrier(group=gloo)
        for b in buffers:
            b.destroy()
        self.assert_none_failed()


def check_back_to_back(check: Checks, nat, cfg, experts_per_rank: int, iters: int, cached: bool) -> None:
    """Non-cached dispatch + combine (+ a cached dispatch of the combined rows when `cached`) `iters` times on one
    routing: the output hashes must not move and memory must not grow."""
    R = check.world
    case = _Case(check.rank, R, 1024, 2048, experts_per_rank * R, 8, False, "none", "random", 7)
    idx, w, x = case.idx.cuda(), case.w.cuda(), case.x.cuda()
    lay = nat.get_dispatch_layout(idx, experts_per_rank * R)
    h0 = None
    mem0 = None
    bad = torch.zeros((), dtype=torch.int64, device="cuda")
    for it in range(iters):
        r = nat.dispatch(x, num_tokens_per_rank=lay.num_tokens_per_rank, is_token_in_rank=lay.is_token_in_rank,
                         num_tokens_per_expert=lay.num_tokens_per_expert, topk_idx=idx, topk_weights=w, config=cfg)
        c = nat.combine(r.recv_x, r.handle, topk_weights=r.recv_topk_weights, config=cfg)
        hashes = [_hash(r.recv_x), _hash(c.combined_x), _hash(c.combined_topk_weights.view(torch.int16))]
        if cached:
            hashes.append(_hash(nat.dispatch(c.combined_x, handle=r.handle, config=cfg).recv_x))
        h = torch.stack(hashes)
        if h0 is None:
            h0 = h
        bad += (h != h0).sum()
        if it == 10:
            torch.cuda.synchronize()
            mem0 = torch.cuda.memory_allocated()
    torch.cuda.synchronize()
    check(f"{iters} back-to-back calls: hash stable", int(bad) == 0)
    # A per-call leak of any output would grow by >= iters x (rows x 4 B) >> 2 MB; allow allocator rounding.
    grown = torch.cuda.memory_allocated() - mem0 if mem0 is not None else 0
    check(f"{iters} back-to-back calls: no memory growth ({grown} B)", grown <= 2 << 20)


def check_chained_rounds(check: Checks, nat, iters: int) -> None:
    """Cached dispatches and combines chain without any reset or barrier (nvl_layout.hpp): FP8 rows then BF16
    rows through the same rings (different slot layouts), a smaller ring on some calls (other slot counts), and
    every 10th iteration a second handle with fewer SMs (a channel-count change, which resets the rings).
    Outputs must equal the non-cached dispatch and the first iteration's combine, every time."""
    from uccl_moe import Config

    R = check.world
    cfg_a, cfg_small_ring, cfg_b = Config(24, 8, 256, 6, 128), Config(24, 4, 96, 6, 128), Config(16, 6, 256, 6, 128)
    fp8 = _Case(check.rank, R, 777, 2048, 16 * R, 8, True, "col", "neg", 21)
    bf16 = _Case(check.rank, R, 500 + 31 * check.rank, 2048, 16 * R, 8, False, "none", "skew", 22)
    _, ra = _dispatch(nat, fp8, "cuda", config=cfg_a)
    _, rb = _dispatch(nat, bf16, "cuda", config=cfg_b)
    xa, xb = fp8.xin("cuda"), bf16.xin("cuda")
    ya = torch.randn((ra.recv_x[0].shape[0], 2048), device="cuda").bfloat16()
    yb = rb.recv_x * 0.5
    want_a, want_b = ra.recv_x[0].view(torch.uint8), rb.recv_x
    comb_a0 = nat.combine(ya, ra.handle, topk_weights=ra.recv_topk_weights, config=cfg_a).combined_x.clone()
    comb_b0 = nat.combine(yb, rb.handle, config=cfg_b).combined_x.clone()
    bad = torch.zeros((), dtype=torch.int64, device="cuda")
    for it in range(iters):
        got = nat.dispatch(xa, handle=ra.handle, config=cfg_small_ring if it % 3 == 0 else cfg_a).recv_x
        bad += (got[0].view(torch.uint8) != want_a).sum() + (got[1] != ra.recv_x[1]).sum()
        bad += (nat.combine(ya, ra.handle, topk_weights=ra.recv_topk_weights,
                            config=cfg_small_ring if it % 2 == 0 else cfg_a).combined_x != comb_a0).sum()
        if it % 10 == 9:
            bad += (nat.dispatch(xb, handle=rb.handle, config=cfg_b).recv_x != want_b).sum()
            bad += (nat.combine(yb, rb.handle, config=cfg_b).combined_x != comb_b0).sum()
    torch.cuda.synchronize()
    check(f"{iters} chained cached dispatch/combine rounds (FP8/BF16 rows, two rings, two SM counts)", int(bad) == 0)


# ------------------------------------------------------------------------------------------------ the worker
def _worker(rank: int, world: int, gloo, big: bool, iters: int) -> None:
    from uccl_moe import Buffer, Config

    R = world
    torch.manual_seed(rank)
    hint_cfg = Config(24, 8, 256, 6, 128)
    nvl = hint_cfg.get_nvl_buffer_size_hint(10240 * 2 if big else 4096 * 2, R)  # widest case: fp8-80-scales
    nat = Buffer(dist.group.WORLD, nvl, backend="native", explicitly_destroy=True)
    ref = Buffer(gloo, nvl, backend="reference", explicitly_destroy=True)
    cfg = Config(24, 8, 256, 6, 128)
    check = Checks(rank, R)

    # name, T, H, experts per rank, K, fp8, scales, routing  (E = experts per rank x R)
    cases = [
        ("bf16", 512, 2048, 16, 8, False, "none", "random"),
        ("bf16-neg", 300 + 17 * rank, 4096, 8, 4, False, "none", "neg"),
        ("bf16-skew", 700, 2048, 16, 8, False, "none", "skew"),
        ("bf16-empty-last", 256, 2048, 16, 4, False, "none", "empty_last"),
        ("bf16-odd-hidden", 333, 2056, 4, 3, False, "none", "random"),  # 4112 B = 257 x 16 B
        ("bf16-1-token", 1, 2048, 4, 4, False, "none", "random"),
        ("fp8-row", 600, 4096, 16, 8, True, "row", "random"),
        ("fp8-col", 600, 2048, 16, 8, True, "col", "neg"),
        ("fp8-int", 400, 2048, 16, 8, True, "int", "random"),
    ]
    if big:
        cases += [
            ("bf16-7168", 2048, 7168, 64, 8, False, "none", "random"),
            ("fp8-7168", 2048, 7168, 64, 8, True, "col", "random"),
            ("bf16-16384-tokens", 16384, 2048, 16, 8, False, "none", "random"),
            # 80 scales per token: the scale copy loops run more than twice per lane
            ("fp8-80-scales", 256, 10240, 4, 8, True, "col", "random"),
        ]
    small = os.environ.get("UMOE_TEST_SMALL", "0") == "1"  # one case, for compute-sanitizer
    if small:
        cases = cases[:1]
    for seed, (name, T, H, per_rank, K, fp8, smode, routing) in enumerate(cases):
        E = per_rank * R
        case = _Case(rank, R, T, H, E, K, fp8, smode, routing, seed)
        # layout
        lay_n = nat.get_dispatch_layout(case.idx.cuda(), E)
        lay_r = ref.get_dispatch_layout(case.idx, E)
        check(f"{name}: layout", _eq(lay_n.num_tokens_per_rank, lay_r.num_tokens_per_rank)
              and _eq(lay_n.num_tokens_per_expert, lay_r.num_tokens_per_expert)
              and _eq(lay_n.is_token_in_rank, lay_r.is_token_in_rank) and lay_n.num_tokens_per_rdma_rank is None)
        check_case(check, name, nat, ref, case, cfg, lay_r, worst=T * R, empty_rank=routing == "empty_last",
                   combine_close=_close_bf16, repeats=10)

    if small:
        check.finish(gloo, nat, ref)
        return
    # More SMs than the GPU has: refused before any kernel runs (the blocks must all be resident), with the
    # remedy; the Buffer stays usable.
    from uccl_moe import _C, InvalidUsageError

    sms = _C.device_sm_count(torch.cuda.current_device())
    too_many = sms + 2 - sms % 2
    case = _Case(rank, R, 64, 2048, 4 * R, 4, False, "none", "random", 98)
    check.refuses("num_sms above the GPU's SMs refused", InvalidUsageError, f"num_sms={too_many} exceeds the {sms} SMs",
                  _dispatch, nat, case, "cuda", config=Config(too_many, 6, 256, 6, 128))
    _, res = _dispatch(nat, case, "cuda", config=cfg)
    _, ref_res = _dispatch(ref, case, "cpu", config=cfg)
    check("dispatch after the refused num_sms", _eq(res.recv_x, ref_res.recv_x))
    # A second Buffer over the same ranks runs this Buffer's handles (Megatron's fused_a2a replaces its Buffer when
    # it needs a bigger one and passes the forward's handles to the new one in backward).
    other = Buffer(dist.group.WORLD, 2 * nvl, backend="native", explicitly_destroy=True)
    y = res.recv_x * 0.5
    check("another Buffer's handle: combine", _eq(other.combine(y, res.handle, config=cfg).combined_x,
                                                  nat.combine(y, res.handle, config=cfg).combined_x))
    check("another Buffer's handle: cached dispatch", _eq(other.dispatch(case.xin("cuda"), handle=res.handle,
                                                                         config=cfg).recv_x, res.recv_x))
    torch.cuda.synchronize()
    dist.barrier(group=gloo)  # every rank is done with the other Buffer's rings before any unmaps them
    other.destroy()

    # Chained rounds first: after a graph capture the Buffer keeps the captured SM count (checked below).
    check_chained_rounds(check, nat, iters)

    # CUDA graph: dispatch (num_worst_tokens, no host sync) + combine captured once, replayed.
    case = _Case(rank, R, 512, 2048, 16 * R, 8, False, "none", "random", 99)
    idx, w, x = case.idx.cuda(), case.w.cuda(), case.x.cuda()
    lay = nat.get_dispatch_layout(idx, 16 * R)
    worst = 512 * R
    eager = nat.dispatch(x, num_tokens_per_rank=lay.num_tokens_per_rank, is_token_in_rank=lay.is_token_in_rank,
                         num_tokens_per_expert=lay.num_tokens_per_expert, topk_idx=idx, topk_weights=w,
                         num_worst_tokens=worst, config=cfg)
    eager_c = nat.combine(eager.recv_x, eager.handle, topk_weights=eager.recv_topk_weights, config=cfg)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_res = nat.dispatch(x, num_tokens_per_rank=lay.num_tokens_per_rank, is_token_in_rank=lay.is_token_in_rank,
                             num_tokens_per_expert=lay.num_tokens_per_expert, topk_idx=idx, topk_weights=w,
                             num_worst_tokens=worst, config=cfg)
        g_comb = nat.combine(g_res.recv_x, g_res.handle, topk_weights=g_res.recv_topk_weights, config=cfg)
    ok = True
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        n = int(eager.handle[0][-1, rank])
        ok &= _eq(g_res.recv_x[:n], eager.recv_x[:n]) and _eq(g_comb.combined_x, eager_c.combined_x)
        ok &= _eq(g_comb.combined_topk_weights, eager_c.combined_topk_weights)
    check("cuda graph dispatch+combine", ok)
    del graph
    # Replays would re-lay the rings of another SM count behind the host's back: refused with the remedy.
    check.refuses("graph-captured Buffer refuses another num_sms", InvalidUsageError, ("CUDA graph", "num_sms=16"),
                  _dispatch, nat, case, "cuda", config=Config(16, 6, 256, 6, 128))

    # Back-to-back: non-cached dispatch + combine `iters` times; hashes must not move, memory must not grow.
    check_back_to_back(check, nat, cfg, 16, iters, cached=False)

    check.finish(gloo, nat, ref)


def ends_beside(nat) -> bool:
    """Whether `nat`'s polled ops start early behind the gate and end beside their kernel (UCCL_MOE_CE_EARLY and
    UCCL_MOE_CE_END_BESIDE as the Buffer reads them, a GPU with the gate; CUDA only)."""
    return knob_on("CE_END_BESIDE") and knob_on("CE_EARLY") and torch.version.hip is None and gate_ok(nat)


def check_ended_beside(check, nat, R: int, some: bool = False) -> None:
    """With more than one rank: where ops end beside their kernel (ends_beside) every gated op was classified so (and
    some were, where `some`: the caller ran polled ops that start early); else none. The runtime counts an op when it
    classifies it, before the launch: that the end kernel ran, callers check in a profile (ce_end_kernel)."""
    if R > 1:
        rt = nat._live()._rt
        n, gated = int(rt.ce_ended_beside), int(rt.ce_gated_ops)
        if ends_beside(nat):
            check(f"ops that ended beside their kernel: {n} of {gated} gated", n == gated and (n > 0 or not some))
        else:
            check(f"no op ended beside its kernel (UCCL_MOE_CE_END_BESIDE or _CE_EARLY off, HIP or no gate: {n} did)",
                  n == 0)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_native_intranode_matches_reference(world: int) -> None:
    iters = int(os.environ.get("UMOE_TEST_ITERS", "1000"))
    big = os.environ.get("UMOE_TEST_BIG", "1") != "0"
    run_shared_gpu_ranks(_worker, world, big, iters, timeout_s=900)


@pytest.mark.parametrize("world", [1, 5, 6, 7, 8])
def test_native_intranode_other_local_rank_counts(world: int) -> None:
    """The rest of 1..8 local ranks: one rank (no peer at all), 5 and 7 (the 24 sender warps do not divide: spare
    warps), 6 and 8 (3-4 lanes per channel, the combine sum's widest instantiations). The same checks on the small
    cases; ranks share the GPUs, so this is a correctness test of the rank-count paths, not of an 8-GPU machine.
    Env: UMOE_TEST_WIDE_ITERS (back-to-back and chained iterations, default 30)."""
    iters = int(os.environ.get("UMOE_TEST_WIDE_ITERS", "30"))
    run_shared_gpu_ranks(_worker, world, False, iters, timeout_s=900)


def _geometry_worker(rank: int, world: int, gloo) -> None:
    """Lane geometries away from the default: one channel with 2-slot lane rings and 1-token chunks (the
    senders wrap their rings on nearly every token), Megatron's 20 SMs, 64 SMs, and every SM of the GPU (132 on
    H100 SXM and H200); from 20 SMs up, a case with fewer tokens than lanes, so most lanes carry none or one."""
    from uccl_moe import _C, Buffer, Config

    R = world
    W = _C.intranode_lanes_per_channel(R)
    sms = _C.device_sm_count(torch.cuda.current_device())
    configs = [Config(2, 1, 2 * W, 6, 128), Config(20, 3, 5 * W, 6, 128), Config(64, 8, 512, 6, 128),
               Config(sms - sms % 2, 4, 256, 6, 128)]
    nvl = max(c.get_nvl_buffer_size_hint(4096 * 2, R) for c in configs)
    nat = Buffer(dist.group.WORLD, nvl, backend="native", explicitly_destroy=True)
    ref = Buffer(gloo, nvl, backend="reference", explicitly_destroy=True)
    check = Checks(rank, R)
    for ci, cfg in enumerate(configs):
        for name, T, H, per_rank, K, fp8, smode, routing in [
            ("bf16", 300 + 11 * rank, 2048, 8, 8, False, "none", "skew"),
            ("fp8", 200, 4096, 8, 6, True, "col", "neg"),
            ("bf16-few", 40 + rank, 2048, 8, 8, False, "none", "random"),  # fewer tokens than lanes from 20 SMs up
        ]:
            E = per_rank * R
            case = _Case(rank, R, T, H, E, K, fp8, smode, routing, 50 + ci)
            lay_r = ref.get_dispatch_layout(case.idx, E)
            check_case(check, f"num_sms={cfg.num_sms} {name}", nat, ref, case, cfg, lay_r, worst=400 * R,
                       empty_rank=False, combine_close=_close_bf16, repeats=2)
    check.finish(gloo, nat, ref)


@pytest.mark.parametrize("world", [2, 3])
def test_native_intranode_lane_geometries(world: int) -> None:
    run_shared_gpu_ranks(_geometry_worker, world, timeout_s=600)


# ------------------------------------------------------------------------------------------------ combine splits
def _combine_split_worker(rank: int, world: int, gloo) -> None:
    """Combine under every kind of block split UCCL_MOE_COMBINE_SENDER_SMS may choose: the fewest sender blocks
    (every sender warp busy, the most receiver blocks, several lanes per block), one more (receiver blocks with
    uneven lane runs), the most (one receiver warp per lane), and the built-in split; at 24 SMs (the DeepSeek-V3
    setting) and Megatron's 20 with 1-token chunks. Each against the reference (with weights and biases, bitwise
    repeatable, through the worst handle), with a rank that receives nothing and with skewed routing. The knob is
    re-read after each change; a value out of range must make combine itself refuse, naming the knob. The ring
    combine only: UCCL_MOE_COMBINE_STAGED=0 and UCCL_MOE_COMBINE_CE=0 (at EP2 a caller's tensor goes through the copy
    engines by default, with no sender blocks)."""
    from uccl_moe import _C, Buffer, Config
    from uccl_moe.errors import InvalidUsageError

    R = world
    W, warps = _C.intranode_lanes_per_channel(R), _C.intranode_lanes_per_channel(1)
    configs = [Config(24, 2, 256, 6, 128), Config(20, 1, 5 * W, 6, 128)]
    nvl = max(c.get_nvl_buffer_size_hint(4096 * 2, R) for c in configs)
    nat = Buffer(dist.group.WORLD, nvl, backend="native", explicitly_destroy=True)
    ref = Buffer(gloo, nvl, backend="reference", explicitly_destroy=True)
    check = Checks(rank, R)
    os.environ["UCCL_MOE_COMBINE_STAGED"] = os.environ["UCCL_MOE_COMBINE_CE"] = "0"
    try:
        for ci, cfg in enumerate(configs):
            lanes = cfg.num_sms // 2 * W
            lo, hi = -(-lanes * (R - 1) // warps), cfg.num_sms - -(-lanes // warps)
            for senders in sorted({lo, lo + 1, hi}) + [0]:
                os.environ["UCCL_MOE_COMBINE_SENDER_SMS"] = str(senders)
                _C.env_reset_cache()
                assert _C.intranode_combine_split(cfg.num_sms, R, senders)[0][0] == (senders or cfg.num_sms // 2)
                for name, T, H, per_rank, K, routing in [("skew", 600 + 13 * rank, 4096, 8, 8, "skew"),
                                                         ("empty-last", 300, 2048, 8, 6, "empty_last")]:
                    case = _Case(rank, R, T, H, per_rank * R, K, False, "none", routing, 80 + ci)
                    check_case(check, f"num_sms={cfg.num_sms} senders={senders} {name}", nat, ref, case, cfg,
                               ref.get_dispatch_layout(case.idx, per_rank * R), worst=700 * R,
                               empty_rank=routing == "empty_last", combine_close=_close_bf16, repeats=2)
            os.environ["UCCL_MOE_COMBINE_SENDER_SMS"] = str(hi + 1)  # every rank refuses before launching
            _C.env_reset_cache()
            _, res = _dispatch(nat, case, "cuda", config=cfg)
            check.refuses(f"num_sms={cfg.num_sms} senders={hi + 1}: refused", InvalidUsageError,
                          f"COMBINE_SENDER_SMS={hi + 1}", nat.combine, res.recv_x, res.handle, config=cfg)
    finally:
        for var in ("UCCL_MOE_COMBINE_SENDER_SMS", "UCCL_MOE_COMBINE_STAGED", "UCCL_MOE_COMBINE_CE"):
            os.environ.pop(var, None)
        _C.env_reset_cache()
    check.finish(gloo, nat, ref)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_native_combine_block_splits(world: int) -> None:
    run_shared_gpu_ranks(_combine_split_worker, world, timeout_s=600)


# ------------------------------------------------------------------------------------------------ ordering stress
def _ordering_worker(rank: int, world: int, gloo, rounds: int, backend: str = "native", dev: str = "cuda") -> None:
    """Ring hand-off ordering under stress. One layout is dispatched `rounds` more times from its handle, each round's
    x the first round's plus the round number (small integers: exact in BF16). A row read before its bytes landed,
    or from the slot's previous occupant, shows up as another round's value: every received element must be the
    first round's plus r. A combine runs every 8 rounds (the same rings the other way) and must equal x times the
    number of ranks each token went to. Geometries: 2-slot lane rings with 1-token chunks (a ring wraps on nearly
    every token and every post is a hand-off), Megatron's 20 SMs at chunk 1, and the EP preset."""
    from uccl_moe import _C, Buffer, Config

    R = world
    W = _C.intranode_lanes_per_channel(R)
    configs = [Config(2, 1, 2 * W, 6, 128), Config(20, 1, 5 * W, 6, 128), Buffer.get_dispatch_config(R)]
    H, T, E, K = 2048, 1024 + 37 * rank, 8 * R, 8
    nvl = max(c.get_nvl_buffer_size_hint(H * 2, R) for c in configs)
    buf = Buffer(dist.group.WORLD if backend == "native" else gloo, nvl, backend=backend, explicitly_destroy=True)
    gen = torch.Generator().manual_seed(7 + rank)
    failures = []
    for cfg in configs:
        idx = _routing(gen, T, E, K, R, "random").to(dev)
        x0 = torch.randint(-60, 60, (T, H), generator=gen).bfloat16().to(dev)
        lay = buf.get_dispatch_layout(idx, E)
        first = buf.dispatch(x0, num_tokens_per_rank=lay.num_tokens_per_rank, is_token_in_rank=lay.is_token_in_rank,
                             num_tokens_per_expert=lay.num_tokens_per_expert, topk_idx=idx,
                             topk_weights=torch.rand((T, K), generator=gen).to(dev), config=cfg)
        copies = lay.is_token_in_rank.sum(1, dtype=torch.float32)[:, None]
        bad_rows = torch.zeros((), dtype=torch.int64, device=dev)
        bad_sums = torch.zeros((), dtype=torch.int64, device=dev)
        for r in range(1, rounds + 1):
            got = buf.dispatch(x0 + r, handle=first.handle, config=cfg).recv_x
            bad_rows += (got != first.recv_x + r).any(1).sum()
            if r % 8 == 0:
                back = buf.combine(got, first.handle, config=cfg).combined_x
                bad_sums += (back != ((x0.float() + r) * copies).bfloat16()).any(1).sum()
        n_rows, n_sums = int(bad_rows), int(bad_sums)
        if n_rows or n_sums:
            failures.append(f"rank {rank} num_sms={cfg.num_sms} chunk={cfg.num_max_nvl_chunked_send_tokens}: "
                            f"{n_rows} received rows of another round, {n_sums} wrong combined rows")
    dist.barrier(group=gloo)
    buf.destroy()
    assert not failures, "; ".join(failures)


@pytest.mark.parametrize("world", [2, 4])
def test_native_dispatch_ordering_stress(world: int) -> None:
    """Env: UMOE_TEST_STRESS_ROUNDS (cached dispatches per geometry, default 128)."""
    rounds = int(os.environ.get("UMOE_TEST_STRESS_ROUNDS", "128"))
    run_shared_gpu_ranks(_ordering_worker, world, rounds, timeout_s=600)


# ------------------------------------------------------------------------------------------------ timeout
def _skip_worker(rank: int, world: int, gloo) -> None:
    from uccl_moe import Buffer, CommTimeoutError

    nvl = Buffer.get_dispatch_config(world).get_nvl_buffer_size_hint(2048 * 2, world)  # the dispatch takes the preset
    nat = Buffer(dist.group.WORLD, nvl, backend="native", explicitly_destroy=True)
    case = _Case(rank, world, 64, 2048, 4 * world, 4, False, "none", "random", 3)
    skipper = world - 1
    if rank != skipper:
        try:
            _dispatch(nat, case, "cuda")
        except CommTimeoutError as e:
            msg = str(e)
            rec = e.record or {}
            assert f"rank {rank}" in msg and "barrier" in msg and f"peer {skipper}" in msg, msg
            assert rec.get("peer") == skipper and rec.get("phase") == "barrier" and rec.get("rank") == rank, rec
        else:
            raise AssertionError("dispatch returned although a peer skipped it")
        # The buffer stays poisoned: the next call raises at once instead of hanging.
        try:
            nat.get_dispatch_layout(case.idx.cuda(), 4 * world)
        except CommTimeoutError:
            pass
        else:
            raise AssertionError("a Buffer whose wait expired accepted another call")
    dist.barrier(group=gloo)  # the skipper keeps its buffer mapped until the others gave up
    nat.destroy()


def test_native_timeout_when_a_rank_skips() -> None:
    run_shared_gpu_ranks(_skip_worker, 3, env={"UCCL_MOE_TIMEOUT_S": "3"}, timeout_s=300)


def _skip_combine_worker(rank: int, world: int, gloo) -> None:
    """Combine has no barrier: a rank that skips it is named by the ring wait that starves."""
    from uccl_moe import Buffer, CommTimeoutError, Config

    cfg = Config(24, 8, 256, 6, 128)
    nat = Buffer(dist.group.WORLD, cfg.get_nvl_buffer_size_hint(2048 * 2, world), backend="native",
                 explicitly_destroy=True)
    case = _Case(rank, world, 64, 2048, 4 * world, 4, False, "none", "random", 3)
    _, res = _dispatch(nat, case, "cuda", config=cfg)
    torch.cuda.synchronize()
    skipper = world - 1
    if rank != skipper:
        try:
            nat.combine(res.recv_x, res.handle, config=cfg)
            torch.cuda.synchronize()
            nat.get_dispatch_layout(case.idx.cuda(), 4 * world)  # the next call surfaces the abort
        except CommTimeoutError as e:
            rec = e.record or {}
            assert rec.get("peer") == skipper and rec.get("rank") == rank, rec
            assert str(rec.get("phase")).startswith("combine/"), rec
            assert f"peer {skipper}" in str(e), str(e)
        else:
            raise AssertionError("combine returned although a peer skipped it")
    dist.barrier(group=gloo)
    nat.destroy()


def test_native_timeout_when_a_rank_skips_a_combine() -> None:
    run_shared_gpu_ranks(_skip_combine_worker, 3, env={"UCCL_MOE_TIMEOUT_S": "3"}, timeout_s=300)


# -------------------------------------------------------------------------------------------- combine from the buffer
PULL_WORST_T = 1100  # the num_worst_tokens of the pull tests' worst-case handles


def pull_buffers(rank: int, R: int, gloo):
    """(config, native Buffer, reference Buffer, checks) for the tests of the combines that read the NVL buffer (from
    the buffer, staged): room for every rank's rows of PULL_WORST_T tokens at hidden 7168 with 8 weights each."""
    from uccl_moe import Buffer, Config

    cfg = Config(24, 8, 256, 6, 128)
    rows_max = PULL_WORST_T * R
    nvl = max(cfg.get_nvl_buffer_size_hint(7168 * 2, R), (1 << 20) + rows_max * 7168 * 2 + rows_max * 8 * 4 + 4096)
    nvl = -(-nvl // 4096) * 4096
    nat = Buffer(dist.group.WORLD, nvl, backend="native", explicitly_destroy=True)
    ref = Buffer(gloo, nvl, backend="reference", explicitly_destroy=True)
    return cfg, nat, ref, Checks(rank, R)


def pull_inputs(nat, ref, case: _Case, cfg):
    """One pull-test case dispatched by both Buffers, and fresh combine inputs: (native result, reference result,
    rows y, biases b0, b1 on the CPU, and y, b0, b1 on the GPU)."""
    _, rn = _dispatch(nat, case, "cuda", config=cfg)
    _, rr = _dispatch(ref, case, "cpu", config=cfg)
    y = torch.randn((rn.recv_x.shape[0], case.H), generator=case.gen).bfloat16()
    b0 = torch.randn((case.T, case.H), generator=case.gen).bfloat16()
    b1 = torch.randn((case.T, case.H), generator=case.gen).bfloat16()
    return rn, rr, y, b0, b1, y.cuda(), b0.cuda(), b1.cuda()


def pull_cases(rank: int) -> list[tuple[str, int, int, int, int, str]]:
    """(name, tokens, hidden, experts per rank, top-k, routing): random, -1 entries with a token count that differs
    per rank, skewed, a rank that receives nothing, an odd hidden (257 x 16 B), one token, hidden 7168."""
    return [("random", 512, 2048, 16, 8, "random"), ("neg", 300 + 17 * rank, 4096, 8, 4, "neg"),
            ("skew", 700, 2048, 16, 8, "skew"), ("empty-last", 256, 2048, 16, 4, "empty_last"),
            ("odd-hidden", 333, 2056, 4, 3, "random"), ("1-token", 1, 2048, 4, 4, "random"),
            ("7168", 1024, 7168, 64, 8, "random")]


def _combine_from_buffer_worker(rank: int, world: int, gloo, small: bool = False) -> None:
    """Combine from the buffer (get_combine_buffer + combine_pull.cu) against the ring combine and the reference.
    The same rows, weights and biases go through both paths: the sums must be bitwise equal (same rank order), and
    close to the reference. Cases: random, -1 entries with a different token count per rank, skewed routing, a rank
    that receives nothing, an odd hidden (257 x 16 B), one token, hidden 7168; combine SM counts 24, 20 and 2 (the
    pull's SM count is free of the handle's); the worst-case handle; bitwise repeats; a CUDA-graph capture; pull,
    ring and cached dispatch interleaved on one Buffer; and the refusals (a slice of the view, a view a dispatch ran
    over, a Buffer too small, a wrong dtype, a row that is not 16-byte aligned). `small` (5-8 ranks): two cases and
    the back-to-back pulls only (also with UMOE_TEST_SMALL=1, for compute-sanitizer)."""
    from uccl_moe import Buffer, Config, InvalidTypeError, InvalidUsageError

    small = small or os.environ.get("UMOE_TEST_SMALL", "0") == "1"
    R = world
    cfg, nat, ref, check = pull_buffers(rank, R, gloo)
    nvl, worst_T = nat.num_nvl_bytes, PULL_WORST_T
    pull_cfgs = [cfg, Config(20, 8, 256, 6, 128), Config(2, 8, 256, 6, 128)]

    def pull(res, y, **kw):
        view = nat.get_combine_buffer(res.handle, y.shape[1])
        view.copy_(y)
        return view, nat.combine(view, res.handle, **kw)

    def check_fits(name, res, worst_res, K):
        """combine_buffer_fits answers for the rank that received the most rows, alike on every rank: at the widest
        hidden whose rows fit that rank and one step wider (which a rank that received fewer rows still fits)."""
        rows = [None] * R
        dist.all_gather_object(rows, int(res.recv_x.shape[0]), group=gloo)
        most = max(rows)
        hint = Buffer.get_combine_buffer_size_hint
        # wide: the narrowest hidden (a multiple of 8) whose rows of the most-receiving rank do not fit
        wide = max(16, ((nvl - (1 << 20)) // (2 * max(most, 1))) // 8 * 8 + 8)
        while wide > 16 and hint(most, wide - 8) > nvl:
            wide -= 8
        # the worst handle answers for its own padded rows (more than `most`): not at wide - 8, where `most` fits
        asks = [(res, hidden, k) for hidden in (wide - 8, wide) for k in (0, K)] + [(worst_res, wide - 8, 0)]
        got = [nat.combine_buffer_fits(r.handle, hidden, k) for r, hidden, k in asks]
        want = [hint(most if r is res else int(r.recv_x.shape[0]), hidden, k) <= nvl for r, hidden, k in asks]
        everyone = [None] * R
        dist.all_gather_object(everyone, got, group=gloo)
        check(f"{name}: combine_buffer_fits answers for the most rows ({most}) alike on every rank: got {got}, "
              f"want {want}, ranks {everyone}", got == want and all(e == got for e in everyone)
              and (most == 0 or (got[0] and not got[2]))
              and (int(worst_res.recv_x.shape[0]) <= most or not got[4]))

    cases = pull_cases(rank)
    if small:
        cases, pull_cfgs = cases[:2], pull_cfgs[:1]
    for seed, (name, T, H, per_rank, K, routing) in enumerate(cases):
        case = _Case(rank, R, T, H, per_rank * R, K, False, "none", routing, 200 + seed)
        rn, rr, y, b0, b1, yc, b0c, b1c = pull_inputs(nat, ref, case, cfg)
        n = rn.recv_x.shape[0]
        ring = nat.combine(yc, rn.handle, topk_weights=rn.recv_topk_weights, bias=(b0c, b1c), config=cfg)
        ring_plain = nat.combine(yc, rn.handle, config=cfg).combined_x
        want = ref.combine(y, rr.handle, topk_weights=rr.recv_topk_weights, bias=(b0, b1), config=cfg)
        for pc in pull_cfgs:
            tag = f"{name} num_sms={pc.num_sms}"
            view, got = pull(rn, yc, topk_weights=rn.recv_topk_weights, bias=(b0c, b1c), config=pc)
            check(f"{tag}: view is the NVL buffer",
                  view.untyped_storage().data_ptr() == nat._backend._rt.local_buffer + (1 << 20)
                  and tuple(view.shape) == (n, H))
            check(f"{tag}: pull == ring (bitwise)", torch.equal(got.combined_x, ring.combined_x))
            check(f"{tag}: pull weights == ring", torch.equal(got.combined_topk_weights, ring.combined_topk_weights))
            check(f"{tag}: pull vs reference", _close_bf16(got.combined_x, want.combined_x, None))
            check(f"{tag}: pull without extras", torch.equal(pull(rn, yc, config=pc)[1].combined_x, ring_plain))
        same = all(torch.equal(pull(rn, yc, topk_weights=rn.recv_topk_weights, bias=(b0c, b1c), config=cfg)[1]
                               .combined_x, ring.combined_x) for _ in range(3))
        check(f"{name}: pull bitwise identical x3", same)
        # through the num_worst_tokens handle: padding rows are ignored (and may take the staged weights)
        _, wn = _dispatch(nat, case, "cuda", config=cfg, num_worst_tokens=worst_T * R)
        yw = torch.cat([yc, torch.randn((worst_T * R - n, H), device="cuda").bfloat16()])
        _, got = pull(wn, yw, topk_weights=wn.recv_topk_weights, bias=(b0c, b1c), config=cfg)
        check(f"{name}: pull via worst handle", torch.equal(got.combined_x, ring.combined_x)
              and torch.equal(got.combined_topk_weights, ring.combined_topk_weights))
        check_fits(name, rn, wn, K)

    # Interleaved on one Buffer: ring, pull, cached dispatch, pull, ring, 40 pulls back to back.
    case = _Case(rank, R, 640, 4096, 16 * R, 8, False, "none", "random", 300)
    _, rn = _dispatch(nat, case, "cuda", config=cfg)
    y = (rn.recv_x.float() * 0.5).bfloat16()
    ring = nat.combine(y, rn.handle, config=cfg).combined_x
    ok = torch.equal(pull(rn, y, config=cfg)[1].combined_x, ring)
    ok &= _eq(nat.dispatch(case.xin("cuda"), handle=rn.handle, config=cfg).recv_x, rn.recv_x)
    ok &= torch.equal(pull(rn, y, config=cfg)[1].combined_x, ring)
    ok &= torch.equal(nat.combine(y, rn.handle, config=cfg).combined_x, ring)
    check("pull / ring / cached dispatch interleaved", ok)
    # Back to back with other rows each time and rank 0 late to every call: a rank that wrote its next rows while a
    # peer still read the previous ones (no end hand-shake) would corrupt that peer's sum.
    ys = [(y.float() * (1 + i % 4) - i).bfloat16() for i in range(24)]
    wants = [nat.combine(yi, rn.handle, config=cfg).combined_x for yi in ys]
    outs = []
    for i, yi in enumerate(ys):
        if rank == 0:
            torch.cuda._sleep(200_000)
        outs.append(pull(rn, yi, config=pull_cfgs[i % len(pull_cfgs)])[1].combined_x)
    check("24 pulls back to back, other rows each, one rank late",
          all(torch.equal(o, w) for o, w in zip(outs, wants)))
    if small:
        torch.cuda.synchronize()
        check.finish(gloo, nat, ref)
        return

    # CUDA graph: the rows' copy into the view and the pull captured once, replayed with new rows.
    view = nat.get_combine_buffer(rn.handle, 4096)
    src = y.clone()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        view.copy_(src)
        g_out = nat.combine(view, rn.handle, config=cfg).combined_x
    ok = True
    for k in range(3):
        src.copy_((y.float() * (k + 1)).bfloat16())
        graph.replay()
        torch.cuda.synchronize()
        ok &= torch.equal(g_out, nat.combine(src, rn.handle, config=cfg).combined_x)
    check("cuda graph pull", ok)
    del graph

    # Refusals (on every rank alike, before anything launches).
    from uccl_moe.utils import tensor_at

    shifted = tensor_at(nat._backend._rt.local_buffer + (1 << 20) + 4096 * 2, tuple(y.shape), torch.bfloat16,
                        y.device)  # in the buffer, one row off
    check.refuses("refuses buffer memory that is not the view", InvalidUsageError, "not the tensor get_combine_buffer",
            nat.combine, shifted, rn.handle, config=cfg)
    check.refuses("refuses float32 views", InvalidTypeError, "bfloat16", nat.get_combine_buffer, rn.handle, 4096,
            dtype=torch.float32)
    check.refuses("refuses rows that are not 16-byte multiples", InvalidUsageError, "multiple of 16",
            nat.get_combine_buffer, rn.handle, 12)
    view = nat.get_combine_buffer(rn.handle, 4096)
    view.copy_(y)
    nat.dispatch(case.xin("cuda"), handle=rn.handle, config=cfg)
    check.refuses("refuses a view a dispatch ran over", InvalidUsageError, "overwrote it", nat.combine, view, rn.handle,
            config=cfg)
    torch.cuda.synchronize()
    dist.barrier(group=gloo)
    small = Buffer(dist.group.WORLD, cfg.get_nvl_buffer_size_hint(7168 * 2, R), backend="native",
                   explicitly_destroy=True)
    big_case = _Case(rank, R, 4096, 7168, 16 * R, 8, False, "none", "random", 301)
    _, bn = _dispatch(small, big_case, "cuda", config=cfg)
    need = (1 << 20) + bn.recv_x.shape[0] * 7168 * 2
    check("the small Buffer is too small for the view", need > small.num_nvl_bytes)
    check.refuses("a Buffer too small refuses the view", InvalidUsageError, f"num_nvl_bytes >= {need}",
            small.get_combine_buffer, bn.handle, 7168)
    torch.cuda.synchronize()
    check.finish(gloo, small, nat, ref)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_native_combine_from_buffer(world: int) -> None:
    run_shared_gpu_ranks(_combine_from_buffer_worker, world, timeout_s=600)


@pytest.mark.parametrize("world", [6, 8])
def test_native_combine_from_buffer_more_ranks(world: int) -> None:
    run_shared_gpu_ranks(_combine_from_buffer_worker, world, True, timeout_s=600)


def _skip_pull_worker(rank: int, world: int, gloo, mode: str) -> None:
    """A rank that skips a combine from the buffer (`skip`), or combines from a tensor of its own while its peers
    combine from their views (`mixed`): the others are named in a bounded combine/pull-start wait, never a hang; where
    that tensor is staged (`mixed_staged`, 2 ranks) every rank raises InvalidUsageError (combine/pull-args: the two
    layouts differ), before anyone sums rows of the other layout.
    `weights`: one rank passes no topk_weights while its peers do: every rank raises InvalidUsageError naming the
    mismatch (combine/pull-args), before anyone reads weights that were not staged. `sizes`: ranks that create their
    Buffers with different num_nvl_bytes are all refused. `ce_hidden` / `staged_hidden` (2 ranks): both on one path,
    one rank's rows narrower: every rank raises InvalidUsageError naming both hidden sizes. `ce_dispatch_skip`: a
    rank skips a copy-engine dispatch that enters through its enter kernel: the others name it (dispatch/ce-enter)."""
    from uccl_moe import Buffer, CommTimeoutError, Config, InvalidUsageError

    cfg = Config(24, 8, 256, 6, 128)
    nvl = cfg.get_nvl_buffer_size_hint(2048 * 2, world)
    if mode == "sizes":
        try:
            Buffer(dist.group.WORLD, nvl + 4096 * (rank == 1), backend="native", explicitly_destroy=True)
        except InvalidUsageError as e:
            assert "num_nvl_bytes differs between the ranks" in str(e) and f"rank 1: {nvl + 4096}" in str(e), str(e)
        else:
            raise AssertionError("Buffers of different num_nvl_bytes were accepted")
        dist.barrier(group=gloo)
        return
    nat = Buffer(dist.group.WORLD, nvl, backend="native", explicitly_destroy=True)
    case = _Case(rank, world, 64, 2048, 4 * world, 4, False, "none", "random", 3)
    _, res = _dispatch(nat, case, "cuda", config=cfg)
    torch.cuda.synchronize()
    odd = world - 1
    view = nat.get_combine_buffer(res.handle, 2048)
    view.copy_(res.recv_x)
    if mode.endswith("_early"):
        _ce_early_fault(nat, res, case, cfg, mode, rank, odd)
    elif mode == "ce_dispatch_skip":  # after the ring dispatch the copy-engine one enters through its enter kernel
        os.environ["UCCL_MOE_DISPATCH_CE"] = "1"
        if rank != odd:
            try:
                nat.dispatch(case.xin("cuda"), handle=res.handle, config=cfg)
                torch.cuda.synchronize()
                nat.get_dispatch_layout(case.idx.cuda(), 4 * world)  # the next call surfaces the abort
            except CommTimeoutError as e:
                rec = e.record or {}
                assert rec.get("phase") == "dispatch/ce-enter" and rec.get("peer") == odd, rec
                assert "dispatch/ce-enter" in str(e) and f"peer {odd}" in str(e), str(e)
            else:
                raise AssertionError("a copy-engine dispatch returned though a peer skipped it")
    elif mode.startswith("ce_dispatch_poll"):  # both dispatch through the copy engines, one waiting for chunk flags
        os.environ["UCCL_MOE_DISPATCH_CE"] = "1"
        if mode == "ce_dispatch_poll_after_ce":  # one copy-engine dispatch alike first: the non-polling rank's next
            # one is early (its copies may land in the polling rank's area before or during its memset); both must
            # still be refused cleanly
            want = nat.dispatch(case.xin("cuda"), handle=res.handle, config=cfg).recv_x
            assert torch.equal(want, res.recv_x), "the copy-engine dispatch before the mismatch"
        os.environ["UCCL_MOE_DISPATCH_CE_POLL"] = "0" if rank == odd else "1"
        try:
            nat.dispatch(case.xin("cuda"), handle=res.handle, config=cfg)
            torch.cuda.synchronize()
            nat.get_dispatch_layout(case.idx.cuda(), 4 * world)  # the next call surfaces the abort
        except InvalidUsageError as e:
            needles = ("copy-engine dispatch", "UCCL_MOE_DISPATCH_CE_POLL", "polls" if rank == odd else "does not poll")
            assert all(n in str(e) for n in needles), str(e)
        else:
            raise AssertionError("a copy-engine dispatch accepted a peer that polls where this rank does not")
    elif mode in ("weights", "mixed_staged", "mixed_ce", "ce_chunks", "ce_poll", "ce_hidden", "staged_hidden"):
        # refused on every rank: other weights, layout, chunks or hidden size
        weights = mode == "weights"
        x = view if weights or rank != odd else res.recv_x.clone()
        w = res.recv_topk_weights if weights and rank != odd else None
        needles = ("top-k weights per row", "same shape") if weights else ("same kind of x", "get_combine_buffer view")
        if mode == "mixed_ce":  # tensors of their own everywhere, but one rank sends through the copy engines
            x = res.recv_x.clone()
            os.environ["UCCL_MOE_COMBINE_CE"] = "1" if rank == odd else "0"
            needles = ("same kind of x", "copy engines", "(staged)")
        if mode == "ce_chunks":  # both through the copy engines, one rank splitting its copies otherwise
            x = res.recv_x.clone()
            os.environ["UCCL_MOE_COMBINE_CE"] = "1"
            os.environ["UCCL_MOE_CE_POLL"] = "0"  # a polled combine copies in one chunk
            os.environ["UCCL_MOE_COMBINE_CE_CHUNKS"] = "2" if rank == odd else "4"
            needles = ("UCCL_MOE_COMBINE_CE_CHUNKS", "chunks")
        if mode == "ce_poll":  # both through the copy engines, one rank waiting for chunk flags
            x = res.recv_x.clone()
            os.environ["UCCL_MOE_COMBINE_CE"] = "1"
            os.environ["UCCL_MOE_CE_POLL"] = "0" if rank == odd else "1"
            needles = ("UCCL_MOE_CE_POLL", "polls" if rank == odd else "does not poll")
        if mode.endswith("_hidden"):  # tensors of their own on one path, one rank's rows narrower
            x = res.recv_x.clone() if rank != odd else res.recv_x[:, :1024].contiguous()
            os.environ["UCCL_MOE_COMBINE_CE"] = "1" if mode == "ce_hidden" else "0"
            seen, mine = (2048, 1024) if rank == odd else (1024, 2048)
            needles = (f"passes rows of hidden {seen}, this rank of hidden {mine}", "same hidden size")
        try:
            nat.combine(x, res.handle, topk_weights=w, config=cfg)
            torch.cuda.synchronize()
            nat.get_dispatch_layout(case.idx.cuda(), 4 * world)  # the next call surfaces the abort
        except InvalidUsageError as e:
            assert all(n in str(e) for n in needles), str(e)
        else:
            raise AssertionError(f"combine accepted mismatched inputs across the ranks ({mode})")
    elif rank != odd or mode == "mixed":
        try:
            nat.combine(view if rank != odd else res.recv_x.clone(), res.handle, config=cfg)
            torch.cuda.synchronize()
            nat.get_dispatch_layout(case.idx.cuda(), 4 * world)  # the next call surfaces the abort
        except CommTimeoutError as e:
            rec = e.record or {}
            if rank != odd:
                assert rec.get("phase") == "combine/pull-start" and rec.get("peer") == odd, rec
                assert rec.get("rank") == rank and f"peer {odd}" in str(e), str(e)
            else:  # the ring path starves for the peers' pushes
                assert str(rec.get("phase")).startswith("combine/"), rec
        else:
            raise AssertionError("combine returned although a peer did not combine from its buffer")
    dist.barrier(group=gloo)
    nat.destroy()


def _rows_mismatch_worker(rank: int, world: int, gloo, mode: str) -> None:
    """A dispatch whose rows differ between the ranks, on the last rank: `hidden` (x narrower), `topk` (fewer experts
    per token), `scales` (FP8 everywhere, packed int32 scales there against float ones); notify compares every rank's
    rows with every peer's, so every rank raises InvalidUsageError from the dispatch call itself, naming both layouts,
    before any row moved, and nobody waits out a timeout. `worst` (x narrower, num_worst_tokens: nothing waits for
    notify's counts): the dispatch runs on, and the Buffer's next call raises, saying so. `experts`: the last rank
    passes twice the experts (its top-k ids stay in range): every rank raises naming both counts."""
    from uccl_moe import Buffer, Config, InvalidUsageError

    cfg = Config(24, 8, 256, 6, 128)
    nat = Buffer(dist.group.WORLD, cfg.get_nvl_buffer_size_hint(2048 * 2, world), backend="native",
                 explicitly_destroy=True)
    odd = world - 1
    fp8 = mode == "scales"
    case = _Case(rank, world, 64, 2048, 4 * world, 4, fp8, ("int" if rank == odd else "row") if fp8 else "none",
                 "random", 5)

    def rows(p: int) -> tuple[int, int, int]:  # (row bytes, top-k, scales) of rank p
        narrow = p == odd and mode in ("hidden", "worst")
        return (2048 if fp8 or narrow else 4096, 2 if p == odd and mode == "topk" else 4,
                (4 if p == odd else 16) if fp8 else 0)

    idx, w, x = case.idx.cuda(), case.w.cuda(), case.xin("cuda")
    if rank == odd and mode == "topk":
        idx, w = idx[:, :2].contiguous(), w[:, :2].contiguous()
    if rank == odd and mode in ("hidden", "worst"):
        x = x[:, :1024].contiguous()
    E = 2 * case.E if rank == odd and mode == "experts" else case.E
    lay = nat.get_dispatch_layout(idx, E)
    mine = rows(rank)
    theirs = next((rows(p) for p in range(world) if p != rank and rows(p) != mine), mine)
    try:
        nat.dispatch(x, num_tokens_per_rank=lay.num_tokens_per_rank, is_token_in_rank=lay.is_token_in_rank,
                     num_tokens_per_expert=lay.num_tokens_per_expert, topk_idx=idx, topk_weights=w, config=cfg,
                     num_worst_tokens=64 * world if mode == "worst" else 0)
        assert mode == "worst", "the dispatch returned"
        torch.cuda.synchronize()
        nat.get_dispatch_layout(case.idx.cuda(), case.E)  # the next call raises
    except InvalidUsageError as e:
        msg = str(e)
        if mode == "experts":
            other = case.E if rank == odd else 2 * case.E
            assert f"passes num_experts={other}, this rank num_experts={E}" in msg and "no row moved" in msg, msg
            dist.barrier(group=gloo)
            nat.destroy()
            return
        said = ("with num_worst_tokens nothing waits", "not valid") if mode == "worst" else ("no row moved",)
        assert (f"passes rows of {theirs[0]} bytes with {theirs[1]} top-k entries and {theirs[2]} scales" in msg
                and f"this rank rows of {mine[0]} bytes with {mine[1]} top-k entries and {mine[2]} scales" in msg
                and "same hidden size" in msg and all(n in msg for n in said)), msg
    else:
        raise AssertionError(f"a dispatch accepted rows of another layout from a peer ({mode})")
    dist.barrier(group=gloo)
    nat.destroy()


@pytest.mark.parametrize("mode", ["hidden", "topk", "scales", "worst", "experts"])
@pytest.mark.parametrize("world", [2, 3])
def test_native_dispatch_refuses_rows_that_differ_between_ranks(world: int, mode: str) -> None:
    run_shared_gpu_ranks(_rows_mismatch_worker, world, mode, env={"UCCL_MOE_TIMEOUT_S": "20"}, timeout_s=300)


def early_ops(buf) -> int:
    """Copy-engine ops of `buf` that started their copies before any hand-shake (UCCL_MOE_CE_EARLY)."""
    return int(buf._live()._rt.ce_early_ops)


def gated_ops(buf) -> int:
    """`buf`'s polled copy-engine ops that started their copies at once behind the gate (each peer's side memset
    ended first), since it was made (none where the GPU's driver has no stream memory operations: gate_ok)."""
    return int(buf._live()._rt.ce_gated_ops)


def gate_ok(buf) -> bool:
    """Whether stream memory operations worked on this GPU (NvlRuntime::connect), so that polled ops can be early."""
    return bool(buf._live()._rt.ce_gate_ok)


def knob_on(name: str) -> bool:
    """The boolean knob UCCL_MOE_<name> (CE_EARLY, CE_POLL, ...) as the Buffer reads it; DISPATCH_CE_POLL as the Buffer
    decides it (auto: polled except with one hardware queue, tuning.dispatch_ce_poll)."""
    from uccl_moe import env, tuning

    if name == "DISPATCH_CE_POLL":
        return tuning.dispatch_ce_poll(env.get(name))
    return bool(env.get(name))


def _ce_early_fault(nat, res, case, cfg, mode: str, rank: int, odd: int) -> None:
    """A fault in a copy-engine combine that starts its copies at once (UCCL_MOE_CE_EARLY: it follows one every rank
    ran through the copy engines, so no enter kernel runs): rank `odd` skips it (`ce_skip_early`: the others are named
    in a bounded combine/pull-start wait, dispatch/ce-enter in the dispatch; `ce_skip_late_early`: rank 0 starts a
    second later, so rank 1 gives up first and raises rank 0's abort flag: rank 0's drained waits still write the
    record; `ce_late_early`, 2 ranks: none skips,
    rank 0 starts after rank 1's whole timeout, finds its flag up and every wait passed, and still raises) or splits
    its copies otherwise
    (`ce_chunks_early`: every rank raises InvalidUsageError naming the chunks, checked by the sum kernel before it
    reads a peer's rows). `_poll` in the mode: the combines poll, so the faulted one is early behind the gate.
    `ce_dispatch_skip_poll_early`: the same skip in a polled copy-engine dispatch (the gather's wait for the skipped
    rank's entry is the one that gives up)."""
    from uccl_moe import CommTimeoutError, InvalidUsageError

    poll = "_poll" in mode
    mode = mode.replace("_poll", "")
    dispatch = mode == "ce_dispatch_skip_early"
    os.environ["UCCL_MOE_COMBINE_CE"] = "1"
    os.environ["UCCL_MOE_CE_POLL"] = "1" if poll else "0"
    os.environ["UCCL_MOE_DISPATCH_CE"] = "1"
    os.environ["UCCL_MOE_DISPATCH_CE_POLL"] = "1" if poll else "0"

    def op():
        if dispatch:
            return nat.dispatch(case.xin("cuda"), handle=res.handle, config=cfg)
        return nat.combine(res.recv_x.clone(), res.handle, config=cfg)

    # A polled op is early only after a side memset, made after one once one followed another (begin_op).
    for _ in range(2 if poll else 1):
        op()
    torch.cuda.synchronize()
    assert not poll or gate_ok(nat), "stream memory operations failed on this GPU: polled ops are never early"
    early0, gated0 = early_ops(nat), gated_ops(nat)
    if mode == "ce_chunks_early":
        os.environ["UCCL_MOE_COMBINE_CE_CHUNKS"] = "2" if rank == odd else "4"
    elif rank == odd and mode != "ce_late_early":
        return  # skips it
    if mode == "ce_skip_late_early" and rank == 0:
        time.sleep(1.0)  # rank 1 gives up first and raises our abort flag: our waits drain, and must still record
    if mode == "ce_late_early" and rank == 0:
        time.sleep(4.5)  # past the peer's whole timeout: it gave up, released its done word and raised our flag
    try:
        op()
        assert early_ops(nat) == early0 + 1, "the op did not start its copies at once"
        assert not poll or gated_ops(nat) == gated0 + 1, "the polled op did not start behind the gate"
        torch.cuda.synchronize()
        nat.get_dispatch_layout(case.idx.cuda(), 4 * (odd + 1))  # the next call surfaces the abort
    except InvalidUsageError as e:
        assert mode == "ce_chunks_early" and "UCCL_MOE_COMBINE_CE_CHUNKS" in str(e), str(e)
    except CommTimeoutError as e:
        rec = e.record or {}
        if mode == "ce_late_early":  # rank 1 timed out on rank 0's entry; rank 0 found the op aborted, no wait failed
            assert rec.get("drained") == (rank == 0), rec
            assert rank == 0 or (rec.get("phase") == "combine/pull-start" and rec.get("peer") == 0), rec
            return
        assert mode in ("ce_skip_early", "ce_skip_late_early", "ce_dispatch_skip_early"), rec
        want = "dispatch/ce-enter" if dispatch else "combine/pull-start"  # the dispatch's waits name the dispatch
        assert rec.get("phase") == want and rec.get("peer") == odd, rec
        if mode == "ce_skip_late_early":  # rank 0 learnt of it from rank 1's abort, rank 1 on its own clock
            assert rec.get("drained") == (rank == 0), rec
            assert ("aborted first" in str(e)) == (rank == 0), str(e)
    else:
        raise AssertionError(f"an early copy-engine op returned through a fault ({mode})")


@pytest.mark.parametrize("mode", ["skip", "mixed", "weights", "sizes", "ce_skip_early", "ce_skip_late_early",
                                  "ce_skip_poll_early", "ce_skip_late_poll_early", "ce_dispatch_skip_poll_early",
                                  "ce_dispatch_skip"])
def test_native_combine_from_buffer_timeout(mode: str) -> None:
    run_shared_gpu_ranks(_skip_pull_worker, 3, mode, env={"UCCL_MOE_TIMEOUT_S": "3"}, timeout_s=300)


@pytest.mark.parametrize("mode", ["ce_skip_poll_early", "ce_skip_late_poll_early", "ce_dispatch_skip_poll_early"])
def test_native_combine_from_buffer_timeout_ends_in_kernel(mode: str) -> None:
    """The early polled faults with each op's end in its kernel's last block (UCCL_MOE_CE_END_BESIDE=0)."""
    run_shared_gpu_ranks(_skip_pull_worker, 3, mode, env={"UCCL_MOE_TIMEOUT_S": "3", "UCCL_MOE_CE_END_BESIDE": "0"},
                         timeout_s=300)


@pytest.mark.parametrize("mode", ["mixed_staged", "mixed_ce", "ce_chunks", "ce_chunks_early", "ce_poll", "ce_hidden",
                                  "staged_hidden", "ce_late_early", "ce_late_poll_early", "ce_dispatch_poll",
                                  "ce_dispatch_poll_after_ce"])
def test_native_combine_view_and_staged_tensor_refused(mode: str) -> None:
    """2 ranks: one passes its get_combine_buffer view, the other a tensor of its own, which is staged; or both pass
    tensors of their own, one staged, one through the copy engines (UCCL_MOE_COMBINE_CE differs); or both through the
    copy engines in different chunks (UCCL_MOE_COMBINE_CE_CHUNKS differs), or one polling its landing area and the
    other not (UCCL_MOE_CE_POLL differs; `ce_dispatch_poll`: UCCL_MOE_DISPATCH_CE_POLL in a cached dispatch, and
    `ce_dispatch_poll_after_ce` after a copy-engine dispatch, so that the rank without it starts early); or both on
    one path (copy engines, staged), one rank's rows of another hidden size: refused on every rank."""
    run_shared_gpu_ranks(_skip_pull_worker, 2, mode,
                         env={"UCCL_MOE_TIMEOUT_S": "3", "UCCL_MOE_COMBINE_STAGED": "1"}, timeout_s=300)
