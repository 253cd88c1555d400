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
refuse rings that do not fit and too many channels. The zero-copy paths (one-copy dispatch, pull
combine) are tests/test_normal_sim_zero_copy.py's. Each case runs in a worker process with a hard
timeout (a kernel bug that deadlocks a barrier must fail the test, not hang CI)."""
from __future__ import annotations

import os
import sys
from typing import Any, Callable, Dict, List, Optional, Tuple

import pytest

from pyep.ep.normal.errors import ERR_PEER_TIMEOUT, PHASES

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
    from normal_world import (Handle, NormalWorld, adopt_notified, check_combine, check_dispatch, expert_outputs,
                              load, make_inputs)
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
            adopt_notified(handles[r], notified[r], r)
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
    from normal_world import Handle, NormalWorld, adopt_notified, check_dispatch, load, make_inputs
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
        adopt_notified(handles[r], notified[r], r)
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
    # BF16 rows of 8448 bytes go to peers by bulk copy (normal_tma.cuh peer_bulk: longer than a warp's
    # stages), FP8 rows by warp copies: the ring path's extra drains and barriers (one-copy's:
    # test_normal_sim_zero_copy.py), and a silent rank's give-up path after bulk copies.
    "long_rows_rings_wrap": (case_rounds, (2, [70, 61], 2, 32, 8, 3, 4224)),
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
