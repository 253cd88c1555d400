"""The connect sequence of the NIC path, over any nic::Provider binding (softnic or DevX).

Per peer, `qps_per_peer` RC QPs, each with its own send CQ (qp.h polls one CQ per QP). Setup:
  create CQ + QP  ->  RST2INIT (least rights: remote write + atomic, remote read only if asked)
  exchange EndpointInfo blobs (connect_info.py validates every peer-supplied value)
  INIT2RTR (peer QPN, its address: LID / GID + MAC / softnic node)  ->  RTR2RTS.
PSNs are derived from QP numbers (both sides compute the same values without another exchange; a new
QP after a rejoin gets a new PSN, so stale packets of the old one are not accepted). On RoCE each QP
gets its own UDP source port from the (local, remote) QPN pair, for ECMP entropy.

Rejoin: `rebuild_peer(p)` destroys and recreates only the QPs towards rank p (other peers keep their
QPs, their state and their posted work) and returns the new local info for p; after exchanging with p,
`connect_peer(p, blob)` takes the new QPs to RTS.
"""
from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, is_dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from ..nic.env import NicSettings, resolve
from .connect_info import EndpointInfo, Region, check_compatible, decode

log = logging.getLogger("pyep.transport.connect")

ACCESS_LOCAL_WRITE, ACCESS_REMOTE_WRITE, ACCESS_REMOTE_READ, ACCESS_REMOTE_ATOMIC = 1, 2, 4, 8
QPS_RTS = 3
PLACEMENTS = {"host": 0, "host_mapped": 1, "device": 2}


def psn_for(qpn: int) -> int:
    return (qpn * 2654435761) & 0xFFFFFF


def udp_sport_for(local_qpn: int, remote_qpn: int, base: int = 0xC000) -> int:
    return base + ((local_qpn * 2654435761) ^ remote_qpn) % (0x10000 - base)


@dataclass(frozen=True)
class ConnectConfig:
    qps_per_peer: int = 1
    log_sq: int = 10                  # 2^log_sq WQEBBs per QP
    placement: str = "host"           # "host" (CPU posters), "host_mapped" / "device" (GPU posters)
    remote_read: bool = False         # grant peers RDMA READ on our QPs (pyep's kernels never read)
    settings: NicSettings = NicSettings()

    def __post_init__(self) -> None:
        for name, lo, hi in (("qps_per_peer", 1, 64), ("log_sq", 1, 15)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"ConnectConfig.{name} must be an int, got {type(v).__name__}")
            if not lo <= v <= hi:
                raise ValueError(f"ConnectConfig.{name}={v} is outside [{lo}, {hi}]")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"ConnectConfig.placement must be one of {', '.join(PLACEMENTS)}, got {self.placement!r}")
        if not isinstance(self.settings, NicSettings):
            raise TypeError("ConnectConfig.settings must be a NicSettings")

    @property
    def access(self) -> int:
        return (ACCESS_LOCAL_WRITE | ACCESS_REMOTE_WRITE | ACCESS_REMOTE_ATOMIC |
                (ACCESS_REMOTE_READ if self.remote_read else 0))


def _plain(obj: Any) -> Dict[str, Any]:
    return asdict(obj) if is_dataclass(obj) else dict(obj)


class _SoftNicDriver:
    """pyep.softnic.SoftNic."""
    kind = "softnic"

    def __init__(self, nic: Any) -> None:
        self.nic = nic

    def identity(self) -> Dict[str, Any]:
        return {"link": "softnic", "node_id": self.nic.node_id, "fabric_id": self.nic.fabric_id}

    def create(self, log_sq: int, placement: str) -> Tuple[Dict[str, Any], Dict[str, Any]]:
        cq = self.nic.create_cq(log_sq, PLACEMENTS[placement])
        try:
            qp = self.nic.create_qp(cq, log_sq, PLACEMENTS[placement])
        except Exception:
            self.nic.destroy_cq(cq)
            raise
        return _plain(qp), _plain(cq)

    def rst2init(self, qpn: int, access: int) -> None:
        self.nic.modify_rst2init(qpn, access)

    def init2rtr(self, qpn: int, remote_qpn: int, peer: EndpointInfo, attr: Dict[str, int]) -> None:
        from ..softnic import ConnectAttr
        self.nic.modify_init2rtr(qpn, peer.node_id, remote_qpn, ConnectAttr(**attr))

    def rtr2rts(self, qpn: int, attr: Dict[str, int]) -> None:
        from ..softnic import ConnectAttr
        self.nic.modify_rtr2rts(qpn, ConnectAttr(**attr))

    def state(self, qpn: int) -> int:
        return int(self.nic.qp_state(qpn))

    def destroy(self, qpn: int, cqn: int) -> None:
        from ..softnic import CqInfo
        self.nic.destroy_qp(qpn)
        self.nic.destroy_cq(CqInfo(cqn, 0, 0, 0))


class _DevxDriver:
    """pyep._engine.devx.DevxProvider."""
    kind = "devx"

    def __init__(self, native: Any) -> None:
        self.native = native

    def identity(self) -> Dict[str, Any]:
        a = dict(self.native.local_address())
        return {"link": "ib" if self.native.link_is_ib else "roce", "lid": int(a["lid"]), "gid": bytes(a["gid"]),
                "mac": bytes(a["mac"]), "port": int(a["port"]), "mtu": int(self.native.active_mtu)}

    def create(self, log_sq: int, placement: str) -> Tuple[Dict[str, Any], Dict[str, Any]]:
        cq = dict(self.native.create_cq(log_sq, PLACEMENTS[placement]))
        try:
            qp = dict(self.native.create_qp(cq["cqn"], log_sq, PLACEMENTS[placement]))
        except Exception:
            self.native.destroy_cq(cq["cqn"])
            raise
        return qp, cq

    def rst2init(self, qpn: int, access: int) -> None:
        self.native.modify_qp_rst2init(qpn, access)

    def init2rtr(self, qpn: int, remote_qpn: int, peer: EndpointInfo, attr: Dict[str, int]) -> None:
        self.native.modify_qp_init2rtr(qpn, dict(attr, remote_qpn=remote_qpn, remote_lid=peer.lid,
                                                 remote_gid=peer.gid, remote_mac=peer.mac))

    def rtr2rts(self, qpn: int, attr: Dict[str, int]) -> None:
        self.native.modify_qp_rtr2rts(qpn, attr)

    def state(self, qpn: int) -> int:
        return int(self.native.query_qp_state(qpn))

    def destroy(self, qpn: int, cqn: int) -> None:
        self.native.destroy_qp(qpn)
        self.native.destroy_cq(cqn)


def driver_for(provider: Any) -> Any:
    """The driver for a provider object: a pyep.softnic.SoftNic or a native DevxProvider."""
    kind = getattr(provider, "kind", None)
    if callable(kind) and kind() == "devx":
        return _DevxDriver(provider)
    if hasattr(provider, "modify_init2rtr") and hasattr(provider, "fabric_id"):
        return _SoftNicDriver(provider)
    raise TypeError(f"{type(provider).__name__} is not a NIC provider (pyep.softnic.SoftNic or devx.DevxProvider)")


@dataclass
class PeerQp:
    qp: Dict[str, Any]       # qpn, log_sq, sq, dbrec, bf, bf_size, cqn
    cq: Dict[str, Any]       # cqn, log_size, cqes, dbrec
    remote_qpn: int = 0


class Connections:
    """This rank's QPs towards every peer, and their lifecycle."""

    def __init__(self, provider: Any, rank: int, world_size: int, config: ConnectConfig = ConnectConfig(),
                 regions: Sequence[Region] = (), ipc_handles: Sequence[bytes] = (),
                 environ: Optional[Dict[str, str]] = None) -> None:
        if not isinstance(config, ConnectConfig):
            raise TypeError("config must be a ConnectConfig")
        for name, v, lo, hi in (("world_size", world_size, 1, 1 << 16), ("rank", rank, 0, world_size - 1)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"{name} must be an int")
            if not lo <= v <= hi:
                raise ValueError(f"{name}={v} is outside [{lo}, {hi}]")
        self.driver = driver_for(provider)
        self.rank, self.world_size, self.config = rank, world_size, config
        self.settings = resolve(config.settings, environ)
        log.info("rank %d NIC settings: %s", rank, self.settings.describe())
        self.regions = tuple(regions)
        self.ipc_handles = tuple(bytes(h) for h in ipc_handles)
        self.generation = 0
        self.peers: Dict[int, List[PeerQp]] = {}
        self.remote: Dict[int, EndpointInfo] = {}
        for p in range(world_size):
            if p != rank:
                self._build(p)

    # --- building
    def _build(self, peer: int) -> List[PeerQp]:
        qps: List[PeerQp] = []
        try:
            for _ in range(self.config.qps_per_peer):
                qp, cq = self.driver.create(self.config.log_sq, self.config.placement)
                qps.append(PeerQp(qp, cq))
                self.driver.rst2init(qp["qpn"], self.config.access)
        except Exception:
            for q in qps:
                self.driver.destroy(q.qp["qpn"], q.cq["cqn"])
            raise
        self.peers[peer] = qps
        return qps

    def _teardown(self, peer: int, qps: Optional[List[PeerQp]] = None) -> None:
        for q in (self.peers.pop(peer, []) if qps is None else qps):
            try:
                self.driver.destroy(q.qp["qpn"], q.cq["cqn"])
            except RuntimeError as exc:
                log.warning("destroying QP %#x towards rank %d: %s", q.qp["qpn"], peer, exc)
        if qps is None:
            self.remote.pop(peer, None)

    def local_info(self) -> EndpointInfo:
        ident = self.driver.identity()
        qpns = tuple(() if p == self.rank else tuple(q.qp["qpn"] for q in self.peers[p]) for p in range(self.world_size))
        mtu = min(self.settings.settings.mtu or 4096, ident.get("mtu", 4096))
        return EndpointInfo(rank=self.rank, world_size=self.world_size, provider=self.driver.kind,
                            link=ident["link"], generation=self.generation, qpns=qpns, regions=self.regions,
                            ipc_handles=self.ipc_handles, node_id=ident.get("node_id", 0),
                            fabric_id=ident.get("fabric_id", 0), lid=ident.get("lid", 0),
                            gid=ident.get("gid", bytes(16)), mac=ident.get("mac", bytes(6)),
                            port=ident.get("port", 1), mtu=mtu)

    # --- connecting
    def _attr(self, peer: EndpointInfo, local_qpn: int, remote_qpn: int) -> Dict[str, int]:
        s = self.settings.settings
        return {"mtu": min(s.mtu or 4096, peer.mtu), "retry_cnt": s.retry_cnt, "rnr_retry": s.rnr_retry,
                "ack_timeout": s.timeout, "min_rnr_timer": 12, "sq_psn": psn_for(local_qpn),
                "rq_psn": psn_for(remote_qpn), "max_rd_atomic": 16, "sl": s.sl, "traffic_class": s.traffic_class,
                "udp_sport": udp_sport_for(local_qpn, remote_qpn) if peer.link == "roce" else 0}

    def validate(self, peer: int, blob: Any) -> EndpointInfo:
        if isinstance(peer, bool) or not isinstance(peer, int) or not 0 <= peer < self.world_size:
            raise ValueError(f"peer must be a rank in [0, {self.world_size}), got {peer!r}")
        if peer == self.rank:
            raise ValueError("a rank does not connect to itself")
        info = decode(blob, peer, self.world_size, self.config.qps_per_peer)
        check_compatible(self.local_info(), info)
        return info

    def connect(self, blobs: Sequence[Any]) -> Dict[int, EndpointInfo]:
        """Every rank's blob (index = rank; our own entry is ignored). All peers are validated before
        any QP moves, so a bad blob leaves every QP untouched."""
        if len(blobs) != self.world_size:
            raise ValueError(f"expected {self.world_size} connect blobs (one per rank), got {len(blobs)}")
        infos = {p: self.validate(p, b) for p, b in enumerate(blobs) if p != self.rank}
        for p, info in infos.items():
            self._connect(p, info)
        return infos

    def connect_peer(self, peer: int, blob: Any) -> EndpointInfo:
        info = self.validate(peer, blob)
        self._connect(peer, info)
        return info

    def _connect(self, peer: int, info: EndpointInfo) -> None:
        remote_qpns = info.qpns[self.rank]
        for q, rq in zip(self.peers[peer], remote_qpns):
            attr = self._attr(info, q.qp["qpn"], rq)
            self.driver.init2rtr(q.qp["qpn"], rq, info, attr)
            self.driver.rtr2rts(q.qp["qpn"], attr)
            q.remote_qpn = rq
        self.remote[peer] = info
        log.debug("rank %d -> %d: QPs %s connected to %s", self.rank, peer,
                  [hex(q.qp["qpn"]) for q in self.peers[peer]], [hex(r) for r in remote_qpns])

    # --- rejoin
    def rebuild_peer(self, peer: int) -> EndpointInfo:
        """New QPs towards `peer` only; returns our new info for the peer to connect to."""
        if peer not in self.peers:
            raise ValueError(f"rank {peer} is not a peer of rank {self.rank}")
        # New QPs first, old ones destroyed after: the new QPNs (and so PSNs) differ from the old ones,
        # so packets still in flight for the old QPs cannot be accepted by the new ones.
        old, old_remote = self.peers.pop(peer), self.remote.pop(peer, None)
        try:
            self._build(peer)
        except Exception:
            self.peers[peer] = old
            if old_remote is not None:
                self.remote[peer] = old_remote
            raise
        self._teardown(peer, old)
        self.generation += 1
        return self.local_info()

    # --- inspection
    def qps(self, peer: int) -> List[PeerQp]:
        if peer not in self.peers:
            raise ValueError(f"rank {peer} is not a peer of rank {self.rank}")
        return list(self.peers[peer])

    def states(self, peer: int) -> List[int]:
        return [self.driver.state(q.qp["qpn"]) for q in self.qps(peer)]

    def connected(self, peer: int) -> bool:
        return peer in self.remote and all(s == QPS_RTS for s in self.states(peer))

    def close(self) -> None:
        for p in list(self.peers):
            self._teardown(p)


def exchange(conn: Connections, allgather: Callable[[bytes], List[bytes]]) -> Dict[int, EndpointInfo]:
    """Publishes our info through `allgather` (bytes in, every rank's bytes out) and connects."""
    return conn.connect(allgather(conn.local_info().to_bytes()))


def torch_allgather(group: Any = None) -> Callable[[bytes], List[bytes]]:
    """An allgather over a torch.distributed process group (its timeout bounds the wait)."""
    def gather(blob: bytes) -> List[bytes]:
        import torch.distributed as dist
        out: List[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(out, bytes(blob), group=group)
        for r, b in enumerate(out):
            if not isinstance(b, bytes):
                raise ValueError(f"connect info from rank {r} arrived as {type(b).__name__}, not bytes")
        return out
    return gather
