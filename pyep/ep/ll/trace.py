"""Per-block timelines of the native LL kernels (diagnostics).

With PYEP_LL_TRACE=1 in the environment when the native backend is built, thread 0 of every block
stamps the GPU's %globaltimer (ns) at fixed points of the dispatch and combine kernels
(engine/kernels/ll_launch.h: TracePoint). `NativeBackend.read_trace()` returns the latest call's
stamps; `summarize()` turns them into "how long after the earliest block started did the blocks
reach each point" -- the view that shows whether time goes to routing, issuing stores, draining
them (the system fence), waiting for peers or copying out. tools/ll_trace.py runs it end to end.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

# Slot order (ll_launch.h TracePoint); the late additions are listed where they happen in time by
# TIME_ORDER.
POINTS = ("send_begin", "send_routed", "send_issued", "send_fenced", "send_done",
          "recv_begin", "recv_ready", "recv_copied", "recv_done", "send_signaled", "recv_planned",
          "recv_reduced")
TIME_ORDER = ("send_begin", "send_routed", "send_issued", "send_fenced", "send_signaled", "send_done",
              "recv_begin", "recv_ready", "recv_planned", "recv_reduced", "recv_copied",
              "recv_done")
KERNELS = ("dispatch", "combine")
ENV_VAR = "PYEP_LL_TRACE"


@dataclass(frozen=True)
class PointStat:
    point: str
    blocks: int          # blocks that stamped it
    first_us: float      # earliest block, relative to the earliest send_begin (or recv_begin)
    median_us: float
    last_us: float


def _median(v: Sequence[float]) -> float:
    s = sorted(v)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def first_stamp(stamps: Sequence[Sequence[int]]) -> int:
    """The earliest stamp of a call (ns), 0 when no block stamped anything."""
    return min((t for row in stamps for t in row[:len(POINTS)] if t), default=0)


def summarize(stamps: Sequence[Sequence[int]], t0: Optional[int] = None) -> List[PointStat]:
    """stamps[block][slot] in ns (0 = not reached in this call) -> one PointStat per reached point,
    times relative to `t0`: by default the earliest stamp of the call. Ranks that share a GPU read one
    %globaltimer, so passing the earliest stamp over all of them puts every rank on one clock (GPUs'
    timers are not aligned with each other: across GPUs only the default is meaningful)."""
    if not first_stamp(stamps):
        return []
    if t0 is None:
        t0 = first_stamp(stamps)
    out = []
    for name in TIME_ORDER:
        i = POINTS.index(name)
        vals = [(row[i] - t0) / 1e3 for row in stamps if i < len(row) and row[i]]
        if vals:
            out.append(PointStat(name, len(vals), min(vals), _median(vals), max(vals)))
    return out


def mean_stats(calls: Sequence[List[PointStat]]) -> List[PointStat]:
    """Average PointStats of several calls point by point (points every call reached)."""
    if not calls:
        return []
    names = [p.point for p in calls[0] if all(any(q.point == p.point for q in c) for c in calls)]
    out = []
    for name in names:
        rows = [next(q for q in c if q.point == name) for c in calls]
        n = len(rows)
        out.append(PointStat(name, min(r.blocks for r in rows), sum(r.first_us for r in rows) / n,
                             sum(r.median_us for r in rows) / n, sum(r.last_us for r in rows) / n))
    return out


def format_table(title: str, stats: Sequence[PointStat]) -> str:
    lines = [title, f"  {'point':<12} {'blocks':>6} {'first us':>9} {'median us':>10} {'last us':>9}"]
    for p in stats:
        lines.append(f"  {p.point:<12} {p.blocks:>6} {p.first_us:>9.1f} {p.median_us:>10.1f} {p.last_us:>9.1f}")
    return "\n".join(lines)


def one_clock_summary(per_rank: Sequence[Sequence[PointStat]]) -> str:
    """One line for a kernel's timelines of all ranks on one clock (summarize with a common t0): the
    ranks' start skew, when the last rank's last block had fenced (its flags go out right after), and
    when every rank's median block had seen all flags -- the gap is a flag's way from store to poll."""
    def at(stats: Sequence[PointStat], name: str) -> Optional[PointStat]:
        return next((p for p in stats if p.point == name), None)
    starts = [p.first_us for p in (at(r, "send_begin") for r in per_rank) if p]
    fenced = [p.last_us for p in (at(r, "send_fenced") for r in per_rank) if p]
    ready = [p.median_us for p in (at(r, "recv_ready") for r in per_rank) if p]
    parts = []
    if len(starts) == len(per_rank) and starts:
        parts.append(f"start skew {max(starts) - min(starts):.1f} us")
    if fenced and ready and len(ready) == len(per_rank):
        parts.append(f"last flags after {max(fenced):.1f} us, every rank ready by {max(ready):.1f} us "
                     f"(+{max(ready) - max(fenced):.1f})")
    return "; ".join(parts)


def split_kernels(raw: Sequence[Sequence[Sequence[int]]]) -> Dict[str, Sequence[Sequence[int]]]:
    """raw[kernel][block][slot] (NativeBackend's trace tensor as lists) -> {"dispatch": ..., "combine": ...}."""
    return {name: raw[i] for i, name in enumerate(KERNELS)}
