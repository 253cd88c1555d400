"""Elastic membership on CPU (issue 12): the store-based control plane (bootstrap, bounded waits that
name the missing ranks, a peer killed mid-exchange), membership generations, announcements that are
malformed or stale (rejected with a clear error), and whole drills with the reference backend in which
a real process is SIGKILLed in the middle of dispatch, of combine and between calls, restarted, and
re-admitted while the survivors keep going (pyep drill)."""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
from typing import Any, Callable, Dict, List

import pytest

from pyep.ep.control import ControlTimeout, StoreControl
from store_util import client_store, master_store, run_threads
from pyep.ep.elastic.membership import (Announcement, BadAnnouncement, StaleAnnouncement, buffer_fingerprint,
                                        decode_announcement)

SECRET = b"elastic-store-test-secret-0123456789"


def _master() -> Any:
    return master_store(30.0)


def _client(port: int) -> Any:
    return client_store(port, 30.0)


def _threads(world: int, fn: Callable[[int], Any], timeout_s: float = 60.0) -> List[Any]:
    return run_threads([lambda r=r: fn(r) for r in range(world)], timeout_s)


# ---------------------------------------------------------------------------------------- control plane
def test_store_all_gather_and_shared_value() -> None:
    master = _master()

    def rank(r: int) -> Any:
        c = StoreControl(_client(master.port), r, 3, "t/gather", SECRET)
        got = c.all_gather_bytes(f"rank{r}".encode(), 10.0, "test round")
        again = c.all_gather_bytes(bytes([r]) * r, 10.0, "second round")
        low = c.all_min(10 - r, 10.0, "min")
        shared = c.shared_value("x", lambda: f"made by {r}".encode(), 10.0)
        return got, again, low, shared

    res = _threads(3, rank)
    for got, again, low, shared in res:
        assert got == [b"rank0", b"rank1", b"rank2"]
        assert again == [b"", b"\x01", b"\x02\x02"]
        assert low == 8
        assert shared == res[0][3]          # one maker, everyone (later callers too) sees its value
    late = StoreControl(_client(master.port), 1, 3, "t/gather", SECRET).shared_value("x", lambda: b"late", 1.0)
    assert late == res[0][3]


def test_store_subgroup_has_its_own_keys_and_the_job_secret() -> None:
    """StoreControl.subgroup (a store-based internode buffer's node stage): its rounds run among its own
    ranks under prefix/name, with the parent's secret -- a record sealed with another secret is refused
    there like anywhere -- and they do not disturb the parent's rounds."""
    master = _master()

    def rank(r: int) -> Any:
        parent = StoreControl(_client(master.port), r, 2, "t/sub", SECRET)
        sub = parent.subgroup(f"node{r}", 0, 1)
        assert sub.prefix == f"t/sub/node{r}" and (sub.rank, sub.world_size) == (0, 1)
        alone = sub.all_gather_bytes(f"node {r}".encode(), 10.0, "node round")
        both = parent.all_gather_bytes(bytes([r]), 10.0, "parent round")
        return alone, both

    res = _threads(2, rank)
    assert [r[0] for r in res] == [[b"node 0"], [b"node 1"]]
    assert all(r[1] == [b"\x00", b"\x01"] for r in res)
    # A forger without the secret writes the next round's key of a one-rank subgroup: refused, so the
    # round waits for a record it can open and names the rank it waited for.
    sub = StoreControl(_client(master.port), 0, 2, "t/sub", SECRET).subgroup("node9", 0, 1)
    forger = StoreControl(_client(master.port), 0, 1, "t/sub/node9", b"another-secret-0123456789-abcdef")
    forger.all_gather_bytes(b"forged", 10.0, "node round")
    with pytest.raises(ControlTimeout) as info:     # the key all_gather_bytes's first round reads
        sub.wait_records([sub.key("boot", 1, "node_round", 0)], [0], 0.5, "node round", 64, current=True, call=1)
    assert info.value.missing == [0] and len(sub.rejects) >= 1
    for name, r, w in (("node1", 1, 1), ("a/b", 0, 1), ("", 0, 1)):
        with pytest.raises(ValueError, match="subgroup"):
            sub.subgroup(name, r, w)


def test_store_wait_names_the_missing_ranks() -> None:
    master = _master()

    def rank(r: int) -> Any:
        c = StoreControl(_client(master.port), r, 4, "t/missing", SECRET)
        with pytest.raises(ControlTimeout) as info:
            c.all_gather_bytes(b"x", 0.5, "setup round")
        return info.value

    # Ranks 1 and 3 never come.
    errs = _threads(2, lambda i: rank([0, 2][i]))
    for e in errs:
        assert e.missing == [1, 3] and "setup round" in str(e) and "[1, 3]" in str(e)


def test_store_control_rejects_bad_arguments() -> None:
    master = _master()
    with pytest.raises(ValueError, match="outside a world"):
        StoreControl(master, 3, 3, job_secret=SECRET)
    with pytest.raises(TypeError, match="Store"):
        StoreControl(object(), 0, 1, job_secret=SECRET)
    from pyep.ep.ll import EpBuffer
    with pytest.raises(ValueError, match="rank= and world_size="):
        EpBuffer(store=master, backend="reference", hidden=128, num_experts=4, job_secret=SECRET)


def _killed_mid_exchange(port: int) -> None:
    """A rank that publishes its part of round 1, and is SIGKILLed before round 2."""
    c = StoreControl(_client(port), 2, 3, "t/kill", SECRET)
    c.all_gather_bytes(b"first", 20.0, "round one")
    os.kill(os.getpid(), signal.SIGKILL)


def test_peer_killed_mid_exchange_is_named() -> None:
    master = _master()
    proc = mp.get_context("spawn").Process(target=_killed_mid_exchange, args=(master.port,), daemon=True)
    proc.start()

    def rank(r: int) -> Any:
        c = StoreControl(_client(master.port), r, 3, "t/kill", SECRET)
        assert c.all_gather_bytes(b"first", 60.0, "round one")[2] == b"first"
        with pytest.raises(ControlTimeout) as info:
            c.all_gather_bytes(b"second", 1.0, "round two")
        return info.value.missing

    assert _threads(2, rank, 120.0) == [[2], [2]]
    proc.join(10.0)
    assert proc.exitcode == -signal.SIGKILL


# ---------------------------------------------------------------------------------------- EpBuffer on a store
SHAPE = dict(num_max_dispatch_tokens_per_rank=8, hidden=128, num_experts=6, max_topk=3)


def _drill_args(**kw: Any) -> dict:
    a = {"T": 8, "H": 128, "E": 6, "K": 3, "seed": 3}
    a.update(kw)
    return a


def test_store_bootstrap_reference_matches_definition() -> None:
    import torch

    from pyep.ep.elastic.drill_rank import _check_dispatch, _expected_combine, _expert, inputs as _inputs
    from pyep.ep.ll import EpBuffer
    master = _master()
    a = _drill_args()

    def rank(r: int) -> Any:
        buf = EpBuffer(store=_client(master.port), rank=r, world_size=3, store_prefix="t/boot", backend="reference",
                       timeout_us=20_000_000, job_secret=SECRET, **SHAPE)
        assert buf.generation == 1 and not buf.joining and buf.backend_name == "reference"
        assert [p.kind for p in buf.transport_table()].count("reference") == 2
        for call in (1, 2, 3):
            assert buf.next_call == call
            x, idx, w = _inputs(a["seed"], call, r, 8, 128, 6, 3)
            recv, cnt, handle, _, _ = buf.dispatch(x, idx, use_fp8=False)
            _check_dispatch(a, call, r, 3, [True] * 3, recv, cnt, handle)
            out, _, _ = buf.combine(_expert(recv, r * 2), idx, w, handle)
            assert torch.equal(out.view(torch.int16), _expected_combine(a, call, r, 3, [True] * 3).view(torch.int16))
        assert buf.poll_rejoin() == [] and buf.admit_pending() == []
        buf.destroy()
        return True

    assert _threads(3, rank, 120.0) == [True] * 3


def _announce_as(port: int, prefix: str, rank: int, world: int, doc: bytes) -> int:
    """What a process of this job (it holds the secret) that announces `doc` leaves in the store: a
    generation slot, the announcement, an index slot. Returns its generation."""
    from pyep.ep.elastic.slots import claim_generation, claim_index_slot
    c = StoreControl(_client(port), rank, world, prefix, SECRET)
    c.generation = claim_generation(c, 10.0)
    c.put(c.key("ann", rank, c.generation), doc)
    claim_index_slot(c, 10.0)
    return c.generation


def _reject_text(port: int, prefix: str, rank: int, gen: int) -> str:
    c = StoreControl(_client(port), rank, 2, prefix, SECRET)
    rec = c.fetch(c.key("reject", rank, gen), (0,), 4096)
    assert rec is not None, c.rejects.entries
    return rec.payload.decode()


def test_generations_and_stale_or_malformed_announcements() -> None:
    """A second process of a rank gets generation 2 and joins; an authentic announcement (a process of
    this job) that is malformed, and a replayed one of an older generation, are refused with errors
    that say why, written where the announcer reads them."""
    from pyep.ep.ll import EpBuffer
    master = _master()
    kw = dict(backend="reference", timeout_us=5_000_000, store_prefix="t/gen", rejoin_lead_calls=0,
              job_secret=SECRET, **SHAPE)
    bufs = _threads(2, lambda r: EpBuffer(store=_client(master.port), rank=r, world_size=2, **kw))
    key = "t/gen"
    # A malformed announcement from a process of rank 1 (generation 2): survivors refuse it and write
    # the reason where the announcer reads it.
    assert _announce_as(master.port, key, 1, 2, b"{not json") == 2
    assert bufs[0].poll_rejoin() == []
    assert "not a pyep membership document" in _reject_text(master.port, key, 1, 2)
    # The real restarted process: generation 3 (the slots moved on), admitted through join().
    newcomer: List[Any] = []

    def restart() -> None:
        b = EpBuffer(store=_client(master.port), rank=1, world_size=2, **kw)
        assert b.generation == 3 and b.joining
        with pytest.raises(RuntimeError, match="not admitted yet"):
            b.dispatch(None, None)  # type: ignore[arg-type]
        newcomer.append((b, b.join(30.0)))
    t = threading.Thread(target=restart, daemon=True)
    t.start()
    admitted: List[int] = []
    import time
    deadline = time.monotonic() + 60
    while not admitted and time.monotonic() < deadline:
        admitted = bufs[0].admit_pending()
        time.sleep(0.01)
    t.join(30)
    assert admitted == [1] and newcomer and newcomer[0][1] == bufs[0].next_call
    # Now a stale announcement: a process of rank 1 announcing after generation 3 was admitted is
    # generation 4 -- but one that reuses generation 2's announcement (a late message of a dead process)
    # is refused: its generation is not the newest.
    fp = buffer_fingerprint(bufs[0].config, 2)
    stale = Announcement(1, 2, 2, fp, "reference", b"").encode()
    gen = _announce_as(master.port, key, 1, 2, stale)
    bufs[0].poll_rejoin()
    assert "generation 2" in _reject_text(master.port, key, 1, gen)
    for b in (bufs[0], newcomer[0][0]):
        b.destroy()
    bufs[1].destroy()


def test_decode_announcement_errors() -> None:
    fp = "T=8, H=128"
    good = Announcement(2, 4, 3, fp, "native", b"\x01\x02")
    assert decode_announcement(good.encode(), 2, 4, fp, "native", 3, 1) == good
    cases = [
        (b"\xff\xfe", 2, 4, fp, 3, 1, BadAnnouncement, "not a pyep membership document"),
        (good.encode(), 1, 4, fp, 3, 1, BadAnnouncement, "belongs to rank 1"),
        (good.encode(), 2, 8, fp, 3, 1, BadAnnouncement, "this job has 8"),
        (good.encode(), 2, 4, "T=16", 3, 1, BadAnnouncement, "differs from the survivors'"),
        (good.encode(), 2, 4, fp, 4, 1, StaleAnnouncement, "newest process of rank 2 has generation 4"),
        (good.encode(), 2, 4, fp, 3, 3, StaleAnnouncement, "already a member"),
        (good.encode().replace(b'"generation":3', b'"generation":"3"'), 2, 4, fp, 3, 1, BadAnnouncement,
         "'generation' must be an integer"),
        (good.encode().replace(b"pyep-member/1", b"other/1"), 2, 4, fp, 3, 1, BadAnnouncement, "format"),
    ]
    for raw, rank, world, f, newest, admitted, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            decode_announcement(raw, rank, world, f, "native", newest, admitted)
    with pytest.raises(BadAnnouncement, match="backend"):
        decode_announcement(good.encode(), 2, 4, fp, "reference", 3, 1)


# ---------------------------------------------------------------------------------------- drills
def _drill_cfg(**kw: Any) -> Any:
    from pyep.launch.drill import DrillConfig
    a: Dict[str, Any] = dict(backend="reference", transport="auto", world=3, drills=1, phases=("dispatch",),
                             victim=-1, kill_call=20, timeout_us=1_500_000, slack_ms=4000.0, max_slowdown=100.0,
                             rounds_after=6, lead_calls=4, tokens=8, hidden=128, experts=6, topk=3, seed=5,
                             join_timeout_s=120.0, drill_timeout_s=240.0)
    a.update(kw)
    return DrillConfig(**a)


# The pause tests: a rank starts one call PAUSE_MS late. That call has a short timeout (the pause is 5 of
# them: without the window under test the late rank is marked), the window is REJOIN_CALL_TIMEOUT_US
# (the pause leaves 1.5 s of it for a loaded machine's scheduling), and every other call has the
# drills' 1.5 s timeout: no call but the paused one is exposed to a short timeout (a loaded 2-core CI
# machine stalls a rank for hundreds of ms; 300 ms timeouts on every call made these tests flake).
PAUSE_TIMEOUT_US, PAUSE_MS = 100_000, 500.0


def _paused() -> Dict[str, Any]:
    from pyep.ep.elastic.membership import REJOIN_CALL_TIMEOUT_US
    assert 5 * PAUSE_TIMEOUT_US / 1e3 <= PAUSE_MS <= REJOIN_CALL_TIMEOUT_US / 1e3 - 1500
    return {"pause_timeout_us": PAUSE_TIMEOUT_US}


@pytest.mark.parametrize("phase", ["dispatch", "combine", "between"])
def test_drill_kill_restart_rejoin_reference(phase: str) -> None:
    """A real rank process is SIGKILLed (mid-exchange for dispatch / combine), the survivors mark it
    within the timeout and keep computing the right outputs, the restarted process (generation 2) is
    admitted while they run, and every call after is equal to the reference definition on every rank."""
    from pyep.launch.drill import run_drill
    out = run_drill(_drill_cfg(), 0, phase)
    assert out.ok, out.why
    assert out.joined_at > 20 and out.rounds_checked == 7
    assert 1500.0 * 0.9 <= out.detect_ms <= 1500.0 + 4000.0
    survivors = [r for r in out.ranks if r["generation"] == 1]
    assert len(survivors) == 2 and all(r["marked"] == [2] for r in survivors)


def test_drill_call_a_survives_a_pause_after_admission() -> None:
    """Every member must leave call #A with everyone active (the restarted rank active on the
    survivors, the survivors active on it) even when the survivors start call #A well over a timeout
    after the handshake released the newcomer (host work between steps; the newcomer's cold first
    launches on GPUs). Call #A waits REJOIN_CALL_TIMEOUT_US on every member; without that, the newcomer
    marks the late survivors in call #A and they mark it back in the combine (seen on GPUs: `ranks still
    marked inactive at the end`). The reference's heartbeat does not cover it: a pausing rank is not
    waiting, so it does not beat."""
    from pyep.launch.drill import run_drill
    out = run_drill(_drill_cfg(world=2, experts=4, phases=("between",), rounds_after=4, **_paused(),
                               pause_after_admit_ms=PAUSE_MS), 0, "between")
    assert out.ok, out.why
    assert all(r["final_active"] == [1, 1] for r in out.ranks), [r["final_active"] for r in out.ranks]


def test_drill_newcomer_late_after_call_a_stays_admitted() -> None:
    """The restarted process pauses well over a timeout after its first call (#A): its cold host code
    (first copies to the host, first CPU operators) on the GPU drill. Without the grace window the
    survivor marks it in dispatch #A+1 (its data is late), sends it no combine rows nor flag, and the
    newcomer marks the survivor back in that combine: the masks end split, {0: [1, 0], 1: [0, 1]}, as in
    the second GPU drill (nvlink, kills in combine and between calls). Calls #A .. #A +
    REJOIN_GRACE_CALLS - 1 wait at least REJOIN_CALL_TIMEOUT_US on every member."""
    from pyep.launch.drill import run_drill
    from pyep.ep.elastic.membership import REJOIN_GRACE_CALLS
    assert REJOIN_GRACE_CALLS >= 2
    out = run_drill(_drill_cfg(world=2, experts=4, phases=("between",), rounds_after=4, **_paused(),
                               newcomer_pause_ms=PAUSE_MS), 0, "between")
    assert out.ok, out.why
    assert all(r["final_active"] == [1, 1] for r in out.ranks), [r["final_active"] for r in out.ranks]
    assert not out.later_marks, out.later_marks


def test_drill_first_call_waits_for_a_late_starter() -> None:
    """Rank 0 starts its first call well over a timeout after the others (the set-up barrier releases
    the ranks a store poll apart, and first launches are cold: on GPUs over the softnic a survivor
    marked a live rank in call 1). Calls 1 .. REJOIN_GRACE_CALLS of a store-based buffer wait at least
    REJOIN_CALL_TIMEOUT_US, so nobody is marked before the victim dies; the drill fails when a rank was
    marked before the kill."""
    from pyep.launch.drill import run_drill
    out = run_drill(_drill_cfg(world=2, experts=4, phases=("between",), rounds_after=4, **_paused(),
                               first_call_pause_ms=PAUSE_MS), 0, "between")
    assert out.ok, out.why
    assert all(r["death_call"] >= 20 for r in out.ranks if r["generation"] == 1)


def test_drill_failure_names_the_call_and_keeps_the_traceback() -> None:
    """A failed rank's message is its last traceback and the call it failed in, not the CUDA warnings
    printed at exit after a sticky error (which pushed the traceback out of the kept lines)."""
    from pyep.launch.drill import failure_lines
    lines = ["setup ok", "rank 0 failed in {'call': 25, 'death_call': 24}", "Traceback (most recent call last):",
             '  File "x.py", line 3, in run', "torch.AcceleratorError: CUDA error: an illegal memory access"]
    lines += ["[W1125 CUDAEvent.h:57] Warning: CUDA warning: an illegal memory access (function ~CUDAEvent)"] * 12
    got = failure_lines(lines)
    assert got[0] == "rank 0 failed in {'call': 25, 'death_call': 24}"
    assert got[-1].startswith("torch.AcceleratorError") and not any("CUDA warning" in g for g in got)
    assert failure_lines([f"line {i}" for i in range(20)]) == [f"line {i}" for i in range(12, 20)]
