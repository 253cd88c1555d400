#!/usr/bin/env python3
"""Where the time of one native LL dispatch / combine goes, block by block.

    torchrun --standalone --nproc-per-node R tools/ll_trace.py [--tokens 128 --hidden 7168 --experts 288
        --topk 8 --iters 10 --transport nvlink --hook --host-profile]

Builds an EpBuffer with PYEP_LL_TRACE=1 (pyep.ep.ll.trace), runs aligned dispatch and combine calls the
way `pyep bench` does, and prints, for rank 0 and as the maximum over ranks, when the blocks reached
each point of the kernels: routed (slot bases known), issued (all stores handed to the memory
system), fenced (the system-scope fence: stores acknowledged), done (signals sent), then the receive
side's ready (every source's signal seen), copied and done. With all ranks on one GPU (they read one
%globaltimer) it also prints every rank's timeline on one clock and a line per kernel with the ranks'
start skew and the time from the last flags to every rank's ready. --host-profile adds a cProfile of the
Python side of the calls. A diagnostic tool: per-kernel performance figures come from `pyep bench`.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)


def main(argv: list) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--experts", type=int, default=288)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--transport", default="nvlink")
    ap.add_argument("--bf16", action="store_true", help="BF16 dispatch (default FP8)")
    ap.add_argument("--hook", action="store_true", help="send and receive as separate launches (recv hook)")
    ap.add_argument("--host-profile", action="store_true", help="cProfile the Python side of the calls")
    args = ap.parse_args(argv)

    os.environ["PYEP_LL_TRACE"] = "1"
    import torch
    import torch.distributed as dist

    from pyep.bench.routing import make_batch
    from pyep.bench.config import RoutingSpec
    from pyep.bench.dist import plan_distributed, start_distributed
    from pyep.bench.sync import Sync
    from pyep.ep.ll import EpBuffer
    from pyep.ep.ll import trace as tr

    # Ranks may outnumber the GPUs: they then share them over a gloo group (pyep/bench/sharing.py).
    plan = plan_distributed("cuda", "auto", os.environ)
    _group, dev, _owned = start_distributed(plan, 120.0, "cuda")
    rank, world = dist.get_rank(), dist.get_world_size()
    buf = EpBuffer(None, num_max_dispatch_tokens_per_rank=args.tokens, hidden=args.hidden,
                   num_experts=args.experts, max_topk=args.topk, transport=args.transport, backend="native",
                   check_values=False)
    backend = buf.backend   # the native backend: read_trace() lives there
    batch = make_batch(RoutingSpec("uniform"), args.tokens, args.hidden, args.experts, args.topk, seed=1,
                       rank=rank).to(dev)
    e_l = args.experts // world
    y = torch.randn((e_l, world * args.tokens, args.hidden), device=dev).to(torch.bfloat16)
    sync = Sync(dist.group.WORLD, dev, 120.0)
    use_fp8 = not args.bf16

    def one_call() -> list:
        backend.clear_trace()
        sync.barrier("trace: before dispatch")
        sync.align()
        _r, _c, handle, _e, hook = buf.dispatch(batch.x, batch.topk_idx, use_fp8=use_fp8, return_recv_hook=args.hook)
        if hook is not None:
            sync.device_wait("trace: dispatch send")
            hook()
        sync.device_wait("trace: dispatch")
        sync.barrier("trace: before combine")
        sync.align()
        _o, _e, chook = buf.combine(y, batch.topk_idx, batch.topk_weights, handle, return_recv_hook=args.hook)
        if chook is not None:
            sync.device_wait("trace: combine send")
            chook()
        sync.device_wait("trace: combine")
        return backend.read_trace()

    for _ in range(3):
        one_call()
    per_kernel = {k: [] for k in tr.KERNELS}
    raws = []
    for _ in range(args.iters):
        raw = tr.split_kernels(one_call())
        raws.append(raw)
        for k in tr.KERNELS:
            per_kernel[k].append(tr.summarize(raw[k]))
    mine = {k: tr.mean_stats(v) for k, v in per_kernel.items()}
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    # Ranks sharing one GPU read one %globaltimer: each call's earliest stamp over all ranks puts them on
    # one clock, which shows their skew and how long a flag took from one rank's store to another's poll.
    # Only when every rank is on this node's one GPU: other GPUs' and other nodes' timers are not aligned.
    one_clock = {}
    if plan is not None and plan.shared and plan.gpus == 1 and plan.local_world == plan.world:
        starts = [None] * world
        dist.all_gather_object(starts, [{k: tr.first_stamp(raw[k]) for k in tr.KERNELS} for raw in raws])
        for k in tr.KERNELS:
            t0s = [min(s[i][k] for s in starts if s[i][k]) if any(s[i][k] for s in starts) else None
                   for i in range(len(raws))]
            one_clock[k] = tr.mean_stats([tr.summarize(raw[k], t0) for raw, t0 in zip(raws, t0s) if t0])
        clocks = [None] * world
        dist.all_gather_object(clocks, one_clock)
    if rank == 0:
        mode = "hook (send and receive launched separately)" if args.hook else "one launch"
        print(f"LL kernel timeline, {world} ranks, T={args.tokens} H={args.hidden} E={args.experts} K={args.topk}, "
              f"{'FP8' if use_fp8 else 'BF16'} dispatch, {args.transport}, {mode}; mean of {args.iters} calls; "
              f"us after the call's first block started")
        for k in tr.KERNELS:
            print(tr.format_table(f"{k}, rank 0:", mine[k]))
            worst = [tr.PointStat(p.point, p.blocks, max(r[k][i].first_us for r in everyone),
                                  max(r[k][i].median_us for r in everyone), max(r[k][i].last_us for r in everyone))
                     for i, p in enumerate(mine[k]) if all(len(r[k]) > i for r in everyone)]
            print(tr.format_table(f"{k}, max over ranks:", worst))
            if one_clock:
                print(f"{k}, every rank on one clock: {tr.one_clock_summary([c[k] for c in clocks])}")
                for r, c in enumerate(clocks):
                    title = f"{k}, rank {r}, every rank on one clock (us after any rank's first block):"
                    print(tr.format_table(title, c[k]))
    if args.host_profile:
        prof = cProfile.Profile()
        for _ in range(20):
            prof.enable()
            _r, _c, handle, _e, _h = buf.dispatch(batch.x, batch.topk_idx, use_fp8=use_fp8)
            buf.combine(y, batch.topk_idx, batch.topk_weights, handle)
            prof.disable()
            sync.device_wait("trace: host profile")
        if rank == 0:
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(18)
            print("host profile of 20 dispatch+combine calls (rank 0, sorted by own time):")
            print(out.getvalue())
    buf.destroy()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
