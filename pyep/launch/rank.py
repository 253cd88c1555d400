"""Per-rank wrapper that torchrun starts instead of the workload itself.

    python -m pyep.launch.rank module NAME [ARGS...]
    python -m pyep.launch.rank script PATH [ARGS...]

It runs the workload as a child process and, for every output line, writes it to
`$PYEP_RUN_DIR/logs/rank-NNNNN.log` and prints it as `[rank R] line`, so the launcher knows which rank
said what no matter how torchrun interleaves streams. At the end it prints
`PYEP_RANK_EXIT rank=R code=C seconds=S` and exits with the workload's status.

Teardown: SIGTERM/SIGINT/SIGHUP are passed to the workload, which is killed `--grace` seconds later if
still alive. Both the wrapper and the workload ask the kernel to be sent SIGTERM when their parent dies
(PR_SET_PDEATHSIG), so a SIGKILLed torchrun never leaves ranks behind.
"""
from __future__ import annotations

import ctypes
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import List, Optional

RANK_LINE = re.compile(r"\[rank (\d+)\] ?(.*)")
EXIT_LINE = re.compile(r"PYEP_RANK_EXIT rank=(\d+) code=(-?\d+) seconds=([0-9.]+)")
_PR_SET_PDEATHSIG = 1
_DEFAULT_GRACE_S = 10.0


@dataclass(frozen=True)
class RankExit:
    rank: int
    code: int
    seconds: float


def parse_rank_line(line: str) -> Optional[tuple]:
    """`[rank R] text` -> (R, text); None for other lines (torchrun's own output)."""
    m = RANK_LINE.fullmatch(line)
    return (int(m.group(1)), m.group(2)) if m else None


def parse_exit(text: str) -> Optional[RankExit]:
    m = EXIT_LINE.fullmatch(text.strip())
    return RankExit(int(m.group(1)), int(m.group(2)), float(m.group(3))) if m else None


def set_parent_death_signal(sig: int = signal.SIGTERM) -> bool:
    """Linux only; returns False where prctl is unavailable (the launcher's own teardown still works)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def log_path(run_dir: str, rank: int) -> str:
    return os.path.join(run_dir, "logs", f"rank-{rank:05d}.log")


def child_argv(kind: str, target: str, args: List[str]) -> List[str]:
    if kind == "module":
        return [sys.executable, "-u", "-m", target, *args]
    if kind == "script":
        return [sys.executable, "-u", target, *args]
    raise ValueError(f"workload kind must be 'module' or 'script', got {kind!r}")


def run(kind: str, target: str, args: List[str], grace_s: float = _DEFAULT_GRACE_S) -> int:
    rank = int(os.environ.get("RANK", "0"))
    parent = os.getppid()
    set_parent_death_signal()
    if os.getppid() != parent:          # the parent died before prctl took effect
        return 143
    run_dir = os.environ.get("PYEP_RUN_DIR")
    log = None
    if run_dir:
        os.makedirs(os.path.join(run_dir, "logs"), exist_ok=True)
        log = open(log_path(run_dir, rank), "a", encoding="utf-8", errors="replace")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    # The workload imports the pyep this wrapper came from (a checkout on a node need not be installed).
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if root not in paths:
        env["PYTHONPATH"] = os.pathsep.join([root, *paths])
    start = time.monotonic()
    child = subprocess.Popen(child_argv(kind, target, args), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL, env=env, preexec_fn=set_parent_death_signal)
    killer: List[threading.Timer] = []

    def forward(signum: int, _frame: object) -> None:
        if child.poll() is None:
            try:
                child.send_signal(signum)
            except ProcessLookupError:
                pass
        if not killer:       # escalate once, `grace_s` after the first signal
            t = threading.Timer(grace_s, lambda: child.poll() is None and child.kill())
            t.daemon = True
            t.start()
            killer.append(t)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)
    prefix = f"[rank {rank}] "
    assert child.stdout is not None
    for raw in iter(child.stdout.readline, b""):
        text = raw.decode("utf-8", errors="replace").rstrip("\r\n")
        if log is not None:
            log.write(text + "\n")
            log.flush()
        try:
            sys.stdout.write(prefix + text + "\n")
            sys.stdout.flush()
        except BrokenPipeError:      # the launcher went away; keep logging, the workload decides
            pass
    code = child.wait()
    seconds = time.monotonic() - start
    if log is not None:
        log.write(f"[pyep] exit code {code} after {seconds:.2f} s\n")
        log.close()
    try:
        sys.stdout.write(f"{prefix}PYEP_RANK_EXIT rank={rank} code={code} seconds={seconds:.3f}\n")
        sys.stdout.flush()
    except BrokenPipeError:
        pass
    return code if code >= 0 else 128 - code


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    grace = _DEFAULT_GRACE_S
    if len(argv) >= 2 and argv[0] == "--grace":
        grace = float(argv[1])
        argv = argv[2:]
    if len(argv) < 2 or argv[0] not in ("module", "script"):
        print("usage: python -m pyep.launch.rank [--grace S] {module NAME|script PATH} [ARGS...]", file=sys.stderr)
        return 2
    return run(argv[0], argv[1], argv[2:], grace)


if __name__ == "__main__":
    raise SystemExit(main())
