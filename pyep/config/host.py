"""Facts about the machine `pyep launch` runs on, used to validate configs before anything starts.

Detection never imports torch (that costs seconds and may initialise CUDA): GPUs are counted with
nvidia-smi, falling back to the driver's /proc entries. Tests pass a HostFacts of their own.
"""
from __future__ import annotations

import logging
import os
import re
import shutil
import socket
import subprocess
from dataclasses import dataclass, field
from typing import FrozenSet, List, Optional

log = logging.getLogger("pyep.config")

_NVIDIA_SMI_TIMEOUT_S = 20.0


def count_gpus() -> int:
    """Physical GPUs of this machine (ignores CUDA_VISIBLE_DEVICES)."""
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "--query-gpu=index", "--format=csv,noheader"], capture_output=True,
                                 text=True, timeout=_NVIDIA_SMI_TIMEOUT_S, check=False)
            if out.returncode == 0:
                return len([ln for ln in out.stdout.splitlines() if ln.strip()])
            log.info("nvidia-smi failed (%d): %s", out.returncode, out.stderr.strip())
        except subprocess.TimeoutExpired:
            log.warning("nvidia-smi did not answer within %.0f s; counting GPUs from /proc", _NVIDIA_SMI_TIMEOUT_S)
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return 0


def visible_gpu_ids(env: Optional[dict] = None) -> Optional[List[str]]:
    """The CUDA_VISIBLE_DEVICES entries this process was given, or None when it is unset."""
    raw = (env if env is not None else os.environ).get("CUDA_VISIBLE_DEVICES")
    if raw is None:
        return None
    return [p.strip() for p in raw.split(",") if p.strip()]


def _rdma_devices(sysfs: str = "/sys/class/infiniband") -> Optional[FrozenSet[str]]:
    try:
        return frozenset(os.listdir(sysfs))
    except OSError:
        return None


def _local_names() -> FrozenSet[str]:
    names = {"localhost", "127.0.0.1", "::1", "localhost.localdomain"}
    try:
        hn = socket.gethostname()
        names.add(hn)
        names.add(hn.split(".")[0])
        names.add(socket.getfqdn())
    except OSError:
        pass
    return frozenset(n for n in names if n)


@dataclass(frozen=True)
class HostFacts:
    """gpus: how many GPUs this process may use; rdma_devices: None when sysfs has no RDMA class."""
    gpus: int
    names: FrozenSet[str] = field(default_factory=_local_names)
    rdma_devices: Optional[FrozenSet[str]] = None
    cwd: str = field(default_factory=os.getcwd)

    def is_local(self, host: str) -> bool:
        return host in self.names

    @classmethod
    def detect(cls) -> "HostFacts":
        visible = visible_gpu_ids()
        gpus = count_gpus() if visible is None else min(len(visible), count_gpus())
        return cls(gpus=gpus, rdma_devices=_rdma_devices())


_HOST_LABEL = r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)"
HOSTNAME_RE = re.compile(rf"{_HOST_LABEL}(\.{_HOST_LABEL})*\.?")
_OCTET = r"(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"      # ASCII digits: \d also takes '٣'
IPV4_RE = re.compile(rf"{_OCTET}(\.{_OCTET}){{3}}")


def valid_host(host: str) -> bool:
    """A DNS name, an IPv4 address or a bracket-free IPv6 address. Nothing that a shell or ssh could
    read as an option or a metacharacter gets through."""
    if not host or len(host) > 253 or host.startswith("-"):
        return False
    if IPV4_RE.fullmatch(host) or HOSTNAME_RE.fullmatch(host):
        return True
    if ":" in host:
        try:
            socket.inet_pton(socket.AF_INET6, host)
            return True
        except OSError:
            return False
    return False
