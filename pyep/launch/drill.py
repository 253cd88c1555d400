"""The elastic-membership drill behind `pyep drill` (docs/elastic.md). Hosts a TCPStore, starts
`world` ranks of a store-based EpBuffer serving loop (pyep.ep.elastic.drill_rank), SIGKILLs one of them
in the middle of dispatch, of combine or between calls, restarts that one process, and checks:

- the survivors finish the call that finds the rank dead within a healthy call's time + timeout + slack,
  with outputs equal to the reference definition for the ranks that were active;
- the restarted process joins (generation 2) and every rank then runs `rounds_after` calls, each
  bit-equal to the reference;
- survivors' per-call time after the rejoin stays near the healthy one (max_slowdown), both counted
  from the last rank's start of each call (so the ranks' host-loop skew is not counted as call time).

`run_drill` runs one drill and returns its DrillOutcome (never raises for a failed drill: `ok`, `hang`
and `why` say what happened).
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

from .secret import SECRET_FILE_VAR, remove_secret_dir, temp_job_secret
from .store import JobStore

PHASES = ("dispatch", "combine", "between")
# --mode normal (NormalBuffer, pyep.ep.elastic.drill_normal): also the layout (notify) exchange.
NORMAL_PHASES = ("layout", "dispatch", "combine", "between")
MODES = ("ll", "normal")
NORMAL_NATIVE_TRANSPORTS = ("nvlink", "emulated", "emulated-internode")


# Each rank is a process sharing the host (and usually one GPU); each call is a loop iteration.
MAX_WORLD = 64
MAX_CALLS = 1_000_000


def _bound(flag: str, value: object, lo: int, hi: int, note: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ValueError(f"{flag} must be an integer in [{lo}, {hi}]{' ' + note if note else ''}, got {value!r}")


@dataclass
class DrillConfig:
    """One `pyep drill` run. The fields are that command's options, so the errors name them as its
    command line spells them. experts = 0: 4 per rank. mode "normal" drills a store-based NormalBuffer
    (the reference backend, or the native kernels: over NVLink on one node, or with --transport
    emulated one rank per virtual node and the column relay on the softnic); its calls are steps (layout,
    dispatch, combine)."""
    mode: str = "ll"                 # ll (EpBuffer) or normal (NormalBuffer)
    backend: str = "native"          # native or reference
    transport: str = "nvlink"        # native: nvlink, emulated, ... (reference: ignored)
    world: int = 2                   # ranks (they may share a GPU)
    ranks_per_node: int = 0          # normal mode over the softnic: ranks per virtual node (0: 1)
    drills: int = 3                  # drills, cycling through phases
    phases: Tuple[str, ...] = ()     # () = every phase of the mode
    victim: int = -1                 # rank to kill (-1: the last)
    kill_call: int = 24              # call the victim dies in; after the first calls' grace window
    timeout_us: int = 50_000
    slack_ms: float = 50.0           # detection bound: a healthy call + timeout + this
    max_slowdown: float = 1.5        # per-call time after / before the kill
    rounds_after: int = 1000         # calls checked after the rejoin
    lead_calls: int = 8
    tokens: int = 32
    hidden: int = 1024
    experts: int = 0
    topk: int = 4
    seed: int = 1
    join_timeout_s: float = 120.0
    drill_timeout_s: float = 600.0
    pause_after_admit_ms: float = 0.0    # survivors pause between admitting the restarted rank and its first call
    newcomer_pause_ms: float = 0.0       # the restarted rank pauses after its first call (cold host code)
    first_call_pause_ms: float = 0.0     # rank 0 starts the first call this late
    pause_timeout_us: int = 0            # the timeout of the calls those pauses delay (0: timeout_us)

    def __post_init__(self) -> None:
        # Every option against the others, before a store or a rank is started.
        from ..ep.config import FP8_GROUP, MAX_HIDDEN, MAX_TOPK, TRANSPORTS
        from ..ep.elastic.membership import REJOIN_GRACE_CALLS
        if self.mode not in MODES:
            raise ValueError(f"--mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        allowed = NORMAL_PHASES if self.mode == "normal" else PHASES
        self.phases = tuple(self.phases) or allowed
        if any(x not in allowed for x in self.phases):
            raise ValueError(f"--phases must name some of {', '.join(allowed)} (--mode {self.mode})")
        if self.backend not in ("native", "reference"):
            raise ValueError(f"--backend must be native or reference, got {self.backend!r}")
        if self.mode == "normal" and self.backend == "native" and self.transport not in NORMAL_NATIVE_TRANSPORTS:
            raise ValueError("--mode normal --backend native runs over --transport nvlink (one node) or emulated (one "
                             "rank per virtual node, the column relay on the softnic): the internode kernels take "
                             "the mask with one rank per node only (docs/elastic.md, 'Normal mode')")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"--transport must be one of {', '.join(TRANSPORTS)}, got {self.transport!r}")
        _bound("--world", self.world, 2, MAX_WORLD)
        _bound("--ranks-per-node", self.ranks_per_node, 0, 8, "(0: one rank per virtual node)")
        if self.ranks_per_node and (self.mode != "normal" or not self.transport.startswith("emulated")):
            raise ValueError("--ranks-per-node goes with --mode normal --transport emulated (virtual nodes)")
        if self.ranks_per_node and (self.world % self.ranks_per_node or self.world == self.ranks_per_node):
            raise ValueError(f"--ranks-per-node {self.ranks_per_node} must divide --world {self.world} into "
                             f"two or more virtual nodes")
        _bound("--victim", self.victim, -1, self.world - 1, "(-1: the last rank)")
        _bound("--drills", self.drills, 1, 10_000)
        _bound("--kill-call", self.kill_call, REJOIN_GRACE_CALLS + 3, MAX_CALLS,
               f"(calls 1 .. {REJOIN_GRACE_CALLS} are the start's grace window: they wait at least 2 s, "
               "docs/elastic.md; the next ones give the healthy time)")
        _bound("--rounds-after", self.rounds_after, 1, MAX_CALLS)
        _bound("--lead-calls", self.lead_calls, 0, MAX_CALLS)
        _bound("--timeout-us", self.timeout_us, 1, 3_600_000_000)
        _bound("--tokens", self.tokens, 1, 65536)
        _bound("--hidden", self.hidden, FP8_GROUP, MAX_HIDDEN, f"(a multiple of {FP8_GROUP})")
        if self.hidden % FP8_GROUP:
            raise ValueError(f"--hidden must be a multiple of {FP8_GROUP}, got {self.hidden}")
        if self.experts == 0:
            self.experts = 4 * self.world
        _bound("--experts", self.experts, self.world, 1 << 16, f"(0: 4 per rank; divisible by --world {self.world})")
        if self.experts % self.world:
            raise ValueError(f"--experts {self.experts} is not divisible by --world {self.world}")
        _bound("--topk", self.topk, 1, min(MAX_TOPK, self.experts), f"(at most {MAX_TOPK} and at most --experts)")
        _bound("--seed", self.seed, 0, (1 << 31) - 1)
        for flag, value, lo, hi in (("--slack-ms", self.slack_ms, 0.0, 3.6e6),
                                    ("--max-slowdown", self.max_slowdown, 1.0, 1e6),
                                    ("--join-timeout-s", self.join_timeout_s, 1e-3, 86400.0),
                                    ("--drill-timeout-s", self.drill_timeout_s, 1e-3, 86400.0),
                                    ("--pause-after-admit-ms", self.pause_after_admit_ms, 0.0, 3.6e6),
                                    ("--newcomer-pause-ms", self.newcomer_pause_ms, 0.0, 3.6e6),
                                    ("--first-call-pause-ms", self.first_call_pause_ms, 0.0, 3.6e6)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
                raise ValueError(f"{flag} must be a number in [{lo:g}, {hi:g}], got {value!r}")

    @property
    def normal_ranks_per_node(self) -> Optional[int]:
        """--mode normal with --transport emulated: virtual nodes of --ranks-per-node ranks (default 1) --
        the native internode path (its relay on the softnic; an elastic buffer runs it rank to rank), or
        the reference's node layout (combine in node order)."""
        if self.mode == "normal" and self.transport.startswith("emulated"):
            return self.ranks_per_node or 1
        return None

    @property
    def victim_rank(self) -> int:
        return self.victim if self.victim >= 0 else self.world - 1


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


def _say(line: str) -> None:
    print(line, flush=True)


def _rank_args(cfg: DrillConfig, rank: int, port: int, prefix: str, phase: str) -> Dict[str, Any]:
    return {"mode": cfg.mode, "rank": rank, "world": cfg.world, "host": "127.0.0.1", "port": port, "prefix": prefix,
            "backend": cfg.backend, "transport": cfg.transport, "T": cfg.tokens, "H": cfg.hidden, "E": cfg.experts,
            "K": cfg.topk, "timeout_us": cfg.timeout_us, "lead": cfg.lead_calls, "seed": cfg.seed,
            "victim": cfg.victim_rank, "kill_call": cfg.kill_call, "phase": phase,
            "rounds_after": cfg.rounds_after, "join_timeout_s": cfg.join_timeout_s, "wall_s": cfg.drill_timeout_s,
            "pause_after_admit_ms": cfg.pause_after_admit_ms, "newcomer_pause_ms": cfg.newcomer_pause_ms,
            "first_call_pause_ms": cfg.first_call_pause_ms, "pause_timeout_us": cfg.pause_timeout_us,
            "ranks_per_node": cfg.normal_ranks_per_node}


def _spawn(args: Dict[str, Any], secret_file: str) -> subprocess.Popen:
    env = dict(os.environ)
    if args.get("backend") == "native" and str(args.get("transport", "")).startswith("emulated"):
        from ..softnic.cuda_env import softnic_cuda_env
        softnic_cuda_env(env, processes_on_gpu=int(args.get("world", 1)) + 1)   # + the restarted one
    env[SECRET_FILE_VAR] = secret_file      # the path only: the secret stays off every command line
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join([root, *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]])
    module = "pyep.ep.elastic.drill_normal" if args.get("mode") == "normal" else "pyep.ep.elastic.drill_rank"
    return subprocess.Popen([sys.executable, "-u", "-m", module, json.dumps(args)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def failure_lines(lines: List[str], limit: int = 24) -> List[str]:
    """What says why a rank failed: its last traceback (the error is its last line, the frames above
    name where), else its last lines. CUDA's warnings printed at exit after a sticky error follow the
    traceback and would otherwise push it out."""
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")]
    if not starts:
        return lines[-8:]
    where = [line for line in lines[:starts[-1]] if " failed in " in line][-1:]   # drill_rank.main
    tb = [line for line in lines[starts[-1]:] if "CUDA warning" not in line]
    return where + (tb if len(tb) <= limit else tb[:4] + ["..."] + tb[-(limit - 5):])


class _Reader:
    def __init__(self, proc: subprocess.Popen, tag: str, echo: bool, say: Callable[[str], None]) -> None:
        self.lines: List[str] = []
        self.stamps: List[List[float]] = []
        self.result: Optional[Dict[str, Any]] = None
        self._t = threading.Thread(target=self._run, args=(proc, tag, echo, say), daemon=True)
        self._t.start()

    def _run(self, proc: subprocess.Popen, tag: str, echo: bool, say: Callable[[str], None]) -> None:
        from ..ep.elastic.drill_rank import RESULT_TAG, STAMP_TAG
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
                say(f"  [{tag}] {line}")

    def join(self) -> None:
        self._t.join(5.0)


def run_drill(cfg: DrillConfig, index: int, phase: str, echo: bool = False,
              say: Callable[[str], None] = _say) -> DrillOutcome:
    """Drill number `index` with the kill in `phase`. `say` gets the progress lines (the restart, and
    with `echo` every line the ranks print)."""
    out = DrillOutcome(index, phase, ok=False)
    # The drill's store listens on 127.0.0.1 only, and each drill has its own secret (docs/elastic.md).
    job = JobStore("127.0.0.1", 0, cfg.world, 60.0)
    secret_file = temp_job_secret()
    store = job.store
    prefix = f"pyep/drill/{os.getpid()}/{index}"
    victim = cfg.victim_rank
    procs: Dict[str, subprocess.Popen] = {}
    readers: Dict[str, _Reader] = {}
    deadline = time.monotonic() + cfg.drill_timeout_s
    restart_time = 0.0
    try:
        for r in range(cfg.world):
            tag = f"rank {r}"
            procs[tag] = _spawn(_rank_args(cfg, r, store.port, prefix, phase), secret_file)
            readers[tag] = _Reader(procs[tag], tag, echo, say)
        while time.monotonic() < deadline:
            alive = [t for t, p in procs.items() if p.poll() is None]
            dead_victim = procs[f"rank {victim}"].poll()
            if dead_victim is not None and "restart" not in procs:
                if dead_victim != -9:
                    raise RuntimeError(f"rank {victim} exited with {dead_victim} before it was killed: "
                                       + " | ".join(readers[f"rank {victim}"].lines[-5:]))
                say(f"pyep drill #{index}: rank {victim} killed ({phase}); restarting it")
                restart_time = time.time()
                procs["restart"] = _spawn(_rank_args(cfg, victim, store.port, prefix, phase), secret_file)
                readers["restart"] = _Reader(procs["restart"], f"rank {victim}'", echo, say)
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
            raise RuntimeError(f"drill did not finish within {cfg.drill_timeout_s} s")
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
        _judge(cfg, out, survivors, newcomer, readers[f"rank {victim}"].stamps, restart_time)
        out.ok = True
    except Exception as exc:  # noqa: BLE001 - reported per drill
        out.why = str(exc)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(10)
        remove_secret_dir(secret_file, levels=2)
        job.close()
    return out


def _judge(cfg: DrillConfig, out: DrillOutcome, survivors: List[Dict[str, Any]], newcomer: Dict[str, Any],
           victim_stamps: List[List[float]], restart_time: float) -> None:
    """Fills `out` from the ranks' results; raises RuntimeError naming the first check that failed."""
    victim = cfg.victim_rank
    if newcomer["generation"] != 2:
        raise RuntimeError(f"the restarted rank has generation {newcomer['generation']}, expected 2")
    out.joined_at = int(newcomer["joined_at"])
    out.rounds_checked = int(newcomer["calls_after_join"])
    out.detect_ms = max(float(s.get("death_call_ms", 0.0)) for s in survivors)
    out.rejoin_s = max(float(s["admit_time"]) for s in survivors) - restart_time
    kill = cfg.kill_call
    healthy = [t for s in survivors for t in s["times_ms"][1:kill - 1]]
    after = [t for s in survivors for t in s["times_ms"][-max(1, out.rounds_checked - 1):]]
    out.healthy_own_ms = statistics.median(healthy) if healthy else 0.0
    out.after_own_ms = statistics.median(after) if after else 0.0
    n_after = max(1, out.rounds_checked - 1)
    last_calls = sorted({int(c) for c, _, _ in newcomer.get("stamps", [])})[-n_after:]
    out.healthy_ms = _from_last_arrival(survivors, victim_stamps, range(2, kill - 1))
    out.after_ms = _from_last_arrival(survivors, newcomer.get("stamps", []), last_calls)
    _diagnostics(out, survivors, newcomer, kill)
    # The call that finds the death still does a call's work around its timed-out wait: with the ranks
    # time-slicing one GPU (no MPS) that work alone is tens of ms, so the bound adds the healthy call.
    limit = out.healthy_ms + cfg.timeout_us / 1e3 + cfg.slack_ms
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
                           f"a healthy call {out.healthy_ms:.1f} ms + timeout + {cfg.slack_ms:g} ms = {limit:.1f} "
                           f"ms (device dispatch/combine {out.death_split_ms}; host dispatch call / expert / "
                           f"combine call / sync "
                           f"{out.death_host_ms})")
    if not out.healthy_ms or not out.after_ms:
        raise RuntimeError(f"no per-call time from the last arrival (before {out.healthy_ms}, after "
                           f"{out.after_ms}): some rank's call stamps are missing")
    if out.after_ms > cfg.max_slowdown * out.healthy_ms + 0.5:
        raise RuntimeError(f"per-call time after the rejoin {out.after_ms:.3f} ms vs {out.healthy_ms:.3f} ms "
                           f"before, from the last arrival (> x{cfg.max_slowdown:g}; own call "
                           f"{out.after_own_ms:.3f} vs {out.healthy_own_ms:.3f} ms); device ms (dispatch, combine) "
                           f"{out.split_before_ms} before, {out.split_after_ms} after; iteration "
                           f"{out.loop_before_ms:.3f} ms before, {out.loop_after_ms:.3f} after, newcomer "
                           f"{out.newcomer_loop_ms:.3f} (its call {out.newcomer_ms:.3f} ms)")


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
