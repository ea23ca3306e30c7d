"""Registers ``uccl-moe bench`` (the same flags as ``python -m uccl_moe.bench``)."""

from __future__ import annotations

import argparse

from ..cli import subcommand


def _add_arguments(p: argparse.ArgumentParser) -> None:
    from .__main__ import add_arguments

    add_arguments(p)


@subcommand("bench", "time dispatch/combine vs NCCL all_to_all_single vs the peer-copy ceiling on this host's GPUs",
            _add_arguments)
def bench(args: argparse.Namespace) -> int:
    from .__main__ import run

    return run(args)
