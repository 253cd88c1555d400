"""The normal mode's intranode dispatch and combine kernels (engine/kernels/normal_dispatch.cu,
normal_combine.cu) on the CPU: compiled as host C++ with one OS thread per GPU thread
(tests/ll_sim/normal_sim.cpp), the ranks of one node in one process, peers' rings reached by direct
stores. Checked against the contract (tests/ll_sim/normal_world.py): BF16 and FP8 rows, top-k ids and
weights mapped to local experts, source indices, combine sums in fp32 in rank order with a bias, rings
that wrap several times, the counters carried from call to call, a rank with no tokens, num_worst_tokens
padding, a cached dispatch, and every L2 hint (normal_launch.h kHint*): a discarded ring line reads back
as poison here, so a discard issued before the last read of a slot changes the data. A rank that never
launches: with the buffer's mask it is marked within the timeout and the others finish with its rows
emptied and their own intact (docs/elastic.md, "Normal mode"); without one the call ends on the timeout
with PeerTimeout naming it. Each case runs in a worker process with a hard timeout (a kernel bug that
deadlocks a barrier must fail the test, not hang CI)."""
from __future__ import annotations

import os
import sys
from typing import Any, Iterator, List

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIM_DIR = os.path.join(ROOT, "tests", "ll_sim")


@pytest.fixture(scope="module")
def sim_pool() -> Iterator[Any]:
    """tests/ll_sim/normal_sim.cpp built (cached by source hash) and a worker to run it in."""
    sys.path.insert(0, SIM_DIR)
    from build import sim_worker
    with sim_worker("normal_sim", ["tests/ll_sim/*.h", "tests/ll_sim/normal_sim.cpp", "engine/kernels/normal_*",
                                   "engine/kernels/ll_common.cuh", "engine/kernels/ll_launch.h",
                                   "engine/mlx5gda/*.h"]) as worker:
        yield worker


# ------------------------------------------------------------------ cases (run in the worker)
def case_rounds(path: str, R: int, sizes: List[int], C: int, Q: int, chunk: int, hints: int, use_tma: int) -> str:
    """BF16 dispatch + combine with a bias, FP8 dispatch + combine, then BF16 again: every output
    against the contract, the rings wrapping, the counters carried over."""
    sys.path.insert(0, SIM_DIR)
    import torch
    from normal_world import NormalWorld, check_dispatch, expected_combine, load, make_inputs
    sim = load(path)
    H, K, E = 256, 4, 4 * R
    w = NormalWorld(sim, R, H, K, E, C, Q, chunk, hints=hints, use_tma=use_tma)
    for i, fp8 in enumerate([False, True, False]):
        what = f"R={R} hints={hints} tma={use_tma} call {i} fp8={fp8}"
        inputs = make_inputs(R, sizes, H, K, E, fp8, seed=100 * R + i)
        handles, outs = w.dispatch(inputs)
        assert w.errors() == [[0, 0, 0, 0]] * R, (what, w.errors())
        check_dispatch(inputs, handles, outs, E, what)
        g = torch.Generator().manual_seed(7 + i)
        ys = [torch.randn((h.num_rows, H), generator=g).to(torch.bfloat16) for h in handles]
        ws = [torch.rand((h.num_rows, K), generator=g) for h in handles]
        bias = [torch.randn((s, H), generator=g).to(torch.bfloat16) for s in sizes] if i == 0 else None
        comb = w.combine(handles, ys, ws, bias)
        assert w.errors() == [[0, 0, 0, 0]] * R, (what, w.errors())
        for r in range(R):
            want, want_w = expected_combine(handles, ys, ws, r, bias[r] if bias else None)
            got = comb[r]["out"]
            bad = (got.view(torch.int16) != want.view(torch.int16)).any(dim=1).nonzero().flatten().tolist()
            assert not bad, f"{what}: rank {r} combined tokens {bad[:8]} differ"
            assert torch.equal(comb[r]["out_weights"], want_w), f"{what}: rank {r} combined weights"
    return "ok"


def case_worst_tokens_and_cached(path: str) -> str:
    """num_worst_tokens: outputs padded past the real count (ids -1, weights 0, source -1); then the
    same routing again as a cached dispatch (payload only, no top-k in or out), FP8; then combine."""
    sys.path.insert(0, SIM_DIR)
    import torch
    from normal_world import NormalWorld, check_dispatch, expected_combine, load, make_inputs
    sim = load(path)
    R, H, K, E = 3, 256, 4, 12
    w = NormalWorld(sim, R, H, K, E, 2, 32, 5, hints=1)
    inputs = make_inputs(R, [70, 45, 88], H, K, E, False, seed=11)
    handles, outs = w.dispatch(inputs, worst=sum(i.topk.shape[0] for i in inputs))
    assert w.errors() == [[0, 0, 0, 0]] * R, w.errors()
    check_dispatch(inputs, handles, outs, E, "num_worst_tokens")
    again = make_inputs(R, [70, 45, 88], H, K, E, True, seed=11)   # same routing, FP8 rows
    for a, b in zip(again, inputs):
        a.topk, a.weights = b.topk, b.weights
    handles, outs = w.dispatch(again, cached=True)
    assert w.errors() == [[0, 0, 0, 0]] * R, w.errors()
    check_dispatch(again, handles, outs, E, "cached FP8")
    g = torch.Generator().manual_seed(12)
    ys = [torch.randn((h.num_rows, H), generator=g).to(torch.bfloat16) for h in handles]
    ws = [torch.rand((h.num_rows, K), generator=g) for h in handles]
    comb = w.combine(handles, ys, ws)
    for r in range(R):
        want, want_w = expected_combine(handles, ys, ws, r)
        assert torch.equal(comb[r]["out"].view(torch.int16), want.view(torch.int16)), f"rank {r}: combine"
        assert torch.equal(comb[r]["out_weights"], want_w), f"rank {r}: combined weights"
    return "ok"


ERR_PEER_TIMEOUT, PHASE_DISPATCH = 3, 1   # normal_launch.h kErrPeerTimeout, kPhaseDispatch


def case_silent_rank(path: str, hints: int) -> str:
    """With a mask, rank 2 of 3 never launches: ranks 0 and 1 mark it within the timeout and finish
    without an error, rows between them intact and rank 2's rows emptied; their combine sums the two
    live ranks; the next call leaves rank 2 out from the start and is correct."""
    sys.path.insert(0, SIM_DIR)
    import torch
    from normal_world import NormalWorld, check_dispatch, expected_combine, load, make_inputs
    sim = load(path)
    R, H, K, E, live = 3, 256, 4, 12, [0, 1]
    w = NormalWorld(sim, R, H, K, E, 2, 32, 8, hints=hints, masked=True, timeout_ns=2_000_000_000)
    inputs = make_inputs(R, [150, 130, 80], H, K, E, False, seed=5)   # > 32 rows a stream: rings fill
    handles, outs = w.dispatch(inputs, ranks=live)
    for r in live:
        assert w.errors()[r] == [0, 0, 0, 0], (r, w.errors())
        assert w.active[r].tolist() == [1, 1, 0], (r, w.active[r].tolist())
        drop = w.dropped[r].tolist()
        assert drop[2] > 0 and drop[:2] == [0, 0], (r, drop)
    check_dispatch(inputs, handles, outs, E, "silent rank 2", ranks=live, gone=[2])
    g = torch.Generator().manual_seed(3)
    ys = [torch.randn((h.num_rows, H), generator=g).to(torch.bfloat16) for h in handles]
    ws = [torch.rand((h.num_rows, K), generator=g) for h in handles]
    comb = w.combine(handles, ys, ws, ranks=live)
    for r in live:
        assert w.errors()[r] == [0, 0, 0, 0], (r, w.errors())
        want, want_w = expected_combine(handles, ys, ws, r, live=live)
        assert torch.equal(comb[r]["out"].view(torch.int16), want.view(torch.int16)), f"rank {r}: combine"
        assert torch.equal(comb[r]["out_weights"], want_w), f"rank {r}: combined weights"
    # The next call: rank 2 sends nothing (its notify would count none), the others skip it.
    inputs = make_inputs(R, [64, 50, 0], H, K, E, True, seed=6)
    handles, outs = w.dispatch(inputs, ranks=live)
    assert [w.errors()[r] for r in live] == [[0, 0, 0, 0]] * 2, w.errors()
    check_dispatch(inputs, handles, outs, E, "rank 2 left out", ranks=live)
    return "ok"


def case_silent_rank_in_combine(path: str) -> str:
    """With a mask, all 3 ranks dispatch, then rank 2 never launches the combine: ranks 0 and 1 mark it
    within the timeout, sum what the two of them hold for each token (rank 2's rows left out, counted
    dropped) and record no error."""
    sys.path.insert(0, SIM_DIR)
    import torch
    from normal_world import NormalWorld, check_dispatch, expected_combine, load, make_inputs
    sim = load(path)
    R, H, K, E, live = 3, 256, 4, 12, [0, 1]
    w = NormalWorld(sim, R, H, K, E, 2, 32, 8, hints=1, masked=True, timeout_ns=2_000_000_000)
    inputs = make_inputs(R, [110, 96, 40], H, K, E, False, seed=21)
    handles, outs = w.dispatch(inputs)
    assert w.errors() == [[0, 0, 0, 0]] * R, w.errors()
    check_dispatch(inputs, handles, outs, E, "all three")
    g = torch.Generator().manual_seed(22)
    ys = [torch.randn((h.num_rows, H), generator=g).to(torch.bfloat16) for h in handles]
    ws = [torch.rand((h.num_rows, K), generator=g) for h in handles]
    comb = w.combine(handles, ys, ws, ranks=live)
    for r in live:
        assert w.errors()[r] == [0, 0, 0, 0], (r, w.errors())
        assert w.active[r].tolist() == [1, 1, 0], (r, w.active[r].tolist())
        routed = int(handles[r].in_rank[r][:, 2].sum())
        assert w.dropped[r].tolist() == [0, 0, routed], (r, w.dropped[r].tolist(), routed)
        want, want_w = expected_combine(handles, ys, ws, r, live=live)
        assert torch.equal(comb[r]["out"].view(torch.int16), want.view(torch.int16)), f"rank {r}: combine"
        assert torch.equal(comb[r]["out_weights"], want_w), f"rank {r}: combined weights"
    return "ok"


def case_silent_rank_without_mask(path: str) -> str:
    """Without a mask a peer that never launches ends the call on the timeout with PeerTimeout naming
    it and the dispatch phase (the error record), never a hang."""
    sys.path.insert(0, SIM_DIR)
    from normal_world import NormalWorld, load, make_inputs
    sim = load(path)
    R, H, K, E = 2, 256, 4, 8
    w = NormalWorld(sim, R, H, K, E, 2, 32, 8, timeout_ns=1_000_000_000)
    w.dispatch(make_inputs(R, [120, 100], H, K, E, False, seed=8), ranks=[0])
    code, peer, phase, channel = w.errors()[0]
    assert (code, peer, phase) == (ERR_PEER_TIMEOUT, 1, PHASE_DISPATCH) and 0 <= channel < 2, w.errors()[0]
    return "ok"


# ------------------------------------------------------------------ tests
@pytest.mark.timeout(600)
@pytest.mark.parametrize("hints", [0, 1, 7])
def test_two_ranks_rings_wrap(sim_pool, hints):
    """2 ranks, 2 channels of 32-row rings fed 8 rows a chunk: ~70 rows a stream, every ring wraps."""
    pool, path = sim_pool
    assert pool.run(case_rounds, path, 2, [150, 131], 2, 32, 8, hints, 1, timeout_s=500) == ["ok"]


@pytest.mark.timeout(600)
def test_three_ranks_one_empty_warp_copies(sim_pool):
    """3 ranks (one without tokens), 3 channels, the receiver's warp copies instead of bulk copies,
    rings dropping their lines once read."""
    pool, path = sim_pool
    assert pool.run(case_rounds, path, 3, [97, 0, 120], 3, 32, 6, 1, 0, timeout_s=500) == ["ok"]


@pytest.mark.timeout(600)
def test_four_ranks_every_hint(sim_pool):
    """4 ranks with one warp per peer group, every hint on."""
    pool, path = sim_pool
    assert pool.run(case_rounds, path, 4, [64, 80, 33, 72], 2, 32, 4, 7, 1, timeout_s=500) == ["ok"]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("hints", [0, 1])
def test_silent_rank_with_mask_is_marked(sim_pool, hints):
    pool, path = sim_pool
    assert pool.run(case_silent_rank, path, hints, timeout_s=500) == ["ok"]


@pytest.mark.timeout(600)
def test_silent_rank_without_mask_is_named(sim_pool):
    pool, path = sim_pool
    assert pool.run(case_silent_rank_without_mask, path, timeout_s=500) == ["ok"]


@pytest.mark.timeout(600)
def test_worst_tokens_then_cached_dispatch(sim_pool):
    pool, path = sim_pool
    assert pool.run(case_worst_tokens_and_cached, path, timeout_s=500) == ["ok"]


@pytest.mark.timeout(600)
def test_silent_rank_in_combine_is_marked(sim_pool):
    pool, path = sim_pool
    assert pool.run(case_silent_rank_in_combine, path, timeout_s=500) == ["ok"]
