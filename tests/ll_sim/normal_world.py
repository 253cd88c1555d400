"""A simulated intranode normal-mode world for the CPU build of the dispatch and combine kernels
(normal_sim): R ranks in one process, host buffers laid out by pyep.ep.normal.layout, peers' rings
reached by direct stores, the handle's matrices computed here from the contract (contract.py) rather
than by the notify kernel, and an oracle of what every rank must receive and combine."""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

import torch

from pyep.ep.normal import layout
from pyep.ep.normal.device_records import TAG_RECORD_INTS
from pyep.ep.normal.limits import MAX_LOCAL_EXPERTS

WS_INTS = 8          # normal_tags.h kWs* words
WS_MASK = 6          # normal_tags.h kWsMask: the call's active ranks (bits), set by its gate
ERR_INTS = 8         # the error record: code, a, b, c
TIMEOUT_NS = 20_000_000_000


def load(path: str) -> Any:
    spec = importlib.util.spec_from_file_location("normal_sim", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _aligned(nbytes: int, align: int = 128) -> torch.Tensor:
    """A zeroed uint8 host tensor of nbytes whose first byte is `align`-aligned (a view into a larger one)."""
    raw = torch.zeros(nbytes + align, dtype=torch.uint8)
    skip = (-raw.data_ptr()) % align
    return raw[skip:skip + nbytes]


@dataclass
class RankInputs:
    x: torch.Tensor                      # bf16 [N, H] or e4m3 bytes as uint8 [N, H]
    scales: Optional[torch.Tensor]       # fp32 [N, H/128] (FP8) or None
    topk: torch.Tensor                   # int64 [N, K], -1 = no expert
    weights: torch.Tensor                # fp32 [N, K]


def make_inputs(R: int, sizes: List[int], H: int, K: int, E: int, fp8: bool, seed: int,
                colmajor: bool = False) -> List[RankInputs]:
    """`colmajor`: FP8 scales column-major (stride (1, N)), as DeepGEMM and DeepEP's tests lay them out."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for r in range(R):
        n = sizes[r]
        topk = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(n)]) if n else \
            torch.zeros((0, K), dtype=torch.int64)
        topk = topk.to(torch.int64)
        topk[torch.rand((n, K), generator=g) < 0.15] = -1
        weights = torch.rand((n, K), generator=g, dtype=torch.float32)
        if fp8:
            x = torch.randint(0, 256, (n, H), generator=g, dtype=torch.uint8)
            scales = torch.rand((n, H // 128), generator=g, dtype=torch.float32) + 0.5
            if colmajor:
                scales = scales.T.contiguous().T
        else:
            x = torch.randn((n, H), generator=g, dtype=torch.float32).to(torch.bfloat16)
            scales = None
        out.append(RankInputs(x.contiguous(), scales, topk.contiguous(), weights.contiguous()))
    return out


class Handle:
    """One rank's view of a dispatch's routing, as the notify kernel would leave it (contract.py)."""

    def __init__(self, inputs: List[RankInputs], me: int, R: int, E: int, C: int,
                 live: Optional[List[int]] = None) -> None:
        """`live`: the call's ranks with a mask (the others get no stream and send nothing)."""
        El = E // R
        self.in_rank = []
        for inp in inputs:
            owner = torch.where(inp.topk >= 0, inp.topk // El, torch.full_like(inp.topk, -1))
            self.in_rank.append(torch.stack([(owner == d).any(dim=1) & (live is None or d in live) for d in range(R)],
                                            dim=1)
                                if inp.topk.numel() else torch.zeros((inp.topk.shape[0], R), dtype=torch.bool))
        per_rank = torch.stack([ir.sum(dim=0).to(torch.int32) for ir in self.in_rank])   # [src, dst]
        self.rank_prefix = per_rank.cumsum(dim=0).to(torch.int32).contiguous()
        n = inputs[me].topk.shape[0]
        self.channel_prefix = torch.zeros((R, C), dtype=torch.int32)
        self.send_head = torch.full((n, R), -1, dtype=torch.int32)
        ir = self.in_rank[me]
        for c, (t0, t1) in enumerate(channel_ranges(n, C)):
            for d in range(R):
                sel = ir[t0:t1, d]
                pos = sel.to(torch.int32).cumsum(0) - 1
                self.send_head[t0:t1, d] = torch.where(sel, pos, torch.full_like(pos, -1))
                self.channel_prefix[d, c] = int(sel.sum()) + (int(self.channel_prefix[d, c - 1]) if c else 0)
        # [src][c]: first row of source src's channel c among its rows here (exclusive over channels).
        self.recv_channel_prefix = torch.zeros((R, C), dtype=torch.int32)
        for s in range(R):
            ns = inputs[s].topk.shape[0]
            run = 0
            for c, (t0, t1) in enumerate(channel_ranges(ns, C)):
                self.recv_channel_prefix[s, c] = run
                run += int(self.in_rank[s][t0:t1, me].sum())
        self.num_rows = int(self.rank_prefix[R - 1, me])


def channel_ranges(n: int, C: int) -> List[tuple]:
    per = (n + C - 1) // C
    return [(min(per * c, n), min(per * c + per, n)) for c in range(C)]


class NormalWorld:
    """R ranks' buffers and counters; dispatch() and combine() launch the kernels on every rank at once."""

    def __init__(self, sim: Any, R: int, H: int, K: int, E: int, C: int, Q: int, chunk: int,
                 use_tma: int = 3, masked: bool = False, timeout_ns: int = TIMEOUT_NS, pool_bytes: int = 0,
                 traced: bool = False) -> None:
        """pool_bytes > 0: each buffer has an output pool past its rings and dispatch runs the one-copy
        handshake (normal_direct.cuh); a rank offers its outputs there unless dispatch(offer=...) leaves it out.
        traced: the combines run the traced kernel (normal_trace.cuh) into trace[r], zeroed before each."""
        self.sim, self.R, self.H, self.K, self.E, self.C, self.Q, self.chunk = sim, R, H, K, E, C, Q, chunk
        self.use_tma, self.timeout_ns = use_tma, timeout_ns
        # With a mask (docs/elastic.md, "Normal mode"): each rank's active_ranks, and the tokens each call
        # did not deliver to each rank.
        self.active = [torch.ones(R, dtype=torch.int32) for _ in range(R)] if masked else None
        self.dropped = [torch.zeros(R, dtype=torch.int32) for _ in range(R)]
        self.words = layout.control_words(R)
        self.ring_off = layout.ring_offset(R)
        self.slot = layout.slot_bytes(H)
        self.capacity = layout.ring_bytes(R, C, Q, self.slot)
        self.pool_lo = self.ring_off + self.capacity if pool_bytes else 0
        self.pool_hi = self.pool_lo + pool_bytes if pool_bytes else 0
        self.bufs = [_aligned(self.ring_off + self.capacity + pool_bytes) for _ in range(R)]
        self.peer_base = torch.tensor([b.data_ptr() for b in self.bufs], dtype=torch.int64)
        self.ws = [torch.zeros(WS_INTS, dtype=torch.int32) for _ in range(R)]
        self.err = [torch.zeros(ERR_INTS, dtype=torch.int32) for _ in range(R)]
        # What the notify kernel (the gate) writes for the host: [ready, rows, per-expert rows], the
        # record of the last void call, the per-expert scratch of the route kernel.
        self.host = [torch.zeros(2 + MAX_LOCAL_EXPERTS, dtype=torch.int32) for _ in range(R)]
        self.tag_record = [torch.zeros(TAG_RECORD_INTS, dtype=torch.int32) for _ in range(R)]
        self.scratch = [torch.zeros(R * MAX_LOCAL_EXPERTS, dtype=torch.int32) for _ in range(R)]
        from pyep.ep.normal.trace import TRACE_WORDS
        self.trace = ([torch.zeros((2 * C, TRACE_WORDS), dtype=torch.int64) for _ in range(R)] if traced else None)

    def static(self, r: int) -> Dict[str, int]:
        w = self.words
        return dict(rank=r, num_ranks=self.R, buf=self.bufs[r].data_ptr(), peer_base=self.peer_base.data_ptr(),
                    ring_off=self.ring_off, ring_capacity=self.capacity, slot_bytes=self.slot,
                    off_tail=w["tail"], off_head=w["head"], off_tx=w["tx_pos"], off_rx=w["rx_pos"], off_alive=w["alive"],
                    err=self.err[r].data_ptr(), workspace=self.ws[r].data_ptr(), timeout_ns=self.timeout_ns,
                    active=self.active[r].data_ptr() if self.active is not None else 0,
                    off_flag=w["notify_flag"], off_notify=w["notify"], notify_ints=layout.notify_ints(),
                    host_counts=self.host[r].data_ptr(), tag_record=self.tag_record[r].data_ptr(),
                    layout_scratch=self.scratch[r].data_ptr(),
                    off_direct=w["direct"], pool_lo=self.pool_lo, pool_hi=self.pool_hi, off_pulled=w["pulled"],
                    trace=self.trace[r].data_ptr() if self.trace is not None else 0)

    def rings(self, r: int) -> torch.Tensor:
        """Rank r's ring bytes (a view)."""
        return self.bufs[r][self.ring_off:self.ring_off + self.capacity]

    def _pool_outputs(self, r: int, rows: int, fp8: bool, cached: bool) -> tuple:
        """(recv_x, recv_scales, staging address) laid out in rank r's pool as direct_pool.OutputLayout
        lays them out, filled with values no kernel writes."""
        from pyep.ep.normal.direct_pool import OutputLayout
        H = self.H
        lay = OutputLayout.of(rows, H, 1 if fp8 else 2, fp8, None if cached else self.K)
        assert self.pool_lo + lay.total <= self.pool_hi, "the simulated pool is too small for this call"
        raw = self.bufs[r][self.pool_lo:self.pool_lo + lay.total]
        x = raw[lay.x:lay.x + rows * H * (1 if fp8 else 2)]
        x = x.view(rows, H) if fp8 else x.view(torch.bfloat16).view(rows, H)
        x.view(torch.uint8).fill_(0x5A) if fp8 else x.fill_(3.0)
        sc = raw[lay.scales:lay.scales + rows * (H // 128) * 4].view(torch.float32).view(rows, H // 128) if fp8 else None
        if sc is not None:
            sc.fill_(-1.0)
        stage = 0 if cached else raw.data_ptr() + lay.stage
        return x, sc, stage

    def notify(self, inputs: List[RankInputs], ranks: Optional[List[int]] = None, alignment: int = 1,
               status: Optional[Dict[int, int]] = None, sig: Optional[Dict[int, List[int]]] = None) -> List[dict]:
        """get_dispatch_layout on each rank, then one call's routing and gate on `ranks` at once (the
        native dispatch's first kernels): per rank the layout tensors, the handle's matrices, send_head,
        the host-visible counts and the dropped tokens. `status`: a rank's tag status (tags.py; 1 =
        this rank refuses the call); `sig`: a rank's host signature words (NotifyArgs.sig, else 0s)."""
        R, E = self.R, self.E
        ranks = list(range(R)) if ranks is None else ranks
        outs, args = [], []
        for r in range(R):
            inp = inputs[r]
            n, K = inp.topk.shape
            o = {"per_rank": torch.full((R,), -1, dtype=torch.int32), "per_expert": torch.full((E,), -1, dtype=torch.int32),
                 "in_rank": torch.zeros((n, R), dtype=torch.bool), "rpm": torch.full((R, R), -1, dtype=torch.int32),
                 "cpm": torch.full((R, self.C), -1, dtype=torch.int32),
                 "rcp": torch.full((R, self.C), -1, dtype=torch.int32),
                 "send_head": torch.full((n, R), -7, dtype=torch.int32)}
            outs.append(o)
            if r in ranks:
                self.sim.layout(self.static(r), dict(
                    topk=_ptr(inp.topk), num_tokens=n, num_topk=K, num_experts=E,
                    num_tokens_per_rank=o["per_rank"].data_ptr(), num_tokens_per_expert=o["per_expert"].data_ptr(),
                    is_token_in_rank=_ptr(o["in_rank"]), dropped=self.dropped[r].data_ptr()))
            self.host[r][0] = 0
            args.append(dict(
                topk=_ptr(inp.topk), num_topk=K, num_tokens_per_rank=o["per_rank"].data_ptr(),
                num_tokens_per_expert=o["per_expert"].data_ptr(), is_token_in_rank=_ptr(o["in_rank"]), num_tokens=n,
                num_experts=E, num_channels=self.C, expert_alignment=alignment,
                rank_prefix_matrix=o["rpm"].data_ptr(), channel_prefix_matrix=o["cpm"].data_ptr(),
                recv_channel_prefix_matrix=o["rcp"].data_ptr(), send_head=_ptr(o["send_head"]), check_layout=1,
                dropped=self.dropped[r].data_ptr(), status=(status or {}).get(r, 0),
                **({"sig": sig[r]} if sig and r in sig else {})))
        self.sim.notify([self.static(r) for r in ranks], [args[r] for r in ranks])
        for r in ranks:
            outs[r]["ready"], outs[r]["rows"] = int(self.host[r][0]), int(self.host[r][1])
            outs[r]["expert_rows"] = self.host[r][2:2 + E // R].tolist()
        return outs

    def _gate(self, ranks: List[int]) -> None:
        """What a call's gate leaves for the kernels with a mask: the buffer's active ranks as the call's."""
        if self.active is None:
            return
        for r in ranks:
            a = self.active[r].tolist()
            self.ws[r][WS_MASK] = sum(1 << i for i, v in enumerate(a) if v) if a[r] else 0

    def errors(self) -> List[List[int]]:
        return [e.tolist()[:4] for e in self.err]

    def dispatch(self, inputs: List[RankInputs], ranks: Optional[List[int]] = None, cached: bool = False,
                 worst: int = 0, handles: Optional[List["Handle"]] = None, offer: Optional[List[int]] = None,
                 bad_offer: Optional[int] = None, between: Optional[Callable[[], None]] = None) -> tuple:
        """Runs one dispatch on `ranks` (all by default; a rank left out is one that never launched);
        returns (handles, outputs) with outputs[r] = dict of received tensors. `cached`: as with a
        handle (no top-k in or out, no source indices); `worst` > 0: outputs of that many rows
        (num_worst_tokens), the real count where notify leaves it (workspace word kWsRows). With a pool
        the ranks in `offer` (all by default) get their recv_x / recv_scales in it; `bad_offer`: that rank
        offers a recv_x outside its pool (what a corrupted peer descriptor looks like); `between` runs after
        the one-copy kernel and before the ring kernel."""
        R, H, K = self.R, self.H, self.K
        ranks = list(range(R)) if ranks is None else ranks
        fp8 = inputs[0].scales is not None
        gated = handles is not None   # the handles of a notify: its gate set the call's mask and rows
        if handles is None:
            handles = [Handle(inputs, r, R, self.E, self.C) for r in range(R)]
        outs, args = [], []
        for r in range(R):
            h, inp = handles[r], inputs[r]
            rows = worst or h.num_rows
            assert rows >= h.num_rows
            if not gated:
                self.ws[r][0] = h.num_rows
                if self.pool_hi:        # kWsSeq, which the one-copy descriptors carry: a gate advances it
                    self.ws[r][1] += 1
            o = {"recv_x": torch.full((rows, H), 0x5A, dtype=torch.uint8) if fp8 else
                 torch.full((rows, H), 3.0, dtype=torch.bfloat16),   # never what a kernel writes
                 "recv_scales": torch.full((rows, H // 128), -1.0, dtype=torch.float32) if fp8 else None,
                 "recv_topk_idx": torch.full((rows, K), -7, dtype=torch.int64),
                 "recv_topk_weights": torch.full((rows, K), -7.0, dtype=torch.float32),
                 "recv_src_idx": torch.full((rows,), -7, dtype=torch.int32), "handle": h}
            if cached:
                o["recv_topk_idx"] = o["recv_topk_weights"] = o["recv_src_idx"] = None
            stage, offered = 0, False
            if self.pool_hi and (offer is None or r in offer):
                o["recv_x"], o["recv_scales"], stage = self._pool_outputs(r, rows, fp8, cached)
                offered = True
            if bad_offer == r:
                offered = True
            outs.append(o)
            keep = [inp.x, inp.scales, inp.topk, inp.weights, h.in_rank[r].contiguous(), h.rank_prefix,
                    h.channel_prefix, h.recv_channel_prefix]
            o["_keep"] = keep
            args.append(dict(
                x=_ptr(inp.x), x_scales=_ptr(inp.scales), topk_idx=0 if cached else _ptr(inp.topk),
                scale_token_stride=inp.scales.stride(0) if fp8 else -1,
                scale_group_stride=inp.scales.stride(1) if fp8 else -1,
                topk_weights=0 if cached else _ptr(inp.weights), num_worst_tokens=worst,
                is_token_in_rank=keep[4].data_ptr(), rank_prefix_matrix=h.rank_prefix.data_ptr(),
                channel_prefix_matrix=h.channel_prefix.data_ptr(),
                recv_channel_prefix_matrix=h.recv_channel_prefix.data_ptr(), num_tokens=inp.topk.shape[0],
                hidden=H, num_topk=K, num_local_experts=self.E // R, fp8=int(fp8), num_channels=self.C,
                ring_tokens=self.Q, chunk_tokens=self.chunk, num_out_rows=rows, use_tma=self.use_tma,
                recv_x=_ptr(o["recv_x"]), recv_x_scales=_ptr(o["recv_scales"]),
                recv_topk_idx=_ptr(o["recv_topk_idx"]), recv_topk_weights=_ptr(o["recv_topk_weights"]),
                recv_src_idx=_ptr(o["recv_src_idx"]), send_head=_ptr(h.send_head),
                dropped=self.dropped[r].data_ptr(), direct=int(bool(self.pool_hi)), direct_offer=int(offered),
                direct_stage=stage))
        if not gated:
            self._gate(ranks)
        self.sim.dispatch([self.static(r) for r in ranks], [args[r] for r in ranks], between)
        return handles, outs

    def pull_gate(self, offers: List[tuple], K: int, ranks: Optional[List[int]] = None) -> None:
        """A combine's call gate alone (the notify kernel, gate_only) on `ranks` at once, carrying offers[r] =
        (offer, rows, byte offset of x in rank r's buffer) as native.py gate(pull=...) does."""
        R = self.R
        ranks = list(range(R)) if ranks is None else ranks
        args = [dict(topk=0, num_topk=0, num_tokens_per_rank=0, num_tokens_per_expert=0, is_token_in_rank=0,
                     num_tokens=0, num_experts=self.E, num_channels=self.C, rank_prefix_matrix=0,
                     channel_prefix_matrix=0, recv_channel_prefix_matrix=0, send_head=0, gate_only=1, kind=4,
                     sig=[self.H, self.C, self.Q, K], pull_offer=offers[r][0], pull_rows=offers[r][1],
                     pull_x=offers[r][2]) for r in range(R)]
        self.sim.notify([self.static(r) for r in ranks], [args[r] for r in ranks])

    def pool_tensor(self, r: int, like: torch.Tensor) -> tuple:
        """A copy of `like` (bf16 [rows, H]) at the start of rank r's output pool, and its offer."""
        assert self.pool_hi, "a world without an output pool"
        n = like.numel() * 2
        assert self.pool_lo + n <= self.pool_hi, "the simulated pool is too small"
        t = self.bufs[r][self.pool_lo:self.pool_lo + n].view(torch.bfloat16).view(like.shape)
        t.copy_(like)
        return t, (1, like.shape[0], self.pool_lo)

    def combine(self, handles: List[Handle], ys: List[torch.Tensor], ws: Optional[List[torch.Tensor]],
                bias: Optional[List[torch.Tensor]] = None, ranks: Optional[List[int]] = None,
                pull: Optional[List[int]] = None, offers: Optional[Dict[int, tuple]] = None,
                gate_ranks: Optional[List[int]] = None) -> List[Dict[str, torch.Tensor]]:
        """Combines ys[r] (bf16 [rows_r, H], received-row order) with weights ws[r] back to their sources.
        `pull`: the call runs its gate first (on `gate_ranks`, all by default), and the ranks listed copy
        their ys into their pool and offer it (normal_pull.cuh); no weights then (ws None). `offers`
        overrides what a rank offers: (offer, rows, byte offset)."""
        R, H, K = self.R, self.H, self.K
        ranks = list(range(R)) if ranks is None else ranks
        offered = [0] * R
        if pull is not None:
            assert ws is None, "a pull combine takes no weights"
            given, gate_offers = [], []
            for r in range(R):
                t, offer = self.pool_tensor(r, ys[r]) if r in pull else (ys[r], (0, 0, 0))
                offer = (offers or {}).get(r, offer)
                given.append(t)
                gate_offers.append(offer)
                offered[r] = offer[0]
            self.pull_gate(gate_offers, 0, gate_ranks)
            ys = given
        outs, args = [], []
        for r in range(R):
            h = handles[r]
            n = h.send_head.shape[0]
            o = {"out": torch.full((n, H), 7.0, dtype=torch.bfloat16),
                 "out_weights": torch.full((n, K), -7.0, dtype=torch.float32)}
            outs.append(o)
            a = dict(x=ys[r].data_ptr() if ys[r].numel() else 0, topk_weights=_ptr(ws[r]) if ws else 0,
                     send_head=_ptr(h.send_head), rank_prefix_matrix=h.rank_prefix.data_ptr(),
                     channel_prefix_matrix=h.channel_prefix.data_ptr(),
                     recv_channel_prefix_matrix=h.recv_channel_prefix.data_ptr(), num_tokens=n, hidden=H,
                     num_topk=K if ws else 0, num_channels=self.C, ring_tokens=self.Q, chunk_tokens=self.chunk,
                     out=_ptr(o["out"]), out_weights=_ptr(o["out_weights"]) if ws else 0,
                     dropped=self.dropped[r].data_ptr(), use_tma=self.use_tma,
                     pull=offered[r])
            if bias is not None:
                a["bias0"] = bias[r].data_ptr()
            args.append(a)
        self._gate(ranks)
        for t in self.trace or []:
            t.zero_()   # as launch_combine does before a traced combine
        self.sim.combine([self.static(r) for r in ranks], [args[r] for r in ranks])
        return outs


def _ptr(t: Optional[torch.Tensor]) -> int:
    return t.data_ptr() if t is not None and t.numel() else 0


# ---- oracle (contract.py) --------------------------------------------------------------------------------

def check_dispatch(inputs: List[RankInputs], handles: List[Handle], outs: List[dict], E: int, what: str,
                   ranks: Optional[List[int]] = None, gone: Optional[List[int]] = None) -> None:
    """Every row of the ranks in `ranks` (all by default); the rows from a source in `gone` must be
    empty: zero payload and scales, ids -1, weights 0, source -1 (a marked source's convention)."""
    R = len(inputs)
    El = E // R
    for me in (range(R) if ranks is None else ranks):
        o, h = outs[me], handles[me]
        j = 0
        for s in range(R):
            toks = torch.nonzero(h.in_rank[s][:, me]).flatten().tolist()
            for t in toks:
                where = f"{what}: rank {me} row {j} (source {s} token {t})"
                if gone and s in gone:
                    assert not o["recv_x"][j].view(torch.uint8).any(), where + ": payload of a marked source"
                    if o["recv_scales"] is not None:
                        assert not o["recv_scales"][j].any(), where + ": scales of a marked source"
                    assert (o["recv_topk_idx"][j] == -1).all(), where + ": ids of a marked source"
                    assert not o["recv_topk_weights"][j].any(), where + ": weights of a marked source"
                    assert int(o["recv_src_idx"][j]) == -1, where + ": source index of a marked source"
                    j += 1
                    continue
                if inputs[s].scales is not None:
                    assert torch.equal(o["recv_x"][j], inputs[s].x[t]), where + ": payload"
                    assert torch.equal(o["recv_scales"][j], inputs[s].scales[t]), where + ": scales"
                else:
                    assert torch.equal(o["recv_x"][j].view(torch.int16), inputs[s].x[t].view(torch.int16)), \
                        where + ": payload"
                if o["recv_topk_idx"] is None:   # cached: the payload only
                    j += 1
                    continue
                ids = inputs[s].topk[t]
                local = (ids >= me * El) & (ids < (me + 1) * El)
                want = torch.where(local, ids - me * El, torch.full_like(ids, -1))
                assert torch.equal(o["recv_topk_idx"][j], want), where + f": ids {o['recv_topk_idx'][j]} != {want}"
                want_w = torch.where(local, inputs[s].weights[t], torch.zeros_like(inputs[s].weights[t]))
                assert torch.equal(o["recv_topk_weights"][j], want_w), where + ": weights"
                assert int(o["recv_src_idx"][j]) == t, where + ": source index"
                j += 1
        assert j == h.num_rows
        if o["recv_src_idx"] is not None:   # rows past the real count (num_worst_tokens): nobody's
            assert (o["recv_src_idx"][j:] == -1).all(), f"{what}: rank {me} padding rows' source"
            assert (o["recv_topk_idx"][j:] == -1).all(), f"{what}: rank {me} padding rows' ids"
            assert not o["recv_topk_weights"][j:].any(), f"{what}: rank {me} padding rows' weights"


def expected_combine(handles: List[Handle], ys: List[torch.Tensor], ws: List[torch.Tensor], me: int,
                     bias: Optional[torch.Tensor] = None, live: Optional[List[int]] = None) -> tuple:
    """(out bf16 [N, H], out_weights fp32 [N, K]) of rank me: 0 (+ bias), then the rows of every rank
    holding the token, ranks ascending, summed in fp32 (contract.py); only ranks in `live` if given."""
    R = len(handles)
    h = handles[me]
    n, H = h.send_head.shape[0], ys[0].shape[1]
    K = ws[0].shape[1]
    acc = torch.zeros((n, H), dtype=torch.float32)
    wacc = torch.zeros((n, K), dtype=torch.float32)
    if bias is not None:
        acc = acc + bias.float()
    ir = h.in_rank[me]
    for d in (range(R) if live is None else live):
        first = int(h.rank_prefix[me - 1, d]) if me else 0
        toks = torch.nonzero(ir[:, d]).flatten()
        rows = first + torch.arange(toks.numel())
        acc[toks] = acc[toks] + ys[d][rows].float()
        wacc[toks] = wacc[toks] + ws[d][rows]
    return acc.to(torch.bfloat16), wacc


def adopt_notified(handle: Handle, notified: dict, me: int) -> None:
    """The handle the layout, route and gate kernels built (NormalWorld.notify) in place of the
    contract's, once a check found them equal: the dispatch then runs on the kernels' own matrices."""
    handle.rank_prefix, handle.channel_prefix = notified["rpm"], notified["cpm"]
    handle.recv_channel_prefix, handle.send_head = notified["rcp"], notified["send_head"]
    handle.in_rank[me] = notified["in_rank"]


def expert_outputs(handles: List[Handle], H: int, K: int, seed: int) -> tuple:
    """(ys, ws): random expert outputs bf16 [rows, H] and combine weights fp32 [rows, K] per rank."""
    g = torch.Generator().manual_seed(seed)
    ys = [torch.randn((h.num_rows, H), generator=g).to(torch.bfloat16) for h in handles]
    ws = [torch.rand((h.num_rows, K), generator=g) for h in handles]
    return ys, ws


def check_combine(handles: List[Handle], ys: List[torch.Tensor], ws: List[torch.Tensor], comb: List[dict],
                  ranks: List[int], what: str, bias: Optional[List[torch.Tensor]] = None,
                  live: Optional[List[int]] = None) -> None:
    """Every combined token and weight of `ranks` bit for bit (expected_combine)."""
    for r in ranks:
        want, want_w = expected_combine(handles, ys, ws, r, bias[r] if bias else None, live)
        bad = (comb[r]["out"].view(torch.int16) != want.view(torch.int16)).any(dim=1).nonzero().flatten().tolist()
        assert not bad, f"{what}: rank {r} combined tokens {bad[:8]} differ"
        assert torch.equal(comb[r]["out_weights"], want_w), f"{what}: rank {r} combined weights"
