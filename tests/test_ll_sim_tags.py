"""Call tags in the CPU simulation of the low-latency kernels (tests/ll_sim, as in tests/test_ll_sim.py):
every count word and combine flag carries the call number and the sender's generation
(docs/ll_kernels.md, "Call tags"). A rank that refused its call sends an abort marker instead of its
data; a rank at another call is caught by the tag. In both cases every rank of the call gets the
typed error in its call record, uses nothing of the failed peer, marks nobody, skips the combine of the
failed dispatch (NaN output, no wait), and the next calls equal the oracle bit for bit. Direct (NVLink)
peers and NIC peers (masked fetch-adds on the data's QP), through the simulated NIC and the softnic. Each case runs in a worker process with a
hard timeout."""
from __future__ import annotations

import os
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIM_DIR = os.path.join(ROOT, "tests", "ll_sim")
R, T, H, E, K = 3, 6, 256, 6, 2


# ------------------------------------------------------------------ helpers (run in the worker)
def _world(path: str, nic: str):
    sys.path.insert(0, SIM_DIR)
    from world import World, load, nic_pairs
    return World(load(path), R, T, H, E, K, 2, nic_pairs=nic_pairs(R, nic.split("-")[-1]),
                 softnic=nic.startswith("softnic"))


def _close(w) -> None:
    if w.nic is not None and hasattr(w.nic, "close"):   # the softnic's engine threads
        w.nic.close()


def _record(w, r: int, my_call: int):
    """The call error rank r's kernels recorded (cleared, as the host does), or None."""
    from pyep.ep.ll.errors import call_error_from_record
    err = call_error_from_record(w.call_errs[r].tolist(), r, my_call)
    w.call_errs[r].zero_()
    return err


def _quiet(w) -> None:
    """Nobody marked, every signal word of both halves back to 0, no NIC error."""
    assert all(a.tolist() == [1] * R for a in w.active), f"a rank was marked: {[a.tolist() for a in w.active]}"
    for r in range(R):
        for off, size in w.lay.signal_ranges:
            sig = w.bufs[r][off:off + w.lay.off_cack - w.lay.off_dsig]   # counts and flags, not the acks
            assert int(sig.count_nonzero()) == 0, f"rank {r}: signal words left set after the call"
    if w.nic is not None:
        assert not w.nic.errors(), w.nic.errors()


def _checked(w, seed: int, seq: int, tag: str) -> None:
    from world import check_combine, check_dispatch, expert_outputs, rank_inputs
    inputs = rank_inputs(R, T, H, E, K, seed)
    outs = w.dispatch(inputs, seq & 1, seq=seq)
    for r in range(R):
        check_dispatch(w, inputs, outs, r, [True] * R, False, False, False, f"{tag} rank {r}")
    ys = expert_outputs(w, outs, False, False, seed)
    comb = w.combine(ys, inputs, outs, seq & 1, seq=seq)
    for r in range(R):
        check_combine(w, inputs, ys, comb, r, [True] * R, f"{tag} rank {r}")
        assert _record(w, r, seq) is None, f"{tag}: rank {r} recorded a call error in a healthy call"


# ------------------------------------------------------------------ cases
def case_refused(path: str, nic: str) -> str:
    """Rank 0 refuses dispatch #4 (abort marker, no tokens); ranks 1 and 2 dispatch normally: both record
    PeerRefusedCall naming rank 0 and its reason, their exchange with each other is complete and rank 0's
    rows are not used; rank 0 records nothing (its host raised already). The combine of #4 is skipped on
    ranks 1 and 2 (NaN, nothing sent, nobody waits). Then rank 1 refuses the combine of #6: ranks 0 and 2
    record it and reduce without rank 1's experts; acknowledgements stay balanced; nobody is marked; the
    calls after each refusal equal the oracle."""
    import torch
    from world import check_combine, check_dispatch, expert_outputs, rank_inputs
    from pyep.ep.ll.errors import REFUSAL_REASONS, REFUSED_TYPE, REFUSED_VALUE, PeerRefusedCall
    w = _world(path, nic)
    _checked(w, 10, 3, "before")

    inputs = rank_inputs(R, T, H, E, K, 11)
    outs = w.dispatch(inputs, 0, seq=4, aborts={0: REFUSED_VALUE})
    assert _record(w, 0, 4) is None, "the refusing rank records no abort: its host raised already"
    for r in (1, 2):
        err = _record(w, r, 4)
        assert type(err) is PeerRefusedCall, f"rank {r}: {err!r}"
        assert (err.kind, err.peer, err.my_call, err.reason) == ("dispatch", 0, 4, REFUSAL_REASONS[REFUSED_VALUE])
        check_dispatch(w, inputs, outs, r, [False, True, True], False, False, False, f"refused: rank {r}")
    _quiet(w)
    ys = expert_outputs(w, outs, False, False, 12)
    comb = w.combine(ys, inputs, outs, 0, ranks=[1, 2], seq=4)   # rank 0 has no handle: it does not combine
    for r in (1, 2):
        assert bool(torch.isnan(comb[r].float()).all()), f"rank {r}: the skipped combine wrote numbers"
        err = _record(w, r, 4)
        assert err is not None and type(err).__name__ == "CombineOfFailedDispatch", f"rank {r}: {err!r}"
    _quiet(w)
    _checked(w, 13, 5, "after a refused dispatch")

    inputs = rank_inputs(R, T, H, E, K, 14)
    outs = w.dispatch(inputs, 0, seq=6)
    ys = expert_outputs(w, outs, False, False, 15)
    comb = w.combine(ys, inputs, outs, 0, seq=6, aborts={1: REFUSED_TYPE})
    assert _record(w, 1, 6) is None
    for r in (0, 2):
        err = _record(w, r, 6)
        assert type(err) is PeerRefusedCall and (err.kind, err.peer, err.my_call) == ("combine", 1, 6), repr(err)
        # Rank 1's experts contributed nothing: the oracle with owner 1 left out.
        check_combine(w, inputs, ys, comb, r, [True] * R, f"refused combine: rank {r}", owners=[True, False, True])
    _quiet(w)
    deadline = time.monotonic() + 30    # the last acknowledgements may still be on the NIC
    while w.acks(0)[0] != w.acks(0)[1] and time.monotonic() < deadline:
        time.sleep(0.01)
    sent, acked = w.acks(0)
    assert sent == acked, f"an aborted combine unbalanced the acknowledgements: sent {sent}, acked {acked}"
    _checked(w, 16, 7, "after a refused combine")
    _checked(w, 17, 8, "after a refused combine, same half")

    # Two ranks refuse the same dispatch: the third records the first of them (by rank).
    outs = w.dispatch(rank_inputs(R, T, H, E, K, 18), 1, seq=9, aborts={0: REFUSED_VALUE, 2: REFUSED_TYPE})
    assert _record(w, 0, 9) is None and _record(w, 2, 9) is None
    err = _record(w, 1, 9)
    assert type(err) is PeerRefusedCall and err.peer == 0, repr(err)
    _quiet(w)
    _checked(w, 19, 10, "after a dispatch two ranks refused")
    _close(w)
    return "ok"


def case_mismatch(path: str, nic: str) -> str:
    """Rank 2 is at dispatch #6 while ranks 0 and 1 are at #4 (the same buffer half): every rank records
    a CallMismatch naming both calls, nothing of the mismatched peer is used (ranks 0 and 1 still
    exchange with each other), nobody is marked, the combine is skipped on every rank; with the call
    numbers in step again the next calls are exact. A combine at another call number and a peer of
    another generation are caught the same way."""
    import torch
    from world import check_combine, check_dispatch, expert_outputs, rank_inputs
    from pyep.ep.ll.errors import LLCallMismatch
    w = _world(path, nic)
    _checked(w, 30, 3, "before")
    inputs = rank_inputs(R, T, H, E, K, 31)
    outs = w.dispatch(inputs, 0, seq=[4, 4, 6])
    for r, peer, mine, theirs in ((0, 2, 4, 6), (1, 2, 4, 6), (2, 0, 6, 4)):
        err = _record(w, r, mine)
        assert type(err) is LLCallMismatch, f"rank {r}: {err!r}"
        assert (err.kind, err.peer, err.my_call, err.peer_call) == ("dispatch", peer, mine, theirs), repr(err)
    for r in (0, 1):
        check_dispatch(w, inputs, outs, r, [True, True, False], False, False, False, f"mismatch: rank {r}")
    check_dispatch(w, inputs, outs, 2, [False, False, True], False, False, False, "mismatch: rank 2")
    _quiet(w)
    comb = w.combine(expert_outputs(w, outs, False, False, 32), inputs, outs, 0, seq=[4, 4, 6])
    assert all(bool(torch.isnan(comb[r].float()).all()) for r in range(R)), "a skipped combine wrote numbers"
    for r in range(R):
        assert _record(w, r, 4) is not None
    _quiet(w)
    _checked(w, 33, 5, "back in step")
    _checked(w, 34, 6, "back in step, same half")

    # A combine whose tag names another dispatch (the dispatch itself was in step).
    inputs = rank_inputs(R, T, H, E, K, 35)
    outs = w.dispatch(inputs, 1, seq=7)
    ys = expert_outputs(w, outs, False, False, 36)
    comb = w.combine(ys, inputs, outs, 1, seq=[7, 9, 7])
    for r, peer, mine in ((0, 1, 7), (2, 1, 7), (1, 0, 9)):
        err = _record(w, r, mine)
        assert type(err) is LLCallMismatch and (err.kind, err.peer) == ("combine", peer), f"rank {r}: {err!r}"
    for r in (0, 2):
        check_combine(w, inputs, ys, comb, r, [True] * R, f"combine mismatch: rank {r}", owners=[True, False, True])
    assert all(a.tolist() == [1] * R for a in w.active)
    w.rejoin()   # a mismatched combine leaves acknowledgements unbalanced: clean() puts them back

    # Rank 1 expects generation 2 of rank 0 (say, after a restart it has not seen end): rank 0's words
    # are refused as another generation's, never read as data.
    w.gens[1][0] = 2
    inputs = rank_inputs(R, T, H, E, K, 37)
    outs = w.dispatch(inputs, 0, seq=8)
    err = _record(w, 1, 8)
    assert type(err) is LLCallMismatch and err.peer == 0 and "generation 0" in str(err), repr(err)
    check_dispatch(w, inputs, outs, 1, [False, True, True], False, False, False, "generation mismatch")
    assert _record(w, 0, 8) is None and _record(w, 2, 8) is None
    w.gens[1][0] = 0
    w.rejoin()
    _checked(w, 38, 9, "after the generation is known")
    _close(w)
    return "ok"


# ------------------------------------------------------------------ tests
@pytest.mark.parametrize("nic", ["none", "all", "softnic-all"])
@pytest.mark.parametrize("case", [case_refused, case_mismatch], ids=["refused-call-aborts", "call-mismatch"])
def test_call_tags(ll_sim_pool, case, nic):
    from world import has_softnic
    if nic.startswith("softnic") and not has_softnic():
        pytest.skip("pyep._engine has no softnic in this build")
    pool, path = ll_sim_pool
    assert pool.run(case, path, nic, timeout_s=300) == ["ok"]
