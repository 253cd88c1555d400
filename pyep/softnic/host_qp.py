"""HostQp: CPU threads posting to a QP through qp.h (the same functions GPU kernels use)."""
from __future__ import annotations

from typing import Any, Dict, Optional, Sequence

from .types import PostStatus, QpError, SoftNicError, from_dict


class HostQp:
    """Posts to a softnic (or any host-visible) QP from CPU threads through qp.h. Thread-safe."""

    def __init__(self, native: Any, nic: Optional[Any] = None) -> None:
        self._q = native
        self._nic = nic  # keeps the rings alive

    qpn = property(lambda self: self._q.qpn)
    context_size = property(lambda self: self._q.context_size)

    def post_rdma_write(self, laddr: int, lkey: int, raddr: int, rkey: int, length: int, signaled: bool = False,
                        timeout_s: float = 5.0) -> PostStatus:
        return PostStatus(self._q.post_rdma_write(laddr, lkey, raddr, rkey, length, signaled, timeout_s))

    def post_masked_fa32(self, raddr: int, rkey: int, add: int, fetch_laddr: int, fetch_lkey: int,
                         signaled: bool = False, timeout_s: float = 5.0) -> PostStatus:
        return PostStatus(self._q.post_masked_fa32(raddr, rkey, add & 0xFFFFFFFF, fetch_laddr, fetch_lkey, signaled,
                                                   timeout_s))

    def post_fa64(self, raddr: int, rkey: int, add: int, fetch_laddr: int, fetch_lkey: int, signaled: bool = False,
                  timeout_s: float = 5.0) -> PostStatus:
        return PostStatus(self._q.post_fa64(raddr, rkey, add & (2**64 - 1), fetch_laddr, fetch_lkey, signaled, timeout_s))

    def post_nop(self, signaled: bool = False, timeout_s: float = 5.0) -> PostStatus:
        return PostStatus(self._q.post_nop(signaled, timeout_s))

    def post_write_with_signal(self, laddr: int, lkey: int, raddr: int, rkey: int, length: int, sig_raddr: int,
                               sig_rkey: int, add: int, fetch_laddr: int, fetch_lkey: int, signaled: bool = False,
                               timeout_s: float = 5.0) -> PostStatus:
        return PostStatus(self._q.post_write_with_signal(laddr, lkey, raddr, rkey, length, sig_raddr, sig_rkey,
                                                         add & 0xFFFFFFFF, fetch_laddr, fetch_lkey, signaled, timeout_s))

    def post_batch(self, wrs: Sequence[Dict[str, Any]], timeout_s: float = 5.0) -> PostStatus:
        """Several WQEs, one doorbell. Each dict: opcode ('rdma_write', 'masked_fa32', 'fa64', 'nop') and
        laddr/lkey/raddr/rkey/length/add/signaled as needed."""
        return PostStatus(self._q.post_batch(list(wrs), timeout_s))

    def post_raw(self, wqebbs: bytes, fix_index: bool = True, fix_qpn: bool = True,
                 timeout_s: float = 5.0) -> PostStatus:
        """Posts raw WQEBB bytes (tests of malformed WQEs) through the normal reservation/doorbell path."""
        return PostStatus(self._q.post_raw(bytes(wqebbs), fix_index, fix_qpn, timeout_s))

    def quiet(self, timeout_s: float = 5.0) -> PostStatus:
        return PostStatus(self._q.quiet(timeout_s))

    def poll(self) -> int:
        return self._q.poll()

    def error(self) -> QpError:
        return from_dict(QpError, self._q.error())

    def check(self, status: PostStatus, what: str = "post") -> None:
        """Raises SoftNicError describing the QP's error unless status is OK."""
        if status != PostStatus.OK:
            raise SoftNicError(f"{what} on QP {self.qpn:#x}: {PostStatus(status).name}: {self.error().describe()}")

    def counters(self) -> Dict[str, int]:
        return dict(self._q.counters())

    def addresses(self) -> Dict[str, int]:
        """Ring, doorbell, BlueFlame, CQ and context addresses (for handing the QP to a GPU kernel)."""
        q = self._q
        return {"sq": q.sq, "dbrec": q.dbrec, "bf": q.bf, "cqes": q.cqes, "cq_dbrec": q.cq_dbrec,
                "context": q.context_address}

    def context_bytes(self) -> bytes:
        return self._q.context_bytes()
