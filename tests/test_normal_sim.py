"""The normal mode's intranode kernels (engine/kernels/normal_notify.cu, normal_dispatch.cu,
normal_combine.cu) on the CPU: compiled as host C++ with one OS thread per GPU thread
(tests/ll_sim/normal_sim.cpp), the ranks of one node in one process, peers' rings reached by direct
stores. The layout, route and gate kernels build the handle the contract gives (prefix matrices,
send_head, host-visible counts with expert alignment), and the rows follow it; the other cases take
the handle from the contract directly. Checked against the contract (tests/ll_sim/normal_world.py): BF16 and FP8 rows, top-k ids and
weights mapped to local experts, source indices, combine sums in fp32 in rank order with a bias, rings
that wrap several times, the counters carried from call to call, a rank with no tokens, num_worst_tokens
padding, a cached dispatch, the receiver's bulk copies and its warp copies. A rank that never
launches: with the buffer's mask it is marked within the timeout and the others finish with its rows
emptied and their own intact (docs/elastic.md, "Normal mode"); without one the call ends on the timeout
with PeerTimeout naming it. A live rank stalled behind a dead one (its combine waiting out the timeout)
is not marked by a peer waiting for it in the next call's gate: waiting ranks beat a heartbeat
(normal_common.cuh PeerClock). A call one rank refuses at its gate is void on every rank: tag records
naming it, no row moved, the next call right. The launchers' host checks (check_static, check_rings)
refuse rings that do not fit and too many channels. Pull combine (normal_pull.cuh) through the real gate:
the sums, the rings untouched, the pulled[] words, offers that are too short or run past the pool, a
rank that offers and never launches. Each case runs in a worker process with a hard
timeout (a kernel bug that deadlocks a barrier must fail the test, not hang CI)."""
from __future__ import annotations

import os
import sys
from typing import Any, Callable, Dict, List, Optional, Tuple

import pytest

from pyep.ep.normal.errors import ERR_DIRECT_DESC, ERR_LOST_PATH, ERR_PEER_TIMEOUT, PHASES

PHASE_DISPATCH = PHASES.index("dispatch")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIM_DIR = os.path.join(ROOT, "tests", "ll_sim")


# ------------------------------------------------------------------ cases (run in the worker)
def case_rounds(path: str, R: int, sizes: List[int], C: int, Q: int, chunk: int, use_tma: int,
                H: int = 256) -> str:
    """BF16 dispatch + combine with a bias, FP8 dispatch + combine with row-major then column-major
    scales (read in place), then BF16 again: every output against the contract, the rings wrapping, the
    counters carried over."""
    sys.path.insert(0, SIM_DIR)
    import torch
    from normal_world import NormalWorld, check_combine, check_dispatch, expert_outputs, load, make_inputs
    sim = load(path)
    K, E = 4, 4 * R
    w = NormalWorld(sim, R, H, K, E, C, Q, chunk, use_tma=use_tma)
    for i, (fp8, colmajor) in enumerate([(False, False), (True, False), (True, True), (False, False)]):
        what = f"R={R} tma={use_tma} call {i} fp8={fp8} colmajor={colmajor}"
        inputs = make_inputs(R, sizes, H, K, E, fp8, seed=100 * R + i, colmajor=colmajor)
        handles, outs = w.dispatch(inputs)
        assert w.errors() == [[0, 0, 0, 0]] * R, (what, w.errors())
        check_dispatch(inputs, handles, outs, E, what)
        ys, ws = expert_outputs(handles, H, K, 7 + i)
        g = torch.Generator().manual_seed(17 + i)
        bias = [torch.randn((s, H), generator=g).to(torch.bfloat16) for s in sizes] if i == 0 else None
        comb = w.combine(handles, ys, ws, bias)
        assert w.errors() == [[0, 0, 0, 0]] * R, (what, w.errors())
        check_combine(handles, ys, ws, comb, list(range(R)), what, bias)
    return "ok"


def case_worst_tokens_and_cached(path: str) -> str:
    """num_worst_tokens: outputs padded past the real count (ids -1, weights 0, source -1); then the
    same routing again as a cached dispatch (payload only, no top-k in or out), FP8; then combine."""
    sys.path.insert(0, SIM_DIR)
    from normal_world import NormalWorld, check_combine, check_dispatch, expert_outputs, load, make_inputs
    sim = load(path)
    R, H, K, E = 3, 256, 4, 12
    w = NormalWorld(sim, R, H, K, E, 2, 32, 5)
    inputs = make_inputs(R, [70, 45, 88], H, K, E, False, seed=11)
    handles, outs = w.dispatch(inputs, worst=sum(i.topk.shape[0] for i in inputs))
    assert w.errors() == [[0, 0, 0, 0]] * R, w.errors()
    check_dispatch(inputs, handles, outs, E, "num_worst_tokens")
    again = make_inputs(R, [70, 45, 88], H, K, E, True, seed=11, colmajor=True)   # same routing, FP8 rows
    for a, b in zip(again, inputs):
        a.topk, a.weights = b.topk, b.weights
    handles, outs = w.dispatch(again, cached=True)
    assert w.errors() == [[0, 0, 0, 0]] * R, w.errors()
    check_dispatch(again, handles, outs, E, "cached FP8")
    ys, ws = expert_outputs(handles, H, K, 12)
    check_combine(handles, ys, ws, w.combine(handles, ys, ws), list(range(R)), "after the cached dispatch")
    return "ok"


def _adopt(handle: Any, notified: dict, me: int) -> None:
    """The kernels' handle in place of the contract's (after check_notify found them equal)."""
    handle.rank_prefix, handle.channel_prefix = notified["rpm"], notified["cpm"]
    handle.recv_channel_prefix, handle.send_head = notified["rcp"], notified["send_head"]
    handle.in_rank[me] = notified["in_rank"]


def check_notify(inputs: List[Any], handles: List[Any], notified: List[dict], E: int, what: str,
                 ranks: List[int], alignment: int = 1, layout_ranks: Optional[Dict[int, List[int]]] = None) -> None:
    """The layout, route and notify kernels' outputs of `ranks` against the contract (contract.py): the
    handle's against `handles` (a rank outside `ranks` is out of the call: no stream, its experts count
    nothing); the layout tensors against the ranks rank r's mask held when its layout ran
    (`layout_ranks[r]`, `ranks` by default): a rank the gate left out later is the dispatch's to drop."""
    import torch
    from normal_world import Handle
    R = len(inputs)
    El = E // R

    def valid(ids: "torch.Tensor", live: List[int]) -> "torch.Tensor":
        ids = ids[ids >= 0]
        return ids[torch.isin(ids // El, torch.tensor(live))]
    for me in ranks:
        h, o = handles[me], notified[me]
        at_layout = (layout_ranks or {}).get(me, ranks)
        ir = Handle(inputs, me, R, E, h.channel_prefix.shape[1], live=at_layout).in_rank[me]
        assert torch.equal(o["in_rank"], ir), f"{what}: rank {me} is_token_in_rank"
        assert o["per_rank"].tolist() == ir.sum(dim=0).tolist(), f"{what}: rank {me} num_tokens_per_rank"
        ids = valid(inputs[me].topk, at_layout)
        assert o["per_expert"].tolist() == torch.bincount(ids, minlength=E).tolist(), f"{what}: rank {me} per expert"
        for name, want in (("rpm", h.rank_prefix), ("cpm", h.channel_prefix), ("rcp", h.recv_channel_prefix),
                           ("send_head", h.send_head)):
            assert torch.equal(o[name], want), f"{what}: rank {me} {name}\n{o[name]}\n!=\n{want}"
        assert (o["ready"], o["rows"]) == (1, h.num_rows), (what, me, o["ready"], o["rows"], h.num_rows)
        want_e = [0] * El
        for s in ranks:
            ids = valid(inputs[s].topk, ranks)
            for e in range(El):
                want_e[e] += int((ids == me * El + e).sum())
        want_e = [(v + alignment - 1) // alignment * alignment for v in want_e]
        assert o["expert_rows"] == want_e, (what, me, o["expert_rows"], want_e)


def case_notify_pipeline(path: str) -> str:
    """layout -> route + gate (notify) -> dispatch -> combine, all by the kernels, three calls: the
    handle the kernels build equals the contract's, and the rows and sums that follow are right."""
    sys.path.insert(0, SIM_DIR)
    from normal_world import Handle, NormalWorld, check_combine, check_dispatch, expert_outputs, load, make_inputs
    sim = load(path)
    R, H, K, E = 3, 256, 4, 12
    w = NormalWorld(sim, R, H, K, E, 3, 32, 8)
    for i, (fp8, align) in enumerate([(False, 1), (True, 128), (False, 4)]):
        what = f"pipeline call {i}"
        inputs = make_inputs(R, [77, 0, 101] if i == 1 else [64, 90, 58], H, K, E, fp8, seed=40 + i)
        notified = w.notify(inputs, alignment=align)
        assert w.errors() == [[0, 0, 0, 0]] * R, (what, w.errors())
        handles = [Handle(inputs, r, R, E, w.C) for r in range(R)]
        check_notify(inputs, handles, notified, E, what, list(range(R)), align)
        for r in range(R):
            _adopt(handles[r], notified[r], r)
        handles, outs = w.dispatch(inputs, handles=handles)
        assert w.errors() == [[0, 0, 0, 0]] * R, (what, w.errors())
        check_dispatch(inputs, handles, outs, E, what)
        ys, ws = expert_outputs(handles, H, K, 50 + i)
        check_combine(handles, ys, ws, w.combine(handles, ys, ws), list(range(R)), what)
    assert [int(ws[1]) for ws in w.ws] == [3] * R, [ws.tolist() for ws in w.ws]   # kWsSeq: three gated calls
    return "ok"


def case_gate_behind_a_stalled_peer(path: str) -> str:
    """With a mask and rank 2 of 3 dead after the dispatch: rank 1's combine waits out the timeout for
    rank 2's rows while rank 0, with nothing to or from rank 2, finishes its combine and enters the next
    call's gate, waiting for rank 1. Rank 1 is alive (waiting, then its host slow to launch the next
    call): rank 0 must not mark it; both then leave rank 2 out of that call, counts right, no error."""
    sys.path.insert(0, SIM_DIR)
    import threading
    import time

    import torch
    from normal_world import Handle, NormalWorld, expert_outputs, load, make_inputs
    sim = load(path)
    R, H, K, E, live = 3, 256, 4, 12, [0, 1]
    w = NormalWorld(sim, R, H, K, E, 2, 32, 8, masked=True, timeout_ns=1_500_000_000)
    inputs = make_inputs(R, [40, 30, 30], H, K, E, False, seed=61)
    inputs[0].topk[inputs[0].topk >= 8] = -1          # rank 0 sends nothing to rank 2 ...
    inputs[2].topk[:] = torch.where(inputs[2].topk < 4, torch.full_like(inputs[2].topk, -1), inputs[2].topk)
    handles, outs = w.dispatch(inputs)                 # ... and receives nothing from it
    assert w.errors() == [[0, 0, 0, 0]] * R, w.errors()
    assert int(handles[0].in_rank[1][:, 0].sum()) <= 32, "rank 0's rows back to rank 1 must fit one ring"
    ys, ws = expert_outputs(handles, H, K, 62)
    nxt = make_inputs(R, [50, 44, 0], H, K, E, True, seed=63)
    notified: dict = {}

    def rank(r: int) -> None:   # one rank's host: its combine, then its next call's layout and gate
        w.combine(handles, ys, ws, ranks=[r])
        if r == 1:
            time.sleep(0.5)   # a host slow to launch the next call: a third of the timeout, no beats
        notified[r] = w.notify(nxt, ranks=[r])[r]

    threads = [threading.Thread(target=rank, args=(r,)) for r in live]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in live:
        assert w.errors()[r] == [0, 0, 0, 0], (r, w.errors())
        assert w.active[r].tolist() == [1, 1, 0], f"rank {r} marked {w.active[r].tolist()}"
    want = [Handle(nxt, r, R, E, w.C, live=live) for r in range(R)]
    # Rank 0 never waited for rank 2 before its layout ran; rank 1 had marked it in the combine.
    check_notify(nxt, want, notified, E, "the call after", live, layout_ranks={0: [0, 1, 2], 1: live})
    for r in live:   # the tokens routed to rank 2 this call, counted dropped once (on top of the combine's)
        routed = int(((nxt[r].topk >= 8).any(dim=1)).sum())
        assert w.dropped[r][2] >= routed, (r, w.dropped[r].tolist(), routed)
    return "ok"


WS_SEQ, WS_VOID = 1, 3                                  # normal_tags.h kWsSeq, kWsVoid
REC_VOIDS, REC_KIND, REC_PEER, KIND_REFUSED, KIND_MISMATCH = 0, 2, 3, 1, 2   # device_records.py


def case_refused_call(path: str) -> str:
    """Rank 1 refuses a call at its gate: on every rank the call is void (the host sees 2, not counts),
    the peers' tag records name rank 1, the dispatch kernels of the void call move nothing, and the
    next call is whole and right (no counter moved)."""
    sys.path.insert(0, SIM_DIR)
    from normal_world import Handle, NormalWorld, check_dispatch, load, make_inputs
    sim = load(path)
    R, H, K, E = 3, 256, 4, 12
    w = NormalWorld(sim, R, H, K, E, 2, 32, 8)
    inputs = make_inputs(R, [60, 70, 50], H, K, E, False, seed=70)
    notified = w.notify(inputs, status={1: 1})
    for r in range(R):
        assert notified[r]["ready"] == 2 and int(w.ws[r][WS_VOID]) == 1, (r, notified[r]["ready"], w.ws[r].tolist())
    for r in (0, 2):
        rec = w.tag_record[r].tolist()
        assert (rec[REC_VOIDS], rec[REC_KIND], rec[REC_PEER]) == (1, KIND_REFUSED, 1), (r, rec[:8])
    assert w.tag_record[1][REC_VOIDS] == 0, "the refusing rank records no peer's refusal"
    handles, outs = w.dispatch(inputs, handles=[Handle(inputs, r, R, E, w.C) for r in range(R)])
    for r in range(R):
        assert (outs[r]["recv_src_idx"] == -7).all(), f"rank {r}: a void call's dispatch wrote rows"
    inputs = make_inputs(R, [60, 70, 50], H, K, E, True, seed=71)
    notified = w.notify(inputs)
    assert w.errors() == [[0, 0, 0, 0]] * R and all(n["ready"] == 1 for n in notified), w.errors()
    assert [int(x[WS_SEQ]) for x in w.ws] == [2] * R and [int(x[WS_VOID]) for x in w.ws] == [0] * R
    handles = [Handle(inputs, r, R, E, w.C) for r in range(R)]
    check_notify(inputs, handles, notified, E, "after the void call", list(range(R)))
    for r in range(R):
        _adopt(handles[r], notified[r], r)
    handles, outs = w.dispatch(inputs, handles=handles)
    assert w.errors() == [[0, 0, 0, 0]] * R, w.errors()
    check_dispatch(inputs, handles, outs, E, "after the void call")
    return "ok"


def case_signature_mismatch(path: str) -> str:
    """Rank 2's call signature differs from its peers' in its last host word (tag word 11): the gate's
    decision compares every signature word it copied (normal_gate.cuh gate_read_tags), so on every rank
    the call is void and its tag record says mismatch, each naming the first peer whose tag differs."""
    sys.path.insert(0, SIM_DIR)
    from normal_world import Handle, NormalWorld, load, make_inputs
    sim = load(path)
    R, H, K, E = 3, 256, 4, 12
    w = NormalWorld(sim, R, H, K, E, 2, 32, 8)
    inputs = make_inputs(R, [60, 70, 50], H, K, E, False, seed=72)
    same = [H, 2, 32, 12, 4, 0]
    notified = w.notify(inputs, sig={0: same, 1: same, 2: same[:5] + [1]})
    for r in range(R):
        assert notified[r]["ready"] == 2 and int(w.ws[r][WS_VOID]) == 1, (r, notified[r]["ready"], w.ws[r].tolist())
    peers = {0: 2, 1: 2, 2: 0}
    for r in range(R):
        rec = w.tag_record[r].tolist()
        assert (rec[REC_VOIDS], rec[REC_KIND], rec[REC_PEER]) == (1, KIND_MISMATCH, peers[r]), (r, rec[:8])
    handles, outs = w.dispatch(inputs, handles=[Handle(inputs, r, R, E, w.C) for r in range(R)])
    for r in range(R):
        assert (outs[r]["recv_src_idx"] == -7).all(), f"rank {r}: a void call's dispatch wrote rows"
    return "ok"


def case_launch_checks(path: str) -> str:
    """The launchers' host checks (normal_notify.cu check_static / check_rings, run by the simulation as
    by the GPU launch): rings that do not fit the buffer and too many channels are
    ValueErrors naming the problem before any thread starts; the same world then runs a correct call."""
    sys.path.insert(0, SIM_DIR)
    import pytest as _pytest
    from normal_world import NormalWorld, check_dispatch, load, make_inputs
    sim = load(path)
    R, H, K, E = 2, 256, 4, 8
    w = NormalWorld(sim, R, H, K, E, 2, 32, 8)
    inputs = make_inputs(R, [40, 30], H, K, E, False, seed=80)
    w.Q = 64                                  # the buffer holds 32-row rings
    with _pytest.raises(ValueError, match="the rings need"):
        w.dispatch(inputs)
    w.Q, w.C = 32, 65
    with _pytest.raises(ValueError, match=r"num_channels must be in \[1, 64\]"):
        w.dispatch(inputs)
    w.C = 2
    handles, outs = w.dispatch(inputs)
    assert w.errors() == [[0, 0, 0, 0]] * R, w.errors()
    check_dispatch(inputs, handles, outs, E, "after refused launches")
    return "ok"


def case_silent_rank(path: str, use_tma: int, H: int = 256) -> str:
    """With a mask, rank 2 of 3 never launches: ranks 0 and 1 mark it within the timeout and finish
    without an error, rows between them intact and rank 2's rows emptied; their combine sums the two
    live ranks; the next call leaves rank 2 out from the start and is correct."""
    sys.path.insert(0, SIM_DIR)
    from normal_world import NormalWorld, check_combine, check_dispatch, expert_outputs, load, make_inputs
    sim = load(path)
    R, K, E, live = 3, 4, 12, [0, 1]
    w = NormalWorld(sim, R, H, K, E, 2, 32, 8, use_tma=use_tma, masked=True, timeout_ns=2_000_000_000)
    inputs = make_inputs(R, [150, 130, 80], H, K, E, False, seed=5)   # > 32 rows a stream: rings fill
    handles, outs = w.dispatch(inputs, ranks=live)
    for r in live:
        assert w.errors()[r] == [0, 0, 0, 0], (r, w.errors())
        assert w.active[r].tolist() == [1, 1, 0], (r, w.active[r].tolist())
        drop = w.dropped[r].tolist()
        assert drop[2] > 0 and drop[:2] == [0, 0], (r, drop)
    check_dispatch(inputs, handles, outs, E, "silent rank 2", ranks=live, gone=[2])
    ys, ws = expert_outputs(handles, H, K, 3)
    comb = w.combine(handles, ys, ws, ranks=live)
    assert [w.errors()[r] for r in live] == [[0, 0, 0, 0]] * 2, w.errors()
    check_combine(handles, ys, ws, comb, live, "after rank 2 was marked", live=live)
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
    from normal_world import NormalWorld, check_combine, check_dispatch, expert_outputs, load, make_inputs
    sim = load(path)
    R, H, K, E, live = 3, 256, 4, 12, [0, 1]
    w = NormalWorld(sim, R, H, K, E, 2, 32, 8, masked=True, timeout_ns=2_000_000_000)
    inputs = make_inputs(R, [110, 96, 40], H, K, E, False, seed=21)
    handles, outs = w.dispatch(inputs)
    assert w.errors() == [[0, 0, 0, 0]] * R, w.errors()
    check_dispatch(inputs, handles, outs, E, "all three")
    ys, ws = expert_outputs(handles, H, K, 22)
    comb = w.combine(handles, ys, ws, ranks=live)
    for r in live:
        assert w.errors()[r] == [0, 0, 0, 0], (r, w.errors())
        assert w.active[r].tolist() == [1, 1, 0], (r, w.active[r].tolist())
        routed = int(handles[r].in_rank[r][:, 2].sum())
        assert w.dropped[r].tolist() == [0, 0, routed], (r, w.dropped[r].tolist(), routed)
    check_combine(handles, ys, ws, comb, live, "rank 2 silent in the combine", live=live)
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
    from normal_world import Handle, check_dispatch
    R, E = w.R, w.E
    notified = w.notify(inputs)
    handles = [Handle(inputs, r, R, E, w.C) for r in range(R)]
    for r in range(R):
        _adopt(handles[r], notified[r], r)
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


def case_combine_trace(path: str) -> str:
    """PYEP_NORMAL_TRACE's kernel build (normal_trace.cuh): the combine's sums as without it, and per
    block its role, the rows (senders) or tokens (reducers) it moved, its warps, and a time split that
    fits in the block's span."""
    sys.path.insert(0, SIM_DIR)
    from normal_world import NormalWorld, check_combine, expert_outputs, load, make_inputs
    from pyep.ep.normal.trace import TRACE_WORDS, decode, summarize
    sim = load(path)
    assert sim.trace_words == TRACE_WORDS, (sim.trace_words, TRACE_WORDS)
    R, H, K, C, sizes = 3, 256, 4, 2, [90, 0, 71]
    E = 4 * R
    w = NormalWorld(sim, R, H, K, E, C, 32, 6, traced=True)
    inputs = make_inputs(R, sizes, H, K, E, False, seed=5)
    handles, _ = w.dispatch(inputs)
    ys, ws = expert_outputs(handles, H, K, 3)
    comb = w.combine(handles, ys, ws)
    assert w.errors() == [[0, 0, 0, 0]] * R, w.errors()
    check_combine(handles, ys, ws, comb, list(range(R)), "traced combine")
    warps = sim.combine_threads // 32
    for r in range(R):
        blocks = decode(w.trace[r].tolist(), 2 * C)
        send = [b for b in blocks if b.role == "send"]
        red = [b for b in blocks if b.role == "reduce"]
        assert [b.block for b in red] == [1, 3] and [b.block for b in send] == [0, 2], (r, blocks)
        own = int((handles[r].send_head[:, r] >= 0).sum()) if sizes[r] else 0
        assert sum(b.items for b in red) == sizes[r], (r, red)
        assert sum(b.items for b in send) == ys[r].shape[0] - own, (r, send, ys[r].shape[0], own)
        for b in blocks:
            assert b.warps == (warps if b.role == "reduce" else (R - 1) * (warps // (R - 1))), (r, b)
            assert 0 < b.start_ns <= b.end_ns, (r, b)
            assert b.wait_ns + b.work_ns + b.sync_ns <= b.warps * b.duration_ns, (r, b)
        if sizes[r]:
            assert red and all(b.work_ns > 0 for b in red), (r, red)
        shares = summarize(blocks)
        for role in shares.values():
            assert abs(role["wait"] + role["work"] + role["sync"] - 1) < 1e-9 or role["items"] == 0, shares
    return "ok"


def case_combine_small_rings(path: str) -> str:
    """Combines on rings smaller than a dispatch may use (32 rows): 8, 4 and 2 rows, where the reduce's
    rounds and the senders' room are smallest (normal_combine.cu); every ring wraps many times, the
    counters carry over from the dispatch's 32-row rings."""
    sys.path.insert(0, SIM_DIR)
    from normal_world import NormalWorld, check_combine, expert_outputs, load, make_inputs
    sim = load(path)
    R, H, K, sizes = 3, 256, 4, [60, 0, 47]
    E = 4 * R
    w = NormalWorld(sim, R, H, K, E, 2, 32, 6)
    for i, q in enumerate((8, 4, 2)):
        w.Q = 32
        inputs = make_inputs(R, sizes, H, K, E, False, seed=40 + i)
        handles, _ = w.dispatch(inputs)
        assert w.errors() == [[0, 0, 0, 0]] * R, (q, w.errors())
        ys, ws = expert_outputs(handles, H, K, 50 + i)
        w.Q = q
        comb = w.combine(handles, ys, ws)
        assert w.errors() == [[0, 0, 0, 0]] * R, (q, w.errors())
        check_combine(handles, ys, ws, comb, list(range(R)), f"combine on {q}-row rings")
    return "ok"


def case_error_codes(path: str) -> str:
    """pyep/ep/normal/errors.py's record codes and phase order are the kernels' (normal_launch.h
    NormalError, Phase): a code that differs would raise the wrong error, naming the wrong rank or call."""
    sys.path.insert(0, SIM_DIR)
    from normal_world import load
    from pyep.ep.normal import errors
    sim = load(path)
    ours = {k: v for k, v in vars(errors).items() if k.startswith("ERR_")}
    assert dict(sim.error_codes) == ours, (dict(sim.error_codes), ours)
    assert tuple(sim.phases) == tuple(range(len(errors.PHASES))), (sim.phases, errors.PHASES)
    return "ok"


# ------------------------------------------------------------------ tests
# name -> (case, its arguments after the module path)
CASES: Dict[str, Tuple[Callable[..., str], tuple]] = {
    # 2 ranks, 2 channels of 32-row rings fed 8 rows a chunk: ~70 rows a stream, every ring wraps.
    "two_ranks_rings_wrap": (case_rounds, (2, [150, 131], 2, 32, 8, 3)),
    # 3 ranks (one without tokens), 3 channels, the receiver's warp copies.
    "three_ranks_one_empty_warp_copies": (case_rounds, (3, [97, 0, 120], 3, 32, 6, 0)),
    # 4 ranks with one warp per peer group.
    "four_ranks": (case_rounds, (4, [64, 80, 33, 72], 2, 32, 4, 3)),
    # Rows of 4 KiB: the combine's staged reduce (tokens of 3 sources) takes each row in 4 pieces.
    "three_ranks_rows_in_pieces": (case_rounds, (3, [40, 25, 33], 2, 32, 4, 3, 2048)),
    **{f"silent_rank_with_mask_is_marked_tma{t}": (case_silent_rank, (t,)) for t in (0, 3)},
    "silent_rank_without_mask_is_named": (case_silent_rank_without_mask, ()),
    "worst_tokens_then_cached_dispatch": (case_worst_tokens_and_cached, ()),
    "silent_rank_in_combine_is_marked": (case_silent_rank_in_combine, ()),
    "notify_dispatch_combine_pipeline": (case_notify_pipeline, ()),
    "gate_waits_for_a_peer_stalled_behind_a_dead_rank": (case_gate_behind_a_stalled_peer, ()),
    "a_call_refused_by_one_rank_is_void_everywhere": (case_refused_call, ()),
    "a_signature_that_differs_voids_the_call_everywhere": (case_signature_mismatch, ()),
    "launch_checks_refuse_bad_rings": (case_launch_checks, ()),
    # One-copy dispatch: 2 ranks, and 3 with one of them without tokens.
    "direct_two_ranks": (case_direct, (2, [150, 131])),
    "direct_three_ranks_one_empty": (case_direct, (3, [97, 0, 120])),
    "direct_bad_descriptor_is_named": (case_direct_bad_descriptor, ()),
    "direct_lost_path_is_named": (case_direct_lost_path, ()),
    # Pull combine: 2 ranks, and 3 with one of them without tokens.
    "pull_two_ranks": (case_pull, (2, [150, 131])),
    "pull_three_ranks_one_empty": (case_pull, (3, [97, 0, 120])),
    "pull_short_offer_is_named": (case_pull_bad_offer, (5,)),
    "pull_offer_past_the_pool_is_named": (case_pull_bad_offer, (6,)),
    "pull_send_head_past_a_peers_rows_is_named": (case_pull_bad_handle, ()),
    "pull_silent_rank_is_named": (case_pull_silent_rank, ()),
    # BF16 rows of 8448 bytes go to peers by bulk copy (normal_tma.cuh peer_bulk: longer than a warp's
    # stages), FP8 rows by warp copies: the ring path's and one-copy's extra drains and barriers, and a
    # silent rank's give-up path after bulk copies.
    "long_rows_rings_wrap": (case_rounds, (2, [70, 61], 2, 32, 8, 3, 4224)),
    "long_rows_direct": (case_direct, (2, [70, 61], 4224)),
    "long_rows_silent_rank": (case_silent_rank, (3, 4224)),
    "combine_trace": (case_combine_trace, ()),
    "combine_small_rings": (case_combine_small_rings, ()),
    "error_codes_match_errors_py": (case_error_codes, ()),
}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(CASES))
def test_normal_kernels(normal_sim_pool: Tuple[Any, str], name: str) -> None:
    """CASES[name] in the simulation's worker process, with a hard timeout."""
    pool, path = normal_sim_pool
    case, args = CASES[name]
    assert pool.run(case, path, *args, timeout_s=500) == ["ok"]
