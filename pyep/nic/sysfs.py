"""Read-only view of a sysfs tree: the live /sys, or a saved copy (`--sysfs DIR`, test fixtures).

A saved tree keeps sysfs's symlinks (class/infiniband/mlx5_0 -> ../../devices/pci.../infiniband/mlx5_0).
Links are resolved inside the tree: relative ones as usual, absolute ones ("/sys/devices/...", as a
plain `cp -a` of /sys would keep them) re-rooted at the tree, so a fixture never reads the host's /sys.

A saved tree is input: an attribute is read only when it is a regular file, at most MAX_ATTRIBUTE_BYTES,
without ever blocking (a FIFO or a device in the tree reads as missing, with a warning), and directory
entries whose names are not UTF-8 are skipped (no sysfs name is; they could not be printed).
"""
from __future__ import annotations

import logging
import os
from typing import List, Optional

from .._input import FileRejected, parse_uint, read_bytes

log = logging.getLogger("pyep.nic")

_MAX_LINKS = 64
# A sysfs attribute is one page (PAGE_SIZE); 64 KiB leaves room for the largest and no more.
MAX_ATTRIBUTE_BYTES = 1 << 16


def read_attribute(path: str, limit: int = MAX_ATTRIBUTE_BYTES) -> Optional[str]:
    """A sysfs/procfs file's text, undecodable bytes and control characters (a terminal escape planted
    in a saved tree) replaced by U+FFFD; None when missing, unreadable (sysfs denies some attributes),
    not a regular file or larger than `limit`."""
    try:
        raw = read_bytes(path, limit)
    except FileRejected as exc:
        # The live /sys denies or fails some reads (EACCES, EINVAL on a down port): routine. A FIFO, a
        # device or an oversized file is not something sysfs holds: say so.
        log.log(logging.DEBUG if exc.os_error else logging.WARNING, "ignoring %s", exc)
        return None
    text = raw.decode("utf-8", errors="replace")
    return "".join(ch if ch.isprintable() or ch in "\n\t" else "\ufffd" for ch in text)


def index_name(name: str, max_digits: int = 6) -> Optional[int]:
    """A directory name that is a number as the kernel writes it (ports/1, gids/0) as an int; None for
    anything else: '²', '٣', '01', ' 1'."""
    num = parse_uint(name, max_digits)
    return num if num is not None and str(num) == name else None


class SysfsView:
    def __init__(self, root: str = "/sys") -> None:
        if not isinstance(root, str) or not root:
            raise TypeError("sysfs root must be a non-empty path string")
        if not os.path.isdir(root):
            raise ValueError(f"sysfs root {root!r} is not a directory")
        self.root = os.path.abspath(root)
        self.live = self.root == "/sys"

    def _abs(self, rel: str) -> str:
        return os.path.join(self.root, rel.lstrip("/"))

    def resolve(self, rel: str) -> Optional[str]:
        """`rel` with every symlink followed, as a path relative to the root; None if it does not exist."""
        parts = [p for p in rel.strip("/").split("/") if p]
        done: List[str] = []
        hops = 0
        while parts:
            part = parts.pop(0)
            if part == ".":
                continue
            if part == "..":
                if done:
                    done.pop()
                continue
            cur = os.path.join(self.root, *done, part)
            if os.path.islink(cur):
                hops += 1
                if hops > _MAX_LINKS:
                    return None
                target = os.readlink(cur)
                if target.startswith("/"):
                    target = target[len("/sys"):] if target.startswith("/sys/") or target == "/sys" else target
                    done = []
                parts = [p for p in target.split("/") if p] + parts
                continue
            if not os.path.lexists(cur):
                return None
            done.append(part)
        return "/".join(done)

    def exists(self, rel: str) -> bool:
        return self.resolve(rel) is not None

    def read(self, rel: str) -> Optional[str]:
        """File contents, stripped; None when missing or unreadable (sysfs denies some attributes)."""
        real = self.resolve(rel)
        if real is None:
            return None
        text = read_attribute(os.path.join(self.root, real))
        return None if text is None else text.strip()

    def read_int(self, rel: str, base: int = 10) -> Optional[int]:
        text = self.read(rel)
        if text is None:
            return None
        try:
            return int(text, base)
        except ValueError:
            return None

    def listdir(self, rel: str) -> List[str]:
        real = self.resolve(rel)
        if real is None:
            return []
        try:
            names = os.listdir(os.path.join(self.root, real))
        except OSError:
            return []
        return sorted(n for n in names if _utf8(n))

    def basename_of_link(self, rel: str) -> Optional[str]:
        real = self.resolve(rel)
        return real.rsplit("/", 1)[-1] if real else None


def _utf8(name: str) -> bool:
    try:
        os.fsencode(name).decode("utf-8")
        return True
    except UnicodeDecodeError:
        log.warning("ignoring a sysfs entry whose name is not UTF-8: %r", name)
        return False
