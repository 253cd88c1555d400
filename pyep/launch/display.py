"""What the user sees during and after a launch: streamed output, a live progress bar, a summary.

Progress counts the job's steps: each rank reports its own `done/total` (PYEP_PROGRESS), and the job
is as far as its slowest rank, so the display shows that rank's count and label (a rank that has not
reported yet counts as 0 done of the others' total). Summing over ranks instead made the total grow as
ranks started and showed the same step label at several counts. On a terminal a progress bar (rich)
redraws below the scrolling output. Elsewhere (CI logs, pipes) progress is printed as a plain line,
with the time since the launch, whenever it moved by 10% or 5 s passed, so logs stay readable.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress as RichProgress, TextColumn, TimeElapsedColumn
from rich.table import Table

from .progress import Progress
from .supervisor import SuperviseResult

_PLAIN_EVERY_S = 5.0


class LaunchDisplay:
    """OutputSink for the Supervisor."""

    def __init__(self, console: Console, hosts: List[str], *, quiet: bool = False, ranks: Optional[int] = None):
        self.console = console
        self.hosts = hosts
        self.quiet = quiet
        self.ranks = ranks                # how many ranks the job has, when known in advance
        self.multi = len(hosts) > 1
        self.latest: Dict[Tuple[int, int], Progress] = {}
        self._bar: Optional[RichProgress] = None
        self._task = None
        self._start = time.monotonic()
        self._plain_last = (self._start, 0.0)    # (time, fraction) of the last plain progress line
        self._plain_shown = (-1, -1)      # (done, total) of the last plain progress line
        self._plain_pending = ""          # newest progress line not printed yet

    def job_progress(self) -> Tuple[Progress, int, int]:
        """(the slowest rank's progress, ranks reporting, ranks expected)."""
        reporting = len(self.latest)
        expected = max(self.ranks or 0, reporting)
        slowest = min(self.latest.values(), key=lambda p: p.done / p.total if p.total else 1.0)
        if reporting < expected:     # a rank that has not reported is at the start
            slowest = Progress(0, max(p.total for p in self.latest.values()), "")
        return slowest, reporting, expected

    def __enter__(self) -> "LaunchDisplay":
        self._start = time.monotonic()
        self._plain_last = (self._start, 0.0)
        if self.console.is_terminal:
            self._bar = RichProgress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                     TimeElapsedColumn(), TextColumn("{task.fields[label]}"),
                                     console=self.console, transient=False)
            self._task = self._bar.add_task("waiting for ranks", total=None, label="")
            self._bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.stop()
        elif self._plain_pending:
            self._print(self._plain_pending)
            self._plain_pending = ""

    def _print(self, text: str, style: Optional[str] = None) -> None:
        self.console.print(text, markup=False, highlight=False, soft_wrap=True, style=style)

    def on_line(self, node: int, text: str) -> None:
        if not self.quiet:
            self._print(f"[{self.hosts[node]}] {text}" if self.multi else text)

    def on_status(self, text: str) -> None:
        self._print(f"pyep launch: {text}", style="bold yellow")

    def on_progress(self, node: int, rank: int, progress: Progress) -> None:
        self.latest[(node, rank)] = progress
        job, reporting, expected = self.job_progress()
        done, total, label = job.done, job.total, job.label
        desc = (f"{expected} rank{'s' if expected != 1 else ''}" if reporting == expected
                else f"{reporting} of {expected} ranks reporting")
        if self._bar is not None:
            self._bar.update(self._task, completed=done, total=total or None, description=desc, label=label)
            return
        frac = done / total if total else 0.0
        now = time.monotonic()
        last_t, last_f = self._plain_last
        if (done, total) == self._plain_shown:
            return
        line = (f"pyep launch: progress {done}/{total} ({100 * frac:.0f}%, {desc}, {now - self._start:.1f} s) "
                f"{label}").rstrip()
        if done == total or frac - last_f >= 0.1 or now - last_t >= _PLAIN_EVERY_S:
            self._print(line)
            self._plain_last = (now, frac)
            self._plain_shown = (done, total)
            self._plain_pending = ""
        else:
            self._plain_pending = line


@dataclass
class RankRow:
    rank: int
    node: int
    code: Optional[int]
    seconds: Optional[float]


def rank_rows(result: SuperviseResult, nprocs: List[int], static: bool) -> List[RankRow]:
    """Every rank we expected, with its reported exit (or None when it never reported one)."""
    rows: List[RankRow] = []
    if static:
        first = 0
        for node, n in enumerate(nprocs):
            for r in range(first, first + n):
                ex = result.ranks.get(r)
                rows.append(RankRow(r, node, ex.code if ex else None, ex.seconds if ex else None))
            first += n
        return rows
    for r, ex in sorted(result.ranks.items()):     # c10d: rank -> node is not known in advance
        rows.append(RankRow(r, -1, ex.code, ex.seconds))
    return rows


def _status(code: Optional[int]) -> str:
    if code is None:
        return "no report"
    if code == 0:
        return "ok"
    if code < 0:
        return f"killed (signal {-code})"
    return f"exit {code}"


def render_summary(console: Console, result: SuperviseResult, hosts: List[str], rows: List[RankRow],
                   results: List[Tuple[str, int]], run_dir: str) -> None:
    nodes = Table(title="nodes", show_edge=False)
    for col in ("node", "host", "status", "seconds", "note"):
        nodes.add_column(col)
    for out in result.nodes:
        note = "torn down by launcher" if out.torn_down else ""
        nodes.add_row(str(out.index), out.host, _status(out.returncode), f"{out.seconds:.1f}", note)
    console.print(nodes)
    ranks = Table(title="ranks", show_edge=False)
    for col in ("rank", "node", "status", "seconds"):
        ranks.add_column(col)
    for row in rows:
        ranks.add_row(str(row.rank), hosts[row.node] if row.node >= 0 else "?", _status(row.code),
                      "-" if row.seconds is None else f"{row.seconds:.1f}")
    console.print(ranks)
    if results:
        files = Table(title="results", show_edge=False)
        files.add_column("file")
        files.add_column("bytes", justify="right")
        for rel, size in results:
            files.add_row(rel, str(size))
        console.print(files)
    verdict = "[bold green]OK[/]" if result.exit_code == 0 else f"[bold red]FAILED[/] (exit {result.exit_code})"
    console.print(f"{verdict}: {escape(result.reason)} in {result.seconds:.1f} s; run directory: {escape(run_dir)}",
                  highlight=False, soft_wrap=True)     # one line: the path stays copyable
