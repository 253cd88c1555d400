"""One rank of the normal-mode elastic drill (`pyep drill --mode normal`): a store-based NormalBuffer
step loop -- get_dispatch_layout, dispatch, an expert, combine -- that checks every step against a
definition written here from the inputs alone, survives a killed peer, and -- as the restarted process
of a killed rank -- joins the running job. pyep.launch.drill spawns it as `python -m
pyep.ep.elastic.drill_normal JSON`; its results line is drill_rank's (`PYEP_DRILL_RESULT {...}`).

Step s uses inputs derived from (seed, s, rank), so each rank rebuilds every sender's tokens. Given who
was active in the step (the rank's mask after it; in the step that found the victim dead, the sources
its dispatch counted), the received rows must be every active source's tokens routed to this rank, in
source then token order, and the combined rows the sum, over the active ranks ascending, of what each
one's expert returned -- bit for bit. The tokens routed to an inactive rank must be counted dropped,
exactly once in the step (layout, dispatch or combine). The victim kills itself (SIGKILL) in the
middle of the layout exchange, of dispatch, of combine, or between steps.

On the native kernels (`--backend native`, ranks on GPUs over NVLink) the victim dies right after
launching the step's exchanging kernel: the dispatch's count exchange (the "layout" phase: the native
layout exchanges nothing), the dispatch or the combine, so its peers meet the death in the kernels.
With `--transport emulated` each rank is a virtual node of its own (the internode path, its column
relay on the softnic): the victim dies right after launching the relay's count exchange of the
dispatch, the relay of the dispatch's rows, or the relay of the combine's partials.
There a source can die in the middle of its rows: the rows that never came are emptied (zero payload,
top-k -1), and a token's combined row holds the dead rank's part or not, as its row came back or not --
the step that found the death accepts exactly that, and counts the tokens without it as dropped.
"""
from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .drill_rank import STAMP_TAG, _arm_reference_kill, _die, inputs, rank_main

PHASES = ("layout", "dispatch", "combine", "between")


def routed(idx: Any, rank: int, e_l: int) -> Any:
    """bool [n]: tokens with an entry on one of `rank`'s experts."""
    return ((idx >= 0) & (idx.div(e_l, rounding_mode="floor") == rank)).any(dim=1)


def expert(recv: Any, rank: int) -> Any:
    """The drill's expert on `rank`: every row times (1 + rank / 16), rounded to BF16."""
    import torch
    return (recv.float() * (1.0 + rank / 16.0)).to(torch.bfloat16)


def expected_dispatch(a: Dict[str, Any], step: int, rank: int, world: int, sources: Sequence[bool]) -> Any:
    """bf16 [rows, H]: the rows `rank` receives from the active `sources`, source then token order."""
    import torch
    e_l = a["E"] // world
    rows = []
    for s in range(world):
        if sources[s]:
            x, idx, _ = inputs(a["seed"], step, s, a["T"], a["H"], a["E"], a["K"])
            rows.append(x[routed(idx, rank, e_l)])
    return torch.cat(rows) if rows else torch.zeros((0, a["H"]), dtype=torch.bfloat16, device="cpu")


def expected_routing(a: Dict[str, Any], step: int, rank: int, world: int, sources: Sequence[bool]
                     ) -> Tuple[Any, List[int]]:
    """(recv_topk_idx int64 [rows, K]: each received row's ids as local experts of `rank`, -1 for the
    others; tokens per local expert from the active `sources`)."""
    import torch
    e_l = a["E"] // world
    ids, counts = [], [0] * e_l
    for s in range(world):
        if sources[s]:
            _, idx, _ = inputs(a["seed"], step, s, a["T"], a["H"], a["E"], a["K"])
            mine = idx[routed(idx, rank, e_l)]
            local = (mine >= rank * e_l) & (mine < (rank + 1) * e_l)
            ids.append(torch.where(local, mine - rank * e_l, torch.full_like(mine, -1)))
            for le in range(e_l):
                counts[le] += int((mine == rank * e_l + le).any(dim=1).sum())
    out = torch.cat(ids) if ids else torch.zeros((0, a["K"]), dtype=torch.int64, device="cpu")
    return out, counts


def expected_combine(a: Dict[str, Any], step: int, rank: int, world: int, active: Sequence[bool]) -> Any:
    """bf16 [T, H] in the contract's order (contract.combine_order): per node, the fp32 sum over its
    active ranks ascending of their expert's row for each token routed to them, rounded to BF16; then
    the fp32 sum of those partials over the nodes ascending, rounded to BF16 (one node: one rounding)."""
    import torch
    e_l = a["E"] // world
    per_node = int(a.get("ranks_per_node") or world)
    x, idx, _ = inputs(a["seed"], step, rank, a["T"], a["H"], a["E"], a["K"])
    acc = torch.zeros(x.shape[0], a["H"], dtype=torch.float32, device="cpu")
    for n in range(world // per_node):
        part = torch.zeros_like(acc)
        for d in range(n * per_node, (n + 1) * per_node):
            if active[d]:
                sel = routed(idx, d, e_l)
                part[sel] = part[sel] + expert(x[sel], d).float()
        acc = acc + part.to(torch.bfloat16).float()
    return acc.to(torch.bfloat16)


def expected_dropped(a: Dict[str, Any], step: int, rank: int, world: int, active: Sequence[bool]) -> List[int]:
    """Tokens of `rank` routed to each rank that is inactive at the end of the step (0 for active ones)."""
    e_l = a["E"] // world
    _, idx, _ = inputs(a["seed"], step, rank, a["T"], a["H"], a["E"], a["K"])
    return [0 if active[d] else int(routed(idx, d, e_l).sum()) for d in range(world)]


def _sources(handle: Any, rank: int, after: Sequence[bool]) -> List[bool]:
    """The sources a dispatch counted: active after the step, or rows arrived from it (the victim's
    rows can arrive before it dies; the handle's rank_prefix_matrix says how many came from each)."""
    col = [int(v) for v in handle.rank_prefix_matrix[:, rank].tolist()]
    rows = [col[0]] + [col[s] - col[s - 1] for s in range(1, len(col))]
    return [bool(after[s]) or rows[s] > 0 for s in range(len(col))]


def _rows_match(got: Any, want: Any, partial: Any, empty: int) -> bool:
    """Row by row: equal, or -- where `partial` (bool [rows]) -- every element `empty` (the emptied row
    of a source that died before sending it)."""
    same = (got == want).all(dim=1)
    emptied = (got == empty).all(dim=1)
    return bool((same | (partial & emptied)).all())


def check_step(a: Dict[str, Any], step: int, rank: int, world: int, after: Sequence[bool], got: Any,
               handle: Any, out: Any, dropped: Sequence[int], partial: bool = False) -> None:
    """Raises AssertionError naming what differs from the definition. `got`: the dispatch's (recv_x,
    recv_topk_idx, num_recv_tokens_per_expert_list). partial (the native kernels): a source that died in
    this step may have sent part of its rows, and a token's row from it may or may not have come back
    (module doc)."""
    import torch
    recv_x, recv_idx, counts = got
    sources = _sources(handle, rank, after)
    died = [sources[s] and not after[s] for s in range(world)] if partial else [False] * world
    want = expected_dispatch(a, step, rank, world, sources)
    # Which received rows come from a source that died in this step (rows are in source order).
    e_l = a["E"] // world
    per_source = [int(routed(inputs(a["seed"], step, s, a["T"], a["H"], a["E"], a["K"])[1], rank, e_l).sum())
                  if sources[s] else 0 for s in range(world)]
    part = torch.repeat_interleave(torch.tensor(died, dtype=torch.bool, device="cpu"),
                                   torch.tensor(per_source, dtype=torch.int64, device="cpu"))
    if recv_x.shape != want.shape or not _rows_match(recv_x.view(torch.int16), want.view(torch.int16), part, 0):
        raise AssertionError(f"step {step} rank {rank}: received rows differ (got {list(recv_x.shape)}, expected "
                             f"{list(want.shape)}; active after {list(after)})")
    want_idx, want_counts = expected_routing(a, step, rank, world, sources)
    if recv_idx.shape != want_idx.shape or not _rows_match(recv_idx, want_idx, part, -1) or list(counts) != want_counts:
        raise AssertionError(f"step {step} rank {rank}: recv_topk_idx or tokens per local expert differ (counts "
                             f"{list(counts)}, expected {want_counts}; active after {list(after)})")
    want_out = expected_combine(a, step, rank, world, after)
    want_drop = expected_dropped(a, step, rank, world, after)
    gone = [d for d in range(world) if partial and not after[d]]
    if partial and len(gone) == 1:
        # A rank that died during this step: each token routed to it has its part or not; those without
        # it are the dropped ones (the dispatch's rows that never went, the combine's that never came).
        v = gone[0]
        with_v = expected_combine(a, step, rank, world, [after[d] or d == v for d in range(world)])
        o, wo, wv = out.view(torch.int16), want_out.view(torch.int16), with_v.view(torch.int16)
        has_v = (o == wv).all(dim=1)
        if not bool((has_v | (o == wo).all(dim=1)).all()):
            raise AssertionError(f"step {step} rank {rank}: combine is neither with nor without rank {v}'s part "
                                 f"(active {list(after)})")
        _, idx, _ = inputs(a["seed"], step, rank, a["T"], a["H"], a["E"], a["K"])
        to_v = routed(idx, v, a["E"] // world)
        want_drop[v] = int((to_v & ~has_v).sum())
    elif not torch.equal(out.view(torch.int16), want_out.view(torch.int16)):
        raise AssertionError(f"step {step} rank {rank}: combine differs from the definition (active {list(after)})")
    if list(dropped) != want_drop:
        raise AssertionError(f"step {step} rank {rank}: dropped tokens per rank {list(dropped)}, expected {want_drop}")


def explain_step(buf: Any, a: Dict[str, Any], step: int, rank: int, world: int, after: Sequence[bool], got: Any,
                 handle: Any, ms: float) -> str:
    """What a failed step looked like, for the failure report: the rows each source sent (equal to its
    definition, or zero), and on the native kernels this rank's stream counters and gate flags per peer."""
    import torch
    col = [int(v) for v in handle.rank_prefix_matrix[:, rank].tolist()]
    rows = [col[0]] + [col[s] - col[s - 1] for s in range(1, len(col))]
    recv = got[0].view(torch.int16)
    e_l, start = a["E"] // world, 0
    out = [f"step {step} rank {rank}: {ms:.1f} ms, active after {list(after)}"]
    for s in range(world):
        x, idx, _ = inputs(a["seed"], step, s, a["T"], a["H"], a["E"], a["K"])
        want = x[routed(idx, rank, e_l)].view(torch.int16)
        part, m = recv[start:start + rows[s]], min(rows[s], want.shape[0])
        eq = int((part[:m] == want[:m]).all(dim=1).sum())
        zero = int((part == 0).all(dim=1).sum())
        out.append(f"  from {s}: {rows[s]} rows (definition {want.shape[0]}), {eq} equal, {zero} zero")
        start += rows[s]
    words = getattr(buf.backend, "peer_words", None)
    for p in range(world) if words is not None else ():
        out.append(f"  peer {p}: {words(p)}")
    return "\n".join(out)


# The relay's phases (normal_internode.h RelayPhase): which relay launch of a step the victim dies after.
_RELAY_PHASE = {"dispatch": 4, "combine": 5}


def _arm_relay_kill(relay: Any, phase: str) -> None:
    """The internode path (one rank per node): die right after the column's count exchange of the
    dispatch ("layout"), or the relay launch of the dispatch's rows or of the combine's partials."""
    kernels = relay._r

    class _Dying:
        def __getattr__(self, name: str) -> Any:
            return getattr(kernels, name)

    def dying_counts(*args: Any, **kw: Any) -> Any:
        kernels.counts(*args, **kw)
        _die()

    def dying_relay(static: Any, relay_phase: int, *args: Any, **kw: Any) -> Any:
        kernels.relay(static, relay_phase, *args, **kw)
        if relay_phase == _RELAY_PHASE[phase]:
            _die()
    d = _Dying()
    if phase == "layout":
        setattr(d, "counts", dying_counts)
    else:
        setattr(d, "relay", dying_relay)
    relay._r = d


def _arm_native_kill(buf: Any, phase: str) -> None:
    """Native kernels: die right after the phase's exchanging kernel is launched (module doc), through a
    wrapper of the backend's kernel bindings (nothing in the backend itself knows of drills)."""
    be = buf.backend
    if getattr(be, "relay", None) is not None:
        _arm_relay_kill(be.relay, phase)
        return
    kernels, launch = be._n, {"layout": "notify", "dispatch": "dispatch", "combine": "combine"}[phase]

    class _Dying:
        def __getattr__(self, name: str) -> Any:
            return getattr(kernels, name)

    def dying(*args: Any, **kw: Any) -> Any:
        getattr(kernels, launch)(*args, **kw)
        _die()
    d = _Dying()
    setattr(d, launch, dying)
    be._n = d


def _arm_kill(buf: Any, phase: str) -> None:
    if buf.backend_name == "native":
        _arm_native_kill(buf, phase)
    else:
        _arm_reference_kill(buf)            # dies after its first mail of the phase's exchange is out


def _step(buf: Any, a: Dict[str, Any], step: int, rank: int, world: int, mine: bool,
          phase: str) -> Tuple[Any, Any, Any, List[int]]:
    """One step; returns ((recv_x, recv_topk_idx, tokens per local expert), handle, combined, dropped per
    rank summed over the step's calls), on the CPU."""
    dev = buf.device
    x, idx, w = (t.to(dev) for t in inputs(a["seed"], step, rank, a["T"], a["H"], a["E"], a["K"]))
    if mine and phase == "layout":
        _arm_kill(buf, "layout")
    ntpr, ntpn, ntpe, in_rank, ev0 = buf.get_dispatch_layout(idx, a["E"])
    if mine and phase == "dispatch":
        _arm_kill(buf, "dispatch")
    nodes = {} if ntpn is None else {"num_tokens_per_rdma_rank": ntpn}    # one rank per (virtual) node
    recv_x, recv_idx, _, counts, handle, ev1 = buf.dispatch(
        x, num_tokens_per_rank=ntpr, is_token_in_rank=in_rank, num_tokens_per_expert=ntpe, topk_idx=idx,
        topk_weights=w, **nodes)
    y = expert(recv_x, rank)
    if mine and phase == "combine":
        _arm_kill(buf, "combine")
    out, _, ev2 = buf.combine(y, handle)
    recv_x, recv_idx, out = recv_x.cpu(), recv_idx.cpu(), out.cpu()
    # The layout's drops are the dispatch's too (both count tokens routed to ranks inactive then): the
    # step's count is the dispatch's plus the combine's (rows that did not come back).
    drop = (ev1.num_dropped_tokens + ev2.num_dropped_tokens).tolist()
    if any(l_ > d for l_, d in zip(ev0.num_dropped_tokens.tolist(), ev1.num_dropped_tokens.tolist())):
        raise AssertionError(f"step {step} rank {rank}: the layout dropped {ev0.num_dropped_tokens.tolist()}, "
                             f"more than the dispatch {ev1.num_dropped_tokens.tolist()}")
    return (recv_x, recv_idx, counts), handle, out, drop


def run(a: Dict[str, Any], progress: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """One rank's drill; `progress` (drill_rank.rank_main's) says which step it was at when it failed."""
    import datetime

    import torch
    import torch.distributed as dist

    from ..normal import NormalBuffer
    rank, world = int(a["rank"]), int(a["world"])
    backend = a.get("backend", "reference")
    torch.set_num_threads(int(os.environ.get("PYEP_DRILL_THREADS", "1")))
    if backend == "native":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    store = dist.TCPStore(a["host"], int(a["port"]), world, is_master=False,
                          timeout=datetime.timedelta(seconds=120), wait_for_workers=False)
    t0 = time.monotonic()
    nodes: Dict[str, Any] = {}
    if a.get("ranks_per_node"):          # one rank per virtual node: the column relay on the softnic
        nodes = {"ranks_per_node": int(a["ranks_per_node"]), "transport": a.get("transport", "auto")}
    buf = NormalBuffer(store=store, rank=rank, world_size=world, store_prefix=a["prefix"], backend=backend,
                       hidden=a["H"], timeout_us=a["timeout_us"], rejoin_lead_calls=a["lead"], **nodes)
    res: Dict[str, Any] = {"rank": rank, "generation": buf.generation, "setup_s": time.monotonic() - t0}
    stop: Optional[int] = None
    if buf.joining:
        tj = time.monotonic()
        res["joined_at"] = buf.join(a["join_timeout_s"])
        res["join_s"] = time.monotonic() - tj
        stop = res["joined_at"] + a["rounds_after"]
    victim, kill_call, phase = a["victim"], a["kill_call"], a["phase"]
    times: List[float] = []
    stamps: List[List[float]] = []
    deadline = time.monotonic() + a["wall_s"]
    death = None
    progress = {} if progress is None else progress
    while True:
        step = buf.next_call
        progress["normal drill step"] = step
        if stop is not None and step > stop:
            break
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rank}: no rejoin within {a['wall_s']} s (at step {step})")
        mine = rank == victim and buf.generation == 1 and step == kill_call
        if mine and phase == "between":
            _die()
        before = [bool(v) for v in buf.get_active_ranks().tolist()]
        ts = time.monotonic()
        got, handle, out, drop = _step(buf, a, step, rank, world, mine, phase)
        te = time.monotonic()
        stamps.append([step, ts, te])
        times.append(te - ts)
        if rank == victim and buf.generation == 1:
            print(STAMP_TAG + json.dumps([step, ts, te]), flush=True)
        after = [bool(v) for v in buf.get_active_ranks().tolist()]
        admitted = [r for r in range(world) if after[r] and not before[r]]
        lost = [r for r in range(world) if before[r] and not after[r]]
        if admitted and stop is None:
            stop = step + a["rounds_after"]
            res["admitted_at"] = step
            res["admit_time"] = time.time()
        if lost and death is None and buf.generation == 1:
            death = step
            res.update(death_call=step, death_call_ms=(te - ts) * 1e3, detect_time=time.time(), marked=lost)
        elif lost:
            res.setdefault("later_marks", []).append({"call": step, "marked": lost, "ms": round((te - ts) * 1e3, 3)})
        try:
            check_step(a, step, rank, world, after, got, handle, out, drop,
                       partial=backend == "native" and bool(lost) and buf.generation == 1)
        except AssertionError:
            print(explain_step(buf, a, step, rank, world, after, got, handle, (te - ts) * 1e3), file=sys.stderr,
                  flush=True)
            raise
        if stop is None and victim < 0 and step >= a["rounds_after"]:
            stop = step
    first = res.get("admitted_at") or res.get("joined_at")
    res.update(stamps=stamps, calls=len(times), times_ms=[round(t * 1e3, 3) for t in times],
               calls_after_join=(stop - first + 1) if first is not None and stop is not None else 0,
               final_active=[int(v) for v in buf.get_active_ranks().tolist()],
               rejected=[str(e) for e in buf.rejected_records][-8:])
    buf.destroy()
    return res


def main(argv: List[str]) -> int:
    return rank_main(argv, run)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
