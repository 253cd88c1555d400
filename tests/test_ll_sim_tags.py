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
def _world(path: str, nic: str, lag_ns: tuple = ()):
    sys.path.insert(0, SIM_DIR)
    from world import World, load, nic_pairs
    return World(load(path), R, T, H, E, K, 2, nic_pairs=nic_pairs(R, nic.split("-")[-1]),
                 softnic=nic.startswith("softnic"), lag_ns=lag_ns)


def _drained(w) -> None:
    """Every WQE posted so far has been executed (the simulated NIC; the softnic worlds run no lag)."""
    if w.nic is None or not hasattr(w.nic, "idle"):
        return
    deadline = time.monotonic() + 60
    while not w.nic.idle():
        assert time.monotonic() < deadline, "the simulated NIC did not drain in 60 s"
        time.sleep(0.01)


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


def _acks_balanced(w, half: int) -> None:
    """Every combine a rank sent on `half` was acknowledged (an aborted combine sends none and takes
    none). The last acknowledgements may still be on the NIC: bounded wait."""
    deadline = time.monotonic() + 30
    while w.acks(half)[0] != w.acks(half)[1] and time.monotonic() < deadline:
        time.sleep(0.01)
    sent, acked = w.acks(half)
    assert sent == acked, f"a refused combine unbalanced the acknowledgements: sent {sent}, acked {acked}"


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
    _acks_balanced(w, 0)
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


def case_in_stream_order(path: str, nic: str, lag: str) -> str:
    """The refused calls as a GPU stream runs them when the host does not synchronise: every rank's
    dispatch and combine back to back (World.streams), the ranks at once, two QPs per NIC peer; `lag`:
    the simulated NIC runs QP 1 ("qp1") or QP 0 ("qp0") of every NIC pair 300 ms late, so the QPs of one
    peer complete out of step (RC orders one QP, never two). Rank 0 refuses dispatch #4: ranks 1 and 2
    record PeerRefusedCall and skip its combine on the device (NaN); once the NIC drained, no signal word
    is left set -- the abort markers on the late QP landed before the receivers cleared the half (they
    used to land after it, and the next dispatch on that half met a stale marker: a mismatch). Then rank
    2 refuses the combine of #6, launched right behind its dispatch: ranks 0 and 1 record it and reduce
    without rank 2's experts, nobody is marked, acknowledgements stay equal. The calls after each, on
    both halves, equal the oracle."""
    import torch
    from world import check_combine, check_dispatch, expert_outputs, rank_inputs
    from pyep.ep.ll.errors import REFUSED_TYPE, REFUSED_VALUE, PeerRefusedCall
    late = {"none": (), "qp1": (0, 300_000_000), "qp0": (300_000_000, 0)}[lag]
    w = _world(path, nic, late)
    _checked(w, 40, 3, "before")

    def in_order(seq: int, seed: int, dispatch_aborts: dict, combine_aborts: dict):
        inputs = rank_inputs(R, T, H, E, K, seed)
        outs = w.dispatch_outputs()
        ys = expert_outputs(w, outs, False, False, seed + 1)
        comb = w.combine_outputs(inputs)
        launches = []
        for r in range(R):
            ls = [("dispatch", w.dispatch_call(r, inputs, seq & 1, outs, seq=seq, aborts=dispatch_aborts))]
            if r not in dispatch_aborts:     # a rank whose dispatch raised has no handle to combine
                ls.append(("combine", w.combine_call(r, ys, inputs, outs, seq & 1, comb, seq=seq,
                                                     aborts=combine_aborts)))
            launches.append(ls)
        w.streams(launches)
        _drained(w)
        return inputs, outs, ys, comb

    inputs, outs, _, comb = in_order(4, 41, {0: REFUSED_VALUE}, {})
    assert _record(w, 0, 4) is None
    for r in (1, 2):
        err = _record(w, r, 4)
        assert type(err) is PeerRefusedCall and (err.kind, err.peer) == ("dispatch", 0), f"rank {r}: {err!r}"
        check_dispatch(w, inputs, outs, r, [False, True, True], False, False, False, f"in order: rank {r}")
        assert bool(torch.isnan(comb[r].float()).all()), f"rank {r}: the skipped combine wrote numbers"
    _quiet(w)
    _checked(w, 43, 5, "after a refused dispatch")
    _checked(w, 44, 6, "after a refused dispatch, same half")

    inputs, outs, ys, comb = in_order(7, 45, {}, {2: REFUSED_TYPE})
    assert _record(w, 2, 7) is None
    for r in (0, 1):
        err = _record(w, r, 7)
        assert type(err) is PeerRefusedCall and (err.kind, err.peer) == ("combine", 2), f"rank {r}: {err!r}"
        check_combine(w, inputs, ys, comb, r, [True] * R, f"in order: rank {r}", owners=[True, True, False])
    _quiet(w)
    _acks_balanced(w, 1)
    _checked(w, 46, 8, "after a refused combine")
    _checked(w, 47, 9, "after a refused combine, same half")
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


# The late-QP worlds: rank 0 reaches ranks 1 and 2 over the NIC, 1 and 2 each other by stores (ranks
# "across nodes"), so a receiver's only late words are rank 0's (with every pair late, the late words of
# the other peers held every receiver back as long as the refuser's).
@pytest.mark.parametrize("nic,lag", [("all", "none"), ("softnic-all", "none"), ("cross", "qp1"), ("cross", "qp0")],
                         ids=["nic", "softnic", "nic-qp1-late", "nic-qp0-late"])
def test_refused_calls_in_stream_order(ll_sim_pool, nic, lag):
    from world import has_softnic
    if nic.startswith("softnic") and not has_softnic():
        pytest.skip("pyep._engine has no softnic in this build")
    pool, path = ll_sim_pool
    assert pool.run(case_in_stream_order, path, nic, lag, timeout_s=300) == ["ok"]
