"""NIC discovery and selection for the IBGDA transport: what RDMA devices this host has (sysfs), how
far each is from each GPU (PCIe), whether GPU-initiated RDMA can work on it (driver facts from /proc),
which NIC/port/GID each GPU uses, and the NCCL_IB_* compatible settings. Nothing here needs rdma-core
or a GPU, so it runs on saved trees (`pyep nic --sysfs DIR`) as well as on the live host."""
from __future__ import annotations

from .discover import GidEntry, Host, NicInfo, PortInfo, discover, ibgda_blockers
from .env import NicSettings, Resolved, resolve
from .host import HostFacts, read_host_facts
from .select import Choice, HcaFilter, choose_gid, choose_nics, parse_hca_filter
from .sysfs import SysfsView
from .topology import Distance, GpuInfo, PciDevice, distance


def load_host(sysfs: str = "/sys", proc: str = "/proc", dev: str = "/dev") -> Host:
    """Discover the host (or a saved tree) in one call."""
    return discover(SysfsView(sysfs), read_host_facts(proc), dev)


__all__ = ["Choice", "Distance", "GidEntry", "GpuInfo", "HcaFilter", "Host", "HostFacts", "NicInfo",
           "NicSettings", "PciDevice", "PortInfo", "Resolved", "SysfsView", "choose_gid", "choose_nics",
           "discover", "distance", "ibgda_blockers", "load_host", "parse_hca_filter", "read_host_facts",
           "resolve"]
