"""The user docs point at files that exist: every repository path written in README.md, CHANGELOG.md, docs/*.md and
examples/ (in backticks or as a Markdown link) names a file or folder of the checkout, and no doc points into the
raw-log folders that left the repository."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted([ROOT / "README.md", ROOT / "CHANGELOG.md", ROOT / "examples/README.md", *(ROOT / "docs").glob("*.md")])
TOP = ("docs/", "examples/", "tests/", "tools/", "uccl_moe/", "native/", "configs/", "recipes/", ".ci/")
# A path-looking token: starts at one of the top folders (or is a root Markdown file), no spaces.
_TOPS = "|".join(re.escape(t) for t in TOP)
PATH = re.compile(rf"(?<![\w./-])((?:{_TOPS})[\w./-]*|[A-Z]+\.md)")
# Written as patterns or placeholders, not as paths.
NOT_A_PATH = re.compile(r"[*<>{}]|\.\.\.|\$")
GONE = ("docs/logs/", "docs/e2e/", "docs/performance.md")


def _spans(text: str) -> list[str]:
    """Text inside backticks and the targets of Markdown links and images."""
    return re.findall(r"`([^`\n]+)`", text) + re.findall(r"\]\(([^)\s]+)\)", text)


def _referenced(doc: Path) -> set[str]:
    found = set()
    for span in _spans(doc.read_text()):
        for word in span.split():
            if NOT_A_PATH.search(word):  # e.g. native/src/runtime/rdma_runtime.* or ep2_*.json
                continue
            found.update(token.rstrip(".,:;") for token in PATH.findall(word))
    return found


def _exists(doc: Path, token: str) -> bool:
    """A file or folder of the checkout, relative to the root or (Markdown links in docs/) to the doc; a source
    stem such as native/bench/proxy_bench (the binary built from proxy_bench.cc) counts too."""
    for base in (ROOT, doc.parent):
        path = base / token
        if path.exists() or (path.parent.is_dir() and any(path.parent.glob(path.name + ".*"))):
            return True
    return False


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_doc_paths_exist(doc: Path):
    gone = GONE if doc.name == "CHANGELOG.md" else ()  # the changelog records what left the repository
    missing = [t for t in sorted(_referenced(doc)) if t not in gone and not _exists(doc, t)]
    assert not missing, f"{doc.relative_to(ROOT)} names paths that do not exist: {missing}"


def test_raw_logs_are_not_in_the_repository():
    for gone in GONE:
        assert not (ROOT / gone).exists(), f"{gone} is back: raw logs and round notes stay out of the repository"
    for doc in DOCS:
        text = doc.read_text()
        if doc.name == "CHANGELOG.md":  # records that they left
            continue
        for gone in ("docs/logs/", "docs/e2e/", "performance.md"):
            assert gone not in text, f"{doc.relative_to(ROOT)} still points at {gone}"


def test_the_user_docs_exist_and_the_readme_links_them():
    readme = (ROOT / "README.md").read_text()
    for name in ("docs/user_guide.md", "docs/architecture.md", "docs/benchmarks.md", "CHANGELOG.md"):
        assert (ROOT / name).is_file(), name
        assert name in readme, f"README.md does not link {name}"
    assert len((ROOT / "docs/benchmarks.md").read_text().splitlines()) <= 160, "benchmarks.md: the current table only"
