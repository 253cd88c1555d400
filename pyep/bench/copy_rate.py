"""The memory copy rate of the device a run uses, measured in the same run, and the share of it the
normal mode reaches.

Ranks that share one GPU move every byte out of one rank's HBM and into another's, both on that GPU:
a dispatch of B bytes per rank over R ranks reads R x B and writes R x B bytes of the same memory. A
device-to-device copy of a few hundred MB (well past L2) reads and writes every byte once, so its rate,
counted as (read + write) bytes per second, bounds the mode: per-rank GB/s x R x 2 <= copy rate. The
fraction says how close a row comes; it describes ranks on one device only (ranks on separate GPUs are
bound by NVLink instead).
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, Optional

if TYPE_CHECKING:
    import torch

DEFAULT_MB = 256
REPS = 10
WARMUP = 2
COUNTING = "read + write bytes per second: 2 x copied bytes / time"


@dataclass(frozen=True)
class CopyRate:
    device: str            # "cuda" or "cpu"
    what: str              # words for the report
    bytes: int             # bytes copied per repetition
    reps: int
    best_gbps: float       # the fastest repetition: the bound the fraction is taken against
    median_gbps: float

    def as_dict(self) -> Dict[str, Any]:
        return {**asdict(self), "counting": COUNTING}


def measure(device: "torch.device", megabytes: int, wait: Callable[[str], None], reps: int = REPS,
            warmup: int = WARMUP) -> CopyRate:
    """Copies `megabytes` MB `reps` times on `device` (CUDA events on a GPU, the host clock on the CPU).
    `wait(what)` is the caller's bounded wait for the device."""
    import torch
    if isinstance(megabytes, bool) or not isinstance(megabytes, int) or megabytes < 1:
        raise ValueError(f"copy size must be a positive number of MB, got {megabytes!r}")
    n = megabytes << 20
    src = torch.ones(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    cuda = device.type == "cuda"
    for _ in range(warmup):
        dst.copy_(src)
    wait("copy-rate warmup")
    times_s = []
    if cuda:
        events = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            dst.copy_(src)
            b.record()
            events.append((a, b))
        wait("copy-rate measurement")
        times_s = [float(a.elapsed_time(b)) / 1e3 for a, b in events]
    else:
        for _ in range(reps):
            t0 = time.perf_counter()
            dst.copy_(src)
            times_s.append(time.perf_counter() - t0)
    rates = [2 * n / t / 1e9 for t in times_s if t > 0]
    if not rates:
        raise ValueError("the copy-rate measurement timed no copy")
    what = "device-to-device copy in GPU memory" if cuda else "memory copy in host memory"
    return CopyRate(device.type, what, n, len(rates), max(rates), statistics.median(rates))


def fraction(gbps_per_rank: Optional[float], world_size: int, rate: Optional[CopyRate]) -> float:
    """per-rank GB/s x ranks x 2 / the best copy rate; NaN where either is missing."""
    if rate is None or gbps_per_rank is None or math.isnan(gbps_per_rank) or rate.best_gbps <= 0:
        return math.nan
    return gbps_per_rank * world_size * 2 / rate.best_gbps
