"""An elastic workload for `pyep launch` with launcher.restart.policy = "rank" (configs/elastic_cpu.yaml):

    python -m pyep.launch.elastic_demo [--kill-rank R] [--kill-call C] [--phase dispatch|combine|between]
                                       [--rounds-after N] [--timeout-us U] [--lead-calls L]

Every rank runs a store-based EpBuffer serving loop (the job store the launcher hosts: PYEP_STORE_ADDR /
PYEP_STORE_PORT) with the shape from the PYEP_EP_* variables, checking each call against the reference
definition (pyep.ep.elastic.drill_rank). Rank R's first process SIGKILLs itself in call C; the launcher
restarts that rank alone; the new process (generation 2) joins, the survivors admit it between calls,
and every rank runs N more checked calls. Each rank writes elastic-rank-R-gG.json into $PYEP_RUN_DIR.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import List, Optional

from ..config.env import ep_from_env


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="pyep.launch.elastic_demo")
    p.add_argument("--kill-rank", type=int, default=-1, help="default: the last rank; -2: nobody")
    p.add_argument("--kill-call", type=int, default=5)
    p.add_argument("--phase", choices=["dispatch", "combine", "between"], default="dispatch")
    p.add_argument("--rounds-after", type=int, default=10)
    p.add_argument("--timeout-us", type=int, default=2_000_000)
    p.add_argument("--lead-calls", type=int, default=4)
    p.add_argument("--wall-s", type=float, default=300.0)
    args = p.parse_args(argv)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s", stream=sys.stdout)
    ep = ep_from_env()
    victim = world - 1 if args.kill_rank == -1 else args.kill_rank
    a = {"rank": rank, "world": world, "host": os.environ.get("PYEP_STORE_ADDR", "127.0.0.1"),
         "port": int(os.environ["PYEP_STORE_PORT"]), "prefix": "pyep/ep/elastic-demo",
         "backend": "native" if ep.backend == "native" else "reference", "transport": ep.transport,
         "T": ep.num_max_dispatch_tokens_per_rank, "H": ep.hidden, "E": ep.num_experts, "K": ep.num_topk,
         "timeout_us": args.timeout_us, "lead": args.lead_calls, "seed": 11, "victim": victim,
         "kill_call": args.kill_call, "phase": args.phase, "rounds_after": args.rounds_after,
         "join_timeout_s": args.wall_s, "wall_s": args.wall_s}
    from ..ep.elastic.drill_rank import run
    res = run(a)
    print(f"elastic demo rank {rank} generation {res['generation']}: {res['calls']} calls checked"
          + (f", joined at call {res['joined_at']}" if "joined_at" in res else "")
          + (f", admitted rank(s) at call {res['admitted_at']}" if "admitted_at" in res else ""), flush=True)
    if 0 in res["final_active"]:
        print(f"elastic demo rank {rank}: ranks still marked inactive at the end: {res['final_active']}", flush=True)
        return 1
    run_dir = os.environ.get("PYEP_RUN_DIR")
    if run_dir:
        with open(os.path.join(run_dir, f"elastic-rank-{rank}-g{res['generation']}.json"), "w", encoding="utf-8") as fh:
            json.dump(res, fh)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
