"""The ``moe_uccl_*`` knobs of the Megatron integration: one table used by the CLI, Primus and the dispatcher.

Each knob is looked up, first hit wins, in:
1. an attribute of the ``TransformerConfig`` (set it in code: ``config.moe_uccl_num_sms = 24``);
2. Megatron-LM's parsed args (``--moe-uccl-num-sms 24`` after ``uccl_moe.megatron.install()``, or a Primus
   YAML key ``moe_uccl_num_sms: 24``, which Primus merges into the same namespace);
3. the default below.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Optional

from ..errors import InvalidUsageError
from . import _compat

BACKENDS = ("auto", "native", "reference")
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def parse_bool(text: Any) -> bool:
    """A boolean knob's value: a bool, or one of 1/true/yes/on and 0/false/no/off (any case)."""
    if isinstance(text, bool):
        return text
    word = str(text).strip().lower()
    if word in _TRUE or word in _FALSE:
        return word in _TRUE
    raise InvalidUsageError(f"{text!r} is not a boolean: give one of {'/'.join(_TRUE)} or {'/'.join(_FALSE)}")


@dataclasses.dataclass(frozen=True)
class KnobSpec:
    name: str  # attribute / args dest
    type: Callable[[str], Any]
    default: Any
    help: str

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


KNOBS: tuple[KnobSpec, ...] = (
    KnobSpec(
        "moe_uccl_num_sms",
        int,
        None,
        "SMs (CUs on AMD) the uccl dispatch/combine kernels use; even; default: the Buffer's default (20). "
        "Applies to every uccl Buffer of the process (DeepEP's Buffer.set_num_sms).",
    ),
    KnobSpec(
        "moe_uccl_nvl_bytes",
        int,
        None,
        "bytes of the intranode (NVLink/xGMI) buffer; default: the largest of Config.get_nvl_buffer_size_hint "
        "over the dispatch and combine configs for the layer's hidden size and the TPxEP group size",
    ),
    KnobSpec(
        "moe_uccl_rdma_bytes",
        int,
        None,
        "bytes of the internode (RDMA) buffer; default: the same rule with get_rdma_buffer_size_hint "
        "(0 inside one node)",
    ),
    KnobSpec(
        "moe_uccl_backend",
        str,
        "auto",
        "uccl Buffer backend: auto (native kernels on GPUs, the torch.distributed reference elsewhere), "
        "native, or reference (all_to_all on NCCL/gloo; the correctness oracle)",
    ),
    KnobSpec(
        "moe_uccl_combine_from_buffer",
        parse_bool,
        True,
        "both combines of a layer read their rows from the Buffer's own memory: the unpermute (forward) and the "
        "permute's gradient (backward) are summed there (Buffer.get_combine_buffer) and each rank pulls its tokens' "
        "rows over NVLink, no rings; the NVL buffer grows to hold every row a rank may receive and its top-k weights "
        "(Buffer.get_combine_buffer_size_hint(group size x tokens, hidden, top-k)). Inside one node, unfused "
        "permutes only (--moe-permute-fusion keeps the ring combine); true/false",
    ),
)


@dataclasses.dataclass(frozen=True)
class UCCLKnobs:
    """Resolved knobs of one dispatcher."""

    num_sms: Optional[int]
    nvl_bytes: Optional[int]
    rdma_bytes: Optional[int]
    backend: str
    combine_from_buffer: bool = True


def resolve(config: Any) -> UCCLKnobs:
    """Resolve every knob for `config` (see the module doc for the order) and validate it."""
    args = _compat.training_args()
    values: dict[str, Any] = {}
    for spec in KNOBS:
        v = getattr(config, spec.name, None)
        if v is None and args is not None:
            v = getattr(args, spec.name, None)
        values[spec.name] = spec.default if v is None else v
    num_sms, nvl, rdma, backend, from_buffer = (values[s.name] for s in KNOBS)
    if num_sms is not None and (not isinstance(num_sms, int) or num_sms <= 0 or num_sms % 2):
        raise InvalidUsageError(f"moe_uccl_num_sms={num_sms!r} is invalid: give a positive even integer (e.g. 20, 24)")
    for name, v in (("moe_uccl_nvl_bytes", nvl), ("moe_uccl_rdma_bytes", rdma)):
        if v is not None and (not isinstance(v, int) or v < 0):
            raise InvalidUsageError(
                f"{name}={v!r} is invalid: give a byte count >= 0, or leave it unset for the size hint"
            )
    if backend not in BACKENDS:
        raise InvalidUsageError(f"moe_uccl_backend={backend!r} is invalid: choose one of {', '.join(BACKENDS)}")
    try:
        from_buffer = parse_bool(from_buffer)
    except InvalidUsageError as e:
        raise InvalidUsageError(f"moe_uccl_combine_from_buffer: {e}") from None
    return UCCLKnobs(num_sms=num_sms, nvl_bytes=nvl, rdma_bytes=rdma, backend=str(backend),
                     combine_from_buffer=from_buffer)


def add_arguments(parser: Any) -> None:
    """Add the ``--moe-uccl-*`` flags to an argparse parser (skips flags it already has)."""
    existing = {a.dest for a in parser._actions}
    group = None
    for spec in KNOBS:
        if spec.name in existing:
            continue
        if group is None:
            group = parser.add_argument_group(title="uccl-moe dispatcher (--moe-token-dispatcher-type uccl)")
        choices = BACKENDS if spec.name == "moe_uccl_backend" else None
        group.add_argument(spec.flag, dest=spec.name, type=spec.type, default=None, choices=choices, help=spec.help)
