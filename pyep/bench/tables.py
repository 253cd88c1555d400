"""How the benchmark's text output is laid out: 120 columns at most (a terminal, a log, an issue
comment), compact tables whose title and caption are lines of their own (a rich title wraps to the
table's width, which squeezes it into a column when the table is narrow), and the small words
("1 rank") that keep a sentence right. Everything too wide for a table goes to the JSON."""
from __future__ import annotations

import math
from typing import Any, Optional, TextIO

WIDTH = 120


def console(file: Optional[TextIO] = None) -> Any:
    """A recording rich Console of WIDTH columns (save_text writes what it printed)."""
    from rich.console import Console
    return Console(record=True, width=WIDTH, file=file)


def table() -> Any:
    """A table with one header rule and two spaces between columns, no outer edge."""
    from rich import box
    from rich.table import Table
    return Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 1), collapse_padding=True)


def emit(con: Any, title: str, t: Any, caption: str = "") -> None:
    """Title line(s), the table, caption line(s); titles and captions are plain text (not markup)."""
    from rich.text import Text
    con.print(Text(title, style="bold"))
    con.print(t)
    if caption:
        con.print(Text(caption, style="dim"))


def count(n: int, noun: str) -> str:
    """'1 rank', '2 ranks'."""
    return f"{n} {noun}" + ("" if n == 1 else "s")


def num(v: Optional[float], digits: int = 1) -> str:
    """A number for a cell; '-' where there is none."""
    return "-" if v is None or math.isnan(v) else f"{v:.{digits}f}"


def us(v: Optional[float]) -> str:
    """Microseconds: one decimal, none from 1000 up (a reference backend's milliseconds stay narrow)."""
    if v is None or math.isnan(v):
        return "-"
    return f"{v:.0f}" if v >= 1000 else f"{v:.1f}"


def gbps(v: Optional[float]) -> str:
    """GB/s: whole numbers from 10 up, fewer digits below (CPU runs move little)."""
    if v is None or math.isnan(v):
        return "-"
    return f"{v:.0f}" if v >= 10 else (f"{v:.1f}" if v >= 1 else f"{v:.2f}")


def ratio(v: Optional[float]) -> str:
    return "-" if v is None or math.isnan(v) else f"{v:.2f}x"


def percent(v: Optional[float]) -> str:
    return "-" if v is None or math.isnan(v) else f"{100 * v:.0f}%"
