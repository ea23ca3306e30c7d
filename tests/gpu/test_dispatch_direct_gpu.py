"""The ring-free dispatch (UCCL_MOE_DISPATCH_DIRECT=1): every row is written straight to where it ends up (rows a rank
keeps into its outputs, the others into the receiver's landing area in its NVL buffer), then each rank unpacks its
landing area. It must give the ring dispatch's outputs bit for bit: recv_x, scales, top-k ids and weights, per-expert
counts and the handle (prefix matrices, recv_src_idx, send_head), for a new handle and a cached one.

Cases (fresh random inputs, never zeros): BF16 and FP8 with row-major, column-major and int scales; random routing,
-1 top-k entries with a different token count per rank, skewed routing, a rank that receives nothing, an odd hidden,
one token; the num_worst_tokens handle (padding rows -1 / 0); the combine of the direct dispatch's rows (ring and from
the buffer) against the reference; ring and direct dispatches, ring and pulled combines interleaved on one Buffer; 24
direct dispatches back to back with other rows each time and one rank late (a rank that landed rows in a peer still
unpacking the previous ones would corrupt them); a Buffer too small for the landing area takes the rings on every rank.
Ranks may share one GPU (CUDA IPC between processes on one device).
"""

from __future__ import annotations

import functools
import os

import pytest
import torch
import torch.distributed as dist
from helpers.mp import run_shared_gpu_ranks
from test_combine_staged_gpu import _combine, _kernels, _same, kernel_late
from test_intranode_native import (
    PULL_WORST_T,
    _Case,
    _close_bf16,
    _dispatch,
    _eq,
    _split,
    check_ended_beside,
    early_ops,
    ends_beside,
    gate_ok,
    gated_ops,
    knob_on,
    pull_buffers,
)

pytestmark = pytest.mark.gpu

# (name, tokens, hidden, experts per rank, top-k, fp8, scales, routing); tokens <= PULL_WORST_T (the Buffer's room)
CASES = [("bf16-random", 512, 2048, 16, 8, False, "none", "random"),
         ("bf16-neg", 300, 4096, 8, 4, False, "none", "neg"),
         ("bf16-skew", 700, 2048, 16, 8, False, "none", "skew"),
         ("bf16-empty-last", 256, 2048, 16, 4, False, "none", "empty_last"),
         ("bf16-odd-hidden", 333, 2056, 4, 3, False, "none", "random"),
         ("bf16-1-token", 1, 2048, 4, 4, False, "none", "random"),
         ("bf16-past-head", 600, 7168, 16, 8, False, "none", "random"),  # head rows, then chunks (ce_head_rows)
         ("bf16-head-plus-1", 293, 7168, 16, 8, False, "none", "skew"),  # EP2: one row past the head
         ("fp8-row", 600, 4096, 16, 8, True, "row", "random"),
         ("fp8-col", 600, 7168, 16, 8, True, "col", "neg"),
         ("fp8-int", 400, 2048, 16, 8, True, "int", "empty_last"),
         ("bf16-head-plus-1-ep3", 147, 7168, 16, 8, False, "none", "skew")]  # EP3: 146 head rows per peer, then 1


def _with_knob(var: str, on: bool, fn, *args, **kw):
    """fn(*args, **kw) with the path knob `var` set for this call (every rank calls alike)."""
    os.environ[var] = "1" if on else "0"
    try:
        return fn(*args, **kw)
    finally:
        os.environ.pop(var, None)


_direct = functools.partial(_with_knob, "UCCL_MOE_DISPATCH_DIRECT")  # the ring-free dispatch
_ce = functools.partial(_with_knob, "UCCL_MOE_DISPATCH_CE")  # the copy-engine dispatch


def _same_dispatch(check, name: str, a, b, rows: int | None = None) -> None:
    """Every output and handle field of two dispatch results bit for bit; with `rows` (a num_worst_tokens result) only
    the first `rows` rows of recv_x and its scales (neither path writes the padding rows' data)."""
    xa, sa = _split(a.recv_x)
    xb, sb = _split(b.recv_x)
    if rows is not None:
        xa, xb = xa[:rows], xb[:rows]
        sa, sb = (None, None) if sa is None else (sa[:rows], sb[:rows])
    check(f"{name}: recv_x", _eq(xa, xb) and _eq(sa, sb))
    check(f"{name}: top-k ids and weights", _eq(a.recv_topk_idx, b.recv_topk_idx)
          and _eq(a.recv_topk_weights, b.recv_topk_weights))
    check(f"{name}: per-expert counts", a.num_recv_tokens_per_expert_list == b.num_recv_tokens_per_expert_list)
    check(f"{name}: handle", all(_eq(p, q) for p, q in zip(a.handle, b.handle)))


def _direct_worker(rank: int, world: int, gloo) -> None:
    from uccl_moe import Buffer

    R = world
    cfg, nat, ref, check = pull_buffers(rank, R, gloo)
    for seed, (name, T, H, per_rank, K, fp8, scales, routing) in enumerate(CASES):
        T = T + 17 * rank if routing == "neg" else T
        case = _Case(rank, R, T, H, per_rank * R, K, fp8, scales, routing, 700 + seed)
        _, ring = _direct(False, _dispatch, nat, case, "cuda", config=cfg)
        row_bytes, S = H * (1 if fp8 else 2), 0 if case.s is None else case.s.shape[1]
        check(f"{name}: the landing area fits (else the rings would be compared with themselves)",
              nat._live().dispatch_direct_fits(ring.handle, row_bytes, K, S))
        _, direct = _direct(True, _dispatch, nat, case, "cuda", config=cfg)
        _same_dispatch(check, name, direct, ring)
        cached = _direct(True, nat.dispatch, case.xin("cuda"), handle=ring.handle, config=cfg)
        cached_ring = _direct(False, nat.dispatch, case.xin("cuda"), handle=direct.handle, config=cfg)
        check(f"{name}: cached", _eq(_split(cached.recv_x)[0], _split(ring.recv_x)[0])
              and _eq(_split(cached.recv_x)[1], _split(ring.recv_x)[1])
              and _eq(_split(cached_ring.recv_x)[0], _split(ring.recv_x)[0]))
        _, wr = _direct(False, _dispatch, nat, case, "cuda", config=cfg, num_worst_tokens=PULL_WORST_T * R)
        _, wd = _direct(True, _dispatch, nat, case, "cuda", config=cfg, num_worst_tokens=PULL_WORST_T * R)
        _same_dispatch(check, f"{name} (num_worst_tokens)", wd, wr, rows=_split(ring.recv_x)[0].shape[0])
        if not fp8:  # the rows go back: both combines of the direct dispatch's rows against the reference's
            _, rr = _dispatch(ref, case, "cpu", config=cfg)
            y = (_split(direct.recv_x)[0].float() * 0.5 - 0.25).bfloat16()
            want = ref.combine(y.cpu(), rr.handle, topk_weights=rr.recv_topk_weights, config=cfg).combined_x
            got = nat.combine(y, direct.handle, topk_weights=direct.recv_topk_weights, config=cfg).combined_x
            view = nat.get_combine_buffer(direct.handle, H)
            view.copy_(y)
            pulled = nat.combine(view, direct.handle, topk_weights=direct.recv_topk_weights, config=cfg).combined_x
            check(f"{name}: combine of the direct rows", _close_bf16(got, want, None) and torch.equal(got, pulled))

    # The direct kernel ran, not the ring's.
    case = _Case(rank, R, 640, 4096, 16 * R, 8, False, "none", "random", 800)
    names = _kernels(functools.partial(_direct, True, _dispatch, nat, case, "cuda", config=cfg))
    check(f"the direct kernel ran ({names[:200]})", "dispatch_direct_kernel" in names
          and "dispatch_intranode_kernel" not in names)

    # Back to back, one rank late, with other rows each time; and interleaved with ring ops on one Buffer, one rank
    # late before each direct dispatch (so the others finish their part first: the done hand-shake keeps their next
    # ring op out of the late rank's landing area while it still unpacks).
    _, base = _direct(False, _dispatch, nat, case, "cuda", config=cfg)
    xs = [(case.x.float() * (1 + i % 3) - i).bfloat16().cuda() for i in range(24)]
    wants = [_direct(False, nat.dispatch, xi, handle=base.handle, config=cfg).recv_x for xi in xs]
    outs = []
    for xi in xs:
        if rank == 0:
            torch.cuda._sleep(200_000)
        outs.append(_direct(True, nat.dispatch, xi, handle=base.handle, config=cfg).recv_x)
    check("24 direct dispatches back to back, one rank late", all(torch.equal(o, w) for o, w in zip(outs, wants)))
    y = (_split(base.recv_x)[0].float() * 0.5).bfloat16()
    ring_comb = nat.combine(y, base.handle, config=cfg).combined_x

    def late(on: bool, i: int):
        """Cached dispatch i, the ring-free path or the rings, with the last rank late (so a direct push after a
        ring op finds that rank still draining its rings: the enter hand-shake)."""
        if rank == R - 1:
            torch.cuda._sleep(200_000)
        return _direct(on, nat.dispatch, xs[i], handle=base.handle, config=cfg).recv_x

    def late_direct(i: int):
        return late(True, i)

    ok = torch.equal(late_direct(0), wants[0])
    ok &= torch.equal(nat.combine(y, base.handle, config=cfg).combined_x, ring_comb)
    ok &= torch.equal(late_direct(1), wants[1])
    view = nat.get_combine_buffer(base.handle, 4096)
    view.copy_(y)
    ok &= torch.equal(nat.combine(view, base.handle, config=cfg).combined_x, ring_comb)
    ok &= torch.equal(late_direct(2), wants[2])
    ok &= torch.equal(late(False, 3), wants[3])
    ok &= torch.equal(late_direct(4), wants[4])
    ok &= torch.equal(late(False, 5), wants[5])
    ok &= torch.equal(late_direct(6), wants[6])
    check("direct and ring dispatches, ring and pulled combines interleaved", ok)

    # A Buffer too small for the landing area (the ring size hint at 4096 tokens of hidden 7168, EP >= 2... only
    # where the rows from other ranks exceed it): every rank takes the rings, with the same outputs.
    torch.cuda.synchronize()
    dist.barrier(group=gloo)
    small = Buffer(dist.group.WORLD, cfg.get_nvl_buffer_size_hint(7168 * 2, R), backend="native",
                   explicitly_destroy=True)
    big = _Case(rank, R, 8192, 7168, 16 * R, 8, False, "none", "random", 801)
    _, br = _direct(False, _dispatch, small, big, "cuda", config=cfg)
    names = _kernels(functools.partial(_direct, True, _dispatch, small, big, "cuda", config=cfg))
    _, bd = _direct(True, _dispatch, small, big, "cuda", config=cfg)
    check(f"too small: the rings ran ({names[:200]})", R == 1 or ("dispatch_intranode_kernel" in names
                                                                 and "dispatch_direct_kernel" not in names))
    _same_dispatch(check, "too small", bd, br)
    torch.cuda.synchronize()
    check.finish(gloo, small, nat, ref)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_direct_dispatch_matches_the_rings(world: int) -> None:
    run_shared_gpu_ranks(_direct_worker, world, timeout_s=600)


def _ce_worker(rank: int, world: int, gloo, few: bool = False) -> None:
    """The copy-engine cached dispatch (UCCL_MOE_DISPATCH_CE=1) against the rings, bit for bit: every case above
    (token counts differ per rank in the "neg" cases, a rank receives nothing in "empty_last", row-major, column-major
    and int scales) and a rank with no tokens; a num_worst_tokens handle (no host counts) takes the rings; 24 back to
    back with one rank late; interleaved with ring dispatches and every combine path (the copy-engine combine lands in
    the same area). `few` (6 and 8 ranks sharing the GPUs; or UMOE_TEST_SMALL=1, for compute-sanitizer, where the
    kernel names are not checked: the torch profiler sees no kernels under it): the -1-entry, empty-rank and no-token
    cases, the back-to-back and interleaved dispatches only."""
    sanitizer = os.environ.get("UMOE_TEST_SMALL", "0") == "1"
    few = few or sanitizer
    R = world
    cfg, nat, ref, check = pull_buffers(rank, R, gloo)
    # and a rank with no tokens at all (empty x and scales, address 0): it still sends its (empty) x and receives
    no_tokens = [("fp8-col-no-tokens", 0 if rank == R - 1 else 300, 2048, 16, 8, True, "col", "random")]
    for seed, (name, T, H, per_rank, K, fp8, scales, routing) in enumerate(CASES + no_tokens):
        if few and routing not in ("neg", "empty_last") and not name.endswith("no-tokens"):
            continue  # (seeds stay those of the whole list: a case's name pins its inputs in every mode)
        T = T + 17 * rank if routing == "neg" else T
        case = _Case(rank, R, T, H, per_rank * R, K, fp8, scales, routing, 900 + seed)
        _, ring = _ce(False, _dispatch, nat, case, "cuda", config=cfg)
        S = 0 if case.s is None else case.s.shape[1]
        check(f"{name}: the landing areas fit", nat._live().dispatch_ce_fits(ring.handle, H * (1 if fp8 else 2), S))
        x = case.xin("cuda")
        want = _ce(False, nat.dispatch, x, handle=ring.handle, config=cfg)
        got = _ce(True, nat.dispatch, x, handle=ring.handle, config=cfg)
        check(f"{name}: copy engines == rings", all(_eq(p, q) for p, q in zip(_split(got.recv_x), _split(want.recv_x)))
              and _eq(_split(got.recv_x)[0], _split(ring.recv_x)[0]))
        _, wr = _ce(False, _dispatch, nat, case, "cuda", config=cfg, num_worst_tokens=PULL_WORST_T * R)
        wc = _ce(True, nat.dispatch, x, handle=wr.handle, config=cfg)  # no host counts: the rings
        n = _split(ring.recv_x)[0].shape[0]
        check(f"{name}: worst handle", all(_eq(p[:n], q[:n]) for p, q in zip(_split(wc.recv_x), _split(wr.recv_x))
                                           if p is not None))

    case = _Case(rank, R, 640, 4096, 16 * R, 8, True, "col", "random", 950)
    _, base = _ce(False, _dispatch, nat, case, "cuda", config=cfg)
    if not sanitizer:
        names = _kernels(functools.partial(_ce, True, nat.dispatch, case.xin("cuda"), handle=base.handle, config=cfg))
        check(f"the copy-engine kernels ran ({names[:200]})", "dispatch_ce_gather_kernel" in names
              and "ce_enter_kernel" in names and "dispatch_intranode_kernel" not in names)
    s_col = case.xin("cuda")[1]  # column-major on the GPU
    xs = [((case.x.float() * 0.5 ** (i % 3)).to(case.x.dtype).cuda(), s_col * (1 + i))
          for i in range(4 if sanitizer else 24)]
    wants = [_ce(False, nat.dispatch, xi, handle=base.handle, config=cfg).recv_x[0] for xi in xs]
    outs = []
    early0, gated0 = early_ops(nat), gated_ops(nat)

    def back_to_back() -> None:
        for xi in xs:
            if rank == 0:
                torch.cuda._sleep(200_000)
            outs.append(_ce(True, nat.dispatch, xi, handle=base.handle, config=cfg).recv_x[0])

    names = _kernels(back_to_back) if not sanitizer else back_to_back()
    check(f"{len(xs)} copy-engine dispatches back to back, one rank late",
          all(_eq(o, w) for o, w in zip(outs, wants)))
    # every one after the first (which follows a ring dispatch) starts its copies at once (UCCL_MOE_CE_EARLY); where
    # they poll, the first two set the sentinel before their copies (after the ring dispatch, and after a polled one
    # that no polled dispatch followed last time), and from the third on each starts at once behind the gate (its
    # copies into a peer wait until that peer's side memset after the dispatch before ended); one rank lands nothing,
    # so sets no sentinel and is never early where it polls
    polls = knob_on("DISPATCH_CE_POLL")
    gated = len(xs) - 2 if polls and knob_on("CE_EARLY") and R > 1 and gate_ok(nat) else 0
    early = gated if polls else len(xs) - 1 if knob_on("CE_EARLY") else 0
    check("early copy-engine dispatches", early_ops(nat) - early0 == early)
    check("early polled dispatches behind the gate", gated_ops(nat) - gated0 == gated)
    if not sanitizer:  # the gated ones end beside their kernel (UCCL_MOE_CE_END_BESIDE), on the side stream
        check(f"the end kernel ran beside the gather: {'ce_end_kernel' in names}, expected {gated > 0}",
              ("ce_end_kernel" in names) == (gated > 0 and ends_beside(nat)))
    # Interleaved with ring dispatches and every combine path, the last rank late before each copy-engine dispatch.
    bf = _Case(rank, R, 640, 4096, 16 * R, 8, False, "none", "random", 951)
    _, bb = _ce(False, _dispatch, nat, bf, "cuda", config=cfg)
    y = (_split(bb.recv_x)[0].float() * 0.5).bfloat16()
    ring_comb = nat.combine(y, bb.handle, config=cfg).combined_x
    xb = bf.xin("cuda")
    want_b = _ce(False, nat.dispatch, xb, handle=bb.handle, config=cfg).recv_x

    def late_ce():
        if rank == R - 1:
            torch.cuda._sleep(200_000)
        return _ce(True, nat.dispatch, xb, handle=bb.handle, config=cfg).recv_x

    ok = _eq(late_ce(), want_b)
    for comb in ("ce", "staged", "ring", "view"):
        if comb == "view":
            view = nat.get_combine_buffer(bb.handle, 4096)
            view.copy_(y)
            got = nat.combine(view, bb.handle, config=cfg).combined_x
        else:
            got = _combine(nat, comb, y, bb.handle, config=cfg).combined_x
        ok &= _eq(got, ring_comb)
        ok &= _eq(late_ce(), want_b)
        ok &= _eq(_ce(False, nat.dispatch, xb, handle=bb.handle, config=cfg).recv_x, want_b)
    check("copy-engine and ring dispatches, every combine path interleaved", ok)
    # Ranks passing their scales in different orders to one dispatch (column-major on even ranks, row-major on odd
    # ones): every landing area holds them row-major, so the outputs are the rings'.
    mixed = _Case(rank, R, 600, 7168, 16 * R, 8, True, "col", "random", 952)
    _, mr = _ce(False, _dispatch, nat, mixed, "cuda", config=cfg)
    xm, sm = mixed.xin("cuda")
    sm = sm if rank % 2 == 0 else sm.contiguous()
    want_m = _ce(False, nat.dispatch, (xm, sm), handle=mr.handle, config=cfg).recv_x
    got_m = _ce(True, nat.dispatch, (xm, sm), handle=mr.handle, config=cfg).recv_x
    check("scales in different orders on different ranks", all(_eq(p, q) for p, q in zip(got_m, want_m)))
    check_ended_beside(check, nat, R)
    torch.cuda.synchronize()
    check.finish(gloo, nat, ref)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_ce_dispatch_matches_the_rings(world: int) -> None:
    run_shared_gpu_ranks(_ce_worker, world, timeout_s=600)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_flagged_ce_dispatch_matches_the_rings(world: int) -> None:
    """Every case of test_ce_dispatch_matches_the_rings (whose gather polls by default) with chunks and their flags
    instead (UCCL_MOE_DISPATCH_CE_POLL=0)."""
    run_shared_gpu_ranks(_ce_worker, world, env={"UCCL_MOE_DISPATCH_CE_POLL": "0"}, timeout_s=600)


@pytest.mark.parametrize("world", [6, 8])
def test_flagged_ce_dispatch_more_ranks(world: int) -> None:
    """The gather by chunk flags at 6 and 8 ranks sharing the GPUs (the -1-entry, empty-rank and no-token cases, back
    to back and interleaved), as test_ce_dispatch_more_ranks."""
    run_shared_gpu_ranks(_ce_worker, world, True, env={"UCCL_MOE_DISPATCH_CE_POLL": "0"}, timeout_s=600)


@pytest.mark.parametrize("world", [6, 8])
def test_ce_dispatch_more_ranks(world: int) -> None:
    run_shared_gpu_ranks(_ce_worker, world, True, timeout_s=600)


@pytest.mark.parametrize("chunks", [1, 8])
def test_ce_dispatch_chunk_counts(chunks: int) -> None:
    """UCCL_MOE_DISPATCH_CE_CHUNKS at its ends with chunk flags (UCCL_MOE_DISPATCH_CE_POLL=0; the default, 3, runs in
    test_flagged_ce_dispatch_matches_the_rings): one copy per peer, and 8 that shrink so fast that the last ones hold no
    row for the smaller cases, against the rings at EP2 (the BF16 and the FP8 split both)."""
    env = {"UCCL_MOE_DISPATCH_CE_CHUNKS": str(chunks), "UCCL_MOE_DISPATCH_CE_POLL": "0"}
    run_shared_gpu_ranks(_ce_worker, 2, env=env, timeout_s=600)


def test_ce_ops_where_launches_block() -> None:
    """CUDA_LAUNCH_BLOCKING=1 (a common debugging step): a launch returns only when its kernel ended, so the copy-engine
    ops must enqueue every chunk before their kernel, or each rank's kernel waits for chunks its peer has not enqueued
    yet. The copy-engine dispatch against the rings and interleaved with every combine path (the copy-engine combine
    among them), at EP2."""
    run_shared_gpu_ranks(_ce_worker, 2, True, env={"CUDA_LAUNCH_BLOCKING": "1"}, timeout_s=600)


def test_ce_dispatch_with_the_enter_kernel_always() -> None:
    """UCCL_MOE_CE_EARLY=0: every copy-engine dispatch waits for the enter hand-shake kernel before its copies: the
    same outputs as the rings, at EP2 (the default's early copies run in the tests above)."""
    run_shared_gpu_ranks(_ce_worker, 2, True, env={"UCCL_MOE_CE_EARLY": "0"}, timeout_s=600)


def _bits_eq(a, b) -> bool:
    """recv_x results (a tensor, or a tuple with scales) bit for bit: rows and scales that hold NaNs as data too."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
    return all((p is None and q is None) or (p is not None and q is not None and p.dtype == q.dtype and _eq(
        p.view(ints[p.element_size()]), q.view(ints[q.element_size()]))) for p, q in zip(_split(a), _split(b)))


def _poll_counts(buf) -> tuple[int, int, int, int]:
    """`buf`'s polled copy-engine dispatches, polled ops (dispatches and combines), sentinel memsets before a polled
    op (on its stream) and after an op (side stream), since it was made."""
    rt = buf._live()._rt
    return (int(rt.ce_polled_dispatches), int(rt.ce_polled_ops), int(rt.ce_sentinel_sets),
            int(rt.ce_sentinel_side_sets))


def _poll_dispatch_worker(rank: int, world: int, gloo) -> None:
    """The polled copy-engine dispatch (UCCL_MOE_DISPATCH_CE_POLL=1) against the rings, bit for bit (fresh random
    rows): rows that hold the sentinel (all ones in a 32-bit word: four FP8 NaNs, two BF16 NaNs) as data, whole rows
    and scattered words, FP8 with column-major scales (some of them all ones too) and BF16 (whose head rows the SMs
    store, and whose words the gather takes by the same flags); op patterns that each end in a polled dispatch,
    three times over with rank 0 late before every op: a polled combine, a ring combine, a fresh dispatch (notify and
    the rings) and a combine from a view; from the third time on every memset runs on the side stream after the op
    before (none before the dispatch), and a polled combine that follows the dispatch is set up the same way; one
    rank's gather kernel 5 ms late (its head lands long after the peers' copies). Every rank checks."""
    R = world
    cfg, nat, ref, check = pull_buffers(rank, R, gloo)
    fp8 = _Case(rank, R, 640, 7168, 16 * R, 8, True, "col", "random", 960)
    bf = _Case(rank, R, 600, 7168, 16 * R, 8, False, "none", "random", 961)
    _, rf = _ce(False, _dispatch, nat, fp8, "cuda", config=cfg)
    _, rb = _ce(False, _dispatch, nat, bf, "cuda", config=cfg)
    xf, sf = fp8.xin("cuda")
    xb = bf.xin("cuda")
    xf.view(torch.int32)[::7] = -1          # whole rows of the sentinel
    xf.view(torch.int32)[3::5, rank::61] = -1  # and scattered words
    sf.view(torch.int32)[5::9, 1::3] = -1   # scales whose bits are all ones
    xb.view(torch.int32)[::7] = -1
    xb.view(torch.int32)[3::5, rank::61] = -1
    want_f = _ce(False, nat.dispatch, (xf, sf), handle=rf.handle, config=cfg).recv_x
    want_b = _ce(False, nat.dispatch, xb, handle=rb.handle, config=cfg).recv_x
    got_f = _ce(True, nat.dispatch, (xf, sf), handle=rf.handle, config=cfg).recv_x
    got_b = _ce(True, nat.dispatch, xb, handle=rb.handle, config=cfg).recv_x
    check("rows and scales holding the sentinel: polled == rings (FP8)", _bits_eq(got_f, want_f))
    check("rows holding the sentinel: polled == rings (BF16)", _bits_eq(got_b, want_b))
    # The references first (a ring op inside a pattern would be the op before the polled one).
    yb = (torch.rand(rb.recv_x.shape, device="cuda") * 4 - 2).bfloat16()
    want_comb = _combine(nat, "ring", yb, rb.handle, config=cfg).combined_x

    def polled_combine() -> None:
        why = _same(_combine(nat, "ce", yb, rb.handle, config=cfg).combined_x, want_comb)
        check(f"polled combine before a polled dispatch {why}", not why)

    def view() -> None:
        v = nat.get_combine_buffer(rb.handle, 7168)
        v.copy_(yb)
        check("combine from the view", _eq(nat.combine(v, rb.handle, config=cfg).combined_x, want_comb))

    patterns = {
        "polled combine": polled_combine,
        "ring combine": lambda: _combine(nat, "ring", yb, rb.handle, config=cfg),
        "fresh dispatch": lambda: _ce(False, _dispatch, nat, bf, "cuda", config=cfg),
        "view": view,
    }
    for name, op in patterns.items():
        for dtype, x, h, want in (("FP8", (xf, sf), rf.handle, want_f), ("BF16", xb, rb.handle, want_b)):
            for k in range(3):
                before = _poll_counts(nat)
                if rank == 0:
                    torch.cuda._sleep(200_000)
                op()
                if rank == 0:
                    torch.cuda._sleep(200_000)
                got = _ce(True, nat.dispatch, x, handle=h, config=cfg).recv_x
                d = tuple(b - a for a, b in zip(before, _poll_counts(nat)))
                what = f"{name}, then a polled {dtype} dispatch ({k})"
                check(f"{what}: == rings", _bits_eq(got, want))
                check(f"{what}: it polled ({d})", d[0] == 1)
                # learnt by the third time: the memsets after the ops before polled ones run on the side stream (the
                # polled combine's too), none before the dispatch
                if k == 2 and R > 1:
                    check(f"{what}: sentinel sets {d}", d[2] == 0 and d[3] == 1 + (name == "polled combine"))
    # A rank whose gather kernel starts 5 ms late.
    with kernel_late(nat._live(), "_alloc_recv", rank == R - 1):
        late_f = _ce(True, nat.dispatch, (xf, sf), handle=rf.handle, config=cfg).recv_x
        late_b = _ce(True, nat.dispatch, xb, handle=rb.handle, config=cfg).recv_x
    check("one rank's gather 5 ms late: == rings", _bits_eq(late_f, want_f) and _bits_eq(late_b, want_b))
    check_ended_beside(check, nat, R, some=True)
    torch.cuda.synchronize()
    check.finish(gloo, nat, ref)


@pytest.mark.parametrize("world", [2, 3])
def test_polled_ce_dispatch(world: int) -> None:
    run_shared_gpu_ranks(_poll_dispatch_worker, world, timeout_s=600)


def test_polled_ce_dispatch_ends_in_kernel() -> None:
    """test_polled_ce_dispatch with each op's end in its kernel's last block (UCCL_MOE_CE_END_BESIDE=0)."""
    run_shared_gpu_ranks(_poll_dispatch_worker, 2, env={"UCCL_MOE_CE_END_BESIDE": "0"}, timeout_s=600)


@pytest.mark.parametrize("world", [2, 6])
def test_ce_dispatch_matches_the_rings_ends_in_kernel(world: int) -> None:
    """test_ce_dispatch_matches_the_rings (and its 6 ranks sharing the GPUs) with each op's end in its kernel."""
    run_shared_gpu_ranks(_ce_worker, world, world > 4, env={"UCCL_MOE_CE_END_BESIDE": "0"}, timeout_s=600)


def _late_outputs_worker(rank: int, world: int, gloo) -> None:
    """The copy-engine ops allocate their outputs once their first copies are enqueued (intranode.hpp LateOutputs).
    Where that allocation raises on one rank (an out-of-memory, injected), that rank raises it, its op still runs to
    the end without outputs, so every other rank's outputs are the rings' bit for bit, and the next op is right on
    every rank: the cached dispatch (FP8, column-major scales) and the combine of a caller's tensor with top-k weights
    (two late outputs each)."""
    from uccl_moe import _C
    from uccl_moe.backends import _buffer_paths

    R, odd = world, world - 1
    cfg, nat, ref, check = pull_buffers(rank, R, gloo)
    launches: list[str] = []  # the copy-engine launches the ops below reach (a spy around the real ones)
    real = {name: getattr(_C, name) for name in ("dispatch_ce_intranode", "combine_ce_intranode")}
    for name, fn in real.items():
        setattr(_C, name, lambda *a, fn=fn, name=name: (launches.append(name), fn(*a))[1])

    def oom(*args, **kw):
        raise torch.cuda.OutOfMemoryError("injected: the outputs' allocation failed")

    def once_failing(name: str, call, want) -> None:
        """call() with the outputs' allocation failing on rank `odd`, then once more with nothing failing."""
        try:
            got = call()
        except torch.cuda.OutOfMemoryError as e:
            check(f"{name}: only the failing rank raises ({e})", rank == odd and "injected" in str(e))
        else:
            check(f"{name}: the other ranks' outputs are the rings'", rank != odd and all(
                _eq(p, q) for p, q in zip(got, want)))
        finally:
            nat._live().__dict__.pop("_alloc_recv", None)
            _buffer_paths.combine_outputs = real_outputs
        torch.cuda.synchronize()
        check(f"{name}: the next one on every rank", all(_eq(p, q) for p, q in zip(call(), want)))

    real_outputs = _buffer_paths.combine_outputs
    case = _Case(rank, R, 600, 7168, 16 * R, 8, True, "col", "random", 960)
    _, ring = _ce(False, _dispatch, nat, case, "cuda", config=cfg)
    x = case.xin("cuda")
    want = _ce(False, nat.dispatch, x, handle=ring.handle, config=cfg).recv_x

    fail = {"dispatch": rank == odd, "combine": rank == odd}  # the first call of each on rank `odd`

    def dispatch():
        if fail.pop("dispatch", False):
            nat._live()._alloc_recv = oom
        return _ce(True, nat.dispatch, x, handle=ring.handle, config=cfg).recv_x

    once_failing("dispatch", dispatch, want)
    bf = _Case(rank, R, 600, 4096, 16 * R, 8, False, "none", "random", 961)
    _, bb = _ce(False, _dispatch, nat, bf, "cuda", config=cfg)
    y = (_split(bb.recv_x)[0].float() * 0.5).bfloat16()
    w = bb.recv_topk_weights
    ring_out = _combine(nat, "ring", y, bb.handle, topk_weights=w, config=cfg)
    want_c = (ring_out.combined_x, ring_out.combined_topk_weights)

    def combine():
        if fail.pop("combine", False):
            _buffer_paths.combine_outputs = oom
        out = _combine(nat, "ce", y, bb.handle, topk_weights=w, config=cfg)
        return out.combined_x, out.combined_topk_weights

    once_failing("combine", combine, want_c)
    for name, fn in real.items():
        setattr(_C, name, fn)
    check(f"both ops ran through the copy engines, twice each ({launches})",
          launches == ["dispatch_ce_intranode"] * 2 + ["combine_ce_intranode"] * 2)
    torch.cuda.synchronize()
    check.finish(gloo, nat, ref)


@pytest.mark.parametrize("world", [2, 3])
def test_ce_ops_whose_outputs_fail_on_one_rank(world: int) -> None:
    run_shared_gpu_ranks(_late_outputs_worker, world, timeout_s=600)
