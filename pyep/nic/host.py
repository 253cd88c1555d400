"""Driver-side facts that decide whether GPU-initiated RDMA can work on this host, read from /proc
(or a saved copy, `--proc DIR`): GPU memory registration (nvidia_peermem, or DMA-BUF with the open GPU
kernel modules on Linux >= 5.12), the NVIDIA registry keys, and the memlock limit."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

from .._input import parse_uint
from .sysfs import read_attribute

PEERMEM_MODULES = ("nvidia_peermem", "nv_peer_mem")
DMABUF_MIN_KERNEL = (5, 12)


@dataclass(frozen=True)
class HostFacts:
    proc_root: str
    modules: Tuple[str, ...]                 # loaded kernel modules
    kernel: Optional[Tuple[int, int]]        # (major, minor) of the running kernel
    kernel_release: str
    nvidia_version: str                      # first line of /proc/driver/nvidia/version, "" without driver
    open_kernel_modules: bool                # the open GPU kernel modules (needed for DMA-BUF of GPU memory)
    registry: Dict[str, str] = field(default_factory=dict)  # NVreg RegistryDwords, key -> value
    memlock_soft: Optional[int] = None       # bytes; None = unlimited
    memlock_hard: Optional[int] = None
    memlock_known: bool = False

    @property
    def nvidia_driver(self) -> bool:
        return bool(self.nvidia_version)

    @property
    def peermem(self) -> Optional[str]:
        return next((m for m in PEERMEM_MODULES if m in self.modules), None)

    @property
    def dmabuf(self) -> bool:
        return self.open_kernel_modules and self.kernel is not None and self.kernel >= DMABUF_MIN_KERNEL

    def regkey(self, name: str) -> Optional[str]:
        return self.registry.get(name)

    @property
    def peer_mapping_override(self) -> bool:
        return self.regkey("PeerMappingOverride") == "1"


# /proc/modules of a busy host is tens of KiB; a saved copy larger than this is not a /proc file.
_MAX_PROC_FILE = 1 << 20


def _read(path: str) -> Optional[str]:
    return read_attribute(path, _MAX_PROC_FILE)


def parse_registry_dwords(text: str) -> Dict[str, str]:
    """`RegistryDwords: "PeerMappingOverride=1;EnableStreamMemOPs=1"` (from the driver's params) -> dict."""
    out: Dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if not sep or key.strip() != "RegistryDwords":
            continue
        for item in value.strip().strip('"').split(";"):
            name, eq, val = item.partition("=")
            if eq and name.strip():
                out[name.strip()] = val.strip()
    return out


def parse_memlock(limits_text: str) -> Tuple[Optional[int], Optional[int], bool]:
    """(soft, hard, found) from /proc/<pid>/limits; None = unlimited."""
    for line in limits_text.splitlines():
        if line.startswith("Max locked memory"):
            fields = line[len("Max locked memory"):].split()
            conv = [None if f == "unlimited" else parse_uint(f) for f in fields[:2]]
            if len(fields) >= 2 and all(c is not None or f == "unlimited" for c, f in zip(conv, fields)):
                return conv[0], conv[1], True
    return None, None, False


def read_host_facts(proc_root: str = "/proc") -> HostFacts:
    if not os.path.isdir(proc_root):
        raise ValueError(f"proc root {proc_root!r} is not a directory")
    modules = tuple(line.split()[0] for line in (_read(os.path.join(proc_root, "modules")) or "").splitlines()
                    if line.strip())
    release = (_read(os.path.join(proc_root, "sys", "kernel", "osrelease")) or "").strip()
    if not release and proc_root == "/proc":
        release = os.uname().release
    m = re.match(r"([0-9]{1,6})\.([0-9]{1,6})", release)
    kernel = (int(m.group(1)), int(m.group(2))) if m else None
    version = (_read(os.path.join(proc_root, "driver", "nvidia", "version")) or "").strip()
    first = version.splitlines()[0] if version else ""
    registry = parse_registry_dwords(_read(os.path.join(proc_root, "driver", "nvidia", "params")) or "")
    if proc_root == "/proc":
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        memlock = (None if soft == resource.RLIM_INFINITY else soft,
                   None if hard == resource.RLIM_INFINITY else hard, True)
    else:
        memlock = parse_memlock(_read(os.path.join(proc_root, "self", "limits")) or "")
    return HostFacts(proc_root=proc_root, modules=modules, kernel=kernel, kernel_release=release,
                     nvidia_version=first, open_kernel_modules="Open Kernel Module" in first, registry=registry,
                     memlock_soft=memlock[0], memlock_hard=memlock[1], memlock_known=memlock[2])
