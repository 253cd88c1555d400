"""Connects an EP buffer to all its peers: exchange `RankInfo`, agree on the transport plan, connect
each transport kind, and keep the per-peer links (the tables the kernels read)."""
from __future__ import annotations

import base64
import dataclasses
import json
import logging
import os
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

from ..transport.base import KINDS, PeerLink, RankInfo, Transport, host_name, node_ids, plan_transports
from ..transport.local import LocalTransport
from ..transport.nvlink import NvlinkTransport

if TYPE_CHECKING:
    from .config import LinkConfig

log = logging.getLogger("pyep.transport")
NIC_KINDS = ("ibgda", "emulated")


class PeerSet:
    """The links of one EP buffer to every rank of its group (itself included)."""

    def __init__(self, control: Any, config: "LinkConfig", ep: Any, rank: int, num_ranks: int,
                 device_index: int, buffer_addr: int, buffer_bytes: int, setup_timeout_s: float) -> None:
        from .control import as_control
        self.control = as_control(control)   # pyep.ep.control: a ProcessGroup is wrapped, or a store
        self.config = config
        self._ep = ep
        self.rank = rank
        self.num_ranks = num_ranks
        self.device_index = device_index
        self.buffer_addr = int(buffer_addr)     # plain ints: RankInfo.decode checks the types on the other side
        self.buffer_bytes = int(buffer_bytes)
        self.timeout_s = setup_timeout_s
        self.generation = 0
        self.infos: List[RankInfo] = []
        self.plan: List[List[str]] = []
        self.links: List[PeerLink] = []
        self._transports: Dict[str, Transport] = {}

    # ------------------------------------------------------------------ setup
    def _my_info(self, p2p: List[int]) -> RankInfo:
        handle = base64.b64encode(bytes(self._ep.ipc_get_handle(self.buffer_addr))).decode()
        from ..transport.ibgda import detect_nic
        return RankInfo(rank=self.rank, host=host_name(), node=-1,
                        pci_bus_id=self._ep.device_pci_bus_id(self.device_index), pid=os.getpid(),
                        buffer_addr=self.buffer_addr, buffer_bytes=self.buffer_bytes, ipc_handle=handle,
                        generation=self.generation, nic=detect_nic(self.config.device_name), p2p=p2p)

    def _gather(self, info: RankInfo, what: str) -> List[RankInfo]:
        raw = self.control.all_gather_bytes(info.encode(), self.timeout_s, what)
        return [RankInfo.decode(b, r) for r, b in enumerate(raw)]

    def _p2p_row(self, infos: List[RankInfo]) -> List[int]:
        """1 where this process can map rank r's GPU with CUDA IPC (same host, peer access)."""
        import torch
        bus_to_dev: Dict[str, int] = {}
        for d in range(torch.cuda.device_count()):
            bus_to_dev[self._ep.device_pci_bus_id(d).lower()] = d
        me = infos[self.rank]
        row = []
        for info in infos:
            dev = bus_to_dev.get(info.pci_bus_id.lower()) if info.host == me.host else None
            row.append(int(dev is not None and bool(self._ep.can_access_peer(self.device_index, dev))))
        return row

    def connect(self) -> None:
        """Collective: exchange descriptions, plan, connect every kind. Raises naming the problem."""
        first = self._gather(self._my_info([]), "EP transport setup (rank descriptions)")
        row = self._p2p_row(first)
        infos = self._gather(self._my_info(row), "EP transport setup (peer-access table)")
        nodes = node_ids([i.host for i in infos], self.config.ranks_per_node)
        self.infos = [RankInfo(**{**i.__dict__, "node": n}) for i, n in zip(infos, nodes)]
        self.plan = plan_transports(self.config.transport, self.config.allow_nvlink, nodes,
                                    [i.p2p for i in self.infos], [i.nic for i in self.infos])
        mine = self.plan[self.rank]
        links: Dict[int, PeerLink] = {}
        for kind in KINDS:
            used_anywhere = any(kind in row_ for row_ in self.plan)
            if not used_anywhere:
                continue
            peers = [r for r in range(self.num_ranks) if mine[r] == kind]
            links.update(self._transport(kind).connect(peers, self.infos))
        self.links = [links[r] for r in range(self.num_ranks)]
        log.info("rank %d transports: %s", self.rank,
                 ", ".join(f"{link.rank}:{link.kind}" for link in self.links))
        if any(link.kind == "emulated" for link in self.links):
            from ..softnic.cuda_env import cuda_connections_warning
            why = cuda_connections_warning()
            if why is not None:
                log.warning("rank %d: %s", self.rank, why)
        self._publish_info()

    # ------------------------------------------------------------------ store-based membership
    def _publish_info(self) -> None:
        """Store-based buffers keep each member's latest RankInfo in the store: a restarted rank reads
        the survivors' from there (they never set up again)."""
        if self.control.kind == "store":
            self.control.put(self.control.key("member", "info", self.rank), self.infos[self.rank].encode())

    def gpu_identities(self, me: Tuple[str, str]) -> List[Any]:
        """(host, GPU uuid) of every rank: how many ranks share our GPU decides the kernels' grid."""
        mine = json.dumps(list(me)).encode()
        if self.control.kind != "store":
            raw = self.control.all_gather_bytes(mine, self.timeout_s, "GPU identities")
        else:
            c = self.control
            c.put(c.key("member", "gpu", self.rank), mine)
            keys = [c.key("member", "gpu", r) for r in range(self.num_ranks)]
            raw = [rec.payload for rec in c.wait_records(keys, list(range(self.num_ranks)), self.timeout_s,
                                                         "GPU identities", 4096, current=True)]
        out = []
        for r, b in enumerate(raw):
            try:
                host, uuid = json.loads(b.decode())
                out.append((str(host), str(uuid)))
            except (ValueError, TypeError, RecursionError):
                from .errors import RecordRejected
                raise RecordRejected(f"GPU identities (rank {r})", "not a [host, uuid] pair") from None
        return out

    def prepare_join(self) -> bytes:
        """A restarted rank: our description, the plan from the survivors' stored descriptions, fresh
        QPs towards everyone (INIT). Returns the announcement payload."""
        c = self.control
        keys = [c.key("member", "info", r) for r in range(self.num_ranks)]
        others = [r for r in range(self.num_ranks) if r != self.rank]
        recs = c.wait_records([keys[r] for r in others], others, self.timeout_s, "survivors' transport descriptions",
                              c.MAX_PAYLOAD, current=True)
        stored = {r: RankInfo.decode(rec.payload, r) for r, rec in zip(others, recs)}
        first = self._my_info([])
        infos = [first if r == self.rank else stored[r] for r in range(self.num_ranks)]
        mine = self._my_info(self._p2p_row(infos))
        infos[self.rank] = mine
        nodes = node_ids([i.host for i in infos], self.config.ranks_per_node)
        self.infos = [dataclasses.replace(i, node=n) for i, n in zip(infos, nodes)]
        self.plan = plan_transports(self.config.transport, self.config.allow_nvlink, nodes,
                                    [i.p2p for i in self.infos], [i.nic for i in self.infos])
        nic = b""
        for kind in NIC_KINDS:
            if any(k == kind for k in self.plan[self.rank]):
                nic = self._transport(kind).open_join()
        return json.dumps({"info": base64.b64encode(self.infos[self.rank].encode()).decode(),
                           "nic": base64.b64encode(nic).decode()}).encode()

    def finish_join(self, blobs: Dict[int, bytes]) -> None:
        """A restarted rank, admitted: connect to every survivor with what it published for us."""
        links: Dict[int, PeerLink] = dict(self._transport("local").connect([self.rank], self.infos))
        for r in range(self.num_ranks):
            if r == self.rank:
                continue
            kind = self.plan[self.rank][r]
            if kind == "nvlink":
                links.update(self._transport(kind).connect([r], self.infos))
            else:
                nic = base64.b64decode(json.loads(blobs[r].decode())["nic"])
                links[r] = self._transport(kind).connect_peer(r, nic)
        self.links = [links[r] for r in range(self.num_ranks)]
        self._publish_info()

    def rebuild_peer(self, rank: int, payload: bytes) -> bytes:
        """A survivor: rebuild only the link to restarted `rank` (a new IPC mapping of its new buffer,
        or new QPs connected to its new ones). Returns what we publish for it."""
        from .errors import BadAnnouncement
        try:
            doc = json.loads(payload.decode())
            info = RankInfo.decode(base64.b64decode(doc["info"]), rank)
            nic = base64.b64decode(doc["nic"])
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
            raise BadAnnouncement(f"rejoin announcement of rank {rank}: malformed transport data ({exc})") from None
        old = self.infos[rank]
        if (info.host, info.pci_bus_id.lower()) != (old.host, old.pci_bus_id.lower()):
            raise BadAnnouncement(f"rejoin announcement of rank {rank}: it came back on {info.host} GPU "
                                  f"{info.pci_bus_id}, it was on {old.host} GPU {old.pci_bus_id}; a rejoin keeps "
                                  f"the placement (the transport plan of the others depends on it)")
        self.infos[rank] = dataclasses.replace(info, node=old.node, p2p=old.p2p)
        kind = self.plan[self.rank][rank]
        out = b""
        if kind == "nvlink":
            t = self._transport(kind)
            t.disconnect([rank])
            self.links[rank] = t.connect([rank], self.infos)[rank]
        elif kind in NIC_KINDS:
            self.links[rank], out = self._transport(kind).rebuild_peer(rank, nic)
        return json.dumps({"nic": base64.b64encode(out).decode()}).encode()

    def link_state(self) -> Dict[int, Any]:
        """Per peer: kind, store address, and for NIC links each QP's number and softnic counters."""
        state: Dict[int, Any] = {}
        for link in self.links:
            entry: Dict[str, Any] = {"kind": link.kind, "store_base": link.store_base, "rkey": link.rkey}
            t = self._transports.get(link.kind)
            if link.kind in NIC_KINDS and t is not None:
                entry["qps"] = t.qp_state(link.rank)
            state[link.rank] = entry
        return state

    def _transport(self, kind: str) -> Transport:
        t = self._transports.get(kind)
        if t is None:
            if kind == "local":
                t = LocalTransport(self.rank, self.buffer_addr)
            elif kind == "nvlink":
                t = NvlinkTransport(self._ep, self.rank)
            elif kind in NIC_KINDS:
                from ..transport.ibgda import NicTransport
                t = NicTransport(kind, self.control, self.config, self.rank, self.num_ranks,
                                 self.buffer_addr, self.buffer_bytes, self.timeout_s)
            else:
                raise ValueError(f"unknown transport kind {kind!r}")
            self._transports[kind] = t
        return t

    def reconnect(self) -> None:
        """Collective: drop every connection and build them again (update_ep_member: a peer may have
        restarted with a new buffer, new QPs and new keys)."""
        for kind, t in self._transports.items():
            t.disconnect([r for r in range(self.num_ranks) if self.plan and self.plan[self.rank][r] == kind])
        self.generation += 1
        self.connect()

    def close(self) -> None:
        for t in self._transports.values():
            t.close()
        self._transports.clear()
        self.links = []

    # ------------------------------------------------------------------ tables for the kernels
    def nic_link(self) -> Optional[PeerLink]:
        return next((link for link in self.links if link.kind in NIC_KINDS), None)

    def lkey(self) -> int:
        for t in self._transports.values():
            key = getattr(t, "lkey", None)
            if key is not None:
                return int(key)
        return 0

    def provider(self) -> Any:
        """The NIC provider (softnic or DevX) behind the NIC links, or None when there are none."""
        for t in self._transports.values():
            prov = getattr(t, "_prov", None)
            if prov is not None:
                return prov
        return None

    def qps_per_peer(self) -> int:
        counts = {len(link.qp_contexts) for link in self.links if link.kind in NIC_KINDS}
        if len(counts) > 1:
            raise RuntimeError(f"NIC peers have different QP counts {sorted(counts)}")
        return counts.pop() if counts else 1
