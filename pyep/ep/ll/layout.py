"""The native low-latency buffer layout: THE definition of every offset the kernels use.

One buffer per rank, identical layout on every rank (a sender computes addresses in the receiver's
buffer from its own layout). Two halves, one per in-flight call (the dispatch of call s and its combine
use half s & 1). Each half holds

    signals   dispatch counts int32 [E_l][R] (from source rank r for local expert e, sent as -count-1
              so that 0 means "not arrived"), combine flags int32 [R] (one per source rank), and
              combine acknowledgements cack int32 [R]: cack[s] counts the combines of this rank on
              this half that rank s has finished reducing (s adds 1 after its reduce; never cleared
              by a call, zeroed with the other signal words)
    drecv     dispatch receive area [R source ranks][S slots] of M-byte messages. A sender orders the
              messages it sends to one rank by (local expert, token, k), so the messages of expert e
              from rank r are contiguous. S = T * min(K_max, E_l): a rank sends at most T*K entries,
              and at most T per expert (the sender clamps), so S bounds both.
    crecv     combine receive area [T tokens][K_max slots] of M-byte rows: the expert output for
              token t, top-k slot k lands at (t, k); indexed by (token, slot), not by (expert, token)
              as DeepEP does, so it needs T*K_max rows instead of E*T.

A message is its payload first -- BF16: 2H bytes; FP8: H e4m3 bytes, then the G = H/128 fp32 scales
padded to 16 bytes -- and then a 16-byte header (source token, k, local expert, 0) at
header_offset(fp8). The slot stride M = 2H + max(16, H/32 rounded up to 16: a LogFMT combine row's
meta words) rounded up to 128 bytes: payloads start on 128-byte boundaries, so a warp's 512-byte store covers exactly four whole cache lines (with the header first
and M = 2H + 16, every store straddled five lines and wrote two of them partially, which cost
NVLink bandwidth). On the wire (NIC path) a message is header_offset + 16 bytes.

On the NIC path the same memory doubles as staging: a dispatch message for (t, k) is staged in the
sender's own crecv slot (t, k) -- only the expert owner that will receive it writes that slot later,
and only after it has received the message -- and a combine row is staged in the drecv slot its input
arrived in, which its token owner overwrites only in a later call, after this combine's flag.

A handle combined again (docs/ll_kernels.md): calls that alternate halves are ordered by the two-call
rule, but a second combine of one handle reuses the half with no call in between. The workspace keeps
csent[h][r], the combines this rank sent to r on half h (the last send block adds 1 per active
destination); a combine flagged `repeat` (the host's count of combines per handle) first waits until
r's cack[h][me] in its own buffer reaches csent[h][r] as it was when the call began: r has finished
reducing every earlier combine of ours on that half, so its receive rows and flags are free, and on the
NIC path our staged rows were read (r saw their flag, which travels after them on the same QP).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..config import FP8_GROUP, MAX_HIDDEN, MAX_TOPK, _check_int

HEADER_BYTES = 16
MSG_ALIGN = 128      # slot stride granularity: whole cache lines per message
SIGNAL_ALIGN = 256
REGION_ALIGN = 4096
FETCH_BYTES = 256   # scratch where NIC atomics deposit the fetched old value (never read)
# int32 words of the per-rank (not remotely written) workspace: 4 done-counters per half, padded,
# then per half a decision word per source rank for dispatch and for combine, then send-failure flags,
# then per half the combines sent to each rank (csent) and the decision word of a repeated combine's
# wait for each destination's acknowledgement (ll_ack.cuh), then per half T x K_max self-row words: where
# a fused combine's rows for this rank's own tokens are in its input (ll_combine.cu, "Own rows").
WS_HEADER_WORDS = 16


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def _int(name: str, v: object, lo: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name} must be an int, got {type(v).__name__} ({v!r})")
    if v < lo:
        raise ValueError(f"{name} must be >= {lo}, got {v}")
    return v


@dataclass(frozen=True)
class LLLayout:
    num_max_tokens: int          # T
    hidden: int                  # H
    num_experts: int             # E
    num_ranks: int               # R
    max_topk: int                # K_max
    num_local_experts: int       # E_l
    msg_bytes: int               # M
    slots_per_src: int           # S
    off_dsig: int                # offsets inside a half
    off_csig: int
    off_cack: int
    off_drecv: int
    off_crecv: int
    half_bytes: int
    off_fetch: int               # after both halves
    total_bytes: int

    # ---- addresses (byte offsets from the buffer base); the kernels compute the same numbers
    def half_base(self, half: int) -> int:
        if half not in (0, 1):
            raise ValueError(f"half must be 0 or 1, got {half}")
        return half * self.half_bytes

    def dsig_offset(self, half: int, local_expert: int, src: int) -> int:
        return self.half_base(half) + self.off_dsig + 4 * (local_expert * self.num_ranks + src)

    def csig_offset(self, half: int, src: int) -> int:
        return self.half_base(half) + self.off_csig + 4 * src

    def cack_offset(self, half: int, src: int) -> int:
        """The word rank `src` adds 1 to when it finished reducing a combine of ours on `half`."""
        return self.half_base(half) + self.off_cack + 4 * src

    def drecv_offset(self, half: int, src: int, slot: int) -> int:
        return self.half_base(half) + self.off_drecv + (src * self.slots_per_src + slot) * self.msg_bytes

    def crecv_offset(self, half: int, token: int, k: int) -> int:
        return self.half_base(half) + self.off_crecv + (token * self.max_topk + k) * self.msg_bytes

    def header_offset(self, fp8: bool) -> int:
        """Where a dispatch message's 16-byte header sits: right after the payload (and FP8 scales)."""
        return header_offset(self.hidden, fp8)

    @property
    def fp8_msg_bytes(self) -> int:
        """Bytes of an FP8 message on the wire: H e4m3 bytes, scales padded to 16 bytes, header."""
        return self.header_offset(True) + HEADER_BYTES

    @property
    def bf16_msg_bytes(self) -> int:
        return self.header_offset(False) + HEADER_BYTES

    @property
    def signal_ranges(self) -> list:
        """(offset, bytes) of the signal areas of both halves: what must be zero between calls."""
        return [(self.half_base(h) + self.off_dsig, self.off_drecv - self.off_dsig) for h in (0, 1)]

    def workspace_words(self) -> int:
        return ws_words(self.num_ranks, self.num_max_tokens, self.max_topk)

    def describe(self) -> str:
        mib = 1 << 20
        return (f"LL buffer T={self.num_max_tokens} H={self.hidden} E={self.num_experts} "
                f"R={self.num_ranks} K_max={self.max_topk}: {self.total_bytes / mib:.1f} MiB "
                f"(per half: dispatch recv {self.num_ranks}x{self.slots_per_src} msgs of "
                f"{self.msg_bytes} B = {(self.off_crecv - self.off_drecv) / mib:.1f} MiB, combine recv "
                f"{self.num_max_tokens}x{self.max_topk} rows = "
                f"{(self.half_bytes - self.off_crecv) / mib:.1f} MiB)")


def header_offset(hidden: int, fp8: bool) -> int:
    """Byte offset of the header in a dispatch message (the kernels' hdr_offset)."""
    return hidden + _align(4 * (hidden // FP8_GROUP), 16) if fp8 else 2 * hidden


def ws_words(num_ranks: int, num_max_tokens: int, max_topk: int) -> int:
    """int32 words of the local workspace (done counters, per-source decisions, failure flags, combines
    sent per half and destination, repeated-combine decisions, the fused combine's self-row map)."""
    return WS_HEADER_WORDS + 9 * num_ranks + 2 * num_max_tokens * max_topk


def ws_csent_index(num_ranks: int, half: int, rank: int) -> int:
    """Index of csent[half][rank] in the workspace (ll_common.cuh: ws_csent)."""
    if half not in (0, 1) or not 0 <= rank < num_ranks:
        raise ValueError(f"csent[{half}][{rank}] outside [2][{num_ranks}]")
    return WS_HEADER_WORDS + 5 * num_ranks + half * num_ranks + rank


def ll_buffer_layout(T: int, H: int, E: int, R: int, K_max: int = 16) -> LLLayout:
    """Layout of the native low-latency buffer for T tokens per rank, hidden H, E experts, R ranks and
    at most K_max top-k slots."""
    _int("T", T, 1)
    _int("H", H, FP8_GROUP)
    if H % FP8_GROUP:
        raise ValueError(f"H must be a multiple of {FP8_GROUP}, got {H}")
    _int("E", E, 1)
    _int("R", R, 1)
    _int("K_max", K_max, 1)
    if E % R:
        raise ValueError(f"E ({E}) must be divisible by R ({R})")
    e_l = E // R
    # A slot holds a dispatch message (payload + 16-byte header) or a LogFMT combine row (its per-group
    # meta words + at most 2H bytes of groups: pyep/ep/ll/logfmt.py), whichever is larger.
    msg = _align(2 * H + max(HEADER_BYTES, _align(4 * (H // FP8_GROUP), 16)), MSG_ALIGN)
    slots = T * min(K_max, e_l)
    off_dsig = 0
    off_csig = _align(off_dsig + 4 * e_l * R, SIGNAL_ALIGN)
    off_cack = _align(off_csig + 4 * R, SIGNAL_ALIGN)
    off_drecv = _align(off_cack + 4 * R, REGION_ALIGN)
    off_crecv = _align(off_drecv + R * slots * msg, REGION_ALIGN)
    half = _align(off_crecv + T * K_max * msg, REGION_ALIGN)
    off_fetch = 2 * half
    total = _align(off_fetch + FETCH_BYTES, REGION_ALIGN)
    return LLLayout(num_max_tokens=T, hidden=H, num_experts=E, num_ranks=R, max_topk=K_max,
                    num_local_experts=e_l, msg_bytes=msg, slots_per_src=slots, off_dsig=off_dsig,
                    off_csig=off_csig, off_cack=off_cack, off_drecv=off_drecv, off_crecv=off_crecv, half_bytes=half,
                    off_fetch=off_fetch, total_bytes=total)


def ll_buffer_bytes(T: int, H: int, E: int, R: int, K_max: int = 16) -> int:
    """Bytes of the native low-latency buffer (both halves) for this shape."""
    return ll_buffer_layout(T, H, E, R, K_max).total_bytes


def size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int, num_ranks: int,
              max_topk: int = MAX_TOPK) -> int:
    """Bytes of the native low-latency buffer for a shape (the layout above)."""
    t = _check_int("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank, 1)
    h = _check_int("hidden", hidden, FP8_GROUP, MAX_HIDDEN)
    if h % FP8_GROUP:
        raise ValueError(f"hidden must be a multiple of {FP8_GROUP}, got {h}")
    e = _check_int("num_experts", num_experts, 1)
    r = _check_int("num_ranks", num_ranks, 1)
    k = _check_int("max_topk", max_topk, 1, MAX_TOPK)
    if e % r:
        raise ValueError(f"num_experts ({e}) must be divisible by num_ranks ({r})")
    return int(ll_buffer_bytes(t, h, e, r, k))
