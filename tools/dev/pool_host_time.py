#!/usr/bin/env python3
"""Host time of one-copy dispatch's output allocation (pyep/ep/normal/direct_pool.py OutputPool.outputs)
against the torch.empty calls it replaces, on one GPU: the median over --calls calls, each call's previous
outputs released when the next are made (a dispatch loop's pattern); --profile adds a cProfile.

    python3 tools/dev/pool_host_time.py [--calls 2000] [--profile]
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--profile", action="store_true")
    args = p.parse_args()
    import torch

    from pyep._native import engine
    from pyep.ep.devmem import DeviceMemory
    from pyep.ep.normal.direct_pool import OutputPool
    from pyep.ep.streams import raw_current_stream
    dev = torch.device("cuda", 0)
    ep = engine().ep
    pool = OutputPool(DeviceMemory(ep, 1 << 30), 0, 1 << 30, dev, ep)
    rows, h, k = 8192, 7168, 8

    def pooled() -> object:
        stream = raw_current_stream(dev)
        return pool.outputs(rows, h, torch.bfloat16, False, k, stream, stream)

    def plain() -> object:
        return (torch.empty((rows, h), dtype=torch.bfloat16, device=dev),
                torch.empty((rows, k), dtype=torch.int64, device=dev))

    for name, fn in (("OutputPool.outputs", pooled), ("torch.empty x2", plain)):
        keep = fn()
        times = []
        for _ in range(args.calls):
            t0 = time.perf_counter()
            keep = fn()
            times.append(time.perf_counter() - t0)
        print(f"{name:20s} median {statistics.median(times) * 1e6:7.1f} us  p90 "
              f"{sorted(times)[int(0.9 * len(times))] * 1e6:7.1f} us")
        del keep
    if args.profile:
        prof = cProfile.Profile()
        held = [pooled()]
        prof.enable()
        for _ in range(args.calls):
            held[0] = pooled()   # the previous call's outputs are released here, as in a dispatch loop
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(15)


if __name__ == "__main__":
    main()
