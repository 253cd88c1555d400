"""Byte layout of a native normal-mode buffer (one per rank, mapped by every peer of the node).
engine/kernels/normal_common.cuh addresses it with the offsets computed here; docs/normal_mode.md
explains who writes what.

    [control]  u32 tail[MAX_CHANNELS][R]   rows sender s has published into my ring (c, s)
               u32 head[MAX_CHANNELS][R]   rows receiver d has consumed from my stream (c, -> d)
               u32 tx_pos[MAX_CHANNELS][R] my own count of rows sent on (c, -> d) (never remote)
               u32 rx_pos[MAX_CHANNELS][R] my own count of rows consumed from (c, s)
               i32 alive, 3 spare          my heartbeat: moves while my kernels wait (peers read it)
               i32 notify_flag[2][R]       call number of source s's counts and tag, by call parity
               i32 notify[2][R][NOTIFY_INTS] source s's counts for me: rows, per channel, per expert;
                                           its call tag (tags.py); an internode call's extra words
               i32 direct[MAX_CHANNELS][DESC_INTS] my one-copy output descriptor per channel
                                           (normal_direct.cuh): call, offer, rows, pool offsets
               i32 pulled[2 * MAX_CHANNELS][R] call number of the last pull combine whose block b
                                           of rank s finished reading my x (normal_pull.cuh)
    [rings]    slot[C][R][Q] of slot_bytes: ring (c, s) holds the rows source s sends me on channel c
    [pool]     optional, at the buffer's end: one-copy dispatch outputs, pull combine inputs (direct_pool.py)

Counters are absolute (they only grow, modulo 2**32) so no call ever has to reset them; each call
starts on empty rings (a sender waits until its previous rows were consumed), so the channel count,
ring size and row size may change from one call to the next.
"""
from __future__ import annotations

from typing import Any

from .limits import DESC_INTS, MAX_CHANNELS, MAX_LOCAL_EXPERTS, MAX_RANKS, MAX_TOPK
from .tags import TAG_INTS

# rows per rank, per-channel rows, per-expert entries, the call tag (normal_launch.h kNotifyExtra)
NOTIFY_INTS = MAX_RANKS + MAX_CHANNELS + MAX_LOCAL_EXPERTS + TAG_INTS
RING_ALIGN = 128


def _align(v: int, a: int) -> int:
    return (v + a - 1) // a * a


def slot_bytes(hidden: int, num_topk: int = MAX_TOPK) -> int:
    """One ring slot: the largest row of any call with this hidden size and top-k: a BF16 payload,
    top-k ids (int32) and weights (fp32), the source token index; whole 128-byte lines. FP8 rows (H
    bytes + H/128 scales) and combine rows (BF16 + weights) are smaller (normal_common.cuh)."""
    return _align(2 * hidden + 8 * num_topk + 4, RING_ALIGN)


def notify_ints(extra: int = 0) -> int:
    """Ints of one notify slot: the counts, then `extra` words (an internode call's count records,
    normal_internode.md), 4-int aligned."""
    return NOTIFY_INTS + _align(extra, 4)


def control_words(num_ranks: int, extra: int = 0) -> dict:
    """Word offsets (int32 units) of the control arrays."""
    n = MAX_CHANNELS * num_ranks
    off = {"tail": 0, "head": n, "tx_pos": 2 * n, "rx_pos": 3 * n, "alive": 4 * n, "notify_flag": 4 * n + 4}
    off["notify"] = off["notify_flag"] + 2 * num_ranks
    off["direct"] = off["notify"] + 2 * num_ranks * notify_ints(extra)
    off["pulled"] = off["direct"] + MAX_CHANNELS * DESC_INTS
    off["end"] = off["pulled"] + 2 * MAX_CHANNELS * num_ranks
    return off


def ring_offset(num_ranks: int, extra: int = 0) -> int:
    return _align(4 * control_words(num_ranks, extra)["end"], RING_ALIGN)


def ring_bytes(num_ranks: int, num_channels: int, ring_tokens: int, row_bytes: int) -> int:
    return num_channels * num_ranks * ring_tokens * row_bytes


def buffer_bytes(num_ranks: int, num_channels: int, ring_tokens: int, hidden: int,
                 num_topk: int = MAX_TOPK) -> int:
    """Bytes a buffer needs for calls of this shape."""
    return ring_offset(num_ranks) + ring_bytes(num_ranks, num_channels, ring_tokens, slot_bytes(hidden, num_topk))


MIN_RING_TOKENS = 32   # normal_launch.h kScanWindow: a dispatch sender routes 32 tokens per ballot


def fit_rings(config: Any, num_ranks: int, hidden: int, capacity: int) -> Any:
    """`config` with its rings made to fit `capacity` bytes: the ring depth first (down to
    MIN_RING_TOKENS, the send chunk never above it), then two SMs (one channel) at a time. A caller that
    picks its SM count before it knows the buffer (DeepEP V2's ElasticBuffer: num_sms per call) gets a
    config this buffer can run instead of a refusal; unchanged when it fits."""
    import dataclasses
    row = slot_bytes(hidden)
    sms = config.num_sms
    while sms >= 2:
        c_n = sms // 2
        q = min(config.num_max_nvl_chunked_recv_tokens, capacity // max(1, num_ranks * c_n * row))
        if q >= MIN_RING_TOKENS:
            if (sms, q) == (config.num_sms, config.num_max_nvl_chunked_recv_tokens):
                return config
            return dataclasses.replace(config, num_sms=sms, num_max_nvl_chunked_recv_tokens=q,
                                       num_max_nvl_chunked_send_tokens=min(q, config.num_max_nvl_chunked_send_tokens))
        sms -= 2
    check_rings(config, num_ranks, hidden, capacity)     # raises: not even one channel fits
    return config


def check_rings(config: Any, num_ranks: int, hidden: int, capacity: int) -> None:
    """ValueError unless the rings of `config` (a Config) fit `capacity` bytes of a native buffer."""
    q, c_n = config.num_max_nvl_chunked_recv_tokens, config.num_channels()
    need = ring_bytes(num_ranks, c_n, q, slot_bytes(hidden))
    if need > capacity:
        raise ValueError(f"the rings of this config need {need} bytes ({c_n} channels x {num_ranks} ranks x {q} rows), "
                         f"the buffer holds {capacity}: construct it with num_nvl_bytes >= NormalBuffer.size_hint(...) "
                         f"or use a smaller config")
    if q < MIN_RING_TOKENS:
        raise ValueError(f"num_max_nvl_chunked_recv_tokens={q}: the native rings hold at least {MIN_RING_TOKENS} rows")
