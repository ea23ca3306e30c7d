"""Primus patches for ``moe_token_dispatcher_type: uccl`` (AMD Primus wraps Megatron-LM).

Primus copies YAML/CLI values into Megatron's args namespace without argparse's ``choices``, so ``uccl`` reaches
``TransformerConfig`` and ``MoELayer``, which :func:`uccl_moe.megatron.install` teaches to accept it. Two patches
are registered with Primus' patch system (``primus.core.patches.register_patch``):

- ``uccl_moe.megatron.uccl_dispatcher.build_args`` (phase ``build_args``): when the dispatcher type is ``uccl``,
  refuse ``use_turbo_deepep`` and ``moe_enable_deepep`` (they select another dispatcher; Primus-Turbo's patch would
  silently switch the type to ``flex``), set ``moe_router_dtype: fp32`` when unset (top-k weights travel as fp32),
  check the uccl config rules and the ``moe_uccl_*`` knobs, and run :func:`~uccl_moe.megatron.install`.
- ``uccl_moe.megatron.uccl_dispatcher.before_train`` (phase ``before_train``): check that the type is still ``uccl``
  and that MoELayer builds :class:`~uccl_moe.megatron.dispatcher.UCCLTokenDispatcher` for it.

Primus imports only its own patch modules, so use the entry script (:mod:`uccl_moe.megatron.primus_entry`), which
imports this module and then runs Primus' CLI: ``primus-cli direct --script <path of primus_entry.py> -- train
pretrain --config exp.yaml`` with ``moe_token_dispatcher_type: uccl`` in the experiment's overrides.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Optional

from ..errors import InvalidUsageError
from .dispatcher import DISPATCHER_TYPE

log = logging.getLogger("uccl_moe.megatron")

PATCH_BUILD_ARGS = "uccl_moe.megatron.uccl_dispatcher.build_args"
PATCH_BEFORE_TRAIN = "uccl_moe.megatron.uccl_dispatcher.before_train"
_registered = False


def uses_uccl(args: Any) -> bool:
    return getattr(args, "moe_token_dispatcher_type", None) == DISPATCHER_TYPE


def build_args_patch(args: Any) -> None:
    """The ``build_args`` work on Megatron's args namespace (see the module doc). Raises InvalidUsageError."""
    if not uses_uccl(args):
        return
    if getattr(args, "use_turbo_deepep", False):
        raise InvalidUsageError(
            "moe_token_dispatcher_type: uccl cannot be combined with use_turbo_deepep: true (Primus-Turbo's DeepEP "
            "dispatcher would replace it); set use_turbo_deepep: false, or drop moe_token_dispatcher_type: uccl"
        )
    if getattr(args, "moe_enable_deepep", False):
        raise InvalidUsageError(
            "moe_token_dispatcher_type: uccl cannot be combined with moe_enable_deepep: true (that selects the flex "
            "dispatcher's DeepEP backend); set moe_enable_deepep: false"
        )
    dtype = getattr(args, "moe_router_dtype", None)
    if dtype is None:
        args.moe_router_dtype = "fp32"
        log.info("uccl dispatcher: moe_router_dtype set to fp32 (top-k weights travel as float32)")
    elif dtype not in ("fp32", "fp64"):
        raise InvalidUsageError(f"moe_router_dtype={dtype!r} is invalid with the uccl dispatcher: use fp32")
    from . import knobs
    from .install import install

    knobs.resolve(args)
    install()
    args._uccl_moe_requested = True


def before_train_patch(args: Any) -> None:
    """The ``before_train`` check: the dispatcher is still ours and MoELayer will build it."""
    if not uses_uccl(args):
        if getattr(args, "_uccl_moe_requested", False):
            raise InvalidUsageError(
                f"moe_token_dispatcher_type was changed from uccl to {args.moe_token_dispatcher_type!r} by another "
                f"patch (Primus-Turbo's DeepEP patch does this when use_turbo_deepep is true)"
            )
        return
    from megatron.core.transformer.moe import moe_layer

    from .install import _PATCHED, install

    install()
    if not getattr(moe_layer.MoELayer.__init__, _PATCHED, False):
        raise InvalidUsageError(
            "MoELayer does not build the uccl dispatcher: megatron.core.transformer.moe.moe_layer.MoELayer was "
            "replaced after uccl_moe.megatron.install() ran; import uccl_moe.megatron.primus before that patch"
        )
    log.info("uccl dispatcher active for moe_token_dispatcher_type=uccl")


def _primus_args(ctx: Any) -> Any:
    extra = getattr(ctx, "extra", {}) or {}
    for key in ("backend_args", "args"):
        if extra.get(key) is not None:
            return extra[key]
    from primus.core.patches import get_args  # type: ignore[import-not-found]

    return get_args(ctx)


def register(register_patch: Optional[Callable[..., Any]] = None) -> bool:
    """Register both patches with Primus (idempotent). Returns False when Primus is not importable."""
    global _registered
    if _registered:
        return True
    if register_patch is None:
        try:
            from primus.core.patches import register_patch as primus_register_patch  # type: ignore[import-not-found]
        except ImportError:
            return False
        register_patch = primus_register_patch
    assert register_patch is not None

    def wants_uccl(ctx: Any) -> bool:
        return uses_uccl(_primus_args(ctx))

    register_patch(
        PATCH_BUILD_ARGS,
        backend="megatron",
        phase="build_args",
        description="uccl-moe: accept moe_token_dispatcher_type=uccl (fp32 router dtype, no turbo DeepEP)",
        condition=wants_uccl,
    )(lambda ctx: build_args_patch(_primus_args(ctx)))
    register_patch(
        PATCH_BEFORE_TRAIN,
        backend="megatron",
        phase="before_train",
        description="uccl-moe: check MoELayer builds UCCLTokenDispatcher",
        condition=lambda ctx: True,
    )(lambda ctx: before_train_patch(_primus_args(ctx)))
    _registered = True
    return True


__all__ = ["build_args_patch", "before_train_patch", "register", "uses_uccl", "PATCH_BUILD_ARGS", "PATCH_BEFORE_TRAIN"]
