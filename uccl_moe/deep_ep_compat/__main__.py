"""``python -m uccl_moe.deep_ep_compat install [--target DIR]``: make ``import deep_ep`` load uccl-moe."""

from __future__ import annotations

import argparse
import site
import sys
from pathlib import Path

_INIT = '''"""Shim written by `python -m uccl_moe.deep_ep_compat install`: deep_ep is provided by uccl-moe."""
from uccl_moe.deep_ep_compat import Buffer, Config, EventHandle, EventOverlap, topk_idx_t  # noqa: F401
from . import utils  # noqa: F401
'''
_UTILS = '''from uccl_moe.deep_ep_compat.utils import EventHandle, EventOverlap, check_nvlink_connections  # noqa: F401
'''
_MARK = "deep_ep is provided by uccl-moe"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m uccl_moe.deep_ep_compat")
    p.add_argument("action", choices=["install", "uninstall"])
    p.add_argument("--target", default=site.getsitepackages()[0], help="directory on sys.path (default: site-packages)")
    args = p.parse_args(argv)
    pkg = Path(args.target) / "deep_ep"
    init = pkg / "__init__.py"
    if args.action == "install":
        if init.exists() and _MARK not in init.read_text():
            print(f"error: {pkg} is a real deep_ep installation; uninstall it first (pip uninstall deep_ep)",
                  file=sys.stderr)
            return 1
        pkg.mkdir(parents=True, exist_ok=True)
        init.write_text(_INIT)
        (pkg / "utils.py").write_text(_UTILS)
        print(f"installed deep_ep shim at {pkg}")
        return 0
    if init.exists() and _MARK in init.read_text():
        for f in pkg.iterdir():
            if f.is_file():
                f.unlink()
            elif f.name == "__pycache__":
                for c in f.iterdir():
                    c.unlink()
                f.rmdir()
        pkg.rmdir()
        print(f"removed deep_ep shim at {pkg}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
