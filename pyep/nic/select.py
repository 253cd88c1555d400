"""Which NIC (and port, and GID) a GPU uses.

- An explicit device name ("mlx5_3"), or an NCCL_IB_HCA-style filter: a comma list of name[:port];
  a leading "^" excludes the listed devices instead of selecting them; a leading "=" (after any "^")
  makes names match exactly instead of as prefixes ("mlx5_1" as a prefix also matches "mlx5_10").
- Otherwise automatic: each GPU gets the nearest ACTIVE port on the PCIe tree (PIX < PXB < PHB < NODE
  < SYS, then fewer hops); GPUs that tie for the same nearest NICs are spread over them, so eight GPUs
  never all pick mlx5_0.
- GID: an explicit index, else on RoCE the first RoCE v2 GID with an IPv4-mapped address, then any
  RoCE v2 GID, then RoCE v1; on InfiniBand index 0.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from .._input import parse_uint
from .discover import GidEntry, Host, NicInfo, PortInfo
from .topology import Distance


@dataclass(frozen=True)
class HcaFilter:
    exclude: bool
    exact: bool
    entries: Tuple[Tuple[str, Optional[int]], ...]   # (name, port or None)

    def matches(self, name: str, port: int) -> bool:
        hit = any((name == n if self.exact else name.startswith(n)) and (p is None or p == port)
                  for n, p in self.entries)
        return hit != self.exclude


def parse_hca_filter(text: str) -> HcaFilter:
    """NCCL_IB_HCA syntax: "[^][=]name[:port][,name[:port]...]". ValueError on malformed text."""
    if not isinstance(text, str):
        raise TypeError(f"HCA filter must be a string, got {type(text).__name__}")
    s = text.strip()
    exclude = s.startswith("^")
    s = s[1:] if exclude else s
    exact = s.startswith("=")
    s = s[1:] if exact else s
    entries: List[Tuple[str, Optional[int]]] = []
    for item in s.split(","):
        item = item.strip()
        if not item:
            continue
        name, sep, port = item.partition(":")
        name = name.strip()
        if not name or any(c.isspace() for c in name) or name.startswith(("^", "=")):
            raise ValueError(f"HCA filter {text!r}: bad device name in {item!r}")
        if sep:
            num = parse_uint(port, 3)
            if num is None or not 1 <= num <= 255:
                raise ValueError(f"HCA filter {text!r}: port in {item!r} must be 1..255")
            entries.append((name, num))
        else:
            entries.append((name, None))
    if not entries:
        raise ValueError(f"HCA filter {text!r} names no device")
    return HcaFilter(exclude, exact, tuple(entries))


@dataclass(frozen=True)
class Choice:
    gpu: int
    nic: str
    port: int
    distance: Optional[Distance]
    reason: str                  # why this NIC, in words


def candidates(host: Host, hca: Optional[str], port: Optional[int] = None) -> List[Tuple[NicInfo, PortInfo]]:
    """ACTIVE (nic, port) pairs allowed by `hca` (a device name or an NCCL_IB_HCA filter)."""
    flt = parse_hca_filter(hca) if hca else None
    out = []
    for nic in host.nics:
        for p in nic.ports:
            if not p.active or (port is not None and p.num != port):
                continue
            if flt is not None and not flt.matches(nic.name, p.num):
                continue
            out.append((nic, p))
    return out


def choose_nics(host: Host, gpus: Optional[Sequence[int]] = None, hca: Optional[str] = None,
                port: Optional[int] = None, nic_map: Optional[Dict[int, str]] = None) -> Dict[int, Choice]:
    """The NIC each GPU uses. `nic_map` ({gpu: device}, e.g. from PYEP_NIC_MAP) pins GPUs explicitly.
    ValueError when nothing usable is left for a GPU (the message says what was excluded)."""
    gpu_ids = list(gpus) if gpus is not None else [g.index for g in host.gpus]
    known = {g.index for g in host.gpus}
    for g in gpu_ids:
        if not isinstance(g, int) or g < 0:
            raise ValueError(f"GPU index {g!r} must be a non-negative integer")
    pool = candidates(host, hca, port)
    if not pool:
        have = ", ".join(f"{n.name}:{p.num}({p.state})" for n in host.nics for p in n.ports) or "no RDMA device"
        raise ValueError(f"no ACTIVE RDMA port matches {hca or 'any device'}"
                         f"{'' if port is None else f' port {port}'} (found: {have})")
    load: Dict[Tuple[str, int], int] = {}
    out: Dict[int, Choice] = {}
    for g in gpu_ids:
        if nic_map and g in nic_map:
            pinned = [(n, p) for n, p in pool if n.name == nic_map[g]]
            if not pinned:
                raise ValueError(f"GPU {g} is pinned to {nic_map[g]!r}, which has no usable ACTIVE port")
            n, p = pinned[0]
            out[g] = Choice(g, n.name, p.num, host.affinity.get(g, n.name), "pinned by the NIC map")
            load[(n.name, p.num)] = load.get((n.name, p.num), 0) + 1
            continue
        if g not in known:
            # No PCIe position for this GPU (e.g. a saved tree without GPUs): spread round-robin.
            n, p = min(pool, key=lambda np: (load.get((np[0].name, np[1].num), 0), np[0].name, np[1].num))
            out[g] = Choice(g, n.name, p.num, None, "GPU position unknown: least-used NIC")
        else:
            def rank(np: Tuple[NicInfo, PortInfo]) -> Tuple[int, int]:
                d = host.affinity.get(g, np[0].name)
                return d.rank if d else (99, 0)
            best = min(rank(np) for np in pool)
            tied = [np for np in pool if rank(np) == best]
            n, p = min(tied, key=lambda np: (load.get((np[0].name, np[1].num), 0), np[0].name, np[1].num))
            d = host.affinity.get(g, n.name)
            why = f"nearest on PCIe ({d})" if d else "no PCIe position for this NIC"
            if len(tied) > 1:
                why += f", least used of {len(tied)} equally near"
            out[g] = Choice(g, n.name, p.num, d, why)
        load[(out[g].nic, out[g].port)] = load.get((out[g].nic, out[g].port), 0) + 1
    return out


def choose_gid(port: PortInfo, gid_index: Optional[int] = None) -> GidEntry:
    """The GID a QP on `port` should use. ValueError when an explicit index is empty or none fits."""
    if gid_index is not None:
        if isinstance(gid_index, bool) or not isinstance(gid_index, int) or not 0 <= gid_index <= 255:
            raise ValueError(f"gid_index must be an integer in 0..255, got {gid_index!r}")
        for g in port.gids:
            if g.index == gid_index:
                return g
        raise ValueError(f"GID index {gid_index} is empty on port {port.num} "
                         f"(populated: {', '.join(str(g.index) for g in port.gids) or 'none'})")
    if not port.gids:
        raise ValueError(f"port {port.num} has no GID")
    if not port.roce:
        return min(port.gids, key=lambda g: g.index)

    def pref(g: GidEntry) -> Tuple[int, int]:
        if g.type == "RoCE v2":
            return (0 if g.ipv4 else 1 if not g.gid.startswith("fe80") else 2), g.index
        return 3, g.index
    return min(port.gids, key=pref)
