#!/usr/bin/env python3
"""Python modules over 500 lines and functions over 80 lines under a package (issue 31's size rule).

A long function passes when the line right above it (or above its decorators) is a ``# long: <reason>`` comment.
Usage: tools/module_sizes.py [uccl_moe]; exits 1 if a function over the limit has no reason.
"""

from __future__ import annotations

import ast
import pathlib
import sys

MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80


def main(root: str = "uccl_moe") -> int:
    unexplained = 0
    for path in sorted(pathlib.Path(root).rglob("*.py")):
        src = path.read_text()
        lines = src.split("\n")
        if src.count("\n") > MAX_MODULE_LINES:
            print(f"module   {path}: {src.count(chr(10))} lines")
        for node in ast.walk(ast.parse(src)):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            length = (node.end_lineno or node.lineno) - node.lineno + 1
            if length <= MAX_FUNCTION_LINES:
                continue
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            above = lines[first - 2].strip() if first >= 2 else ""
            reason = above if above.startswith("# long:") else "NO REASON"
            unexplained += reason == "NO REASON"
            print(f"function {path}:{node.lineno} {node.name}: {length} lines  [{reason}]")
    return 1 if unexplained else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
