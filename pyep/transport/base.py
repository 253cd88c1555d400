"""The one transport interface of the low-latency EP buffer: how this rank reaches each peer's buffer.

Every rank publishes a `RankInfo` (host, node, GPU, buffer IPC handle, NIC), the ranks agree on one
symmetric plan (`plan_transports`: the same R x R table on every rank, so a sender and its receiver
always use the same kind of path), and each transport kind then connects its peers and returns one
`PeerLink` per peer: where the kernels store (NVLink/local) or which queue pairs and keys they post
on (NIC). Kinds: "local" (self), "nvlink" (CUDA IPC), "ibgda" (real mlx5 NIC), "emulated" (softnic).
"""
from __future__ import annotations

import base64
import json
import logging
import os
import socket
from abc import ABC, abstractmethod
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Dict, List, Optional, Sequence

if TYPE_CHECKING:
    import torch.distributed as dist

log = logging.getLogger("pyep.transport")

KINDS = ("local", "nvlink", "ibgda", "emulated")
VIRTUAL_NODE_ENV = "PYEP_VIRTUAL_NODE_SIZE"
INFO_BYTES = 4096        # bound of one rank's description


@dataclass(frozen=True)
class RankInfo:
    """What one rank tells the others at setup (and again at update_ep_member)."""
    rank: int
    host: str
    node: int                  # node index after virtual-node overrides
    pci_bus_id: str            # of the GPU holding the buffer
    pid: int
    buffer_addr: int           # the buffer's device address in its own process
    buffer_bytes: int
    ipc_handle: str            # base64 of the 64-byte CUDA IPC handle ("" when not exportable)
    generation: int            # bumps when the buffer is re-created (rejoin after restart)
    nic: str = ""              # NIC device name when one is present, else ""
    p2p: List[int] = field(default_factory=list)  # second round: 1 if this rank can map rank r's GPU

    def encode(self) -> bytes:
        data = json.dumps(asdict(self), separators=(",", ":")).encode()
        if len(data) > INFO_BYTES - 4:
            raise ValueError(f"rank info of rank {self.rank} is {len(data)} bytes, more than {INFO_BYTES - 4}")
        return len(data).to_bytes(4, "little") + data

    @staticmethod
    def decode(raw: bytes, expect_rank: int) -> "RankInfo":
        """A peer's description, checked like user input: every field present, of its type and range
        (ValueError naming the rank), before any of it sizes a mapping or picks a path."""
        n = int.from_bytes(raw[:4], "little")
        if not 0 < n <= len(raw) - 4:
            raise ValueError(f"rank {expect_rank} sent a malformed transport description ({n} bytes)")
        try:
            doc = json.loads(raw[4:4 + n].decode())
        except (UnicodeDecodeError, ValueError) as exc:
            raise ValueError(f"rank {expect_rank} sent a malformed transport description ({exc})") from None
        bad = _rank_info_problem(doc)
        if bad:
            raise ValueError(f"rank {expect_rank} sent a malformed transport description: {bad}")
        info = RankInfo(**doc)
        if info.rank != expect_rank:
            raise ValueError(f"slot {expect_rank} of the transport exchange holds rank {info.rank}'s data")
        return info

    def handle_bytes(self) -> bytes:
        return base64.b64decode(self.ipc_handle) if self.ipc_handle else b""


# RankInfo's fields: (JSON type, whether it must be >= 0); tests/test_transport_plan.py holds them to the
# dataclass. Integers exclude bool (JSON true is not a count).
# `node` is -1 as sent (each rank derives the nodes itself, node_ids), so it is only an int.
_INFO_FIELDS = {"rank": (int, True), "host": (str, False), "node": (int, False), "pci_bus_id": (str, False),
                "pid": (int, True), "buffer_addr": (int, True), "buffer_bytes": (int, True),
                "ipc_handle": (str, False), "generation": (int, True), "nic": (str, False), "p2p": (list, False)}


def _rank_info_problem(doc: object) -> str:
    """What is wrong with a decoded RankInfo document, or "" when nothing is."""
    if not isinstance(doc, dict):
        return f"not an object ({type(doc).__name__})"
    unknown = sorted(set(doc) - set(_INFO_FIELDS))
    if unknown:
        return f"unknown fields {unknown}"
    required = [f.name for f in fields(RankInfo) if f.default is MISSING and f.default_factory is MISSING]
    missing = [f for f in required if f not in doc]
    if missing:
        return f"missing fields {missing}"
    for name, value in doc.items():
        kind, non_negative = _INFO_FIELDS[name]
        if isinstance(value, bool) or not isinstance(value, kind):
            return f"{name} is {type(value).__name__}, not {kind.__name__}"
        if non_negative and value < 0:
            return f"{name} is negative ({value})"
        if name == "p2p" and any(isinstance(v, bool) or v not in (0, 1) for v in value):
            return "p2p must hold 0 or 1 per rank"
    return ""


@dataclass
class PeerLink:
    """How the kernels reach one peer."""
    rank: int
    kind: str
    detail: str = ""
    store_base: int = 0        # address this process may store into (local/nvlink), 0 on NIC paths
    remote_addr: int = 0       # NIC: the peer buffer's address as its MR sees it
    rkey: int = 0
    qp_contexts: List[bytes] = field(default_factory=list)   # NIC: gda::Qp device contexts
    flag_expect: int = 1       # combine flag value this peer's sends add up to on our side


def node_ids(hosts: Sequence[str], ranks_per_node: Optional[int]) -> List[int]:
    """Node index of every rank: ranks_per_node (or $PYEP_VIRTUAL_NODE_SIZE) splits ranks into
    blocks of that size (virtual nodes on one box); otherwise ranks on one host form one node."""
    size = ranks_per_node
    if size is None and os.environ.get(VIRTUAL_NODE_ENV):
        raw = os.environ[VIRTUAL_NODE_ENV]
        try:
            size = int(raw)
        except ValueError:
            raise ValueError(f"${VIRTUAL_NODE_ENV} must be a positive int, got {raw!r}") from None
        if size < 1:
            raise ValueError(f"${VIRTUAL_NODE_ENV} must be a positive int, got {raw!r}")
    if size is not None:
        if len(hosts) % size:
            raise ValueError(f"virtual node size {size} does not divide the {len(hosts)} ranks")
        return [r // size for r in range(len(hosts))]
    order: Dict[str, int] = {}
    return [order.setdefault(h, len(order)) for h in hosts]


def plan_transports(mode: str, allow_nvlink: bool, nodes: Sequence[int], p2p: Sequence[Sequence[int]],
                    nics: Sequence[str]) -> List[List[str]]:
    """The R x R table of transport kinds (plan[i][j] = how i reaches j). Symmetric by construction:
    NVLink needs both GPUs to map each other. Raises ValueError / RuntimeError naming the pair that
    the requested mode cannot connect."""
    r_n = len(nodes)
    if len(p2p) != r_n or any(len(row) != r_n for row in p2p) or len(nics) != r_n:
        raise ValueError(f"plan_transports: inconsistent sizes (nodes {r_n}, p2p {len(p2p)}, nics {len(nics)})")
    plan = [[""] * r_n for _ in range(r_n)]
    for i in range(r_n):
        for j in range(r_n):
            if i == j:
                plan[i][j] = "local"
                continue
            same = nodes[i] == nodes[j]
            mapped = bool(p2p[i][j]) and bool(p2p[j][i])
            if mode == "nvlink":
                if not same or not mapped:
                    why = "is on another node" if not same else "cannot map its GPU (no P2P access)"
                    raise ValueError(f"transport='nvlink': rank {j} {why} as seen from rank {i}")
                plan[i][j] = "nvlink"
            elif mode == "emulated":
                plan[i][j] = "emulated"
            elif mode == "emulated-internode":
                if same and not mapped:
                    raise ValueError(f"transport='emulated-internode': ranks {i} and {j} share a node but "
                                     f"cannot map each other's GPU over NVLink")
                plan[i][j] = "nvlink" if same else "emulated"
            elif mode == "ibgda":
                plan[i][j] = "ibgda"
            elif mode == "auto":
                if same and mapped and allow_nvlink:
                    plan[i][j] = "nvlink"
                else:
                    plan[i][j] = "ibgda"
            else:
                raise ValueError(f"unknown transport mode {mode!r}")
            if plan[i][j] == "ibgda" and (not nics[i] or not nics[j]):
                where = "another node" if not same else ("the same node without NVLink" if allow_nvlink
                                                         else "the same node with allow_nvlink=False")
                missing = [r for r in (i, j) if not nics[r]]
                raise RuntimeError(f"ranks {i} and {j} are on {where}, so they need the NIC path, but "
                                   f"rank(s) {missing} found no usable RDMA NIC; use transport='emulated' "
                                   f"to run the NIC path on the softnic")
    return plan


def host_name() -> str:
    return socket.gethostname()


class Transport(ABC):
    """One transport kind, connecting this rank to a set of peers."""

    kind: str = ""

    @abstractmethod
    def connect(self, peers: Sequence[int], infos: Sequence[RankInfo]) -> Dict[int, PeerLink]:
        """Connect to `peers` (collective over the group for kinds that exchange per-peer data)."""

    @abstractmethod
    def disconnect(self, peers: Sequence[int]) -> None:
        """Release what connect() built for these peers (before a reconnect or at close)."""

    @abstractmethod
    def close(self) -> None:
        """Release everything; idempotent."""
