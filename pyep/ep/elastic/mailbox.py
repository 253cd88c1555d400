"""The reference backend's data path on a store-based EpBuffer: one store key per (call, source,
destination) instead of an all-to-all over a process group, so a dead rank cannot hang the others.

Key: <prefix>/mail/<dst>/<call tag>/<src>.<generation of src>. A receiver waits for the keys of every
active source until the call's deadline; a source whose key is missing then is marked inactive (the
caller's active_ranks, and the backend's own mask), exactly as the native kernels mark a peer that
timed out, and counts as having sent nothing. The generation in the key keeps mail of a dead process
from being read as its restarted successor's. A receiver deletes what it read.

Rows and heartbeats are authenticated records (pyep.ep.records) of the source's current generation; a
value that is refused (forged, another process's, not whole rows) is logged in the control's reject
log and counts as not there yet: the real source's write replaces it, or the wait runs out as it
would for a source that never wrote.
"""
from __future__ import annotations

import logging
import math
import struct
import time
from typing import TYPE_CHECKING, Any, Callable, List, Optional, Tuple

from ..errors import RecordRejected
from ..records import Record, unpack

if TYPE_CHECKING:
    import torch

log = logging.getLogger("pyep.ep.elastic.mailbox")
POLL_S = 0.0005
HEARTBEAT_S = 0.05      # a waiting rank refreshes its alive key this often
MAX_MAIL = 1 << 30      # bytes of one row set (the store holds it whole)
_TIME = struct.Struct("<d")


def _check_time(rec: Record) -> None:
    """A heartbeat holds one finite time."""
    if not math.isfinite(unpack(rec, _TIME)[0]):
        raise RecordRejected(rec.key, "the heartbeat's time is not a finite number")


class StoreMailbox:
    def __init__(self, control: Any) -> None:
        self.c = control
        self.store = control.store
        self.rank = control.rank
        self.world = control.world_size
        self.generations: List[int] = [1] * self.world   # set by the membership (shared list)

    def _key(self, dst: int, tag: str, src: int, gen: int) -> str:
        return self.c.key("mail", dst, tag, f"{src}.{gen}")

    def _read(self, key: str, src: int, max_payload: int, check: Callable[[Record], None]) -> Optional[Record]:
        if not self.store.check([key]):
            return None
        return self.c.open(key, self.store.get(key), (src,), max_payload, generation=self.generations[src],
                           check=check)

    def _beating(self, src: int) -> bool:
        rec = self._read(self.c.key("alive", src), src, _TIME.size, _check_time)
        return rec is not None and time.time() - _TIME.unpack(rec.payload)[0] < 4 * HEARTBEAT_S

    def _rows(self, key: str, src: int, row: int) -> Optional[bytes]:
        """Whole rows from src, or None when the key holds none (yet) or what it holds is refused."""
        def whole_rows(rec: Record) -> None:
            if row and len(rec.payload) % row:
                raise RecordRejected(key, f"{len(rec.payload)} bytes are not whole rows of {row}")
        rec = self._read(key, src, MAX_MAIL, whole_rows)
        return rec.payload if rec is not None else None

    def forget(self, rank: int) -> None:
        """Nothing to release per peer (mail of an older generation is simply never read)."""
        return None

    def exchange(self, send: "torch.Tensor", send_counts: "torch.Tensor", width: int, timeout_us: int, what: str,
                 tag: str, active: "torch.Tensor", marks: Optional["torch.Tensor"]
                 ) -> Tuple["torch.Tensor", "torch.Tensor", List[int]]:
        import torch
        counts = [int(c) for c in send_counts.tolist()]
        on = [bool(a) for a in active.tolist()]
        raw = send.contiguous().numpy().tobytes()
        row = width
        at = 0
        mine = b""
        for dst, n in enumerate(counts):
            part = raw[at * row:(at + n) * row]
            at += n
            if dst == self.rank:
                mine = part
            elif on[dst]:
                key = self._key(dst, tag, self.rank, self.generations[self.rank])
                self.store.set(key, self.c.seal(key, part))
        got = {self.rank: mine}
        waiting = {src: self._key(self.rank, tag, src, self.generations[src])
                   for src in range(self.world) if src != self.rank and on[src]}
        start = time.monotonic()
        deadline = start + timeout_us / 1e6
        extended = False
        silent: List[int] = []        # not beating at the deadline: not waited for any longer
        late: List[int] = []
        beat = 0.0
        delay = POLL_S / 4
        while waiting:
            now = time.monotonic()
            if now - beat > HEARTBEAT_S:
                beat = now
                key = self.c.key("alive", self.rank)
                self.store.set(key, self.c.seal(key, _TIME.pack(time.time())))
            if now > deadline and not extended:
                # A late source may be alive and itself waiting out the timeout on a dead third rank
                # (it saw less of the dead rank's last messages than we did): marking it would drop a
                # healthy rank. Wait once more, for the sources that are still beating; one that is not
                # (a dead rank: it never beats again) is marked at the deadline, after one more look at its
                # key, instead of one timeout later -- with 3 ranks the survivor that got the dead rank's
                # last message used to wait two timeouts, kept waiting by the other, beating, survivor.
                extended = True
                silent = [src for src in waiting if not self._beating(src)]
                if len(silent) < len(waiting):
                    deadline = now + timeout_us / 1e6
            for src, key in list(waiting.items()):
                rows = self._rows(key, src, row)
                if rows is not None:
                    got[src] = rows
                    self.store.delete_key(key)
                    del waiting[src]
            for src in silent:
                if src in waiting:
                    late.append(src)
                    del waiting[src]
            silent = []
            if not waiting or (time.monotonic() > deadline and extended):
                break
            time.sleep(delay)
            delay = min(POLL_S * 8, delay * 2)
        late += list(waiting)
        for src in late:         # late: treated as dead from now on, like the kernels' timeout
            log.warning("rank %d: %s: rank %d did not answer within %d us; marked inactive", self.rank, what, src,
                        timeout_us)
            active[src] = False
            if marks is not None:
                marks[src] = 0
        lens = [len(got.get(src, b"")) // row if row else 0 for src in range(self.world)]
        body = b"".join(got.get(src, b"") for src in range(self.world))
        recv = (torch.frombuffer(bytearray(body), dtype=torch.uint8).view(-1, row) if body
                else torch.empty((0, row), dtype=torch.uint8, device="cpu"))
        return recv, torch.tensor(lens, dtype=torch.int64, device="cpu"), sorted(late)
