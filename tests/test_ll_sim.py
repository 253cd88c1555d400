"""The low-latency EP kernels (engine/kernels/ll_*.cu) on the CPU: compiled as host C++ with one OS thread
per GPU thread (tests/ll_sim), several ranks in one process, peers connected by direct stores (the
NVLink/local path) or through qp.h queue pairs executed by a simulated NIC (the IBGDA path). Checked
against a brute-force oracle and pyep.ep.fp8: slot assignment, packed layout, headers, FP8 bits in all
scale modes, combine sums, both buffer halves, split send/receive launches, the timeout marking a
silent rank, a rejoin, the device-side check of expert ids (the error record, bad entries routed
as -1), the LogFMT combine and the per-source wait statistics; a handle combined again is
tests/test_ll_sim_repeat.py. Each case runs in a worker process with a hard timeout (a kernel bug that
deadlocks a barrier must fail the test, not hang CI)."""
from __future__ import annotations

import os
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIM_DIR = os.path.join(ROOT, "tests", "ll_sim")


# ------------------------------------------------------------------ cases (run in the worker)
def case_matrix(path: str, R: int, shape, grid: int, nic: str) -> str:
    sys.path.insert(0, SIM_DIR)
    from world import World, checked_round, load, nic_pairs, rank_inputs
    sim = load(path)
    T, H, E, K = shape
    softnic = nic.startswith("softnic")
    nic = nic.split("-")[-1]
    w = World(sim, R, T, H, E, max(K, 2), grid, nic_pairs=nic_pairs(R, nic), softnic=softnic)
    modes = [(False, False, False), (True, False, False), (True, True, False), (True, True, True)]
    routings = ["uniform", "sparse", "one", "hot"]
    for i, (mode, routing) in enumerate(zip(modes, routings)):
        n = [T if (i + r) % 3 else max(0, T - 1 - r) for r in range(R)]
        checked_round(w, rank_inputs(R, T, H, E, K, 10 + i, routing, n), i % 2,
                      f"{nic} round {i} {routing} fp8={mode}", mode, phases=1 if i == 2 else 3)
    # Both halves in flight: two dispatches, then both combines.
    a, b = rank_inputs(R, T, H, E, K, 30), rank_inputs(R, T, H, E, K, 31)
    from world import check_combine, check_dispatch, expert_outputs
    oa = w.dispatch(a, 0, wait_stats=True)     # timing the waits changes no output bit
    ob = w.dispatch(b, 1)
    for r in range(R):
        check_dispatch(w, a, oa, r, [True] * R, False, False, False, f"in-flight A rank {r}")
        check_dispatch(w, b, ob, r, [True] * R, False, False, False, f"in-flight B rank {r}")
    ya, yb = expert_outputs(w, oa, False, False, 5), expert_outputs(w, ob, False, False, 6)
    ca, cb = w.combine(ya, a, oa, 0, wait_stats=True), w.combine(yb, b, ob, 1)
    for r in range(R):
        check_combine(w, a, ya, ca, r, [True] * R, f"in-flight A rank {r}")
        check_combine(w, b, yb, cb, r, [True] * R, f"in-flight B rank {r}")
    if w.nic is not None:
        assert not w.nic.errors(), w.nic.errors()
        assert w.nic.executed() > 100, w.nic.executed()
        if softnic:
            w.nic.close()
    return "ok"


def case_timeout(path: str, nic: str) -> str:
    """Rank 2 of 3 stays silent: ranks 0 and 1 finish within the timeout, mark it, skip it afterwards
    without waiting (it accrues no receive wait); after a rejoin all three run normally again. The live
    ranks' sends complete before their receives start, so on a loaded machine the short timeout still
    falls on the silent rank only."""
    sys.path.insert(0, SIM_DIR)
    from world import World, checked_round, load, rank_inputs
    sim = load(path)
    R, T, H, E, K = 3, 4, 256, 6, 2
    w = World(sim, R, T, H, E, K, 2, nic_pairs=[(0, 2), (1, 2)] if nic == "nic" else [])
    checked_round(w, rank_inputs(R, T, H, E, K, 50), 0, "healthy")
    live, mask = [0, 1], [True, True, False]
    inputs = rank_inputs(R, T, H, E, K, 51)
    outs = w.dispatch(inputs, 1, ranks=live, phases=1)
    t0 = time.monotonic()
    w.dispatch(inputs, 1, ranks=live, timeout_ns=300_000_000, phases=2, outs=outs)
    took = time.monotonic() - t0
    assert took >= 0.3, f"the silent rank's timeout took {took:.3f} s"
    for r in live:
        assert w.active[r].tolist() == [1, 1, 0], f"rank {r} active_ranks {w.active[r].tolist()}"
    from world import check_combine, check_dispatch, expert_outputs
    for r in live:
        check_dispatch(w, inputs, outs, r, mask, False, False, False, f"degraded rank {r}")
    ys = expert_outputs(w, outs, False, False, 9)
    comb = w.combine(ys, inputs, outs, 1, ranks=live, phases=1)
    w.combine(ys, inputs, outs, 1, ranks=live, timeout_ns=300_000_000, phases=2, outs=comb, wait_stats=True)
    for r in live:
        check_combine(w, inputs, ys, comb, r, mask, f"degraded rank {r}")
    checked_round(w, rank_inputs(R, T, H, E, K, 52), 0, "degraded again", active=mask, ranks=live)
    w.dispatch(rank_inputs(R, T, H, E, K, 53), 1, ranks=live, wait_stats=True)
    for r in live:   # the marked rank is not waited for again: no receive wait accrues for it
        assert int(w.wait_stats["dispatch"][r][2]) == 0 and int(w.wait_stats["combine"][r][2]) == 0, \
            f"rank {r} waited for the marked rank: {w.wait_stats['dispatch'][r].tolist()}"
    w.rejoin()
    checked_round(w, rank_inputs(R, T, H, E, K, 53), 0, "after rejoin")
    checked_round(w, rank_inputs(R, T, H, E, K, 54), 1, "after rejoin, other half")
    return "ok"


# ------------------------------------------------------------------ tests
MATRIX = [
    (1, (4, 256, 4, 3), 2, "none"),
    (2, (6, 384, 8, 3), 2, "none"),
    (3, (5, 256, 6, 4), 3, "none"),
    (2, (4, 2048, 4, 2), 2, "none"),
    (2, (6, 384, 8, 3), 2, "all"),
    (4, (3, 256, 8, 3), 1, "cross"),
    (2, (4, 384, 8, 3), 2, "softnic-all"),
    (4, (3, 256, 8, 2), 1, "softnic-cross"),
    (2, (4, 384, 12, 10), 2, "none"),      # K > 8: the reduce's second batch of slots
    (2, (3, 5120, 4, 3), 2, "none"),       # rows over one combine send item (8 KiB), the last one partial
    (2, (3, 5120, 4, 3), 2, "softnic-all"),
]



@pytest.mark.parametrize("R,shape,grid,nic", MATRIX)
def test_kernels_match_oracle(ll_sim_pool, R, shape, grid, nic):
    from world import has_softnic
    if nic.startswith("softnic") and not has_softnic():
        pytest.skip("pyep._engine has no softnic in this build")
    pool, path = ll_sim_pool
    assert pool.run(case_matrix, path, R, shape, grid, nic, timeout_s=240) == ["ok"]


def case_bench_routings(path: str, nic: str) -> str:
    """The benchmark's skewed routings (Zipf, a hot expert): the hottest experts get a row from nearly
    every token of every rank, up to T per (expert, source)."""
    sys.path.insert(0, SIM_DIR)
    from world import World, checked_round, load, rank_inputs
    sim = load(path)
    R, T, H, E, K = 4, 24, 256, 16, 6
    pairs = [] if nic == "none" else [(i, j) for i in range(R) for j in range(i + 1, R) if (i < 2) != (j < 2)]
    w = World(sim, R, T, H, E, K, 2, nic_pairs=pairs)
    for i, routing in enumerate(["zipf", "bench-hot"]):
        inputs = rank_inputs(R, T, H, E, K, 60 + i, routing)
        hottest = max(sum(int((t[1] == e).any(dim=1).sum()) for t in inputs) for e in range(E))
        want = R * T // 2 if routing == "zipf" else R * T // 4    # hot: a quarter of the tokens, at least
        assert hottest > want, f"{routing}: routing is not skewed ({hottest} rows on the hottest expert)"
        checked_round(w, inputs, i % 2, f"{nic} {routing}", (i == 1, False, False))
    return "ok"


@pytest.mark.parametrize("nic", ["none", "cross"])
def test_bench_routings(ll_sim_pool, nic):
    pool, path = ll_sim_pool
    assert pool.run(case_bench_routings, path, nic, timeout_s=240) == ["ok"]


@pytest.mark.parametrize("nic", ["direct", "nic"])
def test_silent_rank_times_out_and_rejoins(ll_sim_pool, nic):
    pool, path = ll_sim_pool
    assert pool.run(case_timeout, path, nic, timeout_s=240) == ["ok"]


def case_bad_ids(path: str, nic: str) -> str:
    """Bad expert ids on the device: the first bad entry (row-major) of each rank's dispatch lands in
    its error record with the right (row, k, value), the bad entries are routed as -1 (dispatch and
    combine equal the oracle on the sanitised routing, so every good entry is unchanged), the record
    keeps the first error until the host clears it, and then records the next one."""
    sys.path.insert(0, SIM_DIR)
    import torch
    from world import World, check_combine, check_dispatch, expert_outputs, load, rank_inputs
    from pyep.ep.ll.errors import DuplicateExpertIndex, InvalidExpertIndex, error_from_record
    from pyep.ep.ll.validate import sanitize_topk
    sim = load(path)
    # K = 3 does not divide a warp: row 10 (entries 30..32) straddles two warps; 144 entries take the
    # routing pass past its two preloaded rounds (64 threads per simulated block); 2 blocks send
    # tokens >= 2 through the per-token rank pass.
    R, T, H, E, K = 2, 48, 256, 8, 3
    w = World(sim, R, T, H, E, K, 2, nic_pairs=[(0, 1)] if nic == "nic" else [])

    def run(inputs, half):
        clean = [(x, sanitize_topk(t, E), wt) for x, t, wt in inputs]
        outs = w.dispatch(inputs, half)
        for r in range(R):
            check_dispatch(w, clean, outs, r, [True] * R, False, False, False, f"bad ids rank {r}")
        ys = expert_outputs(w, outs, False, False, seed=half + 11)
        comb = w.combine(ys, inputs, outs, half)
        for r in range(R):
            check_combine(w, clean, ys, comb, r, [True] * R, f"bad ids rank {r}")

    def record(r):
        return error_from_record(w.errs[r].tolist(), E)

    inputs = rank_inputs(R, T, H, E, K, 70)
    t0, t1 = inputs[0][1], inputs[1][1]
    t0[5, 1] = E                       # rank 0: first bad entry, out of range
    t0[10, 2] = t0[10, 0]              # a repeat across the warp boundary
    t0[40, 1] = -5
    t1[3, 0] = -(2 ** 33) - 7          # rank 1: needs both record words
    t1[10, 2] = t1[10, 0]
    t1[47, 1] = t1[47, 0]
    run(inputs, 0)
    e0, e1 = record(0), record(1)
    assert type(e0) is InvalidExpertIndex and (e0.row, e0.k, e0.value) == (5, 1, E), e0
    assert type(e1) is InvalidExpertIndex and (e1.row, e1.k, e1.value) == (3, 0, -(2 ** 33) - 7), e1

    # Not cleared yet: a later dispatch with other bad ids leaves the first error in place.
    inputs = rank_inputs(R, T, H, E, K, 71)
    inputs[0][1][20, 0] = 99
    run(inputs, 1)
    assert (record(0).row, record(0).k, record(0).value) == (5, 1, E)
    # Cleared by the host: the next bad entry is recorded -- here a repeat in a straddling row (rank
    # 0) and in a token of the per-token pass (rank 1); good rounds record nothing.
    for r in range(R):
        w.errs[r][0] = 0
    inputs = rank_inputs(R, T, H, E, K, 72)
    run(inputs, 0)
    assert record(0) is None and record(1) is None
    inputs = rank_inputs(R, T, H, E, K, 73)
    inputs[0][1][10, 2] = inputs[0][1][10, 0]
    inputs[1][1][45, 2] = inputs[1][1][45, 1]
    inputs[1][1][46, 0] = E + 3
    run(inputs, 1)
    d0, d1 = record(0), record(1)
    assert type(d0) is DuplicateExpertIndex and (d0.row, d0.k, d0.first_k) == (10, 2, 0), d0
    assert d0.value == int(inputs[0][1][10, 0])
    assert type(d1) is DuplicateExpertIndex and (d1.row, d1.k, d1.first_k) == (45, 2, 1), d1
    if w.nic is not None:
        assert not w.nic.errors(), w.nic.errors()
    return "ok"


@pytest.mark.parametrize("nic", ["direct", "nic"])
def test_bad_expert_ids_recorded_and_routed_as_minus_one(ll_sim_pool, nic):
    pool, path = ll_sim_pool
    assert pool.run(case_bad_ids, path, nic, timeout_s=240) == ["ok"]


def _logfmt_outputs(w, seed: int):
    """Expert outputs that exercise every LogFMT case: most groups cast (|y| < 1), some groups sent
    as bf16 (a value >= 1, all equal, all zero), zeros and bf16 subnormals inside cast groups."""
    import torch
    ys = []
    for r in range(w.R):
        g = torch.Generator().manual_seed(seed * 37 + r)
        y = torch.randn(w.e_l, w.R * w.T, w.H, generator=g) * 0.2
        y = y.reshape(-1, w.H // 128, 128)
        pick = torch.rand(y.shape[:2], generator=g)
        y[pick < 0.10] *= 40.0                              # over 1: bf16 group
        y[(pick >= 0.10) & (pick < 0.14)] = 0.25            # amin == amax: bf16 group
        y[(pick >= 0.14) & (pick < 0.17)] = 0.0             # all zero: bf16 group
        y[(pick >= 0.17) & (pick < 0.25), 3] = 0.0          # a zero: lowest level 32 octaves down
        y[(pick >= 0.25) & (pick < 0.30), 5] = 1e-39        # a subnormal counts as 0
        y[(pick >= 0.30) & (pick < 0.35)] *= 1e-30          # tiny, still normal
        ys.append(y.reshape(w.e_l, w.R * w.T, w.H).to(torch.bfloat16))
    return ys


def case_logfmt(path: str, R: int, shape, grid: int, nic: str) -> str:
    """use_logfmt combine: the kernel's output equals the reference (pyep.ep.ll.logfmt encode + decode, then
    the same fp32 reduce) bit for bit, for several routings, both halves, split launches, with store
    peers and with NIC peers (the packed, shorter RDMA write)."""
    sys.path.insert(0, SIM_DIR)
    from world import World, check_combine, check_dispatch, load, nic_pairs, rank_inputs
    sim = load(path)
    T, H, E, K = shape
    softnic = nic.startswith("softnic")
    nic = nic.split("-")[-1]
    w = World(sim, R, T, H, E, max(K, 2), grid, nic_pairs=nic_pairs(R, nic), softnic=softnic)
    for i, routing in enumerate(["uniform", "sparse", "hot", "zipf", "one"]):
        n = [T if (i + r) % 3 else max(0, T - 1 - r) for r in range(R)]
        inputs = rank_inputs(R, T, H, E, K, 80 + i, routing, n)
        half = i % 2
        outs = w.dispatch(inputs, half)
        for r in range(R):
            check_dispatch(w, inputs, outs, r, [True] * R, False, False, False, f"logfmt {routing} rank {r}")
        ys = _logfmt_outputs(w, 90 + i)
        if i == 2:   # the hook path
            w.combine(ys, inputs, outs, half, phases=1, use_logfmt=True)
            comb = w.combine(ys, inputs, outs, half, phases=2, use_logfmt=True)
        else:
            comb = w.combine(ys, inputs, outs, half, use_logfmt=True)
        for r in range(R):
            check_combine(w, inputs, ys, comb, r, [True] * R, f"logfmt {nic} {routing} rank {r}", use_logfmt=True)
    if w.nic is not None:
        assert not w.nic.errors(), w.nic.errors()
        if softnic:
            w.nic.close()
    return "ok"


LOGFMT = [
    (2, (6, 512, 8, 3), 2, "none"),
    (3, (5, 1024, 6, 4), 2, "none"),
    (2, (4, 1536, 4, 2), 1, "all"),
    (4, (3, 512, 8, 3), 1, "cross"),
    (2, (4, 512, 8, 3), 2, "softnic-all"),
]


@pytest.mark.parametrize("R,shape,grid,nic", LOGFMT)
def test_logfmt_combine_matches_reference_bits(ll_sim_pool, R, shape, grid, nic):
    from world import has_softnic
    if nic.startswith("softnic") and not has_softnic():
        pytest.skip("pyep._engine has no softnic in this build")
    pool, path = ll_sim_pool
    assert pool.run(case_logfmt, path, R, shape, grid, nic, timeout_s=300) == ["ok"]


def _word(w, rank: int, kernel: int, src: int, half: int = 1) -> bool:
    """Whether every signal word src sends `rank` in the call on `half` is complete (kernel 0: the count
    words; 1: the combine flag, which a NIC peer completes with one add per QP)."""
    import torch
    lay, buf = w.lay, w.bufs[rank]

    def word(off: int) -> int:
        return int(buf[off:off + 4].view(torch.int32)) & 0x7FFF
    if kernel == 0:
        return all(word(lay.dsig_offset(half, le, src)) != 0 for le in range(w.e_l))
    return word(lay.csig_offset(half, src)) >= int(w.tables[rank]["flag_expect"][src])


def case_wait_stats(path: str, nic: str) -> str:
    """dispatch/combine wait_stats (DeepEP's *_wait_recv_cost_stats): each receive adds, per source, the
    nanoseconds it waited for that source, into the caller's int64 [R]. Ranks 0 and 1 send, then wait in
    their receive; rank 2 starts `delay` after their receive began polling (seen in the kernels' trace
    stamps, so a loaded machine cannot shorten the wait by starting the pollers late). They accrue about
    `delay` for source 2 and exactly 0 for each other and themselves (those words were there at the
    first poll), while rank 2 finds everything there and adds exactly 0 everywhere. A silent source
    accrues about the timeout once, then nothing while it is inactive; the tensors accumulate over
    calls; a call without wait_stats leaves them alone."""
    sys.path.insert(0, SIM_DIR)
    import threading

    import torch
    from world import World, check_combine, check_dispatch, checked_round, expert_outputs, load, rank_inputs
    from pyep.ep.ll.trace import POINTS
    sim = load(path)
    R, T, H, E, K = 3, 4, 256, 6, 2
    w = World(sim, R, T, H, E, K, 2, nic_pairs=[(0, 2), (1, 2)] if nic == "nic" else [])
    ds, cs = w.wait_stats["dispatch"], w.wait_stats["combine"]
    checked_round(w, rank_inputs(R, T, H, E, K, 55), 0, "untimed")             # no wait_stats: nothing added
    assert all(int(t.abs().sum()) == 0 for t in ds + cs)
    delay, early, late = 0.4, [0, 1], [2]
    recv_begin = POINTS.index("recv_begin")

    def late_source(kernel: int, call) -> None:
        """call(ranks, phases): ranks 0, 1 send; their receive runs in a thread; once every block of it
        has begun (trace stamps), `delay` later, rank 2 sends and receives."""
        call(early, 1)
        for tr in w.traces:
            tr.zero_()
        errors = []

        def receive() -> None:
            try:
                call(early, 2)
            except BaseException as exc:  # noqa: BLE001 - re-raised below
                errors.append(exc)
        th = threading.Thread(target=receive)
        th.start()
        deadline = time.monotonic() + 120
        # Until the early ranks' receive has begun, and their signals (through the NIC too) are in rank
        # 2's buffer: rank 2 then finds them at its first poll however loaded the machine is.
        while not (all(bool((w.traces[r][kernel, :, recv_begin] != 0).all()) for r in early)
                   and all(_word(w, 2, kernel, src) for src in early)):
            assert time.monotonic() < deadline and th.is_alive(), "the early ranks' receive never began"
            time.sleep(0.001)
        time.sleep(delay)
        call(late, 1)
        call(late, 2)
        th.join()
        if errors:
            raise errors[0]

    inputs = rank_inputs(R, T, H, E, K, 56)
    outs = w.dispatch_outputs()
    late_source(0, lambda ranks, ph: w.dispatch(inputs, 1, ranks=ranks, outs=outs, wait_stats=True, phases=ph))
    for r in range(R):
        check_dispatch(w, inputs, outs, r, [True] * R, False, False, False, f"staggered dispatch rank {r}")
    ys = expert_outputs(w, outs, False, False, 12)
    comb = w.combine_outputs(inputs)
    late_source(1, lambda ranks, ph: w.combine(ys, inputs, outs, 1, ranks=ranks, wait_stats=True, phases=ph, outs=comb))
    for r in range(R):
        check_combine(w, inputs, ys, comb, r, [True] * R, f"staggered combine rank {r}")
    ns = int(delay * 1e9)
    for kind, st in (("dispatch", ds), ("combine", cs)):
        for r in early:
            got = st[r].tolist()
            assert got[2] >= int(0.75 * ns), f"{kind} rank {r}: waited {got[2]} ns for the late rank 2"
            assert got[0] == 0 and got[1] == 0, f"{kind} rank {r}: {got} (ranks 0, 1 were there at the first poll)"
        assert st[2].tolist() == [0, 0, 0], f"{kind} rank 2 found everything there, yet waited: {st[2].tolist()}"
    before = [t.clone() for t in ds + cs]

    # Rank 2 is silent: ranks 0 and 1 add about the timeout for it, once, and nothing afterwards. Their
    # sends complete before their receives, so the short timeout can only fall on the silent rank.
    timeout = 300_000_000
    inputs = rank_inputs(R, T, H, E, K, 57)
    outs = w.dispatch(inputs, 0, ranks=early, phases=1)
    w.dispatch(inputs, 0, ranks=early, timeout_ns=timeout, wait_stats=True, phases=2, outs=outs)
    ys = expert_outputs(w, outs, False, False, 13)
    comb = w.combine(ys, inputs, outs, 0, ranks=early, phases=1)
    w.combine(ys, inputs, outs, 0, ranks=early, timeout_ns=timeout, wait_stats=True, phases=2, outs=comb)
    for kind, st, i in (("dispatch", ds, 0), ("combine", cs, R)):
        for r in early:
            added = (st[r] - before[i + r]).tolist()
            assert w.active[r].tolist() == [1, 1, 0]
            if kind == "dispatch":
                assert timeout <= added[2] < timeout + 5_000_000_000, f"{kind} rank {r}: timed-out source {added}"
            else:   # combine never waits for a source the dispatch already marked inactive
                assert added[2] == 0, f"{kind} rank {r}: inactive source accrued {added}"
    mid = [t.clone() for t in ds + cs]
    checked_round(w, rank_inputs(R, T, H, E, K, 58), 1, "degraded", active=[True, True, False], ranks=early)
    outs = w.dispatch(rank_inputs(R, T, H, E, K, 59), 0, ranks=early, wait_stats=True)
    for r in early:
        assert int(ds[r][2]) == int(mid[r][2]), f"rank {r}: an inactive source accrued wait"
        assert (ds[r] >= mid[r]).all(), "the stats only ever grow"
    return "ok"


@pytest.mark.parametrize("nic", ["direct", "nic"])
def test_wait_stats_per_source(ll_sim_pool, nic):
    pool, path = ll_sim_pool
    assert pool.run(case_wait_stats, path, nic, timeout_s=240) == ["ok"]
