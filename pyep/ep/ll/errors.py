"""Typed errors of the low-latency mode for values that only the device sees without a host sync.

With `check_values=True` (the default) the dispatch kernel checks every top-k entry as it routes it:
an id outside [-1, E), or an expert the same row already named in an earlier slot, is treated as -1
(nothing is sent for it) and the first such entry is written to a small error record in pinned,
host-mapped memory. EpBuffer raises it -- without any device synchronisation -- at the buffer's next
dispatch/combine call (before that call does anything) and after a host wait that happens anyway: the
call's `event.wait()` and its receive hook. `check_values="strict"` reads topk_idx on the host and
raises the same exceptions before launch. Both are ValueErrors.
"""
from __future__ import annotations

from typing import Optional, Sequence

from ..errors import CallMismatch
from ..errors import PeerRefusedCall as _PeerRefusedCall

# Device error record (engine/kernels/ll_launch.h: LLErrorRecord): int32 words
# [code, row, k, value low 32 bits, value high 32 bits, earlier slot k (duplicates) or -1, 0, 0].
# The kernel writes `code` last (after a system-scope fence); the host clears it after reading.
RECORD_WORDS = 8
ERR_NONE = 0
ERR_EXPERT_RANGE = 1
ERR_EXPERT_DUPLICATE = 2


class InvalidExpertIndex(ValueError):
    """topk_idx[row, k] holds an id outside [-1, num_experts); the entry was treated as -1."""

    def __init__(self, row: int, k: int, value: int, num_experts: int, detail: Optional[str] = None) -> None:
        self.row, self.k, self.value, self.num_experts = row, k, value, num_experts
        super().__init__(detail or (f"topk_idx[{row}, {k}] = {value} is not an expert id in "
                                    f"[-1, {num_experts}); the entry was treated as -1 (no expert)"))


class DuplicateExpertIndex(InvalidExpertIndex):
    """topk_idx[row] names expert `value` in slot `first_k` and again in slot k; the later entry was
    treated as -1 (a token goes to an expert once)."""

    def __init__(self, row: int, k: int, value: int, num_experts: int, first_k: int) -> None:
        self.first_k = first_k
        super().__init__(row, k, value, num_experts,
                         f"topk_idx row {row} names expert {value} twice (slots {first_k} and {k}); "
                         f"the entry at [{row}, {k}] was treated as -1 (use -1 for unused slots)")


def make_error(code: int, row: int, k: int, value: int, first_k: int,
               num_experts: int) -> Optional[InvalidExpertIndex]:
    if code == ERR_NONE:
        return None
    if code == ERR_EXPERT_DUPLICATE:
        return DuplicateExpertIndex(row, k, value, num_experts, first_k)
    return InvalidExpertIndex(row, k, value, num_experts)


def error_from_record(words: Sequence[int], num_experts: int) -> Optional[InvalidExpertIndex]:
    """The exception a device error record stands for (None for no error)."""
    code, row, k, lo, hi, first_k = (int(w) for w in words[:6])
    value = ((hi & 0xFFFFFFFF) << 32) | (lo & 0xFFFFFFFF)
    if value >= 1 << 63:
        value -= 1 << 64
    return make_error(code, row, k, value, first_k, num_experts)


# ---------------------------------------------------------------- call errors (docs/ll_kernels.md, "Call tags")
# Device call record (ll_launch.h: LLCallWord): int32 [code, kind, my call (low 32 bits), peer, the peer's
# signal word, the tag expected of it, 0, 0]. Written by the kernels, cleared by the host after reading.
CALL_RECORD_WORDS = 8
CALL_NONE, CALL_PEER_ABORTED, CALL_MISMATCH, CALL_SKIPPED = 0, 1, 2, 3
KIND_DISPATCH, KIND_COMBINE = 1, 2
KIND_NAMES = {KIND_DISPATCH: "dispatch", KIND_COMBINE: "combine"}
# Why a rank refused its call on the host; the code travels in the abort marker (15 bits).
REFUSED_TYPE, REFUSED_VALUE, REFUSED_OTHER = 1, 2, 3
REFUSAL_REASONS = {REFUSED_TYPE: "its arguments were refused (TypeError)",
                   REFUSED_VALUE: "its arguments were refused (ValueError)",
                   REFUSED_OTHER: "it was refused on the host"}
# A signal word: [31:16] tag = (call number mod 4096) << 4 | (generation mod 16), [15] abort, [14:0] value.
TAG_CALL_BITS, TAG_GEN_BITS = 12, 4


def refusal_reason(exc: BaseException) -> int:
    """The reason code a refusing rank sends its peers for `exc`."""
    if isinstance(exc, TypeError):
        return REFUSED_TYPE
    return REFUSED_VALUE if isinstance(exc, ValueError) else REFUSED_OTHER


def call_tag(seq: int, generation: int) -> int:
    """The 16-bit tag of call `seq` sent by a rank of membership `generation` (the kernels' call_tag)."""
    return ((seq & ((1 << TAG_CALL_BITS) - 1)) << TAG_GEN_BITS) | (generation & ((1 << TAG_GEN_BITS) - 1))


def nearest_call(my_call: int, tag: int) -> int:
    """The call number closest to `my_call` whose low bits are those of `tag` (a tag holds the call
    number modulo 4096: a peer more than 2048 calls away is reported modulo that)."""
    span = 1 << TAG_CALL_BITS
    low = (tag >> TAG_GEN_BITS) & (span - 1)
    delta = (low - my_call) % span
    return my_call + (delta - span if delta >= span // 2 else delta)


class LLCallMismatch(CallMismatch):
    """A low-latency exchange met a peer at another call (its tag names another call number or
    generation). `kind` is "dispatch" or "combine"; `my_call` is this rank's call (the dispatch sequence
    number, also for its combine)."""

    def __init__(self, kind: str, rank: int, peer: int, my_call: object, peer_call: object, detail: str = "") -> None:
        self.kind = kind
        super().__init__(f"{kind} #{my_call}" if kind == "dispatch" else f"combine of dispatch #{my_call}",
                         rank, peer, my_call, peer_call, detail)


class PeerRefusedCall(LLCallMismatch, _PeerRefusedCall):
    """Peer `peer` refused this call on the host (`reason`: why) and took part in its exchange with an
    abort marker only: nothing it would have sent was used, and no rank waited for it or marked it."""

    def __init__(self, kind: str, rank: int, peer: int, my_call: int, reason: str) -> None:
        super().__init__(kind, rank, peer, my_call, my_call, reason)
        self.reason = reason
        self.args = (f"{self.what}: rank {peer} refused this call ({reason}); rank {rank} used nothing it would "
                     f"have sent (docs/elastic.md, 'Call-tagged exchanges')",)


class CombineOfFailedDispatch(LLCallMismatch):
    """The combine of a dispatch whose exchange failed (a peer refused it, or met this rank at another
    call). Every rank of that dispatch skips its combine, so none waits for the others; its output is
    not computed (NaN on the native backend)."""

    def __init__(self, rank: int, my_call: int, why: str = "") -> None:
        super().__init__("combine", rank, -1, my_call, None, why)
        self.args = (f"combine of dispatch #{my_call} on rank {rank}: that dispatch's exchange failed"
                     + (f" ({why})" if why else "") + "; every rank skips its combine and nothing was reduced "
                     "(docs/elastic.md, 'Call-tagged exchanges')",)


class CombineAfterRefusal(LLCallMismatch):
    """A combine of a handle whose earlier combine was refused (on this rank, or by a peer whose
    PeerRefusedCall this rank has taken). That refused combine was the handle's combine on every rank:
    its abort marker stands in the peers' flags in place of rows, so a second combine of the handle would
    pair with it. Refused before anything is sent; dispatch again to combine."""

    def __init__(self, rank: int, my_call: int, why: str = "") -> None:
        super().__init__("combine", rank, -1, my_call, None, why)
        self.args = (f"combine of dispatch #{my_call} on rank {rank}: an earlier combine of this handle was refused"
                     + (f" ({why})" if why else "") + " and stood for it on every rank; dispatch again "
                     "(docs/elastic.md, 'Call-tagged exchanges')",)


def describe_tag(tag: int) -> str:
    span = 1 << TAG_CALL_BITS
    return (f"call = {(tag >> TAG_GEN_BITS) & (span - 1)} (mod {span}), generation "
            f"{tag & ((1 << TAG_GEN_BITS) - 1)} (mod {1 << TAG_GEN_BITS})")


def call_error_from_record(words: Sequence[int], rank: int, my_call: int) -> Optional[LLCallMismatch]:
    """The exception a device call record stands for (None for none). `my_call`: the host's call number
    the record's low 32 bits belong to (the nearest one)."""
    code, kind_code, seq32, peer, word, expect = (int(w) for w in words[:6])
    if code == CALL_NONE:
        return None
    seq = my_call + ((seq32 - my_call) & 0xFFFFFFFF)
    if seq > my_call:
        seq -= 1 << 32     # the record is of this call or an earlier one
    kind = KIND_NAMES.get(kind_code, "dispatch")
    if code == CALL_SKIPPED:
        return CombineOfFailedDispatch(rank, seq)
    word &= 0xFFFFFFFF
    tag = word >> 16
    if code == CALL_PEER_ABORTED:
        reason = REFUSAL_REASONS.get(word & 0x7FFF, f"reason code {word & 0x7FFF}")
        return PeerRefusedCall(kind, rank, peer, seq, reason)
    expect &= 0xFFFF
    return LLCallMismatch(kind, rank, peer, seq, nearest_call(seq, tag),
                          f"its signal word {word:#010x} carries {describe_tag(tag)}; expected {describe_tag(expect)}")
