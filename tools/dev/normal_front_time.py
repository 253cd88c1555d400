#!/usr/bin/env python3
"""Host time of the normal mode's front (NormalBuffer: argument checks, the default config, the call
record, the event) with the backend's call stubbed out: the part of a call's host time that every
backend shares, measured on the CPU (no GPU needed; one rank, the reference backend).

    python3 tools/dev/normal_front_time.py [--calls 2000] [--hidden 7168] [--tokens 64] [--profile]

Prints the median over 5 rounds of microseconds per call for a cached BF16 dispatch, a cached FP8
dispatch and a combine, with config=None (the tuned default) and with an explicit Config (as DeepEP's
test passes it). --profile adds a cProfile of the cached BF16 dispatch by own time. The whole host time
of a native call (gate, output pool, launches) is tools/dev/normal_host_time.py's, on a GPU machine.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time
from typing import Any, Callable, Dict, List

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)


def _per_call_us(fn: Callable[[], Any], calls: int) -> float:
    rounds: List[float] = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        rounds.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(rounds)


def main(argv: List[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args(argv)
    import torch
    import torch.distributed as dist

    from pyep.ep.normal.buffer import NormalBuffer
    from pyep.ep.normal.config import Config
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        n, h, k, e = a.tokens, a.hidden, 8, 16
        buf = NormalBuffer(dist.group.WORLD, backend="reference", hidden=h)
        x = torch.randn(n, h).to(torch.bfloat16)
        q = x.to(torch.float8_e4m3fn)
        scales = torch.ones(h // 128, n).T          # column-major, as DeepEP's test passes them
        topk = torch.stack([torch.randperm(e)[:k] for _ in range(n)])
        weights = torch.rand(n, k)
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(topk, e)
        recv, _, _, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                num_tokens_per_expert=per_expert, topk_idx=topk,
                                                topk_weights=weights)
        backend = buf._backend
        # Stub the backend's calls with the results of one real call each: what remains is the front.
        results = {"dispatch": backend.dispatch(_capture(buf, lambda: buf.dispatch(x, handle=handle))),
                   "combine": backend.combine(_capture(buf, lambda: buf.combine(recv, handle=handle), "combine"))}
        backend.dispatch = lambda call: results["dispatch"]
        backend.combine = lambda call: results["combine"]
        cfg = Config(2 * handle.num_channels, 8, 256)
        fns: Dict[str, Callable[[], Any]] = {
            "bf16 cached dispatch": lambda: buf.dispatch(x, handle=handle),
            "fp8 cached dispatch": lambda: buf.dispatch((q, scales), handle=handle),
            "combine": lambda: buf.combine(recv, handle=handle),
            "bf16 cached dispatch, Config": lambda: buf.dispatch(x, handle=handle, config=cfg),
            "combine, Config": lambda: buf.combine(recv, handle=handle, config=cfg),
        }
        print(f"normal-mode front, backend stubbed: us per call (median of 5 rounds of {a.calls}), "
              f"{n} tokens, H={h}")
        for name, fn in fns.items():
            fn()
            print(f"  {name:32s} {_per_call_us(fn, a.calls):8.1f}")
        if a.profile:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(a.calls):
                fns["bf16 cached dispatch"]()
            prof.disable()
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(15)
            print(out.getvalue())
        buf.destroy()
    finally:
        dist.destroy_process_group()
    return 0


def _capture(buf: Any, fn: Callable[[], Any], kind: str = "dispatch") -> Any:
    """The call record the front hands its backend for fn's call (the backend call itself skipped)."""
    backend = buf._backend
    real = getattr(backend, kind)
    seen: List[Any] = []

    def grab(call: Any) -> Any:
        seen.append(call)
        return real(call)
    setattr(backend, kind, grab)
    try:
        fn()
    finally:
        setattr(backend, kind, real)
    return seen[0]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
