"""tools/module_sizes.py (issue 31's size rule): it flags a long module and an unexplained long function, and uccl_moe
has neither."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "module_sizes.py"


def _run(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(TOOL), str(root)], capture_output=True, text=True, timeout=120)


def _function(name: str, body_lines: int) -> str:
    return f"def {name}():\n" + "".join(f"    x{i} = {i}\n" for i in range(body_lines)) + "\n\n"


def test_tool_flags_a_long_module_and_an_unexplained_long_function(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "big.py").write_text("x = 1\n" * 501)
    (pkg / "long_fn.py").write_text(_function("too_long", 81))
    out = _run(pkg)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "module   " in out.stdout and "big.py: 501 lines" in out.stdout
    assert "too_long: 82 lines  [NO REASON]" in out.stdout


def test_tool_accepts_a_long_function_with_its_reason(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "long_fn.py").write_text("# long: one table of cases, read top to bottom\n" + _function("explained", 81))
    out = _run(pkg)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "[# long: one table of cases, read top to bottom]" in out.stdout


def test_uccl_moe_has_no_module_over_500_lines_and_no_unexplained_long_function() -> None:
    out = _run(ROOT / "uccl_moe")
    long_modules = [line for line in out.stdout.splitlines() if line.startswith("module")]
    assert long_modules == [], "\n".join(long_modules)
    assert out.returncode == 0, out.stdout + out.stderr
