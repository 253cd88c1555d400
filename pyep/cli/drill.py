"""`pyep drill`: the elastic-membership drill (pyep.launch.drill). Hosts a TCPStore, starts `--world`
ranks of a store-based EpBuffer serving loop (pyep.ep.elastic.drill_rank), SIGKILLs one of them in the
middle of dispatch, of combine or between calls, restarts that one process, and checks:

- the survivors finish the call that finds the rank dead within a healthy call's time + timeout + slack,
  with outputs equal to the reference definition for the ranks that were active;
- the restarted process joins (generation 2) and every rank then runs `--rounds-after` calls, each
  bit-equal to the reference;
- survivors' per-call time after the rejoin stays near the healthy one (--max-slowdown), both counted
  from the last rank's start of each call (so the ranks' host-loop skew is not counted as call time).

One line per drill and a summary (drills passed, hangs, detection / rejoin / per-call times); exit
status 0 only if every drill passed. --json FILE writes every drill's numbers. Every option is checked
against the others (DrillConfig) before the store or any rank starts: a bad one exits 2 with one line.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any, List

from ..launch.drill import MODES, NORMAL_PHASES, PHASES, DrillConfig, DrillOutcome, run_drill
from . import CliError, check_output


def add_parser(sub: Any) -> None:
    d = DrillConfig   # its class attributes are the defaults
    p = sub.add_parser("drill", help="kill a rank mid-call, restart it, check survivors and rejoin",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=list(MODES), default=d.mode,
                   help="ll: EpBuffer; normal: a store-based NormalBuffer (layout, dispatch, combine per step; "
                        "--backend reference)")
    p.add_argument("--backend", choices=["native", "reference"], default=d.backend)
    p.add_argument("--transport", default=d.transport, help="native: nvlink, emulated, ... (reference: ignored)")
    p.add_argument("--world", type=int, default=d.world, help="ranks (they may share a GPU)")
    p.add_argument("--ranks-per-node", type=int, default=d.ranks_per_node,
                   help="--mode normal --transport emulated: ranks per virtual node (default 1)")
    p.add_argument("--drills", type=int, default=d.drills, help="drills, cycling through --phases")
    p.add_argument("--phases", default="",
                   help=f"comma-separated; default every phase of the mode (ll: {','.join(PHASES)}; normal: "
                        f"{','.join(NORMAL_PHASES)})")
    p.add_argument("--victim", type=int, default=d.victim, help="rank to kill (default: the last)")
    p.add_argument("--kill-call", type=int, default=d.kill_call,
                   help="call the victim dies in; after the first calls' grace window (docs/elastic.md)")
    p.add_argument("--timeout-us", type=int, default=d.timeout_us)
    p.add_argument("--slack-ms", type=float, default=d.slack_ms,
                   help="detection bound: a healthy call + timeout + this")
    p.add_argument("--max-slowdown", type=float, default=d.max_slowdown, help="per-call time after / before the kill")
    p.add_argument("--rounds-after", type=int, default=d.rounds_after, help="calls checked after the rejoin")
    p.add_argument("--lead-calls", type=int, default=d.lead_calls)
    p.add_argument("--tokens", type=int, default=d.tokens)
    p.add_argument("--hidden", type=int, default=d.hidden)
    p.add_argument("--experts", type=int, default=d.experts, help="default: 4 per rank")
    p.add_argument("--topk", type=int, default=d.topk)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--join-timeout-s", type=float, default=d.join_timeout_s)
    p.add_argument("--drill-timeout-s", type=float, default=d.drill_timeout_s)
    p.add_argument("--pause-after-admit-ms", type=float, default=d.pause_after_admit_ms,
                   help="survivors pause this long between admitting the restarted rank and its first call")
    p.add_argument("--newcomer-pause-ms", type=float, default=d.newcomer_pause_ms,
                   help="the restarted rank pauses this long after its first call (cold host code)")
    p.add_argument("--first-call-pause-ms", type=float, default=d.first_call_pause_ms,
                   help="rank 0 starts the first call this late (the start's grace window covers it)")
    p.add_argument("--echo", action="store_true", help="print the ranks' output")
    p.add_argument("--json", default=None, help="write every drill's numbers here")
    p.set_defaults(func=_main)


def config_from_args(ns: argparse.Namespace) -> DrillConfig:
    names = {f.name for f in dataclasses.fields(DrillConfig)} - {"phases"}
    phases = tuple(x.strip() for x in ns.phases.split(",") if x.strip())
    if ns.phases and not phases:      # given, but names none (not given: every phase of the mode)
        allowed = NORMAL_PHASES if ns.mode == "normal" else PHASES
        raise CliError(f"--phases must name some of {', '.join(allowed)} (--mode {ns.mode})")
    try:
        return DrillConfig(phases=phases, **{k: v for k, v in vars(ns).items() if k in names})
    except ValueError as exc:
        raise CliError(str(exc)) from None


def _line(cfg: DrillConfig, o: DrillOutcome) -> str:
    status = "PASS" if o.ok else ("HANG" if o.hang else "FAIL")
    return (f"pyep drill #{o.index} {o.phase:8s} {status}: detect {o.detect_ms:.2f} ms (timeout "
            f"{cfg.timeout_us / 1e3:g} ms), rejoin {o.rejoin_s:.2f} s at call {o.joined_at}, {o.rounds_checked} "
            f"calls checked after, per call {o.healthy_ms:.3f} ms before / {o.after_ms:.3f} ms after from the last "
            f"arrival (own {o.healthy_own_ms:.3f} / {o.after_own_ms:.3f}; newcomer {o.newcomer_ms:.3f}"
            # the LL drill's device split (events around its kernels); the normal drill has none
            + (f"; device dispatch/combine {o.split_before_ms} -> {o.split_after_ms}, death call {o.death_split_ms}"
               if o.split_before_ms or o.split_after_ms or o.death_split_ms else "")
            + ")" + (f" -- {o.why}" if o.why else ""))


def _main(ns: argparse.Namespace) -> int:
    cfg = config_from_args(ns)
    if ns.json:
        check_output(ns.json, "--json", directory=False)
    ns.experts = cfg.experts   # --json records the resolved default
    outcomes: List[DrillOutcome] = []
    for i in range(cfg.drills):
        o = run_drill(cfg, i, cfg.phases[i % len(cfg.phases)], ns.echo)
        outcomes.append(o)
        print(_line(cfg, o), flush=True)
    passed = sum(o.ok for o in outcomes)
    hangs = sum(o.hang for o in outcomes)
    print(f"pyep drill: {passed}/{len(outcomes)} drills passed, {hangs} hangs ({cfg.mode} mode, {cfg.backend}, "
          f"{cfg.transport}, {cfg.world} ranks)", flush=True)
    if ns.json:
        with open(ns.json, "w", encoding="utf-8") as fh:
            json.dump({"args": vars(ns) | {"func": None}, "drills": [dataclasses.asdict(o) for o in outcomes]}, fh,
                      indent=1)
    return 0 if passed == len(outcomes) else 1
