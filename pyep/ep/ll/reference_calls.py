"""The reference backend's exchange (an all-to-all on a group, the store mailbox on a store) and its call
headers (docs/elastic.md, "Call-tagged exchanges"): every rank's message to
every other rank in a call -- over an all-to-all or a store mailbox -- begins with a 32-byte header naming
the call (kind, call number, the sender's generation), whether the sender refused it (the abort marker:
a header alone), and the rows that follow. A receiver checks each source's header before it uses a byte
of it: another call's header is a CallMismatch, an abort marker a PeerRefusedCall, a malformed one is
refused the same way; the source then counts as having sent nothing. Peer data is input: nothing here
raises a builtin exception on it.
"""
from __future__ import annotations

import struct
from typing import TYPE_CHECKING, Callable, List, Optional, Sequence, Tuple

from .._dist import _wait, all_to_all_bounded
from ..errors import RecordRejected
from .contract import CombineOptions, DispatchOptions
from .errors import (KIND_COMBINE, KIND_DISPATCH, KIND_NAMES, REFUSAL_REASONS, LLCallMismatch, PeerRefusedCall,
                     refusal_reason)

if TYPE_CHECKING:
    import torch

    from .handle import Handle

CALL_MAGIC = 0x50455043          # "CPEP"
HEADER = struct.Struct("<IiIIiiii")   # magic, kind, seq lo, seq hi, generation, abort reason, width, rows
CALL_HEADER_BYTES = HEADER.size   # 32


def call_header(kind: int, seq: int, generation: int, reason: int, width: int, rows: int) -> bytes:
    return HEADER.pack(CALL_MAGIC, kind, seq & 0xFFFFFFFF, (seq >> 32) & 0xFFFFFFFF, generation, reason, width, rows)


def frame(kind: int, seq: int, generation: int, reason: int, rows: "torch.Tensor",
          counts: Sequence[int]) -> Tuple["torch.Tensor", List[int]]:
    """Every destination's header then its rows (`rows`: uint8 [M, width] grouped by destination,
    counts[d] of them for d), as one byte tensor, and the bytes per destination."""
    import torch
    width = int(rows.shape[1]) if rows.dim() == 2 else 0
    parts, sizes, at = [], [], 0
    for n in counts:
        head = torch.frombuffer(bytearray(call_header(kind, seq, generation, reason, width, n)), dtype=torch.uint8)
        parts.append(head.to(rows.device))
        if n:
            parts.append(rows[at:at + n].reshape(-1))
        at += n
        sizes.append(CALL_HEADER_BYTES + n * width)
    return torch.cat(parts), sizes


def check_block(head: bytes, length: int, kind: int, seq: int, generation: int, width: Optional[int], max_rows: int,
                rank: int, src: int) -> Tuple[int, Optional[LLCallMismatch]]:
    """(rows that follow the header, None) when source src's block (`length` bytes beginning with `head`)
    is this call's; (0, the error) when it is another call's, an abort marker, or malformed. `width`: the
    row width this rank expects (None: any, for a rank that discards what it receives)."""
    what = KIND_NAMES.get(kind, "dispatch")

    def bad(detail: str, peer_call: object = None) -> Tuple[int, LLCallMismatch]:
        return 0, LLCallMismatch(what, rank, src, seq, peer_call, detail)

    if length < CALL_HEADER_BYTES or len(head) < CALL_HEADER_BYTES:
        return bad(f"its message has {length} bytes, shorter than a call header")
    magic, p_kind, lo, hi, p_gen, reason, p_width, rows = HEADER.unpack_from(head, 0)
    if magic != CALL_MAGIC:
        return bad(f"its message does not begin with a call header (word {magic:#010x})")
    p_seq = (hi << 32) | lo
    if p_kind != kind or p_seq != seq or p_gen != generation:
        return bad(f"its header names {KIND_NAMES.get(p_kind, f'kind {p_kind}')} #{p_seq} of generation {p_gen}, "
                   f"this rank expected {what} #{seq} of generation {generation}", p_seq)
    if reason != 0:
        return 0, PeerRefusedCall(what, rank, src, seq, REFUSAL_REASONS.get(reason, f"reason code {reason}"))
    want = p_width if width is None else width
    if rows < 0 or rows > max_rows or (rows and p_width != want) or length != CALL_HEADER_BYTES + rows * p_width:
        return bad(f"its header announces {rows} rows of {p_width} bytes in {length} bytes; this call takes at "
                   f"most {max_rows} rows of {want} bytes")
    return rows, None


class ReferenceExchange:
    """Mixed into ReferenceBackend (which provides config, rank, num_ranks, device, group, _mail, _mask,
    _p2p_counts, _call_error, _generations, _active)."""

    # ---------------------------------------------------------------- exchange
    def _exchange(self, send: "torch.Tensor", send_counts: "torch.Tensor", max_bytes: int,
                  timeout_us: int, what: str, tag: str, active: "torch.Tensor",
                  marks: Optional["torch.Tensor"]) -> Tuple["torch.Tensor", "torch.Tensor", Optional[List[int]]]:
        """The bytes of `send` (uint8 [B], grouped by destination rank, send_counts[d] for d) go to their
        ranks; returns (received bytes grouped by source rank, int64 bytes per source, ns waited per
        source or None). A source announcing more than max_bytes is refused before anything is allocated.
        On a store, a source that does not answer within timeout_us is marked in `active`, `marks` (the
        caller's active_ranks) and this backend's own mask, and counts as having sent nothing."""
        import torch
        if self._mail is not None:
            recv, counts, late = self._mail.exchange(send.view(-1, 1), send_counts, 1, timeout_us, what, tag, active,
                                                     marks)
            for src in late:
                self._mask[src] = False
            return recv.reshape(-1), counts, None
        recv_counts = torch.empty_like(send_counts)
        waits: Optional[List[int]] = None
        if self._p2p_counts:
            waits = self._counts_timed(recv_counts, send_counts, timeout_us, f"{what} (counts)")
        else:
            all_to_all_bounded(recv_counts, send_counts, None, None, self.group, timeout_us,
                               f"{what} (counts all-to-all)")
        in_splits = send_counts.tolist()
        out_splits = recv_counts.tolist()
        for src, n in enumerate(out_splits):
            if not 0 <= n <= max_bytes:
                raise RecordRejected(f"{what} (counts from rank {src})",
                                     f"announces {n} bytes; a call's message is at most {max_bytes} bytes")
        recv = torch.empty(sum(out_splits), dtype=torch.uint8, device=self.device)
        all_to_all_bounded(recv, send, out_splits, in_splits, self.group, timeout_us,
                           f"{what} (data all-to-all)")
        return recv, recv_counts, waits

    def _generation(self, rank: int) -> int:
        return self._generations[rank] if self._generations is not None else 0

    def _call_exchange(self, kind: int, seq: int, rows: "torch.Tensor", counts: List[int], timeout_us: int, what: str,
                       tag: str, active: "torch.Tensor", marks: Optional["torch.Tensor"], reason: int = 0
                       ) -> Tuple["torch.Tensor", "torch.Tensor", Optional[List[int]], Optional[LLCallMismatch]]:
        """One call's exchange: rows (uint8 [M, width], counts[d] for destination d) behind a call header
        per destination, or the header alone with the abort marker (`reason`, this rank refused the call).
        Returns (rows of the sources whose header is this call's, grouped by source; their row counts, 0
        for the others; ns waited per source or None; the first failed source's error). Nothing of a
        failed source is used; the error is also kept for take_error() (a refusing rank, whose host
        raised already, keeps only mismatches)."""
        import torch
        cfg = self.config
        width = int(rows.shape[1])
        max_rows = cfg.num_max_dispatch_tokens_per_rank * cfg.max_topk
        max_width = 2 * cfg.hidden + 4 * (cfg.hidden // 128) + 64     # any message of this shape
        send, sizes = frame(kind, seq, self._generation(self.rank), reason, rows, counts)
        recv, got, waits = self._exchange(send, torch.tensor(sizes, dtype=torch.int64, device=self.device),
                                          CALL_HEADER_BYTES + max_rows * max_width, timeout_us, what, tag, active,
                                          marks)
        lengths = [int(n) for n in got.tolist()]
        keep: List["torch.Tensor"] = []
        per_src = [0] * self.num_ranks
        first: Optional[LLCallMismatch] = None
        at = 0
        on = active.tolist()
        for src, n in enumerate(lengths):
            block = recv[at:at + n]
            at += n
            if not on[src]:
                continue
            head = bytes(block[:CALL_HEADER_BYTES].tolist())
            k, err = check_block(head, n, kind, seq, self._generation(src), None if reason else width, max_rows,
                                 self.rank, src)
            if err is not None:
                if first is None:
                    first = err
                continue
            if k and not reason:          # a refusing rank drops what its peers sent
                keep.append(block[CALL_HEADER_BYTES:].view(k, width))
                per_src[src] = k
        if first is not None and self._call_error is None and not (reason and isinstance(first, PeerRefusedCall)):
            self._call_error = first
        data = torch.cat(keep) if keep else torch.empty((0, width), dtype=torch.uint8, device=self.device)
        return data, torch.tensor(per_src, dtype=torch.int64, device=self.device), waits, first

    def _counts_timed(self, recv_counts: "torch.Tensor", send_counts: "torch.Tensor", timeout_us: int,
                      what: str) -> List[int]:
        """The counts exchange as one message per peer (gloo), received in arrival order (any-source
        receives), so each source's arrival is seen on the host: the reference's measure of the receive
        wait the kernels time (*_wait_recv_cost_stats). Source r's wait is the host time from the start
        of the receive until r's count was taken (about a receive's cost when it was already there)."""
        import time

        import torch
        import torch.distributed as dist
        me, n = self.rank, self.num_ranks
        recv_counts[me] = send_counts[me]
        sends = [dist.isend(send_counts[r:r + 1], dist.get_global_rank(self.group, r), group=self.group)
                 for r in range(n) if r != me]
        waits, missing = [0] * n, set(range(n)) - {me}
        got = torch.empty(1, dtype=send_counts.dtype, device=send_counts.device)
        start = time.monotonic_ns()
        while missing:
            work = dist.irecv(got, None, group=self.group)
            try:
                _wait(work, max(1, timeout_us - (time.monotonic_ns() - start) // 1000), what, sorted(missing))
            except TimeoutError as exc:
                raise TimeoutError(f"{what}: ranks {list(range(n))} did not all take part within {timeout_us} us "
                                   f"(no counts from ranks {sorted(missing)})") from exc
            src = dist.get_group_rank(self.group, work._source_rank())
            waits[src] = time.monotonic_ns() - start
            recv_counts[src] = got[0]
            missing.discard(src)
        for work in sends:
            _wait(work, timeout_us, what, [])
        return waits

    # ---------------------------------------------------------------- refused calls
    def _refusing(self, exc: BaseException, started: List[bool], abort: Callable[[int], None]) -> None:
        """A call that failed on this host before its exchange began takes part in it with the abort
        marker, so its peers neither wait for it nor pair another call with it (the caller re-raises)."""
        if not started[0]:
            abort(refusal_reason(exc))

    def abort_dispatch(self, opts: DispatchOptions, reason: int) -> None:
        """This rank refused dispatch #opts.seq: its exchange with the abort marker and no rows; what the
        peers sent is received and dropped."""
        import torch
        self._call_exchange(KIND_DISPATCH, opts.seq, torch.empty((0, 0), dtype=torch.uint8, device=self.device),
                            [0] * self.num_ranks, opts.timeout_us, f"dispatch #{opts.seq} (refused here)",
                            f"d{opts.seq}", self._active(opts.active_ranks), opts.active_ranks, reason)

    def abort_combine(self, handle: "Handle", opts: CombineOptions, reason: int) -> None:
        import torch
        self._call_exchange(KIND_COMBINE, handle.seq, torch.empty((0, 0), dtype=torch.uint8, device=self.device),
                            [0] * self.num_ranks, opts.timeout_us, f"combine of dispatch #{handle.seq} (refused here)",
                            f"c{handle.seq}", self._active(opts.active_ranks), opts.active_ranks, reason)

    def set_generations(self, generations: List[int]) -> None:
        self._generations = generations           # the membership's list, shared (admissions update it)
        if self._mail is not None:
            self._mail.generations = generations

