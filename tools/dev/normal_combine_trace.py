#!/usr/bin/env python3
"""Where a normal-mode combine's blocks spend their time: the traced build of the combine kernel
(PYEP_NORMAL_TRACE=1, engine/kernels/normal_trace.cuh) on DeepEP's test inputs through pyep's DeepEP shim.

A combine's sender blocks and reduce blocks are coupled through the rings: a sender waits for the
reducer's head before it reuses slots, a reducer for the sender's tail before it reads a row. The kernel
time alone cannot tell which side paces the other; per block the trace gives its span and its warps'
time waiting on those counters, moving rows, and at barriers. Each call starts after a gloo barrier and
a 1 ms device sleep (the ranks' kernels start within the barrier's skew, printed), then is read back.

    python3 tools/dev/normal_combine_trace.py --ranks 2 --sms 24 [--calls 10] [--json F]

Ranks share the visible GPUs (rank % GPUs) over a gloo group; start the MPS daemon first. The traced
kernel spills more registers than the plain one (104 against 20 bytes a thread, sm_90a): its span is
its own, printed beside nothing else; read the shares, and time the plain kernel with
tools/dev/normal_b2b_probe.py. A diagnostic, not a benchmark.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import textwrap
from typing import Any, Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))


def _worker(rank: int, world: int, args: argparse.Namespace, port: int) -> None:
    os.environ["PYEP_NORMAL_TRACE"] = "1"     # before the buffer is built: it allocates the trace words then
    import torch
    import torch.distributed as dist
    sys.path.insert(0, HERE)
    from normal_b2b_probe import first_dispatch   # DeepEP's test inputs and routing, as the probe makes them
    import pyep.compat.deep_ep as deep_ep
    group, buf, _, cfg, recv_x, handle = first_dispatch(deep_ep, rank, world, args, port)
    backend = buf.normal_buffer().backend
    calls: List[List[Dict[str, Any]]] = []
    for i in range(args.warmup + args.calls):
        torch.cuda.synchronize()
        dist.barrier(group)
        torch.cuda._sleep(int(1.7e6))           # ~1 ms: every rank's combine is queued before any starts
        buf.combine(recv_x, handle=handle, config=cfg)
        blocks = backend.last_combine_trace()
        if i >= args.warmup:
            calls.append([vars(b) for b in blocks])
    every: List[Any] = [None] * world
    dist.all_gather_object(every, {"rank": rank, "recv_rows": int(recv_x.shape[0]), "calls": calls}, group=group)
    if rank == 0:
        _report(every, args)
    dist.barrier(group)
    dist.destroy_process_group()


def _report(ranks: List[Dict[str, Any]], args: argparse.Namespace) -> None:
    from pyep.ep.normal.trace import BlockTrace, summarize
    print(f"traced combine, {len(ranks)} ranks, N={args.num_tokens} H={args.hidden} K={args.num_topk} "
          f"E={args.num_experts}, Config({args.sms}, {args.chunk}, {args.ring}), {args.calls} calls")
    skews = []
    for c in range(args.calls):
        starts = [min(b["start_ns"] for b in r["calls"][c]) for r in ranks]
        skews.append((max(starts) - min(starts)) / 1e3)
    print(f"start skew between the ranks' kernels: median {statistics.median(skews):.1f} us, "
          f"max {max(skews):.1f} us")
    print(f"{'rank':>4} {'role':<7} {'blocks':>6} {'block us':>9} {'longest':>8} {'kernel us':>9} "
          f"{'items':>7} {'wait':>6} {'work':>6} {'sync':>6}")
    doc: Dict[str, Any] = {"args": vars(args), "skew_us": skews, "ranks": []}
    for r in ranks:
        per_call = [summarize([BlockTrace(**b) for b in blocks]) for blocks in r["calls"]]
        spans = [(max(b["end_ns"] for b in blocks) - min(b["start_ns"] for b in blocks)) / 1e3
                 for blocks in r["calls"]]
        entry: Dict[str, Any] = {"rank": r["rank"], "recv_rows": r["recv_rows"], "kernel_us": spans, "roles": {}}
        for role in ("send", "reduce"):
            rows = [s[role] for s in per_call if role in s]
            if not rows:
                continue
            med = {k: statistics.median(x[k] for x in rows) for k in rows[0]}
            entry["roles"][role] = med
            print(f"{r['rank']:>4} {role:<7} {int(med['blocks']):>6} {med['mean_us']:>9.1f} {med['max_us']:>8.1f} "
                  f"{statistics.median(spans):>9.1f} {int(med['items']):>7} {med['wait']:>6.0%} "
                  f"{med['work']:>6.0%} {med['sync']:>6.0%}")
        doc["ranks"].append(entry)
    print(textwrap.fill("block us: mean span of a block (first to last clock reading of its warps); kernel us: the "
                        "rank's blocks' span; items: rows sent / tokens reduced; wait / work / sync: shares of the "
                        "warps' summed time waiting on peer counters, moving rows, at barriers (medians over calls)",
                        width=120))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)


def main() -> None:
    sys.path.insert(0, HERE)
    from normal_b2b_probe import add_shape_args
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_shape_args(p, ranks=2)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--json", default="")
    args = p.parse_args()
    import torch.multiprocessing as mp
    port = 29000 + os.getpid() % 2000
    mp.spawn(_worker, args=(args.ranks, args, port), nprocs=args.ranks)


if __name__ == "__main__":
    main()
