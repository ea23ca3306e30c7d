"""Run a Megatron-LM training script with the ``uccl`` dispatcher registered.

    python -m uccl_moe.megatron.pretrain <Megatron-LM>/pretrain_gpt.py <megatron args> --moe-token-dispatcher-type uccl
    torchrun --nproc-per-node 8 -m uccl_moe.megatron.pretrain <Megatron-LM>/pretrain_gpt.py <args...>

It calls :func:`uccl_moe.megatron.install` (``uccl`` becomes a valid ``--moe-token-dispatcher-type`` choice, the
``--moe-uccl-*`` knobs exist, TransformerConfig and MoELayer accept it) and then runs the script as ``__main__``
with ``sys.argv = [script, *args]`` and the script's folder first on ``sys.path``, as ``python script.py`` would.
The script itself is unmodified.
"""

from __future__ import annotations

import os
import runpy
import sys
from collections.abc import Sequence
from typing import Optional

USAGE = "usage: python -m uccl_moe.megatron.pretrain <megatron training script.py> [script args...]"


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE + "\n\n" + (__doc__ or ""), file=sys.stderr if not argv else sys.stdout)
        return 0 if argv else 2
    script = argv[0]
    if not os.path.isfile(script):
        print(f"uccl_moe.megatron.pretrain: no such script: {script!r}\n{USAGE}", file=sys.stderr)
        return 2
    from .install import install

    install()
    script = os.path.abspath(script)
    sys.argv = [script, *argv[1:]]
    sys.path.insert(0, os.path.dirname(script))
    runpy.run_path(script, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
