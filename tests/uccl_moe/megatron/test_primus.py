"""Primus patches: build_args accepts uccl (fp32 router dtype), refuses turbo DeepEP; before_train checks MoELayer.

Primus is not a dependency: its ``register_patch`` decorator and ``PatchContext`` are stood in for by a recorder
with the same call shape, and the patch bodies run on a plain namespace like Megatron's args.
"""

from __future__ import annotations

import types

import pytest

pytest.importorskip("megatron.core", reason='megatron-core is not installed: pip install -e ".[train]"')

from uccl_moe.errors import InvalidUsageError  # noqa: E402
from uccl_moe.megatron import primus  # noqa: E402


def _args(**kw):
    base = dict(moe_token_dispatcher_type="uccl", moe_router_dtype=None, use_turbo_deepep=False,
                moe_enable_deepep=False, overlap_moe_expert_parallel_comm=False)
    base.update(kw)
    return types.SimpleNamespace(**base)


def test_build_args_accepts_uccl_and_sets_fp32():
    a = _args()
    primus.build_args_patch(a)
    assert a.moe_router_dtype == "fp32" and a._uccl_moe_requested
    primus.before_train_patch(a)  # MoELayer builds ours


@pytest.mark.parametrize("kw, match", [(dict(use_turbo_deepep=True), "use_turbo_deepep"),
                                       (dict(moe_enable_deepep=True), "moe_enable_deepep"),
                                       (dict(moe_router_dtype="bf16"), "moe_router_dtype"),
                                       (dict(moe_uccl_backend="fast"), "moe_uccl_backend")])
def test_build_args_refuses(kw, match):
    with pytest.raises(InvalidUsageError, match=match):
        primus.build_args_patch(_args(**kw))


def test_build_args_accepts_ep_overlap():
    a = _args(overlap_moe_expert_parallel_comm=True, delay_wgrad_compute=True)
    primus.build_args_patch(a)
    assert a._uccl_moe_requested


def test_other_dispatchers_untouched_and_switch_detected():
    a = _args(moe_token_dispatcher_type="alltoall", use_turbo_deepep=True)
    primus.build_args_patch(a)
    primus.before_train_patch(a)
    assert a.moe_router_dtype is None
    b = _args()
    primus.build_args_patch(b)
    b.moe_token_dispatcher_type = "flex"  # what Primus-Turbo's DeepEP patch would do
    with pytest.raises(InvalidUsageError, match="changed from uccl"):
        primus.before_train_patch(b)


def test_register_with_primus_registry_shape(monkeypatch):
    recorded = {}

    def register_patch(patch_id, backend, phase, description, condition):
        def deco(fn):
            recorded[patch_id] = (backend, phase, condition, fn)
            return fn
        return deco

    monkeypatch.setattr(primus, "_registered", False)
    assert primus.register(register_patch)
    assert primus.register(register_patch)  # idempotent
    backend, phase, cond, fn = recorded[primus.PATCH_BUILD_ARGS]
    assert (backend, phase) == ("megatron", "build_args")
    assert recorded[primus.PATCH_BEFORE_TRAIN][1] == "before_train"
    ctx = types.SimpleNamespace(extra={"backend_args": _args()})
    assert cond(ctx)
    fn(ctx)
    assert ctx.extra["backend_args"].moe_router_dtype == "fp32"
    assert not cond(types.SimpleNamespace(extra={"backend_args": _args(moe_token_dispatcher_type="flex")}))
    recorded[primus.PATCH_BEFORE_TRAIN][3](ctx)
