"""Typed errors of the normal mode. Argument problems are TypeError/ValueError raised before anything is
sent; what only the device can see (expert ids, received-row counts, a peer that stops answering) is
recorded by the kernels in a small host-visible error record and raised from it at the buffer's next
call or when the call's event is waited on (no device synchronisation on the hot path)."""
from __future__ import annotations

from typing import Any, Optional, Sequence

from ..errors import CallMismatch
from ..errors import PeerRefusedCall as _PeerRefusedCall

# Codes of the device error record (engine/kernels/normal_launch.h: NormalError); words are
# [code, a, b, c]; the first error of a call wins.
ERR_NONE = 0
ERR_EXPERT_ID = 1        # a = token row, b = top-k slot, c = the id (low 32 bits)
ERR_WORST_TOKENS = 2     # a = rows that arrived, b = num_worst_tokens
ERR_PEER_TIMEOUT = 3     # a = peer rank, b = phase (PHASES), c = channel
ERR_BAD_HANDLE = 4       # a = channel, b = rows the handle promised, c = rows the sender found
# 5 is the relay's (internode_relay.ERR_QP)
ERR_IN_RANK = 6          # a = token row, b = rank, c = what is_token_in_rank said (0/1)
ERR_EXPERT_COUNT = 7     # a = expert, b = num_tokens_per_expert's value, c = entries of topk_idx naming it
ERR_RANK_COUNT = 8       # a = rank, b = num_tokens_per_rank's value, c = tokens is_token_in_rank selects
ERR_NODE_COUNT = 9       # a = node, b = num_tokens_per_rdma_rank's value, c = tokens is_token_in_rank selects
ERR_VOID_HANDLE = 10     # a = the call number of the void dispatch whose handle the call used
ERR_DIRECT_DESC = 11     # a = rank, b = field (1 rows, 2 recv_x, 3 scales, 4 staging; pull combine: 5 rows, 6 x), c = rows
ERR_LOST_PATH = 12       # a = rank, b = the call number
PHASES = ("notify", "dispatch", "combine")


class NotCapturable(ValueError):
    """This call cannot be captured in a CUDA graph (the message says what to change); raised before
    anything is launched, so the capture and the buffer stay usable."""


class NormalModeError(RuntimeError):
    """Base class of the errors the normal mode reports from the device."""


class InvalidExpertIndex(NormalModeError, ValueError):
    """topk_idx held an id outside [-1, num_experts); that entry was treated as -1."""

    def __init__(self, row: int, k: int, value: int, num_experts: int) -> None:
        self.row, self.k, self.value, self.num_experts = row, k, value, num_experts
        super().__init__(f"topk_idx[{row}, {k}] = {value} is not an expert id in [-1, {num_experts}); "
                         f"the entry was treated as -1 (no expert)")


class WorstTokensExceeded(NormalModeError, ValueError):
    """More rows arrived than num_worst_tokens allows; the extra rows were dropped."""

    def __init__(self, arrived: int, num_worst_tokens: int) -> None:
        self.arrived, self.num_worst_tokens = arrived, num_worst_tokens
        super().__init__(f"{arrived} rows arrived but num_worst_tokens={num_worst_tokens}: rows past "
                         f"{num_worst_tokens} were dropped; pass a larger num_worst_tokens")


class LayoutMismatch(NormalModeError, ValueError):
    """The layout tensors passed to dispatch contradict each other or topk_idx (they must be what one
    get_dispatch_layout call returned for that topk_idx); found in the values, so raised like the other
    value errors. The call's counts came from the caller's tensors and its results are not to be used."""


def in_rank_mismatch(row: int, rank: int, claimed: int) -> LayoutMismatch:
    said = "True" if claimed else "False"
    truth = "names no expert" if claimed else "names an expert"
    return LayoutMismatch(f"is_token_in_rank[{row}, {rank}] is {said} but topk_idx[{row}] {truth} of rank {rank}; "
                          f"pass the is_token_in_rank get_dispatch_layout returned for this topk_idx")


def expert_count_mismatch(expert: int, claimed: int, derived: int) -> LayoutMismatch:
    if claimed < 0:
        return LayoutMismatch(f"num_tokens_per_expert[{expert}] is {claimed}: a count cannot be negative")
    return LayoutMismatch(f"num_tokens_per_expert[{expert}] is {claimed} but topk_idx names expert {expert} in "
                          f"{derived} entries; pass the num_tokens_per_expert get_dispatch_layout returned for this "
                          f"topk_idx")


def rank_count_mismatch(rank: int, claimed: int, derived: int) -> LayoutMismatch:
    return LayoutMismatch(f"num_tokens_per_rank[{rank}] is {claimed} but is_token_in_rank selects {derived} tokens "
                          f"for rank {rank}; pass the tensors of one get_dispatch_layout call")


def node_count_mismatch(node: int, claimed: int, derived: int) -> LayoutMismatch:
    return LayoutMismatch(f"num_tokens_per_rdma_rank[{node}] is {claimed} but is_token_in_rank selects {derived} "
                          f"tokens for node {node}; pass the tensors of one get_dispatch_layout call")


class PeerTimeout(NormalModeError, TimeoutError):
    """A peer did not answer within the buffer's timeout; the channels are in an unknown state until
    clean() (collective) resets them."""

    def __init__(self, peer: int, phase: str, channel: int, timeout_us: int) -> None:
        self.peer, self.phase, self.channel, self.timeout_us = peer, phase, channel, timeout_us
        where = f" (channel {channel})" if channel >= 0 else ""
        super().__init__(f"rank {peer} did not answer within {timeout_us} us in the {phase} phase{where}; "
                         f"call clean() on every live rank before using this buffer again")


class ElasticUnsupported(NormalModeError, NotImplementedError):
    """An elastic feature (an active_ranks mask that leaves a rank out, a store-based buffer) on a
    backend that does not implement it: the native normal kernels do not take a mask yet, and a mask
    they ignored would send to and wait for a dead rank. `feature` names what is missing."""

    def __init__(self, feature: str, backend: str) -> None:
        self.feature, self.backend = feature, backend
        super().__init__(f"NormalBuffer: {feature} is not implemented on the {backend} backend (the reference "
                         f"backend has it: backend='reference'; docs/elastic.md, 'Normal mode')")


class BadOutputDescriptor(NormalModeError):
    """A rank's one-copy output descriptor (normal_direct.cuh) lay outside the output pool, or its pull
    combine offer (normal_pull.cuh, fields 5 and 6) did not describe its input: nothing of the call was
    sent or read, and the buffer refuses calls until clean()."""

    def __init__(self, peer: int, field: int, rows: int) -> None:
        self.peer, self.field, self.rows = peer, field, rows
        if field in (5, 6):
            what = "fewer rows than the handle says it received" if field == 5 else "x outside the output pool"
            super().__init__(f"rank {peer}'s pull combine offer is invalid ({what}, {rows} rows): the ranks' "
                             f"buffers differ in size or layout, the handles differ, or its memory was overwritten; "
                             f"nothing was read (PYEP_NORMAL_PULL=0 makes every combine push)")
            return
        what = {1: "its row count", 2: "recv_x", 3: "recv_x_scales", 4: "its staging rows"}.get(field, f"field {field}")
        super().__init__(f"rank {peer}'s one-copy dispatch descriptor is invalid ({what}, {rows} rows, outside the "
                         f"output pool): the ranks' buffers differ in size or layout, or its memory was overwritten; "
                         f"nothing was sent (PYEP_NORMAL_DIRECT=0 turns one-copy dispatch off)")


class LostDispatchPath(NormalModeError):
    """A rank's ring dispatch kernel found no record of the path (one-copy or ring) its one-copy kernel
    took for this call (normal_direct.cuh recorded_path): that memory was overwritten. Nothing more of
    the call was sent, and the buffer refuses calls until clean() (its peers time out on this rank)."""

    def __init__(self, peer: int, call: int) -> None:
        self.peer, self.call = peer, call
        super().__init__(f"rank {peer}'s ring dispatch kernel found no one-copy decision of call {call} in its "
                         f"own descriptor: that memory was overwritten; nothing more of the call was sent")


class BufferBroken(NormalModeError):
    """The buffer saw a peer time out (or ranks at different calls) earlier and refuses calls until
    clean()."""


class NormalCallMismatch(CallMismatch, NormalModeError):
    """Ranks met in a normal-mode exchange at different calls (generation, call number, kind or shape):
    raised on every rank of the exchange, nothing of it was used. The ranks no longer agree on which
    call is which, so the buffer refuses calls until clean() (collective) starts every rank at call 1
    of a new generation (docs/normal_mode.md, "Call-tagged exchanges")."""


class PeerRefusedCall(_PeerRefusedCall, NormalModeError):
    """A peer refused this call on its host (its arguments failed validation, or it raised an error of
    an earlier call instead): it took part in the call's exchange only to say so, every rank raises at
    this call, nothing of the exchange was used and the buffer stays usable. `peer` is the rank that
    refused, `reason` its exception (as it sent it), `via` the rank that passed the refusal on (across
    nodes), if not the refusing rank itself."""

    def __init__(self, what: str, rank: int, peer: int, call: int, reason: str, via: Optional[int] = None) -> None:
        self.what, self.rank, self.peer, self.my_call, self.peer_call = what, rank, peer, call, call
        self.reason, self.via = reason, via
        hop = f" (passed on by rank {via})" if via is not None else ""
        RuntimeError.__init__(self, f"{what}: rank {peer} refused call #{call}{hop}: {reason}; every rank raises "
                                    f"at this call, none used anything of its exchange, the buffer stays usable")


def error_from_record(words: Sequence[int], num_experts: int, timeout_us: int) -> Optional[NormalModeError]:
    """The exception a device error record [code, a, b, c] stands for (None for no error)."""
    code, a, b, c = (int(w) for w in words[:4])
    if code == ERR_NONE:
        return None
    if code == ERR_EXPERT_ID:
        return InvalidExpertIndex(a, b, c, num_experts)
    if code == ERR_WORST_TOKENS:
        return WorstTokensExceeded(a, b)
    if code == ERR_PEER_TIMEOUT:
        phase = PHASES[b] if 0 <= b < len(PHASES) else f"phase {b}"
        return PeerTimeout(a, phase, c, timeout_us)
    if code == ERR_IN_RANK:
        return in_rank_mismatch(a, b, c)
    if code == ERR_EXPERT_COUNT:
        return expert_count_mismatch(a, b, c)
    if code == ERR_RANK_COUNT:
        return rank_count_mismatch(a, b, c)
    if code == ERR_NODE_COUNT:
        return node_count_mismatch(a, b, c)
    if code == ERR_VOID_HANDLE:
        return NormalModeError(f"this call used the handle of dispatch #{a & 0xFFFFFFFF}, which was void (a rank "
                               f"refused it or the ranks were at different calls): the call was void on every rank "
                               f"too; dispatch again for a new handle")
    if code == ERR_DIRECT_DESC:
        return BadOutputDescriptor(a, b, c)
    if code == ERR_LOST_PATH:
        return LostDispatchPath(a, b)
    if code == ERR_BAD_HANDLE:
        return NormalModeError(f"the handle does not describe this call: channel {a} promised {b} rows, "
                               f"the tokens gave {c}; pass the handle of a dispatch with the same tokens")
    return NormalModeError(f"unknown device error record {list(words[:4])}")


class RefusingArgs:
    """The context of a call's host checks (NormalBuffer._refusing): a TypeError or ValueError raised
    inside it refuses the call on the peers too (the backend's refuse: a REFUSED tag, so they raise
    PeerRefusedCall instead of waiting), and an earlier call's pending error is raised in its place. A
    class rather than a contextlib generator: it is entered on every call, at a third of the host time."""

    __slots__ = ("backend", "kind", "pending")

    def __init__(self, backend: Any, kind: int, pending: Optional[Exception]) -> None:
        self.backend, self.kind, self.pending = backend, kind, pending

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        if exc_type is None or not issubclass(exc_type, (TypeError, ValueError)):
            return False
        problem = self.backend.refuse(self.kind, f"{type(exc).__name__}: {exc}")
        if problem is not None:
            exc.add_note(f"the call's exchange found more: {problem}")
        if self.pending is not None:
            self.pending.add_note(f"(raised by a call that was refused: {type(exc).__name__}: {exc})")
            raise self.pending from None
        return False
