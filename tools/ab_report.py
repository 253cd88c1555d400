"""What tools/ll_ab_report.py and tools/normal_ab_report.py share: their command line (the A/B's output
folder, the two trees' labels, where the ranks ran) and how they leave their results (the table printed
and in <stem>.txt, every figure in <stem>.json, the plot in <stem>.png or a line saying why none)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Callable, List, Optional


def parse_args(description: str, script: str, where: str, argv: Optional[List[str]]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("out", type=Path, help=f"{script}'s output folder (holds base/ and new/)")
    ap.add_argument("--baseline", default="base")
    ap.add_argument("--current", default="new")
    ap.add_argument("--where", default=where, help="where the ranks ran, for the title")
    return ap.parse_args(argv)


NO_MATPLOTLIB = "matplotlib missing: no plot (pip install matplotlib)"


def pyplot() -> Any:
    """matplotlib.pyplot on the file-only backend, or None where matplotlib is missing (NO_MATPLOTLIB)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def write(out: Path, stem: str, text: str, doc: Any, plot: Callable[[Path], Optional[str]]) -> None:
    print(text)
    (out / f"{stem}.txt").write_text(text + "\n")
    (out / f"{stem}.json").write_text(json.dumps(doc, indent=1))
    note = plot(out / f"{stem}.png")
    if note:
        print(note)


def run(argv: Optional[List[str]], description: str, script: str, where: str, stem: str, folders: str,
        collect: Callable[[Path], List[Any]], table: Callable[[List[Any], str, str, str], str],
        rows_json: Callable[[List[Any]], List[Any]], plot: Callable[[List[Any], Path], Optional[str]]) -> int:
    """A report's main: 2 when the A/B folder holds no `folders`, 1 when a row lacks the base's or the
    new tree's figures, else 0 (the table, JSON and plot written either way)."""
    a = parse_args(description, script, where, argv)
    rows = collect(a.out)
    if not rows:
        print(f"no {folders} folders under {a.out}/base or {a.out}/new", file=sys.stderr)
        return 2
    doc = {"baseline": a.baseline, "current": a.current, "where": a.where, "rows": rows_json(rows)}
    write(a.out, stem, table(rows, a.baseline, a.current, a.where), doc, lambda path: plot(rows, path))
    return 0 if all(r["base"] and r["new"] for r in rows) else 1
