"""Reading input pyep does not control: files named on a command line or found in saved trees (configs,
QP dumps, sysfs/procfs copies) and the numbers written in them.

`read_bytes` / `read_text` open only regular files and never block: a FIFO, a device, a socket or a
directory where a file is expected is refused before it is read (a FIFO in a saved sysfs tree would
otherwise hang the reader forever), reading stops one byte past `limit`, and text must be UTF-8.
Every refusal is a `FileRejected` (a ValueError) naming the path and the reason, never a raw OSError or
UnicodeDecodeError. `parse_uint` accepts ASCII digits only: `str.isdigit()` and `\\d` also accept
'²' (which int() rejects) and '٣' (which int() reads as 3), so a name or value checked with them
either crashes int() or means something other than what it shows.
"""
from __future__ import annotations

import os
import re
import stat
from typing import Optional

_DIGITS = re.compile(r"[0-9]+")
_CHUNK = 1 << 16


class FileRejected(ValueError):
    """A file that cannot be used as input: missing, not a regular file, unreadable, too large, or not
    UTF-8 text. `path` and `reason` are the two halves of the message; `os_error` says the OS refused
    (missing, permission, I/O error) rather than pyep (the file's kind, size or encoding)."""

    def __init__(self, path: str, reason: str, os_error: bool = False) -> None:
        self.path, self.reason, self.os_error = path, reason, os_error
        super().__init__(f"{path}: {reason}")


def parse_uint(text: str, max_digits: int = 19) -> Optional[int]:
    """`text` (surrounding whitespace ignored) as a non-negative decimal int; None unless it is 1 to
    `max_digits` ASCII digits (the bound keeps int() far from its 4300-digit limit and callers from
    numbers no field can hold)."""
    if not isinstance(text, str):
        return None
    t = text.strip()
    if not 0 < len(t) <= max_digits or not _DIGITS.fullmatch(t):
        return None
    return int(t)


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "is a directory, not a file"
    if stat.S_ISFIFO(mode):
        return "is a FIFO, not a regular file"
    if stat.S_ISSOCK(mode):
        return "is a socket, not a regular file"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "is a device, not a regular file"
    return "is not a regular file"


def _os_reason(exc: OSError) -> str:
    if isinstance(exc, FileNotFoundError):
        return "no such file"
    if isinstance(exc, PermissionError):
        return "permission denied"
    return exc.strerror or type(exc).__name__


def read_bytes(path: str, limit: int, follow_symlinks: bool = True) -> bytes:
    """The contents of the regular file `path`, at most `limit` bytes; FileRejected otherwise."""
    if not isinstance(path, str) or not path:
        raise FileRejected(repr(path), "a path must be a non-empty string")
    try:
        # stat before open: opening a FIFO or a device may block or have side effects.
        st = os.stat(path, follow_symlinks=follow_symlinks)
        if not stat.S_ISREG(st.st_mode):
            raise FileRejected(path, _kind(st.st_mode))
        flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow_symlinks else os.O_NOFOLLOW)
        fd = os.open(path, flags)
    except OSError as exc:
        raise FileRejected(path, _os_reason(exc), os_error=True) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):      # swapped between the stat and the open
            raise FileRejected(path, _kind(st.st_mode))
        chunks, got = [], 0
        while got <= limit:
            # Not st_size: sysfs and procfs report 4096 or 0 whatever the attribute holds.
            chunk = os.read(fd, min(_CHUNK, limit + 1 - got))
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
    except OSError as exc:
        raise FileRejected(path, _os_reason(exc), os_error=True) from None
    finally:
        os.close(fd)
    if got > limit:
        raise FileRejected(path, f"is larger than the limit of {limit} bytes")
    return b"".join(chunks)


def decode_text(raw: bytes, where: str) -> str:
    """UTF-8 text of `raw`; FileRejected naming `where` and the first bad byte."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise FileRejected(where, f"is not UTF-8 text (byte {exc.start} is {raw[exc.start]:#04x})") from None


def read_text(path: str, limit: int, follow_symlinks: bool = True) -> str:
    """`read_bytes` decoded as UTF-8."""
    return decode_text(read_bytes(path, limit, follow_symlinks), path)
