"""Register ``--moe-token-dispatcher-type uccl`` in an unmodified Megatron-Core / Megatron-LM (no fork).

:func:`install` (idempotent; ``import uccl_moe.megatron`` calls it) patches, at the Python level:

1. ``TransformerConfig``: ``moe_token_dispatcher_type="uccl"`` passes ``__post_init__`` (validated like ``alltoall``,
   the dispatcher whose feature gates fit ours, so ``moe_shared_expert_overlap`` is allowed), after uccl's own checks
   reject the features it does not implement. The field's ``Literal`` gains ``"uccl"``.
2. ``MoELayer.__init__``: for "uccl" the layer is built as for "allgather" (whose constructor does no comm), then its
   ``token_dispatcher`` is replaced by :class:`~uccl_moe.megatron.dispatcher.UCCLTokenDispatcher`.
3. ``megatron.training.arguments.add_megatron_arguments`` (when ``megatron.training`` is importable; the <= 0.16
   wheels do not ship it): the ``--moe-token-dispatcher-type`` choices gain ``uccl`` and the ``--moe-uccl-*`` knobs
   (see :mod:`uccl_moe.megatron.knobs`) are added.

On a host without CUDA it also applies :mod:`uccl_moe.megatron.cpu` (never on a GPU host).
Any other unknown dispatcher type still fails exactly as before.
"""

from __future__ import annotations

import functools
import inspect
import logging
import threading
import typing
from typing import Any

import torch

from ..errors import InvalidUsageError
from . import _compat
from . import knobs as _knobs
from .dispatcher import DISPATCHER_TYPE

log = logging.getLogger("uccl_moe.megatron")

_PATCHED = "__uccl_moe_patched__"
_LOCK = threading.Lock()
_installed = False

# Megatron features the uccl dispatcher does not implement (refused when truthy), with the reason and the fix.
# Supported (docs/megatron.md has the whole table): --overlap-moe-expert-parallel-comm and --delay-wgrad-compute
# (Megatron's 1F1B EP overlap calls the six methods from separate schedule nodes; see UCCLTokenDispatcher),
# --moe-router-padding-for-quantization (dispatch_postprocess pads each local expert's rows) and --moe-latent-size
# (the dispatcher moves rows of whatever width MoELayer hands it, here the latent projection's).
_UNSUPPORTED: tuple[tuple[str, str], ...] = (
    (
        "moe_pad_expert_input_to_capacity",
        "--moe-pad-expert-input-to-capacity is not supported with --moe-token-dispatcher-type uccl (like flex/DeepEP): "
        "each expert gets its routed rows, not a fixed capacity; use --moe-expert-capacity-factor alone (dropped "
        "tokens are skipped, not padded)",
    ),
)


def validate_config(config: Any) -> None:
    """uccl's own checks on a TransformerConfig whose dispatcher type is "uccl"; raises InvalidUsageError."""
    for name, message in _UNSUPPORTED:
        if getattr(config, name, None):
            raise InvalidUsageError(f"{name}={getattr(config, name)!r}: {message}")
    if getattr(config, "moe_enable_deepep", False):
        raise InvalidUsageError(
            "moe_enable_deepep=True selects the flex dispatcher's DeepEP backend; it cannot be combined with "
            "--moe-token-dispatcher-type uccl (uccl is the dispatcher): drop --moe-enable-deepep"
        )
    _knobs.resolve(config)


def is_installed() -> bool:
    return _installed


def install() -> None:
    """Make ``moe_token_dispatcher_type="uccl"`` work in the installed Megatron. Safe to call any number of times."""
    global _installed
    with _LOCK:
        if _installed:
            return
        if not torch.cuda.is_available():
            from . import cpu

            cpu.apply()
        _patch_transformer_config()
        _patch_moe_layer()
        _patch_arguments()
        _installed = True
        log.info("uccl dispatcher registered in megatron-core %s", _compat.megatron_version())


# ----------------------------------------------------------------------------------------------------------------
def _patch_transformer_config() -> None:
    from megatron.core.transformer.transformer_config import TransformerConfig

    field = TransformerConfig.__dataclass_fields__.get("moe_token_dispatcher_type")
    if field is not None:
        args = typing.get_args(field.type)
        if args and DISPATCHER_TYPE not in args:
            widened = typing.Literal[tuple(args) + (DISPATCHER_TYPE,)]  # type: ignore[valid-type]
            field.type = widened
            TransformerConfig.__annotations__["moe_token_dispatcher_type"] = widened

    orig = TransformerConfig.__post_init__
    if getattr(orig, _PATCHED, False):
        return

    @functools.wraps(orig)
    def __post_init__(self: Any) -> None:
        if getattr(self, "moe_token_dispatcher_type", None) != DISPATCHER_TYPE:
            return orig(self)
        validate_config(self)
        # Megatron's own validation, with the feature gates of the alltoall dispatcher (ours need the same ones).
        self.moe_token_dispatcher_type = "alltoall"
        try:
            orig(self)
        finally:
            self.moe_token_dispatcher_type = DISPATCHER_TYPE

    setattr(__post_init__, _PATCHED, True)
    TransformerConfig.__post_init__ = __post_init__  # type: ignore[method-assign]


def _patch_moe_layer() -> None:
    from megatron.core.transformer.moe import moe_layer

    cls = moe_layer.MoELayer
    orig = cls.__init__
    if getattr(orig, _PATCHED, False):
        return
    sig = inspect.signature(orig)

    @functools.wraps(orig)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        bound = sig.bind(self, *args, **kwargs)
        config: Any = bound.arguments.get("config")
        if getattr(config, "moe_token_dispatcher_type", None) != DISPATCHER_TYPE:
            return orig(self, *args, **kwargs)
        from .dispatcher import UCCLTokenDispatcher

        # Build everything as for "allgather" (its dispatcher constructor does no comm and allocates nothing) ...
        config.moe_token_dispatcher_type = "allgather"
        try:
            orig(self, *args, **kwargs)
        finally:
            config.moe_token_dispatcher_type = DISPATCHER_TYPE
        # ... then put ours in its place.
        pgc = bound.arguments.get("pg_collection", bound.arguments.get("model_comm_pgs"))
        if pgc is None:
            pgc = getattr(self, "pg_collection", None) or _compat.default_pg_collection()
        old = self.token_dispatcher
        self.token_dispatcher = UCCLTokenDispatcher(
            self.num_local_experts, self.local_expert_indices, config=self.config, pg_collection=pgc
        )
        if getattr(self, "_training_token_dispatcher", None) is old:
            self._training_token_dispatcher = self.token_dispatcher
        if getattr(self, "use_shared_expert", False) and getattr(self, "shared_expert_overlap", False):
            self.token_dispatcher.set_shared_experts(self.shared_experts)

    setattr(__init__, _PATCHED, True)
    cls.__init__ = __init__  # type: ignore[method-assign]


def widen_parser(parser: Any, dest: str = "moe_token_dispatcher_type") -> Any:
    """Add ``uccl`` to the choices of the `dest` option (``--moe-token-dispatcher-type``) of `parser` and add the
    ``--moe-uccl-*`` knobs.

    Usable directly as Megatron's ``extra_args_provider``. Returns the parser.
    """
    for action in parser._actions:
        if action.dest == dest and action.choices is not None:
            if DISPATCHER_TYPE not in action.choices:
                action.choices = list(action.choices) + [DISPATCHER_TYPE]
    _knobs.add_arguments(parser)
    return parser


def _patch_arguments() -> None:
    try:
        from megatron.training import arguments
    except Exception as exc:  # noqa: BLE001 - absent from <= 0.16 wheels; optional deps may fail to import
        log.debug("megatron.training not importable (%s): CLI patch skipped", exc)
        return
    orig = getattr(arguments, "add_megatron_arguments", None)
    if orig is None or getattr(orig, _PATCHED, False):
        return

    @functools.wraps(orig)
    def add_megatron_arguments(parser: Any, *args: Any, **kwargs: Any) -> Any:
        result = orig(parser, *args, **kwargs)
        widen_parser(result if result is not None else parser)
        return result

    setattr(add_megatron_arguments, _PATCHED, True)
    arguments.add_megatron_arguments = add_megatron_arguments


__all__ = ["install", "is_installed", "validate_config", "widen_parser"]
