"""`pyep drill`: the elastic-membership drill. Hosts a TCPStore, starts `--world` ranks of a store-based
EpBuffer serving loop (pyep.cli._drill_rank), SIGKILLs one of them in the middle of dispatch, of
combine or between calls, restarts that one process, and checks:

- the survivors finish the call that finds the rank dead within timeout + slack, with outputs equal to
  the reference definition for the ranks that were active;
- the restarted process joins (generation 2) and every rank then runs `--rounds-after` calls, each
  bit-equal to the reference;
- survivors' per-call time after the rejoin stays near the healthy one (--max-slowdown), both counted
  from the last rank's start of each call (so the ranks' host-loop skew is not counted as call time).

One line per drill and a summary (drills passed, hangs, detection / rejoin / per-call times); exit
status 0 only if every drill passed. --json FILE writes every drill's numbers.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional

PHASES = ("dispatch", "combine", "between")


@dataclass
class DrillOutcome:
    index: int
    phase: str
    ok: bool
    hang: bool = False
    why: str = ""
    detect_ms: float = 0.0          # the survivors' call that found the victim dead (max over survivors)
    rejoin_s: float = 0.0           # restart spawned -> admitted
    # Per-call time: a survivor's call counted from the moment the last rank started it (every rank's
    # start and end on the host's one monotonic clock), median over survivors and calls. A survivor's
    # own call time also holds how much later than it the other ranks arrived -- the skew of the
    # ranks' host loops (here: the reference checks between calls), not the cost of the call.
    healthy_ms: float = 0.0         # before the kill (the victim's stamps included)
    after_ms: float = 0.0           # after the rejoin (the restarted rank's stamps included)
    healthy_own_ms: float = 0.0     # survivors' median own call time before the kill
    after_own_ms: float = 0.0       # ... after the rejoin
    newcomer_ms: float = 0.0        # the restarted rank's median call after its first
    loop_before_ms: float = 0.0     # survivors' median iteration (checks, store poll, call) before the kill
    loop_after_ms: float = 0.0      # ... after the rejoin
    newcomer_loop_ms: float = 0.0   # the restarted rank's median iteration
    split_before_ms: List[float] = field(default_factory=list)   # survivors' median device ms: dispatch, combine
    split_after_ms: List[float] = field(default_factory=list)
    death_split_ms: List[List[float]] = field(default_factory=list)  # each survivor's death call: dispatch, combine
    death_host_ms: List[List[float]] = field(default_factory=list)   # ... host: dispatch, expert, combine, sync
    # Survivors' median host ms per iteration segment (admit, inputs, device wait, dispatch call, expert,
    # combine call, sync, checks) before the kill and after the rejoin, and the restarted rank's.
    host_segs_before_ms: List[float] = field(default_factory=list)
    host_segs_after_ms: List[float] = field(default_factory=list)
    newcomer_host_segs_ms: List[float] = field(default_factory=list)
    stall_dumps: List[str] = field(default_factory=list)
    later_marks: Dict[str, Any] = field(default_factory=dict)         # rank (' = restarted) -> later marks
    joined_at: int = 0
    rounds_checked: int = 0
    ranks: List[Dict[str, Any]] = field(default_factory=list)


def _rank_args(ns: argparse.Namespace, rank: int, port: int, prefix: str, phase: str) -> Dict[str, Any]:
    return {"rank": rank, "world": ns.world, "host": "127.0.0.1", "port": port, "prefix": prefix,
            "backend": ns.backend, "transport": ns.transport, "T": ns.tokens, "H": ns.hidden, "E": ns.experts,
            "K": ns.topk, "timeout_us": ns.timeout_us, "lead": ns.lead_calls, "seed": ns.seed,
            "victim": ns.victim if ns.victim >= 0 else ns.world - 1, "kill_call": ns.kill_call, "phase": phase,
            "rounds_after": ns.rounds_after, "join_timeout_s": ns.join_timeout_s, "wall_s": ns.drill_timeout_s,
            "pause_after_admit_ms": getattr(ns, "pause_after_admit_ms", 0.0),
            "newcomer_pause_ms": getattr(ns, "newcomer_pause_ms", 0.0),
            "first_call_pause_ms": getattr(ns, "first_call_pause_ms", 0.0)}


def _spawn(args: Dict[str, Any]) -> subprocess.Popen:
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join([root, *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]])
    return subprocess.Popen([sys.executable, "-u", "-m", "pyep.cli._drill_rank", json.dumps(args)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def failure_lines(lines: List[str], limit: int = 24) -> List[str]:
    """What says why a rank failed: its last traceback (the error is its last line, the frames above
    name where), else its last lines. CUDA's warnings printed at exit after a sticky error follow the
    traceback and would otherwise push it out."""
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")]
    if not starts:
        return lines[-8:]
    where = [line for line in lines[:starts[-1]] if " failed in " in line][-1:]   # _drill_rank.main
    tb = [line for line in lines[starts[-1]:] if "CUDA warning" not in line]
    return where + (tb if len(tb) <= limit else tb[:4] + ["..."] + tb[-(limit - 5):])


class _Reader:
    def __init__(self, proc: subprocess.Popen, tag: str, echo: bool) -> None:
        self.lines: List[str] = []
        self.stamps: List[List[float]] = []
        self.result: Optional[Dict[str, Any]] = None
        self._t = threading.Thread(target=self._run, args=(proc, tag, echo), daemon=True)
        self._t.start()

    def _run(self, proc: subprocess.Popen, tag: str, echo: bool) -> None:
        from ._drill_rank import RESULT_TAG, STAMP_TAG
        assert proc.stdout is not None
        for raw in iter(proc.stdout.readline, b""):
            line = raw.decode(errors="replace").rstrip()
            if line.startswith(RESULT_TAG):
                self.result = json.loads(line[len(RESULT_TAG):])
                continue
            if line.startswith(STAMP_TAG):
                self.stamps.append(json.loads(line[len(STAMP_TAG):]))
                continue
            self.lines.append(line)
            if echo:
                print(f"  [{tag}] {line}", flush=True)

    def join(self) -> None:
        self._t.join(5.0)


def run_drill(ns: argparse.Namespace, index: int, phase: str, echo: bool = False) -> DrillOutcome:
    import torch.distributed as dist
    out = DrillOutcome(index, phase, ok=False)
    store = dist.TCPStore("127.0.0.1", 0, ns.world, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=60))
    prefix = f"pyep/drill/{os.getpid()}/{index}"
    victim = ns.victim if ns.victim >= 0 else ns.world - 1
    procs: Dict[str, subprocess.Popen] = {}
    readers: Dict[str, _Reader] = {}
    for r in range(ns.world):
        tag = f"rank {r}"
        procs[tag] = _spawn(_rank_args(ns, r, store.port, prefix, phase))
        readers[tag] = _Reader(procs[tag], tag, echo)
    deadline = time.monotonic() + ns.drill_timeout_s
    restart_time = 0.0
    try:
        while time.monotonic() < deadline:
            alive = [t for t, p in procs.items() if p.poll() is None]
            dead_victim = procs[f"rank {victim}"].poll()
            if dead_victim is not None and "restart" not in procs:
                if dead_victim != -9:
                    raise RuntimeError(f"rank {victim} exited with {dead_victim} before it was killed: "
                                       + " | ".join(readers[f"rank {victim}"].lines[-5:]))
                print(f"pyep drill #{index}: rank {victim} killed ({phase}); restarting it", flush=True)
                restart_time = time.time()
                procs["restart"] = _spawn(_rank_args(ns, victim, store.port, prefix, phase))
                readers["restart"] = _Reader(procs["restart"], f"rank {victim}'", echo)
                continue
            failed = [t for t, p in procs.items() if t != f"rank {victim}" and p.poll() not in (None, 0)]
            if failed:
                t = failed[0]
                raise RuntimeError(f"{t} exited with {procs[t].poll()}: " + " | ".join(failure_lines(readers[t].lines)))
            if not alive:
                break
            time.sleep(0.05)
        else:
            out.hang = True
            raise RuntimeError(f"drill did not finish within {ns.drill_timeout_s} s")
        for r in readers.values():
            r.join()
        res = {t: r.result for t, r in readers.items() if t != f"rank {victim}"}
        missing = [t for t, v in res.items() if v is None]
        if missing:
            raise RuntimeError(f"no result from {missing}")
        out.ranks = [v for v in res.values() if v is not None]
        survivors = [v for t, v in res.items() if t not in ("restart",) and v is not None]
        newcomer = res["restart"]
        assert newcomer is not None
        if newcomer["generation"] != 2:
            raise RuntimeError(f"the restarted rank has generation {newcomer['generation']}, expected 2")
        out.joined_at = int(newcomer["joined_at"])
        out.rounds_checked = int(newcomer["calls_after_join"])
        out.detect_ms = max(float(s.get("death_call_ms", 0.0)) for s in survivors)
        out.rejoin_s = max(float(s["admit_time"]) for s in survivors) - restart_time
        kill = ns.kill_call
        healthy = [t for s in survivors for t in s["times_ms"][1:kill - 1]]
        after = [t for s in survivors for t in s["times_ms"][-max(1, out.rounds_checked - 1):]]
        out.healthy_own_ms = statistics.median(healthy) if healthy else 0.0
        out.after_own_ms = statistics.median(after) if after else 0.0
        n_after = max(1, out.rounds_checked - 1)
        last_calls = sorted({int(c) for c, _, _ in newcomer.get("stamps", [])})[-n_after:]
        out.healthy_ms = _from_last_arrival(survivors, readers[f"rank {victim}"].stamps, range(2, kill - 1))
        out.after_ms = _from_last_arrival(survivors, newcomer.get("stamps", []), last_calls)
        _diagnostics(out, survivors, newcomer, kill)
        limit = ns.timeout_us / 1e3 + ns.slack_ms
        if any("death_call_ms" not in s for s in survivors):
            raise RuntimeError("a survivor never marked the killed rank")
        early = {s["rank"]: (s["death_call"], s["marked"]) for s in survivors if s["death_call"] < kill}
        if early:
            raise RuntimeError(f"ranks were marked before rank {victim} was killed at call {kill} "
                               f"(survivor: call, marked): {early}")
        wrong = {s["rank"]: s["marked"] for s in survivors if s["marked"] != [victim]}
        if wrong:
            raise RuntimeError(f"survivors marked ranks other than the killed one: {wrong}")
        changed = {s["rank"]: s["others_changed"] for s in survivors if "others_changed" in s}
        if changed:
            raise RuntimeError(f"a rejoin changed the links to other peers: {changed}")
        partial = {s["rank"]: s["final_active"] for s in out.ranks if 0 in s["final_active"]}
        if partial:
            raise RuntimeError(f"ranks still marked inactive at the end: {partial}; marks after the death call "
                               f"(rank: call, marked, call ms, device split, iteration ms): {out.later_marks}")
        if out.detect_ms > limit:
            raise RuntimeError(f"the call that found rank {victim} dead took {out.detect_ms:.1f} ms > "
                               f"timeout + {ns.slack_ms:g} ms = {limit:.1f} ms (device dispatch/combine "
                               f"{out.death_split_ms}; host dispatch call / expert / combine call / sync "
                               f"{out.death_host_ms})")
        if not out.healthy_ms or not out.after_ms:
            raise RuntimeError(f"no per-call time from the last arrival (before {out.healthy_ms}, after "
                               f"{out.after_ms}): some rank's call stamps are missing")
        if out.after_ms > ns.max_slowdown * out.healthy_ms + 0.5:
            raise RuntimeError(f"per-call time after the rejoin {out.after_ms:.3f} ms vs {out.healthy_ms:.3f} ms "
                               f"before, from the last arrival (> x{ns.max_slowdown:g}; own call "
                               f"{out.after_own_ms:.3f} vs {out.healthy_own_ms:.3f} ms); device ms (dispatch, combine) "
                               f"{out.split_before_ms} before, {out.split_after_ms} after; iteration "
                               f"{out.loop_before_ms:.3f} ms before, {out.loop_after_ms:.3f} after, newcomer "
                               f"{out.newcomer_loop_ms:.3f} (its call {out.newcomer_ms:.3f} ms)")
        out.ok = True
    except Exception as exc:  # noqa: BLE001 - reported per drill
        out.why = str(exc)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(10)
    return out


def _from_last_arrival(survivors: List[Dict[str, Any]], other: List[List[float]], calls: Any) -> float:
    """Median over survivors and `calls` of (the survivor's end of call c - the latest start of c over
    every rank: survivors and `other`, the victim's or the restarted rank's stamps). Calls some rank
    has no stamp for are left out."""
    per_rank = [{int(c): (ts, te) for c, ts, te in s.get("stamps", [])} for s in survivors]
    theirs = {int(c): (ts, te) for c, ts, te in other}
    vals = []
    for c in calls:
        if c not in theirs or any(c not in m for m in per_rank):
            continue
        arrive = max([theirs[c][0], *[m[c][0] for m in per_rank]])
        vals.extend(max(0.0, m[c][1] - arrive) * 1e3 for m in per_rank)
    return statistics.median(vals) if vals else 0.0


def _median(xs: List[float]) -> float:
    return round(statistics.median(xs), 3) if xs else 0.0


def _diagnostics(out: DrillOutcome, survivors: List[Dict[str, Any]], newcomer: Dict[str, Any], kill: int) -> None:
    """Where the time goes (reported with every drill, used in the failure messages): whole iterations
    against the call, the device time of dispatch and combine (native), and the restarted rank's own."""
    n_after = max(1, out.rounds_checked - 1)
    out.newcomer_ms = _median(newcomer["times_ms"][1:])
    out.newcomer_loop_ms = _median(newcomer.get("loop_ms", [])[1:])
    out.loop_before_ms = _median([t for s in survivors for t in s.get("loop_ms", [])[1:kill - 2]])
    out.loop_after_ms = _median([t for s in survivors for t in s.get("loop_ms", [])[-n_after:]])
    for name, pick in (("split_before_ms", lambda sp: sp[1:kill - 1]), ("split_after_ms", lambda sp: sp[-n_after:])):
        rows = [row for s in survivors for row in pick(s.get("split_ms", []))]
        setattr(out, name, [_median([r[0] for r in rows]), _median([r[1] for r in rows])] if rows else [])
    out.death_split_ms = [s["death_split_ms"] for s in survivors if "death_split_ms" in s]
    out.death_host_ms = [s["death_host_ms"] for s in survivors if "death_host_ms" in s]
    def seg_median(rows: List[List[float]]) -> List[float]:
        return [_median([r[i] for r in rows]) for i in range(len(rows[0]))] if rows else []
    out.host_segs_before_ms = seg_median([r for s in survivors for r in s.get("host_segs_ms", [])[1:kill - 1]])
    out.host_segs_after_ms = seg_median([r for s in survivors for r in s.get("host_segs_ms", [])[-n_after:]])
    out.newcomer_host_segs_ms = seg_median(newcomer.get("host_segs_ms", [])[1:])
    out.stall_dumps = [d for s in [*survivors, newcomer] for d in s.get("stall_dumps", [])]
    out.later_marks = {(str(s["rank"]) if s["generation"] == 1 else f"{s['rank']}'"): s["later_marks"]
                       for s in [*survivors, newcomer] if s.get("later_marks")}


def add_parser(sub: Any) -> None:
    p = sub.add_parser("drill", help="kill a rank mid-call, restart it, check survivors and rejoin",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=["native", "reference"], default="native")
    p.add_argument("--transport", default="nvlink", help="native: nvlink, emulated, ... (reference: ignored)")
    p.add_argument("--world", type=int, default=2, help="ranks (they may share a GPU)")
    p.add_argument("--drills", type=int, default=3, help="drills, cycling through --phases")
    p.add_argument("--phases", default=",".join(PHASES))
    p.add_argument("--victim", type=int, default=-1, help="rank to kill (default: the last)")
    p.add_argument("--kill-call", type=int, default=24,
                   help="call the victim dies in; after the first calls' grace window (docs/elastic.md)")
    p.add_argument("--timeout-us", type=int, default=50_000)
    p.add_argument("--slack-ms", type=float, default=50.0, help="detection bound: timeout + this")
    p.add_argument("--max-slowdown", type=float, default=1.5, help="per-call time after / before the kill")
    p.add_argument("--rounds-after", type=int, default=1000, help="calls checked after the rejoin")
    p.add_argument("--lead-calls", type=int, default=8)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--experts", type=int, default=0, help="default: 4 per rank")
    p.add_argument("--topk", type=int, default=4)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--join-timeout-s", type=float, default=120.0)
    p.add_argument("--drill-timeout-s", type=float, default=600.0)
    p.add_argument("--pause-after-admit-ms", type=float, default=0.0,
                   help="survivors pause this long between admitting the restarted rank and its first call")
    p.add_argument("--newcomer-pause-ms", type=float, default=0.0,
                   help="the restarted rank pauses this long after its first call (cold host code)")
    p.add_argument("--first-call-pause-ms", type=float, default=0.0,
                   help="rank 0 starts the first call this late (the start's grace window covers it)")
    p.add_argument("--echo", action="store_true", help="print the ranks' output")
    p.add_argument("--json", default=None, help="write every drill's numbers here")
    p.set_defaults(func=_main)


def _main(ns: argparse.Namespace) -> int:
    from . import CliError
    phases = [x.strip() for x in ns.phases.split(",") if x.strip()]
    if not phases or any(x not in PHASES for x in phases):
        raise CliError(f"--phases must name some of {', '.join(PHASES)}")
    if ns.world < 2:
        raise CliError("--world must be >= 2")
    if ns.experts == 0:
        ns.experts = 4 * ns.world
    from ..ep.elastic.membership import REJOIN_GRACE_CALLS
    if ns.kill_call < REJOIN_GRACE_CALLS + 3:
        raise CliError(f"--kill-call must be >= {REJOIN_GRACE_CALLS + 3}: calls 1 .. {REJOIN_GRACE_CALLS} are the "
                       f"start's grace window (they wait at least 2 s, docs/elastic.md), the next ones give the "
                       f"healthy time")
    outcomes = []
    for i in range(ns.drills):
        o = run_drill(ns, i, phases[i % len(phases)], ns.echo)
        outcomes.append(o)
        status = "PASS" if o.ok else ("HANG" if o.hang else "FAIL")
        print(f"pyep drill #{i} {o.phase:8s} {status}: detect {o.detect_ms:.2f} ms (timeout {ns.timeout_us / 1e3:g} ms), "
              f"rejoin {o.rejoin_s:.2f} s at call {o.joined_at}, {o.rounds_checked} calls checked after, per call "
              f"{o.healthy_ms:.3f} ms before / {o.after_ms:.3f} ms after from the last arrival (own "
              f"{o.healthy_own_ms:.3f} / {o.after_own_ms:.3f}; newcomer {o.newcomer_ms:.3f}; device "
              f"dispatch/combine {o.split_before_ms} -> {o.split_after_ms}, death call {o.death_split_ms})"
              + (f" -- {o.why}" if o.why else ""), flush=True)
    passed = sum(o.ok for o in outcomes)
    hangs = sum(o.hang for o in outcomes)
    print(f"pyep drill: {passed}/{len(outcomes)} drills passed, {hangs} hangs ({ns.backend}, {ns.transport}, "
          f"{ns.world} ranks)", flush=True)
    if ns.json:
        with open(ns.json, "w", encoding="utf-8") as fh:
            json.dump({"args": vars(ns) | {"func": None}, "drills": [asdict(o) for o in outcomes]}, fh, indent=1)
    return 0 if passed == len(outcomes) else 1
