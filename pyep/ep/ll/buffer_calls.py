"""What `EpBuffer` does about calls that fail between ranks (docs/elastic.md, "Call-tagged exchanges";
docs/ll_kernels.md, "Call tags"): a call the front refuses still takes part in its exchange with an
abort marker, the combine of a dispatch that failed is refused before it sends anything (every rank
skips it), the checked event and hook raise what the calls recorded, and clean() puts the ranks' call
numbers back in step. A mixin, so that dispatch and combine call these as plain methods of the buffer.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable, Optional, Tuple

from ..backend import EventLike
from .contract import CALL_ERROR, COMBINE_REFUSED, CombineOptions, DispatchOptions
from .errors import CombineAfterRefusal, CombineOfFailedDispatch, PeerRefusedCall, refusal_reason
from .handle import Handle
from .validate import check_active_ranks, check_timeout

if TYPE_CHECKING:
    import torch

log = logging.getLogger("pyep.ep")


class CheckedEvent:
    """The event EpBuffer returns: wait() is a host wait, so after it the records of the calls before
    (bad expert ids, failed exchanges) are complete and a recorded error is raised."""

    __slots__ = ("_event", "_check")

    def __init__(self, event: EventLike, check: Callable[[], None]) -> None:
        self._event = event
        self._check = check

    def wait(self) -> None:
        self._event.wait()
        self._check()

    def current_stream_wait(self) -> None:
        self._event.current_stream_wait()

    @property
    def inner(self) -> EventLike:
        return self._event

    def __repr__(self) -> str:
        return f"CheckedEvent({self._event!r})"


class CheckedHook:
    """The receive hook with the error check after it: the receive half always runs (peers wait for
    it), then an error recorded by then is raised."""

    __slots__ = ("_hook", "_check")

    def __init__(self, hook: Callable[[], None], check: Callable[[], None]) -> None:
        self._hook = hook
        self._check = check

    def __call__(self) -> None:
        self._hook()
        self._check()


class EpBufferCalls:
    """Mixed into EpBuffer (which provides _backend, _config, _control, _rank, _num_ranks, _device, _seq,
    _raise_pending, ...)."""

    def _safe_opts(self, active_ranks: Any, timeout_us: Any) -> Tuple[Optional["torch.Tensor"], int]:
        """The active mask and timeout an abort marker goes with: the caller's where they are valid."""
        try:
            check_active_ranks(active_ranks, self._num_ranks, self._device)
        except Exception:  # noqa: BLE001 - a bad mask is one reason the call was refused
            active_ranks = None
        try:
            timeout = check_timeout("timeout_us", timeout_us, self._config.timeout_us)
        except Exception:  # noqa: BLE001
            timeout = self._config.timeout_us
        return active_ranks, timeout

    def _refuse_dispatch(self, exc: BaseException, active_ranks: Any, timeout_us: Any) -> None:
        """The host refused this dispatch: it still takes part in its exchange with an abort marker (no
        payload), so its peers neither wait for it nor pair the next call's data with this one."""
        abort = getattr(self._backend, "abort_dispatch", None)
        self._seq += 1       # the refused call keeps its number: the next one is in step with the peers
        if abort is None:
            return
        active, timeout = self._safe_opts(active_ranks, timeout_us)
        seq = self._seq
        opts = DispatchOptions(use_fp8=False, round_scale=False, use_ue8m0=False, active_ranks=active,
                               timeout_us=timeout, async_finish=False, return_recv_hook=False,
                               cumulative_local_expert_recv_stats=None, buffer_idx=seq & 1, seq=seq)
        try:
            abort(opts, refusal_reason(exc))
        except Exception as abort_exc:  # noqa: BLE001 - the refusal is what the caller gets
            log.error("rank %d: dispatch #%d was refused (%s) and its abort marker could not be sent: %s",
                      self._rank, seq, exc, abort_exc)

    def _refuse_combine(self, exc: BaseException, handle: Handle, active_ranks: Any, timeout_us: Any) -> None:
        """The host refused the combine of a handle of this buffer: abort marker instead of its rows. The
        refused combine stands for the handle's combine on every rank (CombineAfterRefusal after it)."""
        handle.extras[COMBINE_REFUSED] = refusal_reason(exc)
        abort = getattr(self._backend, "abort_combine", None)
        if abort is None:
            return
        active, timeout = self._safe_opts(active_ranks, timeout_us)
        opts = CombineOptions(active_ranks=active, timeout_us=timeout, zero_copy=False, async_finish=False,
                              return_recv_hook=False, out=None)
        try:
            abort(handle, opts, refusal_reason(exc))
        except Exception as abort_exc:  # noqa: BLE001
            log.error("rank %d: the combine of dispatch #%d was refused (%s) and its abort marker could not be "
                      "sent: %s", self._rank, handle.seq, exc, abort_exc)

    def _raise_failed_dispatch(self, handle: Handle) -> None:
        """The combine of a dispatch whose exchange failed is skipped on every rank (each saw the failure),
        so this one raises before it sends anything: the dispatch's own error if it is still pending,
        else CombineOfFailedDispatch."""
        peek = getattr(self._backend, "pending_call_error", None)
        err = peek(latest_call=self._seq) if peek is not None else None
        if err is not None and getattr(err, "kind", "") == "dispatch" and err.my_call == handle.seq:
            self._raise_pending()    # call errors are taken first: this is `err`
        failed = handle.extras.get(CALL_ERROR)
        if failed is not None:
            raise CombineOfFailedDispatch(self._rank, handle.seq, str(failed))
        refused = handle.extras.get(COMBINE_REFUSED)
        if refused is None and handle.seq in self._combines_refused_by_peers:
            refused = self._combines_refused_by_peers[handle.seq]
        if refused is not None:
            raise CombineAfterRefusal(self._rank, handle.seq, refused)

    def _note_refused_combine(self, err: BaseException) -> None:
        """A peer's refusal of a combine, as this rank takes it: later combines of that dispatch's handle
        are refused here too (only the latest few dispatches can still be combined)."""
        if isinstance(err, PeerRefusedCall) and getattr(err, "kind", "") == "combine":
            seen = self._combines_refused_by_peers
            seen[int(err.my_call)] = f"rank {err.peer}: {err.reason}"
            while len(seen) > 4:
                seen.pop(next(iter(seen)))

    def _realign_calls(self, what: str) -> None:
        """Collective (clean(), update_ep_member() on a group): every rank takes the largest call number
        any of them reached, so ranks that met at different calls (CallMismatch) are in step again, and
        no number is used twice."""
        timeout_s = 3 * self._config.timeout_us / 1e6 + 10.0
        self._seq = -int(self._control.all_min(-self._seq, timeout_s, f"{what} (call numbers)"))
