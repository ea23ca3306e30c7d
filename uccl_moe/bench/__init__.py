"""``uccl-moe bench``: intranode HT dispatch/combine throughput vs NCCL all_to_all_single and the peer-copy
ceiling (implementation and docs in ``__main__.py``; run ``python -m uccl_moe.bench``)."""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``uccl-moe bench`` (see ``uccl_moe/bench/__main__.py``)."""
    from .__main__ import main as _main

    return _main(argv)


__all__ = ["main"]
