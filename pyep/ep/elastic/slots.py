"""Numbered slots in the store, claimed with compare_set, where the membership used to count with
store.add: generations (`gen/<r>/<g>`) and the announcement index (`annidx/<i>`).

A counter cannot carry a MAC, and store.add on a value a forger made non-integer makes the store server
drop the adding client's connection; so nothing here is a counter. A process claims the first free
slot with compare_set (one winner), and the slot holds its authenticated record (pyep.ep.records):

- generation g of rank r is the slot gen/<r>/<g> holding a record of rank r. A slot holding anything
  else (a forgery) is taken over, so a forger can neither make a first process look restarted nor
  push the generations up.
- the i-th announcement is the slot annidx/<i> holding the newcomer's record (writer r, generation g).
  Survivors read the slots in order, each once; so a forged slot is skipped, never taken over (a
  survivor that skipped it would not read it again), and the newcomer claims the next empty one.
  compare_set counts an empty value as absent, so survivors stop at one too (a newcomer may take it).
Every scan is bounded: a forger filling slots delays, and never changes who is a member.
"""
from __future__ import annotations

import secrets
import time
from typing import TYPE_CHECKING, List, Tuple

from ..errors import MembershipError

if TYPE_CHECKING:
    from ..control import StoreControl

SLOT_PAYLOAD = 16          # a claim's payload: a random nonce (two claims never look alike)
MAX_SCAN = 64              # slots one look at a rank's generations reads
INDEX_PER_POLL = 16        # announcement slots one survivor poll reads
MAX_INDEX_SLOTS = 1 << 16


def claim_generation(c: "StoreControl", timeout_s: float) -> int:
    """This process's generation: the first slot of its rank that no earlier process of it holds."""
    r = c.rank
    deadline = time.monotonic() + timeout_s
    g = 1
    while True:
        rec, mine = c.claim(c.key("gen", r, g), secrets.token_bytes(SLOT_PAYLOAD), (r,), SLOT_PAYLOAD, generation=g)
        if mine:
            return g
        if rec is not None:
            g += 1                      # an earlier process of this rank
        elif time.monotonic() > deadline:
            raise MembershipError(f"rank {r}: generation slot {c.key('gen', r, g)} kept holding invalid records for "
                                  f"{timeout_s:g} s (see the reject log); cannot take a generation")
        else:
            time.sleep(0.002)           # another writer keeps replacing the slot: try again shortly


def newest_generation(c: "StoreControl", r: int, known: int) -> int:
    """The newest generation rank r has claimed, at least `known` (read from known + 1 up to the first
    empty slot; forged slots are skipped)."""
    newest = known
    for g in range(known + 1, known + 1 + MAX_SCAN):
        key = c.key("gen", r, g)
        if not c.store.check([key]):
            break
        if c.fetch(key, (r,), SLOT_PAYLOAD, generation=g) is not None:
            newest = g
    return newest


def claim_index_slot(c: "StoreControl", timeout_s: float) -> int:
    """The newcomer's announcement slot: the first empty one (forged ones are left to the survivors
    to skip). Returns its number."""
    deadline = time.monotonic() + timeout_s
    for i in range(1, MAX_INDEX_SLOTS + 1):
        key = c.key("annidx", i)
        mine = c.seal(key, secrets.token_bytes(SLOT_PAYLOAD))
        if bytes(c.store.compare_set(key, b"", mine)) == mine:
            return i
        if time.monotonic() > deadline:
            break
    raise MembershipError(f"rank {c.rank}: no free announcement slot under {c.key('annidx')} within {timeout_s:g} s "
                          f"(slots filled by another writer: see the reject log)")


def read_index(c: "StoreControl", seen: int) -> Tuple[int, List[Tuple[int, int]]]:
    """Announcements after slot `seen`: (the new `seen`, [(rank, generation)] of the valid ones)."""
    found: List[Tuple[int, int]] = []
    others = [s for s in range(c.world_size) if s != c.rank]
    for _ in range(INDEX_PER_POLL):
        key = c.key("annidx", seen + 1)
        if not c.store.check([key]):
            break
        raw = bytes(c.store.get(key))
        if not raw:
            break                       # compare_set takes an empty value as absent: a newcomer may claim it
        seen += 1
        rec = c.open(key, raw, others, SLOT_PAYLOAD)
        if rec is not None:
            found.append((rec.writer, rec.generation))
    return seen, found
