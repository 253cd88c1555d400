"""Per-link rejoin on the softnic with host memory (issue 12): a restarted rank gets new QPs; each
survivor rebuilds only its QPs towards that rank (pyep.transport.connect.Connections.rebuild_peer, the
call NicTransport.rebuild_peer makes for EpBuffer), and a survivor's other QPs keep their numbers,
their state and their counters (WQEs executed, bytes, doorbells, consumer index) across the rejoin."""
from __future__ import annotations

from typing import Any, Dict, List

from pyep.softnic import SoftNic, SoftNicConfig
from pyep.transport.connect import ConnectConfig, Connections
from pyep.transport.connect_info import Region
from test_connect_softnic import write

FABRIC = 0x5EED0C12


def _rank(rank: int, world: int) -> List[Any]:
    nic = SoftNic(SoftNicConfig(node_id=rank + 1, fabric_id=FABRIC))
    buf = nic.alloc_host(1 << 12)
    mr = nic.reg_mr(buf)
    conn = Connections(nic, rank, world, ConnectConfig(qps_per_peer=2, log_sq=6),
                       regions=[Region("buf", mr.addr, mr.length, mr.rkey)])
    return [nic, buf, mr, conn]


_POSTERS: Dict[Any, Any] = {}


def _write(ranks: List[List[Any]], src: int, dst: int, payload: bytes) -> None:
    """A write on every QP src has towards dst (test_connect_softnic.write, posters kept per QP)."""
    for i in range(len(ranks[src][3].qps(dst))):
        write(ranks, src, dst, payload, i, _POSTERS)


def _state(ranks: List[List[Any]], me: int, peer: int) -> List[Dict[str, Any]]:
    nic, _, _, conn = ranks[me]
    out = []
    for q in conn.qps(peer):
        st = nic.qp_stats(q.qp["qpn"])
        out.append({"qpn": q.qp["qpn"], "remote_qpn": q.remote_qpn, "state": int(st.state), "wqes": st.wqes,
                    "bytes": st.bytes, "doorbells": st.doorbells, "consumer_index": st.consumer_index})
    return out


def test_rejoin_rebuilds_only_the_links_to_the_restarted_rank() -> None:
    world = 3
    ranks = [_rank(r, world) for r in range(world)]
    try:
        blobs = [r[3].local_info().to_bytes() for r in ranks]
        for r in ranks:
            r[3].connect(blobs)
        for src in range(world):
            for dst in range(world):
                if src != dst:
                    _write(ranks, src, dst, f"{src}->{dst} before".encode())
        before = {(0, 2): _state(ranks, 0, 2), (2, 0): _state(ranks, 2, 0)}
        assert all(s["wqes"] == 1 and s["doorbells"] >= 1 for v in before.values() for s in v)
        old_to_1 = [q["qpn"] for q in _state(ranks, 0, 1)]

        # Rank 1 dies (its softnic and QPs go with it) and a new process takes its place.
        nic1, _, _, conn1 = ranks[1]
        conn1.close()
        for key in [k for k in _POSTERS if k[0] == id(nic1)]:
            del _POSTERS[key]
        nic1.close()
        ranks[1] = _rank(1, world)
        announced = ranks[1][3].local_info().to_bytes()
        survivor_blobs = {}
        for s in (0, 2):
            conn = ranks[s][3]
            conn.validate(1, announced)
            conn.rebuild_peer(1)
            conn.connect_peer(1, announced)
            survivor_blobs[s] = conn.local_info().to_bytes()
        for s in (0, 2):
            ranks[1][3].connect_peer(s, survivor_blobs[s])

        # The links between the survivors: same QPs, same state, same counters.
        assert _state(ranks, 0, 2) == before[(0, 2)] and _state(ranks, 2, 0) == before[(2, 0)]
        new_to_1 = [q["qpn"] for q in _state(ranks, 0, 1)]
        assert set(new_to_1).isdisjoint(old_to_1)
        assert all(q["wqes"] == 0 for q in _state(ranks, 0, 1))   # fresh QPs towards the newcomer
        for src in range(world):
            for dst in range(world):
                if src != dst:
                    _write(ranks, src, dst, f"{src}->{dst} after".encode())
        assert [s["wqes"] for s in _state(ranks, 0, 2)] == [2, 2]
    finally:
        _POSTERS.clear()
        for nic, _, _, conn in ranks:
            conn.close()
            nic.close()


def test_bad_announcement_blob_leaves_the_survivor_untouched() -> None:
    ranks = [_rank(r, 2) for r in range(2)]
    try:
        blobs = [r[3].local_info().to_bytes() for r in ranks]
        for r in ranks:
            r[3].connect(blobs)
        before = _state(ranks, 0, 1)
        bad = ranks[1][3].local_info().to_bytes().replace(b'"world_size":2', b'"world_size":5')
        import pytest
        with pytest.raises(ValueError, match="rank 1.*world_size"):
            ranks[0][3].validate(1, bad)      # NicTransport.rebuild_peer validates before rebuilding
        assert _state(ranks, 0, 1) == before
    finally:
        for nic, _, _, conn in ranks:
            conn.close()
            nic.close()
