"""The native backend's side of call-tagged exchanges (docs/ll_kernels.md, "Call tags"; docs/elastic.md,
"Call-tagged exchanges"): the two pinned records the kernels write (bad expert ids; an exchange that
failed with a peer) and how the host reads them without a device sync, the abort launches a rank makes
for a call it refused on the host (its count words or flags carry an abort marker, no payload, and it
still receives and clears its peers' words of that call), and the generations the tags carry.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, List, Optional

from .contract import CombineOptions, DispatchOptions
from .errors import RECORD_WORDS, InvalidExpertIndex, LLCallMismatch, call_error_from_record, error_from_record

if TYPE_CHECKING:
    from .handle import Handle

log = logging.getLogger("pyep.ep.ll.native")
PHASES_BOTH = 3
# Handle extras the combine keeps: how often the handle was combined (a second combine waits for the
# peers' acknowledgements of the earlier ones: docs/ll_kernels.md, "A handle combined again"), and
# whether the last combine's receive hook is still uncalled.
COMBINED = "combined"
RECV_PENDING = "combine_recv_pending"


class NativeCallTags:
    """Mixed into NativeBackend (which provides _ep, _static, _err, _half, _active, _tables, device, rank,
    config, _launch_stream, _check_alive, ...)."""

    _generations: Optional[List[int]] = None
    _last_seq = 0                # the latest call number launched: call records are of it or earlier

    # ------------------------------------------------------------------ the records
    def _call_record(self) -> Any:
        rec = self._err
        return None if rec is None else rec[RECORD_WORDS:]

    def pending_call_error(self, latest_call: Optional[int] = None) -> Optional[LLCallMismatch]:
        """The call error the kernels recorded, if it is visible yet, without clearing it. The record
        holds the low 32 bits of the call number: latest_call (the front's latest dispatch) completes it."""
        rec = self._call_record()
        if rec is None or rec[0] == 0:
            return None
        latest = self._last_seq if latest_call is None else latest_call
        return call_error_from_record([int(w) for w in rec[:6]], self.rank, latest)

    def take_error(self, latest_call: Optional[int] = None) -> Optional[Exception]:
        """The error a kernel recorded, if it is visible yet (a call error first, then a bad expert id);
        clears it. Reads pinned host memory only: no device synchronisation."""
        rec = self._err
        if rec is None or (rec[RECORD_WORDS] == 0 and rec[0] == 0):
            return None              # the common case, after every combine: two pinned words
        call = self.pending_call_error(latest_call)
        if call is not None:
            rec[RECORD_WORDS] = 0        # the kernels write a new call record only while this word is 0
            return call
        if rec[0] == 0:
            return None
        words = [int(w) for w in rec[:6]]
        rec[0] = 0
        err: Optional[InvalidExpertIndex] = error_from_record(words, self.config.num_experts)
        return err

    # ------------------------------------------------------------------ refused calls
    def abort_dispatch(self, opts: DispatchOptions, reason: int) -> None:
        """This rank refused dispatch #opts.seq on the host: take part in its exchange with abort-tagged
        count words and no payload, so no peer waits for it or pairs another call's data with this one."""
        half = self._half
        self._half ^= 1
        self._launch_abort_dispatch(half, opts, reason)

    def _launch_abort_dispatch(self, half: int, opts: DispatchOptions, reason: int) -> None:
        import torch
        if torch.cuda.is_current_stream_capturing():
            return               # an abort must not be captured into a graph that replays it later
        self._last_seq = max(self._last_seq, opts.seq)
        _, stream = self._launch_stream(False)
        self._ep.dispatch(self._static, 0, 0, 0, 1, half, False, False, False, self._active_ptr(opts.active_ranks),
                          0, 0, 0, 0, 0, 0, 0, int(opts.timeout_us) * 1000, PHASES_BOTH, stream,
                          seq=opts.seq & 0xFFFFFFFF, abort=reason)
        log.info("rank %d: dispatch #%d refused on the host; its peers get an abort marker", self.rank, opts.seq)

    def abort_combine(self, handle: "Handle", opts: CombineOptions, reason: int) -> None:
        """This rank refused the combine of `handle` on the host: abort-tagged flags, no rows, and the
        peers' flags of that combine received and cleared (and acknowledged, so their counts stay equal)."""
        import torch
        if torch.cuda.is_current_stream_capturing():
            return
        half, recv_slot = self._handle_parts(handle)
        if handle.extras.get(RECV_PENDING):
            # Our receive half of the handle's previous combine has not run: our flags still hold that
            # combine's, and an abort receive would take them for this one's. The refusal says so.
            log.warning("rank %d: combine of dispatch #%d refused with its previous receive hook uncalled: "
                        "no abort marker sent", self.rank, handle.seq)
            return
        # After an earlier combine of this handle the abort flag waits, like any combine, until every
        # destination has finished reducing that one (ll_ack.cuh): it must not land on an uncleared flag.
        repeat = int(handle.extras.get(COMBINED, 0)) > 0
        _, stream = self._launch_stream(False)
        self._ep.combine(self._static, 0, 0, 0, 0, 1, half, handle.src_info.data_ptr(), recv_slot.data_ptr(),
                         handle.layout_range.data_ptr(), self._active_ptr(opts.active_ranks), 0,
                         int(opts.timeout_us) * 1000, PHASES_BOTH, stream, repeat=repeat,
                         seq=handle.seq & 0xFFFFFFFF, abort=reason)
        log.info("rank %d: combine of dispatch #%d refused on the host; its peers get an abort marker",
                 self.rank, handle.seq)

    # ------------------------------------------------------------------ generations
    def set_generations(self, generations: List[int]) -> None:
        """The membership's list of every rank's generation (shared: it changes as ranks are admitted);
        the kernels get it at the next sync_generations()."""
        self._generations = generations
        self.sync_generations()

    def sync_generations(self) -> None:
        """Copy the generations into the kernels' table (between calls: after an admission, a join)."""
        import torch
        gens = self._tables.get("gens") if self._tables else None
        if gens is None or self._generations is None:
            return
        gens.copy_(torch.tensor(self._generations, dtype=torch.int32, device="cpu"))
