"""RDMA device discovery from sysfs (/sys/class/infiniband), with the GPU each NIC is nearest to and
whether GPU-initiated RDMA (IBGDA) can work on it, and why not."""
from __future__ import annotations

import ipaddress
import logging
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional

from .host import HostFacts
from .sysfs import SysfsView, index_name
from .topology import Affinity, Distance, GpuInfo, PciDevice, distance, gpus, pci_device_of

log = logging.getLogger("pyep.nic")

# RoCE needs room for the GRH, UDP, BTH and extension headers inside the Ethernet MTU (the kernel's
# iboe_get_mtu rule): 96 bytes.
_ROCE_OVERHEAD = 96
IB_MTUS = (256, 512, 1024, 2048, 4096)
# Below this RLIMIT_MEMLOCK, pinning a multi-GB EP buffer and the rings fails (root with CAP_IPC_LOCK
# is exempt, but containers often drop that capability).
MEMLOCK_NEEDED = 16 << 30


@dataclass(frozen=True)
class GidEntry:
    index: int
    gid: str                      # "fe80:0000:...:1c2a", as sysfs prints it
    type: str                     # "IB", "RoCE v1" or "RoCE v2"
    netdev: Optional[str] = None
    ipv4: Optional[str] = None    # the address of an IPv4-mapped GID

    @property
    def raw(self) -> bytes:
        return bytes.fromhex(self.gid.replace(":", ""))


@dataclass
class PortInfo:
    num: int
    state: str                    # "ACTIVE", "DOWN", ...
    phys_state: str               # "LinkUp", ...
    link_layer: str               # "InfiniBand" or "Ethernet"
    rate: str                     # "400 Gb/sec (4X NDR)"
    rate_gbps: Optional[float]
    lid: int
    sm_lid: int
    netdev: Optional[str]
    netdev_mtu: Optional[int]
    active_mtu: Optional[int]     # IB MTU in bytes; None when sysfs cannot tell (IB link layer)
    gids: List[GidEntry] = field(default_factory=list)

    @property
    def active(self) -> bool:
        return self.state == "ACTIVE"

    @property
    def roce(self) -> bool:
        return self.link_layer == "Ethernet"


@dataclass
class NicInfo:
    name: str
    driver: str
    hca_type: str
    fw_ver: str
    node_guid: str
    pci: Optional[PciDevice]
    uverbs: Optional[str]                  # "uverbs0"
    ports: List[PortInfo]
    nearest_gpu: Optional[int] = None
    gpu_distance: Optional[Distance] = None
    devx: bool = False                     # an mlx5 device: DevX is the driver's interface
    devx_access: Optional[bool] = None     # the uverbs device is readable and writable; None = not checked
    ibgda_ready: bool = False
    ibgda_blockers: List[str] = field(default_factory=list)

    def to_json(self) -> Dict[str, Any]:
        d = asdict(self)
        d["gpu_distance"] = str(self.gpu_distance) if self.gpu_distance else None
        return d


@dataclass
class Host:
    nics: List[NicInfo]
    gpus: List[GpuInfo]
    affinity: Affinity
    facts: Optional[HostFacts]
    sysfs_root: str

    def nic(self, name: str) -> NicInfo:
        for n in self.nics:
            if n.name == name:
                return n
        raise ValueError(f"no RDMA device named {name!r} (found: {', '.join(n.name for n in self.nics) or 'none'})")


def _state(text: Optional[str]) -> str:
    # "4: ACTIVE" -> "ACTIVE"
    if not text:
        return "UNKNOWN"
    return text.split(":", 1)[-1].strip()


def _rate_gbps(text: str) -> Optional[float]:
    try:
        return float(text.split()[0])
    except (ValueError, IndexError):
        return None


def roce_mtu(netdev_mtu: Optional[int]) -> Optional[int]:
    if netdev_mtu is None:
        return None
    usable = netdev_mtu - _ROCE_OVERHEAD
    fits = [m for m in IB_MTUS if m <= usable]
    return fits[-1] if fits else None


def _gid_entries(view: SysfsView, base: str, link_layer: str) -> List[GidEntry]:
    out: List[GidEntry] = []
    for index in sorted(_numbered(view, f"{base}/gids")):
        name = str(index)
        gid = view.read(f"{base}/gids/{name}")
        if not gid or set(gid.replace(":", "")) <= {"0"}:
            continue  # empty slot
        if link_layer == "InfiniBand":
            gtype = "IB"
        else:
            raw = view.read(f"{base}/gid_attrs/types/{name}") or ""
            gtype = "RoCE v2" if "v2" in raw else "RoCE v1"
        ndev = view.read(f"{base}/gid_attrs/ndevs/{name}") or None
        ipv4 = None
        try:
            addr = ipaddress.IPv6Address(gid)
            if addr.ipv4_mapped is not None:
                ipv4 = str(addr.ipv4_mapped)
        except ValueError:
            log.debug("unparsable GID %r in %s", gid, base)
        out.append(GidEntry(index, gid, gtype, ndev, ipv4))
    return out


def _numbered(view: SysfsView, rel: str) -> List[int]:
    """The entries of `rel` (ports/, gids/) named by a number; others (a port directory named '²' or
    '٣') are logged and left out: the kernel writes these names in plain ASCII digits."""
    out = []
    for name in view.listdir(rel):
        num = index_name(name)
        if num is None:
            log.warning("ignoring %s/%s: not a number", rel, name)
        else:
            out.append(num)
    return out


def _port(view: SysfsView, dev: str, num: int) -> PortInfo:
    base = f"class/infiniband/{dev}/ports/{num}"
    link = view.read(f"{base}/link_layer") or "InfiniBand"
    gids = _gid_entries(view, base, link)
    netdev = next((g.netdev for g in gids if g.netdev), None)
    if netdev is None and link == "Ethernet":
        nets = view.listdir(f"class/infiniband/{dev}/device/net")
        netdev = nets[0] if nets else None
    netdev_mtu = view.read_int(f"class/net/{netdev}/mtu") if netdev else None
    rate = view.read(f"{base}/rate") or ""
    return PortInfo(num=num, state=_state(view.read(f"{base}/state")),
                    phys_state=_state(view.read(f"{base}/phys_state")), link_layer=link, rate=rate,
                    rate_gbps=_rate_gbps(rate), lid=view.read_int(f"{base}/lid", 16) or 0,
                    sm_lid=view.read_int(f"{base}/sm_lid", 16) or 0, netdev=netdev, netdev_mtu=netdev_mtu,
                    active_mtu=roce_mtu(netdev_mtu) if link == "Ethernet" else None, gids=gids)


def discover(view: SysfsView, facts: Optional[HostFacts] = None, dev_root: Optional[str] = "/dev") -> Host:
    """Every RDMA device under class/infiniband, the GPUs, their distances, and IBGDA readiness.

    `facts` (from /proc) and `dev_root` (for the uverbs permission check; None = skip) feed readiness."""
    gpu_list = gpus(view, facts.proc_root if facts else None)
    affinity = Affinity()
    nics: List[NicInfo] = []
    for name in view.listdir("class/infiniband"):
        base = f"class/infiniband/{name}"
        pci = pci_device_of(view, f"{base}/device")
        ports = [_port(view, name, num) for num in sorted(_numbered(view, f"{base}/ports"))]
        uverbs = next(iter(view.listdir(f"{base}/device/infiniband_verbs")), None)
        driver = view.basename_of_link(f"{base}/device/driver") or ""
        nic = NicInfo(name=name, driver=driver, hca_type=view.read(f"{base}/hca_type") or "",
                      fw_ver=view.read(f"{base}/fw_ver") or "", node_guid=view.read(f"{base}/node_guid") or "",
                      pci=pci, uverbs=uverbs, ports=ports, devx=driver == "mlx5_core" or name.startswith("mlx5"))
        if pci is not None:
            for g in gpu_list:
                affinity.table[(g.index, name)] = distance(g.pci, pci)
            near = affinity.nearest_gpu(name)
            if near:
                nic.nearest_gpu, nic.gpu_distance = near
        if uverbs and dev_root is not None:
            path = os.path.join(dev_root, "infiniband", uverbs)
            nic.devx_access = os.path.exists(path) and os.access(path, os.R_OK | os.W_OK)
        nic.ibgda_blockers = ibgda_blockers(nic, facts)
        nic.ibgda_ready = not nic.ibgda_blockers
        nics.append(nic)
    return Host(nics=nics, gpus=gpu_list, affinity=affinity, facts=facts, sysfs_root=view.root)


def ibgda_blockers(nic: NicInfo, facts: Optional[HostFacts]) -> List[str]:
    """What stops GPU-initiated RDMA through this NIC, in words (empty = ready as far as we can see)."""
    why: List[str] = []
    if not nic.devx:
        why.append(f"driver {nic.driver or 'unknown'} is not mlx5: no DevX")
    if nic.uverbs is None:
        why.append("no uverbs device (ib_uverbs not loaded?)")
    elif nic.devx_access is False:
        why.append(f"/dev/infiniband/{nic.uverbs} is not readable and writable by this user")
    active = [p for p in nic.ports if p.active]
    if not active:
        why.append("no ACTIVE port")
    elif all(p.roce and not any(g.type == "RoCE v2" for g in p.gids) for p in active):
        why.append("RoCE port without a RoCE v2 GID (give the interface an IP address)")
    if facts is not None:
        if not facts.nvidia_driver:
            why.append("no NVIDIA driver (/proc/driver/nvidia missing)")
        else:
            if facts.peermem is None and not facts.dmabuf:
                why.append("no nvidia_peermem and no DMA-BUF (GPU memory cannot be registered)")
            if facts.memlock_known and facts.memlock_soft is not None and facts.memlock_soft < MEMLOCK_NEEDED:
                why.append(f"memlock limit {facts.memlock_soft} bytes (needs unlimited)")
            if not facts.peer_mapping_override:
                why.append("PeerMappingOverride=1 not set (GPU cannot map the doorbell)")
    if nic.nearest_gpu is None:
        why.append("no GPU on this host")
    return why
