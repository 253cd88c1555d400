"""A simulated EP world for the CPU build of the low-latency kernels (ll_sim): R ranks in one process,
host buffers laid out by pyep.ep.ll.layout, peers connected by direct stores or by the simulated NIC, and
a brute-force oracle of what every rank must receive and combine."""
from __future__ import annotations

import importlib.util
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from pyep.ep import fp8
from pyep.ep.ll.errors import CALL_RECORD_WORDS, RECORD_WORDS
from pyep.ep.ll.layout import ll_buffer_layout


def load(path: str) -> Any:
    spec = importlib.util.spec_from_file_location("ll_sim", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class SoftNicMesh:
    """The real softnic (pyep.softnic) as the NIC of the simulated world: one softnic per rank in this
    process, shared-memory buffers, a full mesh of RC QPs between the NIC pairs."""

    def __init__(self, R: int, nbytes: int, pairs: set, nqp: int, log_sq: int = 8) -> None:
        import numpy as np
        from pyep.softnic import Placement, SoftNic, SoftNicConfig, new_fabric_id
        fabric = new_fabric_id()
        self.nics = [SoftNic(SoftNicConfig(node_id=r + 1, fabric_id=fabric)) for r in range(R)]
        self.host = [n.alloc_host(nbytes) for n in self.nics]
        self.bufs = [torch.frombuffer(h.view, dtype=torch.uint8) for h in self.host]
        for b in self.bufs:
            b.zero_()
        self.mrs = [n.reg_mr(h) for n, h in zip(self.nics, self.host)]
        qps: Dict[Tuple[int, int, int], Any] = {}
        for (r, d) in pairs:
            for j in range(nqp):
                cq = self.nics[r].create_cq(log_sq, Placement.HOST)
                qps[(r, d, j)] = (cq, self.nics[r].create_qp(cq, log_sq, Placement.HOST))
        self.qps = qps
        size = None
        self.ctx: List[Any] = []
        for r in range(R):
            blobs = {}
            for (r_, d, j), (cq, qp) in qps.items():
                if r_ != r:
                    continue
                self.nics[r].connect(qp, d + 1, qps[(d, r, j)][1].qpn)
                blobs[(d, j)] = self.nics[r].host_qp(qp, cq).context_bytes()
                size = len(blobs[(d, j)])
            arr = np.zeros(max(1, R * nqp * (size or 1)), dtype=np.uint8)
            for (d, j), b in blobs.items():
                at = (d * nqp + j) * size
                arr[at:at + size] = np.frombuffer(b, dtype=np.uint8)
            self.ctx.append(arr)

    def contexts(self, rank: int) -> int:
        return int(self.ctx[rank].ctypes.data)

    def errors(self) -> List[str]:
        return [e for n in self.nics for e in n.events()]

    def executed(self) -> int:
        """WQEs the softnics executed (NOPs included)."""
        return sum(self.nics[r].qp_stats(qp).wqes for (r, _, _), (_, qp) in self.qps.items())

    def close(self) -> None:
        for n in self.nics:
            n.close()


class World:
    def __init__(self, sim: Any, R: int, T: int, H: int, E: int, K_max: int, grid: int,
                 nic_pairs: Sequence[Tuple[int, int]] = (), nqp: int = 2, softnic: bool = False,
                 lag_ns: Sequence[int] = ()) -> None:
        """lag_ns[j]: the simulated NIC runs QP j of every pair that much behind (SimNic)."""
        self.sim, self.R, self.T, self.H, self.E, self.K_max = sim, R, T, H, E, K_max
        self.lay = ll_buffer_layout(T, H, E, R, K_max)
        self.e_l = E // R
        self.ws = [torch.zeros(self.lay.workspace_words(), dtype=torch.int32) for _ in range(R)]
        # The dispatch kernel's error record per rank (pyep.ep.ll.errors; host memory on the GPU too).
        self.errs = [torch.zeros(RECORD_WORDS, dtype=torch.int32) for _ in range(R)]
        # The call record (an exchange that failed with a peer) and the generations each rank expects of
        # every rank, itself included (all 0: a buffer on a process group).
        self.call_errs = [torch.zeros(CALL_RECORD_WORDS, dtype=torch.int32) for _ in range(R)]
        self.gens = [torch.zeros(R, dtype=torch.int32) for _ in range(R)]
        # Per-block timeline stamps [kernel][block][slot] (ns; 0 = not reached), reset by the caller.
        self.traces = [torch.zeros(2, grid, sim.trace_slots, dtype=torch.int64) for _ in range(R)]
        self.active = [torch.ones(R, dtype=torch.int32) for _ in range(R)]
        # Per-source receive wait (ns) each rank's calls add up when a call passes wait_stats=True.
        self.wait_stats = {k: [torch.zeros(R, dtype=torch.int64) for _ in range(R)] for k in ("dispatch", "combine")}
        nic = {(i, j) for i, j in nic_pairs} | {(j, i) for i, j in nic_pairs}
        if softnic:
            self.nic: Any = SoftNicMesh(R, self.lay.total_bytes, nic, nqp)
            self.bufs = self.nic.bufs
            keys = [(m.lkey, m.rkey) for m in self.nic.mrs]
        else:
            self.bufs = [torch.zeros(self.lay.total_bytes, dtype=torch.uint8) for _ in range(R)]
            self.nic = sim.SimNic([b.data_ptr() for b in self.bufs], [self.lay.total_bytes] * R, nqp, 8,
                                  list(lag_ns)) if nic else None
            keys = [(1000 + r, 1000 + r) for r in range(R)]
        self.tables: List[Dict[str, torch.Tensor]] = []
        self.statics: List[Dict[str, int]] = []
        for r in range(R):
            t = {"peer_base": torch.tensor([0 if (r, j) in nic else self.bufs[j].data_ptr() for j in range(R)],
                                           dtype=torch.int64),
                 "remote_addr": torch.tensor([b.data_ptr() for b in self.bufs], dtype=torch.int64),
                 "rkeys": torch.tensor([keys[j][1] for j in range(R)], dtype=torch.int64).to(torch.int32),
                 "flag_expect": torch.tensor([nqp if (r, j) in nic else 1 for j in range(R)], dtype=torch.int32)}
            self.tables.append(t)
            lay = self.lay
            self.statics.append(dict(
                rank=r, num_ranks=R, num_local_experts=self.e_l, num_max_tokens=T, hidden=H, max_topk=K_max,
                buf=self.bufs[r].data_ptr(), peer_base=t["peer_base"].data_ptr(),
                remote_addr=t["remote_addr"].data_ptr(), rkeys=t["rkeys"].data_ptr(), lkey=keys[r][0],
                qps=self.nic.contexts(r) if nic else 0, num_qps_per_peer=nqp if nic else 1,
                flag_expect=t["flag_expect"].data_ptr(), fetch_addr=self.bufs[r].data_ptr() + lay.off_fetch,
                workspace=self.ws[r].data_ptr(), half_bytes=lay.half_bytes, off_dsig=lay.off_dsig,
                off_csig=lay.off_csig, off_cack=lay.off_cack, off_drecv=lay.off_drecv, off_crecv=lay.off_crecv,
                msg_bytes=lay.msg_bytes, slots_per_src=lay.slots_per_src, num_blocks=grid,
                err=self.errs[r].data_ptr(), call_err=self.call_errs[r].data_ptr(),
                peer_gen=self.gens[r].data_ptr(), trace=self.traces[r].data_ptr()))

    def rejoin(self) -> None:
        """What update_ep_member does on every rank: clear signals and decisions, everyone active."""
        for r in range(self.R):
            for off, size in self.lay.signal_ranges:
                self.bufs[r][off:off + size] = 0
            self.ws[r].zero_()
            self.active[r].fill_(1)

    def dispatch_outputs(self, use_fp8: bool = False, use_ue8m0: bool = False) -> List[Dict[str, Any]]:
        """Every rank's dispatch output tensors, filled with sentinels."""
        rows, g = self.R * self.T, self.H // 128
        outs = []
        for r in range(self.R):
            o = {"recv_x": torch.zeros(self.e_l, rows, self.H if use_fp8 else 2 * self.H, dtype=torch.uint8),
                 "src_info": torch.full((self.e_l, rows), -7, dtype=torch.int32),
                 "recv_slot": torch.full((self.e_l, rows), -7, dtype=torch.int32),
                 "layout_range": torch.zeros(self.e_l, self.R, dtype=torch.int64),
                 "recv_count": torch.full((self.e_l,), -7, dtype=torch.int32),
                 "cum": torch.zeros(self.e_l, dtype=torch.int32)}
            if use_fp8:
                o["scales"] = (torch.zeros(self.e_l, (g + 3) // 4, rows, dtype=torch.int32) if use_ue8m0 else
                               torch.zeros(self.e_l, g, rows, dtype=torch.float32))
            outs.append(o)
        return outs

    def dispatch(self, inputs: Sequence[Any], half: int, use_fp8: bool = False, round_scale: bool = False,
                 use_ue8m0: bool = False, ranks: Optional[Sequence[int]] = None, phases: int = 3,
                 timeout_ns: int = 20_000_000_000, outs: Optional[List[Dict[str, Any]]] = None,
                 wait_stats: bool = False, seq: Any = None, aborts: Optional[Dict[int, int]] = None):
        """seq: the call number (its tag), one for every rank or a list per rank (default: `half`);
        aborts: {rank: reason} of ranks that refused the call (abort marker, no tokens)."""
        ranks = list(range(self.R)) if ranks is None else list(ranks)
        if outs is None:
            outs = self.dispatch_outputs(use_fp8, use_ue8m0)
        calls = [self.dispatch_call(r, inputs, half, outs, use_fp8, round_scale, use_ue8m0, phases, timeout_ns,
                                    wait_stats, seq, aborts) for r in ranks]
        self.sim.dispatch([self.statics[r] for r in ranks], calls)
        return outs

    def dispatch_call(self, r: int, inputs: Sequence[Any], half: int, outs: List[Dict[str, Any]],
                      use_fp8: bool = False, round_scale: bool = False, use_ue8m0: bool = False, phases: int = 3,
                      timeout_ns: int = 20_000_000_000, wait_stats: bool = False, seq: Any = None,
                      aborts: Optional[Dict[int, int]] = None) -> Dict[str, int]:
        """Rank r's dispatch launch (dispatch() takes every listed rank's at once; streams() in order)."""
        x, topk, _ = inputs[r]
        o = outs[r]
        abort = (aborts or {}).get(r, 0)
        return dict(x=x.data_ptr(), topk=topk.data_ptr(), num_tokens=0 if abort else x.shape[0],
                    num_topk=topk.shape[1], seq=_seq_of(seq, half, r), abort=abort,
                    half=half, use_fp8=int(use_fp8), round_scale=int(round_scale),
                    use_ue8m0=int(use_ue8m0), active=self.active[r].data_ptr(),
                    recv_x=o["recv_x"].data_ptr(), recv_scales=o["scales"].data_ptr() if use_fp8 else 0,
                    src_info=o["src_info"].data_ptr(), recv_slot=o["recv_slot"].data_ptr(),
                    layout_range=o["layout_range"].data_ptr(), recv_count=o["recv_count"].data_ptr(),
                    cum_stats=o["cum"].data_ptr(), timeout_ns=timeout_ns, phases=phases,
                    wait_stats=self.wait_stats["dispatch"][r].data_ptr() if wait_stats else 0)

    def combine(self, ys: Sequence[Any], inputs: Sequence[Any], douts: Sequence[Dict[str, Any]], half: int,
                ranks: Optional[Sequence[int]] = None, phases: int = 3, timeout_ns: int = 20_000_000_000,
                use_logfmt: bool = False, wait_stats: bool = False, repeat: bool = False,
                outs: Optional[List[Any]] = None, seq: Any = None, aborts: Optional[Dict[int, int]] = None):
        """seq / aborts: as for dispatch (the seq of a combine is its dispatch's)."""
        ranks = list(range(self.R)) if ranks is None else list(ranks)
        if outs is None:   # a send launch and its receive launch share the caller's outputs
            outs = self.combine_outputs(inputs)
        calls = [self.combine_call(r, ys, inputs, douts, half, outs, phases, timeout_ns, use_logfmt, wait_stats,
                                   repeat, seq, aborts) for r in ranks]
        self.sim.combine([self.statics[r] for r in ranks], calls)
        return outs

    def combine_call(self, r: int, ys: Sequence[Any], inputs: Sequence[Any], douts: Sequence[Dict[str, Any]],
                     half: int, outs: List[Any], phases: int = 3, timeout_ns: int = 20_000_000_000,
                     use_logfmt: bool = False, wait_stats: bool = False, repeat: bool = False, seq: Any = None,
                     aborts: Optional[Dict[int, int]] = None) -> Dict[str, int]:
        """Rank r's combine launch (as dispatch_call)."""
        x, topk, w = inputs[r]
        d = douts[r]
        abort = (aborts or {}).get(r, 0)
        return dict(x=ys[r].data_ptr(), topk=topk.data_ptr(), weights=w.data_ptr(),
                    num_tokens=0 if abort else x.shape[0], seq=_seq_of(seq, half, r), abort=abort,
                    num_topk=topk.shape[1], half=half, src_info=d["src_info"].data_ptr(),
                    recv_slot=d["recv_slot"].data_ptr(), layout_range=d["layout_range"].data_ptr(),
                    active=self.active[r].data_ptr(), out=outs[r].data_ptr(), timeout_ns=timeout_ns,
                    phases=phases, use_logfmt=int(use_logfmt),
                    wait_stats=self.wait_stats["combine"][r].data_ptr() if wait_stats else 0,
                    repeat=int(repeat))

    def streams(self, launches: Sequence[Sequence[Tuple[str, Dict[str, int]]]]) -> None:
        """launches[r]: rank r's ("dispatch" | "combine", call) in stream order, with no host step between
        them (a call launched right after the previous one, no synchronisation); all ranks at once."""
        self.sim.streams([[(kind, self.statics[r], call) for kind, call in ls] for r, ls in enumerate(launches)])

    def combine_outputs(self, inputs: Sequence[Any]) -> List[Any]:
        return [torch.full((inputs[r][0].shape[0], self.H), float("nan"), dtype=torch.bfloat16) for r in range(self.R)]

    def acks(self, half: int) -> Tuple[List[List[int]], List[List[int]]]:
        """(sent[r][d], acked[r][d]): combines rank r sent to d on `half` (its workspace csent) and the
        acknowledgements d added to cack[half][d] in r's buffer."""
        from pyep.ep.ll.layout import ws_csent_index
        sent = [[int(self.ws[r][ws_csent_index(self.R, half, d)]) for d in range(self.R)] for r in range(self.R)]
        acked = [[int(self.bufs[r][self.lay.cack_offset(half, d):self.lay.cack_offset(half, d) + 4].view(torch.int32))
                  for d in range(self.R)] for r in range(self.R)]
        return sent, acked


def _seq_of(seq: Any, half: int, rank: int) -> int:
    if seq is None:
        return half
    return int(seq[rank]) if isinstance(seq, (list, tuple)) else int(seq)


def routing(R: int, e_l: int, inputs: Sequence[Any], me: int, active: Sequence[bool]):
    """Per local expert of `me`: the (source rank, token, k) rows in receive order."""
    out = []
    for le in range(e_l):
        ge = me * e_l + le
        rows = []
        for r in range(R):
            if active[r]:
                rows += [(r, t, k) for t, k in (inputs[r][1] == ge).nonzero().tolist()]
        out.append(rows)
    return out


def check_dispatch(w: World, inputs: Sequence[Any], outs: Sequence[Dict[str, Any]], me: int, active: Sequence[bool],
                   use_fp8: bool, round_scale: bool, use_ue8m0: bool, tag: str) -> None:
    o = outs[me]
    exp = routing(w.R, w.e_l, inputs, me, active)
    quant = [fp8.quantize_fp8(inputs[r][0], round_scale) if use_fp8 else None for r in range(w.R)]
    assert o["recv_count"].tolist() == [len(rows) for rows in exp], f"{tag}: counts {o['recv_count'].tolist()}"
    assert torch.equal(o["cum"], o["recv_count"]), f"{tag}: cumulative stats"
    for le, rows in enumerate(exp):
        per_src = [sum(1 for r_, _, _ in rows if r_ == r) for r in range(w.R)]
        begins = [sum(per_src[:r]) for r in range(w.R)]
        want_lr = [(b << 32) | c for b, c in zip(begins, per_src)]
        assert o["layout_range"][le].tolist() == want_lr, f"{tag}: layout_range of expert {le}"
        for i, (r, t, k) in enumerate(rows):
            assert int(o["src_info"][le, i]) == t and int(o["recv_slot"][le, i]) == k, f"{tag}: header of row {i}"
            if use_fp8:
                q, sc = quant[r]
                assert torch.equal(o["recv_x"][le, i], q[t].view(torch.uint8)), f"{tag}: fp8 row {i} of expert {le}"
                if use_ue8m0:
                    assert torch.equal(o["scales"][le, :, i], fp8.pack_ue8m0(sc[t])), f"{tag}: ue8m0 row {i}"
                else:
                    assert torch.equal(o["scales"][le, :, i], sc[t]), f"{tag}: scales row {i} of expert {le}"
            else:
                assert torch.equal(o["recv_x"][le, i].view(torch.bfloat16), inputs[r][0][t]), f"{tag}: bf16 row {i}"


def expert_outputs(w: World, outs: Sequence[Dict[str, Any]], use_fp8: bool, use_ue8m0: bool, seed: int):
    """A made-up expert output per received row (bf16 [E_l, R*T, H]) and the rows' source positions."""
    ys = []
    for r in range(w.R):
        g = torch.Generator().manual_seed(seed * 31 + r)
        ys.append((torch.randn(w.e_l, w.R * w.T, w.H, generator=g) * 2).to(torch.bfloat16))
    return ys


def check_combine(w: World, inputs: Sequence[Any], ys: Sequence[Any], outs: Sequence[Any], me: int,
                  active: Sequence[bool], tag: str, use_logfmt: bool = False,
                  owners: Optional[Sequence[bool]] = None) -> None:
    """out[t] = sum over k ascending of w * y(row of (me, t, k) at its owner), fp32, one bf16 rounding.
    With use_logfmt, y is the row after pyep.ep.ll.logfmt's encode + decode (bit-exact reference).
    `active`: the ranks the dispatch exchanged with; `owners` (default: the same): the expert owners
    whose rows the combine used."""
    owners = active if owners is None else owners
    x, topk, wts = inputs[me]
    if use_logfmt:
        from pyep.ep.ll import logfmt
        ys = [logfmt.roundtrip(y.reshape(-1, w.H)).reshape(y.shape) for y in ys]
    acc = torch.zeros(x.shape[0], w.H, dtype=torch.float32)
    row_of: Dict[Tuple[int, int], Tuple[int, int, int]] = {}
    for owner in range(w.R):
        if not owners[owner]:
            continue
        for le, rows in enumerate(routing(w.R, w.e_l, inputs, owner, active)):
            for i, (r, t, k) in enumerate(rows):
                if r == me:
                    row_of[(t, k)] = (owner, le, i)
    for k in range(topk.shape[1]):
        for t in range(x.shape[0]):
            e = int(topk[t, k])
            if e < 0 or not owners[e // w.e_l]:
                continue
            owner, le, i = row_of[(t, k)]
            acc[t] = acc[t] + wts[t, k] * ys[owner][le, i].float()
    want = acc.to(torch.bfloat16)
    got = outs[me]
    if not torch.equal(got.view(torch.int16), want.view(torch.int16)):
        diff = (got.float() - want.float()).abs()
        raise AssertionError(f"{tag}: combine differs (max {diff.max().item():.3g}, {int((diff > 0).sum())} elements)")


# ------------------------------------------------------------------ what the test modules' cases share
def rank_inputs(R: int, T: int, H: int, E: int, K: int, seed: int, routing: str = "uniform",
                n: Optional[Sequence[int]] = None) -> List[Any]:
    """Every rank's (x, topk_idx, weights), made as tests/ep_native_cases.py makes them for the GPU
    tests; rank r has n[r] tokens (default T)."""
    from ep_native_cases import Shape, make_inputs
    return [make_inputs(seed, r, Shape(T, H, E, K), T if n is None else n[r], routing) for r in range(R)]


def checked_round(w: World, inputs: Sequence[Any], half: int, tag: str,
                  fp8: Tuple[bool, bool, bool] = (False, False, False), active: Optional[Sequence[bool]] = None,
                  ranks: Optional[Sequence[int]] = None, phases: int = 3) -> List[Dict[str, Any]]:
    """One dispatch and one combine on `ranks`, both checked against the oracle; phases=1: each as a send
    launch, then a receive launch (the hook path). Returns the dispatch outputs."""
    use_fp8, rs, ue = fp8
    active = [True] * w.R if active is None else active
    ranks = list(range(w.R)) if ranks is None else ranks
    if phases == 3:
        outs = w.dispatch(inputs, half, use_fp8, rs, ue, ranks=ranks)
    else:   # the hook path: send launch, then receive launch
        outs = w.dispatch(inputs, half, use_fp8, rs, ue, ranks=ranks, phases=1)
        w.dispatch(inputs, half, use_fp8, rs, ue, ranks=ranks, phases=2, outs=outs)
    for r in ranks:
        check_dispatch(w, inputs, outs, r, active, use_fp8, rs, ue, f"{tag} rank {r}")
    ys = expert_outputs(w, outs, use_fp8, ue, seed=half + 3)
    if phases == 3:
        combined = w.combine(ys, inputs, outs, half, ranks=ranks)
    else:
        w.combine(ys, inputs, outs, half, ranks=ranks, phases=1)
        combined = w.combine(ys, inputs, outs, half, ranks=ranks, phases=2)
    for r in ranks:
        check_combine(w, inputs, ys, combined, r, active, f"{tag} rank {r}")
    return outs


def nic_pairs(R: int, nic: str) -> List[Tuple[int, int]]:
    """The rank pairs that talk through the NIC: none ("none"), every pair ("all"), or the pairs across
    the two halves of the ranks ("cross", as between two nodes)."""
    return [] if nic == "none" else [(i, j) for i in range(R) for j in range(i + 1, R)
                                     if nic == "all" or (i < R // 2) != (j < R // 2)]


def has_softnic() -> bool:
    """Whether this build of pyep._engine has the softnic that the "softnic-*" worlds run on."""
    from pyep._native import load as load_engine
    mod = load_engine()
    return mod is not None and hasattr(mod, "SoftNic")
