"""Performance configuration of the normal mode (DeepEP's `Config`, same positional order), the tuned
defaults per rank count, and the native buffer size a configuration needs."""
from __future__ import annotations

from dataclasses import dataclass
from typing import List

from ..config import MAX_HIDDEN
from .layout import buffer_bytes
from .limits import (DEFAULT_NUM_SMS, MAX_CHANNELS, MAX_GROUP_RANKS, MAX_LOCAL_EXPERTS, MAX_RANKS, MAX_RING_TOKENS,
                     MAX_TOPK)

__all__ = ["Config", "default_config", "DEFAULT_NUM_SMS", "MAX_CHANNELS", "MAX_LOCAL_EXPERTS", "MAX_RANKS",
           "MAX_TOPK"]


def _positive_int(name: str, v: object, hi: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name} must be an int, got {type(v).__name__} ({v!r:.40})")
    if not 1 <= v <= hi:
        raise ValueError(f"{name} must be in [1, {hi}], got {v}")
    return v


@dataclass(frozen=True)
class Config:
    """num_sms: SMs of the dispatch/combine kernels (two per channel: a sender and a receiver).
    num_max_nvl_chunked_send_tokens: rows a sender writes between two tail updates.
    num_max_nvl_chunked_recv_tokens: ring capacity in rows per (channel, peer).
    The RDMA fields are accepted for DeepEP compatibility; one-node buffers do not use them."""
    num_sms: int = DEFAULT_NUM_SMS
    num_max_nvl_chunked_send_tokens: int = 6
    num_max_nvl_chunked_recv_tokens: int = 256
    num_max_rdma_chunked_send_tokens: int = 6
    num_max_rdma_chunked_recv_tokens: int = 128

    def __post_init__(self) -> None:
        for name in ("num_sms", "num_max_nvl_chunked_send_tokens", "num_max_nvl_chunked_recv_tokens",
                     "num_max_rdma_chunked_send_tokens", "num_max_rdma_chunked_recv_tokens"):
            _positive_int(f"Config.{name}", getattr(self, name), MAX_RING_TOKENS)
        if self.num_sms % 2 or not 2 <= self.num_sms <= 2 * MAX_CHANNELS:
            raise ValueError(f"Config.num_sms must be even and in [2, {2 * MAX_CHANNELS}] (a sender and a "
                             f"receiver SM per channel), got {self.num_sms}")
        if self.num_max_nvl_chunked_send_tokens > self.num_max_nvl_chunked_recv_tokens:
            raise ValueError(f"Config: the send chunk ({self.num_max_nvl_chunked_send_tokens} rows) must fit "
                             f"the ring ({self.num_max_nvl_chunked_recv_tokens} rows)")

    def num_channels(self) -> int:
        return self.num_sms // 2

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes of NVLink buffer per rank for rows of `hidden_bytes` payload (DeepEP's name; pyep's
        rows also carry top-k ids and weights, max_topk of them)."""
        _size_args(hidden_bytes, num_ranks)
        return buffer_bytes(num_ranks, self.num_channels(), self.num_max_nvl_chunked_recv_tokens,
                            hidden_bytes // 2, MAX_TOPK)

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """One-node buffers need no RDMA buffer."""
        _size_args(hidden_bytes, num_ranks)
        return 0


def _size_args(hidden_bytes: object, num_ranks: object) -> None:
    """A size hint's arguments: a row of at most MAX_HIDDEN BF16 values, the ranks of a group."""
    _positive_int("hidden_bytes", hidden_bytes, 2 * MAX_HIDDEN)
    _positive_int("num_ranks", num_ranks, MAX_GROUP_RANKS)


# Defaults per rank count: the SM count is shared (NormalBuffer.set_num_sms); the chunk sizes were
# chosen on 2 H200s (docs/normal_mode.md, tools: pyep bench --mode normal --sweep-sms).
_DISPATCH = {1: (8, 256), 2: (8, 256), 4: (8, 256), 8: (6, 256)}
_COMBINE = {1: (8, 256), 2: (8, 256), 4: (8, 256), 8: (6, 256)}
# Eight ranks with 6 or more channels each: a 64-row ring. What counts there is the memory in flight,
# ring x channels x 7 peers per rank; at 8 channels the 256-row ring was 20 % slower on FP8 dispatch, at
# 4 channels the 64-row ring was (docs/normal_mode.md, "Ring depth"; docs/results/2026-11-26d-h100x1).
_SHALLOW_RING = (8, 6, 64)   # (ranks, from this many channels, ring rows)


def default_config(num_ranks: int, num_sms: int, combine: bool, one_node: bool = True) -> Config:
    """one_node=False (a buffer across nodes): the table's rows without the shallow ring, which was
    measured on the ranks of one node only."""
    table = _COMBINE if combine else _DISPATCH
    if num_ranks not in table:
        raise ValueError(f"the normal mode runs on 1, 2, 4 or 8 ranks of one node, not {num_ranks}")
    send, recv = table[num_ranks]
    ranks, channels, shallow = _SHALLOW_RING
    if one_node and num_ranks == ranks and num_sms // 2 >= channels:
        recv = shallow
    return Config(num_sms, send, recv)


def sizing_configs(num_ranks: int, num_sms: int) -> List[Config]:
    """The configs a default-sized buffer must hold: the defaults, and with the table's ring depth where
    the default is shallower (8 ranks), so that DeepEP's own configs for that rank count (256-row rings)
    fit a buffer sized by NormalBuffer.size_hint as they did before the shallow default."""
    if num_ranks not in _DISPATCH:        # no tuned entry (the reference on 3 ranks, say): Config's defaults
        return [Config(num_sms)]
    out: List[Config] = []
    for combine in (False, True):
        table = _COMBINE if combine else _DISPATCH
        c = default_config(num_ranks, num_sms, combine)
        out += [c, Config(num_sms, c.num_max_nvl_chunked_send_tokens, max(c.num_max_nvl_chunked_recv_tokens,
                                                                          table[num_ranks][1]))]
    return out
