"""One rank of the elastic drill: a store-based EpBuffer serving loop that checks every call against the
reference definition, survives a killed peer, and -- as the restarted process of a killed rank -- joins
the running job. pyep.launch.drill (`pyep drill`) spawns it as `python -m pyep.ep.elastic.drill_rank
JSON`; pyep.launch.elastic_demo calls `run` in the ranks `pyep launch` starts.

Every call c uses inputs derived from (seed, c, rank), so each rank rebuilds every sender's tokens and
checks its dispatch output (counts, src_info, rows) and its combine output bit for bit against what
the reference backend defines, given who was active in that call (the rank's own active_ranks after
the phase). The victim kills itself (SIGKILL) in the middle of dispatch, of combine, or between calls.
Results are one JSON line on stdout: `PYEP_DRILL_RESULT {...}`.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

RESULT_TAG = "PYEP_DRILL_RESULT "
STAMP_TAG = "PYEP_DRILL_STAMP "


def inputs(seed: int, call: int, rank: int, n: int, h: int, e: int, k: int) -> Tuple[Any, Any, Any]:
    """(x bf16 [n, h], topk_idx int64 [n, k] with distinct experts and some -1, weights fp32 [n, k]) of
    rank `rank` at call (LL) or step (normal mode) `call`: both drills' definitions rebuild them."""
    import torch
    # On the CPU generator's device, whatever default device or dtype the caller set: every rank must
    # rebuild the same inputs.
    g = torch.Generator().manual_seed(seed * 1_000_003 + call * 7919 + rank)
    cpu, f32 = torch.device("cpu"), torch.float32
    x = (torch.randn(n, h, generator=g, dtype=f32, device=cpu) * 2).to(torch.bfloat16)
    idx = torch.rand(n, e, generator=g, dtype=f32, device=cpu).argsort(dim=1)[:, :k].to(torch.int64).contiguous()
    idx[torch.rand(n, k, generator=g, dtype=f32, device=cpu) < 0.15] = -1
    w = torch.rand(n, k, generator=g, dtype=f32, device=cpu)
    return x, idx, w


def _expert(recv: Any, e_offset: int) -> Any:
    import torch
    factor = 1.0 + (torch.arange(recv.shape[0], dtype=torch.float32, device=recv.device) + e_offset) / 16.0
    return (recv.float() * factor.view(-1, 1, 1)).to(torch.bfloat16)


def _check_dispatch(a: Dict[str, Any], call: int, rank: int, world: int, active: Sequence[bool], recv: Any,
                    cnt: Any, handle: Any) -> None:
    import torch
    e_l = a["E"] // world
    ins = [inputs(a["seed"], call, r, a["T"], a["H"], a["E"], a["K"]) for r in range(world)]
    cnt, src, recv = cnt.cpu(), handle.src_info.cpu(), recv.cpu()
    for le in range(e_l):
        ge = rank * e_l + le
        toks, rows = [], []
        for r in range(world):
            if not active[r]:
                continue
            x, idx, _ = ins[r]
            t = (idx == ge).any(dim=1).nonzero().reshape(-1)
            toks.append(t)
            rows.append(x[t])
        t = torch.cat(toks) if toks else torch.empty(0, dtype=torch.int64, device="cpu")
        n = int(t.numel())
        if int(cnt[le]) != n:
            raise AssertionError(f"call {call} rank {rank}: recv_count[{le}] = {int(cnt[le])}, expected {n} "
                                 f"(active {list(active)})")
        if not torch.equal(src[le, :n].to(torch.int64), t):
            raise AssertionError(f"call {call} rank {rank}: src_info of local expert {le} differs")
        if n and not torch.equal(recv[le, :n].view(torch.int16), torch.cat(rows).view(torch.int16)):
            raise AssertionError(f"call {call} rank {rank}: received rows of local expert {le} differ")


def _expected_combine(a: Dict[str, Any], call: int, rank: int, world: int, active: Sequence[bool]) -> Any:
    import torch
    e_l = a["E"] // world
    x, idx, w = inputs(a["seed"], call, rank, a["T"], a["H"], a["E"], a["K"])
    acc = torch.zeros(x.shape[0], a["H"], dtype=torch.float32, device="cpu")
    owner_on = torch.tensor([bool(active[int(v) // e_l]) if v >= 0 else False for v in idx.reshape(-1).tolist()],
                            dtype=torch.bool, device="cpu").view(idx.shape)
    for k in range(idx.shape[1]):     # k ascending, multiply then add in fp32: the reference's order
        e = idx[:, k]
        y = (x.float() * (1.0 + e.clamp_min(0).float() / 16.0).view(-1, 1)).to(torch.bfloat16).float()
        acc = torch.where(owner_on[:, k].view(-1, 1), acc + w[:, k:k + 1] * y, acc)
    return acc.to(torch.bfloat16)


class _Watchdog:
    """With PYEP_DRILL_STALL_MS set: when a call runs longer than that, dump every thread's Python stack
    (faulthandler) into PYEP_DRILL_DUMP_DIR, once per call -- which line a stalled call is blocked in."""

    def __init__(self, a: Dict[str, Any], rank: int) -> None:
        import threading
        self.limit = float(os.environ.get("PYEP_DRILL_STALL_MS", "0")) / 1e3
        self.dir = os.environ.get("PYEP_DRILL_DUMP_DIR", "")
        self.tag = f"{a.get('prefix', '').replace('/', '_')}_r{rank}_{os.getpid()}"
        self.dumps: List[str] = []
        self._call: Any = None
        self._t0 = 0.0
        self._done = True
        self._stop = threading.Event()
        if self.limit > 0 and self.dir:
            threading.Thread(target=self._run, daemon=True).start()

    def arm(self, call: int, t0: float) -> None:
        self._call, self._t0, self._done = call, t0, False

    def disarm(self) -> None:
        self._done = True

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        import faulthandler
        while not self._stop.wait(0.005):
            if self._done or time.monotonic() - self._t0 < self.limit or len(self.dumps) >= 8:
                continue
            self._done = True
            path = os.path.join(self.dir, f"stall_{self.tag}_{self._call}.txt")
            with open(path, "w", encoding="utf-8") as fh:
                fh.write(f"call {self._call}: {1e3 * (time.monotonic() - self._t0):.1f} ms\n")
                fh.flush()
                faulthandler.dump_traceback(fh, all_threads=True)
            self.dumps.append(path)


def _warm_up(a: Dict[str, Any], rank: int, world: int, dev: Any) -> None:
    """Run the loop's own GPU work once before the first EP call, as a serving loop warms up. A CUDA
    kernel's first launch loads its module (lazily by default, and with CUDA_MODULE_LOADING=EAGER a
    library's first use loads all of it): seconds of host time, and a load can wait for kernels already
    running -- a peer's dispatch spinning on our data. Done inside call 1, it made a live rank seconds
    late for the job's first call over the softnic (marked in call 1 even with the start's 2 s wait)."""
    import torch
    e_l = a["E"] // world
    x, idx, w = (t.to(dev) for t in inputs(a["seed"], 0, rank, a["T"], a["H"], a["E"], a["K"]))
    recv = torch.zeros((e_l, world * a["T"], a["H"]), dtype=torch.bfloat16, device=dev)
    y = _expert(recv, rank * e_l)
    for t in (x, idx, w, y):
        t.cpu()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    ev[0].record()
    ev[1].record()
    torch.cuda.synchronize()
    ev[0].elapsed_time(ev[1])


def _trace_summary(buf: Any) -> Dict[str, List[Any]]:
    """The latest dispatch's and combine's per-block timeline (PYEP_LL_TRACE=1): per point, blocks that
    reached it and the first / median / last block in µs after the call's first stamp."""
    from ..ll.trace import KERNELS, summarize
    stamps = buf.backend.read_trace()
    return {k: [(p.point, p.blocks, round(p.first_us, 1), round(p.median_us, 1), round(p.last_us, 1))
                for p in summarize(stamps[i])] for i, k in enumerate(KERNELS)}


def _call_timeout_us(a: Dict[str, Any], call: int, first: Optional[int]) -> int:
    """The timeout of `call`. With pause_timeout_us, a call that one of the drill's pauses delays gets
    that (short) timeout -- the pause must be well over it, and the window under test well over the
    pause -- and every other call the drill's timeout, so that on a loaded machine only the paused call
    is exposed to a short timeout (first: call #A, the restarted rank's first call, once known)."""
    short = a.get("pause_timeout_us") or 0
    if not short:
        return int(a["timeout_us"])
    paused = {1} if a.get("first_call_pause_ms") else set()
    if first is not None and a.get("pause_after_admit_ms"):
        paused.add(first)
    if first is not None and a.get("newcomer_pause_ms"):
        paused.add(first + 1)
    return int(short) if call in paused else int(a["timeout_us"])


def _die() -> None:
    sys.stdout.flush()
    from .mps import terminate_own_gpu_work
    terminate_own_gpu_work()        # a shared GPU under MPS: see mps.py
    os.kill(os.getpid(), signal.SIGKILL)


def _arm_reference_kill(buf: Any) -> None:
    """Reference backend: die after the first message of the next exchange is in the store, i.e. in the
    middle of the exchange (some peers have our data, the others never get it)."""
    mail = getattr(buf.backend, "_mail", None)
    if mail is None:
        raise RuntimeError("the reference drill needs a store-based buffer")
    store = mail.store

    class _Dying:
        def __getattr__(self, name: str) -> Any:
            return getattr(store, name)

        def set(self, key: str, value: Any) -> None:
            store.set(key, value)
            _die()
    mail.store = _Dying()


def run(a: Dict[str, Any], progress: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """One rank of a drill. `progress` (the caller's) holds the call in progress and the death call, so
    a rank that fails can say where."""
    import datetime

    import torch
    import torch.distributed as dist

    from ..ll import EpBuffer
    rank, world = int(a["rank"]), int(a["world"])
    native = a["backend"] == "native"
    # The checks' CPU operators are tiny: with torch's default (a thread per core) in every rank, the
    # ranks' thread pools fight over the cores and one rank's checks took 70-120 ms instead of 3 ms on
    # the GPU machine -- skew between the ranks' calls larger than the 50 ms timeout, so live ranks were
    # marked. One thread each keeps the loop as close to a serving loop's host time as the checks allow.
    torch.set_num_threads(int(os.environ.get("PYEP_DRILL_THREADS", "1")))
    if native:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    store = dist.TCPStore(a["host"], int(a["port"]), world, is_master=False,
                          timeout=datetime.timedelta(seconds=120), wait_for_workers=False)
    t0 = time.monotonic()
    buf = EpBuffer(store=store, rank=rank, world_size=world, store_prefix=a["prefix"], backend=a["backend"],
                   transport=a["transport"], num_max_dispatch_tokens_per_rank=a["T"], hidden=a["H"],
                   num_experts=a["E"], max_topk=a["K"], timeout_us=a["timeout_us"], check_values=False,
                   rejoin_lead_calls=a["lead"])
    dev = buf.device
    res: Dict[str, Any] = {"rank": rank, "generation": buf.generation, "setup_s": time.monotonic() - t0}
    active = torch.ones(world, dtype=torch.int32, device=dev)
    if native:
        _warm_up(a, rank, world, dev)
    if buf.joining:
        active.fill_(1)
        tj = time.monotonic()
        res["joined_at"] = buf.join(a["join_timeout_s"])
        res["join_s"] = time.monotonic() - tj
        stop = res["joined_at"] + a["rounds_after"]
    else:
        stop = None
    victim, kill_call, phase = a["victim"], a["kill_call"], a["phase"]
    times: List[float] = []
    loops: List[float] = []
    split: List[Tuple[float, float]] = []
    last_ts = None
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)] if native else []
    death_call = admit_call = None
    deadline = time.monotonic() + a["wall_s"]
    e_off = rank * (a["E"] // world)

    def sync() -> None:
        if native:
            torch.cuda.synchronize()

    segs: List[List[float]] = []
    stamps: List[List[float]] = []   # [call, start, end] (CLOCK_MONOTONIC: one clock for every process)
    watch = _Watchdog(a, rank)
    tracing = native and os.environ.get("PYEP_LL_TRACE", "") not in ("", "0")
    while True:
        t_top = time.monotonic()
        call = buf.next_call
        if progress is not None:
            progress.update(call=call, generation=buf.generation, death_call=death_call, admit_call=admit_call)
        if stop is not None and call > stop:
            break
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rank}: no rejoin within {a['wall_s']} s (at call {call})")
        pending = list(buf._member._pending.values()) if (native and buf._member is not None) else []
        # Counters only where every survivor waits anyway (the handshake at call #A): a pause before a
        # call elsewhere would let peers time out on us.
        full = any(p.at == call for p in pending)
        snap = _links(buf, victim, full) if pending else None
        admitted = buf.admit_pending(active)
        if snap is not None:
            # No settling now: the handshake has released the newcomer, so a pause here would delay
            # call #A for everyone; and nothing was posted since the settled snapshot above.
            after_links = _links(buf, victim, full, settle=False)
            res.setdefault("link_checks", 0)
            res["link_checks"] += 1
            if after_links != snap:
                res["others_changed"] = {"before": snap, "after": after_links}
        if True:
            if admitted and stop is None:
                admit_call = call
                stop = call + a["rounds_after"]
                res["admitted_at"] = call
                res["admit_time"] = time.time()
                if a.get("pause_after_admit_ms"):
                    # Host work between the admission and call #A (a model's layers before the first
                    # MoE layer): call #A's rejoin timeout must cover it (docs/elastic.md).
                    time.sleep(a["pause_after_admit_ms"] / 1e3)
        if buf.generation > 1 and call == res.get("joined_at", -1) + 1 and a.get("newcomer_pause_ms"):
            # The restarted process's cold host code after its first call (first copies to the host,
            # first CPU operators): the grace window after call #A must cover it (docs/elastic.md).
            time.sleep(a["newcomer_pause_ms"] / 1e3)
        if call == 1 and rank == 0 and buf.generation == 1 and a.get("first_call_pause_ms"):
            # A rank that starts the job's first call late (set-up released a store poll apart, cold
            # first launches): the start's grace window must cover it (docs/elastic.md).
            time.sleep(a["first_call_pause_ms"] / 1e3)
        mine = rank == victim and buf.generation == 1 and call == kill_call
        if mine and phase == "between":
            _die()
        t_us = _call_timeout_us(a, call, admit_call or res.get("joined_at"))
        t_admit = time.monotonic()
        x, idx, w = (t.to(dev) for t in inputs(a["seed"], call, rank, a["T"], a["H"], a["E"], a["K"]))
        before = active.tolist()
        t_inputs = time.monotonic()
        sync()
        ts = time.monotonic()
        watch.arm(call, ts)
        if last_ts is not None:
            loops.append(ts - last_ts)     # the whole iteration: checks, store poll, the call
        last_ts = ts
        if native:
            ev[0].record()
        if mine and phase == "dispatch" and not native:
            _arm_reference_kill(buf)
        t_launch = [time.monotonic()]
        recv, cnt, handle, _, _ = buf.dispatch(x, idx, use_fp8=False, active_ranks=active, timeout_us=t_us)
        if mine and phase == "dispatch":
            _die()                                   # native: the kernel is in flight
        if native:
            ev[1].record()
        if mine and phase == "combine" and not native:
            _arm_reference_kill(buf)
        t_launch.append(time.monotonic())
        y = _expert(recv, e_off)
        if native:
            ev[2].record()
        t_launch.append(time.monotonic())
        out, _, _ = buf.combine(y, idx, w, handle, active_ranks=active, timeout_us=t_us)
        t_launch.append(time.monotonic())
        if mine and phase == "combine":
            _die()
        if native:
            ev[3].record()
        sync()
        t_launch.append(time.monotonic())
        watch.disarm()
        te = time.monotonic()
        stamps.append([call, ts, te])
        if rank == victim and buf.generation == 1:
            # The victim's result never comes (it is killed): its stamps go out as it runs, for the
            # drill's per-call time counted from the last rank's arrival.
            print(STAMP_TAG + json.dumps([call, ts, te]), flush=True)
        dt = te - ts
        times.append(dt)
        if native:
            # Device time of the dispatch and of the combine (CUDA events): which one a slow call waits in.
            split.append((ev[0].elapsed_time(ev[1]), ev[2].elapsed_time(ev[3])))
        after = active.tolist()
        if before != after and death_call is None and buf.generation == 1:
            death_call = call
            res["death_call"] = call
            res["death_call_ms"] = dt * 1e3
            if split:
                res["death_split_ms"] = [round(v, 3) for v in split[-1]]
            res["detect_time"] = time.time()
            res["marked"] = [r for r in range(world) if before[r] and not after[r]]
            # Host ms of the call: dispatch binding call, _expert, combine binding call, the final
            # synchronize (a blocked launch, e.g. on a softnic control lock, shows in the first three).
            res["death_host_ms"] = [round((b - a_) * 1e3, 3) for a_, b in zip(t_launch, t_launch[1:])]
        elif before != after:
            # Any later mark (after a rejoin: who marked whom, in which call, and how long it took).
            res.setdefault("later_marks", []).append(
                {"call": call, "marked": [r for r in range(world) if before[r] and not after[r]],
                 "ms": round(dt * 1e3, 3), "split_ms": [round(v, 3) for v in split[-1]] if split else [],
                 "loop_ms": round(loops[-1] * 1e3, 3) if loops else 0.0})        # Who counted as active in this call: the mask after it (a source marked during the call sent
        # nothing that was used, an owner marked during combine contributes nothing).
        on = [bool(v) for v in after]
        cpu0 = time.process_time()
        _check_dispatch(a, call, rank, world, on if on == before else _dispatch_view(buf, handle, world, on),
                        recv, cnt, handle)
        want = _expected_combine(a, call, rank, world, on)
        if not torch.equal(out.cpu().view(torch.int16), want.view(torch.int16)):
            raise AssertionError(f"call {call} rank {rank}: combine differs from the reference (active {on})")
        if tracing and (call == kill_call - 1 or call == death_call or call == admit_call
                        or call == res.get("joined_at") or (stop is not None and call == stop)):
            res.setdefault("traces", {})[str(call)] = _trace_summary(buf)
        t_end = time.monotonic()
        # Host ms of the whole iteration: admit_pending, inputs, wait for the device, dispatch call,
        # _expert, combine call, final sync, checks (where an iteration's time goes, and so how far
        # apart the ranks start their next call).
        # The last entry is the checks' CPU time (all threads of the process): CPU-bound or waiting.
        segs.append([round((b - a_) * 1e3, 3) for a_, b in zip([t_top, t_admit, t_inputs, *t_launch],
                                                                [t_admit, t_inputs, *t_launch, t_end])]
                    + [round((time.process_time() - cpu0) * 1e3, 3)])
        if len(segs) >= 2 and res.get("later_marks") and res["later_marks"][-1]["call"] == call:
            res["later_marks"][-1]["segs_prev_this"] = segs[-2:]
        if stop is None and victim < 0 and call >= a["rounds_after"]:
            stop = call
    res["stamps"] = stamps
    res["calls"] = len(times)
    first = admit_call or res.get("joined_at")
    res["calls_after_join"] = (stop - first + 1) if first is not None and stop is not None else 0
    res["times_ms"] = [round(t * 1e3, 3) for t in times]
    res["loop_ms"] = [round(t * 1e3, 3) for t in loops]
    res["split_ms"] = [[round(d, 3), round(c, 3)] for d, c in split]
    res["host_segs_ms"] = segs
    res["threads"] = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 0
    watch.stop()
    if watch.dumps:
        res["stall_dumps"] = watch.dumps
    events = getattr(getattr(buf.backend, "_peers", None), "provider", lambda: None)()
    if events is not None and hasattr(events, "events"):
        res["softnic_events"] = list(events.events())[-20:]   # errors / overruns the softnic noticed
    res["final_active"] = [int(v) for v in active.tolist()]
    buf.destroy()
    return res


COUNTERS = ("wqes", "bytes", "atomics", "doorbells", "consumer_index")


def _links(buf: Any, victim: int, counters: bool, settle: bool = True) -> Any:
    """The links to every peer but the victim: addresses, keys, QP numbers and state, and with
    `counters` the softnic's per-QP counters (settled first when `settle`: the softnic executes posted
    WQEs asynchronously). A rejoin must leave them as they are."""
    import torch
    if counters and settle:
        torch.cuda.synchronize()
        time.sleep(0.05)
    state = buf.backend.link_state()
    if not counters:
        for v in state.values():
            for q in v.get("qps", []):
                for c in COUNTERS:
                    q.pop(c, None)
    return {r: v for r, v in state.items() if r != victim}


def _dispatch_view(buf: Any, handle: Any, world: int, after: List[bool]) -> List[bool]:
    """The mask a dispatch that marked a rank used: the layout says which sources it counted."""
    counted = handle.layout_range.cpu() & 0xFFFFFFFF
    sent = (counted.sum(0) > 0).tolist()
    return [after[r] or bool(sent[r]) for r in range(world)]


def rank_main(argv: List[str], body: Callable[[Dict[str, Any], Dict[str, Any]], Dict[str, Any]]) -> int:
    """A drill rank process (this module's, drill_normal's): the JSON arguments, logging, body(args,
    progress), and the results line pyep.launch.drill reads; on failure, where it was."""
    a = json.loads(argv[0])
    import logging
    logging.basicConfig(level=logging.WARNING, format=f"rank {a['rank']} %(levelname)s %(name)s: %(message)s")
    progress: Dict[str, Any] = {}
    try:
        res = body(a, progress)
    except BaseException:
        print(f"rank {a['rank']} failed in {progress or 'set-up'}", flush=True)
        raise
    print(RESULT_TAG + json.dumps(res), flush=True)
    return 0


def main(argv: List[str]) -> int:
    return rank_main(argv, run)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
