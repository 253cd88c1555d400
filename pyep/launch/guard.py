"""Remote end of an ssh launch: runs torchrun and tears it down when the ssh connection goes away.

    python -m pyep.launch.guard [--grace S] [--expect-gpus N] -- torchrun-argv...

Killing a local `ssh` does not reliably kill what it started on the remote host (no pty, no SIGHUP).
The launcher keeps ssh's stdin open and never writes to it; when the launcher closes it, or ssh dies,
the remote stdin reaches EOF and this guard sends SIGTERM to torchrun's process group, then SIGKILL
after the grace period. `--expect-gpus N` checks, before starting, that N GPUs are visible here, so a
node with fewer GPUs than the config says fails with a clear message instead of a CUDA error.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from typing import List, Optional

from ..config.host import count_gpus, visible_gpu_ids


def _stop(proc: subprocess.Popen, grace_s: float, reason: str) -> None:
    if proc.poll() is not None:
        return
    print(f"[pyep guard] {reason}: stopping torchrun (pid {proc.pid})", file=sys.stderr, flush=True)
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        print(f"[pyep guard] torchrun still alive after {grace_s:.0f} s: SIGKILL", file=sys.stderr, flush=True)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _check_gpus(expected: int) -> Optional[str]:
    visible = visible_gpu_ids()
    have = count_gpus()
    if visible is not None:
        bad = [v for v in visible if v.isdigit() and int(v) >= have]
        if bad:
            return f"this host has {have} GPUs; the config asks for GPU(s) {', '.join(bad)}"
    elif have < expected:
        return f"this host has {have} GPUs; the config asks for {expected}"
    return None


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    grace, expect = 15.0, 0
    while argv and argv[0] != "--":
        if argv[0] == "--grace" and len(argv) > 1:
            grace, argv = float(argv[1]), argv[2:]
        elif argv[0] == "--expect-gpus" and len(argv) > 1:
            expect, argv = int(argv[1]), argv[2:]
        else:
            print(f"pyep guard: unexpected argument {argv[0]!r}", file=sys.stderr)
            return 2
    cmd = argv[1:]
    if not cmd:
        print("usage: python -m pyep.launch.guard [--grace S] [--expect-gpus N] -- COMMAND...", file=sys.stderr)
        return 2
    if expect:
        problem = _check_gpus(expect)
        if problem:
            print(f"pyep guard: {problem}", file=sys.stderr, flush=True)
            return 2
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, start_new_session=True)
    done = threading.Event()

    def watch_stdin() -> None:
        # os.read on the raw fd: a daemon thread blocked inside sys.stdin's buffered reader would hold
        # its lock and abort the interpreter at exit.
        try:
            while os.read(0, 4096):
                pass
        except OSError:
            pass
        if not done.is_set():
            _stop(proc, grace, "connection to the launcher closed")

    def on_signal(signum: int, _frame: object) -> None:
        threading.Thread(target=_stop, args=(proc, grace, f"signal {signum}"), daemon=True).start()

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    threading.Thread(target=watch_stdin, daemon=True).start()
    code = proc.wait()
    done.set()
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    raise SystemExit(main())
