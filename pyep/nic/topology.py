"""PCIe topology from sysfs: GPUs, the PCI path of any device, and NIC<->GPU distance.

Distance classes follow NCCL's vocabulary, nearest first:
  PIX   through at most one PCIe switch (the two share a switch),
  PXB   through several PCIe bridges, without the host bridge,
  PHB   through the host bridge (same root complex, no shared switch),
  NODE  different root complexes of one NUMA node,
  SYS   across NUMA nodes (the inter-socket link).
GPUs are numbered in PCI bus order, which is nvidia-smi's order and CUDA's with
CUDA_DEVICE_ORDER=PCI_BUS_ID.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from .sysfs import SysfsView, read_attribute

NVIDIA_VENDOR = "0x10de"
GPU_CLASSES = ("0x0302", "0x0300")  # 3D controller (data-center GPUs), VGA controller
DISTANCE_CLASSES = ("PIX", "PXB", "PHB", "NODE", "SYS")
_BDF = re.compile(r"^[0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]$")


@dataclass(frozen=True)
class PciDevice:
    address: str                 # "0000:17:00.0"
    root: str                    # root complex, "pci0000:16"
    bridges: Tuple[str, ...]     # BDFs from the root port down to (and including) the device
    numa_node: int               # -1 when the platform does not say
    vendor: str = ""
    device: str = ""


@dataclass(frozen=True)
class Distance:
    kind: str                    # one of DISTANCE_CLASSES
    hops: int                    # PCIe links between the two devices (0 across root complexes)

    @property
    def rank(self) -> Tuple[int, int]:
        return DISTANCE_CLASSES.index(self.kind), self.hops

    def __str__(self) -> str:
        return f"{self.kind}/{self.hops}" if self.kind in ("PIX", "PXB", "PHB") else self.kind


@dataclass(frozen=True)
class GpuInfo:
    index: int
    pci: PciDevice
    model: str = ""


def pci_device(view: SysfsView, address: str) -> Optional[PciDevice]:
    """The PCI device at `address` ("0000:17:00.0") with its path from the root complex."""
    real = view.resolve(f"bus/pci/devices/{address}")
    if real is None:
        return None
    return _from_devices_path(view, real)


def pci_device_of(view: SysfsView, rel: str) -> Optional[PciDevice]:
    """The PCI device a sysfs node belongs to (e.g. "class/infiniband/mlx5_0/device")."""
    real = view.resolve(rel)
    return _from_devices_path(view, real) if real else None


def _from_devices_path(view: SysfsView, real: str) -> Optional[PciDevice]:
    parts = real.split("/")
    try:
        start = next(i for i, p in enumerate(parts) if p.startswith("pci") and ":" in p)
    except StopIteration:
        return None
    chain: List[str] = []
    for p in parts[start + 1:]:
        if not _BDF.match(p):
            break
        chain.append(p.lower())
    if not chain:
        return None
    base = "/".join(parts[:start + 1 + len(chain)])
    numa = view.read_int(f"{base}/numa_node")
    return PciDevice(address=chain[-1], root=parts[start], bridges=tuple(chain),
                     numa_node=numa if numa is not None else -1,
                     vendor=(view.read(f"{base}/vendor") or "").lower(),
                     device=(view.read(f"{base}/device") or "").lower())


def distance(a: PciDevice, b: PciDevice) -> Distance:
    if a.root != b.root:
        same_numa = a.numa_node >= 0 and a.numa_node == b.numa_node
        return Distance("NODE" if same_numa else "SYS", 0)
    common = 0
    for x, y in zip(a.bridges, b.bridges):
        if x != y:
            break
        common += 1
    hops = (len(a.bridges) - common) + (len(b.bridges) - common)
    if common == 0:
        return Distance("PHB", hops)
    # Below a shared switch port each side crosses one downstream port and lands on the device: four
    # links in all. More means another bridge level on the way.
    return Distance("PIX" if hops <= 4 else "PXB", hops)


def gpus(view: SysfsView, proc_root: Optional[str] = None) -> List[GpuInfo]:
    """NVIDIA GPUs on the PCI bus, numbered in bus order."""
    found: List[PciDevice] = []
    for addr in view.listdir("bus/pci/devices"):
        vendor = (view.read(f"bus/pci/devices/{addr}/vendor") or "").lower()
        cls = (view.read(f"bus/pci/devices/{addr}/class") or "").lower()
        if vendor == NVIDIA_VENDOR and cls.startswith(GPU_CLASSES):
            dev = pci_device(view, addr)
            if dev is not None:
                found.append(dev)
    found.sort(key=lambda d: d.address)
    return [GpuInfo(i, d, _gpu_model(proc_root, d.address)) for i, d in enumerate(found)]


def _gpu_model(proc_root: Optional[str], address: str) -> str:
    if not proc_root:
        return ""
    import os
    text = read_attribute(os.path.join(proc_root, "driver", "nvidia", "gpus", address, "information")) or ""
    for line in text.splitlines():
        if line.startswith("Model:"):
            return line.split(":", 1)[1].strip()
    return ""


@dataclass
class Affinity:
    """Distances between every (GPU, NIC) pair."""
    table: Dict[Tuple[int, str], Distance] = field(default_factory=dict)

    def get(self, gpu: int, nic: str) -> Optional[Distance]:
        return self.table.get((gpu, nic))

    def nearest_gpu(self, nic: str) -> Optional[Tuple[int, Distance]]:
        rows = [(d.rank, g, d) for (g, n), d in self.table.items() if n == nic]
        if not rows:
            return None
        _, g, d = min(rows)
        return g, d
