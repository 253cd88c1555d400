"""What the native kernels leave for the host without a synchronisation: the error record (the first
value error or timeout of a call, engine/kernels/normal_common.cuh record_error) and the tag record
(the last call the call gates voided, engine/kernels/normal_tags.h, a seqlock whose void count only
grows). `DeviceRecords` reads both from pinned memory and turns them into the typed errors; it keeps
how many voids it has reported, so every void call is reported once, however many piled up."""
from __future__ import annotations

import time
from typing import Any, Callable, List, Optional

from . import tags
from .errors import NormalCallMismatch, NormalModeError, PeerRefusedCall, PeerTimeout, error_from_record

REC_VOIDS, REC_MISMATCHES, REC_KIND, REC_PEER, REC_CALL, REC_EPOCH, REC_MY_KIND = range(7)   # normal_tags.h kRec*
REC_TAG = 16
TAG_RECORD_INTS = REC_TAG + tags.TAG_INTS
KIND_REFUSED, KIND_MISMATCH = 1, 2
SEQLOCK_TRIES = 1000


class DeviceRecords:
    """err: pinned int32[8] error record; record: pinned int32[TAG_RECORD_INTS]; rearm(): re-arms the
    error record's device claim in stream order; num_ranks: the group's (tags name global ranks);
    rank: this rank's global rank; peer_name maps a record's peer index to a global rank."""

    def __init__(self, err: Any, record: Any, rearm: Callable[[], None], rank: int, num_ranks: int,
                 timeout_us: int, peer_name: Callable[[int], int] = lambda r: r) -> None:
        self._err, self._rec = err.numpy(), record.numpy()
        self._rearm, self.rank, self.num_ranks, self.timeout_us = rearm, rank, num_ranks, timeout_us
        self._peer_name = peer_name
        self.num_experts = 0
        self.reset()

    def reset(self) -> None:
        """After clean() zeroed both records."""
        self._voids_seen = 0
        self._mismatches_seen = 0

    @property
    def voids_seen(self) -> int:
        """The void count (tag record) up to which voids were reported (NormalFast declines past it)."""
        return self._voids_seen

    # ------------------------------------------------------------------ the error record
    def take_error(self) -> Optional[NormalModeError]:
        """The recorded error (cleared, its claim re-armed), a PeerTimeout naming the group's rank."""
        if self._err[0] == 0:
            return None
        exc = error_from_record(self._err.tolist(), self.num_experts, self.timeout_us)
        self._err[:4] = 0
        self._rearm()
        if isinstance(exc, PeerTimeout):
            exc = PeerTimeout(self._peer_name(exc.peer), exc.phase, exc.channel, exc.timeout_us)
        return exc

    # ------------------------------------------------------------------ the tag record
    def _snapshot(self) -> Optional[List[int]]:
        for _ in range(SEQLOCK_TRIES):
            before = int(self._rec[REC_VOIDS])
            if before == self._voids_seen:
                return None
            words = self._rec.tolist()
            if int(self._rec[REC_VOIDS]) == before:
                return words
            time.sleep(0)
        return self._rec.tolist()   # a gate per call at most: the writer cannot keep it torn for long

    def take_void(self) -> Optional[NormalModeError]:
        """PeerRefusedCall / NormalCallMismatch for the calls voided since the last take, or None. A
        record is peer data (its tag was written by a peer): malformed words are a call mismatch."""
        words = self._snapshot()
        if words is None:
            return None
        voids = int(words[REC_VOIDS]) - self._voids_seen
        mismatched = int(words[REC_MISMATCHES]) != self._mismatches_seen
        self._voids_seen, self._mismatches_seen = int(words[REC_VOIDS]), int(words[REC_MISMATCHES])
        kind = int(words[REC_MY_KIND])
        call = int(words[REC_CALL]) & 0xFFFFFFFF
        what = f"normal {tags.KIND_NAMES.get(kind, 'call')} #{call}"
        peer = int(words[REC_PEER])
        try:
            tag = tags.decode(words[REC_TAG:], what, self.rank, peer, call, self.num_ranks)
        except NormalCallMismatch as exc:
            err: NormalModeError = exc
        else:
            if mismatched or int(words[REC_KIND]) == KIND_MISMATCH:
                # tag.call: the peer's call number, from its tag or (found from its flags) from the record
                other = f"{tags.KIND_NAMES[tag.kind]}, " if tag.kind != kind else ""   # the same number, another call
                err = NormalCallMismatch(what, self.rank, peer, f"{call} (generation {int(words[REC_EPOCH])})",
                                         f"{tag.call} ({other}generation {tag.epoch})",
                                         "the ranks made different calls, or calls of different shapes")
            else:
                origin = tag.origin if tag.status == tags.STATUS_PROXY and tag.origin >= 0 else peer
                err = PeerRefusedCall(what, self.rank, origin, call,
                                      tag.reason or "(its reason did not travel over RDMA)",
                                      via=peer if origin != peer else None)
        if voids > 1:
            err.add_note(f"{voids} calls up to #{call} were void on this rank since the last check; this is the last")
        return err
