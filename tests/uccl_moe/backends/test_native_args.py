"""The Python↔C++ seam of the native intranode ops, host-side (no GPU): argument structs bound by field name, the
geometry computed once in C++ and handed to every op, and the backends building handles by field name."""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from uccl_moe import _C, Config, DispatchHandle

# PackArgs (rdma_pack) exists in builds with the internode kernels only.
ARGS_CLASSES = ("NotifyArgs", "DispatchArgs", "CombineArgs", "CombinePullArgs",
                pytest.param("PackArgs", marks=pytest.mark.skipif(not hasattr(_C, "PackArgs"),
                                                                  reason="build without internode kernels")))
STUB = Path(__file__).resolve().parents[3] / "uccl_moe" / "_C.pyi"


def _stub_class(name: str) -> ast.ClassDef:
    tree = ast.parse(STUB.read_text())
    return next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)


def _fields_of(cls: Any) -> list[str]:
    """The field names in the order the binding registered them (its repr lists every field)."""
    text = repr(cls())
    inner = text[text.index("(") + 1:-1]
    return [part.split("=")[0] for part in inner.split(", ")]


@pytest.mark.parametrize("name", ARGS_CLASSES)
def test_args_struct_fields_match_the_stub(name: str) -> None:
    """Every field the stub declares is a field of the bound struct, in both the attributes and the keyword-only
    constructor, and nothing else: mypy checks the backends against the stub, so a drifted stub hides a typo."""
    cls = _stub_class(name)
    attrs = [n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)]
    init = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    assert not init.args.args[1:], "the constructor is keyword-only"
    kwonly = [a.arg for a in init.args.kwonlyargs]
    assert attrs == kwonly == _fields_of(getattr(_C, name))


# The integer (non-pointer) fields of the structs in intranode.hpp and internode.hpp.
_SCALARS = {"num_tokens", "num_experts", "expert_alignment", "row_bytes", "num_topk", "num_scales",
            "scale_token_stride", "scale_hidden_stride", "num_recv_rows", "hidden", "num_lanes", "staged",
            "ce_chunks", "ce_poll"}


def test_geometry_properties_match_the_stub() -> None:
    stub = {n.name for n in _stub_class("IntranodeGeometry").body if isinstance(n, ast.FunctionDef)}
    assert stub == {n for n in dir(_C.IntranodeGeometry) if not n.startswith("_")}


@pytest.mark.parametrize("name", ARGS_CLASSES)
def test_args_struct_round_trips_every_field_by_name(name: str) -> None:
    """A struct built by keyword holds each value (pointers as full 64-bit addresses, bools as bools); unset fields
    are 0."""
    cls = getattr(_C, name)
    fields = _fields_of(cls)
    values: dict[str, Any] = {}
    for i, f in enumerate(fields):
        current = getattr(cls(), f)
        assert current in (0, False), (f, current)
        if isinstance(current, bool):
            values[f] = True
        elif f in _SCALARS:
            values[f] = i + 1
        else:  # a pointer: a device address beyond 32 bits
            values[f] = 0x7F00_0000_0000 + 16 * i
    a = cls(**values)
    assert {f: getattr(a, f) for f in fields} == values
    a2 = cls()
    setattr(a2, fields[0], values[fields[0]])
    assert getattr(a2, fields[0]) == values[fields[0]] and getattr(a2, fields[-1]) in (0, False)


def test_args_struct_refuses_unknown_fields_positional_values_and_wrong_types() -> None:
    """The constructor is a plain keyword-only signature: a misspelt field, a positional value, a value of the wrong
    type or out of a field's range is a TypeError that shows the signature and what was passed."""
    with pytest.raises(TypeError, match=r"(?s)num_tokens: int = 0.*kwargs = \{ num_token: int \}"):
        _C.DispatchArgs(num_token=3)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        _C.DispatchArgs(3)  # type: ignore[misc]
    with pytest.raises(TypeError, match=r"kwargs = \{ num_tokens: str \}"):
        _C.DispatchArgs(num_tokens="3")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"kwargs = \{ num_tokens: int \}"):
        _C.NotifyArgs(num_tokens=2**31)  # an int32 field
    with pytest.raises(TypeError):
        _C.DispatchArgs(x=-1)  # an address is unsigned
    with pytest.raises(AttributeError):
        _C.CombineArgs().hiden = 3  # type: ignore[attr-defined]


pytestmark_kernels = pytest.mark.skipif(not _C.has_intranode_kernels(), reason="build without intranode kernels")


@pytestmark_kernels
@pytest.mark.parametrize("ranks", [1, 2, 5, 8])
def test_placed_geometry_is_the_tuples_geometry_placed_in_the_buffer(ranks: int) -> None:
    """The geometry every op runs on (NvlRuntime.geometry, without its SM check) is the validated lane geometry plus
    the ring placement of the buffer, one object Python sizes the lane matrices from."""
    hint = Config(24, 8, 256, 6, 128).get_nvl_buffer_size_hint(7168 * 2, ranks)
    g = _C.intranode_placed_geometry(24, ranks, 8, 256, hint)
    assert (g.num_channels, g.lanes_per_channel, g.channel_slots, g.lane_slots, g.chunk_tokens) == \
        _C.intranode_geometry(24, ranks, 8, 256)
    assert g.num_lanes == g.num_channels * g.lanes_per_channel and g.num_sms == 24
    assert (g.num_ranks, g.num_nvl_bytes) == (ranks, hint)
    assert g.lane_region_bytes == _C.intranode_slot_placement(24, ranks, 8, 256, hint, 7168 * 2, 8, 0)[1]
    with pytest.raises(AttributeError):
        g.num_lanes = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        _C.IntranodeGeometry()  # only the runtime makes one
    with pytest.raises(_C_error(), match="num_max_nvl_chunked_recv"):
        _C.intranode_placed_geometry(24, 4, 8, 8, hint)


def _C_error() -> type[Exception]:
    from uccl_moe.errors import InvalidUsageError

    return InvalidUsageError


class _FakeRuntime:
    """The NvlRuntime seam of NativeBackend: geometry comes from the real C++ computation (placed for a fake buffer),
    counts from a fixed answer."""

    def __init__(self, ranks: int, rows: int) -> None:
        self.ranks, self.rows = ranks, rows
        self.asked: list[tuple[int, int, int]] = []

    local_buffer = 4096  # an NVL buffer no CPU tensor lies in (combine's get_combine_buffer check)
    topk_fault_device = 0  # no device range record: the kernels' fault path is not what this fake checks

    def take_topk_fault(self) -> None:
        return None

    def aborted(self) -> bool:
        return False

    def geometry(self, num_sms: int, send: int, recv: int) -> Any:
        self.asked.append((num_sms, send, recv))
        return _C.intranode_placed_geometry(num_sms, self.ranks, send, recv, 1 << 30)

    def reset_recv_counter(self) -> None:
        pass

    def wait_recv_counts(self, num_local_experts: int) -> tuple[bool, int, int, int, list[int], list[int],
                                                               list[int]]:
        rank_prefix = list(range(1, self.ranks * self.ranks + 1))
        tokens = [5 + r for r in range(self.ranks)]
        return True, self.rows, self.rows + 1, self.rows - 1, [1] * num_local_experts, rank_prefix, tokens


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else int(t.data_ptr())


def _request(x: torch.Tensor, R: int, K: int, E: int, cfg: Any) -> Any:
    """A DispatchRequest of x's tokens, every token to every rank, top-k and per-expert counts zero."""
    from uccl_moe.backends.base import DispatchRequest

    T = x.shape[0]
    return DispatchRequest(x=x, x_scales=None, topk_idx=torch.zeros((T, K), dtype=torch.int64),
                           topk_weights=torch.zeros((T, K)), num_tokens_per_rank=torch.zeros(R, dtype=torch.int32),
                           num_tokens_per_rdma_rank=None, is_token_in_rank=torch.ones((T, R), dtype=torch.bool),
                           num_tokens_per_expert=torch.zeros(E, dtype=torch.int32), expert_alignment=1,
                           num_worst_tokens=0, config=cfg)


def _fake_backend(R: int, rows: int) -> Any:
    """A NativeBackend without a GPU: the runtime is a fake (_FakeRuntime), the tensors live on the CPU."""
    from uccl_moe.backends import native

    backend = object.__new__(native.NativeBackend)
    backend._rt, backend._inter, backend.R = _FakeRuntime(R, rows), None, R
    backend.W = _C.intranode_lanes_per_channel(R)
    backend._stream = lambda: 0  # type: ignore[method-assign]
    backend.ctx = SimpleNamespace(num_nvl_bytes=1 << 20)
    return backend


@pytestmark_kernels
def test_native_ops_pass_the_runtimes_geometry_and_the_handles_fields_by_name(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """NativeBackend sizes the handle's lane matrices from the runtime's geometry, hands that same object to notify,
    dispatch and combine, returns a DispatchHandle, and fills each launcher's struct from the handle's named fields
    (the GPU suite checks the results; this checks the wiring on the host)."""
    from uccl_moe.backends import native

    calls: list[tuple[str, Any, Any]] = []
    for op in ("notify_dispatch", "dispatch_intranode", "combine_intranode"):
        monkeypatch.setattr(native._C, op, lambda rt, geo, args, stream, op=op: calls.append((op, geo, args)))
    R, T, H, K, E, rows = 2, 5, 64, 2, 4, 7
    backend = _fake_backend(R, rows)
    cfg = Config(24, 8, 256, 6, 128)
    x = torch.zeros((T, H), dtype=torch.bfloat16)
    req = _request(x, R, K, E, cfg)
    recv_x, _, recv_idx, recv_w, counts, h = backend.dispatch(req)
    assert isinstance(h, DispatchHandle) and counts == [1, 1]
    (_, geo_n, notify), (_, geo_d, disp) = calls
    assert backend._rt.asked == [(24, 8, 256)]
    assert geo_n is geo_d
    assert h.channel_prefix_matrix.shape == h.recv_channel_prefix_matrix.shape == (R, geo_n.num_lanes)
    assert (notify.lane_prefix, notify.rank_prefix, notify.recv_lane_start, notify.is_token_in_rank) == \
        (_ptr(h.channel_prefix_matrix), _ptr(h.rank_prefix_matrix), _ptr(h.recv_channel_prefix_matrix),
         _ptr(h.is_token_in_rank))
    assert notify.write_host_counters and (notify.num_tokens, notify.num_experts) == (T, E)
    assert (disp.rank_prefix, disp.recv_lane_start, disp.recv_src_idx, disp.send_head) == \
        (_ptr(h.rank_prefix_matrix), _ptr(h.recv_channel_prefix_matrix), _ptr(h.recv_src_idx), _ptr(h.send_head))
    assert (disp.recv_x, disp.recv_topk_idx, disp.recv_topk_weights) == (_ptr(recv_x), _ptr(recv_idx), _ptr(recv_w))
    assert (disp.num_recv_rows, disp.num_tokens, disp.row_bytes, disp.num_topk) == (rows, T, H * 2, K)
    assert h.recv_src_idx.shape == (rows,) and h.send_head.shape == (T, R)
    # notify compares (between the ranks) the very rows the dispatch then moves
    assert notify.rows_code == _C.dispatch_rows_code(disp.row_bytes, disp.num_topk, disp.num_scales) != 0

    calls.clear()
    backend.cached_dispatch(x, None, h, Config(20, 4, 128, 6, 128))  # runs on the handle's lanes (24 SMs)
    (_, geo_c, cached), = calls
    assert backend._rt.asked[-1] == (24, 4, 128) and geo_c.num_lanes == geo_n.num_lanes
    assert (cached.recv_src_idx, cached.send_head, cached.topk_idx) == (0, 0, 0)  # reads the handle, writes no meta
    assert (cached.rank_prefix, cached.recv_lane_start) == (_ptr(h.rank_prefix_matrix),
                                                            _ptr(h.recv_channel_prefix_matrix))

    calls.clear()
    y = torch.zeros((rows, H), dtype=torch.bfloat16)
    out, _ = backend.combine(y, h, None, (None, None), cfg)
    (_, _, comb), = calls
    assert (comb.x, comb.rank_prefix, comb.recv_lane_start, comb.send_head, comb.out) == \
        (_ptr(y), _ptr(h.rank_prefix_matrix), _ptr(h.recv_channel_prefix_matrix), _ptr(h.send_head), _ptr(out))
    assert (comb.num_tokens, comb.hidden, comb.num_topk, comb.topk_weights) == (T, H, 0, 0)


@pytestmark_kernels
def test_a_fresh_dispatch_builds_its_arguments_before_the_count_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    """After notify's count wait the GPU waits for the host's launch, so a fresh dispatch builds its arguments (and
    the handle's send_head) while notify runs; only what the received rows decide comes after the wait."""
    from uccl_moe.backends import native

    order: list[str] = []
    real_args = native._C.DispatchArgs

    def args(**kw: Any) -> Any:
        order.append("args")
        return real_args(**kw)

    monkeypatch.setattr(native._C, "DispatchArgs", args)
    for op in ("notify_dispatch", "dispatch_intranode"):
        monkeypatch.setattr(native._C, op, lambda rt, geo, a, stream, op=op: order.append(op))
    R, T, H, K, E, rows = 2, 5, 64, 2, 4, 7
    backend = _fake_backend(R, rows)
    wait = backend._rt.wait_recv_counts
    monkeypatch.setattr(backend._rt, "wait_recv_counts", lambda n: (order.append("wait"), wait(n))[1])
    empty = torch.empty

    def logged_empty(*a: Any, **kw: Any) -> torch.Tensor:
        order.append(f"empty{tuple(a[0])}")
        return empty(*a, **kw)

    monkeypatch.setattr(native.torch, "empty", logged_empty)
    x = torch.zeros((T, H), dtype=torch.bfloat16)
    backend.dispatch(_request(x, R, K, E, Config(24, 8, 256, 6, 128)))
    after = order[order.index("wait") + 1:]
    assert order.index("args") < order.index("wait") and f"empty{(T, R)}" in order[:order.index("wait")]
    assert after == [f"empty{(rows,)}", f"empty{(rows, H)}", f"empty{(rows, K)}", f"empty{(rows, K)}",
                     "dispatch_intranode"], after


@pytestmark_kernels
def test_a_direct_dispatch_lands_rows_without_rings(monkeypatch: pytest.MonkeyPatch) -> None:
    """UCCL_MOE_DISPATCH_DIRECT=1: dispatch and cached dispatch launch the ring-free kernel with the handle's
    lane_prefix and the landing rows every rank holds (notify's most rows from other ranks, the same on every rank);
    a buffer too small for them, 0, or auto at an EP size not in tuning.DIRECT_DISPATCH take the rings (the GPU suite
    checks the outputs bit for bit)."""
    from uccl_moe import tuning
    from uccl_moe.backends import native

    calls: list[tuple[str, Any]] = []
    for op in ("notify_dispatch", "dispatch_intranode", "dispatch_direct_intranode"):
        monkeypatch.setattr(native._C, op, lambda rt, geo, args, stream, op=op: calls.append((op, args)))
    R, T, H, K, E, rows = 2, 5, 64, 2, 4, 7
    backend = _fake_backend(R, rows)  # notify reports rows - 1 rows from other ranks at most
    need = int(_C.intranode_direct_landing_bytes(rows - 1, H * 2, K, 0))
    assert need > int(_C.intranode_direct_landing_bytes(rows - 1, H * 2, 0, 0)) > (1 << 20)
    cfg = Config(24, 8, 256, 6, 128)
    x = torch.zeros((T, H), dtype=torch.bfloat16)
    req = _request(x, R, K, E, cfg)
    backend.ctx = SimpleNamespace(num_nvl_bytes=need)
    monkeypatch.setenv("UCCL_MOE_DISPATCH_DIRECT", "1")
    *_, h = backend.dispatch(req)
    (_, notify), (op, disp) = calls
    assert op == "dispatch_direct_intranode"
    assert (disp.lane_prefix, disp.landing_rows, disp.num_topk) == (_ptr(h.channel_prefix_matrix), rows - 1, K)
    assert (disp.recv_src_idx, disp.send_head) == (_ptr(h.recv_src_idx), _ptr(h.send_head))
    calls.clear()
    backend.cached_dispatch(x, None, h, cfg)  # no top-k: a smaller landing area, the same rows
    (op, cached), = calls
    assert (op, cached.landing_rows, cached.num_topk, cached.send_head) == ("dispatch_direct_intranode", rows - 1, 0, 0)
    assert backend.dispatch_direct_fits(h, H * 2, K, 0) and not backend.dispatch_direct_fits(h, H * 2, K, 1)
    backend.ctx = SimpleNamespace(num_nvl_bytes=need - 1)  # the ids and weights no longer fit: the rings
    for knob, table, want in (("1", {}, "dispatch_intranode"), ("0", {}, "dispatch_intranode"),
                              ("auto", {}, "dispatch_intranode"), ("auto", {R: "here"}, "dispatch_direct_intranode")):
        if want == "dispatch_direct_intranode":
            backend.ctx = SimpleNamespace(num_nvl_bytes=need)
        calls.clear()
        monkeypatch.setenv("UCCL_MOE_DISPATCH_DIRECT", knob)
        monkeypatch.setattr(tuning, "DIRECT_DISPATCH", table)
        backend.dispatch(req)
        assert calls[-1][0] == want, (knob, table)


def _check_auto_knob(monkeypatch: pytest.MonkeyPatch, var: str, table_attr: str, calls: list[tuple[str, Any]],
                     call: Any, cases: Any) -> None:
    """For each (knob, table, want): with `var` set to knob (None: unset) and tuning.<table_attr> = table, call()
    launches `want` first."""
    from uccl_moe import tuning

    for knob, table, want in cases:
        monkeypatch.setattr(tuning, table_attr, table)
        if knob is None:
            monkeypatch.delenv(var, raising=False)
        else:
            monkeypatch.setenv(var, knob)
        calls.clear()
        call()
        assert calls[0][0] == want, (var, knob, table)


def _two_rank_handle(T: int, rows: int, L: int) -> DispatchHandle:
    """A 2-rank handle of T tokens and `rows` received rows (recv_src_idx 0..rows-1): rank 0 receives 3 rows from
    itself and 2 from rank 1, rank 1 receives 4 from rank 0 and 3 from itself."""
    R = 2
    return DispatchHandle(rank_prefix_matrix=torch.tensor([[3, 4], [5, 7]], dtype=torch.int32),
                          channel_prefix_matrix=torch.zeros((R, L), dtype=torch.int32),
                          recv_channel_prefix_matrix=torch.zeros((R, L), dtype=torch.int32),
                          recv_src_idx=torch.arange(rows, dtype=torch.int32),
                          is_token_in_rank=torch.ones((T, R), dtype=torch.bool),
                          send_head=torch.zeros((T, R), dtype=torch.int32))


@pytestmark_kernels
def test_a_staged_combine_copies_the_other_ranks_rows_then_pulls_with_our_rows_in_x(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """UCCL_MOE_COMBINE_STAGED=1: a caller's tensor whose rows fit the buffer is combined by the stage kernel (x, the
    rows to hold, the handle's rank prefix) followed by the pull with own_x = x, not by the ring combine. The rows to
    hold are the most any rank received from other ranks where notify published it (so a buffer too small for every
    received row may still stage), else the handle's rows. 0, or rows that do not fit, take the ring; auto stages at
    the EP sizes of tuning.STAGED_COMBINE only (the GPU suite checks the bits)."""
    from uccl_moe.backends import native

    calls: list[tuple[str, Any]] = []
    monkeypatch.setattr(native._C, "combine_intranode", lambda rt, geo, args, stream: calls.append(("ring", args)))
    monkeypatch.setattr(native._C, "combine_pull_intranode",
                        lambda rt, num_sms, num_rows, args, stream: calls.append(("pull", (num_sms, num_rows, args))))
    monkeypatch.setattr(native._C, "stage_combine_rows_intranode",
                        lambda rt, x, hidden, num_rows, rank_prefix, stream:
                        calls.append(("stage", (x, hidden, num_rows, rank_prefix))))
    R, T, H, K, rows = 2, 5, 64, 2, 7
    backend = _fake_backend(R, rows)
    backend.ctx = SimpleNamespace(num_nvl_bytes=2 << 20)  # the meta region (1 MiB), then the rows
    L = _C.intranode_placed_geometry(24, R, 8, 256, 1 << 30).num_lanes
    h = _two_rank_handle(T, rows, L)
    cfg = Config(24, 8, 256, 6, 128)
    y = torch.ones((rows, H), dtype=torch.bfloat16)
    w = torch.ones((rows, K))
    monkeypatch.setenv("UCCL_MOE_COMBINE_STAGED", "1")
    out, out_w = backend.combine(y, h, w, (None, None), cfg)
    (op1, stage), (op2, (num_sms, num_rows, pull)) = calls
    assert (op1, op2) == ("stage", "pull")
    assert stage == (_ptr(y), H, rows, _ptr(h.rank_prefix_matrix))
    assert (num_sms, num_rows) == (24, rows)
    assert (pull.staged, pull.own_x, pull.topk_weights, pull.out, pull.out_topk_weights) == (
        1, _ptr(y), _ptr(w), _ptr(out), _ptr(out_w))
    assert (pull.num_tokens, pull.hidden, pull.num_topk, pull.num_lanes) == (T, H, K, L)
    assert (pull.rank_prefix, pull.lane_prefix, pull.send_head) == (
        _ptr(h.rank_prefix_matrix), _ptr(h.channel_prefix_matrix), _ptr(h.send_head))

    calls.clear()
    backend.ctx = SimpleNamespace(num_nvl_bytes=1 << 20)  # the rows do not fit: the ring, on every rank alike
    backend.combine(y, h, w, (None, None), cfg)
    assert [op for op, _ in calls] == ["ring"]
    calls.clear()
    backend.ctx = SimpleNamespace(num_nvl_bytes=2 << 20)
    monkeypatch.setenv("UCCL_MOE_COMBINE_STAGED", "0")
    backend.combine(y, h, w, (None, None), cfg)
    assert [op for op, _ in calls] == ["ring"]

    # notify's count of the rows from other ranks: the buffer holds only those (3 rows + their weights)
    setattr(h.rank_prefix_matrix, native._MOST_REMOTE_ATTR, 3)
    backend.ctx = SimpleNamespace(num_nvl_bytes=int(_C.intranode_combine_input_layout(3, H, K)[1]))
    assert int(_C.intranode_combine_input_layout(rows, H, K)[1]) > backend.ctx.num_nvl_bytes
    for knob, ranks, want in (("1", 2, "stage"), ("auto", 2, "stage"), ("auto", 3, "ring"), ("0", 2, "ring"),
                              (None, 2, "stage"), (None, 3, "ring")):  # the default: auto
        calls.clear()
        if knob is None:
            monkeypatch.delenv("UCCL_MOE_COMBINE_STAGED", raising=False)
        else:
            monkeypatch.setenv("UCCL_MOE_COMBINE_STAGED", knob)
        monkeypatch.setattr(backend, "R", ranks)
        backend.combine(y, h, w, (None, None), cfg)
        assert calls[0][0] == want, (knob, ranks)
        if want == "stage":
            assert calls[0][1][2] == 3 and calls[1][1][1] == 3  # stage and pull hold 3 rows
    # A rank that received no rows passes an empty x (data_ptr 0) and must still read the peers' buffers compacted.
    calls.clear()
    monkeypatch.setenv("UCCL_MOE_COMBINE_STAGED", "1")
    backend.combine(torch.empty((0, H), dtype=torch.bfloat16), h, torch.empty((0, K)), (None, None), cfg)
    (op1, _), (op2, (_, num_rows, pull)) = calls
    assert (op1, op2, num_rows, pull.staged, pull.own_x) == ("stage", "pull", 3, 1, 0)
    assert backend.combine_staged_fits(h, H, K) and not backend.combine_staged_fits(h, H, K + 64)
    monkeypatch.setenv("UCCL_MOE_COMBINE_STAGED", "yes")
    with pytest.raises(_C_error(), match="UCCL_MOE_COMBINE_STAGED"):
        backend.combine(y, h, w, (None, None), cfg)


@pytestmark_kernels
def test_a_ce_combine_hands_the_host_rank_prefix_and_its_chunks_to_the_copy_engine_launch(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """UCCL_MOE_COMBINE_CE=1: a caller's tensor is combined by combine_ce_intranode with the rank prefix notify
    published to the host (a non-cached dispatch stores it on the handle), own_x = x and UCCL_MOE_COMBINE_CE_CHUNKS
    chunks, before any staged or ring path. A handle without host counts (num_worst_tokens, or a cloned rank_prefix)
    or a landing area that does not fit every buffer falls back to the staged path or the rings, alike on every
    rank; auto takes the copy engines at the EP sizes of tuning.CE_COMBINE only (the GPU suite checks the bits)."""
    from uccl_moe.backends import native

    calls: list[tuple[str, Any]] = []
    monkeypatch.setattr(native._C, "combine_intranode", lambda rt, geo, args, stream: calls.append(("ring", args)))
    monkeypatch.setattr(native._C, "combine_pull_intranode",
                        lambda rt, num_sms, num_rows, args, stream: calls.append(("pull", args)))
    monkeypatch.setattr(native._C, "stage_combine_rows_intranode", lambda *a: calls.append(("stage", a)))
    monkeypatch.setattr(native._C, "combine_ce_intranode",  # outputs: allocated late (LateOutputs), at the kernel
                        lambda rt, num_sms, args, rank_prefix, early, stream, outputs, poll, beside: calls.append(
                            ("ce", (num_sms, args, rank_prefix, early, outputs(), poll, beside))))
    R, T, H, K, rows = 2, 5, 64, 2, 7
    backend = _fake_backend(R, rows)
    backend.ctx = SimpleNamespace(num_nvl_bytes=2 << 20)
    L = _C.intranode_placed_geometry(24, R, 8, 256, 1 << 30).num_lanes
    # rank 0 receives 3 rows from itself and 2 from rank 1; rank 1 receives 4 from rank 0 and 3 from itself
    h = _two_rank_handle(T, rows, L)
    cfg = Config(24, 8, 256, 6, 128)
    y, w = torch.ones((rows, H), dtype=torch.bfloat16), torch.ones((rows, K))
    monkeypatch.setenv("UCCL_MOE_COMBINE_CE", "1")
    monkeypatch.setenv("UCCL_MOE_COMBINE_STAGED", "1")
    backend.combine(y, h, w, (None, None), cfg)
    assert [op for op, _ in calls] == ["stage", "pull"]  # no host counts on this handle: staged
    assert not backend.combine_ce_fits(h, H, K)

    setattr(h.rank_prefix_matrix, native._RANK_PREFIX_HOST_ATTR, [3, 4, 5, 7])
    # the largest landing area: rank 0 sent 4 rows to rank 1 (rank 1 sent 2 to rank 0)
    assert _C.intranode_ce_landing_bytes([3, 4, 5, 7], H, K) == _C.intranode_combine_input_layout(4, H, K)[1]
    calls.clear()
    out, out_w = backend.combine(y, h, w, (None, None), cfg)
    [(op, (num_sms, ce, rank_prefix, early, late, poll, beside))] = calls
    assert (op, num_sms, rank_prefix, early) == ("ce", 24, [3, 4, 5, 7], True)  # UCCL_MOE_CE_EARLY's default
    assert poll is True  # UCCL_MOE_CE_POLL's default (the runtime turns it off where a graph captures)
    assert beside is True  # UCCL_MOE_CE_END_BESIDE's default (the runtime ends only gated ops beside)
    assert (ce.staged, ce.own_x, ce.ce_chunks, ce.topk_weights, ce.out, ce.out_topk_weights) == (
        1, _ptr(y), 4, _ptr(w), 0, 0)  # the outputs come from the callback, once the first copies are enqueued
    assert late == (_ptr(out), _ptr(out_w)) and out.shape == (T, H) and out_w.shape == (T, K)
    assert (ce.num_tokens, ce.hidden, ce.num_topk, ce.num_lanes) == (T, H, K, L)
    assert (ce.rank_prefix, ce.lane_prefix, ce.send_head) == (
        _ptr(h.rank_prefix_matrix), _ptr(h.channel_prefix_matrix), _ptr(h.send_head))
    assert backend.combine_ce_fits(h, H, K)
    monkeypatch.setenv("UCCL_MOE_COMBINE_CE_CHUNKS", "2")
    calls.clear()
    backend.combine(y, h, w, (None, None), cfg)
    assert calls[0][1][1].ce_chunks == 2
    monkeypatch.setenv("UCCL_MOE_CE_EARLY", "0")
    calls.clear()
    backend.combine(y, h, w, (None, None), cfg)
    assert calls[0][1][3] is False
    monkeypatch.delenv("UCCL_MOE_CE_EARLY")
    monkeypatch.setenv("UCCL_MOE_CE_POLL", "0")
    calls.clear()
    backend.combine(y, h, w, (None, None), cfg)
    assert calls[0][1][5] is False
    monkeypatch.delenv("UCCL_MOE_CE_POLL")
    monkeypatch.setenv("UCCL_MOE_CE_END_BESIDE", "0")
    calls.clear()
    backend.combine(y, h, w, (None, None), cfg)
    assert calls[0][1][6] is False
    monkeypatch.delenv("UCCL_MOE_CE_END_BESIDE")
    monkeypatch.setenv("UCCL_MOE_COMBINE_CE_CHUNKS", "9")  # more than the meta region's ce_ready words
    with pytest.raises(_C_error(), match="UCCL_MOE_COMBINE_CE_CHUNKS"):
        backend.combine(y, h, w, (None, None), cfg)
    monkeypatch.delenv("UCCL_MOE_COMBINE_CE_CHUNKS")

    # a landing area over the buffer: every rank computes the same largest area, so every rank falls back alike
    backend.ctx = SimpleNamespace(num_nvl_bytes=int(_C.intranode_ce_landing_bytes([3, 4, 5, 7], H, K)) - 1)
    assert not backend.combine_ce_fits(h, H, K)
    calls.clear()
    backend.combine(y, h, w, (None, None), cfg)
    assert calls[0][0] != "ce"
    backend.ctx = SimpleNamespace(num_nvl_bytes=2 << 20)
    _check_auto_knob(monkeypatch, "UCCL_MOE_COMBINE_CE", "CE_COMBINE", calls,
                     lambda: backend.combine(y, h, w, (None, None), cfg),
                     (("auto", {}, "stage"), ("auto", {2: "measured"}, "ce"), ("0", {2: "measured"}, "stage"),
                      (None, {2: "measured"}, "ce")))  # None: unset, the default auto
    monkeypatch.setenv("UCCL_MOE_COMBINE_CE", "yes")
    with pytest.raises(_C_error(), match="UCCL_MOE_COMBINE_CE"):
        backend.combine(y, h, w, (None, None), cfg)
    with pytest.raises(_C_error(), match="not an \\[N, N\\] matrix"):
        _C.intranode_ce_landing_bytes([1, 2, 3], H, K)


def test_the_dispatch_polls_except_with_one_hardware_queue(monkeypatch: pytest.MonkeyPatch) -> None:
    """UCCL_MOE_DISPATCH_CE_POLL=auto (the default) polls except where CUDA_DEVICE_MAX_CONNECTIONS=1 (HIP:
    GPU_MAX_HW_QUEUES=1); 1 and 0 force."""
    from uccl_moe import tuning

    monkeypatch.setattr(tuning._C, "gpu_backend", lambda: "cuda")
    for knob, environ, want in (("auto", {}, True), ("auto", {"CUDA_DEVICE_MAX_CONNECTIONS": "8"}, True),
                                ("auto", {"CUDA_DEVICE_MAX_CONNECTIONS": " 1 "}, False),
                                ("1", {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}, True), ("0", {}, False)):
        assert tuning.dispatch_ce_poll(knob, environ) is want, (knob, environ)
    assert tuning.dispatch_ce_poll("auto", {"GPU_MAX_HW_QUEUES": "1"}) is True
    with pytest.MonkeyPatch.context() as mp:  # HIP: the ROCm runtime's own variable
        mp.setattr(tuning._C, "gpu_backend", lambda: "hip")
        assert tuning.dispatch_ce_poll("auto", {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}) is True
        assert tuning.dispatch_ce_poll("auto", {"GPU_MAX_HW_QUEUES": "1"}) is False
    tuning.one_hardware_queue.cache_clear()
    try:
        with pytest.MonkeyPatch.context() as mp:  # the process's own environment, read once (the driver's context)
            mp.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
            assert tuning.dispatch_ce_poll("auto") is False
            mp.delenv("CUDA_DEVICE_MAX_CONNECTIONS")
            assert tuning.dispatch_ce_poll("auto") is False  # the context keeps the queue it was made with
    finally:
        tuning.one_hardware_queue.cache_clear()


@pytestmark_kernels
def test_a_ce_dispatch_gathers_along_the_handle_with_the_host_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    """UCCL_MOE_DISPATCH_CE=1: a cached dispatch is launched by dispatch_ce_intranode with the handle's recv_src_idx
    (read), notify's host rank prefix and token counts and UCCL_MOE_DISPATCH_CE_CHUNKS chunks; scales that are neither
    dense row- nor column-major are made contiguous first (the engines move them as one block). A handle without host
    counts or an x that does not fit every other rank's buffer takes the rings, alike on every rank; auto takes the
    copy engines at the EP sizes of tuning.CE_DISPATCH only, and only where every rank sends at least
    tuning.CE_DISPATCH_MIN_SENT of its tokens to every other (the GPU suite checks the bits)."""
    from uccl_moe import tuning

    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)  # several hardware queues: polled by default
    tuning.one_hardware_queue.cache_clear()
    from uccl_moe.backends import _buffer_paths, native

    assert 2 in tuning.CE_DISPATCH and 0.7 <= tuning.CE_DISPATCH_MIN_SENT <= 1.0  # the shipped table: EP2 measured
    calls: list[tuple[str, Any]] = []
    monkeypatch.setattr(native._C, "dispatch_intranode", lambda rt, geo, args, stream: calls.append(("ring", args)))
    monkeypatch.setattr(native._C, "dispatch_ce_intranode", lambda rt, num_sms, args, rank_prefix, tokens, chunks,
                        early, stream, outputs, poll, beside: calls.append(
                            ("ce", (num_sms, args, rank_prefix, tokens, chunks, early, outputs(), poll, beside))))
    R, T, H, rows = 2, 5, 128, 7
    backend = _fake_backend(R, rows)
    backend.ctx = SimpleNamespace(num_nvl_bytes=2 << 20)
    L = _C.intranode_placed_geometry(24, R, 8, 256, 1 << 30).num_lanes
    h = _two_rank_handle(T, rows, L)
    cfg = Config(24, 8, 256, 6, 128)
    x = torch.zeros((T, H), dtype=torch.float8_e4m3fn)
    col = torch.rand((1, T)).T  # [T, 1] column-major; with one scale it is row-major too
    monkeypatch.setenv("UCCL_MOE_DISPATCH_CE", "1")
    backend.cached_dispatch(x, col, h, cfg)
    assert [op for op, _ in calls] == ["ring"] and not backend.dispatch_ce_fits(h, H, 1)  # no host counts
    setattr(h.rank_prefix_matrix, native._RANK_PREFIX_HOST_ATTR, [3, 4, 5, 7])
    setattr(h.rank_prefix_matrix, native._RANK_TOKENS_HOST_ATTR, [T, 6])
    assert backend.dispatch_ce_fits(h, H, 1)
    calls.clear()
    scales = torch.rand((2, T)).T  # [T, 2] column-major
    recv_x, recv_s = backend.cached_dispatch(x, scales, h, cfg)
    [(op, (num_sms, a, rank_prefix, tokens, chunks, early, late, poll, beside))] = calls
    assert (op, num_sms, rank_prefix, tokens, chunks, early, beside) == ("ce", 24, [3, 4, 5, 7], [T, 6], 3, True, True)
    assert poll is True  # UCCL_MOE_DISPATCH_CE_POLL's default (polled and early behind the gate measured faster)
    assert (a.x, a.x_scales, a.num_tokens, a.row_bytes, a.num_scales) == (_ptr(x), _ptr(scales), T, H, 2)
    assert (a.scale_token_stride, a.scale_hidden_stride) == (1, T)
    assert (a.recv_src_idx, a.recv_x, a.recv_scales, a.num_recv_rows) == (_ptr(h.recv_src_idx), 0, 0, rows)
    assert late == (_ptr(recv_x), _ptr(recv_s))  # allocated by the callback (LateOutputs)
    assert recv_x.shape == (rows, H) and recv_x.dtype == x.dtype and recv_s.shape == (rows, 2)
    calls.clear()
    odd = torch.rand((T, 4))[:, ::2]  # strides (4, 2): neither layout
    backend.cached_dispatch(x, odd, h, cfg)
    a = calls[0][1][1]
    assert (a.scale_token_stride, a.scale_hidden_stride) == (2, 1) and a.x_scales != _ptr(odd)
    monkeypatch.setenv("UCCL_MOE_DISPATCH_CE_CHUNKS", "2")
    calls.clear()
    backend.cached_dispatch(x, scales, h, cfg)
    assert calls[0][1][4] == 2
    monkeypatch.delenv("UCCL_MOE_DISPATCH_CE_CHUNKS")
    monkeypatch.setenv("UCCL_MOE_CE_EARLY", "off")
    calls.clear()
    backend.cached_dispatch(x, scales, h, cfg)
    assert calls[0][1][5] is False
    monkeypatch.delenv("UCCL_MOE_CE_EARLY")
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # one hardware queue: auto takes the chunk flags
    tuning.one_hardware_queue.cache_clear()  # as if the driver had made the context now
    calls.clear()
    backend.cached_dispatch(x, scales, h, cfg)
    assert calls[0][1][7] is False
    monkeypatch.setenv("UCCL_MOE_DISPATCH_CE_POLL", "1")  # unless asked for
    calls.clear()
    backend.cached_dispatch(x, scales, h, cfg)
    assert calls[0][1][7] is True
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS")
    tuning.one_hardware_queue.cache_clear()
    monkeypatch.setenv("UCCL_MOE_DISPATCH_CE_POLL", "0")
    calls.clear()
    backend.cached_dispatch(x, scales, h, cfg)
    assert calls[0][1][7] is False
    monkeypatch.delenv("UCCL_MOE_DISPATCH_CE_POLL")
    monkeypatch.setenv("UCCL_MOE_CE_END_BESIDE", "0")
    calls.clear()
    backend.cached_dispatch(x, scales, h, cfg)
    assert calls[0][1][8] is False
    monkeypatch.delenv("UCCL_MOE_CE_END_BESIDE")
    # the largest landing area over the buffer: every rank computes the same one and takes the rings
    need = int(_C.intranode_ce_dispatch_landing_bytes([T, 6], H, 2))
    assert need == int(_C.intranode_ce_dispatch_landing_bytes([6, T], H, 2))
    backend.ctx = SimpleNamespace(num_nvl_bytes=need - 1)
    calls.clear()
    backend.cached_dispatch(x, scales, h, cfg)
    assert [op for op, _ in calls] == ["ring"]
    backend.ctx = SimpleNamespace(num_nvl_bytes=2 << 20)
    # This handle's rank 1 sends 2 of its 6 tokens to rank 0: auto keeps the rings even where EP2 was measured.
    assert tuning.least_sent_share([3, 4, 5, 7], [T, 6]) == pytest.approx(2 / 6)
    _check_auto_knob(monkeypatch, "UCCL_MOE_DISPATCH_CE", "CE_DISPATCH", calls,
                     lambda: backend.cached_dispatch(x, scales, h, cfg),
                     (("auto", {2: "measured"}, "ring"), ("1", {}, "ce"), (None, {2: "measured"}, "ring")))
    # Every token to the peer both ways (DeepSeek-V3's routing at EP2): auto takes the copy engines where measured.
    setattr(h.rank_prefix_matrix, native._RANK_PREFIX_HOST_ATTR, [3, 5, 9, 11])
    delattr(h.rank_prefix_matrix, _buffer_paths._CE_DISPATCH_FIT_ATTR)  # answered once per handle: forget it
    assert tuning.least_sent_share([3, 5, 9, 11], [T, 6]) == 1.0
    _check_auto_knob(monkeypatch, "UCCL_MOE_DISPATCH_CE", "CE_DISPATCH", calls,
                     lambda: backend.cached_dispatch(x, scales, h, cfg),
                     (("auto", {}, "ring"), ("auto", {2: "measured"}, "ce"), ("0", {2: "measured"}, "ring"),
                      (None, {2: "measured"}, "ce")))  # None: unset, the default auto


def test_least_sent_share_reads_the_inclusive_rank_prefix() -> None:
    """The least share of its tokens a rank sends to another (what UCCL_MOE_DISPATCH_CE=auto asks of a handle): rows
    from the inclusive-over-sources prefix, a rank with no tokens left out, 1.0 with one rank."""
    from uccl_moe import tuning

    # 3 ranks of 10, 4 and 0 tokens; [s][d] counts the rows d gets from sources 0..s
    prefix = [10, 9, 7,
              12, 13, 9,
              12, 13, 9]
    assert tuning.least_sent_share(prefix, [10, 4, 0]) == pytest.approx(min(9 / 10, 7 / 10, 2 / 4, 2 / 4))
    assert tuning.least_sent_share([5], [5]) == 1.0
    assert tuning.dispatch_ce(2, "auto", 0.95) == (2 in tuning.CE_DISPATCH)
    assert not tuning.dispatch_ce(2, "auto", tuning.CE_DISPATCH_MIN_SENT - 0.01)
    assert tuning.dispatch_ce(2, "1", 0.0) and not tuning.dispatch_ce(2, "0", 1.0)


@pytestmark_kernels
def test_dispatch_keeps_the_host_rank_prefix_on_the_handle(monkeypatch: pytest.MonkeyPatch) -> None:
    """A non-cached dispatch without num_worst_tokens stores notify's host copy of the rank prefix on the handle's
    rank_prefix tensor (what a copy-engine combine sizes its copies by); a num_worst_tokens one has none."""
    import dataclasses

    from uccl_moe.backends import native

    for op in ("notify_dispatch", "dispatch_intranode"):
        monkeypatch.setattr(native._C, op, lambda rt, geo, args, stream: None)
    R, T, H, K, E, rows = 2, 5, 64, 2, 4, 7
    backend = _fake_backend(R, rows)
    req = _request(torch.zeros((T, H), dtype=torch.bfloat16), R, K, E, Config(24, 8, 256, 6, 128))
    h = backend.dispatch(req)[5]
    assert getattr(h.rank_prefix_matrix, native._RANK_PREFIX_HOST_ATTR) == [1, 2, 3, 4]  # the fake's matrix
    assert getattr(h.rank_prefix_matrix, native._RANK_TOKENS_HOST_ATTR) == [5, 6]
    h = backend.dispatch(dataclasses.replace(req, num_worst_tokens=9))[5]
    assert not hasattr(h.rank_prefix_matrix, native._RANK_PREFIX_HOST_ATTR)


@pytest.mark.gpu
def test_ops_run_on_the_runtimes_geometry_and_refuse_one_placed_for_another_buffer() -> None:
    """NvlRuntime.geometry is the placed geometry plus the GPU's SM check; a launch handed a geometry placed for another
    buffer size refuses before any kernel runs (one rank, one GPU)."""
    from uccl_moe.errors import InvalidUsageError

    big, small = _C.NvlRuntime(0, 1, 64 << 20, 0), _C.NvlRuntime(0, 1, 32 << 20, 0)
    try:
        for rt in (big, small):
            rt.connect([rt.ipc_handle()])
        g = big.geometry(24, 8, 256)
        want = _C.intranode_placed_geometry(24, 1, 8, 256, 64 << 20)
        assert repr(g) == repr(want) and (g.num_ranks, g.num_nvl_bytes) == (1, 64 << 20)
        with pytest.raises(InvalidUsageError, match="exceeds the"):
            big.geometry(100_000, 8, 256)
        stream = torch.cuda.current_stream().cuda_stream
        with pytest.raises(InvalidUsageError, match=r"notify: the lane geometry was placed for 1 ranks and 33554432"):
            _C.notify_dispatch(big, small.geometry(24, 8, 256), _C.NotifyArgs(num_experts=1), stream)
        with pytest.raises(InvalidUsageError, match=r"placed for 1 ranks and 33554432"):
            _C.dispatch_intranode(big, small.geometry(24, 8, 256), _C.DispatchArgs(row_bytes=16), stream)
        with pytest.raises(InvalidUsageError, match=r"placed for 1 ranks and 33554432"):
            _C.combine_intranode(big, small.geometry(24, 8, 256), _C.CombineArgs(hidden=8), stream)
        torch.cuda.synchronize()
    finally:
        big.destroy()
        small.destroy()


@pytest.mark.skipif(not hasattr(_C, "PackArgs"), reason="build without internode kernels")
def test_internode_stage_packs_by_field_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """InternodePath._stage hands rdma_pack one PackArgs built by field name from the plan, plus the row sizes its
    RDMA layout is computed from (the proxy legs are fakes: no GPU, no proxy)."""
    from uccl_moe.backends.internode import InternodePath, rdma_bytes_for

    calls: list[tuple[Any, ...]] = []
    monkeypatch.setattr(_C, "rdma_pack", lambda *a: calls.append(a))
    monkeypatch.setattr(_C, "rdma_post", lambda **kw: None)
    monkeypatch.setattr(_C, "rdma_wait", lambda **kw: None)
    path = object.__new__(InternodePath)
    path.ctx = SimpleNamespace(num_rdma_bytes=rdma_bytes_for(64, 128, 2, 2))
    path.G, path.timeline, path.rt = 1, None, object()
    path.backend = SimpleNamespace(_stream=lambda: 7, _rt=object())
    T, H, K = 3, 128, 2
    plan = SimpleNamespace(send_pos=torch.zeros((T, 2), dtype=torch.int32), pack_dst_row=torch.zeros(2),
                           send_rows=torch.zeros(2), send_row0=torch.zeros(2), peer_row0=torch.zeros(2))
    x, idx, w = torch.zeros((T, H), dtype=torch.bfloat16), torch.zeros((T, K), dtype=torch.int64), torch.zeros((T, K))
    in_rank = torch.ones((T, 2), dtype=torch.bool)
    lay = path._stage(plan, x, None, idx, w, in_rank, 8, barrier=False)  # type: ignore[arg-type]
    (rt, nvl, pack, row_bytes, num_scales, num_topk, stream), = calls
    assert (rt, nvl, stream) == (path.rt, path.backend._rt, 7)
    assert (row_bytes, num_scales, num_topk) == (H * 2, 0, K) and lay == path._dispatch_layout(H * 2, 0, K)
    assert (pack.x, pack.topk_idx, pack.topk_weights, pack.is_token_in_rank, pack.send_pos, pack.dst_row) == \
        (_ptr(x), _ptr(idx), _ptr(w), _ptr(in_rank), _ptr(plan.send_pos), _ptr(plan.pack_dst_row))
    assert (pack.num_tokens, pack.num_experts, pack.x_scales) == (T, 8, 0)


@pytestmark_kernels
def test_the_ce_combine_fit_is_answered_once_per_handle_and_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every combine of a handle asks whether the copy-engine combine fits; the answer is kept on the handle's
    rank_prefix for its (hidden, top-k, buffer size) and computed again when one of them changes."""
    from uccl_moe.backends import native

    asked: list[tuple[int, int]] = []
    real = native._C.intranode_ce_landing_bytes
    monkeypatch.setattr(native._C, "intranode_ce_landing_bytes",
                        lambda rp, hidden, k: asked.append((hidden, k)) or real(rp, hidden, k))
    backend = _fake_backend(2, 7)
    backend.ctx = SimpleNamespace(num_nvl_bytes=2 << 20)
    h = _two_rank_handle(5, 7, _C.intranode_placed_geometry(24, 2, 8, 256, 1 << 30).num_lanes)
    setattr(h.rank_prefix_matrix, native._RANK_PREFIX_HOST_ATTR, [3, 4, 5, 7])
    assert [backend.combine_ce_fits(h, 64, 2) for _ in range(3)] == [True] * 3 and asked == [(64, 2)]
    assert backend.combine_ce_fits(h, 64, 0) and asked == [(64, 2), (64, 0)]
    backend.ctx = SimpleNamespace(num_nvl_bytes=int(real([3, 4, 5, 7], 64, 0)) - 1)  # another Buffer size
    assert not backend.combine_ce_fits(h, 64, 0) and len(asked) == 3


def test_a_copy_engine_launch_must_ask_for_its_outputs_once() -> None:
    """The copy-engine ops' outputs come from a callback the launch calls once, before its kernel (LateOutputs): a
    launch that returned without calling it (or called it twice) is our bug, named as such, not an IndexError."""
    from uccl_moe.backends import _buffer_paths
    from uccl_moe.errors import InternalError

    out = torch.empty(3)

    def launch(times: int):
        return lambda outputs: [outputs() for _ in range(times)]

    assert _buffer_paths._late_outputs(launch(1), lambda: (out, None), "copy-engine dispatch") == (out, None)
    for times in (0, 2):
        with pytest.raises(InternalError, match=f"copy-engine combine: the native launch asked for its outputs "
                                                f"{times} times"):
            _buffer_paths._late_outputs(launch(times), lambda: (out, None), "copy-engine combine")


def test_a_copy_engine_op_that_does_not_fit_says_how_to_size_the_buffer_once(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Where the knobs and the EP size take a copy-engine op but the landing area does not fit the NVL buffer, the op
    takes the rings and the Buffer says so once per op, naming Buffer.get_copy_engine_buffer_size_hint and the knob
    that turned the op on; nothing where the knob keeps the op off anyway (for the dispatch's auto: where a rank sends
    less than tuning.CE_DISPATCH_MIN_SENT of its tokens to another)."""
    from uccl_moe.backends import native

    H, K = 64, 2
    need = int(_C.intranode_ce_landing_bytes([3, 4, 5, 7], H, K))
    backend = _fake_backend(2, 7)
    backend.ctx = SimpleNamespace(num_nvl_bytes=need - 1)
    lanes = _C.intranode_placed_geometry(24, 2, 8, 256, 1 << 30).num_lanes

    def handle(tokens: tuple[int, int] = (5, 5)) -> DispatchHandle:
        h = _two_rank_handle(5, 7, lanes)
        setattr(h.rank_prefix_matrix, native._RANK_PREFIX_HOST_ATTR, [3, 4, 5, 7])
        setattr(h.rank_prefix_matrix, native._RANK_TOKENS_HOST_ATTR, list(tokens))
        return h

    def said() -> list[str]:
        return [r.getMessage() for r in caplog.records if "get_copy_engine_buffer_size_hint" in r.getMessage()]

    monkeypatch.setenv("UCCL_MOE_COMBINE_CE", "0")
    with caplog.at_level("WARNING", logger="uccl_moe.buffer"):
        assert not backend.combine_ce_fits(handle(), H, K)
    assert said() == []
    monkeypatch.setenv("UCCL_MOE_COMBINE_CE", "1")
    with caplog.at_level("WARNING", logger="uccl_moe.buffer"):
        assert not backend.combine_ce_fits(handle(), H, K)
        assert not backend.combine_ce_fits(handle(), H, K)  # a new handle: answered again, said once
    [msg] = said()
    assert "copy-engine combine (on at EP2 with UCCL_MOE_COMBINE_CE=1" in msg and "runs on the rings" in msg
    assert f"get_copy_engine_buffer_size_hint(tokens_per_rank, {H}, 2, {K})" in msg
    assert f"{need / 2**20:.1f} MiB" in msg
    assert f"UCCL_MOE_NVL_BYTES_MIN={-(-need >> 20) << 20} (this batch's need)" in msg  # a whole MiB, rounded up
    # the dispatch of the same Buffer speaks for itself; FP8 rows name the hidden size, not half the row bytes. auto
    # at EP2 takes it only where every rank sends at least 0.9 of its tokens to the other: rank 1 sends 2 of 5 here
    backend.ctx = SimpleNamespace(num_nvl_bytes=1)
    monkeypatch.delenv("UCCL_MOE_DISPATCH_CE", raising=False)
    caplog.clear()
    with caplog.at_level("WARNING", logger="uccl_moe.buffer"):
        assert not backend.dispatch_ce_fits(handle(), 128, 1)
        assert said() == []
        monkeypatch.setenv("UCCL_MOE_DISPATCH_CE", "1")
        assert not backend.dispatch_ce_fits(handle((5, 6)), 128, 1)  # other counts: answered again
    [msg] = said()
    assert "copy-engine cached dispatch (on at EP2 with UCCL_MOE_DISPATCH_CE=1" in msg
    assert "get_copy_engine_buffer_size_hint(tokens_per_rank, 128, 2, 0)" in msg
