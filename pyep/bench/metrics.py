"""What the benchmark counts: bytes moved per rank, bandwidth, and per-iteration statistics.

Bytes follow the low-latency wire format (REFERENCE.md section 1), counted the way DeepEP's benchmark
counts them so that GB/s figures compare: every valid (token, k) entry of this rank is one message,
whether its expert lives on a remote rank or on this one.
- dispatch message: 16-byte header + payload; FP8 payload = H bytes + H/128 fp32 scales, BF16 = 2H.
- combine message: 2H bytes (one bf16 expert output per entry).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Sequence

HEADER_BYTES = 16
SCALE_GROUP = 128


def dispatch_message_bytes(hidden: int, use_fp8: bool) -> int:
    if hidden <= 0 or hidden % SCALE_GROUP:
        raise ValueError(f"hidden must be a positive multiple of {SCALE_GROUP}, got {hidden}")
    payload = hidden + (hidden // SCALE_GROUP) * 4 if use_fp8 else 2 * hidden
    return payload + HEADER_BYTES


def combine_message_bytes(hidden: int) -> int:
    if hidden <= 0:
        raise ValueError(f"hidden must be positive, got {hidden}")
    return 2 * hidden


def dispatch_bytes(num_valid: int, hidden: int, use_fp8: bool) -> int:
    """Bytes one rank sends in a dispatch: num_valid = number of its topk_idx entries != -1."""
    if num_valid < 0:
        raise ValueError(f"num_valid must be >= 0, got {num_valid}")
    return num_valid * dispatch_message_bytes(hidden, use_fp8)


def combine_bytes(num_valid: int, hidden: int) -> int:
    """Bytes one rank receives back in a combine (the same entries as its dispatch)."""
    if num_valid < 0:
        raise ValueError(f"num_valid must be >= 0, got {num_valid}")
    return num_valid * combine_message_bytes(hidden)


def gbps(num_bytes: float, time_us: float) -> float:
    """Decimal GB/s (1e9 bytes per second), as DeepEP and NCCL report; NaN without a valid time."""
    if not time_us or time_us <= 0 or math.isnan(time_us):
        return math.nan
    return num_bytes / (time_us * 1e-6) / 1e9


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default) of the non-NaN values; NaN if none."""
    vals = sorted(v for v in values if not math.isnan(v))
    if not vals:
        return math.nan
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    pos = (len(vals) - 1) * q / 100.0
    lo = int(math.floor(pos))
    hi = min(lo + 1, len(vals) - 1)
    return vals[lo] + (vals[hi] - vals[lo]) * (pos - lo)


def mean(values: Sequence[float]) -> float:
    vals = [v for v in values if not math.isnan(v)]
    return sum(vals) / len(vals) if vals else math.nan


@dataclass(frozen=True)
class Stat:
    """One metric over ranks and iterations. mean/p50/p99 are each the maximum over ranks of that
    rank's statistic across iterations: a collective step is as slow as its slowest rank."""
    mean: float
    p50: float
    p99: float
    min: float
    per_rank_mean: List[float]

    def as_dict(self) -> Dict[str, object]:
        return {"mean": _num(self.mean), "p50": _num(self.p50), "p99": _num(self.p99),
                "min": _num(self.min), "per_rank_mean": [_num(v) for v in self.per_rank_mean]}


def _num(v: float) -> object:
    return None if math.isnan(v) else round(v, 4)


def _nanmax(vals: Sequence[float]) -> float:
    vals = [v for v in vals if not math.isnan(v)]
    return max(vals) if vals else math.nan


def summarize(samples: Sequence[Sequence[float]]) -> Stat:
    """samples[rank][iteration] (microseconds, NaN = not measured) -> Stat."""
    if not samples:
        raise ValueError("no ranks in samples")
    per_mean = [mean(r) for r in samples]
    all_vals = [v for r in samples for v in r if not math.isnan(v)]
    return Stat(mean=_nanmax(per_mean), p50=_nanmax([percentile(r, 50) for r in samples]),
                p99=_nanmax([percentile(r, 99) for r in samples]),
                min=min(all_vals) if all_vals else math.nan, per_rank_mean=per_mean)
