"""The normal mode's zero-copy paths in the CPU simulation of its intranode kernels (the world of
tests/test_normal_sim.py: tests/ll_sim/normal_sim.cpp, one OS thread per GPU thread, the ranks of one
node in one process). One-copy dispatch (normal_direct.cuh): rows straight into the receivers' pooled
outputs, the rings untouched, BF16 and FP8 with column-major scales, padding, a cached dispatch, a call
where one rank offers nothing taking the ring path everywhere; a descriptor outside the pool and a lost
path record named. Pull combine (normal_pull.cuh) through the real gate: the sums bit for bit the push
path's, the rings and counters untouched, the pulled[] words; offers that are too short or run past the
pool, a send_head past a peer's rows, a rank that offers and never launches. Each case runs in a worker
process with a hard timeout."""
from __future__ import annotations

import os
import sys
from typing import Any, List, Optional, Tuple

import pytest

from pyep.ep.normal.errors import ERR_DIRECT_DESC, ERR_LOST_PATH, ERR_PEER_TIMEOUT, PHASES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIM_DIR = os.path.join(ROOT, "tests", "ll_sim")


# ------------------------------------------------------------------ cases (run in the worker)

def case_direct(path: str, R: int, sizes: List[int], H: int = 256) -> str:
    """One-copy dispatch (normal_direct.cuh): every rank offers outputs in its pool, so rows go straight
    into the receivers' recv_x (the rings stay untouched: zeroed before, zero after) and the small
    fields through the staging rows; BF16, FP8 with column-major scales, num_worst_tokens padding, a
    cached dispatch; a call where one rank offers nothing takes the ring path on every rank; each
    followed by a combine over the rings (the counters stay consistent across both paths)."""
    sys.path.insert(0, SIM_DIR)
    from normal_world import NormalWorld, check_combine, check_dispatch, expert_outputs, load, make_inputs
    sim = load(path)
    K, E = 4, 4 * R
    w = NormalWorld(sim, R, H, K, E, 2, 32, 6, pool_bytes=max(4 << 20, 8 * H * sum(sizes)))
    plan = [("bf16", False, False, None, 0), ("fp8 colmajor", True, True, None, 0), ("ring: rank 1 offers nothing", False,
            False, [r for r in range(R) if r != 1], 0), ("fp8 worst", True, False, None, sum(sizes) + 5),
            ("bf16 again", False, False, None, 0)]
    for i, (what, fp8, colmajor, offer, worst) in enumerate(plan):
        what = f"R={R} {what}"
        inputs = make_inputs(R, sizes, H, K, E, fp8, seed=300 + 10 * R + i, colmajor=colmajor)
        one_copy = offer is None
        if one_copy:
            for r in range(R):
                w.rings(r).zero_()
        handles, outs = w.dispatch(inputs, offer=offer, worst=worst)
        assert w.errors() == [[0, 0, 0, 0]] * R, (what, w.errors())
        check_dispatch(inputs, handles, outs, E, what)
        for r in range(R):
            # Inside [pool_lo, pool_hi) of rank r's buffer: a tensor allocated elsewhere may lie above it.
            at = outs[r]["recv_x"].data_ptr() - w.bufs[r].data_ptr()
            in_pool = w.pool_lo <= at < w.pool_hi
            assert in_pool == (offer is None or r in offer), (what, r)
            if one_copy:
                assert not w.rings(r).any(), f"{what}: rank {r}'s rings were written on a one-copy call"
            elif sum(sizes):
                assert any(w.rings(q).any() for q in range(R)), f"{what}: the ring path left every ring empty"
        if i == 1:   # the same routing again with a handle: payload and scales only
            again = make_inputs(R, sizes, H, K, E, True, seed=400 + R, colmajor=True)
            for a, b in zip(again, inputs):
                a.topk, a.weights = b.topk, b.weights
            for r in range(R):
                w.rings(r).zero_()
            handles, outs = w.dispatch(again, cached=True)
            assert w.errors() == [[0, 0, 0, 0]] * R, (what, w.errors())
            check_dispatch(again, handles, outs, E, what + " cached")
            assert not any(w.rings(r).any() for r in range(R)), f"{what} cached: a ring was written"
        ys, ws = expert_outputs(handles, H, K, 40 + i)
        comb = w.combine(handles, ys, ws)
        assert w.errors() == [[0, 0, 0, 0]] * R, (what, w.errors())
        check_combine(handles, ys, ws, comb, list(range(R)), what + " combine")
    return "ok"


def _gated_dispatch(w: Any, inputs: List[Any], what: str) -> List[Any]:
    """A dispatch as native.py makes one without a handle: layout, route and gate, then the kernel."""
    from normal_world import Handle, adopt_notified, check_dispatch
    R, E = w.R, w.E
    notified = w.notify(inputs)
    handles = [Handle(inputs, r, R, E, w.C) for r in range(R)]
    for r in range(R):
        adopt_notified(handles[r], notified[r], r)
    handles, outs = w.dispatch(inputs, handles=handles)
    assert w.errors() == [[0, 0, 0, 0]] * R, (what, w.errors())
    check_dispatch(inputs, handles, outs, E, what)
    return handles


def _check_pull(w: Any, handles: List[Any], ys: List[Any], comb: List[dict], what: str,
                bias: Optional[List[Any]] = None) -> None:
    import torch
    from normal_world import expected_combine
    ws0 = [torch.zeros((y.shape[0], 1)) for y in ys]
    for r in range(len(comb)):
        want, _ = expected_combine(handles, ys, ws0, r, bias[r] if bias else None)
        bad = (comb[r]["out"].view(torch.int16) != want.view(torch.int16)).any(dim=1).nonzero().flatten().tolist()
        assert not bad, f"{what}: rank {r} combined tokens {bad[:8]} differ"


def case_pull(path: str, R: int, sizes: List[int]) -> str:
    """Pull combine (normal_pull.cuh), every call through its real gate: every rank's x in its pool, so
    each token's owner reads the rows where they lie -- the sums bit for bit the push path's (bias, rank
    order), the rings and their counters untouched, every block's pulled[] word at the call number; a
    call where one rank offers nothing pushes on every rank; then dispatch and push again, the counters
    consistent across both paths."""
    sys.path.insert(0, SIM_DIR)
    import torch
    from normal_world import NormalWorld, expert_outputs, load, make_inputs
    sim = load(path)
    H, K, E, C = 256, 4, 4 * R, 2
    w = NormalWorld(sim, R, H, K, E, C, 32, 6, pool_bytes=max(4 << 20, 8 * H * sum(sizes)))
    plan = [("pull", list(range(R)), True), ("rank 1 offers nothing: push", [r for r in range(R) if r != 1], False),
            ("pull again", list(range(R)), False)]
    for i, (what, offer, with_bias) in enumerate(plan):
        what = f"R={R} {what}"
        inputs = make_inputs(R, sizes, H, K, E, False, seed=600 + 10 * R + i)
        handles = _gated_dispatch(w, inputs, what + " dispatch")
        ys, _ = expert_outputs(handles, H, K, 70 + i)
        g = torch.Generator().manual_seed(90 + i)
        bias = [torch.randn((n, H), generator=g).to(torch.bfloat16) for n in sizes] if with_bias else None
        pulls = len(offer) == R
        for r in range(R):
            w.rings(r).zero_()
        before = [b[:w.ring_off].clone() for b in w.bufs]   # the control area
        comb = w.combine(handles, ys, None, bias, pull=offer)
        assert w.errors() == [[0, 0, 0, 0]] * R, (what, w.errors())
        _check_pull(w, handles, ys, comb, what, bias)
        seq = int(w.ws[0][1])
        for r in range(R):
            if pulls:
                assert not w.rings(r).any(), f"{what}: rank {r}'s rings were written on a pull call"
                words = w.bufs[r].view(torch.int32)
                for name in ("tail", "head", "tx_pos", "rx_pos"):
                    lo = w.words[name]
                    assert torch.equal(words[lo:lo + 64 * R], before[r].view(torch.int32)[lo:lo + 64 * R]), \
                        f"{what}: rank {r}'s {name} counters moved on a pull call"
                pulled = words[w.words["pulled"]:w.words["pulled"] + 2 * C * R].view(2 * C, R)
                want = torch.full((2 * C, R), seq, dtype=torch.int32)
                want[:, r] = 0   # nobody writes a rank's own word
                assert torch.equal(pulled, want), f"{what}: rank {r}'s pulled words {pulled.tolist()}"
            elif sum(sizes):
                assert any(w.rings(q).any() for q in range(R)), f"{what}: the push path left every ring empty"
    # Push (with weights) after pulls: the counters the pull calls left alone are still the rings'.
    inputs = make_inputs(R, sizes, H, K, E, False, seed=690 + R)
    handles = _gated_dispatch(w, inputs, "dispatch after pulls")
    from normal_world import check_combine
    ys, ws = expert_outputs(handles, H, K, 99)
    comb = w.combine(handles, ys, ws)
    assert w.errors() == [[0, 0, 0, 0]] * R, w.errors()
    check_combine(handles, ys, ws, comb, list(range(R)), "push after pulls")
    return "ok"


def _pull_world(path: str, timeout_ns: int, seed: int) -> Tuple[Any, List[Any], List[Any]]:
    """3 ranks with output pools after a gated dispatch: (world, handles, expert outputs)."""
    sys.path.insert(0, SIM_DIR)
    from normal_world import NormalWorld, expert_outputs, load, make_inputs
    R, H, K, E = 3, 256, 4, 12
    w = NormalWorld(load(path), R, H, K, E, 2, 32, 6, pool_bytes=1 << 20, timeout_ns=timeout_ns)
    handles = _gated_dispatch(w, make_inputs(R, [40, 50, 30], H, K, E, False, seed=seed), "dispatch")
    ys, _ = expert_outputs(handles, H, K, seed + 1)
    return w, handles, ys


def case_pull_bad_offer(path: str, field: int) -> str:
    """A rank whose pull offer has fewer rows than the handle says it received (field 5), or whose x runs
    past the pool's end (field 6): every rank records kErrDirectDesc naming it and the field, reads
    nothing, and still ends (the pulled[] exchange runs)."""
    from pyep.ep.normal.errors import BadOutputDescriptor, error_from_record
    w, handles, ys = _pull_world(path, 2_000_000_000, 72)
    R, E = w.R, w.E
    rows1 = handles[1].num_rows
    bad = (1, rows1 - 1, w.pool_lo) if field == 5 else (1, rows1, w.pool_hi - 128)
    comb = w.combine(handles, ys, None, pull=list(range(R)), offers={1: bad})
    for r in range(R):
        assert w.errors()[r] == [ERR_DIRECT_DESC, 1, field, bad[1]], (r, w.errors())
        err = error_from_record(w.errors()[r], E, 1000)
        assert isinstance(err, BadOutputDescriptor) and "rank 1's" in str(err) and "combine" in str(err), err
        assert (comb[r]["out"].float() == 7.0).all(), f"rank {r}: a failed pull wrote its output"
    return "ok"


def case_pull_bad_handle(path: str) -> str:
    """Rank 0's send_head names a position past what rank 1 received: rank 0 records ERR_BAD_HANDLE for
    that channel and reads nothing past rank 1's x; the other tokens' sums are right, the other ranks clean."""
    import torch
    from normal_world import expected_combine
    from pyep.ep.normal.errors import ERR_BAD_HANDLE
    w, handles, ys = _pull_world(path, 2_000_000_000, 76)
    sh = handles[0].send_head
    t = int(torch.nonzero(sh[:, 1] >= 0)[0])
    sh[t, 1] = 1 << 20
    comb = w.combine(handles, ys, None, pull=list(range(w.R)))
    code, channel, left, need = w.errors()[0]
    assert (code, channel, need) == (ERR_BAD_HANDLE, 0, (1 << 20) + 1) and 0 < left < need, w.errors()
    assert w.errors()[1:] == [[0, 0, 0, 0]] * (w.R - 1), w.errors()
    ws0 = [torch.zeros((y.shape[0], 1)) for y in ys]
    want, _ = expected_combine(handles, ys, ws0, 0)   # token t's sum lacks rank 1's row: left out
    others = [i for i in range(sh.shape[0]) if i != t]
    assert torch.equal(comb[0]["out"][others].view(torch.int16), want[others].view(torch.int16)), "rank 0's sums"
    return "ok"


def case_pull_negative_prefix(path: str) -> str:
    """Rank 1's rank_prefix_matrix says rank 0 received -1000 rows from rank 2: the first row of rank 1's
    rows in rank 2's x lies before its start. Rank 1 records ERR_BAD_HANDLE and reads nothing there
    (its tokens from rank 2 are summed without that row); the other ranks are clean."""
    import torch
    from normal_world import expected_combine
    from pyep.ep.normal.errors import ERR_BAD_HANDLE
    w, handles, ys = _pull_world(path, 2_000_000_000, 78)
    kept = int(handles[1].rank_prefix[0, 2])
    handles[1].rank_prefix[0, 2] = -1000
    from_2 = (handles[1].send_head[:, 2] >= 0).nonzero().flatten().tolist()
    assert from_2, "rank 1 sent rank 2 no tokens: the case tests nothing"
    comb = w.combine(handles, ys, None, pull=list(range(w.R)))
    code, _channel, left, need = w.errors()[1]
    assert code == ERR_BAD_HANDLE and left > 1000 and need >= 1, w.errors()
    assert w.errors()[0] == w.errors()[2] == [0, 0, 0, 0], w.errors()
    handles[1].rank_prefix[0, 2] = kept   # the oracle reads the handle's matrices too
    ws0 = [torch.zeros((y.shape[0], 1)) for y in ys]
    want, _ = expected_combine(handles, ys, ws0, 1)
    others = [i for i in range(comb[1]["out"].shape[0]) if i not in from_2]
    assert torch.equal(comb[1]["out"][others].view(torch.int16), want[others].view(torch.int16)), "rank 1's sums"
    return "ok"


def case_pull_silent_rank(path: str) -> str:
    """Rank 2 of 3 runs its combine gate (offering) but never launches the combine kernel: ranks 0 and 1
    read its rows (there since its gate), sum right, then wait for its pulled[] words and give up after
    the timeout with PeerTimeout naming it in the combine phase."""
    w, handles, ys = _pull_world(path, 300_000_000, 74)
    comb = w.combine(handles, ys, None, ranks=[0, 1], pull=list(range(w.R)))
    for r in (0, 1):
        code, peer, phase, _ = w.errors()[r]
        assert (code, peer, phase) == (ERR_PEER_TIMEOUT, 2, PHASES.index("combine")), (r, w.errors())
    _check_pull(w, handles, ys, comb[:2], "the ranks that ran")
    return "ok"


def case_direct_bad_descriptor(path: str) -> str:
    """A rank whose one-copy descriptor points outside its pool: every rank records kErrDirectDesc naming
    it (field 2, recv_x) and moves nothing; no rank waits for rows that will never come."""
    sys.path.insert(0, SIM_DIR)
    from normal_world import NormalWorld, load, make_inputs
    sim = load(path)
    R, H, K, E = 3, 256, 4, 12
    w = NormalWorld(sim, R, H, K, E, 2, 32, 6, pool_bytes=1 << 20, timeout_ns=2_000_000_000)
    w.dispatch(make_inputs(R, [40, 50, 30], H, K, E, False, seed=71), offer=[0, 2], bad_offer=1)
    from pyep.ep.normal.errors import BadOutputDescriptor, error_from_record
    for r in range(R):
        code, peer, field, _ = w.errors()[r]
        assert (code, peer, field) == (ERR_DIRECT_DESC, 1, 2), (r, w.errors())
        err = error_from_record(w.errors()[r], E, 1000)
        assert isinstance(err, BadOutputDescriptor) and "rank 1's" in str(err) and "recv_x" in str(err), err
    return "ok"


def case_direct_lost_path(path: str) -> str:
    """A rank whose record of the one-copy kernel's path (normal_direct.cuh record_path) is overwritten
    before its ring kernel reads it: that rank records kErrLostPath naming itself and the call, and its
    ring kernel moves nothing; the rows the one-copy kernel moved are all there, the other rank is clean."""
    import torch
    sys.path.insert(0, SIM_DIR)
    from normal_world import NormalWorld, check_dispatch, load, make_inputs
    sim = load(path)
    R, H, K, E, C = 2, 256, 4, 8, 2
    w = NormalWorld(sim, R, H, K, E, C, 32, 6, pool_bytes=4 << 20, timeout_ns=2_000_000_000)
    inputs = make_inputs(R, [60, 45], H, K, E, False, seed=91)
    seq = int(w.ws[1][1]) + 1   # kWsSeq of this call (NormalWorld.dispatch advances it)

    def overwrite_rank1_paths() -> None:
        assert int(w.ws[1][1]) == seq
        words = w.bufs[1].view(torch.int32)[w.words["direct"]:]   # layout.control_words: int32 offsets
        for c in range(C):
            for h in range(2):
                at = c * sim.desc_ints + sim.desc_path + 2 * h
                assert int(words[at]) == seq, (c, h, int(words[at]), seq)
                words[at] = seq - 1   # an earlier call's record
    handles, outs = w.dispatch(inputs, between=overwrite_rank1_paths)
    from pyep.ep.normal.errors import LostDispatchPath, error_from_record
    assert w.errors()[0] == [0, 0, 0, 0], w.errors()
    assert w.errors()[1][:3] == [ERR_LOST_PATH, 1, seq], w.errors()
    err = error_from_record(w.errors()[1], E, 1000)
    assert isinstance(err, LostDispatchPath) and f"call {seq}" in str(err) and "rank 1's" in str(err), err
    check_dispatch(inputs, handles, outs, E, "one-copy rows before the lost path")
    return "ok"


CASES = {
    # One-copy dispatch: 2 ranks, and 3 with one of them without tokens; BF16 rows of 8448 bytes go to
    # peers by bulk copy (normal_tma.cuh peer_bulk).
    "direct_two_ranks": (case_direct, (2, [150, 131])),
    "direct_three_ranks_one_empty": (case_direct, (3, [97, 0, 120])),
    "direct_bad_descriptor_is_named": (case_direct_bad_descriptor, ()),
    "direct_lost_path_is_named": (case_direct_lost_path, ()),
    "long_rows_direct": (case_direct, (2, [70, 61], 4224)),
    # Pull combine: 2 ranks, and 3 with one of them without tokens.
    "pull_two_ranks": (case_pull, (2, [150, 131])),
    "pull_three_ranks_one_empty": (case_pull, (3, [97, 0, 120])),
    "pull_short_offer_is_named": (case_pull_bad_offer, (5,)),
    "pull_offer_past_the_pool_is_named": (case_pull_bad_offer, (6,)),
    "pull_send_head_past_a_peers_rows_is_named": (case_pull_bad_handle, ()),
    "pull_negative_prefix_is_named": (case_pull_negative_prefix, ()),
    "pull_silent_rank_is_named": (case_pull_silent_rank, ()),
}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(CASES))
def test_zero_copy_paths(normal_sim_pool: Tuple[Any, str], name: str) -> None:
    """CASES[name] in the simulation's worker process, with a hard timeout."""
    pool, path = normal_sim_pool
    case, args = CASES[name]
    assert pool.run(case, path, *args, timeout_s=500) == ["ok"]
