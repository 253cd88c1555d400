"""The softnic fabric across processes: connect blobs, store exchange, two rank processes writing into
each other's shared memory, a private buffer that peers cannot reach, and a peer that dies."""
from __future__ import annotations

import glob
import multiprocessing as mp
import os
import queue
import signal
import struct
import time
import traceback
import zlib
from datetime import timedelta
from typing import Any, Dict, List

import pytest

pytest.importorskip("pyep._engine")

from pyep.softnic import (ConnectAttr, PostStatus, SoftNic, SoftNicConfig, Syndrome, agree_fabric_id,  # noqa: E402
                          exchange_blobs, new_fabric_id, parse_connect_blob, vendor_syndromes)

CHUNKS, CHUNK = 64, 1024


class DictStore:
    """The minimal store interface (set/get) the exchange helpers need."""

    def __init__(self) -> None:
        self.d: Dict[str, bytes] = {}

    def set(self, key: str, value: bytes) -> None:
        self.d[key] = bytes(value)

    def get(self, key: str) -> bytes:
        return self.d[key]


def test_blob_round_trip_and_validation() -> None:
    with SoftNic(SoftNicConfig(node_id=5)) as nic:
        cq = nic.create_cq(2)
        qps = [nic.create_qp(cq, 2) for _ in range(3)]
        buf = nic.alloc_host(8192)
        mr = nic.reg_mr(buf)
        blob = nic.connect_blob(qps, [mr])
        peer = nic.parse_blob(blob)
        assert (peer.node_id, peer.fabric_id, peer.pid) == (5, nic.fabric_id, os.getpid())
        assert peer.qpns == tuple(q.qpn for q in qps)
        assert (peer.mrs[0].addr, peer.mrs[0].length, peer.mrs[0].rkey) == (buf.addr, buf.size, mr.rkey)
        with pytest.raises(ValueError, match="magic"):
            parse_connect_blob(b"hello world, not a blob")
        with pytest.raises(ValueError, match="length|truncated"):
            parse_connect_blob(blob[:-5])
        corrupt = bytearray(blob)
        corrupt[40] ^= 0xFF
        with pytest.raises(ValueError, match="checksum"):
            parse_connect_blob(bytes(corrupt))
        with pytest.raises(ValueError, match="fabric"):
            parse_connect_blob(blob, expect_fabric=nic.fabric_id ^ 1)
        other_host = bytearray(blob[:-4])
        other_host[32:40] = struct.pack("<Q", struct.unpack_from("<Q", other_host, 32)[0] ^ 1)
        other_host += struct.pack("<I", zlib.crc32(bytes(other_host)))
        with pytest.raises(ValueError, match="another host"):
            parse_connect_blob(bytes(other_host))
        with pytest.raises(TypeError):
            parse_connect_blob("text")  # type: ignore[arg-type]
        with pytest.raises(Exception, match="not an MR"):
            nic.connect_blob(qps, [type(mr)(mr.addr, mr.length, 0x7777, 0x7777, mr.access)])


def test_store_helpers() -> None:
    store = DictStore()
    fid = agree_fabric_id(store, 0, prefix="x")
    assert agree_fabric_id(store, 1, prefix="x") == fid
    store.set("x/blob/1", b"one")  # rank 1 published first
    assert exchange_blobs(store, 0, 2, b"zero", prefix="x") == [b"zero", b"one"]
    with pytest.raises(ValueError):
        exchange_blobs(store, 2, 2, b"", prefix="x")
    store.set("y/fabric_id", b"garbage")
    with pytest.raises(ValueError, match="fabric id"):
        agree_fabric_id(store, 1, prefix="y")


# --- two rank processes ------------------------------------------------------------------------------

def _rank_main(rank: int, port: int, results: Any) -> None:
    try:
        import numpy as np
        from torch.distributed import TCPStore
        store = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
        fabric = agree_fabric_id(store, rank, prefix="t")
        with SoftNic(SoftNicConfig(node_id=rank, fabric_id=fabric)) as nic:
            cq = nic.create_cq(5)
            qp = nic.create_qp(cq, 4)
            src, data, sig, fetch = (nic.alloc_host(n) for n in (CHUNKS * CHUNK, CHUNKS * CHUNK, 4096, 4096))
            mr_src, mr_data, mr_sig, mr_fetch = (nic.reg_mr(b) for b in (src, data, sig, fetch))
            blobs = exchange_blobs(store, rank, 2, nic.connect_blob([qp], [mr_data, mr_sig]), prefix="t")
            peer = nic.parse_blob(blobs[1 - rank])
            nic.connect(qp, peer.node_id, peer.qpns[0], ConnectAttr(ack_timeout=16, retry_cnt=3))
            pattern = (np.arange(CHUNKS * CHUNK) * (rank + 3)).astype(np.uint8)
            src.numpy()[:] = pattern
            poster = nic.host_qp(qp, cq)
            pdata, psig = peer.mrs
            for i in range(CHUNKS):
                st = poster.post_write_with_signal(src.addr + i * CHUNK, mr_src.lkey, pdata.addr + i * CHUNK,
                                                   pdata.rkey, CHUNK, psig.addr, psig.rkey, 1, fetch.addr,
                                                   mr_fetch.lkey)
                poster.check(st, f"rank {rank} write {i}")
            poster.check(poster.quiet(timeout_s=20), "quiet")
            counter = sig.numpy("uint32")
            deadline = time.monotonic() + 20
            while int(counter[0]) < CHUNKS:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"rank {rank} waited 20 s for {CHUNKS} signals from rank {1 - rank}, "
                                       f"got {int(counter[0])}")
                time.sleep(0.001)
            expect = (np.arange(CHUNKS * CHUNK) * (4 - rank)).astype(np.uint8)
            if not np.array_equal(data.numpy(), expect):
                raise AssertionError(f"rank {rank}: data from rank {1 - rank} differs")
            store.set(f"t/done/{rank}", b"1")
            store.wait([f"t/done/{1 - rank}"], timedelta(seconds=30))
        results.put((rank, "ok"))
    except BaseException:  # reported to the parent, which fails the test with it
        results.put((rank, traceback.format_exc()))


def _collect(procs: List[Any], results: Any, n: int, timeout_s: float) -> Dict[int, str]:
    got: Dict[int, str] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(got) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"waited {timeout_s} s for {n} rank processes, heard from {sorted(got)}")
            try:
                rank, text = results.get(timeout=min(left, 1.0))
                got[rank] = text
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs):
                    raise AssertionError(f"a rank process died: {[p.exitcode for p in procs]}, results {got}")
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    return got


def test_two_processes_write_into_each_other() -> None:
    torch_dist = pytest.importorskip("torch.distributed")
    store = torch_dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                timeout=timedelta(seconds=30))
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, store.port, results)) for r in range(2)]
    for p in procs:
        p.start()
    got = _collect(procs, results, 2, 90)
    assert got == {0: "ok", 1: "ok"}, "\n".join(got.values())


# --- a peer process that dies -----------------------------------------------------------------------

def _peer_main(fabric: int, conn: Any) -> None:
    import numpy as np
    nic = SoftNic(SoftNicConfig(node_id=1, fabric_id=fabric))
    cq = nic.create_cq(3)
    qps = [nic.create_qp(cq, 3) for _ in range(2)]
    shared = nic.alloc_host(4096)
    private = np.zeros(4096, dtype=np.uint8)  # ordinary process memory: not reachable by other processes
    mrs = [nic.reg_mr(shared), nic.reg_mr(private)]
    conn.send(nic.connect_blob(qps, mrs))
    peer = nic.parse_blob(conn.recv())
    for qp, rq in zip(qps, peer.qpns):
        nic.connect(qp, peer.node_id, rq, ConnectAttr(ack_timeout=10, retry_cnt=1))
    conn.send("ready")
    while True:  # serve read-backs until killed
        n = conn.recv()
        conn.send(bytes(shared.numpy()[:n]))


def test_private_memory_and_dead_peer() -> None:
    fabric = new_fabric_id()
    ctx = mp.get_context("spawn")
    parent_end, child_end = ctx.Pipe()
    proc = ctx.Process(target=_peer_main, args=(fabric, child_end))
    proc.start()
    try:
        assert parent_end.poll(60), "peer process did not send its connect blob within 60 s"
        peer = parse_connect_blob(parent_end.recv(), fabric)
        with SoftNic(SoftNicConfig(node_id=0, fabric_id=fabric)) as nic:
            cqs = [nic.create_cq(3) for _ in range(2)]  # a qp.h poster owns its CQ: one per QP
            qps = [nic.create_qp(cq, 3) for cq in cqs]
            attr = ConnectAttr(ack_timeout=10, retry_cnt=1)  # ~8 ms of retries
            for qp, rq in zip(qps, peer.qpns):
                nic.connect(qp, 1, rq, attr)
            parent_end.send(nic.connect_blob(qps))
            assert parent_end.poll(30) and parent_end.recv() == "ready"
            src = nic.alloc_host(4096)
            mr = nic.reg_mr(src)
            src.numpy()[:100] = bytearray(range(100))
            shared, private = peer.mrs
            poster = nic.host_qp(qps[0], cqs[0])
            assert poster.post_rdma_write(src.addr, mr.lkey, shared.addr, shared.rkey, 100, signaled=True) == \
                PostStatus.OK
            assert poster.quiet() == PostStatus.OK
            parent_end.send(100)
            assert parent_end.poll(10) and parent_end.recv() == bytes(range(100))

            other = nic.host_qp(qps[1], cqs[1])
            assert other.post_rdma_write(src.addr, mr.lkey, private.addr, private.rkey, 8, signaled=True) == \
                PostStatus.OK
            assert other.quiet() == PostStatus.ERR_QP
            err = other.error()
            assert (err.syndrome, err.vendor_syndrome) == (Syndrome.REMOTE_ACCESS_ERR,
                                                           vendor_syndromes()["not_shareable"])

            os.kill(proc.pid, signal.SIGKILL)
            proc.join(timeout=10)
            time.sleep(0.1)  # the softnic re-checks a peer's liveness every 50 ms
            assert poster.post_rdma_write(src.addr, mr.lkey, shared.addr, shared.rkey, 8, signaled=True) == \
                PostStatus.OK
            t0 = time.monotonic()
            assert poster.quiet(timeout_s=10) == PostStatus.ERR_QP
            assert time.monotonic() - t0 < 5
            err = poster.error()
            assert (err.syndrome, err.vendor_syndrome) == (Syndrome.TRANSPORT_RETRY_EXC_ERR, vendor_syndromes()["retry"])
            assert "not reachable" in nic.qp_stats(qps[0]).last_error
            nic.events(log_them=False)
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join(timeout=10)
        # the killed peer could not unlink its segments
        for path in glob.glob(f"/dev/shm/pyep-sn-{fabric:016x}-*"):
            os.unlink(path)


def test_restarted_peer_under_the_same_node_id() -> None:
    """A peer process SIGKILLed while our QP still has a WQE for it (stalled, retrying), then a new
    process of the same node id (elastic rejoin on the softnic): new QPs reach the new process at once,
    the old QP keeps failing towards the dead one, and a peer found dead is not re-probed on every pass."""
    fabric = new_fabric_id()
    ctx = mp.get_context("spawn")

    def start() -> Any:
        parent_end, child_end = ctx.Pipe()
        proc = ctx.Process(target=_peer_main, args=(fabric, child_end))
        proc.start()
        assert parent_end.poll(60), "peer process did not send its connect blob within 60 s"
        return proc, parent_end, parse_connect_blob(parent_end.recv(), fabric)

    procs = []
    try:
        with SoftNic(SoftNicConfig(node_id=0, fabric_id=fabric)) as nic:
            src = nic.alloc_host(4096)
            mr = nic.reg_mr(src)
            src.numpy()[:64] = bytearray(range(64))

            def link(conn: Any, peer: Any, attr: Any) -> Any:
                cqs = [nic.create_cq(3) for _ in range(2)]
                qps = [nic.create_qp(cq, 3) for cq in cqs]
                for qp, rq in zip(qps, peer.qpns):
                    nic.connect(qp, 1, rq, attr)
                conn.send(nic.connect_blob(qps))
                assert conn.poll(30) and conn.recv() == "ready"
                return [nic.host_qp(qp, cq) for qp, cq in zip(qps, cqs)], qps

            proc, conn, peer = start()
            procs.append(proc)
            old, old_qps = link(conn, peer, ConnectAttr(ack_timeout=16, retry_cnt=7))   # ~2 s of retries
            os.kill(proc.pid, signal.SIGKILL)
            proc.join(timeout=10)
            time.sleep(0.1)
            shared = peer.mrs[0]
            assert old[0].post_rdma_write(src.addr, mr.lkey, shared.addr, shared.rkey, 8, signaled=True) == \
                PostStatus.OK
            time.sleep(0.2)                                  # the old QP stalls on the dead node
            assert nic.qp_stats(old_qps[0]).wqes == 0
            proc, conn, peer = start()                       # the same node id, a new process
            procs.append(proc)
            new, _ = link(conn, peer, ConnectAttr(ack_timeout=10, retry_cnt=1))
            shared = peer.mrs[0]
            t0 = time.monotonic()
            assert new[0].post_rdma_write(src.addr, mr.lkey, shared.addr, shared.rkey, 64, signaled=True) == \
                PostStatus.OK
            assert new[0].quiet(timeout_s=10) == PostStatus.OK
            assert time.monotonic() - t0 < 1.0
            conn.send(64)
            assert conn.poll(10) and conn.recv() == bytes(range(64))
            # The old QP was connected to the dead process's QP: the new one does not accept it.
            assert old[0].quiet(timeout_s=10) == PostStatus.ERR_QP
            nic.events(log_them=False)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=10)
        for path in glob.glob(f"/dev/shm/pyep-sn-{fabric:016x}-*"):
            os.unlink(path)
