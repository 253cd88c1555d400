#!/usr/bin/env python3
"""WQE post-rate benchmark: how fast can GPU threads drive an mlx5 send queue?

Each case posts 64-byte RDMA-write WQEs through engine/mlx5gda/qp.h — the path every pyep kernel
uses — into send rings in GPU memory, with doorbell records, BlueFlame pages and CQs in host-mapped
memory, consumed by a completion sink thread that completes everything it sees (a NIC that costs
nothing). The figure is the GPU side's ceiling for driving a real NIC. The same code posted by CPU
threads (host rings, same sink) is measured in the same run as the baseline.

    python tools/bench_post_rate.py [--out DIR] [--quick]
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from dataclasses import asdict, dataclass
from typing import List, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

log = logging.getLogger("pyep.bench_post_rate")


@dataclass
class Case:
    name: str
    poster: str            # "gpu" or "cpu"
    qps: int
    warps_or_threads: int
    batch: int
    posts: int = 0
    elapsed_ms: float = 0.0
    mpps: float = 0.0          # million WQEs per second, all posters together
    mpps_per_qp: float = 0.0
    doorbells: int = 0
    errors: int = 0
    note: str = ""


def gpu_cases(quick: bool, num_sms: int) -> List[tuple]:
    posts = 4096 if quick else 32768
    # (name, qps, blocks, warps_per_block, warps_per_qp, posts_per_warp, batch)
    return [
        ("1 warp -> 1 QP", 1, 1, 1, 1, posts * 4, 1),
        ("1 warp -> 1 QP, 8 WQEs/doorbell", 1, 1, 1, 1, posts * 4, 8),
        ("32 warps -> 1 QP (shared)", 1, 8, 4, 32, posts, 1),
        (f"{num_sms} SMs x 4 warps, QP per warp", num_sms * 4, num_sms, 4, 1, posts, 1),
        (f"{num_sms} SMs x 4 warps, QP per warp, 8/doorbell", num_sms * 4, num_sms, 4, 1, posts, 8),
        (f"{num_sms} SMs x 4 warps, 4 warps per QP", num_sms, num_sms, 4, 4, posts, 1),
    ]


def run(out_dir: str, quick: bool, device: int) -> List[Case]:
    from pyep._native import engine
    eng = engine()
    results: List[Case] = []
    cpu_posts = 20000 if quick else 200000
    for threads, qps, batch in ((1, 1, 1), (1, 1, 8), (2, 2, 1)):
        r = eng.host_post_rate(threads, qps, 10, cpu_posts, batch, 30.0)
        c = Case(f"CPU {threads} thread(s) -> {qps} QP(s)" + (f", {batch}/doorbell" if batch > 1 else ""),
                 "cpu", qps, threads, batch, r.posts, r.elapsed_s * 1e3, r.posts / r.elapsed_s / 1e6,
                 r.posts / r.elapsed_s / 1e6 / qps, 0, r.errors, "baseline: same qp.h code on host threads")
        results.append(c)
    if getattr(eng, "has_cuda", False):
        import torch
        num_sms = torch.cuda.get_device_properties(device).multi_processor_count
        for name, qps, blocks, wpb, wpq, ppw, batch in gpu_cases(quick, num_sms):
            bench = eng.PostRateBench(device, qps, 10)
            bench.run(1, 1, 1, 64, 1, 10.0)  # warm-up: module load, first-touch of host pages
            r = bench.run(blocks, wpb, wpq, ppw, batch, 30.0)
            c = Case(name, "gpu", qps, blocks * wpb, batch, r.posts, r.elapsed_ms,
                     r.posts / (r.elapsed_ms / 1e3) / 1e6, r.posts / (r.elapsed_ms / 1e3) / 1e6 / qps,
                     r.doorbells, r.errors, r.first_error)
            results.append(c)
    else:
        log.warning("host-only build: GPU cases skipped (%s)", "pyep._engine has no CUDA kernels")
    return results


def report(results: List[Case], out_dir: str, meta: dict) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
        t = Table(title="WQE post rate (64 B RDMA WRITE WQEs, completion sink consumer)")
        for col in ("case", "poster", "QPs", "warps/threads", "WQEs", "ms", "Mpps total", "Mpps/QP", "errors"):
            t.add_column(col, justify="right" if col not in ("case", "poster") else "left")
        for c in results:
            t.add_row(c.name, c.poster, str(c.qps), str(c.warps_or_threads), str(c.posts), f"{c.elapsed_ms:.2f}",
                      f"{c.mpps:.2f}", f"{c.mpps_per_qp:.3f}", str(c.errors))
        Console(width=max(140, Console().width)).print(t)
    except ImportError:
        for c in results:
            print(f"{c.name:50s} {c.poster} {c.mpps:8.2f} Mpps {c.mpps_per_qp:8.3f} Mpps/QP errors={c.errors}")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "post_rate.json")
    with open(path, "w") as f:
        json.dump({"meta": meta, "cases": [asdict(c) for c in results]}, f, indent=2)
    print(f"wrote {path}")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(10, 4))
        ax.barh([c.name for c in results], [c.mpps for c in results],
                color=["tab:gray" if c.poster == "cpu" else "tab:green" for c in results])
        ax.set_xlabel("million WQEs / s (all posters)")
        ax.set_title("pyep WQE post rate")
        fig.tight_layout()
        png = os.path.join(out_dir, "post_rate.png")
        fig.savefig(png, dpi=120)
        print(f"wrote {png}")
    except ImportError:
        log.warning("matplotlib not installed: no plot")


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("PYEP_RUN_DIR") or f"runs/post-rate-{time.strftime('%Y%m%d-%H%M%S')}")
    ap.add_argument("--quick", action="store_true", help="fewer posts per case")
    ap.add_argument("--device", type=int, default=0)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    meta = {"quick": args.quick, "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    try:
        import torch
        if torch.cuda.is_available():
            meta["gpu"] = torch.cuda.get_device_name(args.device)
    except ImportError:
        pass
    results = run(args.out, args.quick, args.device)
    report(results, args.out, meta)
    return 1 if any(c.errors for c in results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
