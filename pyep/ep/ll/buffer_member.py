"""The elastic side of `EpBuffer` (docs/elastic.md is the protocol, pyep.ep.elastic.membership drives it):
re-admitting restarted ranks (update_ep_member, poll_rejoin, admit_pending), a restarted rank's join(),
and the longer timeouts of the calls right after a rejoin. A mixin, so that dispatch and combine call
_in_grace/_rejoin_timeout as plain methods of the buffer.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, List, Optional

from ..elastic.membership import REJOIN_CALL_TIMEOUT_US, REJOIN_GRACE_CALLS, MemberView, MembershipError, Rejoin
from .validate import check_active_ranks

if TYPE_CHECKING:
    import torch


class EpBufferMembership(MemberView):
    """Mixed into EpBuffer (which provides _member, _seq, _grace_seq, _epoch, _backend, _config,
    _check_alive, _init_fast, _realign_calls, ...)."""

    # ------------------------------------------------------------------ the calls after a rejoin
    def _in_grace(self, seq: Any) -> bool:
        """Whether call `seq` is in the grace window of the latest rejoin: #A .. #A + REJOIN_GRACE_CALLS - 1
        (docs/elastic.md, "The grace window")."""
        a = self._grace_seq
        return bool(a) and isinstance(seq, int) and a <= seq < a + REJOIN_GRACE_CALLS

    def _rejoin_timeout(self, timeout_us: Any) -> Any:
        """The timeout of call #A, the first call after a rejoin (docs/elastic.md, "Call #A"): at least
        REJOIN_CALL_TIMEOUT_US on every member. The handshake releases the members through the store, so
        they start call #A up to a store poll apart, and the newcomer's first launches are cold (module
        loading, first allocations); neither is the per-call skew the caller's timeout is chosen for.
        After #A every member is in step again (each call waits for the others' data). A bad value is
        left alone for validation to reject."""
        if timeout_us is None:
            return max(int(self._config.timeout_us), REJOIN_CALL_TIMEOUT_US)
        if isinstance(timeout_us, bool) or not isinstance(timeout_us, int) or timeout_us <= 0:
            return timeout_us
        return max(timeout_us, REJOIN_CALL_TIMEOUT_US)

    # ------------------------------------------------------------------ membership
    def update_ep_member(self, active_ranks: Optional["torch.Tensor"] = None) -> None:
        """Collective: re-admit restarted ranks. On a group, every connection is rebuilt. On a store
        (docs/elastic.md), every live rank calls it: a restarted rank joins, and each survivor waits
        (bounded) for the ranks it expects back -- those 1 in active_ranks but marked dead in its own
        view, or all it marked dead when active_ranks is None -- and rebuilds only their links. Older
        handles go stale."""
        self._check_alive("update_ep_member")
        check_active_ranks(active_ranks, self._num_ranks, self._device)
        member = self._member
        if member is None:
            self._backend.update_ep_member(active_ranks)
            self._realign_calls("EpBuffer.update_ep_member")
        elif member.joining:
            self.join()
        else:
            expect = self._backend.inactive_ranks()
            if active_ranks is not None:
                want = active_ranks.tolist()
                expect = [r for r in expect if want[r]]
            self._admit_blocking(expect, active_ranks)
        self._epoch += 1

    def _admit_blocking(self, expect: List[int], active_ranks: Optional["torch.Tensor"]) -> None:
        member = self._member
        assert member is not None

        def admit_once() -> List[int]:
            member.poll(self._seq + 1, lead_calls=0)
            done = []
            for r in member.due(self._seq + 1):
                member.activate(r, self._seq + 1, active_ranks)
                self._admitted()
                done.append(r)
            return done
        self._wait_admitted(expect, admit_once, self._rank)

    @property
    def next_call(self) -> int:
        """The sequence number the next dispatch carries (the same on every member)."""
        return self._seq + 1

    def join(self, timeout_s: Optional[float] = None) -> int:
        """A restarted rank: wait (bounded) until the survivors admit it, and return the number of the
        call its next dispatch is (every member's next dispatch carries the same number)."""
        member = self._member
        if member is None or not member.joining:
            raise MembershipError("join() is for a restarted rank of a store-based EpBuffer")
        at = member.join(member.timeout_s if timeout_s is None else float(timeout_s))
        self._seq = at - 1
        self._grace_seq = at
        self._epoch += 1
        self._init_fast(self._config)
        return at

    def poll_rejoin(self) -> List[Rejoin]:
        """Non-blocking (one store round trip when nothing is pending): learn of restarted ranks,
        rebuild only the links to them, and report each one's stage and the call it joins at.
        Survivors call it (or admit_pending()) before every dispatch while a rejoin is pending."""
        self._check_alive("poll_rejoin")
        if self._member is None:
            return []
        return self._member.poll(self._seq + 1)

    def admit_pending(self, active_ranks: Optional["torch.Tensor"] = None) -> List[int]:
        """poll_rejoin(), then admit every restarted rank whose agreed call is the next one: its entry in
        this buffer's own mask (and in `active_ranks`, when the caller keeps one) becomes 1. Returns the
        ranks admitted now. Call it between steps, before each dispatch, on every survivor."""
        self._check_alive("admit_pending")
        member = self._member
        if member is None:
            return []
        if active_ranks is not None:
            check_active_ranks(active_ranks, self._num_ranks, self._device)
        member.poll(self._seq + 1)
        due = member.due(self._seq + 1)
        for r in due:
            member.activate(r, self._seq + 1, active_ranks)
            self._admitted()
        return due

    def _admitted(self) -> None:
        """A rank was admitted for the next call: that call opens the grace window, and the tags of its
        signals carry the newcomer's generation (the membership updated the shared list)."""
        self._grace_seq = self._seq + 1
        sync = getattr(self._backend, "sync_generations", None)
        if sync is not None:
            sync()
