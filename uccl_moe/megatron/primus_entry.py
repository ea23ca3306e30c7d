"""Primus entry with the uccl dispatcher: registers uccl-moe's Primus patches, then runs Primus' own CLI.

    primus-cli direct --script "$(python -m uccl_moe.megatron.primus_entry --path)" -- \\
        train pretrain --config exp.yaml --moe_token_dispatcher_type uccl

``--path`` prints this file's path (for ``--script``); anything else is handed to ``primus/cli/main.py``.
"""

from __future__ import annotations

import runpy
import sys


def main() -> int:
    if sys.argv[1:] == ["--path"]:
        print(__file__)
        return 0
    from . import primus

    if not primus.register():
        print("uccl_moe.megatron.primus_entry: Primus is not importable (pip install primus / add it to PYTHONPATH)",
              file=sys.stderr)
        return 2
    runpy.run_module("primus.cli.main", run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    # Run as a file by primus-cli (--script path) or as `python -m`: make the package importable either way.
    if __package__ in (None, ""):
        import os

        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
        __package__ = "uccl_moe.megatron"  # noqa: A001
        import uccl_moe.megatron  # noqa: F401
    sys.exit(main())
