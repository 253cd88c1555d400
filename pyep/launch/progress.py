"""The progress protocol between workloads and `pyep launch`.

A workload prints lines `PYEP_PROGRESS <done>/<total> <label>` on stdout; the launcher turns them into
a live progress bar (summed over ranks) and does not echo them. Workloads call `report()`:

    from pyep.launch.progress import report
    for i, case in enumerate(cases):
        run(case)
        report(i + 1, len(cases), case.name)

Importing this module is cheap (no torch) and `report` is a no-op cost when nothing listens: it is one
flushed line on stdout.
"""
from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from typing import Optional, TextIO

PREFIX = "PYEP_PROGRESS"
_LINE = re.compile(r"PYEP_PROGRESS (\d+)/(\d+)(?: (.*))?")


@dataclass(frozen=True)
class Progress:
    done: int
    total: int
    label: str = ""


def format_progress(done: int, total: int, label: str = "") -> str:
    if not isinstance(done, int) or not isinstance(total, int) or isinstance(done, bool) or isinstance(total, bool):
        raise TypeError(f"progress needs integers, got done={done!r} total={total!r}")
    if total < 0 or not 0 <= done <= max(total, 0):
        raise ValueError(f"progress {done}/{total} is not 0 <= done <= total")
    label = " ".join(str(label).split())     # one line, no control characters
    return f"{PREFIX} {done}/{total}" + (f" {label}" if label else "")


def report(done: int, total: int, label: str = "", stream: Optional[TextIO] = None) -> None:
    """Print one progress line (flushed, so the launcher sees it at once)."""
    out = stream if stream is not None else sys.stdout
    out.write(format_progress(done, total, label) + "\n")
    out.flush()


def parse_progress(line: str) -> Optional[Progress]:
    m = _LINE.fullmatch(line.rstrip("\r\n"))
    if not m:
        return None
    done, total = int(m.group(1)), int(m.group(2))
    if done > total:
        return None
    return Progress(done, total, m.group(3) or "")
