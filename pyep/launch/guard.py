"""Remote end of an ssh launch: runs torchrun and tears it down when the ssh connection goes away.

    python -m pyep.launch.guard [--grace S] [--expect-gpus N] [--env-stdin] -- torchrun-argv...

Killing a local `ssh` does not reliably kill what it started on the remote host (no pty, no SIGHUP).
The launcher keeps ssh's stdin open; when the launcher closes it, or ssh dies, the remote stdin
reaches EOF and this guard sends SIGTERM to torchrun's process group, then SIGKILL after the grace
period. `--expect-gpus N` checks, before starting, that N GPUs are visible here, so a node with fewer
GPUs than the config says fails with a clear message instead of a CUDA error.

`--env-stdin`: the first line the launcher writes on stdin is the node's environment and the job
secret (stdin_payload), so neither is on the ssh command line, where other users of either host can
read it (ps, /proc). The secret goes into a 0600 file in a private directory, removed at exit; torchrun
and the ranks get its path in PYEP_JOB_SECRET_FILE.
"""
from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from typing import Dict, List, Optional, Tuple

from ..config.host import count_gpus, visible_gpu_ids
from .secret import SECRET_FILE_VAR, remove_secret_dir, temp_job_secret

MAX_STDIN_LINE = 1 << 20
STDIN_WAIT_S = 120.0
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def stdin_payload(env: Dict[str, str], secret: Optional[bytes]) -> bytes:
    """The line the launcher writes on an ssh node's stdin."""
    return json.dumps({"env": env, "job_secret": secret.hex() if secret is not None else None}).encode() + b"\n"


def parse_stdin_payload(line: bytes) -> Tuple[Dict[str, str], Optional[bytes]]:
    """(environment, secret) from stdin_payload's line; ValueError saying what is wrong."""
    try:
        doc = json.loads(line.decode("utf-8"))
    except (ValueError, RecursionError):
        raise ValueError("the launcher's first stdin line is not a JSON document") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("env"), dict):
        raise ValueError("the launcher's first stdin line has no 'env' object")
    env: Dict[str, str] = {}
    for k, v in doc["env"].items():
        if not isinstance(v, str) or not _NAME.fullmatch(k) or "\0" in v:
            raise ValueError(f"environment entry {k!r} is not NAME=string")
        env[k] = v
    hexed = doc.get("job_secret")
    if hexed is None:
        return env, None
    if not isinstance(hexed, str):
        raise ValueError("'job_secret' is not a hex string")
    try:
        return env, bytes.fromhex(hexed)
    except ValueError:
        raise ValueError("'job_secret' is not a hex string") from None


def read_first_line(fd: int, timeout_s: float = STDIN_WAIT_S, limit: int = MAX_STDIN_LINE) -> bytes:
    """The first line on `fd` (bounded in size and time); ValueError when it does not come."""
    deadline = time.monotonic() + timeout_s
    buf = b""
    while b"\n" not in buf:
        left = deadline - time.monotonic()
        if left <= 0:
            raise ValueError(f"the launcher sent no environment on stdin within {timeout_s:g} s")
        ready, _, _ = select.select([fd], [], [], left)
        if not ready:
            continue
        chunk = os.read(fd, 65536)
        if not chunk:
            raise ValueError("stdin closed before the launcher sent the environment")
        buf += chunk
        if len(buf) > limit:
            raise ValueError(f"the environment line on stdin is longer than {limit} bytes")
    return buf.split(b"\n", 1)[0]


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


def _check_gpus(expected: int, env: Dict[str, str]) -> Optional[str]:
    visible = visible_gpu_ids(env)
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
    grace, expect, env_stdin = 15.0, 0, False
    while argv and argv[0] != "--":
        if argv[0] == "--grace" and len(argv) > 1:
            grace, argv = float(argv[1]), argv[2:]
        elif argv[0] == "--expect-gpus" and len(argv) > 1:
            expect, argv = int(argv[1]), argv[2:]
        elif argv[0] == "--env-stdin":
            env_stdin, argv = True, argv[1:]
        else:
            print(f"pyep guard: unexpected argument {argv[0]!r}", file=sys.stderr)
            return 2
    cmd = argv[1:]
    if not cmd:
        print("usage: python -m pyep.launch.guard [--grace S] [--expect-gpus N] -- COMMAND...", file=sys.stderr)
        return 2
    env = dict(os.environ)
    secret_file = None
    if env_stdin:
        try:
            extra, secret = parse_stdin_payload(read_first_line(0))
        except (ValueError, OSError) as exc:
            print(f"pyep guard: {exc}", file=sys.stderr, flush=True)
            return 2
        env.update(extra)
        if secret is not None:
            secret_file = temp_job_secret(secret)
            env[SECRET_FILE_VAR] = secret_file
    try:
        return _run(cmd, env, grace, expect)
    finally:
        if secret_file is not None:
            remove_secret_dir(secret_file, levels=2)


def _run(cmd: List[str], env: Dict[str, str], grace: float, expect: int) -> int:
    if expect:
        problem = _check_gpus(expect, env)   # the node's CUDA_VISIBLE_DEVICES may come on stdin
        if problem:
            print(f"pyep guard: {problem}", file=sys.stderr, flush=True)
            return 2
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, start_new_session=True, env=env)
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
