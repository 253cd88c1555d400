"""Helpers of the hostile-input suites (tests/test_hostile_*.py): run `pyep ...` in this process or in a
child (for inputs that used to hang), and the shape of a refusal: exit status 2, a one-line message that
names the problem, no traceback."""
from __future__ import annotations

import io
import os
import subprocess
import sys
from typing import List, Tuple

from pytest import CaptureFixture, MonkeyPatch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOSTS = os.path.join(ROOT, "tests", "fixtures", "hosts")


def run_cli(argv: List[str], monkeypatch: MonkeyPatch, capsys: CaptureFixture[str],
            stdin: bytes = b"") -> Tuple[int, str, str]:
    """`pyep ARGV` in this process: (exit status, stdout, stderr). An exception escaping main() fails the
    test with its traceback, which is what the suites guard against."""
    import pyep.cli as cli
    fake = io.TextIOWrapper(io.BytesIO(stdin), encoding="utf-8")
    monkeypatch.setattr(sys, "stdin", fake)
    try:
        rc = cli.main(argv)
    except SystemExit as exc:     # argparse's own refusals
        rc = exc.code if isinstance(exc.code, int) else 2
    out, err = capsys.readouterr()
    return rc, out, err


def run_child(argv: List[str], timeout_s: float = 120.0) -> "subprocess.CompletedProcess[str]":
    """`python -m pyep ARGV` in a child with a bound: an input that hangs the reader fails the test
    instead of hanging the suite."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "pyep", *argv], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)


def assert_refused(rc: int, err: str, *needles: str) -> None:
    """Exit status 2 and a last stderr line naming every needle, without a traceback."""
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert rc == 2 and lines, (rc, err)
    for needle in needles:
        assert needle in lines[-1], (needle, err)
