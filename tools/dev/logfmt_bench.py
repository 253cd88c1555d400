#!/usr/bin/env python3
"""LogFMT combine (use_logfmt=True) next to BF16 combine on the native backend: the error of LogFMT's
output against BF16's, and the combine kernel time of both (kineto: device time of combine).

    python tools/dev/logfmt_bench.py [--ranks 2] [--tokens 128] [--hidden 7168] [--experts 288]
                                     [--topk 8] [--iters 50] [--scale 0.1] [--json FILE]

Works on one GPU: --ranks N starts N processes on a gloo group, GPU = rank % GPUs (ranks may share one).
Expert outputs are randn * --scale (DeepEP's LogFMT perf case uses 0.1: most groups under 1, so cast).
Errors are over the output elements with |out_bf16| > 1e-3 * max |out_bf16|; calc_diff is DeepEP's
test metric (1 - cosine-like similarity of x + 1 and y + 1).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from typing import Any, Dict, List

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)


def _kernel_us(buf: Any, y: Any, topk: Any, w: Any, handle: Any, use_logfmt: bool, iters: int) -> float:
    """Mean device time of the combine kernel over `iters` combines (kineto)."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            buf.combine(y, topk, w, handle, use_logfmt=use_logfmt)
        torch.cuda.synchronize()
    times = [e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
             for e in prof.key_averages() if "pyep::ll::" in e.key and "::combine" in e.key]
    calls = [e.count for e in prof.key_averages() if "pyep::ll::" in e.key and "::combine" in e.key]
    return sum(times) / max(1, sum(calls))


def _rank_main(rank: int, args: argparse.Namespace, port: int, results: Any) -> None:
    import torch
    import torch.distributed as dist

    from pyep.ep import EpBuffer
    ngpu = torch.cuda.device_count()
    if ngpu == 0:
        raise SystemExit("logfmt_bench: no CUDA device")
    dev = torch.device("cuda", rank % ngpu)
    torch.cuda.set_device(dev)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.ranks)
    T, H, E, K = args.tokens, args.hidden, args.experts, args.topk
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(T, H, generator=gen).to(torch.bfloat16).to(dev)
    topk = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]).to(dev)
    w = torch.rand(T, K, generator=gen).to(dev)
    e_l = E // args.ranks
    y = (torch.randn(e_l, args.ranks * T, H, generator=gen) * args.scale).to(torch.bfloat16).to(dev)
    buf = EpBuffer(None, num_max_dispatch_tokens_per_rank=T, hidden=H, num_experts=E, max_topk=K, backend="native")
    out: Dict[str, Any] = {"rank": rank, "device": torch.cuda.get_device_name(dev)}
    try:
        _r, _c, handle, _e, _h = buf.dispatch(x, topk)
        for lf in (False, True):     # warm-up
            for _ in range(3):
                buf.combine(y, topk, w, handle, use_logfmt=lf)
        torch.cuda.synchronize()
        bf, _, _ = buf.combine(y, topk, w, handle)
        lf, _, _ = buf.combine(y, topk, w, handle, use_logfmt=True)
        torch.cuda.synchronize()
        a, b = bf.double(), lf.double()
        keep = a.abs() > 1e-3 * a.abs().max()
        rel = ((b - a).abs() / a.abs())[keep]
        xa, xb = a + 1, b + 1
        out["calc_diff"] = float(1 - 2 * (xa * xb).sum() / (xa * xa + xb * xb).sum())
        out["max_rel"], out["mean_rel"] = float(rel.max()), float(rel.mean())
        out["nan"] = int(torch.isnan(lf).sum())
        for name, flag in (("bf16_us", False), ("logfmt_us", True)):
            dist.barrier()
            out[name] = _kernel_us(buf, y, topk, w, handle, flag, args.iters)
        dist.barrier()
    finally:
        buf.destroy()
    results.put(out)
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--experts", type=int, default=288)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--scale", type=float, default=0.1, help="expert outputs are randn * scale")
    ap.add_argument("--json", help="write every rank's figures here")
    args = ap.parse_args()
    if args.ranks < 1 or args.experts % args.ranks or args.hidden % 512:
        ap.error("need ranks >= 1 dividing experts, hidden % 512 == 0")
    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, args, port, results)) for r in range(args.ranks)]
    for p in procs:
        p.start()
    outs: List[Dict[str, Any]] = []
    deadline = time.monotonic() + 600
    while len(outs) < args.ranks and time.monotonic() < deadline:
        try:
            outs.append(results.get(timeout=5))
        except Exception:  # noqa: BLE001 - queue.Empty: check the processes are alive
            if any(p.exitcode not in (None, 0) for p in procs):
                break
    for p in procs:
        p.join(timeout=60)
    if len(outs) < args.ranks:
        print(f"logfmt_bench: {args.ranks - len(outs)} rank(s) gave no result "
              f"(exit codes {[p.exitcode for p in procs]})", file=sys.stderr)
        return 1
    print(f"T={args.tokens} H={args.hidden} E={args.experts} K={args.topk} ranks={args.ranks} "
          f"y=randn*{args.scale} on {outs[0]['device']}")
    print("rank  combine bf16 us  combine logfmt us  logfmt/bf16  max rel err  mean rel err  calc_diff  nan")
    for o in sorted(outs, key=lambda o: o["rank"]):
        print(f"{o['rank']:>4}  {o['bf16_us']:>15.1f}  {o['logfmt_us']:>17.1f}  {o['logfmt_us'] / o['bf16_us']:>11.2f}"
              f"  {o['max_rel']:>11.4%}  {o['mean_rel']:>12.4%}  {o['calc_diff']:>9.2e}  {o['nan']:>3}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"config": vars(args), "ranks": outs}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
