"""A handle combined again, in the CPU simulation of the low-latency kernels (tests/ll_sim, as in
tests/test_ll_sim.py): the per-peer acknowledgements of engine/kernels/ll_ack.cuh. A handle combined
several times with store, NIC and softnic peers, counts equal afterwards; a delayed receiver whose
peer's repeated send must wait, with a control run without the wait that shows the corruption; a
silent destination timing out. Each case runs in a worker process with a hard timeout."""
from __future__ import annotations

import os
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIM_DIR = os.path.join(ROOT, "tests", "ll_sim")


# ------------------------------------------------------------------ cases (run in the worker)
def _scaled(ys, j):
    """Combine #j's expert outputs: the same rows times 2^(j % 4) (exact in bf16), so every combine of a
    handle has its own expected result."""
    return [y * float(2 ** (j % 4)) for y in ys]


def case_repeat(path: str, R: int, nic: str) -> str:
    """A handle combined several times (repeat=1 after the first), both halves interleaved: every result
    equals the oracle, and afterwards each rank's csent to a peer equals the acknowledgements that peer
    added to its cack, per half (ll_ack.cuh)."""
    sys.path.insert(0, SIM_DIR)
    from world import World, check_combine, check_dispatch, expert_outputs, load, nic_pairs, rank_inputs
    sim = load(path)
    T, H, E, K = 4, 256, 2 * R, 2
    softnic = nic.startswith("softnic")
    nic = nic.split("-")[-1]
    w = World(sim, R, T, H, E, K, 2, nic_pairs=nic_pairs(R, nic), softnic=softnic)
    a, b = rank_inputs(R, T, H, E, K, 100), rank_inputs(R, T, H, E, K, 101)
    oa, ob = w.dispatch(a, 0), w.dispatch(b, 1)
    for r in range(R):
        check_dispatch(w, a, oa, r, [True] * R, False, False, False, f"repeat A rank {r}")
        check_dispatch(w, b, ob, r, [True] * R, False, False, False, f"repeat B rank {r}")
    ya, yb = expert_outputs(w, oa, False, False, 21), expert_outputs(w, ob, False, False, 22)
    for j in range(4):
        for tag, inp, o, ys, half in (("A", a, oa, ya, 0), ("B", b, ob, yb, 1)):
            y = _scaled(ys, j)
            got = w.combine(y, inp, o, half, repeat=j > 0, phases=3 if j != 2 else 1)
            if j == 2:   # the hook path: the receive launch sends the acknowledgements
                w.combine(y, inp, o, half, repeat=True, phases=2, outs=got)
            for r in range(R):
                check_combine(w, inp, y, got, r, [True] * R, f"{nic} combine #{j} of {tag} rank {r}")
    for half in (0, 1):
        deadline = time.monotonic() + 30   # the last acknowledgements may still be on the NIC
        while w.acks(half)[0] != w.acks(half)[1] and time.monotonic() < deadline:
            time.sleep(0.01)
        sent, acked = w.acks(half)
        assert sent == acked, f"half {half}: sent {sent}, acknowledged {acked}"
        assert all(v == 4 for row in sent for v in row), f"half {half}: sent {sent}"
    assert all(int(a_) == 1 for act in w.active for a_ in act), "no rank may time out"
    if w.nic is not None:
        assert not w.nic.errors(), w.nic.errors()
        if softnic:
            w.nic.close()
    return "ok"


def case_repeat_race(path: str, nic: str, ack: bool) -> str:
    """Rank 0 sends combine #0 of a handle and receives it only later (the hook path); rank 1 finishes #0
    and sends #1 of the same handle meanwhile. With the acknowledgement (repeat=1), rank 1's send waits
    until rank 0's receive of #0 is done and every result is right; without it (ack=False: repeat=0, the
    race a repeated combine had), rank 1's rows of #1 overwrite those rank 0 has not reduced yet."""
    sys.path.insert(0, SIM_DIR)
    import threading

    import torch
    from world import World, check_combine, expert_outputs, load, rank_inputs
    sim = load(path)
    R, T, H, E, K = 2, 6, 256, 4, 2
    w = World(sim, R, T, H, E, K, 2, nic_pairs=[(0, 1)] if nic == "nic" else [])
    inputs = rank_inputs(R, T, H, E, K, 110)
    outs = w.dispatch(inputs, 0)
    ys = expert_outputs(w, outs, False, False, 23)
    y0, y1 = _scaled(ys, 0), _scaled(ys, 1)
    c0, c1 = w.combine_outputs(inputs), w.combine_outputs(inputs)
    errors = []

    def bg(fn):
        def run():
            try:
                fn()
            except BaseException as exc:  # noqa: BLE001 - re-raised below
                errors.append(exc)
        t = threading.Thread(target=run)
        t.start()
        return t

    # Combine #0: rank 0 only sends; rank 1 runs it whole (it needs rank 0's rows, not its receive).
    t = bg(lambda: w.combine(y0, inputs, outs, 0, ranks=[0], phases=1, outs=c0))
    w.combine(y0, inputs, outs, 0, ranks=[1], outs=c0)
    t.join()
    # Combine #1, rank 1's send, while rank 0 still holds #0's rows unreduced.
    timeout = 20_000_000_000 if ack else 300_000_000
    t = bg(lambda: w.combine(y1, inputs, outs, 0, ranks=[1], phases=1, outs=c1, repeat=ack, timeout_ns=timeout))
    if ack:
        t.join(0.5)
        assert t.is_alive(), "rank 1's repeated send must wait for rank 0's acknowledgement"
    else:
        t.join()
        if nic == "nic":   # the posts are out; let the NIC land them (the flag follows the rows)
            flag = w.bufs[0][w.lay.csig_offset(0, 1):w.lay.csig_offset(0, 1) + 4].view(torch.int32)
            deadline = time.monotonic() + 30
            while int(flag) < 2 * int(w.tables[0]["flag_expect"][1]) and time.monotonic() < deadline:
                time.sleep(0.01)
    w.combine(y0, inputs, outs, 0, ranks=[0], phases=2, outs=c0)     # rank 0 reduces #0 now
    t.join()
    if errors:
        raise errors[0]
    if not ack:
        try:
            check_combine(w, inputs, y0, c0, 0, [True] * R, "rank 0, combine #0")
        except AssertionError:
            return "raced"
        return "not raced"
    check_combine(w, inputs, y0, c0, 0, [True] * R, "rank 0, combine #0")
    check_combine(w, inputs, y0, c0, 1, [True] * R, "rank 1, combine #0")
    # Rank 0's combine #1 (whole) with rank 1's receive of #1.
    t = bg(lambda: w.combine(y1, inputs, outs, 0, ranks=[0], outs=c1, repeat=True))
    w.combine(y1, inputs, outs, 0, ranks=[1], phases=2, outs=c1, repeat=True)
    t.join()
    if errors:
        raise errors[0]
    for r in range(R):
        check_combine(w, inputs, y1, c1, r, [True] * R, f"rank {r}, combine #1")
    deadline = time.monotonic() + 30   # the last acknowledgements may still be on the NIC
    while w.acks(0)[1] != [[2, 2], [2, 2]] and time.monotonic() < deadline:
        time.sleep(0.01)
    sent, acked = w.acks(0)
    assert sent == acked == [[2, 2], [2, 2]], (sent, acked)
    assert all(int(a_) == 1 for act in w.active for a_ in act)
    if w.nic is not None:
        assert not w.nic.errors(), w.nic.errors()
    return "ok"


def case_repeat_silent(path: str, nic: str) -> str:
    """A destination that never acknowledges (rank 1 sends combine #0 and never receives it): rank 0's
    repeated combine times out on it within the call's timeout, marks it inactive, sends it nothing,
    and returns the combine of the ranks still active; a rejoin (clean) restarts the counters."""
    sys.path.insert(0, SIM_DIR)
    import torch
    from world import World, check_combine, checked_round, expert_outputs, load, rank_inputs
    sim = load(path)
    R, T, H, E, K = 2, 4, 256, 4, 2
    w = World(sim, R, T, H, E, K, 2, nic_pairs=[(0, 1)] if nic == "nic" else [])
    inputs = rank_inputs(R, T, H, E, K, 120)
    outs = w.dispatch(inputs, 0)
    ys = expert_outputs(w, outs, False, False, 24)
    c0 = w.combine_outputs(inputs)
    import threading
    t = threading.Thread(target=lambda: w.combine(ys, inputs, outs, 0, ranks=[1], phases=1, outs=c0))
    t.start()
    w.combine(ys, inputs, outs, 0, ranks=[0], outs=c0)
    t.join()
    check_combine(w, inputs, ys, c0, 0, [True] * R, "rank 0, combine #0")
    y1 = _scaled(ys, 1)
    t0 = time.monotonic()
    c1 = w.combine(y1, inputs, outs, 0, ranks=[0], repeat=True, timeout_ns=300_000_000)
    took = time.monotonic() - t0
    assert 0.3 <= took < 10.0, f"the silent destination's acknowledgement wait took {took:.3f} s"
    assert w.active[0].tolist() == [1, 0], w.active[0].tolist()
    check_combine(w, inputs, y1, c1, 0, [True, False], "rank 0, combine #1 without rank 1")
    sent, acked = w.acks(0)
    # Rank 0 sent #1 to itself only; only it acknowledged (rank 1 never received anything).
    assert sent[0] == [2, 1] and acked[0] == [2, 0], (sent, acked)
    w.rejoin()
    sent, acked = w.acks(0)
    assert sent == acked == [[0, 0], [0, 0]]
    checked_round(w, rank_inputs(R, T, H, E, K, 121), 0, "after rejoin")
    assert torch.equal(w.active[0], torch.ones(R, dtype=torch.int32))
    return "ok"


REPEAT = [(3, "none"), (2, "all"), (4, "cross"), (2, "softnic-all")]


@pytest.mark.parametrize("R,nic", REPEAT)
def test_repeated_combine_of_one_handle(ll_sim_pool, R, nic):
    from world import has_softnic
    if nic.startswith("softnic") and not has_softnic():
        pytest.skip("pyep._engine has no softnic in this build")
    pool, path = ll_sim_pool
    assert pool.run(case_repeat, path, R, nic, timeout_s=240) == ["ok"]


@pytest.mark.parametrize("nic", ["direct", "nic"])
def test_repeated_combine_waits_for_the_acknowledgement(ll_sim_pool, nic):
    pool, path = ll_sim_pool
    assert pool.run(case_repeat_race, path, nic, True, timeout_s=240) == ["ok"]


@pytest.mark.parametrize("nic", ["direct", "nic"])
def test_without_the_acknowledgement_the_race_bites(ll_sim_pool, nic):
    """The control experiment: the same schedule with repeat=0 corrupts rank 0's combine #0, so the test
    above would catch a repeated combine that stopped waiting."""
    pool, path = ll_sim_pool
    assert pool.run(case_repeat_race, path, nic, False, timeout_s=240) == ["raced"]


@pytest.mark.parametrize("nic", ["direct", "nic"])
def test_repeated_combine_times_out_on_a_silent_destination(ll_sim_pool, nic):
    pool, path = ll_sim_pool
    assert pool.run(case_repeat_silent, path, nic, timeout_s=240) == ["ok"]
