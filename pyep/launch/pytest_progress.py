"""pytest plugin that reports test progress in the PYEP_PROGRESS protocol.

The "tests" workload runs `python -m pytest -p pyep.launch.pytest_progress ...`, so `pyep launch`
shows a bar of finished tests out of collected ones. Harmless when nothing listens.
"""
from __future__ import annotations

import sys
from typing import Any, Optional

from .progress import format_progress


class ProgressReporter:
    """Counts finished tests of one pytest session (state lives on the instance pytest registers)."""

    def __init__(self, config: Any) -> None:
        self.config = config
        self.total = 0
        self.done = 0

    def _emit(self, label: str) -> None:
        line = format_progress(self.done, self.total, label)
        # pytest captures stdout while tests run; its terminal reporter writes to the real stream.
        tr: Optional[Any] = self.config.pluginmanager.get_plugin("terminalreporter")
        if tr is not None:
            # Leading newline: in -q mode the cursor sits after a row of progress dots.
            tr.write("\n" + line + "\n", flush=True)
        else:
            sys.__stdout__.write(line + "\n")
            sys.__stdout__.flush()

    def pytest_collection_finish(self, session: Any) -> None:
        # After deselection (-k, -m), unlike pytest_collection_modifyitems.
        self.total = len(session.items)
        self._emit("collected")

    def pytest_runtest_logfinish(self, nodeid: str, location: Any) -> None:
        if self.total:
            self.done = min(self.done + 1, self.total)
            self._emit(nodeid)


def pytest_configure(config: Any) -> None:
    config.pluginmanager.register(ProgressReporter(config), "pyep-progress-reporter")
