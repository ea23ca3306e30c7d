"""The staged combine (UCCL_MOE_COMBINE_STAGED=1): a combine of a tensor of the caller's whose rows fit the Buffer
copies the other ranks' rows into the NVL buffer (stage_combine_rows_intranode), then pulls (combine_pull.cu, our own
rows read from the caller's tensor). The copy-engine combine (UCCL_MOE_COMBINE_CE=1): the copy engines move each
peer's block of the caller's tensor back into that peer's buffer in chunks while the SMs sum (launch_combine_ce).
Both sum in the same order as the ring combine, so each must give the ring's bits; every case runs for both paths.

Cases (fresh random inputs, never zeros): random routing, -1 top-k entries with a different token count per rank,
skewed routing, a rank that receives nothing, an odd hidden, one token, hidden 7168; with top-k weights and both
biases, and without; the num_worst_tokens handle; staged, ring, pull from the view and cached dispatch interleaved on
one Buffer; 24 combines back to back with other rows each time and one rank late (a rank that staged or copied its
next rows while a peer still read the previous ones would corrupt that peer's sum). The num_worst_tokens handle has
no host counts: the copy-engine path falls back (to the rings here), on every rank alike. The staged rows are
compacted (only the rows from other ranks), the landing areas hold only the rows sent to other ranks: a Buffer sized
by the ring's hint, too small for every received row (no view), still takes either path at 4096 tokens of hidden 7168,
while one too small for those rows takes the ring on every rank. Ranks may share one GPU (CUDA IPC between processes
on one device).
"""

from __future__ import annotations

import contextlib
import functools
import os

import pytest
import torch
import torch.distributed as dist
from helpers.mp import run_shared_gpu_ranks
from test_intranode_native import (
    PULL_WORST_T,
    _Case,
    _close_bf16,
    _dispatch,
    check_ended_beside,
    early_ops,
    ends_beside,
    gate_ok,
    gated_ops,
    knob_on,
    pull_buffers,
    pull_cases,
    pull_inputs,
)

pytestmark = pytest.mark.gpu


def _combine(nat, path: str, *args, **kw):
    """nat.combine through `path` ("ring", "staged" or "ce") for this call (every rank calls alike)."""
    os.environ["UCCL_MOE_COMBINE_STAGED"] = "1" if path == "staged" else "0"
    os.environ["UCCL_MOE_COMBINE_CE"] = "1" if path == "ce" else "0"
    try:
        return nat.combine(*args, **kw)
    finally:
        os.environ.pop("UCCL_MOE_COMBINE_STAGED", None)
        os.environ.pop("UCCL_MOE_COMBINE_CE", None)


def _fits(buf, path: str, handle, hidden: int, num_topk: int) -> bool:
    live = buf._live()
    return live.combine_ce_fits(handle, hidden, num_topk) if path == "ce" else \
        live.combine_staged_fits(handle, hidden, num_topk)


def _staged_worker(rank: int, world: int, gloo, path: str = "staged", few: bool = False) -> None:
    """`few` (6 and 8 ranks sharing the GPUs: the sum kernels' widest instantiations; or UMOE_TEST_SMALL=1, for
    compute-sanitizer): the -1-entry and empty-rank cases, the interleaving and the back-to-back combines only."""
    from uccl_moe import Buffer

    sanitizer = os.environ.get("UMOE_TEST_SMALL", "0") == "1"  # the torch profiler sees no kernels under it
    few = few or sanitizer
    R = world
    P = path  # the path under test: "staged" or "ce"
    cfg, nat, ref, check = pull_buffers(rank, R, gloo)
    worst_T = PULL_WORST_T
    for seed, (name, T, H, per_rank, K, routing) in enumerate(pull_cases(rank)):
        if few and name not in ("neg", "empty-last"):
            continue  # (seeds stay those of the whole list: a case's name pins its inputs in every mode)
        case = _Case(rank, R, T, H, per_rank * R, K, False, "none", routing, 400 + seed)
        rn, rr, y, b0, b1, yc, b0c, b1c = pull_inputs(nat, ref, case, cfg)
        n = rn.recv_x.shape[0]
        check(f"{name}: the rows fit (the {P} path runs)", _fits(nat, P, rn.handle, H, K))
        extras = dict(topk_weights=rn.recv_topk_weights, bias=(b0c, b1c), config=cfg)
        ring = _combine(nat, "ring", yc, rn.handle, **extras)
        got = _combine(nat, P, yc, rn.handle, **extras)
        want = ref.combine(y, rr.handle, topk_weights=rr.recv_topk_weights, bias=(b0, b1), config=cfg)
        check(f"{name}: {P} == ring (bitwise)", torch.equal(got.combined_x, ring.combined_x))
        check(f"{name}: {P} weights == ring", torch.equal(got.combined_topk_weights, ring.combined_topk_weights))
        check(f"{name}: {P} vs reference", _close_bf16(got.combined_x, want.combined_x, None))
        check(f"{name}: the caller's rows are untouched", torch.equal(yc.cpu(), y))
        y2 = (yc.float() * 2 - 1).bfloat16()  # other rows: a copy the stage kernel skipped would show
        plain = _combine(nat, P, y2, rn.handle, config=cfg).combined_x
        check(f"{name}: {P} without extras", torch.equal(plain, _combine(nat, "ring", y2, rn.handle,
                                                                         config=cfg).combined_x))
        _, wn = _dispatch(nat, case, "cuda", config=cfg, num_worst_tokens=worst_T * R)
        yw = torch.cat([yc, torch.randn((worst_T * R - n, H), device="cuda").bfloat16()])
        got = _combine(nat, P, yw, wn.handle, **{**extras, "topk_weights": wn.recv_topk_weights})
        check(f"{name}: {P} via the worst handle", torch.equal(got.combined_x, ring.combined_x)
              and torch.equal(got.combined_topk_weights, ring.combined_topk_weights))

    # The path ran: its kernels, not the ring's.
    if not sanitizer:
        names = _kernels(lambda: _combine(nat, P, yc, rn.handle, config=cfg))
        check(f"the {P} kernels ran ({names[:200]})", _ran(P, names, R, rn.recv_x.shape[0]))

    # Interleaved on one Buffer: the path, ring, pull from the view, cached dispatch, the other path; then 24 of the
    # path back to back.
    other = "staged" if P == "ce" else "ce"
    case = _Case(rank, R, 640, 4096, 16 * R, 8, False, "none", "random", 500)
    _, rn = _dispatch(nat, case, "cuda", config=cfg)
    y = (rn.recv_x.float() * 0.5 - 1).bfloat16()
    ring = _combine(nat, "ring", y, rn.handle, config=cfg).combined_x
    ok = torch.equal(_combine(nat, P, y, rn.handle, config=cfg).combined_x, ring)
    view = nat.get_combine_buffer(rn.handle, 4096)
    view.copy_(y)
    ok &= torch.equal(nat.combine(view, rn.handle, config=cfg).combined_x, ring)
    ok &= torch.equal(nat.dispatch(case.xin("cuda"), handle=rn.handle, config=cfg).recv_x, rn.recv_x)
    ok &= torch.equal(_combine(nat, P, y, rn.handle, config=cfg).combined_x, ring)
    ok &= torch.equal(_combine(nat, "ring", y, rn.handle, config=cfg).combined_x, ring)
    ok &= torch.equal(_combine(nat, other, y, rn.handle, config=cfg).combined_x, ring)
    ok &= torch.equal(_combine(nat, P, y, rn.handle, config=cfg).combined_x, ring)
    check(f"{P} / ring / pull / cached dispatch / {other} interleaved", ok)
    ys = [(y.float() * (1 + i % 4) - i).bfloat16() for i in range(24)]
    wants = [_combine(nat, "ring", yi, rn.handle, config=cfg).combined_x for yi in ys]
    outs = []
    early0, gated0, polled0 = early_ops(nat), gated_ops(nat), _poll_counts(nat)
    for yi in ys:
        if rank == 0:
            torch.cuda._sleep(200_000)
        outs.append(_combine(nat, P, yi, rn.handle, config=cfg).combined_x)
    check(f"24 {P} combines back to back, other rows each, one rank late",
          all(torch.equal(o, w) for o, w in zip(outs, wants)))
    if P == "ce":  # every one after the first (which follows a ring combine) starts its copies at once; where they
        # poll, the first two set the sentinel before their copies (after the ring combine, and after a polled one:
        # neither followed by a polled combine last time), and once one followed another, every one sets it for the
        # next after itself, on the side stream: from the third on each starts at once behind the gate (its copies
        # into a peer wait until that peer's side memset ended)
        # (one rank: they poll too, but land nothing, so no memset and nothing early)
        polls = knob_on("CE_POLL")
        gated = 22 if polls and knob_on("CE_EARLY") and R > 1 and gate_ok(nat) else 0
        early = gated if polls else 23 if knob_on("CE_EARLY") else 0
        check("early copy-engine combines", early_ops(nat) - early0 == early)
        check("early polled combines behind the gate", gated_ops(nat) - gated0 == gated)
        got_counts = tuple(b - a for a, b in zip(polled0, _poll_counts(nat)))
        check(f"polled combines, sentinel sets before them and after ops: {got_counts}",
              got_counts == (((24, 2, 23) if R > 1 else (24, 0, 0)) if polls else (0, 0, 0)))
    if few:
        torch.cuda.synchronize()
        check.finish(gloo, nat, ref)
        return

    # CUDA graph: a cached dispatch and the combine through the path captured once, replayed with new rows (the
    # copy-engine ops fork onto their copy streams and join back inside the capture).
    xg, src = case.xin("cuda"), y.clone()
    torch.cuda.synchronize()
    os.environ["UCCL_MOE_DISPATCH_CE"] = "1" if P == "ce" else "0"
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            g_disp = nat.dispatch(xg, handle=rn.handle, config=cfg).recv_x
            g_out = _combine(nat, P, src, rn.handle, config=cfg).combined_x
    finally:
        os.environ.pop("UCCL_MOE_DISPATCH_CE", None)
    ok = True
    for k in range(3):
        src.copy_((y.float() * (k + 1)).bfloat16())
        graph.replay()
        torch.cuda.synchronize()
        ok &= torch.equal(g_disp, rn.recv_x)
        ok &= torch.equal(g_out, _combine(nat, "ring", src, rn.handle, config=cfg).combined_x)
    check(f"cuda graph: cached dispatch and {P} combine, replayed with new rows", ok)
    del graph

    # A Buffer sized by the ring's size hint (as DeepEP clients size it): too small for every received row of 4096
    # tokens at hidden 7168 (no view), but the staged rows are only those from other ranks, so the staged path runs;
    # with 8192 tokens even those do not fit, and every rank takes the ring (the fit is judged alike on every rank).
    torch.cuda.synchronize()
    dist.barrier(group=gloo)
    small = Buffer(dist.group.WORLD, cfg.get_nvl_buffer_size_hint(7168 * 2, R), backend="native",
                   explicitly_destroy=True)
    for T, stages in ((4096, True), (8192, R == 1)):
        big = _Case(rank, R, T, 7168, 16 * R, 8, False, "none", "random", 501 + T)
        _, bn = _dispatch(small, big, "cuda", config=cfg)
        yb = torch.randn(bn.recv_x.shape, device="cuda").bfloat16()
        wb = bn.recv_topk_weights
        check(f"T={T}: the small Buffer cannot hold the view",
              R == 1 or not small.combine_buffer_fits(bn.handle, 7168, 0))
        check(f"T={T}: the {P} rows fit: {stages}", _fits(small, P, bn.handle, 7168, 8) == stages)
        got = _combine(small, P, yb, bn.handle, topk_weights=wb, config=cfg)
        want = _combine(small, "ring", yb, bn.handle, topk_weights=wb, config=cfg)
        check(f"T={T}: {P} or ring, the same bits", torch.equal(got.combined_x, want.combined_x)
              and torch.equal(got.combined_topk_weights, want.combined_topk_weights))
        names = _kernels(functools.partial(_combine, small, P, yb, bn.handle, topk_weights=wb, config=cfg))
        check(f"T={T}: {P if stages else 'ring'} kernels ran ({names[:200]})",
              _ran(P, names, R, bn.recv_x.shape[0]) if stages else "combine_intranode_kernel" in names)
    torch.cuda.synchronize()
    check.finish(gloo, small, nat, ref)


@contextlib.contextmanager
def kernel_late(owner, name: str, late: bool):
    """Where `late`, `owner.name` (a copy-engine op's outputs' allocation, which runs after the op's first copies and
    before its kernel) first holds this rank's stream back for about 5 ms: the op's kernel starts long after its
    peers' copies and SM stores into this rank landed."""
    orig = getattr(owner, name)

    def held(*a, **kw):
        if late:
            torch.cuda._sleep(10_000_000)
        return orig(*a, **kw)

    setattr(owner, name, held)
    try:
        yield
    finally:
        setattr(owner, name, orig)


def _poll_counts(buf) -> tuple[int, int, int]:
    """`buf`'s polled copy-engine combines, sentinel memsets before one (on its stream) and after an op (side
    stream), since it was made."""
    rt = buf._live()._rt
    return int(rt.ce_polled_ops), int(rt.ce_sentinel_sets), int(rt.ce_sentinel_side_sets)


def _same(a: torch.Tensor, b: torch.Tensor) -> str:
    """'' where a and b hold the same bits except that a NaN may be any NaN (a sum's NaN takes the payload of one
    of its inputs, which the compiler's operand order picks), else what differs."""
    nan = a.isnan()
    if not torch.equal(nan, b.isnan()):
        return f"NaN at {int((nan != b.isnan()).sum())} other places"
    diff = int((a[~nan].view(torch.int16) != b[~nan].view(torch.int16)).sum()) if a.dtype == torch.bfloat16 else \
        int((a[~nan] != b[~nan]).sum())
    return f"{diff} values differ" if diff else ""


def _poll_worker(rank: int, world: int, gloo) -> None:
    """The polled copy-engine combine (UCCL_MOE_CE_POLL, the default), against the ring's bits (fresh random rows):
    rows that hold the sentinel (all ones in a 32-bit word: a pair of BF16 NaNs) as data, in whole rows and scattered
    words (their sums are NaN: the same places must be, and every other value the same bits); op patterns that each
    end in a polled combine, three times over with rank 0 late before every op (after
    the first time the op before it sets the sentinel on the side stream, and the combine sets none; a view written
    while that memset may still run, and a staged combine, follow such an op too); one rank's sum kernel 5 ms late
    (its peers' words from its SMs, the head rows, land long after the copy: a word still at the sentinel is waited
    for through both flags). Every rank checks."""
    from uccl_moe.backends import _buffer_paths

    R = world
    cfg, nat, ref, check = pull_buffers(rank, R, gloo)
    case = _Case(rank, R, 640, 4096, 16 * R, 8, False, "none", "random", 600)
    _, rn = _dispatch(nat, case, "cuda", config=cfg)
    w = rn.recv_topk_weights
    y = (torch.rand(rn.recv_x.shape, device="cuda") * 4 - 2).bfloat16()
    pat = y.clone()
    words = pat.view(torch.int32)
    words[::7] = -1                 # whole rows of the sentinel
    words[3::5, rank::61] = -1      # and scattered words of others
    ring = _combine(nat, "ring", pat, rn.handle, topk_weights=w, config=cfg)
    got = _combine(nat, "ce", pat, rn.handle, topk_weights=w, config=cfg)
    why = _same(got.combined_x, ring.combined_x)
    check(f"rows holding the sentinel: ce == ring (bits; NaN where the ring's is) {why}",
          not why and torch.equal(got.combined_topk_weights, ring.combined_topk_weights))

    def cached() -> None:
        check("cached dispatch", torch.equal(nat.dispatch(case.xin("cuda"), handle=rn.handle, config=cfg).recv_x,
                                             rn.recv_x))

    def view(rows: torch.Tensor, want: torch.Tensor) -> None:
        v = nat.get_combine_buffer(rn.handle, 4096)
        v.copy_(rows)
        check("combine from the view", torch.equal(nat.combine(v, rn.handle, config=cfg).combined_x, want))

    # The references first: a ring combine inside a pattern would be the op before the polled one.
    ys = [(y.float() * (k + 1) - k).bfloat16() for k in range(3)]
    wants = [_combine(nat, "ring", yk, rn.handle, topk_weights=w, config=cfg) for yk in ys]
    plain = [_combine(nat, "ring", yk, rn.handle, config=cfg).combined_x for yk in ys]
    patterns = {
        "cached dispatch": [cached],
        "ring combine": [lambda: _combine(nat, "ring", y, rn.handle, config=cfg)],
        "staged combine": [lambda: _combine(nat, "staged", y, rn.handle, config=cfg)],
        "view": [lambda: view(ys[0], plain[0])],
        "cached dispatch, then a view": [cached],
    }

    def run_patterns() -> None:
        for name, ops in patterns.items():
            for k in range(3):
                before = _poll_counts(nat)
                for op in ops:
                    if rank == 0:
                        torch.cuda._sleep(200_000)
                    op()
                if name == "cached dispatch, then a view":  # a polled combine was predicted: the view's writes wait for
                    view(ys[k], plain[k])                    # the memset after the dispatch
                    continue
                if rank == 0:
                    torch.cuda._sleep(200_000)
                got = _combine(nat, "ce", ys[k], rn.handle, topk_weights=w, config=cfg)
                counts = tuple(b - a for a, b in zip(before, _poll_counts(nat)))
                check(f"{name}, then polled ({k}): == ring", torch.equal(got.combined_x, wants[k].combined_x)
                      and torch.equal(got.combined_topk_weights, wants[k].combined_topk_weights))
                # once the op before was followed by a polled combine, it sets the sentinel on the side stream and the
                # combine sets none; the first time it may not have been (a kind seen before another kind last time)
                if R > 1:
                    check(f"{name} ({k}): polled, sentinel sets {counts}", counts[0] == 1 and (
                          sum(counts[1:]) == 1 if k == 0 else counts[1:] == (0, 1)))

    # under UCCL_MOE_CE_END_BESIDE (the default) the gated combines among them end in ce_end_kernel on the side stream
    rt = nat._live()._rt
    ended0 = int(rt.ce_ended_beside)
    names = _kernels(run_patterns)
    ended = int(rt.ce_ended_beside) - ended0
    if R > 1:
        beside = ends_beside(nat)
        check(f"combines that ended beside their kernel: {ended} (expected some: {beside}), ce_end_kernel ran: "
              f"{'ce_end_kernel' in names}", (ended > 0) == beside and ('ce_end_kernel' in names) == beside)
    # A rank whose sum kernel starts 5 ms late.
    with kernel_late(_buffer_paths, "combine_outputs", rank == R - 1):
        got = _combine(nat, "ce", pat, rn.handle, topk_weights=w, config=cfg)
    why = _same(got.combined_x, ring.combined_x)
    check(f"one rank's sum 5 ms late: == ring (bits; NaN where the ring's is) {why}",
          not why and torch.equal(got.combined_topk_weights, ring.combined_topk_weights))
    check("every copy-engine combine polled", _poll_counts(nat)[0] == 1 + 4 * 3 + 1)
    check_ended_beside(check, nat, R, some=True)
    torch.cuda.synchronize()
    check.finish(gloo, nat, ref)


@pytest.mark.parametrize("world", [2, 3])
def test_polled_ce_combine(world: int) -> None:
    # the dispatch in its patterns by chunk flags, so that the counts are the combine's (a polled dispatch before a
    # polled combine runs in test_staged_and_ce_combine_match_the_ring's interleaving and in the bench)
    run_shared_gpu_ranks(_poll_worker, world, env={"UCCL_MOE_DISPATCH_CE_POLL": "0"}, timeout_s=600)


def test_polled_ce_combine_ends_in_kernel() -> None:
    """test_polled_ce_combine with each op's end in its kernel's last block (UCCL_MOE_CE_END_BESIDE=0)."""
    run_shared_gpu_ranks(_poll_worker, 2, env={"UCCL_MOE_DISPATCH_CE_POLL": "0", "UCCL_MOE_CE_END_BESIDE": "0"},
                         timeout_s=600)


@pytest.mark.parametrize("world", [2, 6])
def test_staged_and_ce_combine_match_the_ring_ends_in_kernel(world: int) -> None:
    """The copy-engine combine's interleavings (polled dispatches before polled combines) with each op's end in its
    kernel."""
    run_shared_gpu_ranks(_staged_worker, world, "ce", world > 4, env={"UCCL_MOE_CE_END_BESIDE": "0"}, timeout_s=600)


def _gate_worker(rank: int, world: int, gloo, op: str = "combine") -> None:
    """A peer whose count of side memsets stays behind ours: it ran a one-sided op (the bench's peer copy) between two
    polled combines, so it predicts no polled combine after one and makes one memset fewer (ranks must run the same
    ops on a Buffer; this one breaks that rule on purpose). Our next early polled combine's copies into it then wait
    at the gate, which nothing opens but the side stream's watch (ce_gate_watch_kernel) after UCCL_MOE_TIMEOUT_S; with
    CUDA_DEVICE_MAX_CONNECTIONS=1 the waiting copy stream may also hold the combine's own kernel. The gated rank raises
    CommTimeoutError naming that peer (`op`/ce-sentinel); the peer raises or returns; nobody hangs. `op`
    "dispatch": the same with polled copy-engine dispatches (UCCL_MOE_DISPATCH_CE=1, the cached dispatch)."""
    from uccl_moe import CommTimeoutError

    cfg, nat, ref, check = pull_buffers(rank, world, gloo)
    check("stream memory operations work here", gate_ok(nat))
    case = _Case(rank, world, 256, 2048, 8 * world, 4, False, "none", "random", 77)
    _, rn = _dispatch(nat, case, "cuda", config=cfg)
    if op == "dispatch":
        os.environ["UCCL_MOE_DISPATCH_CE"] = "1"
        x, want = case.xin("cuda"), rn.recv_x

        def polled():
            return nat.dispatch(x, handle=rn.handle, config=cfg).recv_x
    else:
        y = (rn.recv_x.float() * 0.5 - 1).bfloat16()
        want = _combine(nat, "ring", y, rn.handle, config=cfg).combined_x

        def polled():
            return _combine(nat, "ce", y, rn.handle, config=cfg).combined_x
    odd = world - 1
    ok = all(torch.equal(polled(), want) for _ in range(2))
    if rank == odd:
        nat._live().peer_copy(rank, 4096)  # one-sided, within its own buffer
    torch.cuda.synchronize()
    dist.barrier(group=gloo)
    nat._live().peer_copies_done()  # every rank: the next polled combine sets its whole area first (none is early)
    # (no device-wide synchronize from here on: it would wait for the watch too, which then fires before the next call)
    ok &= torch.equal(polled(), want)
    check(f"polled {op}s before the fault", ok)
    gated0 = gated_ops(nat)
    try:
        polled()
        torch.cuda.synchronize()
        nat.get_dispatch_layout(case.idx.cuda(), 8 * world)  # the next call surfaces an abort
    except CommTimeoutError as e:
        rec = e.record or {}
        if rank != odd:
            check(f"the gated rank names the peer whose memset count stayed behind ({rec})",
                  rec.get("phase") == f"{op}/ce-sentinel" and rec.get("peer") == odd)
    else:
        check("the gated rank raised", rank == odd)
    if rank != odd:
        check(f"the {op} was early behind the gate", gated_ops(nat) == gated0 + 1)
    dist.barrier(group=gloo)
    check.assert_none_failed()


def test_polled_ce_combine_gate_that_never_opens() -> None:
    run_shared_gpu_ranks(_gate_worker, 2, env={"UCCL_MOE_TIMEOUT_S": "3", "CUDA_DEVICE_MAX_CONNECTIONS": "1"},
                         timeout_s=300)


def test_polled_ce_dispatch_gate_that_never_opens() -> None:
    """The gate that never opens with polled copy-engine dispatches (the default since session 45; with one hardware
    queue only where asked for)."""
    run_shared_gpu_ranks(_gate_worker, 2, "dispatch", env={"UCCL_MOE_TIMEOUT_S": "3", "UCCL_MOE_DISPATCH_CE_POLL": "1",
                                                           "CUDA_DEVICE_MAX_CONNECTIONS": "1"}, timeout_s=300)


@pytest.mark.parametrize("op", ["combine", "dispatch"])
def test_gate_that_never_opens_ends_in_kernel(op: str) -> None:
    """The gate that never opens with each op's end in its kernel (UCCL_MOE_CE_END_BESIDE=0), one hardware queue."""
    run_shared_gpu_ranks(_gate_worker, 2, op, env={"UCCL_MOE_TIMEOUT_S": "3", "CUDA_DEVICE_MAX_CONNECTIONS": "1",
                                                   "UCCL_MOE_CE_END_BESIDE": "0", "UCCL_MOE_DISPATCH_CE_POLL": "1"},
                         timeout_s=300)


def _kernels(fn) -> str:
    """The names of the GPU kernels fn() ran (torch profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return " ".join(e.name for e in prof.events() if e.device_type.name == "CUDA")


def _ran(path: str, names: str, R: int, rows: int) -> bool:
    """`names` show the `path` combine, not the ring's: for "staged" the pull and (where this rank has rows from other
    ranks) the stage kernel; for "ce" the enter and sum kernels, no pull."""
    if "combine_intranode_kernel" in names:
        return False
    if path == "ce":
        return "ce_enter_kernel" in names and "combine_ce_sum_kernel" in names and \
            "combine_pull_kernel" not in names
    return "combine_pull_kernel" in names and (rows == 0 or R == 1 or "stage_combine_rows_kernel" in names)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("path", ["staged", "ce"])
def test_staged_and_ce_combine_match_the_ring(world: int, path: str) -> None:
    run_shared_gpu_ranks(_staged_worker, world, path, timeout_s=600)


@pytest.mark.parametrize("world", [6, 8])
@pytest.mark.parametrize("path", ["staged", "ce"])
def test_staged_and_ce_combine_more_ranks(world: int, path: str) -> None:
    run_shared_gpu_ranks(_staged_worker, world, path, True, timeout_s=600)


def test_ce_combine_with_the_enter_kernel_always() -> None:
    """UCCL_MOE_CE_EARLY=0: every copy-engine combine waits for the enter hand-shake kernel before its copies (the
    default starts them at once where the op before ended with the done hand-shake): the same bits, at EP2."""
    run_shared_gpu_ranks(_staged_worker, 2, "ce", True, env={"UCCL_MOE_CE_EARLY": "0"}, timeout_s=600)
