"""Errors about what peers send (shared by both modes and the elastic control plane). The modes' own
errors are pyep.ep.ll.errors and pyep.ep.normal.errors; a control-plane wait that runs out is
pyep.ep.control.ControlTimeout."""
from __future__ import annotations


class MembershipError(RuntimeError):
    """The membership protocol cannot go on (wrong call order, a survivor missed call #A, ...)."""


class BadAnnouncement(MembershipError, ValueError):
    """A rejoin announcement that is malformed or does not fit this job."""


class StaleAnnouncement(BadAnnouncement):
    """An announcement of a generation that is not the rank's newest (or was already admitted)."""


class CallMismatch(RuntimeError):
    """Two ranks met in an exchange while at different calls (or generations): a rank that refused a
    call, or skipped one, would otherwise pair its next call's messages with the peer's current one.
    Raised on every rank of the exchange instead of returning another call's data; nothing of the
    exchange is used. `my_call` / `peer_call` are the call numbers (`None` where a side is unknown),
    `what` names the exchange."""

    def __init__(self, what: str, rank: int, peer: int, my_call: object, peer_call: object,
                 detail: str = "") -> None:
        self.what, self.rank, self.peer, self.my_call, self.peer_call = what, rank, peer, my_call, peer_call
        super().__init__(f"{what}: rank {rank} is at call {my_call} but rank {peer} sent call {peer_call}"
                         + (f" ({detail})" if detail else "")
                         + "; nothing of this exchange was used (docs/elastic.md, 'Call-tagged exchanges')")


class PeerRefusedCall(CallMismatch):
    """A peer refused this call on its host and took part in the call's exchange only to say so: nothing
    it would have sent was used and no rank waited for it or marked it. The one type to catch for both
    modes (pyep.ep.ll.errors.PeerRefusedCall and pyep.ep.normal.errors.PeerRefusedCall derive from it);
    `peer` is the rank that refused, `reason` why, as it sent it."""

    peer: int
    reason: str


class RecordRejected(ValueError):
    """A record read from the store (or from a peer) failed authentication, parsing, a size bound or the
    protocol's state machine. `key` names the store key (or the exchange); the record was not used."""

    def __init__(self, key: str, why: str) -> None:
        self.key, self.why = key, why
        super().__init__(f"store record {key!r} refused: {why}")
