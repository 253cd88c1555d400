"""pyep.transport.connect driven over the softnic provider: the whole setup sequence (CQ, QP,
RST->INIT->RTR->RTS, exchange), data actually moving over the connected QPs, rebuilding one peer's QPs
while the others stay untouched, a restarted rank rejoining, and the exchange across processes."""
from __future__ import annotations

from typing import List, Tuple

import pytest

from pyep.softnic import CqInfo, QpInfo, SoftNic, SoftNicConfig
from pyep.transport.connect import ConnectConfig, Connections, driver_for, exchange, psn_for, torch_allgather
from pyep.transport.connect_info import Region

FABRIC = 0x5EED0001


def make_rank(rank: int, world: int, qps: int = 2) -> Tuple[SoftNic, object, object, Connections]:
    nic = SoftNic(SoftNicConfig(node_id=rank + 1, fabric_id=FABRIC))
    buf = nic.alloc_host(1 << 12)
    mr = nic.reg_mr(buf)
    conn = Connections(nic, rank, world, ConnectConfig(qps_per_peer=qps, log_sq=6),
                       regions=[Region("buf", mr.addr, mr.length, mr.rkey)])
    return nic, buf, mr, conn


def write(ranks, src: int, dst: int, payload: bytes, qp_index: int = 0, posters=None) -> None:
    """One signaled RDMA write src -> dst on QP qp_index, quiet, and check the bytes landed. `posters`
    (a dict) keeps one host poster per QP across calls: a poster holds the producer index, as a GPU
    context does, so a QP used again must be posted through the same one."""
    nic, buf, mr, conn = ranks[src]
    q = conn.qps(dst)[qp_index]
    key = (id(nic), q.qp["qpn"])
    hq = posters.get(key) if posters is not None else None
    if hq is None:
        hq = nic.host_qp(QpInfo(**q.qp), CqInfo(**q.cq))
        if posters is not None:
            posters[key] = hq
    buf.view[:len(payload)] = payload
    region = conn.remote[dst].region("buf")
    hq.check(hq.post_rdma_write(mr.addr, mr.lkey, region.addr, region.rkey, len(payload), signaled=True,
                                timeout_s=10.0), "rdma write")
    hq.check(hq.quiet(timeout_s=10.0), "quiet")
    assert bytes(ranks[dst][1].view[:len(payload)]) == payload


@pytest.fixture()
def world3():
    ranks = [make_rank(r, 3) for r in range(3)]
    blobs = [r[3].local_info().to_bytes() for r in ranks]
    for r in ranks:
        r[3].connect(blobs)
    yield ranks
    for nic, _, _, conn in ranks:
        conn.close()
        nic.close()


def qpns(conn: Connections, peer: int) -> List[int]:
    return [q.qp["qpn"] for q in conn.qps(peer)]


def test_full_sequence_reaches_rts_and_moves_data(world3) -> None:
    for rank, (_, _, _, conn) in enumerate(world3):
        for peer in range(3):
            if peer != rank:
                assert conn.states(peer) == [3, 3] and conn.connected(peer)
                # Each of our QPs targets exactly the QP the peer created for us.
                assert [q.remote_qpn for q in conn.qps(peer)] == list(world3[peer][3].local_info().qpns[rank])
    write(world3, 0, 1, b"to rank one")
    write(world3, 2, 0, b"two->zero", qp_index=1)
    write(world3, 1, 2, b"one->two")


def test_rebuild_one_peer_leaves_others_untouched(world3) -> None:
    c0, c1, c2 = (r[3] for r in world3)
    before_02, before_20, before_12 = qpns(c0, 2), qpns(c2, 0), qpns(c1, 2)
    old_01 = qpns(c0, 1)
    info0 = c0.rebuild_peer(1)
    info1 = c1.rebuild_peer(0)
    assert info0.generation == 1 and info1.generation == 1
    new_01 = qpns(c0, 1)
    assert set(new_01).isdisjoint(old_01)
    assert c0.states(1) == [1, 1]          # rebuilt QPs wait in INIT for the peer's new info
    assert qpns(c0, 2) == before_02 and qpns(c2, 0) == before_20 and qpns(c1, 2) == before_12
    assert c0.connected(2) and c2.connected(0) and c1.connected(2)
    c0.connect_peer(1, info1.to_bytes())
    c1.connect_peer(0, info0.to_bytes())
    assert c0.connected(1) and c1.connected(0)
    write(world3, 0, 1, b"after rebuild")
    write(world3, 1, 0, b"and back")
    write(world3, 0, 2, b"untouched path still works")


def test_restarted_rank_rejoins() -> None:
    ranks = [make_rank(r, 3) for r in range(3)]
    try:
        blobs = [r[3].local_info().to_bytes() for r in ranks]
        for r in ranks:
            r[3].connect(blobs)
        # Rank 1 dies and comes back as a fresh process would: new softnic, new QPs, generation 0.
        nic1, _, _, conn1 = ranks[1]
        conn1.close()
        nic1.close()
        ranks[1] = make_rank(1, 3)
        survivors = {r: ranks[r][3].rebuild_peer(1).to_bytes() for r in (0, 2)}
        untouched = qpns(ranks[0][3], 2)
        blobs = [survivors[0], ranks[1][3].local_info().to_bytes(), survivors[2]]
        ranks[1][3].connect(blobs)
        for r in (0, 2):
            ranks[r][3].connect_peer(1, blobs[1])
        assert qpns(ranks[0][3], 2) == untouched
        write(ranks, 0, 1, b"welcome back")
        write(ranks, 1, 2, b"hello two")
        write(ranks, 2, 1, b"hello one")
    finally:
        for nic, _, _, conn in ranks:
            conn.close()
            nic.close()


def test_psns_agree_between_the_two_ends(world3) -> None:
    c0, c1 = world3[0][3], world3[1][3]
    for mine, theirs in zip(c0.qps(1), c1.qps(0)):
        attr0 = c0._attr(c0.remote[1], mine.qp["qpn"], mine.remote_qpn)
        attr1 = c1._attr(c1.remote[0], theirs.qp["qpn"], theirs.remote_qpn)
        assert attr0["sq_psn"] == attr1["rq_psn"] == psn_for(mine.qp["qpn"])


def test_bad_blob_leaves_every_qp_untouched() -> None:
    ranks = [make_rank(r, 2, qps=1) for r in range(2)]
    try:
        good = ranks[1][3].local_info()
        bad = good.to_bytes().replace(b'"world_size":2', b'"world_size":3')
        with pytest.raises(ValueError, match="rank 1.*world_size"):
            ranks[0][3].connect([ranks[0][3].local_info().to_bytes(), bad])
        assert ranks[0][3].states(1) == [1]   # still INIT: nothing moved
    finally:
        for nic, _, _, conn in ranks:
            conn.close()
            nic.close()


def test_other_fabric_rejected() -> None:
    a = make_rank(0, 2, qps=1)
    other = SoftNic(SoftNicConfig(node_id=2, fabric_id=FABRIC + 1))
    b = Connections(other, 1, 2, ConnectConfig(qps_per_peer=1, log_sq=6))
    try:
        with pytest.raises(ValueError, match="rank 1.*fabric_id"):
            a[3].connect_peer(1, b.local_info().to_bytes())
    finally:
        b.close()
        other.close()
        a[3].close()
        a[0].close()


def test_config_and_provider_validation() -> None:
    with pytest.raises(ValueError):
        ConnectConfig(qps_per_peer=0)
    with pytest.raises(ValueError):
        ConnectConfig(placement="gpu")
    with pytest.raises(TypeError):
        ConnectConfig(log_sq=3.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        driver_for(object())
    nic = SoftNic(SoftNicConfig(node_id=1, fabric_id=FABRIC))
    try:
        with pytest.raises(ValueError, match="rank"):
            Connections(nic, 2, 2)
        with pytest.raises(ValueError, match="sl"):
            Connections(nic, 0, 2, environ={"NCCL_IB_SL": "16"})
    finally:
        nic.close()


def _cross_process(fabric: int) -> bytes:
    import torch.distributed as dist
    rank = dist.get_rank()
    nic = SoftNic(SoftNicConfig(node_id=rank + 1, fabric_id=fabric))
    try:
        buf = nic.alloc_host(4096)
        mr = nic.reg_mr(buf)
        conn = Connections(nic, rank, 2, ConnectConfig(qps_per_peer=1, log_sq=6),
                           regions=[Region("buf", mr.addr, mr.length, mr.rkey)])
        exchange(conn, torch_allgather())
        if rank == 0:
            q = conn.qps(1)[0]
            hq = nic.host_qp(QpInfo(**q.qp), CqInfo(**q.cq))
            buf.view[:12] = b"across procs"
            region = conn.remote[1].region("buf")
            hq.check(hq.post_rdma_write(mr.addr, mr.lkey, region.addr, region.rkey, 12, True, 10.0))
            hq.check(hq.quiet(10.0))
        dist.barrier()
        got = bytes(buf.view[:12])
        dist.barrier()
        conn.close()
        return got
    finally:
        nic.close()


def test_exchange_across_processes(pool2) -> None:
    results = pool2.run(_cross_process, FABRIC + 7)
    assert results[1] == b"across procs"
