"""Typed errors of the normal mode. Argument problems are TypeError/ValueError raised before anything is
sent; what only the device can see (expert ids, received-row counts, a peer that stops answering) is
recorded by the kernels in a small host-visible error record and raised from it at the buffer's next
call or when the call's event is waited on (no device synchronisation on the hot path)."""
from __future__ import annotations

from typing import Optional, Sequence

# Codes of the device error record (engine/kernels/normal_launch.h: NormalError); words are
# [code, a, b, c]; the first error of a call wins.
ERR_NONE = 0
ERR_EXPERT_ID = 1        # a = token row, b = top-k slot, c = the id (low 32 bits)
ERR_WORST_TOKENS = 2     # a = rows that arrived, b = num_worst_tokens
ERR_PEER_TIMEOUT = 3     # a = peer rank, b = phase (PHASES), c = channel
ERR_BAD_HANDLE = 4       # a = channel, b = rows the handle promised, c = rows the sender found
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


class PeerTimeout(NormalModeError, TimeoutError):
    """A peer did not answer within the buffer's timeout; the channels are in an unknown state until
    clean() (collective) resets them."""

    def __init__(self, peer: int, phase: str, channel: int, timeout_us: int) -> None:
        self.peer, self.phase, self.channel, self.timeout_us = peer, phase, channel, timeout_us
        where = f" (channel {channel})" if channel >= 0 else ""
        super().__init__(f"rank {peer} did not answer within {timeout_us} us in the {phase} phase{where}; "
                         f"call clean() on every live rank before using this buffer again")


class BufferBroken(NormalModeError):
    """The buffer saw a peer time out earlier and refuses calls until clean()."""


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
    if code == ERR_BAD_HANDLE:
        return NormalModeError(f"the handle does not describe this call: channel {a} promised {b} rows, "
                               f"the tokens gave {c}; pass the handle of a dispatch with the same tokens")
    return NormalModeError(f"unknown device error record {list(words[:4])}")
