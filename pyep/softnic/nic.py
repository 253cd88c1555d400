"""SoftNic: the Python face of one software NIC (see the package docstring)."""
from __future__ import annotations

import ctypes
import logging
from dataclasses import fields
from typing import Any, Dict, List, Optional, Sequence, Union

from .._native import engine
from .host_qp import HostQp
from .types import (RDMA_ACCESS, Access, ConnectAttr, CqInfo, CqStats, MrInfo, PeerInfo, Placement, QpInfo,
                    QpState, QpStats, RawCqe, SoftNicConfig, SoftNicError, Syndrome, call, check_int, check_seconds,
                    from_dict)

log = logging.getLogger("pyep.softnic")


class HostBuffer:
    """Shared host memory from SoftNic.alloc_host(); peers in other processes can reach it. Valid until
    freed or the softnic closes (views taken from it must not be used afterwards)."""

    def __init__(self, addr: int, size: int) -> None:
        self.addr = addr
        self.size = size
        self._array = (ctypes.c_ubyte * size).from_address(addr)
        self.closed = False

    @property
    def view(self) -> memoryview:
        if self.closed:
            raise ValueError("this softnic host buffer has been freed")
        return memoryview(self._array).cast("B")

    def numpy(self, dtype: Any = "uint8"):
        import numpy as np
        return np.frombuffer(self.view, dtype=dtype)


def _addr_len(obj: Any, length: Optional[int]) -> "tuple[int, int]":
    if isinstance(obj, HostBuffer):
        return obj.addr, obj.size if length is None else length
    if isinstance(obj, int) and not isinstance(obj, bool):
        if length is None:
            raise ValueError("reg_mr(addr, length): length is required with a raw address")
        return obj, length
    if hasattr(obj, "data_ptr") and hasattr(obj, "element_size"):  # torch.Tensor
        if not obj.is_contiguous():
            raise ValueError("reg_mr: tensor must be contiguous")
        return int(obj.data_ptr()), obj.numel() * obj.element_size() if length is None else length
    if hasattr(obj, "__array_interface__"):  # numpy
        addr = int(obj.__array_interface__["data"][0])
        return addr, int(obj.nbytes) if length is None else length
    raise TypeError(f"reg_mr: cannot register a {type(obj).__name__} (int address, HostBuffer, numpy or torch)")


QpLike = Union[QpInfo, int]


def _qpn(qp: QpLike) -> int:
    return qp.qpn if isinstance(qp, QpInfo) else check_int("qpn", qp, 1, 0xFFFFFF)


class SoftNic:
    """One software NIC (one per rank process; several per process also work)."""

    def __init__(self, config: SoftNicConfig = SoftNicConfig()) -> None:
        if not isinstance(config, SoftNicConfig):
            raise TypeError("SoftNic(config): config must be a SoftNicConfig")
        self.config = config
        self._n = call(engine().SoftNic, config.fabric_id or 0, config.node_id, config.max_mrs, config.max_qps,
                        config.idle_spin, config.idle_sleep_us, config.cuda_device)
        self._buffers: Dict[int, HostBuffer] = {}
        if config.start:
            self._n.start()

    # --- identity
    @property
    def fabric_id(self) -> int:
        return self._native.fabric_id

    @property
    def node_id(self) -> int:
        return self._native.node_id

    @property
    def has_cuda(self) -> bool:
        return self._native.has_cuda

    @property
    def _native(self) -> Any:
        if self._n is None:
            raise SoftNicError("this softnic is closed")
        return self._n

    # --- memory
    def alloc_host(self, size: int) -> HostBuffer:
        check_int("size", size, 1, 1 << 40)
        addr = call(self._native.alloc_host, size)
        buf = HostBuffer(addr, size)
        self._buffers[addr] = buf
        return buf

    def free_host(self, buf: HostBuffer) -> None:
        call(self._native.free_host, buf.addr)
        buf.closed = True
        self._buffers.pop(buf.addr, None)

    def reg_mr(self, obj: Any, length: Optional[int] = None, access: Access = RDMA_ACCESS) -> MrInfo:
        addr, nbytes = _addr_len(obj, length)
        check_int("length", nbytes, 1, 1 << 48)
        return from_dict(MrInfo, call(self._native.reg_mr, addr, nbytes, int(Access(access))))

    def dereg_mr(self, mr: MrInfo) -> None:
        call(self._native.dereg_mr, mr.lkey)

    # --- queues
    def create_cq(self, log_size: int, placement: Placement = Placement.HOST) -> CqInfo:
        return from_dict(CqInfo, call(self._native.create_cq, check_int("log_size", log_size, 1, 22), int(Placement(placement))))

    def create_qp(self, cq: CqInfo, log_sq: int, placement: Placement = Placement.HOST) -> QpInfo:
        return from_dict(QpInfo, call(self._native.create_qp, cq.cqn, check_int("log_sq", log_sq, 1, 15), int(Placement(placement))))

    def modify_rst2init(self, qp: QpLike, access: Access = RDMA_ACCESS) -> None:
        call(self._native.modify_qp_rst2init, _qpn(qp), int(Access(access)))

    def modify_init2rtr(self, qp: QpLike, remote_node: int, remote_qpn: int, attr: ConnectAttr = ConnectAttr()) -> None:
        d = {f.name: getattr(attr, f.name) for f in fields(attr)}
        d.update(remote_node=check_int("remote_node", remote_node, 0, 2**64 - 1),
                 remote_qpn=check_int("remote_qpn", remote_qpn, 1, 0xFFFFFF))
        call(self._native.modify_qp_init2rtr, _qpn(qp), d)

    def modify_rtr2rts(self, qp: QpLike, attr: ConnectAttr = ConnectAttr()) -> None:
        call(self._native.modify_qp_rtr2rts, _qpn(qp), {f.name: getattr(attr, f.name) for f in fields(attr)})

    def connect(self, qp: QpLike, remote_node: int, remote_qpn: int, attr: ConnectAttr = ConnectAttr(),
                access: Access = RDMA_ACCESS) -> None:
        """RST -> INIT -> RTR -> RTS towards (remote_node, remote_qpn)."""
        self.modify_rst2init(qp, access)
        self.modify_init2rtr(qp, remote_node, remote_qpn, attr)
        self.modify_rtr2rts(qp, attr)

    def reset_qp(self, qp: QpLike) -> None:
        call(self._native.modify_qp_to_reset, _qpn(qp))

    def error_qp(self, qp: QpLike) -> None:
        call(self._native.modify_qp_to_error, _qpn(qp))

    def qp_state(self, qp: QpLike) -> QpState:
        return QpState(call(self._native.query_qp_state, _qpn(qp)))

    def destroy_qp(self, qp: QpLike) -> None:
        call(self._native.destroy_qp, _qpn(qp))

    def destroy_cq(self, cq: CqInfo) -> None:
        call(self._native.destroy_cq, cq.cqn)

    def host_qp(self, qp: QpInfo, cq: CqInfo) -> "HostQp":
        """A CPU poster for `qp` (fresh producer state: make one per QP lifetime, again after reset)."""
        if qp.cqn != cq.cqn:
            raise ValueError(f"QP {qp.qpn:#x} completes on CQ {qp.cqn}, not CQ {cq.cqn}")
        return HostQp(engine().HostQp(qp.qpn, qp.log_sq, qp.sq, qp.dbrec, qp.bf, qp.bf_size, cq.cqes, cq.dbrec,
                                      cq.log_size, -1), self)

    # --- progress
    def start(self) -> None:
        self._native.start()

    def stop(self) -> None:
        self._native.stop()

    @property
    def running(self) -> bool:
        return self._native.running

    def progress_once(self) -> int:
        """One pass over all QPs (only while the thread is stopped): work done."""
        return call(self._native.progress_once)

    # --- fault injection
    def drop_peer(self, node: int, blackhole: bool = False, retry_s: Optional[float] = None) -> None:
        """Drop all traffic to and from `node`: requests fail with TRANSPORT_RETRY_EXC_ERR after
        `retry_s` (default: the requester QP's own retry time), or never complete with blackhole=True."""
        retry_ns = -1 if retry_s is None else int(check_seconds("retry_s", retry_s) * 1e9)
        call(self._native.drop_peer, check_int("node", node, 0, 2**64 - 1), bool(blackhole), retry_ns)

    def restore_peer(self, node: int) -> None:
        call(self._native.restore_peer, check_int("node", node, 0, 2**64 - 1))

    def set_delay(self, delay_s: float, qp: Optional[QpLike] = None, peer: Optional[int] = None) -> None:
        """Added latency before each WQE of `qp` (or of every QP towards node `peer`) executes."""
        if (qp is None) == (peer is None):
            raise ValueError("set_delay: give exactly one of qp= or peer=")
        ns = int(check_seconds("delay_s", delay_s) * 1e9)
        if qp is not None:
            call(self._native.set_qp_delay, _qpn(qp), ns)
        else:
            call(self._native.set_peer_delay, check_int("peer", peer, 0, 2**64 - 1), ns)

    def fail_after(self, qp: QpLike, n: int, syndrome: Syndrome = Syndrome.REMOTE_OP_ERR) -> None:
        """After `n` more successful WQEs, the next one fails with `syndrome`."""
        call(self._native.fail_after, _qpn(qp), check_int("n", n, 0, 2**63 - 1), int(Syndrome(syndrome)))

    def force_error(self, qp: QpLike) -> None:
        call(self._native.force_error, _qpn(qp))

    def invalidate_key(self, key: Union[int, MrInfo]) -> None:
        """Corrupt a key: every later use of the MR's lkey/rkey fails (LOCAL_PROT / REMOTE_ACCESS)."""
        call(self._native.invalidate_key, key.lkey if isinstance(key, MrInfo) else check_int("key", key, 1, 2**32 - 1))

    def clear_faults(self) -> None:
        call(self._native.clear_faults)

    # --- diagnostics
    def qp_stats(self, qp: QpLike) -> QpStats:
        d = call(self._native.qp_stats, _qpn(qp))
        d["state"] = QpState(d["state"])
        return from_dict(QpStats, d)

    def cq_stats(self, cq: CqInfo) -> CqStats:
        return from_dict(CqStats, call(self._native.cq_stats, cq.cqn))

    def read_cq(self, cq: CqInfo) -> List[RawCqe]:
        """Every entry of a host-visible CQ ring, decoded (diagnostics; the poller owns consumption)."""
        raw = ctypes.string_at(cq.cqes, 64 << cq.log_size)
        return [RawCqe.decode(i, raw[64 * i:64 * i + 64]) for i in range(1 << cq.log_size)]

    def events(self, log_them: bool = True) -> List[str]:
        """Errors and CQ overruns noticed since the last call (logged as warnings unless log_them=False)."""
        out = list(self._native.drain_events())
        for e in out if log_them else ():
            log.warning("softnic: %s", e)
        return out

    # --- connect info
    def connect_blob(self, qps: Sequence[QpLike], mrs: Sequence[MrInfo] = ()) -> bytes:
        """What a peer needs to connect to `qps` and access `mrs`, as bytes for any store."""
        return call(self._native.connect_blob, [_qpn(q) for q in qps],
                     [{"addr": m.addr, "length": m.length, "rkey": m.rkey, "access": m.access} for m in mrs])

    def parse_blob(self, blob: bytes) -> PeerInfo:
        """Decodes a peer's blob; ValueError if malformed or from another fabric/host."""
        return parse_connect_blob(blob, self.fabric_id)

    def close(self) -> None:
        if self._n is None:
            return
        n, self._n = self._n, None
        n.stop()
        for buf in self._buffers.values():
            buf.closed = True
        self._buffers.clear()
        del n  # the native destructor frees rings, unmaps and unlinks the shared segments

    def __enter__(self) -> "SoftNic":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def parse_connect_blob(blob: bytes, expect_fabric: Optional[int] = None) -> PeerInfo:
    if not isinstance(blob, (bytes, bytearray)):
        raise TypeError(f"connect blob must be bytes, got {type(blob).__name__}")
    d = engine().softnic_parse_blob(bytes(blob), expect_fabric or 0)
    return PeerInfo(d["fabric_id"], d["node_id"], d["host_id"], d["pid"], tuple(d["qpns"]),
                    tuple(from_dict(MrInfo, dict(m, lkey=0)) for m in d["mrs"]))
