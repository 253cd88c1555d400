#!/usr/bin/env python3
"""Host (CPU) time of the pieces of one native dispatch / combine call, on one GPU (world size 1).

    python tools/dev/host_overhead.py [--iters 300]

Prints the mean microseconds of each piece, measured separately with the device idle between calls,
so the front end's cost can be attributed (validation, allocations, the launch binding, handles).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=300)
    args = ap.parse_args()
    import torch
    import torch.distributed as dist

    from pyep.ep import EpBuffer
    from pyep.ep.validate import validate_combine, validate_dispatch

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    dev = torch.device("cuda", 0)
    T, H, E, K = 128, 7168, 72, 8      # E_l = 72 as for E = 288 over 4 ranks
    buf = EpBuffer(None, num_max_dispatch_tokens_per_rank=T, hidden=H, num_experts=E, max_topk=K,
                   backend="native", check_values=False)
    be = buf.backend
    x = torch.randn(T, H, device=dev).to(torch.bfloat16)
    topk = torch.stack([torch.randperm(E, device=dev)[:K] for _ in range(T)])
    w = torch.rand(T, K, device=dev)
    y = torch.randn(E, T, H, device=dev).to(torch.bfloat16)
    cfg = buf._config

    def timed(name: str, fn) -> None:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        total = 0.0
        for _ in range(args.iters):
            t0 = time.perf_counter()
            fn()
            total += time.perf_counter() - t0
            torch.cuda.synchronize()
        print(f"{name:<44} {total / args.iters * 1e6:8.1f} us")

    _r, _c, handle, _e, _h = buf.dispatch(x, topk)
    torch.cuda.synchronize()
    timed("EpBuffer.dispatch (fp8)", lambda: buf.dispatch(x, topk))
    timed("EpBuffer.combine", lambda: buf.combine(y, topk, w, buf.dispatch(x, topk)[2]))
    timed("  validate_dispatch", lambda: validate_dispatch(
        cfg, 1, dev, x, topk, use_fp8=True, round_scale=False, use_ue8m0=False, active_ranks=None,
        timeout_us=None, async_finish=False, return_recv_hook=False, cumulative_local_expert_recv_stats=None))
    _r, _c, handle, _e, _h = buf.dispatch(x, topk)
    torch.cuda.synchronize()
    timed("  validate_combine", lambda: validate_combine(
        cfg, 1, dev, y, topk, w, handle, owner=buf._owner, epoch=buf._epoch, last_seq=buf._seq,
        active_ranks=None, timeout_us=None, zero_copy=False, async_finish=False, return_recv_hook=False,
        out=None))
    timed("  torch.empty recv_x [72,128,7168] e4m3", lambda: torch.empty((E, T, H), dtype=torch.float8_e4m3fn,
                                                                         device=dev))
    timed("  torch.empty scales (+transpose)", lambda: torch.empty((E, H // 128, T), dtype=torch.float32,
                                                                   device=dev).transpose(1, 2))
    timed("  torch.empty int32 [E*(1+2T)]", lambda: torch.empty(E * (1 + 2 * T), dtype=torch.int32, device=dev))
    timed("  torch.empty out [T,H] bf16", lambda: torch.empty((T, H), dtype=torch.bfloat16, device=dev))
    timed("  raw stream query", be._raw_current_stream)
    timed("  10 x data_ptr()", lambda: [x.data_ptr() for _ in range(10)])
    recv = torch.empty((E, T, H), dtype=torch.float8_e4m3fn, device=dev)
    sc = torch.empty((E, H // 128, T), dtype=torch.float32, device=dev).transpose(1, 2)
    meta = torch.empty(E * (1 + 2 * T), dtype=torch.int32, device=dev)
    lr = torch.empty((E, 1), dtype=torch.int64, device=dev)
    act = be._active_ptr(None)
    s = be._static
    ep = be._ep
    timed("  ep.dispatch binding + launch", lambda: ep.dispatch(
        s, x.data_ptr(), topk.data_ptr(), T, K, 0, True, False, False, act, recv.data_ptr(), sc.data_ptr(),
        meta.data_ptr() + 4 * E, meta.data_ptr() + 4 * E * (1 + T), lr.data_ptr(), meta.data_ptr(), 0,
        10**10, 3, be._raw_current_stream()))
    buf.destroy()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
