"""No import circle inside ``uccl_moe`` (issue 31): a static graph of imports, built with ``ast``.

Two graphs: the imports that run when a module is imported (statements at module level, also inside a module-level
``try``/``if``), and those plus the imports inside functions (a lazy import that closes a circle is a circle too).
Neither counts imports under ``if TYPE_CHECKING:``; ``importlib.import_module`` by name is not seen.
"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "uccl_moe"



def _module_name(path: Path, pkg: Path) -> str:
    parts = path.relative_to(pkg.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _top_level_imports(body: list[ast.stmt]) -> list[ast.Import | ast.ImportFrom]:
    out: list[ast.Import | ast.ImportFrom] = []
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out.append(node)
        elif isinstance(node, ast.If):
            if not _is_type_checking(node.test):
                out += _top_level_imports(node.body)
            out += _top_level_imports(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                out += _top_level_imports(block)
    return out


def _all_imports(body: list[ast.stmt]) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement in `body`, inside functions and classes too, except under ``if TYPE_CHECKING:``."""
    out: list[ast.Import | ast.ImportFrom] = []

    class Visitor(ast.NodeVisitor):
        def visit_If(self, node: ast.If) -> None:
            if _is_type_checking(node.test):
                for stmt in node.orelse:
                    self.visit(stmt)
            else:
                self.generic_visit(node)

        def visit_Import(self, node: ast.Import) -> None:
            out.append(node)

        def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
            out.append(node)

    for stmt in body:
        Visitor().visit(stmt)
    return out


def import_graph(pkg: Path = PKG, function_level: bool = False) -> dict[str, set[str]]:
    """module -> the uccl_moe modules it imports at module level, or anywhere with `function_level` (``from . import
    x`` is an edge to module x, not to the package, when x is a module)."""
    files = {_module_name(p, pkg): p for p in pkg.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in files}
    collect = _all_imports if function_level else _top_level_imports
    for mod, path in files.items():
        is_pkg = path.name == "__init__.py"
        for node in collect(ast.parse(path.read_text()).body):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                if node.level:
                    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    prefix = ".".join(base + ([node.module] if node.module else []))
                else:
                    prefix = node.module or ""
                # ``from P import name`` imports the module P.name where there is one, else P (its attribute)
                subs = [f"{prefix}.{a.name}" for a in node.names]
                targets = [t for t in subs if t in files]
                if len(targets) < len(subs):
                    targets.append(prefix)
            for t in targets:
                if t in files and t != mod:
                    graph[mod].add(t)
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_finder_sees_a_circle_and_ignores_function_level_imports(tmp_path: Path) -> None:
    pkg = tmp_path / "uccl_moe"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .sub import b\n")
    (pkg / "sub" / "b.py").write_text("try:\n    from .. import a\nexcept ImportError:\n    pass\n")
    (pkg / "e.py").write_text("from . import a\nfrom .sub import nothing_module\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import d\n"
                              "def f():\n    from . import d\n")
    (pkg / "d.py").write_text("from . import c\n")
    graph = import_graph(pkg)
    assert graph["uccl_moe.a"] == {"uccl_moe.sub.b"}
    assert graph["uccl_moe.e"] == {"uccl_moe.a", "uccl_moe.sub"}
    assert graph["uccl_moe.c"] == set()
    assert find_cycles(graph) == [["uccl_moe.a", "uccl_moe.sub.b"]]


def test_no_import_circle_in_uccl_moe() -> None:
    cycles = find_cycles(import_graph())
    assert cycles == [], f"import circles (module-level imports) in uccl_moe: {cycles}"


def test_function_level_graph_sees_a_lazy_import_that_closes_a_circle(tmp_path: Path) -> None:
    pkg = tmp_path / "uccl_moe"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text("import os\n\ndef f():\n    from .a import g\n    return g\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import d\n"
                              "else:\n    from . import e\n")
    (pkg / "d.py").write_text("class K:\n    def m(self):\n        from . import c\n")
    (pkg / "e.py").write_text("")
    assert find_cycles(import_graph(pkg)) == []
    graph = import_graph(pkg, function_level=True)
    assert graph["uccl_moe.b"] == {"uccl_moe.a"}
    assert graph["uccl_moe.c"] == {"uccl_moe.e"}  # not d: TYPE_CHECKING only
    assert graph["uccl_moe.d"] == {"uccl_moe.c"}  # a method's import counts
    assert find_cycles(graph) == [["uccl_moe.a", "uccl_moe.b"]]


def test_no_import_circle_in_uccl_moe_counting_imports_inside_functions() -> None:
    cycles = find_cycles(import_graph(function_level=True))
    assert cycles == [], f"import circles (imports inside functions included) in uccl_moe: {cycles}"
