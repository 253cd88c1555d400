"""NIC transport: RC queue pairs that the GPU kernels post to directly (IBGDA), on a real mlx5 NIC through
the DevX provider ("ibgda") or on the softnic ("emulated"). Both providers share the setup sequence:
register this rank's whole EP buffer once, create `num_qps_per_peer` RC QPs per peer, exchange QP
numbers and keys, take the QPs to RTS, and hand the kernels each QP's device context (qp.h).

The connect sequence itself (QPs, validated exchange, PSNs, RoCE UDP ports) is pyep.transport.connect;
this module adds the EP buffer's registration and hands the kernels the QP device contexts.
The kernels put an expert's data and its count signal on the same QP (RC order makes the data visible
first) and the combine flag on every QP of a peer, so the receiver expects `num_qps_per_peer` adds.
"""
from __future__ import annotations

import logging
import os
import secrets
from typing import TYPE_CHECKING, Any, Dict, List, Sequence, Tuple

from .base import PeerLink, RankInfo, Transport

if TYPE_CHECKING:
    from ..ep.config import LinkConfig

log = logging.getLogger("pyep.transport.ibgda")
DEFAULT_QPS_PER_PEER = 2
LOG_SQ = 12          # 4096 WQEBBs per QP: a full dispatch to one peer fits without waiting on the CQ
LOG_CQ = 12
ACCESS_ALL = 1 | 2 | 8   # local write, remote write, remote atomic (prm::Access); the kernels never read
REGION = "ep"


def detect_nic(device_name: str) -> str:
    """`device_name` when a DevX-capable RDMA device of that name is usable here, else ""."""
    if not os.path.isdir(f"/sys/class/infiniband/{device_name}"):
        return ""
    from .._native import load
    mod = load()
    devx = getattr(mod, "devx", None) if mod is not None else None
    if devx is None or not getattr(devx, "has_provider", False):
        return ""
    try:
        return "" if devx.unavailable_reason(device_name) else device_name
    except RuntimeError:
        return ""


def _open_provider(kind: str, node_id: int, fabric_id: int, device_name: str, cuda_device: int) -> Tuple[Any, str]:
    """(provider object for pyep.transport.connect, ring placement GPU posters can use)."""
    if kind == "emulated":
        from ..softnic import SoftNic, SoftNicConfig
        nic = SoftNic(SoftNicConfig(node_id=node_id, fabric_id=fabric_id, cuda_device=cuda_device))
        if not nic.has_cuda:
            nic.close()
            raise RuntimeError("transport='emulated' needs a softnic built with CUDA (GPU memory registration)")
        return nic, "host_mapped"   # the GPU posts into host-mapped rings, the softnic thread reads them
    from .._native import engine
    prov = engine().devx.DevxProvider(device_name)
    names = {p[0] if isinstance(p, (tuple, list)) else str(p) for p in prov.placements()}
    return prov, "device" if "device" in names else "host_mapped"


def _register(kind: str, prov: Any, addr: int, length: int) -> Tuple[int, int, int]:
    if kind == "emulated":
        mr = prov.reg_mr(addr, length)
        return int(mr.addr), int(mr.lkey), int(mr.rkey)
    mr = dict(prov.reg_mr(addr, length, ACCESS_ALL))
    return int(mr["addr"]), int(mr["lkey"]), int(mr["rkey"])


class NicTransport(Transport):
    """The NIC path over pyep.transport.connect (validated exchange, PSNs, per-QP UDP ports)."""

    def __init__(self, kind: str, control: Any, config: "LinkConfig", rank: int, num_ranks: int,
                 buffer_addr: int, buffer_bytes: int, timeout_s: float) -> None:
        if kind not in ("ibgda", "emulated"):
            raise ValueError(f"NicTransport kind must be 'ibgda' or 'emulated', got {kind!r}")
        self.kind = kind
        self.control = control           # pyep.ep.control: a process group or a store
        self.config = config
        self.rank = rank
        self.num_ranks = num_ranks
        self.buffer_addr = buffer_addr
        self.buffer_bytes = buffer_bytes
        self.timeout_s = timeout_s
        self.nqp = config.num_qps_per_peer or DEFAULT_QPS_PER_PEER
        self._prov: Any = None
        self._placement = "host_mapped"
        self._region: Any = None
        self._conn: Any = None
        self.lkey: Any = None

    def _open(self) -> None:
        if self._prov is not None:
            return
        import torch
        from .connect_info import Region
        fabric = 0
        if self.kind == "emulated":
            # All softnics of the job share one random fabric id (a restarted rank reads the job's).
            raw = self.control.shared_value("softnic_fabric_id", lambda: (secrets.randbits(62) + 1).to_bytes(8, "little"),
                                            self.timeout_s)
            fabric = int.from_bytes(raw[:8], "little")
        self._prov, self._placement = _open_provider(self.kind, self.rank + 1, fabric, self.config.device_name,
                                                     torch.cuda.current_device())
        addr, lkey, rkey = _register(self.kind, self._prov, self.buffer_addr, self.buffer_bytes)
        self._region = Region(REGION, addr, self.buffer_bytes, rkey)
        self.lkey = lkey

    def connect(self, peers: Sequence[int], infos: Sequence[RankInfo]) -> Dict[int, PeerLink]:
        """Collective over the group (every rank calls it when this kind appears anywhere in the plan)."""
        if self.rank in peers:
            raise ValueError("the NIC transport does not connect a rank to itself")
        self._connections()
        blobs = self.control.all_gather_bytes(self._conn.local_info().to_bytes(), self.timeout_s,
                                              f"{self.kind} connect exchange")
        self._conn.connect(blobs)
        return {r: self._link(r) for r in peers}

    def _connections(self) -> Any:
        from .connect import ConnectConfig, Connections
        self._open()
        if self._conn is None:
            cfg = ConnectConfig(qps_per_peer=self.nqp, log_sq=LOG_SQ, placement=self._placement)
            self._conn = Connections(self._prov, self.rank, self.num_ranks, cfg, regions=[self._region])
        return self._conn

    def _link(self, r: int) -> PeerLink:
        """The kernels' view of our connected QPs towards r (device contexts, the peer's region)."""
        from .._native import engine
        info = self._conn.remote[r]
        region = info.region(REGION)
        ctxs = []
        for q in self._conn.qps(r):
            qp, cq = q.qp, q.cq
            # cq_ci=-1 reads the consumer index from the CQ doorbell record, which only host memory
            # allows (softnic rings); a DevX CQ may live in GPU memory, and connect() always creates
            # fresh CQs, whose consumer index is 0.
            host = engine().HostQp(qp["qpn"], qp["log_sq"], qp["sq"], qp["dbrec"], qp["bf"], qp["bf_size"],
                                   cq["cqes"], cq["dbrec"], cq["log_size"], -1 if self.kind == "emulated" else 0)
            ctxs.append(bytes(host.context_bytes()))
        detail = (f"softnic node {info.node_id}" if self.kind == "emulated" else self.config.device_name)
        return PeerLink(rank=r, kind=self.kind, detail=f"{detail}, {self.nqp} QPs", remote_addr=region.addr,
                        rkey=region.rkey, qp_contexts=ctxs, flag_expect=self.nqp)

    # --- elastic membership (pyep.ep.elastic.membership): only the QPs towards one rank change
    def open_join(self) -> bytes:
        """A restarted rank: register, create fresh QPs towards every peer; our connect blob."""
        return self._connections().local_info().to_bytes()

    def connect_peer(self, r: int, blob: bytes) -> PeerLink:
        """A restarted rank: take our QPs towards survivor r to RTS with its new QPs."""
        self._conn.connect_peer(r, blob)
        return self._link(r)

    def rebuild_peer(self, r: int, blob: bytes) -> Tuple[PeerLink, bytes]:
        """A survivor: new QPs towards restarted rank r only (the old ones are destroyed; other peers'
        QPs, their state and their counters stay), connected to r's new ones. Returns the link and our
        new connect blob (it lists the new QPNs towards r)."""
        self._conn.validate(r, blob)          # a bad blob changes nothing
        self._conn.rebuild_peer(r)
        self._conn.connect_peer(r, blob)
        return self._link(r), self._conn.local_info().to_bytes()

    def qp_state(self, r: int) -> List[Dict[str, Any]]:
        """QP numbers and, on the softnic, each QP's counters (executed WQEs, bytes, doorbells, ...)."""
        out = []
        for q in self._conn.qps(r):
            entry: Dict[str, Any] = {"qpn": q.qp["qpn"], "remote_qpn": q.remote_qpn}
            if self.kind == "emulated":
                st = self._prov.qp_stats(q.qp["qpn"])
                entry.update(wqes=st.wqes, bytes=st.bytes, atomics=st.atomics, doorbells=st.doorbells,
                             consumer_index=st.consumer_index, state=int(st.state))
            out.append(entry)
        return out

    def disconnect(self, peers: Sequence[int]) -> None:
        # Every QP goes (a rejoin rebuilds the whole mesh collectively); the MR stays registered.
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def close(self) -> None:
        if self._prov is None:
            return
        self.disconnect([])
        try:
            if self.lkey is not None:
                if self.kind == "emulated":
                    from ..softnic import MrInfo
                    self._prov.dereg_mr(MrInfo(self._region.addr, self._region.length, self.lkey,
                                               self._region.rkey, ACCESS_ALL))
                else:
                    self._prov.dereg_mr(self.lkey)
        finally:
            if self.kind == "emulated":
                self._prov.close()
            self._prov = None
            self.lkey = None
