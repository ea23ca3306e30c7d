"""UCCLTokenDispatcher inside a real Megatron MoELayer vs Megatron's allgather dispatcher, on CPU (gloo).

Each world size is spawned once (module fixture) and runs every case of its list; the tests then check each case:
outputs, input grads, router grads, expert (and shared expert) weight grads must match the allgather dispatcher on
identical weights and inputs. Also Megatron's dropless round-trip contract through the six methods alone.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core", reason='megatron-core is not installed: pip install -e ".[train]"')

from helpers.mp import run_ranks_on as run_ranks  # noqa: E402

from tests.uccl_moe.megatron._moe_cases import Case, dropless_roundtrip, run_cases  # noqa: E402

pytestmark = [pytest.mark.mp, pytest.mark.timeout(600)]

# Tolerance: both sides sum the same fp32 products, in different orders.
ATOL = 1e-5
# BF16 models: the two dispatchers sum expert outputs and weight grads in different orders; a wrong or missing row
# is an O(1) relative error.
BF16_RTOL = 2e-2

CASES_2 = [
    Case(ep=2, topk=1),
    Case(ep=2, topk=2),
    Case(ep=2, topk=1, capacity_factor=0.5),
    Case(ep=2, topk=2, shared_expert=True),
    Case(ep=2, topk=2, combine_from_buffer=False),
]
CASES_4 = [
    Case(ep=4, topk=1),
    Case(ep=4, topk=2),
    Case(ep=4, topk=4),
    Case(ep=4, topk=4, capacity_factor=0.5),
    Case(ep=4, topk=2, shared_expert=True, capacity_factor=1.0),
    Case(tp=2, ep=2, topk=2),  # expert TP 2: the TPxEP comm group (flex semantics)
    Case(tp=2, ep=2, etp=1, topk=2),  # attention TP 2, expert TP 1
    Case(tp=1, ep=2, etp=2, topk=2, shared_expert=True),
    Case(tp=2, ep=2, topk=2, capacity_factor=0.5),
]


@pytest.fixture(scope="module")
def results_2():
    return run_ranks(run_cases, 2, CASES_2)


@pytest.fixture(scope="module")
def results_4():
    return run_ranks(run_cases, 4, CASES_4)


def _check(results, case: Case) -> None:
    for rank, per_rank in enumerate(results):
        res = per_rank[case.id]
        assert "error" not in res, f"rank {rank}:\n{res.get('error')}"
        assert res["dispatcher"] == "UCCLTokenDispatcher" and res["ref_dispatcher"] == "MoEAllGatherTokenDispatcher"
        assert not res["missing"], f"tensors with a grad on one side only: {res['missing']}"
        names = res["grad_names"]
        assert "grad/router.weight" in names
        assert any("local_experts" in n or "weight1" in n for n in names), names
        if case.shared_expert:
            assert any(n.startswith("grad/shared_experts.") for n in names), names
        # Both combines (the forward one, and the dispatch's backward one) take their rows from get_combine_buffer
        # unless the knob is off; on the native backend inside one node that is the NVL buffer itself (combine from
        # the buffer: the pull kernel launches), elsewhere a fresh tensor.
        views, native = res["combine_views"], res["backend"] == "NativeBackend"
        if case.combine_from_buffer is False:
            assert views == [] and res["combine_pulls"] == 0, (views, res["combine_pulls"])
        else:
            assert views == [native, native], (views, res["backend"])
            assert res["combine_pulls"] == (2 if native else 0), (res["combine_pulls"], res["backend"])
        for name in ("output", "input_grad", *names):
            tol = ATOL if case.dtype == "fp32" else BF16_RTOL * res["scales"][name] + 1e-3
            assert res["diffs"][name] <= tol, (
                f"rank {rank} {name}: max |uccl - allgather| = {res['diffs'][name]} > {tol} "
                f"(max |allgather| {res['scales'][name]})"
            )


@pytest.mark.parametrize("case", CASES_2, ids=[c.id for c in CASES_2])
def test_matches_allgather_2_ranks(results_2, case):
    _check(results_2, case)


@pytest.mark.parametrize("case", CASES_4, ids=[c.id for c in CASES_4])
def test_matches_allgather_4_ranks(results_4, case):
    _check(results_4, case)


def test_dropless_roundtrip_contract():
    """dispatch -> tokens * probs (1/topk) -> combine returns the input; the backward returns the gradient."""
    for res in run_ranks(dropless_roundtrip, 2, 2, 2):
        assert res["rows"] > 0
        assert res["forward"] <= 1e-6, res
        assert res["backward"] <= 1e-6, res


def test_dropless_roundtrip_emulated_two_nodes():
    """The default Buffer sizes follow the group's node layout: on two (emulated) nodes of one rank each the
    dispatcher sizes the RDMA buffer too, which the Buffer requires across nodes."""
    for res in run_ranks(dropless_roundtrip, 2, 2, 2, env={"UCCL_MOE_EMULATE_NODES": "2"}):
        assert res["rows"] > 0
        assert res["forward"] <= 1e-6, res
        assert res["backward"] <= 1e-6, res


def _nvl_bytes_of_buffer(rank: int, world: int, ce_tokens: list[int], combine_tokens: list[int],
                         backend: str) -> tuple[int, int]:
    """(the Buffer's NVL bytes, the configs' ring hint) in this process (the hint follows Buffer.num_sms)."""
    import torch.distributed as dist

    from uccl_moe import Buffer
    from uccl_moe.megatron import buffer_manager as bm
    from uccl_moe.megatron.knobs import UCCLKnobs

    bm.clear_buffers()
    knobs = UCCLKnobs(num_sms=None, nvl_bytes=None, rdma_bytes=None, backend=backend)
    buf = bm.get_buffer(dist.group.WORLD, 2 * 2048, knobs, 0, 2, backend=backend,
                        combine_tokens=combine_tokens[rank], ce_tokens=ce_tokens[rank])
    ring = max(c.get_nvl_buffer_size_hint(2 * 2048, 2) for c in (Buffer.get_dispatch_config(2),
                                                                  Buffer.get_combine_config(2)))
    return int(buf.num_nvl_bytes), int(ring)


def test_buffer_holds_the_copy_engine_ops_of_the_groups_largest_batch():
    """Without combine from the buffer (1F1B EP overlap, fused permute) the dispatcher's Buffer still fits the
    copy-engine dispatch and combine of the group's largest batch at EP2 (the configs' ring hints alone would leave
    them on the rings past a few thousand tokens); alike on every rank; not for the reference backend."""
    from uccl_moe import Buffer

    ce = Buffer.get_copy_engine_buffer_size_hint(16384, 2048, 2, 2)
    got = run_ranks(_nvl_bytes_of_buffer, 2, [16384, 100], [0, 0], "auto")
    ring = got[0][1]
    assert ce > ring and got == [(ce, ring)] * 2
    assert run_ranks(_nvl_bytes_of_buffer, 2, [16384, 100], [0, 0], "reference") == [(ring, ring)] * 2
    view = Buffer.get_combine_buffer_size_hint(2 * 16384, 2048, 2)  # combine from the buffer: every row, larger
    assert run_ranks(_nvl_bytes_of_buffer, 2, [16384, 16384], [100, 16384], "auto") == [(view, ring)] * 2
    # a rank whose first batch has no tokens still takes part in the size exchange (else its peer would wait in it)
    assert run_ranks(_nvl_bytes_of_buffer, 2, [0, 16384], [0, 0], "auto", timeout_s=120) == [(ce, ring)] * 2


@pytest.mark.parametrize("overlap, fused", [(False, False), (True, False), (False, True)])
def test_dispatcher_sizes_its_buffer_for_its_batch(monkeypatch, overlap, fused):
    """The dispatcher asks the manager for a Buffer sized for the copy-engine ops of its batch (ce_tokens), and for
    the combine from the buffer only where that path is on (not under the 1F1B EP overlap or a fused permute)."""
    from types import SimpleNamespace

    from uccl_moe.megatron import dispatcher as dmod
    from uccl_moe.megatron.knobs import UCCLKnobs

    asked = []
    monkeypatch.setattr(dmod, "get_buffer", lambda *a, **kw: asked.append((a, kw)) or "buffer")
    disp = object.__new__(dmod.UCCLTokenDispatcher)
    disp._buffer_key, disp._buffer, disp.comm_group, disp.tp_size, disp.router_topk = None, None, "group", 1, 8
    disp.knobs = UCCLKnobs(num_sms=None, nvl_bytes=None, rdma_bytes=None, backend="auto")
    disp.config = SimpleNamespace(moe_permute_fusion=fused, overlap_moe_expert_parallel_comm=overlap)
    x = torch.zeros((2, 300, 64), dtype=torch.bfloat16)
    assert disp._get_buffer(x) == "buffer" and disp._get_buffer(x) == "buffer"  # the second call: the same Buffer
    [(args, kw)] = asked
    assert args == ("group", 128, disp.knobs, 1200, 8) and kw["ce_tokens"] == 600
    assert kw["combine_tokens"] == (0 if overlap or fused else 600)


def test_backend_for_model_dtype(caplog):
    from uccl_moe import InvalidTypeError
    from uccl_moe.megatron import buffer_manager as d

    assert d.backend_for("auto", torch.bfloat16) == "auto"
    assert d.backend_for("native", torch.bfloat16) == "native"
    assert d.backend_for("reference", torch.float32) == "reference"
    d._FALLBACK_LOGGED.discard(torch.float16)
    with caplog.at_level("WARNING", logger="uccl_moe.megatron"):
        assert d.backend_for("auto", torch.float16) == "reference"
        assert d.backend_for("auto", torch.float16) == "reference"
    said = [r.getMessage() for r in caplog.records if "native kernels move BF16" in r.getMessage()]
    assert len(said) == 1 and "float16" in said[0] and "--bf16" in said[0], said
    with pytest.raises(InvalidTypeError, match=r"moe_uccl_backend=native moves BF16.*float32.*--bf16"):
        d.backend_for("native", torch.float32)


@pytest.mark.parametrize("deterministic", [False, True])
def test_unpermute_into_matches_megatron_unpermute(deterministic):
    """The forward combine's rows summed into the Buffer's memory equal Megatron's own unpermute (the same ops in the
    same order), values and gradients, in both of its branches (scatter_add_, and index_add_ under deterministic
    algorithms)."""
    from megatron.core.transformer.moe.moe_utils import unpermute

    from uccl_moe.megatron import _compat

    gen = torch.Generator().manual_seed(3)
    N, H, E = 12, 16, 4
    routing_map = torch.rand((N, E), generator=gen) < 0.5
    routing_map[0] = False  # a row no local expert took: stays zero
    sorted_indices = torch.arange(N).unsqueeze(0).expand(E, -1).masked_select(routing_map.T.contiguous())
    tokens = torch.randn((int(routing_map.sum()), H), generator=gen).bfloat16()
    grad = torch.randn((N, H), generator=gen).bfloat16()
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(deterministic)
    try:
        a = tokens.clone().requires_grad_(True)
        want = unpermute(a, sorted_indices, restore_shape=torch.Size((N, H)), routing_map=routing_map, fused=False)
        want.backward(grad)
        b = tokens.clone().requires_grad_(True)
        memory = torch.full((N, H), 7.0, dtype=torch.bfloat16)  # stands in for the NVL buffer: stale contents
        got = _compat.unpermute_into(memory, b, sorted_indices)
        got.backward(grad)
    finally:
        torch.use_deterministic_algorithms(was)
    assert got.data_ptr() == memory.data_ptr()
    assert torch.equal(got.detach(), want.detach()) and bool((got[0] == 0).all())
    assert torch.equal(b.grad, a.grad)


@pytest.mark.parametrize("fits", [False, True])
def test_permute_gradient_lands_in_the_buffer(fits):
    """dispatch_postprocess's gather: Megatron's permute (on zero columns, for its routing) plus _GatherGradIntoBuffer
    gives Megatron's own permuted rows and probs, and the same gradient (bitwise: index_select's backward is the same
    zeros-then-index_add_); where every rank's rows fit, that gradient is the Buffer's memory itself (stale contents
    cleared), asked for with the dispatch's top-k width, so the dispatch's backward combine pulls it."""
    from megatron.core.transformer.moe.moe_utils import permute

    from uccl_moe.megatron import _compat
    from uccl_moe.megatron import autograd as d

    gen = torch.Generator().manual_seed(5)
    N, H, E, K = 10, 16, 4, 3
    routing_map = torch.rand((N, E), generator=gen) < 0.5
    routing_map[1] = False  # a received row no local expert takes: zero gradient
    probs = torch.rand((N, E), generator=gen)
    tokens = torch.randn((N, H), generator=gen).bfloat16()
    memory = torch.full((N, H), 7.0, dtype=torch.bfloat16)  # stands in for the NVL buffer: stale contents

    class FakeBuffer:
        def __init__(self):
            self.asked = []

        def combine_buffer_fits(self, handle, hidden, num_topk):
            self.asked.append((handle, hidden, num_topk))
            return fits

        def get_combine_buffer(self, handle, hidden, dtype):
            assert (handle, hidden, dtype) == ("h", H, torch.bfloat16)
            return memory

    a = tokens.clone().requires_grad_(True)
    want, want_probs, want_idx = permute(a, routing_map, probs=probs, num_out_tokens=int(routing_map.sum()))
    grad = torch.randn(want.shape, generator=gen).bfloat16()
    want.backward(grad)
    b = tokens.clone().requires_grad_(True)
    buf = FakeBuffer()
    _, got_probs, idx = _compat.permute(b.detach()[:, :0], routing_map, probs, int(routing_map.sum()), fused=False)
    state = d._DispatchState(pull_backward=True)
    state.handle = "h"
    got = d._GatherGradIntoBuffer.apply(b, idx, buf, state, K)
    state.handle = None  # token_combine drops it; the gather kept its own
    seen = []
    b.register_hook(lambda g: seen.append(g.data_ptr()))
    got.backward(grad)
    assert torch.equal(idx, want_idx) and torch.equal(got_probs, want_probs) and torch.equal(got, want)
    assert torch.equal(b.grad, a.grad) and bool((b.grad[1] == 0).all())
    assert buf.asked == [("h", H, K)]
    assert (seen == [memory.data_ptr()]) is fits  # the gradient handed on is the Buffer's memory only when it fits
    assert (state.backward_view is memory) is fits and (fits or state.backward_view is None)


def test_backward_combine_input_pulls_alike_on_every_rank():
    """The dispatch's backward combine takes the Buffer's memory exactly when every rank's rows fit: the gather's
    gradient as it lies there, any other gradient copied in (a hook, a second consumer); where they do not fit, a
    tensor of its own, never the Buffer's memory."""
    from uccl_moe.megatron import autograd as d

    memory = torch.zeros((5, 8), dtype=torch.bfloat16)
    grad = torch.randn((5, 8)).bfloat16()

    class FakeBuffer:
        def __init__(self, fits):
            self.fits, self.views = fits, 0

        def combine_buffer_fits(self, handle, hidden, num_topk):
            assert (handle, hidden, num_topk) == ("h", 8, 3)
            return self.fits

        def get_combine_buffer(self, handle, hidden, dtype):
            self.views += 1
            return memory

    buf = FakeBuffer(True)
    assert d._backward_combine_input(buf, "h", memory, 3, memory) is memory and buf.views == 0
    for view in (None, memory):  # no view taken, or a gradient that is not the view
        memory.zero_()
        out = d._backward_combine_input(buf, "h", grad, 3, view)
        assert out.data_ptr() == memory.data_ptr() and torch.equal(out, grad)
    assert buf.views == 2
    buf = FakeBuffer(False)
    assert d._backward_combine_input(buf, "h", grad, 3, None) is grad
    out = d._backward_combine_input(buf, "h", memory, 3, memory)
    assert out.data_ptr() != memory.data_ptr() and torch.equal(out, memory) and buf.views == 0


def test_dispatch_backward_captures_after_the_copy_into_the_buffer():
    """With async_finish the backward combine runs on the comm stream after the event it is handed: that event must
    be captured after every write of its input, the copy of a gradient into the Buffer's view included (else the
    comm stream could read the view before the copy lands)."""
    import types

    from uccl_moe.megatron import autograd as d

    calls, memory = [], torch.zeros((4, 8), dtype=torch.bfloat16)

    class FakeBuffer:
        def combine_buffer_fits(self, handle, hidden, num_topk):
            calls.append("fits")
            return True

        def get_combine_buffer(self, handle, hidden, dtype):
            calls.append("view")
            return memory

        def capture(self):
            calls.append("capture")
            return "event"

        def combine(self, x, handle, topk_weights=None, previous_event=None, **kw):
            calls.append(("combine", x.data_ptr() == memory.data_ptr(), previous_event))
            return x.float().sum(1, keepdim=True), topk_weights, types.SimpleNamespace(current_stream_wait=lambda: None)

    state = d._DispatchState(pull_backward=True)  # no gather view: the gradient reached the dispatch another way
    ctx = types.SimpleNamespace(buffer=FakeBuffer(), handle="h", state=state, async_finish=True,
                                allocate_on_comm_stream=True)
    grad = torch.randn((4, 8)).bfloat16()
    d.UCCLDispatch.backward(ctx, grad, torch.rand((4, 2)))
    assert calls == ["fits", "view", "capture", ("combine", True, "event")], calls
    assert torch.equal(memory, grad)


def test_combine_input_choice():
    """Where combine_preprocess writes its rows: the Buffer's view only with the knob on, no fused permute, a handle,
    and Buffer.combine_buffer_fits (the group-wide answer) true; otherwise None (Megatron's unpermute, the ring
    combine). This rank's own token count plays no part: ranks of one group with different counts still agree."""
    import types

    from uccl_moe.megatron import dispatcher as d
    from uccl_moe.megatron import knobs

    class FakeBuffer:
        def __init__(self, fits):
            self.fits, self.asked, self.fits_asked = fits, [], []

        def combine_buffer_fits(self, handle, hidden, num_topk):
            self.fits_asked.append((handle, hidden, num_topk))
            return self.fits

        def get_combine_buffer(self, handle, hidden, dtype):
            self.asked.append((handle, hidden, dtype))
            return torch.empty((3, hidden), dtype=dtype)

    def make(fits=True, from_buffer=True, fused=False, handle="h", tokens=32):
        disp = object.__new__(d.UCCLTokenDispatcher)
        disp.knobs = knobs.UCCLKnobs(None, None, None, "auto", combine_from_buffer=from_buffer)
        disp.config = types.SimpleNamespace(moe_permute_fusion=fused)
        disp._buffer = FakeBuffer(fits)
        disp._state = types.SimpleNamespace(handle=handle)
        disp.hidden_shape = torch.Size((tokens, 16))
        return disp

    for tokens in (32, 10**6):  # a rank with many more tokens than the Buffer was sized for still follows the group
        disp = make(tokens=tokens)
        view = disp._combine_input(16, torch.bfloat16)
        assert view is not None and disp._buffer.asked == [("h", 16, torch.bfloat16)]
        assert disp._buffer.fits_asked == [("h", 16, 0)]
    for disp in (make(from_buffer=False), make(fused=True), make(handle=None), make(fits=False)):
        assert disp._combine_input(16, torch.bfloat16) is None and disp._buffer.asked == []
