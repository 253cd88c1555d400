"""The normal mode's intranode dispatch and combine kernels (engine/kernels/normal_dispatch.cu,
normal_combine.cu) on the CPU: compiled as host C++ with one OS thread per GPU thread
(tests/ll_sim/normal_sim.cpp), the ranks of one node in one process, peers' rings reached by direct
stores. Checked against the contract (tests/ll_sim/normal_world.py): BF16 and FP8 rows, top-k ids and
weights mapped to local experts, source indices, combine sums in fp32 in rank order with a bias, rings
that wrap several times, the counters carried from call to call, a rank with no tokens, and every L2
hint (normal_launch.h kHint*): a discarded ring line reads back as poison here, so a discard issued
before the last read of a slot changes the data. Each case runs in a worker process with a hard
timeout (a kernel bug that deadlocks a barrier must fail the test, not hang CI)."""
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
