"""A reader can find every page: docs/README.md lists each docs page, the README's layout names each
one, and docs/results/README.md has a row for each results folder."""
from __future__ import annotations

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")
RESULTS = os.path.join(DOCS, "results")


def _read(*path: str) -> str:
    with open(os.path.join(ROOT, *path), encoding="utf-8") as fh:
        return fh.read()


def _pages() -> list:
    return sorted(f for f in os.listdir(DOCS) if f.endswith(".md") and f != "README.md")


def test_docs_index_links_every_page_once() -> None:
    index = _read("docs", "README.md")
    linked = re.findall(r"^\| \[([^\]]+)\]\(([^)]+)\) \| \S", index, flags=re.M)
    targets = [t for _, t in linked]
    assert sorted(t for t in targets if "/" not in t) == _pages()
    assert "results/README.md" in targets
    assert all(os.path.exists(os.path.join(DOCS, t)) for t in targets)


def test_readme_layout_names_every_page() -> None:
    readme = _read("README.md")
    layout = readme[readme.index("## Layout"):]
    missing = [p for p in _pages() + ["README.md"] if p not in layout]
    assert not missing, f"README's layout does not name docs/{missing}"
    assert "docs/compat.md" in readme[:readme.index("## Layout")]      # linked from the text too


def test_results_index_has_a_row_per_folder() -> None:
    index = _read("docs", "results", "README.md")
    folders = sorted(d for d in os.listdir(RESULTS) if os.path.isdir(os.path.join(RESULTS, d)))
    rows = re.findall(r"^\| (\d{4}-\d\d-\d\d) \| [^|]+ \| [^|]+ \| [^|]+ \| \[([^\]]+)\]", index, flags=re.M)
    assert sorted(folder for _, folder in rows) == folders
    for date, folder in rows:
        assert folder.startswith(date), (date, folder)
        assert os.path.isfile(os.path.join(RESULTS, folder, "README.md"))
