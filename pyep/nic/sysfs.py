"""Read-only view of a sysfs tree: the live /sys, or a saved copy (`--sysfs DIR`, test fixtures).

A saved tree keeps sysfs's symlinks (class/infiniband/mlx5_0 -> ../../devices/pci.../infiniband/mlx5_0).
Links are resolved inside the tree: relative ones as usual, absolute ones ("/sys/devices/...", as a
plain `cp -a` of /sys would keep them) re-rooted at the tree, so a fixture never reads the host's /sys.
"""
from __future__ import annotations

import os
from typing import List, Optional

_MAX_LINKS = 64


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
        try:
            with open(os.path.join(self.root, real), "r", encoding="utf-8", errors="replace") as f:
                return f.read().strip()
        except OSError:
            return None

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
            return sorted(os.listdir(os.path.join(self.root, real)))
        except OSError:
            return []

    def basename_of_link(self, rel: str) -> Optional[str]:
        real = self.resolve(rel)
        return real.rsplit("/", 1)[-1] if real else None
