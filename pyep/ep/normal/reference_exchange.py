"""The normal reference backend's exchanges, with the buffer's `active_ranks` mask (docs/elastic.md,
"Normal mode"): on a process group they are bounded all-to-alls among every rank (gloo cannot lose a
member: a masked rank still takes part, with nothing to send or receive); on a store-based buffer they
are store mailbox keys (pyep.ep.elastic.mailbox), so a dead rank hangs nobody: a source that does not
answer within the call's timeout is marked in the mask and counts as having sent nothing.

Every call begins with the call-tag exchange (tags.py), which also carries every rank's mask: a rank
takes the AND of the masks of the ranks it heard from, so a peer one rank marked is left out by every
rank from the next call on, without each of them waiting out its own timeout. The mask is the buffer's
tensor (int32 [R], 1 = active, the caller's when it passed one): marks are written into it as they
are made.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, List, Optional, Tuple

from .._dist import all_to_all_bounded as all_to_all
from ..elastic.membership import REJOIN_CALL_TIMEOUT_US, REJOIN_GRACE_CALLS
from . import tags
from .errors import BufferBroken, NormalCallMismatch
from .reference_values import ERR_WORDS

if TYPE_CHECKING:
    import torch

log = logging.getLogger("pyep.ep.normal.reference")
# Calls of one step (layout, dispatch, combine): the grace windows count steps of this many calls.
CALLS_PER_STEP = 3


class NormalExchange:
    """Mixed into NormalReferenceBackend, which provides group, rank, num_ranks, device, timeout_us,
    epoch, calls, _broken, _mail (a StoreMailbox on a store-based buffer, else None) and mask."""

    group: Any
    rank: int
    num_ranks: int
    device: "torch.device"
    timeout_us: int
    epoch: int
    calls: int
    _broken: Optional[str]
    _mail: Any
    mask: "torch.Tensor"
    grace_until: int

    # ------------------------------------------------------------------ the mask
    def active_now(self) -> "torch.Tensor":
        """bool [R]: the buffer's mask as it is now (a host copy)."""
        return (self.mask != 0).to("cpu").clone()

    def _store_mask(self, active: "torch.Tensor", what: str) -> None:
        """Write a call's view back into the buffer's mask (only ever clearing entries: admissions set them)."""
        import torch
        cur = self.mask.to("cpu") != 0
        lost = (cur & ~active).nonzero().reshape(-1).tolist()
        if lost:
            log.warning("rank %d: %s: ranks %s marked inactive", self.rank, what, lost)
            self.mask.copy_((cur & active).to(torch.int32).to(self.mask.device))

    def call_timeout(self, timeout_us: int) -> int:
        """The timeout of the current call: at least REJOIN_CALL_TIMEOUT_US inside a grace window (a
        store-based buffer's first calls and those after a rejoin; docs/elastic.md, "The grace window")."""
        if self._mail is not None and self.calls <= self.grace_until:
            return max(int(timeout_us), REJOIN_CALL_TIMEOUT_US)
        return int(timeout_us)

    def open_grace(self) -> None:
        """The next REJOIN_GRACE_CALLS steps wait at least REJOIN_CALL_TIMEOUT_US."""
        self.grace_until = self.calls + CALLS_PER_STEP * REJOIN_GRACE_CALLS

    # ------------------------------------------------------------------ exchanges
    def _fixed(self, rows: "torch.Tensor", active: "torch.Tensor", timeout_us: int, what: str,
               stage: str) -> "torch.Tensor":
        """int64 [R, W], row d for rank d -> int64 [R, W], row s from rank s (zeros where s is inactive
        after the exchange; `active` loses the sources that did not answer in time)."""
        import torch
        if self._mail is None:
            recv = torch.empty_like(rows)
            all_to_all(recv, rows.contiguous(), None, None, self.group, timeout_us, what)
            return recv * active.to(recv.device).view(-1, 1).to(recv.dtype)
        width = 8 * int(rows.shape[1])
        # The mailbox takes the rows grouped by destination, counts[d] for d: one row per active rank.
        send = rows.to("cpu").contiguous().view(torch.uint8).reshape(self.num_ranks, width)[active.to("cpu")]
        counts = torch.tensor([1 if a else 0 for a in active.tolist()], dtype=torch.int64, device="cpu")
        recv, lens, _ = self._mail.exchange(send, counts, width, self.call_timeout(timeout_us), what,
                                            self._mail_tag(stage), active, None)
        self._store_mask(active, what)
        out = torch.zeros_like(rows, device="cpu")
        at = 0
        for src, n in enumerate(lens.tolist()):
            if n == 1 and active[src]:
                out[src] = recv[at].contiguous().view(torch.int64)
            elif n:
                raise NormalCallMismatch(what, self.rank, src, self.calls, None,
                                         f"its mail holds {n} rows where one was expected")
            at += n
        return out.to(rows.device)

    def _rows(self, send: "torch.Tensor", send_counts: List[int], recv_counts: List[int], active: "torch.Tensor",
              timeout_us: int, what: str, stage: str) -> Tuple["torch.Tensor", List[int]]:
        """uint8 rows of `send` grouped by destination go to their ranks (send_counts[d] for d, 0 for an
        inactive d); returns the received rows grouped by source ascending and the rows per source. A
        source that does not answer (store) is marked in `active` and sent nothing; one that sends
        another count than its header announced (recv_counts) is a NormalCallMismatch."""
        import torch
        if self._mail is None:
            recv = torch.empty((sum(recv_counts), send.shape[1]), dtype=torch.uint8, device=self.device)
            all_to_all(recv, send, recv_counts, send_counts, self.group, timeout_us, what)
            return recv, list(recv_counts)
        width = int(send.shape[1])
        counts = torch.tensor(send_counts, dtype=torch.int64, device="cpu")
        recv, lens, _ = self._mail.exchange(send.to("cpu"), counts, width, self.call_timeout(timeout_us), what,
                                            self._mail_tag(stage), active, None)
        self._store_mask(active, what)
        got = [int(n) for n in lens.tolist()]
        keep = []
        at = 0
        for src, n in enumerate(got):
            if active[src] and n != recv_counts[src]:
                raise NormalCallMismatch(what, self.rank, src, self.calls, None,
                                         f"it sent {n} rows, its header announced {recv_counts[src]}")
            if active[src]:
                keep.append(recv[at:at + n])
            else:
                got[src] = 0
            at += n
        rows = torch.cat(keep) if keep else torch.empty((0, width), dtype=torch.uint8, device="cpu")
        return rows.to(self.device), got

    def _mail_tag(self, stage: str) -> str:
        return f"n{self.epoch}.{self.calls}.{stage}"

    # ------------------------------------------------------------------ call tags
    def _exchange_tags(self, kind: int, sig: Tuple[int, ...], *, status: int = tags.STATUS_OK, reason: str = "",
                       extra: Optional[List[int]] = None) -> Tuple[str, "torch.Tensor", "torch.Tensor"]:
        """The call's tag exchange (the first exchange of every call): returns the call's name, every
        rank's `extra` words [R, ERR_WORDS] (zeros for inactive ranks) and the call's mask (bool [R],
        host): the buffer's mask AND every answering rank's. Raises NormalCallMismatch (and breaks the
        buffer) when an active rank is at another call, PeerRefusedCall when one refused this call
        (unless this rank refuses it too: its own error is raised by the front)."""
        if self._broken is not None:
            raise BufferBroken(self._broken)
        self.calls += 1
        what = f"normal {tags.KIND_NAMES[kind]} #{self.calls}"
        mine = tags.CallTag(self.epoch, self.calls, kind, status, sig, self.rank, reason)
        active, table = self._tag_table(mine, extra or [], f"{what} (call tags)")
        try:
            peers = [tags.decode(table[r].tolist(), what, self.rank, r, self.calls, self.num_ranks)
                     if active[r] else mine for r in range(self.num_ranks)]
            err = tags.verdict(what, self.rank, mine, peers)
            if isinstance(err, NormalCallMismatch):
                raise err
        except NormalCallMismatch as exc:
            self._broken = f"{exc}; call clean() on every rank"
            raise
        if err is not None and status == tags.STATUS_OK:
            raise err
        return what, table[:, tags.TAG_INTS:tags.TAG_INTS + ERR_WORDS], self._and_masks(active, table, what)

    def _and_masks(self, active: "torch.Tensor", table: "torch.Tensor", what: str) -> "torch.Tensor":
        """This rank's mask AND the masks of the ranks it heard from. On a group every rank hears from
        every rank, so all of them get the same mask -- a masked rank included, which then sends and
        receives nothing. On a store a rank a live peer marked is left out here too."""
        masks = table[:, tags.TAG_INTS + ERR_WORDS:].to("cpu") != 0
        out = active.clone()
        for r in range(self.num_ranks):
            if active[r] and (self._mail is None or r != self.rank):
                out &= masks[r]
        if self._mail is not None:
            out[self.rank] = bool(active[self.rank])
        self._store_mask(out, what)
        if not out[self.rank]:
            out.zero_()         # a masked rank exchanges nothing with anyone in this call
        return out

    def _tag_table(self, mine: tags.CallTag, extra: List[int], what: str) -> Tuple["torch.Tensor", "torch.Tensor"]:
        """Every rank's [tag | extra | mask] as int64 [R, TAG_INTS + ERR_WORDS + R], and the mask after the
        exchange. One width for every call, so that ranks at different calls still exchange whole tags
        (and find out) instead of mismatching the collective's sizes."""
        import torch
        active = self.active_now()
        if self._mail is not None and not active[self.rank]:
            # Fenced: a live peer marked this rank; it exchanges with nobody (docs/elastic.md).
            active = torch.zeros_like(active)
            active[self.rank] = True
        words = tags.encode(mine) + extra + [0] * (ERR_WORDS - len(extra)) + [int(a) for a in active.tolist()]
        row = torch.tensor(words, dtype=torch.int64, device=self.device)
        rows = row.reshape(1, -1).expand(self.num_ranks, -1).contiguous()
        if self._mail is None:
            # every rank takes part in the collective
            active = torch.ones(self.num_ranks, dtype=torch.bool, device="cpu")
        table = self._fixed(rows, active, self.timeout_us, what, "tag")
        return active, table

    def refuse(self, kind: int, reason: str) -> Optional[Exception]:
        try:
            self._exchange_tags(kind, (), status=tags.STATUS_REFUSED, reason=reason)
        except (NormalCallMismatch, BufferBroken) as exc:
            return exc
        except TimeoutError as exc:
            # The peers did not make this call at all: gloo's pending exchange pairs with nothing now.
            self._broken = f"a refused call's tag exchange found no peers ({exc}); call clean() on every rank"
            return exc
        return None

    def clean(self) -> None:
        """Collective (among the active ranks): every rank must be cleaning (the tags of this exchange
        compare kinds only: the ranks may have been at different calls, which is what clean() repairs),
        then every rank starts a new generation at call 1."""
        mine = tags.CallTag(self.epoch, 0, tags.KIND_CLEAN, origin=self.rank)
        saved, self.calls = self.calls, 0
        try:
            active, table = self._tag_table(mine, [], "normal reference clean (call tags)")
        finally:
            self.calls = saved
        what = "normal clean"
        for r in range(self.num_ranks):
            if not active[r]:
                continue
            peer = tags.decode(table[r].tolist(), what, self.rank, r, 0, self.num_ranks)
            if peer.kind != tags.KIND_CLEAN:
                raise NormalCallMismatch(what, self.rank, r, "clean", peer.describe(),
                                         "clean() is collective: every rank must call it")
        self.epoch += 1
        self.calls = 0
        self._broken = None
