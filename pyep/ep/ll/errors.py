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
