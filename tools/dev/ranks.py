"""The process launcher of the tools in tools/dev: N ranks of a gloo group on this host, rank r on GPU
r % (number of GPUs), so one GPU is enough (ranks then share it). Each rank runs
`rank_main(rank, device, args) -> dict` (a module-level function, so the spawned processes can import
it); the parent collects the dicts, bounded by a deadline, and notices ranks that died.

    from tools.dev.ranks import rank_inputs, run_ranks
    outs = run_ranks("my_tool", _rank_main, args, args.ranks, timeout_s=600)   # None: a rank failed
"""
from __future__ import annotations

import argparse
import socket
import sys
import time
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

if TYPE_CHECKING:
    import torch

RankMain = Callable[[int, "torch.device", argparse.Namespace], Dict[str, Any]]


def _entry(rank: int, nranks: int, port: int, name: str, rank_main: RankMain, args: argparse.Namespace,
           results: Any) -> None:
    import torch
    import torch.distributed as dist
    ngpu = torch.cuda.device_count()
    if ngpu == 0:
        raise SystemExit(f"{name}: no CUDA device")
    dev = torch.device("cuda", rank % ngpu)
    torch.cuda.set_device(dev)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=nranks)
    try:
        out = rank_main(rank, dev, args)
        out.setdefault("rank", rank)
        results.put(out)
    finally:
        dist.destroy_process_group()


def run_ranks(name: str, rank_main: RankMain, args: argparse.Namespace, nranks: int,
              timeout_s: float) -> Optional[List[Dict[str, Any]]]:
    """Every rank's dict, or None (after saying which ranks gave nothing, on stderr) when a rank died
    or the deadline passed."""
    import queue

    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_entry, args=(r, nranks, port, name, rank_main, args, results))
             for r in range(nranks)]
    for p in procs:
        p.start()
    outs: List[Dict[str, Any]] = []
    deadline = time.monotonic() + timeout_s
    while len(outs) < nranks and time.monotonic() < deadline:
        try:
            outs.append(results.get(timeout=5))
        except queue.Empty:
            if any(p.exitcode not in (None, 0) for p in procs):
                break
    for p in procs:
        p.join(timeout=60)
        if p.is_alive():
            p.terminate()
    if len(outs) < nranks:
        got = {o["rank"] for o in outs}
        print(f"{name}: rank(s) {sorted(set(range(nranks)) - got)} gave no result within {timeout_s:g} s "
              f"(exit codes {[p.exitcode for p in procs]})", file=sys.stderr)
        return None
    return sorted(outs, key=lambda o: o["rank"])


def rank_inputs(rank: int, nranks: int, dev: "torch.device", tokens: int, hidden: int, experts: int, topk: int,
                y_scale: float = 1.0) -> Tuple["torch.Tensor", "torch.Tensor", "torch.Tensor", "torch.Tensor"]:
    """A rank's dispatch / combine inputs, seeded by the rank: x bf16 [T, H], topk int64 [T, K] (K
    distinct experts per token), weights fp32 [T, K], and expert outputs y bf16 [E_l, R*T, H] (randn *
    y_scale)."""
    import torch
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16).to(dev)
    idx = torch.stack([torch.randperm(experts, generator=gen)[:topk] for _ in range(tokens)]).to(dev)
    w = torch.rand(tokens, topk, generator=gen).to(dev)
    y = (torch.randn(experts // nranks, nranks * tokens, hidden, generator=gen) * y_scale).to(torch.bfloat16).to(dev)
    return x, idx, w, y
