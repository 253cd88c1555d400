#!/usr/bin/env python3
"""Host (CPU) time of one normal-mode call on whichever `deep_ep` is importable (DeepEP itself, or pyep's
shim through a `deep_ep` package that re-exports pyep.compat.deep_ep), the GPU kept busy so that the
figure is host time and not waiting: the timed calls queue behind a long device sleep.

    PYTHONPATH=<deep_ep>:<pyep root> python3 tools/dev/normal_host_time.py [--ranks 2] [--calls 100] [--profile]
                                                                          [--as-deepep-test]

Calls (DeepEP's test_intranode.py inputs: 4096 tokens, H=7168, top-8 of 256 experts, Config(24, 8, 256)):
cached FP8 dispatch with column-major scales and cached BF16 dispatch (DeepEP's tuning calls), combine,
get_dispatch_layout, and a full dispatch (which waits for the counts, so its figure includes the GPU).
Prints per rank and call the median, p10 and p90 microseconds; --profile adds rank 0's cProfile (by own
time and by cumulative time) over a second set of calls; --as-deepep-test sets the default dtype and
device as DeepEP's test does (the device puts a __torch_function__ mode on every torch call). On pyep's
shim each line also says how many of the timed calls the C++ fast path took (docs/normal_mode.md, "Host
path"). Ranks share the visible GPUs over a gloo group, as the one-GPU method does; start the MPS daemon
first.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time
from typing import Any, Callable, Dict, List, Optional


def _worker(rank: int, world: int, port: int, calls: int, profile: bool, as_test: bool) -> None:
    import torch
    import torch.distributed as dist
    torch.cuda.set_device(rank % torch.cuda.device_count())
    if as_test:   # DeepEP's init_dist: a default dtype, and a default device (a __torch_function__ mode)
        torch.set_default_dtype(torch.bfloat16)
        torch.set_default_device("cuda")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=world, rank=rank)
    group = dist.new_group(list(range(world)), backend="gloo")
    import deep_ep
    buf = deep_ep.Buffer(group, int(2e9), 0)
    n, h, k, e = 4096, 7168, 8, 256
    torch.manual_seed(rank)
    x = torch.ones((n, h), dtype=torch.bfloat16, device="cuda") * rank
    amax = x.float().abs().view(n, h // 128, 128).amax(dim=2).clamp(min=1e-4)
    q = (x.float().view(n, h // 128, 128) * (448.0 / amax.unsqueeze(2))).view(n, h).to(torch.float8_e4m3fn)
    scales = (amax / 448.0).T.contiguous().T          # column-major, as DeepEP's test passes them
    topk = torch.topk(torch.randn((n, e), device="cuda").abs() + 1, k, dim=-1, sorted=False)[1]
    weights = torch.ones((n, k), dtype=torch.float32, device="cuda")
    cfg = deep_ep.Config(24, 8, 256)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(topk, e)
    full: Dict[str, Any] = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                num_tokens_per_expert=per_expert, topk_idx=topk, topk_weights=weights, config=cfg)
    recv_x, _, _, _, handle, _ = buf.dispatch(x, **full)
    fns: Dict[str, Callable[[], Any]] = {
        "fp8 cached dispatch": lambda: buf.dispatch((q, scales), handle=handle, config=cfg),
        "bf16 cached dispatch": lambda: buf.dispatch(x, handle=handle, config=cfg),
        "combine": lambda: buf.combine(recv_x, handle=handle, config=cfg),
        "layout": lambda: buf.get_dispatch_layout(topk, e),
        "full dispatch (waits)": lambda: buf.dispatch(x, **full),
    }
    def fast_calls() -> Optional[int]:
        """Calls pyep's C++ fast path took so far (pyep's shim), None on DeepEP or without one."""
        nb = getattr(buf, "normal_buffer", None)
        fast = getattr(getattr(nb(), "backend", None), "fast", None) if nb is not None else None
        return int(fast.calls) if fast is not None else None

    for name, fn in fns.items():
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        fast_before = fast_calls()
        dist.barrier(group)
        waits = name.startswith("full")
        prof = cProfile.Profile()
        times: List[float] = []
        for rnd in range(2 if profile else 1):
            if not waits:
                torch.cuda._sleep(int(300e6))   # ~0.2 s of device time: every call below only queues
            for _ in range(calls):
                t0 = time.perf_counter()
                if rnd:
                    prof.enable()
                fn()
                if rnd:
                    prof.disable()
                else:
                    times.append((time.perf_counter() - t0) * 1e6)
            torch.cuda.synchronize()
        dist.barrier(group)
        times.sort()
        fast_after = fast_calls()
        taken = f"  fast path {fast_after - fast_before}/{calls * (2 if profile else 1)}" if fast_after is not None else ""
        # One write per line: print() writes the text and its newline apart, and the ranks' lines interleaved.
        sys.stdout.write(f"[rank {rank}] {name:22s} host us per call: median {times[len(times) // 2]:7.1f}  "
                         f"p10 {times[len(times) // 10]:7.1f}  p90 {times[len(times) * 9 // 10]:7.1f}{taken}\n")
        sys.stdout.flush()
        if profile and rank == 0:
            for key in ("tottime", "cumulative"):
                s = io.StringIO()
                pstats.Stats(prof, stream=s).sort_stats(key).print_stats(25)
                print(s.getvalue(), flush=True)
    dist.barrier(group)
    dist.destroy_process_group()


def main() -> None:
    import torch.multiprocessing as mp
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--calls", type=int, default=100)
    p.add_argument("--profile", action="store_true", help="rank 0's cProfile over a second set of calls")
    p.add_argument("--as-deepep-test", action="store_true",
                   help="set the default dtype (bfloat16) and device (cuda) as DeepEP's tests do")
    a = p.parse_args()
    mp.spawn(_worker, args=(a.ranks, 29500 + os.getpid() % 1000, a.calls, a.profile, a.as_deepep_test),
             nprocs=a.ranks)


if __name__ == "__main__":
    main()
