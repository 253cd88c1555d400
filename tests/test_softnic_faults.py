"""Softnic error paths: every check yields the mlx5 syndrome a NIC would report, injected faults
behave as documented, the QP state machine is enforced, and nothing hangs."""
from __future__ import annotations

import struct
import time
from typing import Iterator

import pytest

pytest.importorskip("pyep._engine")

from pyep.cli.softnic import Loopback, LoopbackSpec  # noqa: E402
from pyep.softnic import (Access, ConnectAttr, Placement, PostStatus, QpState, SoftNic, SoftNicConfig,  # noqa: E402
                          SoftNicError, Syndrome, vendor_syndromes)

OK = PostStatus.OK
VEND = vendor_syndromes()


@pytest.fixture
def lb() -> Iterator[Loopback]:
    with Loopback() as loop:  # retry time ~2 ms (ack_timeout 8, retry_cnt 1)
        yield loop


def expect_error(lb: Loopback, syndrome: Syndrome, vendor: str, timeout_s: float = 5.0) -> None:
    st = lb.poster.quiet(timeout_s=timeout_s)
    err = lb.poster.error()
    assert st == PostStatus.ERR_QP, (st, err.describe())
    assert (err.syndrome, err.vendor_syndrome) == (syndrome, VEND[vendor]), err.describe()
    assert lb.a.qp_state(lb.qp_a) == QpState.ERR
    stats = lb.a.qp_stats(lb.qp_a)
    if syndrome == Syndrome.WR_FLUSH_ERR:  # a flush is a consequence, not an error of its own
        assert stats.errors == 0 and stats.flushed >= 1 and stats.last_error
    else:
        assert stats.errors == 1 and stats.last_syndrome == syndrome and stats.last_error
    assert lb.poster.post_nop(signaled=True) == PostStatus.ERR_QP, "posts after an error must fail fast"
    lb.a.events(log_them=False)


def write(lb: Loopback, length: int = 64, laddr: int = 0, lkey: int = 0, raddr: int = 0, rkey: int = 0) -> None:
    st = lb.poster.post_rdma_write(laddr or lb.src.addr, lkey or lb.mr_src.lkey, raddr or lb.dst.addr,
                                   rkey or lb.mr_dst.rkey, length, signaled=True)
    assert st == OK


def fa32(lb: Loopback, raddr: int = 0, rkey: int = 0, lkey: int = 0) -> None:
    st = lb.poster.post_masked_fa32(raddr or lb.sig.addr, rkey or lb.mr_sig.rkey, 1, lb.fetch.addr,
                                    lkey or lb.mr_fetch.lkey, signaled=True)
    assert st == OK


# --- requester-side checks -------------------------------------------------------------------------

def test_bad_lkey(lb: Loopback) -> None:
    write(lb, lkey=lb.mr_dst.lkey ^ 0x5500)
    expect_error(lb, Syndrome.LOCAL_PROT_ERR, "lkey")


def test_invalidated_lkey(lb: Loopback) -> None:
    lb.a.invalidate_key(lb.mr_src)
    write(lb)
    expect_error(lb, Syndrome.LOCAL_PROT_ERR, "lkey")


def test_local_range_outside_mr(lb: Loopback) -> None:
    write(lb, laddr=lb.src.addr + lb.src.size - 8, length=16)
    expect_error(lb, Syndrome.LOCAL_PROT_ERR, "local_bounds")


def test_fetch_buffer_without_local_write(lb: Loopback) -> None:
    ro = lb.a.reg_mr(lb.fetch, access=Access(0))
    fa32(lb, lkey=ro.lkey)
    expect_error(lb, Syndrome.LOCAL_PROT_ERR, "local_access")


def test_message_longer_than_log_max_msg(lb: Loopback) -> None:
    write(lb, length=(1 << 30) + 1)
    expect_error(lb, Syndrome.LOCAL_LENGTH_ERR, "msg_len")


# --- responder-side checks -------------------------------------------------------------------------

def test_invalidated_rkey(lb: Loopback) -> None:
    lb.b.invalidate_key(lb.mr_dst)
    write(lb)
    expect_error(lb, Syndrome.REMOTE_ACCESS_ERR, "rkey")
    assert not lb.dst.numpy()[:64].any()


def test_remote_range_outside_mr(lb: Loopback) -> None:
    write(lb, raddr=lb.dst.addr + lb.dst.size - 32, length=64)
    expect_error(lb, Syndrome.REMOTE_ACCESS_ERR, "remote_bounds")


def test_remote_mr_without_atomic_right(lb: Loopback) -> None:
    mr = lb.b.reg_mr(lb.sig, access=Access.LOCAL_WRITE | Access.REMOTE_WRITE)
    fa32(lb, rkey=mr.rkey)
    expect_error(lb, Syndrome.REMOTE_ACCESS_ERR, "remote_access")


def test_misaligned_atomic(lb: Loopback) -> None:
    fa32(lb, raddr=lb.sig.addr + 2)
    expect_error(lb, Syndrome.REMOTE_INVAL_REQ_ERR, "align")


def test_responder_qp_without_remote_atomic_enable(lb: Loopback) -> None:
    lb.b.reset_qp(lb.qp_b)
    lb.b.connect(lb.qp_b, 0, lb.qp_a.qpn, lb.attr, access=Access.LOCAL_WRITE | Access.REMOTE_WRITE)
    fa32(lb)
    expect_error(lb, Syndrome.REMOTE_ACCESS_ERR, "qp_access")


def test_responder_not_ready_retries_then_fails(lb: Loopback) -> None:
    lb.b.reset_qp(lb.qp_b)
    # The retry clock starts at the doorbell, so a lower bound is timed from before the post:
    # timed from the poll, it misses whatever the softnic ran in between (CI flaked on exactly that).
    t0 = time.monotonic()
    write(lb)
    expect_error(lb, Syndrome.TRANSPORT_RETRY_EXC_ERR, "retry")
    assert time.monotonic() - t0 >= lb.attr.retry_time_s() * 0.9


def test_responder_connected_to_another_qp(lb: Loopback) -> None:
    other = lb.a.create_qp(lb.cq_a, 3)
    lb.b.reset_qp(lb.qp_b)
    lb.b.connect(lb.qp_b, 0, other.qpn, lb.attr)
    write(lb)
    expect_error(lb, Syndrome.TRANSPORT_RETRY_EXC_ERR, "retry")
    assert "connected to" in lb.a.qp_stats(lb.qp_a).last_error


def test_responder_becoming_ready_within_the_retry_time_succeeds() -> None:
    with Loopback(LoopbackSpec(ack_timeout=14, retry_cnt=3)) as lb:  # ~270 ms of retries
        lb.b.reset_qp(lb.qp_b)
        write(lb)
        time.sleep(0.02)
        lb.b.connect(lb.qp_b, 0, lb.qp_a.qpn, lb.attr)
        assert lb.poster.quiet() == OK


# --- injected faults -------------------------------------------------------------------------------

def test_drop_peer_fails_after_retry_time(lb: Loopback) -> None:
    lb.a.drop_peer(1, retry_s=0.05)
    t0 = time.monotonic()
    write(lb)
    expect_error(lb, Syndrome.TRANSPORT_RETRY_EXC_ERR, "dropped")
    assert time.monotonic() - t0 >= 0.045


def test_drop_applies_to_traffic_from_the_peer_too(lb: Loopback) -> None:
    lb.b.drop_peer(0, retry_s=0.0)
    write(lb)
    expect_error(lb, Syndrome.TRANSPORT_RETRY_EXC_ERR, "dropped")


def test_blackhole_times_out_then_completes_after_restore(lb: Loopback) -> None:
    lb.a.drop_peer(1, blackhole=True)
    lb.src.numpy()[:64] = 5
    write(lb)
    t0 = time.monotonic()
    assert lb.poster.quiet(timeout_s=0.2) == PostStatus.ERR_TIMEOUT
    assert 0.15 <= time.monotonic() - t0 < 2.0
    assert lb.poster.error().kind == 4  # quiet timeout, recorded in the error slot
    assert not lb.dst.numpy()[:64].any()
    lb.a.restore_peer(1)
    deadline = time.monotonic() + 5
    while lb.a.qp_stats(lb.qp_a).wqes < 1 and time.monotonic() < deadline:
        time.sleep(0.001)
    assert bytes(lb.dst.numpy()[:64]) == bytes([5] * 64)


def test_full_ring_post_times_out_instead_of_hanging(lb: Loopback) -> None:
    lb.a.drop_peer(1, blackhole=True)
    statuses = []
    t0 = time.monotonic()
    for _ in range(12):  # the ring holds 8 WQEBBs: a post soon has to wait for space that never comes
        statuses.append(lb.poster.post_rdma_write(lb.src.addr, lb.mr_src.lkey, lb.dst.addr, lb.mr_dst.rkey, 8,
                                                  timeout_s=0.1))
        if statuses[-1] != OK:
            break
    assert statuses[-1] == PostStatus.ERR_TIMEOUT and time.monotonic() - t0 < 2.0
    assert lb.poster.error().kind == 2  # no ring space in time
    assert lb.poster.post_nop() == PostStatus.ERR_QP  # and the QP context now fails fast


@pytest.mark.parametrize("where", ["qp", "peer"])
def test_added_delay(lb: Loopback, where: str) -> None:
    kwargs = {"qp": lb.qp_a} if where == "qp" else {"peer": 1}
    # A delay long enough that an undelayed write on a loaded 2-core CI machine stays far below it.
    lb.a.set_delay(0.5, **kwargs)
    t0 = time.monotonic()
    write(lb)
    assert lb.poster.quiet() == OK
    assert time.monotonic() - t0 >= 0.45
    lb.a.clear_faults()
    t0 = time.monotonic()
    write(lb)
    assert lb.poster.quiet() == OK
    assert time.monotonic() - t0 < 0.4


def test_fail_after_n(lb: Loopback) -> None:
    lb.a.fail_after(lb.qp_a, 3, Syndrome.REMOTE_OP_ERR)
    src, dst = lb.src.numpy(), lb.dst.numpy()
    src[:256] = 1
    for i in range(4):
        write(lb, raddr=lb.dst.addr + 64 * i)
    expect_error(lb, Syndrome.REMOTE_OP_ERR, "injected")
    assert bytes(dst[:192]) == bytes([1] * 192) and not dst[192:256].any()
    assert lb.poster.error().wqe_counter == 3


def test_force_error_flushes(lb: Loopback) -> None:
    lb.a.force_error(lb.qp_a)
    write(lb)
    expect_error(lb, Syndrome.WR_FLUSH_ERR, "flush")


def test_error_then_flush_of_everything_after_it() -> None:
    with Loopback(LoopbackSpec(log_sq=4, log_cq=4)) as lb:
        lb.b.invalidate_key(lb.mr_dst)
        wr = {"opcode": "rdma_write", "laddr": lb.src.addr, "lkey": lb.mr_src.lkey, "raddr": lb.dst.addr,
              "rkey": lb.mr_dst.rkey, "length": 8}
        good = dict(wr, rkey=lb.mr_sig.rkey, raddr=lb.sig.addr)
        assert lb.poster.post_batch([wr, good, dict(good, signaled=True)]) == OK
        expect_error(lb, Syndrome.REMOTE_ACCESS_ERR, "rkey")
        deadline = time.monotonic() + 5
        while lb.a.qp_stats(lb.qp_a).flushed < 2 and time.monotonic() < deadline:
            time.sleep(0.001)
        cqes = [c for c in lb.a.read_cq(lb.cq_a) if c.opcode != 15]
        assert [(c.opcode, c.syndrome, c.wqe_counter) for c in cqes] == [(13, 0x13, 0), (13, 0x05, 1), (13, 0x05, 2)]
        assert not lb.sig.numpy()[:8].any(), "flushed writes must not execute"


# --- malformed WQEs and the state machine ------------------------------------------------------------

def ctrl(opcode: int, index: int, qpn: int, ds: int, opmod: int = 0) -> bytes:
    return struct.pack(">II", (opmod << 24) | (index << 8) | opcode, (qpn << 8) | ds) + bytes([0, 0, 0, 8, 0, 0, 0, 0])


@pytest.mark.parametrize("case,vendor", [
    ("index", "bad_wqe_index"), ("qpn", "bad_qpn"), ("opcode", "bad_opcode"), ("ds", "bad_ds"), ("opmod", "bad_opcode"),
])
def test_malformed_wqe(lb: Loopback, case: str, vendor: str) -> None:
    qpn = lb.qp_a.qpn
    wqe = {
        "index": ctrl(0x00, 0x55, qpn, 1),
        "qpn": ctrl(0x00, 0, qpn + 1, 1),
        "opcode": ctrl(0x0A, 0, qpn, 3),  # SEND: not executed by the softnic
        "ds": ctrl(0x08, 0, qpn, 1),
        "opmod": ctrl(0x15, 0, qpn, 4, opmod=0x0B),
    }[case]
    st = lb.poster.post_raw(wqe + bytes(64 - len(wqe)), fix_index=case != "index", fix_qpn=case != "qpn")
    assert st == OK
    expect_error(lb, Syndrome.LOCAL_QP_OP_ERR, vendor)


def test_state_machine_is_enforced() -> None:
    with SoftNic(SoftNicConfig(node_id=0)) as nic:
        cq = nic.create_cq(3)
        qp = nic.create_qp(cq, 3)
        assert nic.qp_state(qp) == QpState.RESET
        with pytest.raises(SoftNicError, match="RESET"):
            nic.modify_init2rtr(qp, 0, qp.qpn)
        nic.modify_rst2init(qp)
        with pytest.raises(SoftNicError, match="INIT"):
            nic.modify_rtr2rts(qp)
        with pytest.raises(SoftNicError):
            nic.modify_rst2init(qp)
        # a doorbell while the QP is not in RTS: LOCAL_QP_OP_ERR, then the QP is in error
        poster = nic.host_qp(qp, cq)
        assert poster.post_nop(signaled=True) == OK
        assert poster.quiet(timeout_s=5) == PostStatus.ERR_QP
        err = poster.error()
        assert (err.syndrome, err.vendor_syndrome) == (Syndrome.LOCAL_QP_OP_ERR, VEND["qp_not_rts"])
        assert nic.qp_state(qp) == QpState.ERR
        nic.reset_qp(qp)
        nic.connect(qp, 0, qp.qpn, ConnectAttr())  # loopback onto itself
        buf = nic.alloc_host(4096)
        mr = nic.reg_mr(buf)
        poster = nic.host_qp(qp, cq)
        buf.numpy()[:8] = 3
        assert poster.post_rdma_write(buf.addr, mr.lkey, buf.addr + 64, mr.rkey, 8, signaled=True) == OK
        assert poster.quiet() == OK and bytes(buf.numpy()[64:72]) == bytes([3] * 8)
        nic.destroy_qp(qp)
        nic.destroy_cq(cq)
        with pytest.raises(SoftNicError, match="no QP"):
            nic.qp_state(qp)


def test_bad_arguments_are_rejected() -> None:
    with pytest.raises(ValueError):
        SoftNicConfig(max_mrs=0)
    with pytest.raises(TypeError):
        SoftNicConfig(node_id="1")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        ConnectAttr(mtu=1000)
    with SoftNic(SoftNicConfig(node_id=3)) as nic:
        with pytest.raises(SoftNicError, match="already exists"):
            SoftNic(SoftNicConfig(node_id=3, fabric_id=nic.fabric_id))
        with pytest.raises(ValueError):
            nic.create_cq(0)
        cq = nic.create_cq(2)
        with pytest.raises(SoftNicError, match="HostMapped"):
            nic.create_qp(cq, 3, Placement.DEVICE)
        with pytest.raises(TypeError):
            nic.reg_mr(object())
        with pytest.raises(SoftNicError, match="LOCAL_WRITE"):
            nic.reg_mr(nic.alloc_host(64), access=Access.REMOTE_WRITE)
        with pytest.raises(ValueError):
            nic.set_delay(0.1)
        qp = nic.create_qp(cq, 3)
        with pytest.raises(ValueError):
            nic.host_qp(qp, cq).quiet(timeout_s=0)
        with pytest.raises(SoftNicError, match="still has"):
            nic.destroy_cq(cq)
        with pytest.raises(SoftNicError, match="progress thread is running"):
            nic.progress_once()
