"""The EP buffer's control plane: how ranks exchange set-up data and wait for each other, on either

- a torch.distributed ProcessGroup (`GroupControl`: bounded collectives, as before), or
- a c10d Store plus (rank, world size) (`StoreControl`: every exchange is keys in the store).

The data path of the native backend needs no collectives, so a buffer built on a store survives the
death of a member: nothing it does later is a collective over a group that contains the dead rank.
Every wait here is bounded and, when it runs out, names the ranks whose keys never appeared.

Store keys live under `<prefix>/` (EpBuffer's `store_prefix`, one per buffer). Rounds of the initial
set-up are numbered (`boot/<n>/<what>/<rank>`): every rank makes the same rounds in the same order.
Membership keys (announcements, generations) are pyep.ep.elastic.membership's. Every value is an
authenticated record (pyep.ep.records; docs/elastic.md, "Threat model").
"""
from __future__ import annotations

import logging
import struct
import time
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from .errors import RecordRejected
from .records import Record, RecordCodec, RejectLog, resolve_job_secret

if TYPE_CHECKING:
    import torch.distributed as dist

log = logging.getLogger("pyep.ep.control")
MAX_PAYLOAD = 1 << 20
POLL_S = 0.002          # between store checks of a bounded wait
_INT = struct.Struct("<q")


class ControlTimeout(TimeoutError):
    """A control-plane wait ran out; `missing` are the ranks it waited for in vain, `refused` the keys
    whose records were there but refused (RecordRejected, in the reject log)."""

    def __init__(self, what: str, missing: Sequence[int], timeout_s: float, refused: Sequence[str] = ()) -> None:
        self.missing = list(missing)
        self.refused = list(refused)
        extra = (f"; the records at {self.refused} were refused (forged or malformed: see the reject log)"
                 if self.refused else "")
        super().__init__(f"{what}: ranks {self.missing} did not answer within {timeout_s:g} s{extra}")


class GroupControl:
    """Control plane over a ProcessGroup (bounded collectives; pyep.ep._dist)."""

    kind = "group"

    def __init__(self, group: "dist.ProcessGroup") -> None:
        import torch.distributed as dist
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.store: Any = None

    def all_gather_bytes(self, payload: bytes, timeout_s: float, what: str) -> List[bytes]:
        from ._dist import all_gather_bytes
        return all_gather_bytes(self.group, payload, timeout_s, what)

    def barrier(self, timeout_s: float, what: str) -> None:
        from ._dist import barrier_bounded, group_device
        barrier_bounded(self.group, group_device(self.group), int(timeout_s * 1e6), what)

    def all_min(self, value: int, timeout_s: float, what: str) -> int:
        import torch

        from ._dist import all_reduce_min_bounded, group_device
        t = torch.tensor([int(value)], dtype=torch.int64, device=group_device(self.group))
        all_reduce_min_bounded(t, self.group, int(timeout_s * 1e6), what)
        return int(t.item())

    def shared_value(self, name: str, make: Callable[[], bytes], timeout_s: float) -> bytes:
        """A value rank 0 makes and every rank receives."""
        mine = make() if self.rank == 0 else b""
        return self.all_gather_bytes(mine, timeout_s, f"shared value {name!r}")[0]


class StoreControl:
    """Control plane over a c10d Store (e.g. torchrun's or `pyep launch`'s TCPStore): keys only. Every
    value is a record of pyep.ep.records, sealed with the job secret; a value that fails to open is
    refused, logged in `rejects`, and treated as absent -- it can delay a wait, never feed it data.
    No key is ever incremented with store.add: a forged non-integer value makes the store server drop
    the adding client's connection, and a forged count cannot be authenticated."""

    kind = "store"
    MAX_PAYLOAD = MAX_PAYLOAD

    def __init__(self, store: Any, rank: int, world_size: int, prefix: str = "pyep/ep",
                 job_secret: Optional[bytes] = None) -> None:
        for name, v in (("rank", rank), ("world_size", world_size)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"{name} must be an int, got {type(v).__name__}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a world of {world_size}")
        if not isinstance(prefix, str) or not prefix or any(c in prefix for c in " \n"):
            raise ValueError(f"store_prefix must be a non-empty string without blanks, got {prefix!r}")
        for attr in ("set", "get", "check", "compare_set"):
            if not callable(getattr(store, attr, None)):
                raise TypeError(f"store must be a torch.distributed Store (no {attr}()), got {type(store).__name__}")
        self.codec = RecordCodec(resolve_job_secret(job_secret))
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.prefix = prefix.rstrip("/")
        self.group = None
        self._round = 0
        self.rejects = RejectLog()
        # This process's membership generation and the one it knows for every rank (the membership
        # shares its list of admitted generations here): records are sealed with the first and, where
        # a reader asks for `current`, must come from the second.
        self.generation = 1
        self.generations: List[int] = [1] * world_size

    def key(self, *parts: Any) -> str:
        return "/".join([self.prefix, *[str(p) for p in parts]])

    def subgroup(self, name: str, rank: int, world_size: int) -> "StoreControl":
        """A control plane for `world_size` of this job's processes (the ranks of one node, say) under
        prefix/name: the same store and job secret, its own keys, rounds and generations."""
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"subgroup {name!r}: rank {rank} is outside a world of {world_size}")
        if not name or any(c in name for c in " \n/"):
            raise ValueError(f"subgroup name must be a non-empty key part without blanks or '/', got {name!r}")
        sub = StoreControl.__new__(StoreControl)
        sub.codec, sub.store, sub.group = self.codec, self.store, None
        sub.rank, sub.world_size, sub.prefix = rank, world_size, self.key(name)
        sub._round, sub.rejects = 0, RejectLog()
        sub.generation, sub.generations = 1, [1] * world_size
        return sub

    def _next_round(self, what: str) -> str:
        self._round += 1
        return self.key("boot", self._round, what.replace("/", "_").replace(" ", "_")[:48])

    # ------------------------------------------------------------------ records
    def seal(self, key: str, payload: bytes, call: int = 0, generation: Optional[int] = None) -> bytes:
        return self.codec.seal(key, self.rank, self.generation if generation is None else generation, call, payload)

    def put(self, key: str, payload: bytes, call: int = 0) -> None:
        self.store.set(key, self.seal(key, payload, call))

    def open(self, key: str, raw: Any, writers: Iterable[int], max_payload: int, *, generation: Optional[int] = None,
             current: bool = False, call: Optional[int] = None,
             check: Optional[Callable[[Record], None]] = None) -> Optional[Record]:
        """The record in `raw`, or None when it is refused (logged). `current`: the writer's generation
        must be the one this process knows for it (not a dead process's record). `check`: the payload's
        own rules (sizes, ranges), raising RecordRejected."""
        try:
            rec = self.codec.open(key, raw, max_payload, writers, generation, call)
            if current and rec.generation != self.generations[rec.writer]:
                raise RecordRejected(key, f"written by generation {rec.generation} of rank {rec.writer}; its "
                                          f"current generation is {self.generations[rec.writer]}")
            if check is not None:
                check(rec)
            return rec
        except RecordRejected as exc:
            self.rejects.add(exc, raw)
            return None

    def fetch(self, key: str, writers: Iterable[int], max_payload: int, **expect: Any) -> Optional[Record]:
        """The record at `key`; None when there is none or it is refused."""
        if not self.store.check([key]):
            return None
        return self.open(key, self.store.get(key), writers, max_payload, **expect)

    def wait_records(self, keys: Sequence[str], owners: Sequence[int], timeout_s: float, what: str, max_payload: int,
                     max_poll_s: float = POLL_S * 8, **expect: Any) -> List[Record]:
        """Wait (bounded) until every key holds a valid record written by its owner; on timeout raise
        ControlTimeout naming the owners still missing (and the keys whose records were refused). Polls
        with check() rather than one blocking wait(): a blocking wait cannot say which keys were missing,
        and it holds the store's client connection. The poll interval backs off up to `max_poll_s` (the
        membership handshake keeps it short: it is how late a rank sees the release)."""
        deadline = time.monotonic() + timeout_s
        got: Dict[str, Record] = {}
        pending = list(zip(keys, owners))
        refused: List[str] = []
        delay = min(POLL_S / 4, max_poll_s)
        while True:
            left = []
            for k, o in pending:
                rec = self.fetch(k, (o,), max_payload, **expect)
                if rec is None:
                    left.append((k, o))
                else:
                    got[k] = rec
            pending = left
            if not pending:
                return [got[k] for k in keys]
            if time.monotonic() > deadline:
                refused = [k for k, _ in pending if k in set(self.rejects.keys())]
                raise ControlTimeout(what, sorted({o for _, o in pending}), timeout_s, refused)
            time.sleep(delay)
            delay = min(max_poll_s, delay * 2)

    def claim(self, key: str, payload: bytes, writers: Iterable[int], max_payload: int, tries: int = 8,
              **expect: Any) -> Tuple[Optional[Record], bool]:
        """Set `key` to our record unless it holds a valid one already (compare_set: one winner among
        the ranks). A value that is not a valid record (`expect` as for open) is replaced. Returns (the
        record the key holds, whether it is ours); (None, False) when a writer kept replacing it with
        invalid values."""
        writers = tuple(writers)
        mine = self.seal(key, payload, generation=expect.get("generation"))
        expected = b""
        for _ in range(tries):
            cur = bytes(self.store.compare_set(key, expected, mine))
            if cur == mine:
                return self.codec.open(key, mine, max_payload), True
            rec = self.open(key, cur, writers, max_payload, **expect)
            if rec is not None:
                return rec, False
            # compare_set on a missing key returns `expected` unchanged: look before trying again.
            expected = cur if self.store.check([key]) else b""
        return None, False

    # ------------------------------------------------------------------ the set-up exchanges
    def all_gather_bytes(self, payload: bytes, timeout_s: float, what: str) -> List[bytes]:
        if len(payload) > MAX_PAYLOAD:
            raise ValueError(f"{what}: payload of {len(payload)} bytes exceeds {MAX_PAYLOAD}")
        base = self._next_round(what)
        self.put(f"{base}/{self.rank}", bytes(payload), call=self._round)
        ranks = range(self.world_size)
        recs = self.wait_records([f"{base}/{r}" for r in ranks], list(ranks), timeout_s, what, MAX_PAYLOAD,
                                 current=True, call=self._round)
        return [r.payload for r in recs]

    def barrier(self, timeout_s: float, what: str) -> None:
        self.all_gather_bytes(b"", timeout_s, what)

    def all_min(self, value: int, timeout_s: float, what: str) -> int:
        raws = self.all_gather_bytes(_INT.pack(int(value)), timeout_s, what)
        vals = []
        for r, raw in enumerate(raws):
            if len(raw) != _INT.size:
                raise RecordRejected(f"{what} (rank {r})", f"holds {len(raw)} bytes, expected a {_INT.size}-byte int")
            vals.append(_INT.unpack(raw)[0])
        return min(vals)

    def shared_value(self, name: str, make: Callable[[], bytes], timeout_s: float) -> bytes:
        """A value the first rank to ask makes and every later caller -- a restarted rank included --
        receives (compare_set: set only where absent; an invalid value there is replaced)."""
        key = self.key("shared", name)
        rec = self.fetch(key, range(self.world_size), MAX_PAYLOAD)
        deadline = time.monotonic() + timeout_s
        value = make() if rec is None else b""
        while rec is None:
            rec, _ = self.claim(key, value, range(self.world_size), MAX_PAYLOAD)
            if rec is None and time.monotonic() > deadline:
                raise RecordRejected(key, f"shared value {name!r}: the key kept holding invalid records for "
                                          f"{timeout_s:g} s (see the reject log)")
            if rec is None:
                time.sleep(POLL_S)
        return rec.payload


ControlPlane = Any   # GroupControl | StoreControl (duck-typed: rank, world_size, all_gather_bytes, ...)


def make_control(group: Optional["dist.ProcessGroup"], store: Any, rank: Optional[int],
                 world_size: Optional[int], prefix: str, job_secret: Optional[bytes] = None) -> ControlPlane:
    """The control plane EpBuffer runs on: a store when one is given, else the (default) group. A
    store-based one needs the job secret (the argument or the environment: pyep.ep.records)."""
    if store is not None:
        if group is not None:
            raise ValueError("pass either group= or store= (with rank= and world_size=), not both")
        if rank is None or world_size is None:
            raise ValueError("EpBuffer(store=...) needs rank= and world_size=")
        return StoreControl(store, rank, world_size, prefix, job_secret)
    if rank is not None or world_size is not None:
        raise ValueError("rank= and world_size= go with store=; a group has its own")
    if job_secret is not None:
        raise ValueError("job_secret= goes with store=: a buffer on a process group exchanges nothing through a store")
    from ._dist import resolve_group
    return GroupControl(resolve_group(group))


def as_control(x: Any) -> ControlPlane:
    """Backends take a control plane; a bare ProcessGroup (the old contract) is wrapped."""
    if isinstance(x, (GroupControl, StoreControl)):
        return x
    return GroupControl(x)
