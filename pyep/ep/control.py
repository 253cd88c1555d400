"""The EP buffer's control plane: how ranks exchange set-up data and wait for each other, on either

- a torch.distributed ProcessGroup (`GroupControl`: bounded collectives, as before), or
- a c10d Store plus (rank, world size) (`StoreControl`: every exchange is keys in the store).

The data path of the native backend needs no collectives, so a buffer built on a store survives the
death of a member: nothing it does later is a collective over a group that contains the dead rank.
Every wait here is bounded and, when it runs out, names the ranks whose keys never appeared.

Store keys live under `<prefix>/` (EpBuffer's `store_prefix`, one per buffer). Rounds of the initial
set-up are numbered (`boot/<n>/<what>/<rank>`): every rank makes the same rounds in the same order.
Membership keys (announcements, generations) are pyep.ep.elastic.membership's.
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Callable, List, Optional, Sequence

if TYPE_CHECKING:
    import torch.distributed as dist

log = logging.getLogger("pyep.ep.control")
MAX_PAYLOAD = 1 << 20
POLL_S = 0.002          # between store checks of a bounded wait


class ControlTimeout(TimeoutError):
    """A control-plane wait ran out; `missing` are the ranks it waited for in vain."""

    def __init__(self, what: str, missing: Sequence[int], timeout_s: float) -> None:
        self.missing = list(missing)
        super().__init__(f"{what}: ranks {self.missing} did not answer within {timeout_s:g} s")


def store_wait(store: Any, keys: Sequence[str], owners: Sequence[int], timeout_s: float, what: str,
               max_poll_s: float = POLL_S * 8) -> None:
    """Wait until every key exists (bounded); on timeout raise ControlTimeout naming the owners of the
    missing keys. Polls with check() rather than one blocking wait(): a blocking wait cannot say which
    keys were missing, and it holds the store's client connection. The poll interval backs off up to
    `max_poll_s` (the membership handshake keeps it short: it is how late a rank sees the release)."""
    deadline = time.monotonic() + timeout_s
    pending = list(zip(keys, owners))
    delay = min(POLL_S / 4, max_poll_s)
    while True:
        pending = [(k, o) for k, o in pending if not store.check([k])]
        if not pending:
            return
        if time.monotonic() > deadline:
            raise ControlTimeout(what, sorted({o for _, o in pending}), timeout_s)
        time.sleep(delay)
        delay = min(max_poll_s, delay * 2)


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
    """Control plane over a c10d Store (e.g. torchrun's or `pyep launch`'s TCPStore): keys only."""

    kind = "store"

    def __init__(self, store: Any, rank: int, world_size: int, prefix: str = "pyep/ep") -> None:
        for name, v in (("rank", rank), ("world_size", world_size)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"{name} must be an int, got {type(v).__name__}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a world of {world_size}")
        if not isinstance(prefix, str) or not prefix or any(c in prefix for c in " \n"):
            raise ValueError(f"store_prefix must be a non-empty string without blanks, got {prefix!r}")
        for attr in ("set", "get", "add", "check", "compare_set"):
            if not callable(getattr(store, attr, None)):
                raise TypeError(f"store must be a torch.distributed Store (no {attr}()), got {type(store).__name__}")
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.prefix = prefix.rstrip("/")
        self.group = None
        self._round = 0

    def key(self, *parts: Any) -> str:
        return "/".join([self.prefix, *[str(p) for p in parts]])

    def _next_round(self, what: str) -> str:
        self._round += 1
        return self.key("boot", self._round, what.replace("/", "_").replace(" ", "_")[:48])

    def gather_keys(self, base: str, ranks: Sequence[int], timeout_s: float, what: str) -> List[bytes]:
        keys = [f"{base}/{r}" for r in ranks]
        store_wait(self.store, keys, list(ranks), timeout_s, what)
        return [bytes(self.store.get(k)) for k in keys]

    def all_gather_bytes(self, payload: bytes, timeout_s: float, what: str) -> List[bytes]:
        if len(payload) > MAX_PAYLOAD:
            raise ValueError(f"{what}: payload of {len(payload)} bytes exceeds {MAX_PAYLOAD}")
        base = self._next_round(what)
        self.store.set(f"{base}/{self.rank}", bytes(payload))
        return self.gather_keys(base, range(self.world_size), timeout_s, what)

    def barrier(self, timeout_s: float, what: str) -> None:
        self.all_gather_bytes(b"1", timeout_s, what)

    def all_min(self, value: int, timeout_s: float, what: str) -> int:
        vals = self.all_gather_bytes(str(int(value)).encode(), timeout_s, what)
        return min(int(v.decode()) for v in vals)

    def shared_value(self, name: str, make: Callable[[], bytes], timeout_s: float) -> bytes:
        """A value the first rank to ask makes and every later caller -- a restarted rank included --
        receives (compare_set: set only where absent)."""
        key = self.key("shared", name)
        if self.store.check([key]):
            return bytes(self.store.get(key))
        got = self.store.compare_set(key, "", make())
        return bytes(got)


ControlPlane = Any   # GroupControl | StoreControl (duck-typed: rank, world_size, all_gather_bytes, ...)


def make_control(group: Optional["dist.ProcessGroup"], store: Any, rank: Optional[int],
                 world_size: Optional[int], prefix: str) -> ControlPlane:
    """The control plane EpBuffer runs on: a store when one is given, else the (default) group."""
    if store is not None:
        if group is not None:
            raise ValueError("pass either group= or store= (with rank= and world_size=), not both")
        if rank is None or world_size is None:
            raise ValueError("EpBuffer(store=...) needs rank= and world_size=")
        return StoreControl(store, rank, world_size, prefix)
    if rank is not None or world_size is not None:
        raise ValueError("rank= and world_size= go with store=; a group has its own")
    from ._dist import resolve_group
    return GroupControl(resolve_group(group))


def as_control(x: Any) -> ControlPlane:
    """Backends take a control plane; a bare ProcessGroup (the old contract) is wrapped."""
    if isinstance(x, (GroupControl, StoreControl)):
        return x
    return GroupControl(x)
