"""Private files of a job: the job secret that authenticates every store record (pyep.ep.records), and
the files that hold the config's `env:` values. A job's secret lives in a 0600 file inside a 0700
directory (`<run dir>/private/job.secret`, or a temporary directory for `pyep drill`), and the ranks get
its path in PYEP_JOB_SECRET_FILE: the secret itself is never on a command line nor in a file others
can read. For ssh launches the launcher sends it on the connection's stdin (pyep.launch.guard writes it
to a private file on the node).
"""
from __future__ import annotations

import os
import shutil
import tempfile
from typing import Optional

from ..ep.records import SECRET_FILE_VAR, new_job_secret

PRIVATE_DIR = "private"
SECRET_FILE = "job.secret"

__all__ = ["SECRET_FILE_VAR", "secret_path", "create_job_secret", "temp_job_secret", "remove_secret_dir",
           "write_private", "write_secret_file"]


def secret_path(run_dir: str) -> str:
    """Where a run's job secret lives (as that side sees the run directory)."""
    return os.path.join(run_dir, PRIVATE_DIR, SECRET_FILE)


def _private_dir(path: str) -> None:
    os.mkdir(path, 0o700)
    os.chmod(path, 0o700)        # whatever the umask said


def write_private(path: str, data: bytes) -> None:
    """Write a file only this user may read: created 0600 (never through a link), its mode set again
    for a file that was there before."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)


def write_secret_file(directory: str, secret: bytes) -> str:
    """`directory` (created 0700, must not exist) holding the secret as hex in a 0600 file; its path."""
    _private_dir(directory)
    path = os.path.join(directory, SECRET_FILE)
    write_private(path, secret.hex().encode() + b"\n")
    return path


def create_job_secret(run_dir: str, secret: Optional[bytes] = None) -> str:
    """A fresh secret for the job of `run_dir` in `<run_dir>/private/job.secret`; returns the path."""
    return write_secret_file(os.path.join(run_dir, PRIVATE_DIR), new_job_secret() if secret is None else secret)


def temp_job_secret(secret: Optional[bytes] = None) -> str:
    """A fresh secret in a new private temporary directory (remove it with remove_secret_dir)."""
    parent = tempfile.mkdtemp(prefix="pyep-job-")       # 0700
    return write_secret_file(os.path.join(parent, PRIVATE_DIR), new_job_secret() if secret is None else secret)


def remove_secret_dir(path: str, levels: int = 1) -> None:
    """Remove a secret file and the private directory (levels=2: and the temporary one above) it is in."""
    top = path
    for _ in range(levels):
        top = os.path.dirname(top)
    shutil.rmtree(top, ignore_errors=True)
