"""What tools/ll_ab_report.py and tools/normal_ab_report.py share: their command line (the A/B's output
folder, the two trees' labels, where the ranks ran) and how they leave their results (the table printed
and in <stem>.txt, every figure in <stem>.json, the plot in <stem>.png or a line saying why none)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Callable, List, Optional


def parse_args(description: str, script: str, where: str, argv: Optional[List[str]]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("out", type=Path, help=f"{script}'s output folder (holds base/ and new/)")
    ap.add_argument("--baseline", default="base")
    ap.add_argument("--current", default="new")
    ap.add_argument("--where", default=where, help="where the ranks ran, for the title")
    return ap.parse_args(argv)


def write(out: Path, stem: str, text: str, doc: Any, plot: Callable[[Path], Optional[str]]) -> None:
    print(text)
    (out / f"{stem}.txt").write_text(text + "\n")
    (out / f"{stem}.json").write_text(json.dumps(doc, indent=1))
    note = plot(out / f"{stem}.png")
    if note:
        print(note)
