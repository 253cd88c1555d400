"""Softnic data path on host memory: writes, atomics, CQE contents, ring wraparound, concurrency."""
from __future__ import annotations

import random
import struct
import threading
from typing import Iterator

import pytest

softnic = pytest.importorskip("pyep.softnic")
pytest.importorskip("pyep._engine")

from pyep.cli.softnic import Loopback, LoopbackSpec  # noqa: E402
from pyep.softnic import PostStatus, QpState  # noqa: E402

OK = PostStatus.OK


@pytest.fixture
def lb() -> Iterator[Loopback]:
    with Loopback(LoopbackSpec(buffer_bytes=1 << 20)) as loop:
        yield loop


def ctrl(opcode: int, index: int, qpn: int, ds: int, opmod: int = 0, signaled: bool = True) -> bytes:
    return struct.pack(">II", (opmod << 24) | (index << 8) | opcode, (qpn << 8) | ds) + \
        bytes([0, 0, 0, 0x08 if signaled else 0]) + bytes(4)


def raddr_seg(addr: int, rkey: int) -> bytes:
    return struct.pack(">QII", addr, rkey, 0)


def data_seg(length: int, lkey: int, addr: int) -> bytes:
    return struct.pack(">IIQ", length, lkey, addr)


def test_writes_land_byte_exact(lb: Loopback) -> None:
    rng = random.Random(7)
    src, dst = lb.src.numpy(), lb.dst.numpy()
    src[:] = bytearray(rng.randbytes(len(src)))
    total = 0
    for length in (0, 1, 3, 64, 4095, 65536, (1 << 20) - 17):
        dst[:] = 0
        soff = rng.randrange(0, len(src) - length + 1)
        doff = rng.randrange(0, len(dst) - length + 1)
        st = lb.poster.post_rdma_write(lb.src.addr + soff, lb.mr_src.lkey, lb.dst.addr + doff, lb.mr_dst.rkey,
                                       length, signaled=True)
        assert st == OK
        assert lb.poster.quiet() == OK
        assert bytes(dst[doff:doff + length]) == bytes(src[soff:soff + length])
        assert not dst[:doff].any() and not dst[doff + length:].any()
        total += length
    stats = lb.a.qp_stats(lb.qp_a)
    assert stats.bytes == total and stats.errors == 0 and stats.state == QpState.RTS


def test_signals_add_and_fetch_old_values(lb: Loopback) -> None:
    sig32, fetch32 = lb.sig.numpy("uint32"), lb.fetch.numpy("uint32")
    sig32[3] = 0xFFFFFFF0
    expect = 0xFFFFFFF0
    for add in (0x5, 0x20, 0xFFFFFFFF, 1):  # crosses 2^32: wraps like the NIC's 32-bit adder
        assert lb.poster.post_masked_fa32(lb.sig.addr + 12, lb.mr_sig.rkey, add, lb.fetch.addr + 4,
                                          lb.mr_fetch.lkey, signaled=True) == OK
        assert lb.poster.quiet() == OK
        assert int(fetch32[1]) == expect
        expect = (expect + add) & 0xFFFFFFFF
    assert int(sig32[3]) == expect
    sig64, fetch64 = lb.sig.numpy("uint64"), lb.fetch.numpy("uint64")
    sig64[4] = 2**64 - 3
    assert lb.poster.post_fa64(lb.sig.addr + 32, lb.mr_sig.rkey, 5, lb.fetch.addr + 16, lb.mr_fetch.lkey) == OK
    assert lb.poster.quiet() == OK
    assert int(fetch64[2]) == 2**64 - 3 and int(sig64[4]) == 2
    assert lb.a.qp_stats(lb.qp_a).atomics == 5


def test_masked_fa_field_boundaries(lb: Loopback) -> None:
    """field_boundary bit i ends a field: the carry out of bit i is dropped (4- and 8-byte forms)."""
    sig32, sig64 = lb.sig.numpy("uint32"), lb.sig.numpy("uint64")
    sig32[0] = 0x0001FFFF
    wqe = ctrl(0x15, 0, lb.qp_a.qpn, 4, opmod=0x08) + raddr_seg(lb.sig.addr, lb.mr_sig.rkey) + \
        struct.pack(">IIQ", 0x00010001, 0x00008000, 0) + data_seg(4, lb.mr_fetch.lkey, lb.fetch.addr)
    assert lb.poster.post_raw(wqe) == OK
    assert lb.poster.quiet() == OK
    assert int(sig32[0]) == 0x00020000  # low 16-bit field wrapped without carrying into the high one
    assert int(lb.fetch.numpy("uint32")[0]) == 0x0001FFFF
    sig64[1] = 0x00000001_FFFFFFFF
    wqe = ctrl(0x15, 0, lb.qp_a.qpn, 4, opmod=0x09) + raddr_seg(lb.sig.addr + 8, lb.mr_sig.rkey) + \
        struct.pack(">QQ", 0x00000001_00000001, 0x00000000_80000000) + data_seg(8, lb.mr_fetch.lkey, lb.fetch.addr + 8)
    assert lb.poster.post_raw(wqe) == OK
    assert lb.poster.quiet() == OK
    assert int(sig64[1]) == 0x00000002_00000000


def test_gather_list_spanning_two_wqebbs(lb: Loopback) -> None:
    src, dst = lb.src.numpy(), lb.dst.numpy()
    src[:300] = bytearray(range(256)) + bytearray(range(44))
    segs = [(0, 10), (100, 50), (200, 7)]
    wqe = ctrl(0x08, 0, lb.qp_a.qpn, 2 + len(segs)) + raddr_seg(lb.dst.addr + 1000, lb.mr_dst.rkey)
    wqe += b"".join(data_seg(n, lb.mr_src.lkey, lb.src.addr + off) for off, n in segs)
    wqe += bytes(128 - len(wqe))
    for _ in range(5):  # a 2-WQEBB WQE in a ring of 8 also straddles the ring's end
        assert lb.poster.post_raw(wqe) == OK
    assert lb.poster.quiet() == OK
    expect = b"".join(bytes(src[off:off + n]) for off, n in segs)
    assert bytes(dst[1000:1000 + len(expect)]) == expect
    assert lb.a.qp_stats(lb.qp_a).wqes >= 5


def test_cqe_contents_deterministic_progress() -> None:
    with Loopback(LoopbackSpec(start=False, log_sq=5, log_cq=4)) as lb:  # no forced signal in 4 posts
        lb.src.numpy()[:64] = 9
        for i, length in enumerate((8, 16, 24)):
            assert lb.poster.post_rdma_write(lb.src.addr, lb.mr_src.lkey, lb.dst.addr + 64 * i, lb.mr_dst.rkey,
                                             length, signaled=True) == OK
        assert lb.poster.post_nop(signaled=False) == OK
        assert not lb.dst.numpy()[:256].any(), "nothing may land before the softnic runs"
        assert all(c.opcode == 15 and c.owner == 1 for c in lb.a.read_cq(lb.cq_a))
        assert lb.a.progress_once() >= 4
        cqes = lb.a.read_cq(lb.cq_a)
        for i, length in enumerate((8, 16, 24)):
            c = cqes[i]
            assert (c.opcode, c.owner, c.wqe_counter, c.byte_cnt, c.qpn, c.wqe_opcode) == \
                (0, 0, i, length, lb.qp_a.qpn, 0x08)
        assert cqes[3].opcode == 15, "the unsignaled NOP must not produce a CQE"
        assert bytes(lb.dst.numpy()[64:80]) == bytes([9] * 16)
        assert lb.poster.poll() == 3 and lb.poster.counters()["cons"] == 3


def test_ring_of_8_wraps_hundreds_of_times(lb: Loopback) -> None:
    sig = lb.sig.numpy("uint32")
    src, dst = lb.src.numpy(), lb.dst.numpy()
    src[:] = bytearray(random.Random(3).randbytes(len(src)))
    n = 1500
    for i in range(n):
        off = (i * 97) % (len(dst) - 256)
        st = lb.poster.post_write_with_signal(lb.src.addr + off, lb.mr_src.lkey, lb.dst.addr + off, lb.mr_dst.rkey,
                                              256, lb.sig.addr, lb.mr_sig.rkey, 1, lb.fetch.addr, lb.mr_fetch.lkey)
        assert st == OK, lb.poster.error().describe()
    assert lb.poster.quiet() == OK
    assert int(sig[0]) == n
    offs = sorted({(i * 97) % (len(dst) - 256) for i in range(n)})
    assert all(bytes(dst[o:o + 256]) == bytes(src[o:o + 256]) for o in offs)
    assert lb.poster.counters()["resv"] // 8 >= 300  # ring wraps
    assert lb.a.cq_stats(lb.cq_a).overrun is False


def test_many_threads_post_to_one_qp() -> None:
    with Loopback(LoopbackSpec(log_sq=4, log_cq=5, buffer_bytes=1 << 18)) as lb:
        threads, per_thread, chunk = 4, 150, 128
        src, dst = lb.src.numpy(), lb.dst.numpy()
        src[:] = bytearray(random.Random(5).randbytes(len(src)))
        errors: list = []

        def worker(t: int) -> None:
            for i in range(per_thread):
                off = (t * per_thread + i) * chunk
                st = lb.poster.post_write_with_signal(lb.src.addr + off, lb.mr_src.lkey, lb.dst.addr + off,
                                                      lb.mr_dst.rkey, chunk, lb.sig.addr, lb.mr_sig.rkey, 1,
                                                      lb.fetch.addr + 8 * t, lb.mr_fetch.lkey)
                if st != OK:
                    errors.append((t, i, st, lb.poster.error().describe()))
                    return

        ts = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(timeout=60)
        assert not any(t.is_alive() for t in ts), "posting threads did not finish in 60 s"
        assert not errors, errors
        assert lb.poster.quiet() == OK
        total = threads * per_thread
        assert int(lb.sig.numpy("uint32")[0]) == total
        assert bytes(dst[:total * chunk]) == bytes(src[:total * chunk])
        assert lb.a.qp_stats(lb.qp_a).wqes == lb.poster.counters()["wqes_posted"]  # every posted WQE ran


def test_batch_shares_one_doorbell(lb: Loopback) -> None:
    before = lb.a.qp_stats(lb.qp_a)
    wr = {"opcode": "rdma_write", "laddr": lb.src.addr, "lkey": lb.mr_src.lkey, "rkey": lb.mr_dst.rkey, "length": 8}
    batch = [dict(wr, raddr=lb.dst.addr + 8 * i) for i in range(5)] + [{"opcode": "nop", "signaled": True}]
    assert lb.poster.post_batch(batch) == OK
    assert lb.poster.quiet() == OK
    after = lb.a.qp_stats(lb.qp_a)
    assert after.wqes - before.wqes == 6
    assert after.doorbells - before.doorbells <= 2  # one for the batch (quiet may add none)
    with pytest.raises(ValueError):
        lb.poster.post_batch([{"opcode": "send"}])
    assert lb.poster.post_batch([{"opcode": "nop"}] * 7) == PostStatus.ERR_INVALID  # > 3/4 of the ring


def test_cq_overrun_is_detected_and_stops_the_qp() -> None:
    with Loopback(LoopbackSpec(start=False, log_cq=1)) as lb:
        for _ in range(4):
            assert lb.poster.post_nop(signaled=True) == OK
        lb.a.progress_once()
        stats = lb.a.cq_stats(lb.cq_a)
        assert stats.overrun and "overrun" in stats.error
        assert stats.producer_index == 2
        assert lb.a.qp_state(lb.qp_a) == QpState.ERR
        assert any("overrun" in e for e in lb.a.events(log_them=False))


def test_reset_cleans_unconsumed_cqes_and_restarts_counters() -> None:
    with Loopback(LoopbackSpec(start=False)) as lb:
        for _ in range(3):
            assert lb.poster.post_nop(signaled=True) == OK
        lb.a.progress_once()
        assert lb.a.cq_stats(lb.cq_a).producer_index == 3
        lb.reset()
        assert lb.a.qp_state(lb.qp_a) == QpState.RESET
        stats = lb.a.cq_stats(lb.cq_a)
        assert stats.consumer_index == 3, "the 3 unconsumed CQEs of the reset QP are cleaned"
        assert lb.a.qp_stats(lb.qp_a).consumer_index == 0
        lb.connect()
        assert lb.poster.post_rdma_write(lb.src.addr, lb.mr_src.lkey, lb.dst.addr, lb.mr_dst.rkey, 4,
                                         signaled=True) == OK
        lb.a.progress_once()
        assert lb.poster.poll() == 1
        assert lb.poster.counters()["cons"] == 1 and not lb.poster.error().valid
