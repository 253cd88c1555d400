"""The normal mode's RDMA relay (engine/kernels/normal_internode_relay.cu) on the CPU: compiled as host C++
with one OS thread per GPU thread (tests/ll_sim/relay_sim.cpp), M simulated nodes of one rank each in one
process, the column peers' qp.h queue pairs executed by the simulated NIC (tests/ll_sim/sim_nic.h).
Checked against pure-Python expectations: the count exchange over several calls (both parities, slot
reuse, the device call counter and its wrap past 0), rows through rings that wrap several times (skewed
and empty routings, row size and ring depth changing between calls), a peer that never launches
(PeerTimeout naming it and the phase, no hang), the count exchange as the column's call gate (a rank
that refuses a call: every peer's call void at once, naming it, no row moved, the next calls correct;
call counters that disagree: a call mismatch on every rank, not a timeout), and with the buffer's mask
(docs/elastic.md, "Normal mode"): a peer out of the mask skipped, a silent peer marked within two
timeouts with no error and the rows between the others delivered, a live peer late by more than one
timeout not marked. Each case runs in a worker process with a hard timeout."""
from __future__ import annotations

import os
import sys
import time
from typing import Any, List, Optional

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIM_DIR = os.path.join(ROOT, "tests", "ll_sim")

ERR_PEER_TIMEOUT = 3                       # pyep/ep/normal/errors.py
PHASE_COUNTS, PHASE_DISPATCH = 3, 4        # pyep/ep/normal/internode_relay.py PHASES
SEQ_WORD, EPOCH_WORD, VOID_WORD, CLAIM_WORD, ORIGIN_WORD, MASK_WORD = 1, 2, 3, 4, 5, 6   # normal_tags.h kWs*
STATUS_OK, STATUS_REFUSED = 0, 1           # pyep/ep/normal/tags.py
KIND_DISPATCH, KIND_COMBINE = 2, 4


def next_seq(prev: int) -> int:
    """normal_internode.h relay_next_seq: +1, from 0xffffffff to 2 (0 never names a call)."""
    s = (prev + 1) & 0xFFFFFFFF
    return 2 if s == 0 else s


# ------------------------------------------------------------------ the world (runs in the worker)
class RelayWorld:
    """M column peers (node m = rank m, one rank per node), relay buffers laid out by RelayLayout."""

    def __init__(self, path: str, M: int, ring_bytes: int = 1024, timeout_ms: int = 2000, nqp: int = 2,
                 log_sq: int = 5):
        import importlib.util

        import torch
        from pyep.ep.normal.internode_relay import RelayLayout
        spec = importlib.util.spec_from_file_location("relay_sim", path)
        self.sim = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(self.sim)
        self.M, self.lay = M, RelayLayout(M, ring_bytes)
        self.bufs = [torch.zeros(self.lay.total_bytes, dtype=torch.uint8) for _ in range(M)]
        self.err = [torch.zeros(8, dtype=torch.int32) for _ in range(M)]
        self.ws = [torch.zeros(8, dtype=torch.int32) for _ in range(M)]
        from pyep.ep.normal.device_records import TAG_RECORD_INTS
        self.rec = [torch.zeros(TAG_RECORD_INTS, dtype=torch.int32) for _ in range(M)]
        self.nic = self.sim.SimNic([b.data_ptr() for b in self.bufs], [self.lay.total_bytes] * M, nqp, log_sq)
        self.raddr = torch.tensor([b.data_ptr() for b in self.bufs], dtype=torch.int64)
        self.rkeys = torch.tensor([1000 + m for m in range(M)], dtype=torch.int32)
        w = self.lay.words
        self.statics = [dict(
            node=m, num_nodes=M, ranks_per_node=1, local=0, buf=self.bufs[m].data_ptr(),
            remote_addr=self.raddr.data_ptr(), rkeys=self.rkeys.data_ptr(), lkey=1000 + m,
            qps=self.nic.contexts(m), num_qps_per_peer=nqp, off_tail=w["tail"], off_head=w["head"],
            off_tx=w["tx"], off_rx=w["rx"], off_count=w["count"], off_outbox=w["outbox"], off_fetch=w["fetch"],
            off_send=self.lay.off_send, off_recv=self.lay.off_recv, ring_bytes=ring_bytes,
            err=self.err[m].data_ptr(), workspace=self.ws[m].data_ptr(), timeout_ns=timeout_ms * 1_000_000,
            tag_record=self.rec[m].data_ptr())
            for m in range(M)]
        self.tickets = 0
        self.masks: List[Any] = []

    def use_masks(self, masks: List[List[int]]) -> None:
        """Every rank reads its own mask (int32 [M]: one rank per node) from now on."""
        import torch
        self.masks = [torch.tensor(m, dtype=torch.int32) for m in masks]
        for m in range(self.M):
            self.statics[m]["active"] = self.masks[m].data_ptr()

    def call_mask(self, m: int) -> int:
        return int(self.ws[m][MASK_WORD]) & ((1 << self.M) - 1)

    def word(self, m: int, name: str, i: int) -> int:
        import torch
        return int(self.bufs[m][:4 * self.lay.words["end"]].view(torch.int32)[self.lay.words[name] + i]) & 0xFFFFFFFF

    def errors(self, m: int) -> List[int]:
        return [int(v) for v in self.err[m][:4]]

    def set_seq(self, m: int, value: int) -> None:
        self.ws[m][SEQ_WORD] = value - (1 << 32) if value >= 1 << 31 else value

    def set_history(self, value: int) -> None:
        """Every rank as if its last two count exchanges were calls prev(value) and value: the call
        counters and every count slot (the gate reads a peer's position from both parities)."""
        import torch
        prev = 0xFFFFFFFF if value == 2 else value - 1
        w = self.lay.words
        for m in range(self.M):
            self.set_seq(m, value)
            slots = self.bufs[m][4 * w["count"]:4 * w["count"] + 16 * self.M].view(torch.int64)
            for call in (prev, value):
                for s_ in range(self.M):
                    rec = (call << 32) | 1
                    slots[(call & 1) * self.M + s_] = rec - (1 << 64) if rec >= 1 << 63 else rec

    def seq(self, m: int) -> int:
        return int(self.ws[m][SEQ_WORD]) & 0xFFFFFFFF

    def counts(self, send: List[List[int]], ranks: Optional[List[int]] = None, refused: Optional[List[int]] = None,
               upstream: Optional[dict] = None, void_handle: Optional[List[int]] = None,
               kinds: Optional[dict] = None):
        """One count exchange; send[m][d] rows from m to d; `refused` ranks refuse the call, `upstream`
        maps a rank to the (void, origin) of an earlier gate of its call, `void_handle` ranks pass the
        handle of a void dispatch. Returns (recv_counts, host words) per rank."""
        import torch
        ranks = list(range(self.M)) if ranks is None else ranks
        self.tickets += 1
        sc = {m: torch.tensor(send[m], dtype=torch.int32) for m in ranks}
        rc = {m: torch.full((self.M + 1,), -7, dtype=torch.int32) for m in ranks}
        hc = {m: torch.zeros(2 + 2 * self.M, dtype=torch.int32) for m in ranks}
        up = {m: torch.tensor([0, 0, 0, v, 0, o, 0, 0], dtype=torch.int32) for m, (v, o) in (upstream or {}).items()}
        hv = {m: torch.tensor([3, -1], dtype=torch.int32) for m in (void_handle or [])}   # normal_tags.h kHandleVoid
        self.sim.counts([self.statics[m] for m in ranks],
                        [dict(host_ticket=self.tickets, send_counts=sc[m].data_ptr(), recv_counts=rc[m].data_ptr(),
                              host_counts=hc[m].data_ptr(), kind=(kinds or {}).get(m, KIND_COMBINE), origin=m,
                              status=STATUS_REFUSED if m in (refused or []) else STATUS_OK,
                              upstream=up[m].data_ptr() if m in up else 0,
                              handle_tag=hv[m].data_ptr() if m in hv else 0) for m in ranks])
        return {m: rc[m].tolist() for m in ranks}, {m: hc[m].tolist() for m in ranks}

    def void(self, m: int) -> tuple:
        """(void flag, origin) the count exchange left in rank m's workspace."""
        return int(self.ws[m][VOID_WORD]), int(self.ws[m][ORIGIN_WORD])

    def record(self, m: int) -> Any:
        """Rank m's tag record, decoded as the host does (pyep.ep.normal.device_records)."""
        from pyep.ep.normal.device_records import DeviceRecords
        recs = DeviceRecords(self.err[m], self.rec[m], lambda: None, m, self.M, 1000)
        return recs.take_void()

    def relay(self, rows: List[List[Any]], row_bytes: int, Q: int, chunk: int, ranks: Optional[List[int]] = None,
              recv_n: Optional[List[List[int]]] = None, capacity: Optional[List[int]] = None):
        """One relay; rows[m][d]: uint8 [n, row_bytes] from m to d. Returns dst [sum, row_bytes] per rank."""
        import torch
        ranks = list(range(self.M)) if ranks is None else ranks
        recv_n = [[len(rows[s][d]) for s in range(self.M)] for d in range(self.M)] if recv_n is None else recv_n
        keep, statics, args, dsts = [], [], [], {}
        for m in ranks:
            n_send = [0 if d == m else len(rows[m][d]) for d in range(self.M)]
            src = torch.cat([rows[m][d] if d != m else rows[m][d][:0] for d in range(self.M)]).contiguous()
            so = torch.tensor([0] + n_send, dtype=torch.int32).cumsum(0).to(torch.int32)
            ro = torch.tensor([0] + [0 if s == m else recv_n[m][s] for s in range(self.M)],
                              dtype=torch.int32).cumsum(0).to(torch.int32)
            dst = torch.full((int(ro[-1]) + 1, row_bytes), 0xEE, dtype=torch.uint8)
            dsts[m] = (dst, ro)
            keep += [src, so, ro, dst]
            statics.append(self.statics[m])
            args.append(dict(phase=PHASE_DISPATCH, src=src.data_ptr(), send_offsets=so.data_ptr(), dst=dst.data_ptr(),
                             recv_offsets=ro.data_ptr(), row_bytes=row_bytes, ring_tokens=Q, chunk_tokens=chunk,
                             dst_capacity=0 if capacity is None else capacity[m]))
        self.sim.relay(statics, args)
        return dsts


def _world(path: str, M: int, **kw) -> RelayWorld:
    sys.path.insert(0, SIM_DIR)
    return RelayWorld(path, M, **kw)


def check_counts(w: RelayWorld, calls: int, seed: int, start: Optional[int] = None) -> None:
    """`calls` consecutive count exchanges with different per-peer counts: every rank receives exactly
    what each peer sent it, and the device call counter advances by relay_next_seq per launch."""
    import torch
    M = w.M
    g = torch.Generator().manual_seed(seed)
    if start is not None:
        w.set_history(start)
    for k in range(calls):
        before = [w.seq(m) for m in range(M)]
        send = [[int(v) for v in torch.randint(0, 1 << 20, (M,), generator=g)] for _ in range(M)]
        send[0][M - 1] = 0 if k % 2 else (1 << 24) - 1   # an empty and the largest count too (24 bits)
        rc, hc = w.counts(send)
        for m in range(M):
            assert w.errors(m)[0] == 0, f"call {k}: rank {m} error record {w.errors(m)} (seq {before[m]:#x})"
            want = [0 if s == m else send[s][m] for s in range(M)]
            assert rc[m] == want + [sum(want)], \
                f"call {k}: rank {m} received {rc[m]}, expected {want}"
            assert hc[m][:2] == [w.tickets, sum(want)] and hc[m][2:2 + M] == want and hc[m][2 + M:] == send[m], \
                f"call {k}: rank {m} host words {hc[m]}"
            assert w.seq(m) == next_seq(before[m]), f"call {k}: rank {m} counter {w.seq(m):#x} after {before[m]:#x}"


def case_counts(path: str, M: int) -> str:
    w = _world(path, M)
    check_counts(w, 6, seed=M)
    assert [w.seq(m) for m in range(M)] == [6] * M
    # The counter near 0xffffffff: calls 0xfffffffe, 0xffffffff, 2, 3, 4 (parity alternates across the wrap).
    check_counts(w, 5, seed=10 + M, start=0xFFFFFFFD)
    assert [w.seq(m) for m in range(M)] == [4] * M
    assert not w.nic.errors(), w.nic.errors()
    return "ok"


def case_counts_mutation(path: str, M: int) -> str:
    """Mutation: rank 0's counter starts one call ahead, so its call numbers never match its peers'
    records. The count exchange finds it on every rank -- a call mismatch naming both calls, from the
    records (rank 0's peers see its record of another call; rank 0 is told by their NOTICE) -- well
    within the timeout, with no PeerTimeout, and the call is void (no counts)."""
    from pyep.ep.normal.errors import NormalCallMismatch
    w = _world(path, M, timeout_ms=20_000)
    w.set_history(7)
    w.set_seq(0, 8)
    t0 = time.monotonic()
    rc, hc = w.counts([[5] * M for _ in range(M)])
    took = time.monotonic() - t0
    assert took < 10.0, f"the mismatch took {took:.1f} s to report (the timeout is 20 s)"
    for m in range(M):
        assert w.errors(m)[0] == 0, f"rank {m}: {w.errors(m)} (a mismatch is not a timeout)"
        assert w.void(m) == (1, -1) and rc[m] == [0] * (M + 1) and hc[m][0] == -w.tickets, (m, w.void(m), rc[m])
        err = w.record(m)
        assert type(err) is NormalCallMismatch, (m, err)
        # Rank 0 names the peer's last record it saw: 8, or 7 if it looked before the peer posted 8.
        mine, theirs = (9, (8, 7)) if m == 0 else (8, (9,))
        assert f"at call {mine}" in str(err) and any(f"sent call {c} " in str(err) for c in theirs), (m, str(err))
    return "ok"


def case_counts_other_kind(path: str, M: int) -> str:
    """The last rank makes a dispatch where its peers make a combine of the same call number (one rank
    per node: no node gate compares kinds): the count records carry the kind, so every rank finds a call
    mismatch naming the peer's kind, well within the timeout and with no PeerTimeout; the call is void."""
    from pyep.ep.normal.errors import NormalCallMismatch
    w = _world(path, M, timeout_ms=20_000)
    check_counts(w, 2, seed=3)
    t0 = time.monotonic()
    rc, hc = w.counts([[5] * M for _ in range(M)], kinds={M - 1: KIND_DISPATCH})
    took = time.monotonic() - t0
    assert took < 10.0, f"the mismatch took {took:.1f} s to report (the timeout is 20 s)"
    for m in range(M):
        assert w.errors(m)[0] == 0, f"rank {m}: {w.errors(m)} (a mismatch is not a timeout)"
        assert w.void(m) == (1, -1) and rc[m] == [0] * (M + 1) and hc[m][0] == -w.tickets, (m, w.void(m), rc[m])
        err = w.record(m)
        assert type(err) is NormalCallMismatch, (m, err)
        other = "combine" if m == M - 1 else "dispatch"
        assert f"({other}, generation" in str(err), (m, str(err))
    return "ok"


def case_counts_refused(path: str, M: int) -> str:
    """Rank 0 refuses a call (on its host): every other rank's count exchange ends at once with the call
    void, its record naming rank 0; a relay of the same call moves nothing on any rank and leaves every
    counter as it was; the next calls are correct. With M = 3, rank 1 passes on a refusal that an earlier
    gate of its call saw (upstream: rank 0 refused in rank 1's node): rank 2 names rank 0, passed on by
    rank 1."""
    import torch
    from pyep.ep.normal.errors import PeerRefusedCall
    w = _world(path, M, timeout_ms=20_000)
    g = torch.Generator().manual_seed(M)
    t0 = time.monotonic()
    rc, _ = w.counts([[3] * M for _ in range(M)], refused=[0])
    assert time.monotonic() - t0 < 10.0
    for m in range(M):
        assert w.void(m) == (1, 0) and rc[m] == [0] * (M + 1), (m, w.void(m), rc[m])
        err = w.record(m)
        if m == 0:
            assert err is None, f"the refusing rank records nothing (it raises its own error): {err}"
        else:
            assert isinstance(err, PeerRefusedCall) and err.peer == 0 and err.via is None, (m, err)
    rows = [[_rows(g, 0 if d == s_ else 6, 32, 16 * s_ + d) for d in range(M)] for s_ in range(M)]
    dsts = w.relay(rows, 32, 4, 3)
    for d in range(M):
        assert bool((dsts[d][0] == 0xEE).all()), f"rank {d} received rows in a void call"
    _settled_counters(w, [[0] * M for _ in range(M)], "void call")
    if M == 3:
        w.counts([[1] * M for _ in range(M)], upstream={1: (1, 0)})
        err = w.record(2)
        assert isinstance(err, PeerRefusedCall) and (err.peer, err.via) == (0, 1), err
        assert w.void(1) == (1, 0) and w.void(2) == (1, 0), (w.void(1), w.void(2))
    # A rank whose handle is of a void dispatch refuses the cached dispatch on the device.
    w.counts([[2] * M for _ in range(M)], void_handle=[M - 1])
    for m in range(M - 1):
        err = w.record(m)
        assert isinstance(err, PeerRefusedCall) and err.peer == M - 1, (m, err)
    assert w.void(M - 1) == (1, M - 1)
    check_counts(w, 3, seed=4)
    check_relay(w, rows, w.relay(rows, 32, 4, 3), "after the void calls")
    assert not w.nic.errors(), w.nic.errors()
    return "ok"


def _rows(g: Any, n: int, row_bytes: int, tag: int) -> Any:
    import torch
    r = torch.randint(0, 256, (n, row_bytes), dtype=torch.uint8, generator=g)
    if n:
        r[:, 0] = tag                                           # source and destination,
        r[:, 1:5] = torch.arange(n, dtype=torch.int32).view(-1, 1).view(torch.uint8).view(n, 4)  # row index
    return r


def check_relay(w: RelayWorld, rows, dsts, tag: str) -> None:
    M = w.M
    for d in range(M):
        dst, ro = dsts[d]
        for s in range(M):
            if s == d:
                continue
            got = dst[int(ro[s]):int(ro[s + 1])]
            assert got.shape == rows[s][d].shape and bool((got == rows[s][d]).all()), \
                f"{tag}: rows {s} -> {d} differ ({rows[s][d].shape[0]} sent)"
        assert bool((dst[-1] == 0xEE).all()), f"{tag}: rank {d} wrote past its rows"


def _settled_counters(w: RelayWorld, sent, tag: str) -> None:
    """tx (sender) = rx (receiver) = tail (receiver's) = head (sender's) = rows sent so far, per pair."""
    M = w.M
    # The receiver's last head fetch-add is not awaited by the kernel (the next call's sender waits for
    # head == tx first), so head may still be in flight at the NIC: give it a bounded moment.
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline and any(w.word(s, "head", d) != sent[s][d]
                                              for s in range(M) for d in range(M) if s != d):
        time.sleep(0.001)
    for s in range(M):
        for d in range(M):
            if s != d:
                got = [w.word(s, "tx", d), w.word(d, "rx", s), w.word(d, "tail", s), w.word(s, "head", d)]
                assert got == [sent[s][d]] * 4, f"{tag}: counters {s} -> {d} (tx rx tail head) {got}, sent {sent[s][d]}"


def case_relay(path: str, M: int, nqp: int) -> str:
    """Rows through rings of Q slots in chunks < Q, wrapping several times; routings uniform, one peer
    gets all, some get none; the row size and Q change between calls (each call starts on an empty
    ring), and the absolute counters tx/rx/tail/head keep growing and agree. A send queue of 32 WQEBBs
    is outrun by a call's WQEs, so its room comes from CQ polling. Last, a receive side shorter than
    the rows (dst_capacity): the rows past it are consumed but not stored, and the counters agree."""
    import torch
    w = _world(path, M, ring_bytes=1024, timeout_ms=5000, nqp=nqp)
    g = torch.Generator().manual_seed(100 + M)
    sent = [[0] * M for _ in range(M)]
    plans = [(48, 5, 3, "uniform"), (32, 7, 7, "one"), (64, 4, 1, "none-to-last"), (16, 9, 4, "uniform"),
             (48, 3, 2, "skew")]
    for i, (row_bytes, Q, chunk, routing) in enumerate(plans):
        n = [[int(v) for v in torch.randint(0, 40, (M,), generator=g)] for _ in range(M)]
        for s in range(M):
            if routing == "one":            # all rows to one peer, none to the others
                n[s] = [37 if d == (s + 1) % M else 0 for d in range(M)]
            elif routing == "none-to-last":
                n[s][M - 1] = 0
            elif routing == "skew":
                n[s] = [60 if d == 0 else 1 for d in range(M)]
        rows = [[_rows(g, 0 if d == s else n[s][d], row_bytes, 16 * s + d) for d in range(M)] for s in range(M)]
        rc, _ = w.counts([[0 if d == s else n[s][d] for d in range(M)] for s in range(M)])
        recv_n = [rc[d][:M] for d in range(M)]          # the exchanged counts size the receive side
        dsts = w.relay(rows, row_bytes, Q, chunk, recv_n=recv_n)
        for m in range(M):
            assert w.errors(m)[0] == 0, f"call {i} {routing}: rank {m} error record {w.errors(m)}"
        check_relay(w, rows, dsts, f"call {i} {routing} (row {row_bytes} B, Q {Q}, chunk {chunk})")
        for s in range(M):
            for d in range(M):
                sent[s][d] += 0 if s == d else n[s][d]
        _settled_counters(w, sent, f"call {i}")
    # dst_capacity: every receiver stores only its first `cap` rows (node order), consumes all.
    n = [[0 if d == s_ else 9 + 3 * s_ + d for d in range(M)] for s_ in range(M)]
    rows = [[_rows(g, n[s_][d], 32, 16 * s_ + d) for d in range(M)] for s_ in range(M)]
    total = [sum(n[s_][d] for s_ in range(M)) for d in range(M)]
    cap = [t - 5 for t in total]
    dsts = w.relay(rows, 32, 4, 3, capacity=cap)
    for d in range(M):
        assert w.errors(d)[0] == 0, f"capacity: rank {d} error record {w.errors(d)}"
        dst, ro = dsts[d]
        want = torch.cat([rows[s_][d] for s_ in range(M) if s_ != d])
        assert bool((dst[:cap[d]] == want[:cap[d]]).all()), f"capacity: rank {d} rows below the capacity"
        assert bool((dst[cap[d]:] == 0xEE).all()), f"capacity: rank {d} stored rows past its capacity"
    for s_ in range(M):
        for d in range(M):
            sent[s_][d] += n[s_][d]
    _settled_counters(w, sent, "capacity")
    assert not w.nic.errors(), w.nic.errors()
    assert max(max(r) for r in sent) > 3 * 9, "the rings did not wrap several times"
    return "ok"


def case_relay_mutation(path: str) -> str:
    """Mutation: after a good call, node 1's rx counter for node 0 is bumped by one row, so receiver and
    sender disagree on where the stream stands. The row check must fail (a PeerTimeout in the dispatch
    phase naming rank 0, or rows that differ), within the timeout."""
    import torch
    M = 2
    w = _world(path, M, timeout_ms=1000)
    g = torch.Generator().manual_seed(5)
    rows = [[_rows(g, 0 if d == s_ else 10, 32, 16 * s_ + d) for d in range(M)] for s_ in range(M)]
    check_relay(w, rows, w.relay(rows, 32, 4, 3), "before the mutation")
    assert w.errors(0)[0] == w.errors(1)[0] == 0
    w.bufs[1][:4 * w.lay.words["end"]].view(torch.int32)[w.lay.words["rx"] + 0] += 1
    rows = [[_rows(g, 0 if d == s_ else 10, 32, 16 * s_ + d) for d in range(M)] for s_ in range(M)]
    t0 = time.monotonic()
    dsts = w.relay(rows, 32, 4, 3)
    assert time.monotonic() - t0 < 10.0, "the mutated relay took too long to report"
    try:
        for m in range(M):
            assert w.errors(m)[0] == 0, f"rank {m} error record {w.errors(m)}"
        check_relay(w, rows, dsts, "after the mutation")
    except AssertionError:
        code, peer, phase, _ = w.errors(1)
        assert (code, peer, phase) in ((0, 0, 0), (ERR_PEER_TIMEOUT, 0, PHASE_DISPATCH)), w.errors(1)
        return "ok"
    raise AssertionError("the row check passed with counters that disagree: it cannot fail")


def case_silent_peer(path: str) -> str:
    """Node 2 of 3 never launches: nodes 0 and 1 report PeerTimeout naming rank 2 and the phase within
    two timeouts (a column peer's), for the count exchange and for the relay (whose rows between 0 and 1
    still arrive)."""
    import torch
    M, live, timeout_ms = 3, [0, 1], 1000
    w = _world(path, M, timeout_ms=timeout_ms)
    t0 = time.monotonic()
    rc, hc = w.counts([[0, 5, 6], [7, 0, 8], [9, 10, 0]], ranks=live)
    took = time.monotonic() - t0
    assert took < timeout_ms / 1000 + 10.0, f"counts took {took:.1f} s"
    for m in live:
        assert w.errors(m)[:3] == [ERR_PEER_TIMEOUT, 2, PHASE_COUNTS], f"rank {m}: {w.errors(m)}"
        assert hc[m][0] == -w.tickets, f"rank {m}: the host word must say 'read the error record': {hc[m]}"
        assert w.record(m) is None, f"rank {m}: a silent peer is a timeout, not a refusal or mismatch"
        w.err[m].zero_()
        w.ws[m][CLAIM_WORD] = 0
        # The failed count exchange made the call void (its relay would idle): this case tests the
        # relay's own timeout, as in a call whose counts a host supplied.
        w.ws[m][VOID_WORD] = 0
    g = torch.Generator().manual_seed(7)
    n = [[0, 11, 20], [13, 0, 20], [20, 20, 0]]
    rows = [[_rows(g, n[s][d], 32, 16 * s + d) for d in range(M)] for s in range(M)]
    t0 = time.monotonic()
    dsts = w.relay(rows, 32, 4, 2, ranks=live)
    took = time.monotonic() - t0
    assert took < timeout_ms / 1000 + 10.0, f"relay took {took:.1f} s"
    for m in live:
        assert w.errors(m)[:3] == [ERR_PEER_TIMEOUT, 2, PHASE_DISPATCH], f"rank {m}: {w.errors(m)}"
    for d, s in ((0, 1), (1, 0)):
        dst, ro = dsts[d]
        assert bool((dst[int(ro[s]):int(ro[s + 1])] == rows[s][d]).all()), f"rows {s} -> {d} between live nodes"
    return "ok"


def case_masked_silent_peer(path: str) -> str:
    """With a mask, node 2 of 3 never launches: nodes 0 and 1 mark it within two timeouts (mask entry 0,
    out of the call's mask), record no error, receive 0 rows from it and nothing is void; the relay that
    follows moves the rows between them and leaves rank 2's runs untouched; the next call does not wait
    for rank 2 at all. Then a rank whose own entry is 0 exchanges with nobody."""
    import torch
    M, live, timeout_ms = 3, [0, 1], 1000
    w = _world(path, M, timeout_ms=timeout_ms)
    w.use_masks([[1, 1, 1]] * M)
    t0 = time.monotonic()
    rc, hc = w.counts([[0, 5, 6], [7, 0, 8], [9, 10, 0]], ranks=live)
    took = time.monotonic() - t0
    assert took < timeout_ms / 1000 + 10.0, f"counts took {took:.1f} s"
    for m in live:
        assert w.errors(m)[0] == 0, f"rank {m}: a marked peer is no error: {w.errors(m)}"
        assert w.masks[m].tolist() == [1, 1, 0], f"rank {m}: mask {w.masks[m].tolist()}"
        assert w.call_mask(m) == 0b011 and w.void(m)[0] == 0, f"rank {m}: call mask {w.call_mask(m):#b}, {w.void(m)}"
        want = [0 if s in (m, 2) else [[0, 5, 6], [7, 0, 8]][s][m] for s in range(M)]
        assert rc[m] == want + [sum(want)] and hc[m][0] == w.tickets, f"rank {m}: {rc[m]} {hc[m]}"
    g = torch.Generator().manual_seed(9)
    n = [[0, 11, 20], [13, 0, 20], [20, 20, 0]]
    rows = [[_rows(g, n[s][d], 32, 16 * s + d) for d in range(M)] for s in range(M)]
    dsts = w.relay(rows, 32, 4, 2, ranks=live)
    for m in live:
        assert w.errors(m)[0] == 0, f"rank {m}: {w.errors(m)}"
    for d, s in ((0, 1), (1, 0)):
        dst, ro = dsts[d]
        assert bool((dst[int(ro[s]):int(ro[s + 1])] == rows[s][d]).all()), f"rows {s} -> {d} between live nodes"
        assert bool((dst[int(ro[2]):int(ro[3])] == 0xEE).all()), f"rank {d}: the run of marked rank 2 was written"
    # The next calls leave rank 2 out without waiting for it.
    t0 = time.monotonic()
    for _ in range(3):
        rc, _ = w.counts([[0, 1, 2], [3, 0, 4], [5, 6, 0]], ranks=live)
        assert rc[0] == [0, 3, 0, 3] and rc[1] == [1, 0, 0, 1], rc
    took = time.monotonic() - t0
    assert took < timeout_ms / 1000, f"three calls with rank 2 masked took {took:.2f} s: they waited for it"
    assert all(w.errors(m)[0] == 0 for m in live)
    # Rank 2 is back (as after a rejoin, its counters fresh), but its own entry is 0: it exchanges with
    # nobody and nobody waits for it (it is out of their masks too).
    w2 = _world(path, M, timeout_ms=timeout_ms)
    w2.use_masks([[1, 1, 0]] * M)
    t0 = time.monotonic()
    rc, _ = w2.counts([[0, 5, 6], [7, 0, 8], [9, 10, 0]])
    assert time.monotonic() - t0 < timeout_ms / 1000, "a masked rank was waited for"
    assert rc[2] == [0, 0, 0, 0] and rc[0] == [0, 7, 0, 7] and rc[1] == [5, 0, 0, 5], rc
    assert [w2.call_mask(m) for m in range(M)] == [0b011, 0b011, 0b100]
    assert all(w2.errors(m)[0] == 0 for m in range(M)) and all(w2.masks[m].tolist() == [1, 1, 0] for m in range(M))
    return "ok"


def case_late_column_peer(path: str) -> str:
    """With a mask, node 2 of 3 starts its count exchange 1.25 timeouts after the others, as when its own
    node's kernels first waited out a dead rank there: a live node, so nobody marks it (the relay waits
    two timeouts for a column peer) and every count arrives. A 1 s timeout leaves 0.75 s for a loaded
    CI machine to start the late node's simulated grid."""
    import threading
    M, timeout_ms = 3, 1000
    w = _world(path, M, timeout_ms=timeout_ms)
    w.use_masks([[1, 1, 1]] * M)
    send = [[0, 5, 6], [7, 0, 8], [9, 10, 0]]
    late: dict = {}

    def node2() -> None:
        time.sleep(1.25 * timeout_ms / 1000)
        late["rc"] = w.counts(send, ranks=[2])[0]

    t = threading.Thread(target=node2)
    t.start()
    rc, _ = w.counts(send, ranks=[0, 1])
    t.join()
    rc.update(late["rc"])
    for m in range(M):
        assert w.errors(m)[0] == 0, f"rank {m}: {w.errors(m)}"
        assert w.masks[m].tolist() == [1, 1, 1], f"rank {m} marked a live node: {w.masks[m].tolist()}"
        want = [0 if s == m else send[s][m] for s in range(M)]
        assert rc[m] == want + [sum(want)], f"rank {m}: {rc[m]}"
    return "ok"


# ------------------------------------------------------------------ tests
@pytest.mark.parametrize("M", [2, 3])
def test_relay_counts(relay_sim_pool, M):
    pool, path = relay_sim_pool
    assert pool.run(case_counts, path, M, timeout_s=120) == ["ok"]


@pytest.mark.parametrize("M,nqp", [(2, 1), (2, 2), (3, 2)])
def test_relay_rows(relay_sim_pool, M, nqp):
    pool, path = relay_sim_pool
    assert pool.run(case_relay, path, M, nqp, timeout_s=240) == ["ok"]


def test_relay_silent_peer(relay_sim_pool):
    pool, path = relay_sim_pool
    assert pool.run(case_silent_peer, path, timeout_s=120) == ["ok"]


@pytest.mark.parametrize("M", [2, 3])
def test_relay_counts_mutation_fails(relay_sim_pool, M):
    pool, path = relay_sim_pool
    assert pool.run(case_counts_mutation, path, M, timeout_s=120) == ["ok"]


@pytest.mark.parametrize("M", [2, 3])
def test_relay_counts_refused_call(relay_sim_pool, M):
    pool, path = relay_sim_pool
    assert pool.run(case_counts_refused, path, M, timeout_s=120) == ["ok"]


def test_relay_rows_mutation_fails(relay_sim_pool):
    pool, path = relay_sim_pool
    assert pool.run(case_relay_mutation, path, timeout_s=120) == ["ok"]


def test_relay_masked_silent_peer_is_marked(relay_sim_pool):
    pool, path = relay_sim_pool
    assert pool.run(case_masked_silent_peer, path, timeout_s=120) == ["ok"]


@pytest.mark.parametrize("M", [2, 3])
def test_relay_counts_other_kind_is_a_call_mismatch(relay_sim_pool, M):
    pool, path = relay_sim_pool
    assert pool.run(case_counts_other_kind, path, M, timeout_s=120) == ["ok"]


def test_relay_late_column_peer_is_not_marked(relay_sim_pool):
    pool, path = relay_sim_pool
    assert pool.run(case_late_column_peer, path, timeout_s=120) == ["ok"]
