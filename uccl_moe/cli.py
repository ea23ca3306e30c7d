"""The ``uccl-moe`` command: a registry of subcommands.

``uccl-moe train|slurm|primus|render-recipes ...`` come from :mod:`uccl_moe.launch.commands`. To add a
subcommand (``bench``, ``compare``, ...), write a module that calls :func:`subcommand` at import time and list it
in ``SUBCOMMAND_MODULES`` (or, from another distribution, expose it under the ``uccl_moe.subcommands`` entry-point
group)::

    # uccl_moe/bench/cli.py
    from uccl_moe.cli import subcommand

    def _args(p):                       # argparse.ArgumentParser of this subcommand
        p.add_argument("overrides", nargs="*")

    @subcommand("bench", "sweep dispatch/combine and write tables and plots", _args)
    def bench(args) -> int:
        ...
        return 0
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .errors import InvalidUsageError, UcclMoeError

SUBCOMMAND_MODULES: list[str] = ["uccl_moe.launch.commands", "uccl_moe.launch.compare", "uccl_moe.bench.cli",
                                  "uccl_moe.doctor"]
"""Modules imported to register subcommands, in help order. Append yours here."""

ENTRY_POINT_GROUP = "uccl_moe.subcommands"


@dataclass(frozen=True)
class Subcommand:
    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


_REGISTRY: dict[str, Subcommand] = {}


def subcommand(
    name: str, help: str, add_arguments: Callable[[argparse.ArgumentParser], None] | None = None
) -> Callable[[Callable[[argparse.Namespace], int]], Callable[[argparse.Namespace], int]]:
    """Register ``run(args) -> exit code`` as ``uccl-moe <name>``. Registering a name twice is an error."""

    def deco(run: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
        old = _REGISTRY.get(name)
        if old is not None and old.run is not run:
            raise InvalidUsageError(f"uccl-moe subcommand {name!r} is registered twice ({old.run} and {run})")
        _REGISTRY[name] = Subcommand(name, help, add_arguments or (lambda p: None), run)
        return run

    return deco


def registered() -> dict[str, Subcommand]:
    """The subcommands known so far (after :func:`load_subcommands`)."""
    return dict(_REGISTRY)


def load_subcommands() -> None:
    """Import ``SUBCOMMAND_MODULES`` and the ``uccl_moe.subcommands`` entry points."""
    for mod in SUBCOMMAND_MODULES:
        importlib.import_module(mod)
    from importlib.metadata import entry_points

    for ep in entry_points(group=ENTRY_POINT_GROUP):  # Python >= 3.10 API; none when nothing declares the group
        ep.load()


def build_parser() -> argparse.ArgumentParser:
    load_subcommands()
    parser = argparse.ArgumentParser(
        prog="uccl-moe",
        description="uccl-moe: launch MoE training with uccl-moe's dispatcher from validated Hydra recipes.",
        epilog="Overrides use Hydra syntax: recipe=dsv3_h200_efa_4n parallel.micro_batch_size=2 dispatcher=alltoall",
    )
    subs = parser.add_subparsers(dest="subcommand", metavar="SUBCOMMAND")
    subs.required = True
    for sc in _REGISTRY.values():
        p = subs.add_parser(sc.name, help=sc.help, description=sc.help)
        sc.add_arguments(p)
        p.set_defaults(_run=sc.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``uccl-moe`` console script. Usage errors print one message and exit with 2."""
    parser = build_parser()
    # Hydra overrides may come before or after the options (`train --dry-run recipe=x` and `train recipe=x --dry-run`):
    # leftover non-option tokens are appended to the subcommand's `overrides`.
    args, extra = parser.parse_known_args(list(sys.argv[1:] if argv is None else argv))
    bad = [t for t in extra if t.startswith("-")]
    if bad or (extra and not isinstance(getattr(args, "overrides", None), list)):
        parser.error(f"unrecognized arguments: {' '.join(bad or extra)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    try:
        return int(args._run(args) or 0)
    except UcclMoeError as e:
        print(f"uccl-moe {args.subcommand}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # `python -m uccl_moe.cli`: use the importable module so registrations land in one registry
    from uccl_moe.cli import main as _main

    sys.exit(_main())
