"""Call tags: what every normal-mode exchange carries so that ranks never pair messages of different
calls (docs/normal_mode.md, "Call-tagged exchanges").

Each rank numbers its exchanging calls (the reference backend on the host, the native kernels on the
device) and every exchange starts with a tag from every rank: the buffer's generation (epoch: the
number of clean() calls), the call number, the call's kind and the shape facts the ranks must agree
on (its signature), and a status: a rank whose call was refused on the host still takes part with
status REFUSED and its reason, so its peers raise `PeerRefusedCall` for that very call instead of
waiting for it or pairing its next call with this one. A tag of another generation, call number, kind
or signature raises `NormalCallMismatch` on every rank of the exchange and nothing of it is used.

The word layout is shared with the kernels (engine/kernels/normal_launch.h, kTag*): TAG_INTS int32
words, [magic, epoch, call, kind, status, origin, signature x SIG_INTS, reason length, mask, reason bytes];
the mask word is the native kernels' active-ranks bits (normal_tags.h kTagOffMask; 0 from the host,
whose exchanges carry the mask beside the tag).
A tag read from a peer is input: `decode` refuses anything that is not a well-formed tag.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from .errors import NormalCallMismatch, PeerRefusedCall

MAGIC = 0x4E544147          # "NTAG"
KIND_LAYOUT, KIND_DISPATCH, KIND_CACHED, KIND_COMBINE, KIND_CLEAN = 1, 2, 3, 4, 5
KIND_NAMES = {KIND_LAYOUT: "get_dispatch_layout", KIND_DISPATCH: "dispatch", KIND_CACHED: "cached dispatch",
              KIND_COMBINE: "combine", KIND_CLEAN: "clean"}
# OK: a call made; REFUSED: refused on this rank's host; PROXY: void because a rank it exchanged with
# earlier in the call refused (origin names that rank); NOTICE: "you are at another call" (the kernels
# write it into a peer's slot when they see the peer's flags at another call number).
STATUS_OK, STATUS_REFUSED, STATUS_PROXY, STATUS_NOTICE = 0, 1, 2, 3
SIG_INTS = 8
REASON_BYTES = 128
OFF_SIG, OFF_REASON_LEN, OFF_REASON = 6, 6 + SIG_INTS, 16
TAG_INTS = OFF_REASON + REASON_BYTES // 4


@dataclass(frozen=True)
class CallTag:
    epoch: int
    call: int
    kind: int
    status: int = STATUS_OK
    signature: Tuple[int, ...] = ()
    origin: int = -1          # PROXY: the rank that refused; else the tag's own rank (-1: not set)
    reason: str = ""

    @property
    def void(self) -> bool:
        return self.status in (STATUS_REFUSED, STATUS_PROXY)

    def kind_name(self) -> str:
        return KIND_NAMES.get(self.kind, f"kind {self.kind}")

    def describe(self) -> str:
        sig = ",".join(str(v) for v in self.signature)
        return f"{self.kind_name()} #{self.call} of generation {self.epoch} [{sig}]"


def signature(*values: int) -> Tuple[int, ...]:
    """The first SIG_INTS values (each as an int32), zero-padded."""
    vals = [int(v) & 0xFFFFFFFF for v in values[:SIG_INTS]]
    return tuple(_s32(v) for v in vals + [0] * (SIG_INTS - len(vals)))


def _s32(v: int) -> int:
    v &= 0xFFFFFFFF
    return v - (1 << 32) if v & 0x80000000 else v


def encode(tag: CallTag) -> List[int]:
    """TAG_INTS int32 values (as Python ints)."""
    raw = tag.reason.encode("utf-8", "replace")[:REASON_BYTES]
    words = [MAGIC, _s32(tag.epoch), _s32(tag.call), tag.kind, tag.status, tag.origin]
    words += list(signature(*tag.signature)) + [len(raw), 0]
    padded = raw + bytes(REASON_BYTES - len(raw))
    words += [_s32(int.from_bytes(padded[i:i + 4], "little")) for i in range(0, REASON_BYTES, 4)]
    return words


def clean_reason(raw: bytes) -> str:
    """A peer's reason text, made safe to print: decoded with replacement, control characters dropped."""
    text = raw.decode("utf-8", "replace")
    return "".join(ch if ch.isprintable() else " " for ch in text).strip()


def decode(words: Sequence[int], what: str, rank: int, peer: int, my_call: int, num_ranks: int) -> CallTag:
    """The peer's tag, or NormalCallMismatch when the words are not a well-formed tag (the exchange
    then paired with something else: nothing of it may be used)."""
    vals = [int(w) for w in words[:TAG_INTS]]

    def bad(why: str) -> NormalCallMismatch:
        return NormalCallMismatch(what, rank, peer, my_call, None, f"its record is not a call tag: {why}")
    if len(vals) < TAG_INTS:
        raise bad(f"{len(vals)} words, {TAG_INTS} expected")
    if vals[0] & 0xFFFFFFFF != MAGIC:
        raise bad(f"magic 0x{vals[0] & 0xFFFFFFFF:08x}")
    kind, status, origin, length = vals[3], vals[4], vals[5], vals[OFF_REASON_LEN]
    if kind not in KIND_NAMES:
        raise bad(f"kind {kind}")
    if status not in (STATUS_OK, STATUS_REFUSED, STATUS_PROXY, STATUS_NOTICE):
        raise bad(f"status {status}")
    if not -1 <= origin < num_ranks:
        raise bad(f"origin rank {origin} of {num_ranks}")
    if not 0 <= length <= REASON_BYTES:
        raise bad(f"reason length {length}")
    raw = b"".join((v & 0xFFFFFFFF).to_bytes(4, "little") for v in vals[OFF_REASON:TAG_INTS])[:length]
    return CallTag(epoch=vals[1] & 0xFFFFFFFF, call=vals[2] & 0xFFFFFFFF, kind=kind, status=status,
                   signature=tuple(vals[OFF_SIG:OFF_SIG + SIG_INTS]), origin=origin, reason=clean_reason(raw))


def verdict(what: str, rank: int, mine: CallTag, tags: Sequence[CallTag]) -> Optional[Exception]:
    """What every rank of an exchange concludes from the same table of tags (tags[r] = rank r's):
    NormalCallMismatch if some rank is at another call (generation, number, kind or signature; a NOTICE
    says so too), else PeerRefusedCall if some other rank's call is void, else None. Every rank sees the
    same table, so all of them raise at this call; each names its own call and the first peer at fault."""
    for peer, t in enumerate(tags):
        if peer == rank:
            continue
        if t.status == STATUS_NOTICE:
            return NormalCallMismatch(what, rank, peer, mine.call, t.call, f"rank {peer} found rank {rank} at "
                                      f"another call than its own #{t.call}")
        if (t.epoch, t.call) != (mine.epoch, mine.call):
            return NormalCallMismatch(what, rank, peer, f"{mine.call} (generation {mine.epoch})",
                                      f"{t.call} (generation {t.epoch})")
        if not t.void and not mine.void and (t.kind, t.signature) != (mine.kind, mine.signature):
            return NormalCallMismatch(what, rank, peer, mine.describe(), t.describe(),
                                      "the ranks made different calls or calls of different shapes")
    for peer, t in enumerate(tags):
        if peer != rank and t.void:
            origin = t.origin if t.status == STATUS_PROXY and t.origin >= 0 else peer
            return PeerRefusedCall(what, rank, origin, mine.call, t.reason or "(no reason given)",
                                   via=peer if origin != peer else None)
    return None
