"""The ``uccl-moe`` command: a table of subcommands, each loaded only when it runs.

``uccl-moe --help`` and ``--version`` import nothing beyond this file (no torch, Hydra or OmegaConf), so they work
with the base install. A subcommand's module is imported when that subcommand is named; if the module needs a
package of an extra that is not installed, the command prints one line naming the extra to install.

To add a subcommand, write a module that registers it with :func:`subcommand` and add one row to ``SUBCOMMANDS``
(or, from another distribution, expose the module under the ``uccl_moe.subcommands`` entry-point group)::

    # uccl_moe/bench/cli.py
    from uccl_moe.cli import subcommand

    def _args(p):                       # argparse.ArgumentParser of this subcommand
        p.add_argument("overrides", nargs="*")

    @subcommand("bench", "sweep dispatch/combine and write tables and plots", _args)
    def bench(args) -> int:
        ...
        return 0

    # uccl_moe/cli.py
    SUBCOMMANDS = {..., "bench": ("uccl_moe.bench.cli", "sweep dispatch/combine and write tables and plots")}
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from . import __version__
from .errors import InvalidUsageError, UcclMoeError

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    # name: (module that registers it, one line for `uccl-moe --help`), in help order
    "train": ("uccl_moe.launch.commands", "train on this host: torchrun with the rendered Megatron arguments"),
    "slurm": ("uccl_moe.launch.commands", "render an sbatch script (torchrun per node); --submit sends it"),
    "primus": ("uccl_moe.launch.commands", "render a Primus experiment YAML and its primus-cli command"),
    "render-recipes": ("uccl_moe.launch.commands", "regenerate (or --check) the committed recipes/ folder"),
    "compare": ("uccl_moe.train.compare", "train one recipe once per dispatcher: loss parity, step time, tokens/s"),
    "bench": ("uccl_moe.bench.cli", "time dispatch/combine vs NCCL all_to_all_single on this host's GPUs"),
    "doctor": ("uccl_moe.doctor", "check this host's GPUs, NICs and settings for internode runs; --pair: self-test"),
    "env": ("uccl_moe.env_cli", "list every UCCL_MOE_* knob: its value, who set it, what it does"),
}
"""The built-in subcommands. Append a row for yours."""

ENTRY_POINT_GROUP = "uccl_moe.subcommands"

EXTRA_OF_MODULE: dict[str, str] = {
    "torch": "train", "megatron": "train", "hydra": "train", "omegaconf": "train", "yaml": "train",
    "matplotlib": "test", "pytest": "test",
}
"""Top-level module -> the ``pyproject.toml`` extra that installs it (for the one-line "install X" message)."""


class MissingExtraError(InvalidUsageError):
    """A subcommand needs a package of an optional extra that is not installed."""


def missing_extra(err: ModuleNotFoundError) -> MissingExtraError | None:
    """The one-line error for `err` when the missing module belongs to one of our extras, else None."""
    root = (err.name or "").split(".")[0]
    extra = EXTRA_OF_MODULE.get(root)
    if extra is None:
        return None
    return MissingExtraError(
        f"needs the Python package '{root}' (extra '{extra}'): pip install \"uccl-moe[{extra}]\" "
        f"(from a checkout: pip install -e \".[{extra}]\")"
    )


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


def _import(module: str) -> None:
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as e:
        err = missing_extra(e)
        if err is None:
            raise
        raise err from None


def _load_entry_points() -> None:
    from importlib.metadata import entry_points

    for ep in entry_points(group=ENTRY_POINT_GROUP):  # Python >= 3.10 API; none when nothing declares the group
        ep.load()


def load_subcommand(name: str) -> None:
    """Import the module that registers `name` (a ``SUBCOMMANDS`` row, else the entry points).

    Raises:
        MissingExtraError: the module needs a package of an extra that is not installed.
    """
    if name in _REGISTRY:
        return
    if name in SUBCOMMANDS:
        _import(SUBCOMMANDS[name][0])
    else:
        _load_entry_points()


def load_subcommands() -> None:
    """Import every ``SUBCOMMANDS`` module and the ``uccl_moe.subcommands`` entry points."""
    for module, _ in SUBCOMMANDS.values():
        _import(module)
    _load_entry_points()


def build_parser(load: bool = True) -> argparse.ArgumentParser:
    """The ``uccl-moe`` parser. With `load`, every subcommand is imported and has its arguments; without, the
    subcommands not loaded yet appear with their help line only (enough for ``uccl-moe --help``)."""
    if load:
        load_subcommands()
    parser = argparse.ArgumentParser(
        prog="uccl-moe",
        description="uccl-moe: launch MoE training with uccl-moe's dispatcher from validated Hydra recipes.",
        epilog="Overrides use Hydra syntax: recipe=dsv3_h200_efa_4n parallel.micro_batch_size=2 dispatcher=alltoall",
    )
    parser.add_argument("--version", action="version", version=f"uccl-moe {__version__}")
    subs = parser.add_subparsers(dest="subcommand", metavar="SUBCOMMAND")
    subs.required = True
    names = [*SUBCOMMANDS, *(n for n in _REGISTRY if n not in SUBCOMMANDS)]
    for name in names:
        sc = _REGISTRY.get(name)
        if sc is None:
            subs.add_parser(name, help=SUBCOMMANDS[name][1])
            continue
        p = subs.add_parser(name, help=SUBCOMMANDS.get(name, (None, sc.help))[1], description=sc.help)
        sc.add_arguments(p)
        p.set_defaults(_run=sc.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``uccl-moe`` console script. Usage errors print one message and exit with 2."""
    argv = list(sys.argv[1:] if argv is None else argv)
    name = next((a for a in argv if not a.startswith("-")), None)
    if name is not None:
        try:
            load_subcommand(name)
        except UcclMoeError as e:
            print(f"uccl-moe {name}: error: {e}", file=sys.stderr)
            return 2
    parser = build_parser(load=False)
    # Hydra overrides may come before or after the options (`train --dry-run recipe=x` and `train recipe=x --dry-run`):
    # leftover non-option tokens are appended to the subcommand's `overrides`.
    args, extra = parser.parse_known_args(argv)
    bad = [t for t in extra if t.startswith("-")]
    if bad or (extra and not isinstance(getattr(args, "overrides", None), list)):
        parser.error(f"unrecognized arguments: {' '.join(bad or extra)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    try:
        return int(args._run(args) or 0)
    except ModuleNotFoundError as e:  # a package of an extra imported by the subcommand as it runs
        err = missing_extra(e)
        if err is None:
            raise
        print(f"uccl-moe {args.subcommand}: error: {err}", file=sys.stderr)
        return 2
    except UcclMoeError as e:
        print(f"uccl-moe {args.subcommand}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # `python -m uccl_moe.cli`: use the importable module so registrations land in one registry
    from uccl_moe.cli import main as _main

    sys.exit(_main())
