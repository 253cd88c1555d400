"""Elastic membership of a store-based EpBuffer: a killed rank is survived, restarted and re-admitted,
and only the links to it are rebuilt (docs/elastic.md is the protocol; this is its implementation).

Keys (under the buffer's store prefix; every value an authenticated record, pyep.ep.records):
    gen/<r>/<g>             slot: held by the process of rank r that has generation g (1 = first
                            process; a restarted process claims the next free slot: slots.py)
    ann/<r>/<g>             rank r's announcement for generation g (Announcement, validated by peers)
    annidx/<i>              slot: the i-th announcement, written by its newcomer (writer r, generation g)
    reject/<r>/<g>          why a survivor refused the announcement (the newcomer raises it)
    blob/<r>/<g>/<s>        survivor s's connect data for the newcomer (its new QPs towards r, ...)
    prepared/<r>/<g>/<s>    survivor s rebuilt its links to r and cleared r's stale signals
    at/<r>/<g>              (A, H): the newcomer's first dispatch is call #A, on buffer half H; set
                            once (compare_set) by the first survivor that sees every `prepared`
    act/<r>/<g>/<s>         survivor s is at call #A with r active and its stream drained (call A)
    ready/<r>/<g>           the newcomer saw every act key; its first dispatch follows (call A)

Every wait is bounded and names the ranks it waited for; survivors never block on a newcomer except
for the bounded handshake at call #A.
"""
from __future__ import annotations

import base64
import json
import logging
import struct
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, List, Optional

from ..control import ControlTimeout, StoreControl
from ..errors import BadAnnouncement, MembershipError, RecordRejected, StaleAnnouncement
from ..records import Record, unpack
from .slots import claim_generation, claim_index_slot, newest_generation, read_index

if TYPE_CHECKING:
    import torch

log = logging.getLogger("pyep.ep.elastic.membership")
FORMAT = "pyep-member/1"
MAX_ANNOUNCEMENT = 1 << 20
MAX_REJECT = 4096
MAX_ACT = 4096          # an act record's payload (the normal mode: counters and a mask)
_AT = struct.Struct("<QB")      # call #A, buffer half
DEFAULT_LEAD_CALLS = 8
# Call #A (the newcomer's first call) waits at least this long on every member (EpBuffer._rejoin_timeout).
REJOIN_CALL_TIMEOUT_US = 2_000_000
# ... and so do the calls after it, up to #A + REJOIN_GRACE_CALLS - 1 (docs/elastic.md, "The grace
# window"): the newcomer's first iterations run cold host code (first device-to-host copies, first
# uses of CPU operators and allocators), so it can start one of them more than a timeout after the
# survivors, who would mark it, and it would mark them back in the combine.
REJOIN_GRACE_CALLS = 16
# The handshake at call #A polls the store this often, without backing off: it releases the members, and
# how far apart they see the release is how far apart they start call #A.
HANDSHAKE_POLL_S = 0.0005


@dataclass(frozen=True)
class Announcement:
    rank: int
    world_size: int
    generation: int
    fingerprint: str           # the buffer's shape, transport and backend: must equal the survivors'
    backend: str
    payload: bytes             # backend-specific connect data (native: RankInfo + NIC endpoint)

    def encode(self) -> bytes:
        return json.dumps({"format": FORMAT, "rank": self.rank, "world_size": self.world_size,
                           "generation": self.generation, "fingerprint": self.fingerprint,
                           "backend": self.backend, "payload": base64.b64encode(self.payload).decode()},
                          separators=(",", ":")).encode()


def buffer_fingerprint(config: Any, num_ranks: int) -> str:
    """What must be equal between a restarted rank's buffer and the survivors' (shape, transport)."""
    return (f"{config.describe_shape(num_ranks)} transport={config.transport} nvlink={config.allow_nvlink} "
            f"qps={config.num_qps_per_peer} rpn={config.ranks_per_node} bytes={config.num_buffer_bytes}")


def decode_announcement(raw: Any, expect_rank: int, world_size: int, fingerprint: str, backend: str,
                        newest_generation: int, admitted_generation: int) -> Announcement:
    """Parse and check an announcement that arrived as rank `expect_rank`'s. Raises BadAnnouncement
    (malformed, another job's shape) or StaleAnnouncement (not the newest generation, or one that is
    already a member) with a message naming the rank and the field."""
    who = f"rejoin announcement of rank {expect_rank}"
    if not isinstance(raw, (bytes, bytearray)) or len(raw) > MAX_ANNOUNCEMENT:
        raise BadAnnouncement(f"{who}: not a byte string of at most {MAX_ANNOUNCEMENT} bytes")
    try:
        doc = json.loads(bytes(raw).decode("utf-8"))
    except (ValueError, RecursionError) as exc:     # UnicodeDecodeError, JSONDecodeError, nesting
        why = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        raise BadAnnouncement(f"{who}: not a pyep membership document ({why})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        got = doc.get("format") if isinstance(doc, dict) else doc
        raise BadAnnouncement(f"{who}: field 'format' is {repr(got)[:80]}, expected {FORMAT!r}")
    for name in ("rank", "world_size", "generation"):
        v = doc.get(name)
        if isinstance(v, bool) or not isinstance(v, int):
            raise BadAnnouncement(f"{who}: field {name!r} must be an integer, got {v!r}")
    for name in ("fingerprint", "backend", "payload"):
        if not isinstance(doc.get(name), str):
            raise BadAnnouncement(f"{who}: field {name!r} must be a string")
    if doc["rank"] != expect_rank:
        raise BadAnnouncement(f"{who}: field 'rank' is {doc['rank']}: the key belongs to rank {expect_rank}")
    if doc["world_size"] != world_size:
        raise BadAnnouncement(f"{who}: field 'world_size' is {doc['world_size']}, this job has {world_size}")
    if doc["backend"] != backend:
        raise BadAnnouncement(f"{who}: backend {doc['backend']!r}, the survivors run {backend!r}")
    if doc["fingerprint"] != fingerprint:
        raise BadAnnouncement(f"{who}: buffer {doc['fingerprint']!r} differs from the survivors' {fingerprint!r}")
    gen = doc["generation"]
    if gen <= admitted_generation:
        raise StaleAnnouncement(f"{who}: generation {gen} is already a member (admitted generation "
                                f"{admitted_generation}); a restarted process announces a newer one")
    if gen != newest_generation:
        raise StaleAnnouncement(f"{who}: generation {gen} is stale: the newest process of rank {expect_rank} "
                                f"has generation {newest_generation}")
    try:
        payload = base64.b64decode(doc["payload"].encode(), validate=True)
    except ValueError:
        raise BadAnnouncement(f"{who}: field 'payload' is not base64") from None
    return Announcement(expect_rank, world_size, gen, doc["fingerprint"], doc["backend"], payload)


@dataclass
class _Pending:
    """A newcomer this survivor knows about."""
    rank: int
    generation: int
    announcement: Announcement
    stage: str = "announced"        # announced -> rebuilt -> counted -> (admitted)
    at: Optional[int] = None        # call #A
    half: Optional[int] = None
    since: float = field(default_factory=time.monotonic)


@dataclass(frozen=True)
class Rejoin:
    """What poll_rejoin() reports about one newcomer."""
    rank: int
    generation: int
    stage: str
    at_call: Optional[int]


class Membership:
    """The membership protocol of one store-based EpBuffer (both the survivor and the newcomer side).
    `backend` provides member_payload(), prepare_peer(r, payload) -> bytes, prepare_done(r) -> bool,
    activate_peer(r, active), join(blobs, half) and next_half(seq_next) (docs/elastic.md). Every
    store value it reads is an authenticated record (pyep.ep.records); one that is refused is logged in
    the control's reject log and counts as absent."""

    def __init__(self, control: StoreControl, fingerprint: str, timeout_s: float,
                 lead_calls: int = DEFAULT_LEAD_CALLS) -> None:
        self.c = control
        self.store = control.store
        self.backend: Any = None
        self.fingerprint = fingerprint
        self.timeout_s = timeout_s
        self.lead_calls = lead_calls
        self.rank, self.world = control.rank, control.world_size
        self.generation = claim_generation(control, timeout_s)
        control.generation = self.generation
        self.admitted: List[int] = [1] * self.world
        self.admitted[self.rank] = self.generation
        if self.generation > 1:
            # A restarted process: the survivors' current processes (their records, member/info
            # included, must come from them, not from a process of theirs that died before).
            self.admitted = [self.generation if s == self.rank else newest_generation(control, s, 1)
                             for s in range(self.world)]
        control.generations = self.admitted      # the same list: record checks follow admissions
        self._seen = 0
        self._pending: Dict[int, _Pending] = {}
        self._joined = self.generation == 1
        self.act_payloads: Dict[int, bytes] = {}     # survivor -> its act payload (newcomer, after join)

    def attach(self, backend: Any) -> None:
        self.backend = backend
        setter = getattr(backend, "set_generations", None)
        if setter is not None:
            setter(self.admitted)       # the same list: the mailbox keys follow admissions

    @property
    def joining(self) -> bool:
        return not self._joined

    @property
    def rejected(self) -> List[str]:
        """Why records and announcements were refused (the control's reject log), oldest first."""
        return [str(e) for e in self.c.rejects.entries]

    def k(self, *parts: Any) -> str:
        return self.c.key(*parts)

    def _others(self, r: int) -> List[int]:
        return [s for s in range(self.world) if s != r]

    # ------------------------------------------------------------------ survivor side
    def poll(self, next_call: int, lead_calls: Optional[int] = None) -> List[Rejoin]:
        """Non-blocking: read new announcements, rebuild links for them, count this survivor as
        prepared when its stale-signal clear has completed, and learn call #A. One store round trip
        when nothing is going on."""
        self._seen, found = read_index(self.c, self._seen)
        for r, g in found:
            self._consider(r, g)
        lead = self.lead_calls if lead_calls is None else lead_calls
        for p in list(self._pending.values()):
            self._advance(p, next_call, lead)
        return [Rejoin(p.rank, p.generation, p.stage, p.at) for p in self._pending.values()]

    def _consider(self, r: int, g: int) -> None:
        if r == self.rank or not 0 <= r < self.world:
            return
        # Only an authentic announcement gets an answer: a refusal written for a forged one would make
        # the real newcomer of that generation give up.
        rec = self.c.fetch(self.k("ann", r, g), (r,), MAX_ANNOUNCEMENT, generation=g)
        if rec is None:
            return
        newest = newest_generation(self.c, r, self.admitted[r])
        try:
            ann = decode_announcement(rec.payload, r, self.world, self.fingerprint, self.backend.name, newest,
                                      self.admitted[r])
            if ann.generation != g:
                raise BadAnnouncement(f"rejoin announcement of rank {r}: field 'generation' is {ann.generation}, "
                                      f"its record is generation {g}'s")
        except BadAnnouncement as exc:
            self._refuse(r, g, exc)
            return
        old = self._pending.get(r)
        if old is not None and old.generation >= g:
            return
        log.warning("rank %d: rank %d announced generation %d (rejoin); rebuilding only its links",
                    self.rank, r, g)
        self._pending[r] = _Pending(r, g, ann)

    def _refuse(self, r: int, g: int, exc: Exception) -> None:
        msg = f"rank {self.rank} refused: {exc}"
        self.c.rejects.add(RecordRejected(self.k("ann", r, g), msg))
        self.c.put(self.k("reject", r, g), msg.encode()[:MAX_REJECT])

    def _advance(self, p: _Pending, next_call: int, lead: int) -> None:
        if p.stage == "announced":
            try:
                blob = self.backend.prepare_peer(p.rank, p.announcement.payload)
            except BadAnnouncement as exc:
                self._refuse(p.rank, p.generation, exc)
                del self._pending[p.rank]
                return
            self.c.put(self.k("blob", p.rank, p.generation, self.rank), blob)
            p.stage = "rebuilt"
        if p.stage == "rebuilt" and self.backend.prepare_done(p.rank):
            self.c.put(self.k("prepared", p.rank, p.generation, self.rank), b"")
            p.stage = "counted"
        if p.stage == "counted" and p.at is None:
            self._learn_at(p, next_call, lead)

    def _learn_at(self, p: _Pending, next_call: int, lead: int) -> None:
        """Call #A: read it, or -- once every survivor is prepared -- pick it. The first survivor to see
        them all picks call #A far enough ahead that every survivor, polling once per call, learns it
        before it gets there; compare_set makes its pick the only one."""
        key = self.k("at", p.rank, p.generation)
        survivors = self._others(p.rank)
        rec = self.c.fetch(key, survivors, _AT.size, current=True, check=_check_at)
        if rec is None:
            keys = [self.k("prepared", p.rank, p.generation, s) for s in survivors]
            if not all(self.c.fetch(k, (s,), 0, current=True) is not None for k, s in zip(keys, survivors)):
                return
            at = next_call + lead
            rec, _ = self.c.claim(key, _AT.pack(at, self.backend.next_half(next_call, at)), survivors, _AT.size,
                                  current=True, check=_check_at)
            if rec is None:
                return
        p.at, p.half = _AT.unpack(rec.payload)

    def due(self, next_call: int) -> List[int]:
        """Ranks whose call #A is the next call (activate them now); raises when one was missed."""
        out = []
        for p in self._pending.values():
            if p.at is None:
                continue
            if p.at < next_call:
                raise MembershipError(f"rank {self.rank}: rank {p.rank} (generation {p.generation}) was to join at "
                                      f"call #{p.at}, but this buffer is already at call #{next_call}: poll_rejoin() / "
                                      f"admit_pending() must run before every dispatch while a rejoin is pending")
            if p.at == next_call:
                out.append(p.rank)
        return out

    def activate(self, r: int, next_call: int, active: Optional["torch.Tensor"], payload: bytes = b"") -> None:
        """At call #A: the backend drains its stream and marks r active; then the handshake. `payload`
        (at most MAX_ACT bytes) rides in the act record: what the newcomer takes from the survivors
        (the normal mode's call counters and mask)."""
        p = self._pending[r]
        expect = self.backend.next_half(next_call, next_call)
        if p.half is not None and expect is not None and expect != p.half:
            raise MembershipError(f"rank {self.rank}: at call #{next_call} this buffer uses half {expect}, the "
                                  f"agreed half is {p.half}: the survivors' call sequences differ")
        self.backend.activate_peer(r, active)
        self.c.put(self.k("act", r, p.generation, self.rank), payload[:MAX_ACT], call=next_call)
        self.c.wait_records([self.k("ready", r, p.generation)], [r], self.timeout_s,
                            f"rank {self.rank} admitting rank {r} (generation {p.generation}) at call #{next_call}",
                            0, max_poll_s=HANDSHAKE_POLL_S, generation=p.generation, call=next_call)
        self.admitted[r] = p.generation
        del self._pending[r]
        log.warning("rank %d: rank %d (generation %d) admitted at call #%d", self.rank, r, p.generation, next_call)

    def abandon(self, r: int) -> None:
        """Forget rank r's pending rejoin (its newcomer never confirmed call #A): a newer process of r
        announces again."""
        self._pending.pop(r, None)

    # ------------------------------------------------------------------ newcomer side
    def announce(self) -> None:
        ann = Announcement(self.rank, self.world, self.generation, self.fingerprint, self.backend.name,
                           self.backend.member_payload())
        self.c.put(self.k("ann", self.rank, self.generation), ann.encode())
        # Announcements before our slot are older than this process: not ours to answer.
        self._seen = claim_index_slot(self.c, self.timeout_s)
        log.warning("rank %d: announced generation %d (rejoin), waiting to be admitted", self.rank, self.generation)

    def join(self, timeout_s: float, take_acts: Optional[Callable[[Dict[int, bytes]], None]] = None) -> int:
        """Wait (bounded) until the survivors admit us; returns call #A, the number our next dispatch
        carries. Raises the survivors' refusal, or ControlTimeout naming the survivors that are late.
        `take_acts` (the survivors' act payloads) runs before our ready record: a survivor launches its
        call #A as soon as it reads that record, and its first writes into our buffer (the normal mode's
        gate flags) must find the state it takes from them already in place, never be overwritten by it."""
        r, g = self.rank, self.generation
        others = self._others(r)
        deadline = time.monotonic() + timeout_s
        at_key = self.k("at", r, g)
        at: Optional[int] = None
        half = 0
        while at is None:
            rec = self.c.fetch(at_key, others, _AT.size, current=True, check=_check_at)
            if rec is not None:
                at, half = _AT.unpack(rec.payload)
                break
            rej = self.c.fetch(self.k("reject", r, g), others, MAX_REJECT, current=True)
            if rej is not None:
                raise BadAnnouncement(rej.payload.decode("utf-8", errors="replace"))
            if time.monotonic() > deadline:
                done = [s for s in others if self.store.check([self.k("blob", r, g, s)])]
                raise ControlTimeout(f"rank {r} (generation {g}) waiting to be admitted (no survivor may be "
                                     f"polling: poll_rejoin() / admit_pending() / update_ep_member())",
                                     [s for s in others if s not in done], timeout_s,
                                     [k for k in self.c.rejects.keys() if k.startswith(self.k("at", r, g))])
            time.sleep(0.005)
        left = max(1.0, deadline - time.monotonic())
        recs = self.c.wait_records([self.k("blob", r, g, s) for s in others], others, left,
                                   f"rank {r} (generation {g}) reading the survivors' connect data",
                                   MAX_ANNOUNCEMENT, current=True)
        blobs = {s: rec.payload for s, rec in zip(others, recs)}
        for s in others:
            self.admitted[s] = newest_generation(self.c, s, self.admitted[s])
        self.backend.join(blobs, half)
        left = max(1.0, deadline - time.monotonic())
        acts = self.c.wait_records([self.k("act", r, g, s) for s in others], others, left,
                                   f"rank {r} (generation {g}) waiting for the survivors to reach call #{at}",
                                   MAX_ACT, max_poll_s=HANDSHAKE_POLL_S, current=True, call=at)
        self.act_payloads = {s: rec.payload for s, rec in zip(others, acts)}
        if take_acts is not None:
            take_acts(self.act_payloads)
        self.c.put(self.k("ready", r, g), b"", call=at)
        self._joined = True
        log.warning("rank %d: admitted (generation %d); first call #%d on half %d", r, g, at, half)
        return at


def _check_at(rec: Record) -> None:
    """An `at` record holds (call #A, half): one call number and half 0 or 1."""
    at, half = unpack(rec, _AT)
    if not 1 <= at < 1 << 62 or half not in (0, 1):
        raise RecordRejected(rec.key, f"call #{at} / half {half} out of range")


class MemberView:
    """What a buffer (LL or normal mode) says of its own membership: the properties both buffers' mixins
    share. The buffer holds `_member` (a Membership, or None on a process group) and `_control`."""

    _member: Optional["Membership"]
    _control: Any

    @property
    def generation(self) -> int:
        """This process's membership generation (store-based buffers: 1 for a first process, +1 per
        restart of the rank); 0 for a buffer on a process group."""
        return self._member.generation if self._member is not None else 0

    @property
    def joining(self) -> bool:
        """A restarted rank that has not been admitted yet (call join())."""
        return self._member is not None and self._member.joining

    @property
    def rejected_records(self) -> List[Any]:
        """Store records this buffer refused (pyep.ep.errors.RecordRejected, each naming its key; the
        newest REJECT_LOG_SIZE): forged, malformed or stale. Empty for a buffer on a process group."""
        rejects = getattr(self._control, "rejects", None)
        return rejects.entries if rejects is not None else []

    def _wait_admitted(self, expect: List[int], admit_once: Callable[[], Iterable[int]], rank: int) -> None:
        """update_ep_member's bounded wait: admit_once() (which admits whoever is due and returns them)
        until every rank of `expect` is admitted; ControlTimeout naming the others after the
        membership's timeout."""
        member = self._member
        assert member is not None
        deadline = time.monotonic() + member.timeout_s
        left = set(expect)
        while left:
            left.difference_update(admit_once())
            if left and time.monotonic() > deadline:
                raise ControlTimeout(f"rank {rank} update_ep_member: waiting for restarted ranks to announce "
                                     f"themselves", sorted(left), member.timeout_s)
            if left:
                time.sleep(0.002)
