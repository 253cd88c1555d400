"""What one rank tells every other rank at connect time, and the validation of what it receives.

A peer's blob is untrusted input: it decides which QP numbers our QPs target, which remote addresses
and keys our GPU threads write to, and which IPC handles we open. Every field is parsed and checked
(type, length, range, shape, consistency with our own setup) before anything uses it; a malformed blob
raises ValueError naming the peer and the field.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Dict, List, Sequence, Tuple

FORMAT = "pyep-connect/1"
MAX_BLOB_BYTES = 1 << 20
MAX_WORLD = 1 << 16
MAX_QPS_PER_PEER = 64
MAX_REGIONS = 64
MAX_IPC_HANDLES = 256
IPC_HANDLE_BYTES = 64            # cudaIpcMemHandle_t
LINKS = ("ib", "roce", "softnic")
MTUS = (256, 512, 1024, 2048, 4096)
MAX_UNICAST_LID = 0xBFFF


@dataclass(frozen=True)
class Region:
    """A memory region peers may access: name, address, length and rkey."""
    name: str
    addr: int
    length: int
    rkey: int


@dataclass(frozen=True)
class EndpointInfo:
    rank: int
    world_size: int
    provider: str                          # "softnic" or "devx"
    link: str                              # "ib", "roce" or "softnic"
    generation: int                        # bumped each time this rank rebuilds QPs (rejoin)
    qpns: Tuple[Tuple[int, ...], ...]      # qpns[p]: this rank's QPs towards rank p (empty for itself)
    regions: Tuple[Region, ...] = ()
    ipc_handles: Tuple[bytes, ...] = ()
    node_id: int = 0                       # softnic node id
    fabric_id: int = 0                     # softnic fabric id
    lid: int = 0
    gid: bytes = bytes(16)
    mac: bytes = bytes(6)
    port: int = 1
    mtu: int = 4096

    def to_bytes(self) -> bytes:
        doc: Dict[str, Any] = {
            "format": FORMAT, "rank": self.rank, "world_size": self.world_size, "provider": self.provider,
            "link": self.link, "generation": self.generation, "qpns": [list(q) for q in self.qpns],
            "regions": [[r.name, r.addr, r.length, r.rkey] for r in self.regions],
            "ipc_handles": [h.hex() for h in self.ipc_handles], "node_id": self.node_id,
            "fabric_id": self.fabric_id, "lid": self.lid, "gid": self.gid.hex(), "mac": self.mac.hex(),
            "port": self.port, "mtu": self.mtu,
        }
        return json.dumps(doc, separators=(",", ":")).encode()

    def region(self, name: str) -> Region:
        for r in self.regions:
            if r.name == name:
                return r
        raise KeyError(f"rank {self.rank} published no region named {name!r}")


class _Checker:
    def __init__(self, peer: str) -> None:
        self.peer = peer

    def fail(self, fld: str, why: str) -> ValueError:
        return ValueError(f"connect info from {self.peer}: field {fld!r} {why}")

    def int(self, doc: Dict[str, Any], fld: str, lo: int, hi: int, value: Any = None) -> int:
        v = doc.get(fld) if value is None else value
        if isinstance(v, bool) or not isinstance(v, int):
            raise self.fail(fld, f"must be an integer, got {type(v).__name__}")
        if not lo <= v <= hi:
            raise self.fail(fld, f"= {v} is outside [{lo}, {hi}]")
        return v

    def hexbytes(self, doc: Dict[str, Any], fld: str, n: int, value: Any = None) -> bytes:
        v = doc.get(fld) if value is None else value
        if not isinstance(v, str):
            raise self.fail(fld, f"must be a hex string, got {type(v).__name__}")
        try:
            b = bytes.fromhex(v)
        except ValueError:
            raise self.fail(fld, "is not valid hex") from None
        if len(b) != n:
            raise self.fail(fld, f"must be {n} bytes, got {len(b)}")
        return b

    def choice(self, doc: Dict[str, Any], fld: str, options: Sequence[str]) -> str:
        v = doc.get(fld)
        if v not in options:
            raise self.fail(fld, f"= {v!r} is not one of {', '.join(options)}")
        return v

    def list(self, doc: Dict[str, Any], fld: str, max_len: int, value: Any = None) -> List[Any]:
        v = doc.get(fld) if value is None else value
        if not isinstance(v, list):
            raise self.fail(fld, f"must be a list, got {type(v).__name__}")
        if len(v) > max_len:
            raise self.fail(fld, f"has {len(v)} entries, more than {max_len}")
        return v


def decode(blob: Any, peer: int, world_size: int, qps_per_peer: int) -> EndpointInfo:
    """Parses and validates the blob rank `peer` sent. Checks everything that can be checked without
    knowing our own provider (see `check_compatible` for that)."""
    c = _Checker(f"rank {peer}")
    if not isinstance(blob, (bytes, bytearray)):
        raise TypeError(f"connect info from rank {peer} must be bytes, got {type(blob).__name__}")
    if len(blob) > MAX_BLOB_BYTES:
        raise c.fail("<blob>", f"is {len(blob)} bytes, more than {MAX_BLOB_BYTES}")
    try:
        doc = json.loads(bytes(blob).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise c.fail("<blob>", f"is not a pyep connect document ({exc})") from None
    if not isinstance(doc, dict):
        raise c.fail("<blob>", "is not a JSON object")
    if doc.get("format") != FORMAT:
        raise c.fail("format", f"= {doc.get('format')!r}, expected {FORMAT!r}")
    unknown = set(doc) - {"format", "rank", "world_size", "provider", "link", "generation", "qpns", "regions",
                          "ipc_handles", "node_id", "fabric_id", "lid", "gid", "mac", "port", "mtu"}
    if unknown:
        raise c.fail(sorted(unknown)[0], "is not a known field")
    rank = c.int(doc, "rank", 0, MAX_WORLD - 1)
    if rank != peer:
        raise c.fail("rank", f"= {rank}, but the blob arrived as rank {peer}'s")
    ws = c.int(doc, "world_size", 1, MAX_WORLD)
    if ws != world_size:
        raise c.fail("world_size", f"= {ws}, ours is {world_size}")
    provider = c.choice(doc, "provider", ("softnic", "devx"))
    link = c.choice(doc, "link", LINKS)
    if (provider == "softnic") != (link == "softnic"):
        raise c.fail("link", f"= {link!r} does not fit provider {provider!r}")
    qpns_raw = c.list(doc, "qpns", MAX_WORLD)
    if len(qpns_raw) != world_size:
        raise c.fail("qpns", f"has {len(qpns_raw)} rows, expected one per rank ({world_size})")
    qpns: List[Tuple[int, ...]] = []
    seen = set()
    for p, row in enumerate(qpns_raw):
        row = c.list(doc, f"qpns[{p}]", MAX_QPS_PER_PEER, row)
        want = 0 if p == peer else qps_per_peer
        if len(row) != want:
            raise c.fail(f"qpns[{p}]", f"has {len(row)} QPs, expected {want}")
        vals = tuple(c.int(doc, f"qpns[{p}][{i}]", 1, 0xFFFFFF, q) for i, q in enumerate(row))
        for i, q in enumerate(vals):
            if q in seen:
                raise c.fail(f"qpns[{p}][{i}]", f"= {q:#x} appears twice")
            seen.add(q)
        qpns.append(vals)
    regions: List[Region] = []
    for i, r in enumerate(c.list(doc, "regions", MAX_REGIONS)):
        f = f"regions[{i}]"
        if not isinstance(r, list) or len(r) != 4:
            raise c.fail(f, "must be [name, addr, length, rkey]")
        name = r[0]
        if not isinstance(name, str) or not 0 < len(name) <= 64 or not name.isprintable():
            raise c.fail(f + ".name", "must be a printable string of 1..64 characters")
        if any(x.name == name for x in regions):
            raise c.fail(f + ".name", f"= {name!r} appears twice")
        addr = c.int(doc, f + ".addr", 0, 2**64 - 1, r[1])
        length = c.int(doc, f + ".length", 1, 1 << 48, r[2])
        if addr + length > 2**64:
            raise c.fail(f + ".length", "runs past the end of the address space")
        regions.append(Region(name, addr, length, c.int(doc, f + ".rkey", 0, 2**32 - 1, r[3])))
    handles = tuple(c.hexbytes(doc, f"ipc_handles[{i}]", IPC_HANDLE_BYTES, h)
                    for i, h in enumerate(c.list(doc, "ipc_handles", MAX_IPC_HANDLES)))
    info = EndpointInfo(
        rank=rank, world_size=ws, provider=provider, link=link,
        generation=c.int(doc, "generation", 0, 2**31 - 1), qpns=tuple(qpns), regions=tuple(regions),
        ipc_handles=handles, node_id=c.int(doc, "node_id", 0, 2**63 - 1),
        fabric_id=c.int(doc, "fabric_id", 0, 2**64 - 1), lid=c.int(doc, "lid", 0, 0xFFFF),
        gid=c.hexbytes(doc, "gid", 16), mac=c.hexbytes(doc, "mac", 6), port=c.int(doc, "port", 1, 255),
        mtu=c.int(doc, "mtu", 256, 4096))
    if info.mtu not in MTUS:
        raise c.fail("mtu", f"= {info.mtu} is not one of {MTUS}")
    if link == "ib" and not 1 <= info.lid <= MAX_UNICAST_LID:
        raise c.fail("lid", f"= {info.lid:#x} is not a unicast LID (1..{MAX_UNICAST_LID:#x})")
    if link == "roce":
        if info.gid == bytes(16):
            raise c.fail("gid", "is all zero: a RoCE peer must send the GID its QPs use")
        if info.mac[0] & 1:
            raise c.fail("mac", f"= {info.mac.hex(':')} is a multicast address")
    return info


def check_compatible(ours: EndpointInfo, theirs: EndpointInfo) -> None:
    """What must agree between two endpoints before their QPs can be connected."""
    c = _Checker(f"rank {theirs.rank}")
    if theirs.provider != ours.provider:
        raise c.fail("provider", f"= {theirs.provider!r}, ours is {ours.provider!r}")
    if theirs.link != ours.link:
        raise c.fail("link", f"= {theirs.link!r}, ours is {ours.link!r} (InfiniBand and RoCE do not mix)")
    if ours.provider == "softnic":
        if theirs.fabric_id != ours.fabric_id:
            raise c.fail("fabric_id", f"= {theirs.fabric_id:#x}, ours is {ours.fabric_id:#x} (another job's softnic)")
        if theirs.node_id == ours.node_id:
            raise c.fail("node_id", f"= {theirs.node_id} is our own softnic node id")
