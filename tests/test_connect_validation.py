"""Peer-supplied connect info is validated field by field before use (pyep.transport.connect_info)."""
from __future__ import annotations

import json
from typing import Any, Callable, Dict

import pytest

from pyep.transport.connect_info import EndpointInfo, Region, check_compatible, decode

WORLD, QPS = 3, 2


def good(link: str = "roce", rank: int = 1) -> EndpointInfo:
    qpns = tuple(() if p == rank else (0x100 + 4 * p, 0x101 + 4 * p) for p in range(WORLD))
    return EndpointInfo(rank=rank, world_size=WORLD, provider="softnic" if link == "softnic" else "devx", link=link,
                        generation=0, qpns=qpns, regions=(Region("buf", 0x7F0000000000, 1 << 20, 0x1234),),
                        ipc_handles=(bytes(range(64)),), node_id=2 if link == "softnic" else 0,
                        fabric_id=99 if link == "softnic" else 0, lid=0x11 if link == "ib" else 0,
                        gid=bytes([0] * 10 + [0xFF, 0xFF, 192, 168, 1, 11]) if link != "softnic" else bytes(16),
                        mac=bytes.fromhex("b83fd2102003") if link == "roce" else bytes(6), port=1, mtu=4096)


def mutated(change: Callable[[Dict[str, Any]], None], link: str = "roce") -> bytes:
    doc = json.loads(good(link).to_bytes())
    change(doc)
    return json.dumps(doc).encode()


def test_round_trip() -> None:
    for link in ("roce", "ib", "softnic"):
        info = good(link)
        assert decode(info.to_bytes(), 1, WORLD, QPS) == info


def _set(key: str, value: Any) -> Callable[[Dict[str, Any]], None]:
    return lambda d: d.__setitem__(key, value)


BAD = [
    ("rank", _set("rank", 2)),
    ("rank", _set("rank", True)),
    ("world_size", _set("world_size", 4)),
    ("provider", _set("provider", "verbs")),
    ("link", _set("link", "softnic")),
    ("format", _set("format", "pyep-connect/0")),
    ("extra", _set("extra", 1)),
    ("qpns", _set("qpns", [[], []])),
    ("qpns[0]", lambda d: d["qpns"].__setitem__(0, [0x100])),
    ("qpns[1]", lambda d: d["qpns"].__setitem__(1, [5, 6])),
    ("qpns[0][0]", lambda d: d["qpns"][0].__setitem__(0, 0)),
    ("qpns[0][1]", lambda d: d["qpns"][0].__setitem__(1, 1 << 24)),
    ("qpns[2][0]", lambda d: d["qpns"][2].__setitem__(0, d["qpns"][0][0])),
    ("qpns[0][0]", lambda d: d["qpns"][0].__setitem__(0, "256")),
    ("regions[0]", lambda d: d["regions"].__setitem__(0, ["buf", 1, 2])),
    ("regions[0].name", lambda d: d["regions"][0].__setitem__(0, "")),
    ("regions[1].name", lambda d: d["regions"].append(list(d["regions"][0]))),
    ("regions[0].addr", lambda d: d["regions"][0].__setitem__(1, -1)),
    ("regions[0].length", lambda d: d["regions"][0].__setitem__(2, 0)),
    ("regions[0].length", lambda d: d["regions"][0].__setitem__(1, 2**64 - 16)),
    ("regions[0].rkey", lambda d: d["regions"][0].__setitem__(3, 2**32)),
    ("regions", _set("regions", [["r%d" % i, 0, 1, 0] for i in range(65)])),
    ("ipc_handles[0]", lambda d: d["ipc_handles"].__setitem__(0, "00" * 63)),
    ("ipc_handles[0]", lambda d: d["ipc_handles"].__setitem__(0, "zz" * 64)),
    ("gid", _set("gid", "00" * 15)),
    ("gid", _set("gid", "00" * 16)),
    ("mac", _set("mac", "01005e000001")),
    ("mac", _set("mac", 12)),
    ("port", _set("port", 0)),
    ("mtu", _set("mtu", 1500)),
    ("generation", _set("generation", -1)),
    ("lid", _set("lid", 1 << 16)),
]


@pytest.mark.parametrize("field,change", BAD, ids=[f"{f}-{i}" for i, (f, _) in enumerate(BAD)])
def test_malformed_field_rejected_with_peer_and_field(field: str, change) -> None:
    with pytest.raises(ValueError) as err:
        decode(mutated(change), 1, WORLD, QPS)
    msg = str(err.value)
    assert "rank 1" in msg and f"'{field}'" in msg, msg


def test_ib_peer_needs_unicast_lid() -> None:
    for lid in (0, 0xC000):
        with pytest.raises(ValueError, match="rank 1.*'lid'"):
            decode(mutated(_set("lid", lid), link="ib"), 1, WORLD, QPS)


@pytest.mark.parametrize("blob", [b"", b"\xff\xfe", b"[1,2]", b"null", b"x" * ((1 << 20) + 1)])
def test_not_a_document(blob: bytes) -> None:
    with pytest.raises(ValueError, match="rank 1"):
        decode(blob, 1, WORLD, QPS)


def test_wrong_type_is_type_error() -> None:
    with pytest.raises(TypeError, match="rank 1"):
        decode("text", 1, WORLD, QPS)  # type: ignore[arg-type]


def test_compatibility_checks() -> None:
    ours = good("roce", rank=0)
    check_compatible(ours, good("roce"))
    with pytest.raises(ValueError, match="rank 1.*'link'"):
        check_compatible(ours, good("ib"))
    with pytest.raises(ValueError, match="rank 1.*'provider'"):
        check_compatible(ours, good("softnic"))
    soft = good("softnic", rank=0)
    other = decode(mutated(_set("fabric_id", 100), link="softnic"), 1, WORLD, QPS)
    with pytest.raises(ValueError, match="fabric_id"):
        check_compatible(soft, other)
    same_node = decode(mutated(_set("node_id", soft.node_id), link="softnic"), 1, WORLD, QPS)
    with pytest.raises(ValueError, match="node_id"):
        check_compatible(soft, same_node)
