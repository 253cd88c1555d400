"""Per-kernel GPU time from torch.profiler (kineto), attributed to benchmark phases and iterations.

The benchmark wraps every timed call in a range named `pyep_bench::<phase>::<iteration>`. A GPU
kernel belongs to the range in which the host launched it: kineto links each kernel to the host-side
operator that launched it (linked correlation id), and that operator's start time lies inside exactly
one range. A kernel without such a link falls back to its own start time, which lies after its
launch and -- because every iteration ends with a device wait -- before the next range begins.

Which kernels count is a name filter per phase (native: kernels whose name contains "dispatch" or
"combine"); an empty filter counts every device activity of the phase (the reference backend, whose
work is NCCL and torch kernels with generic names).
"""
from __future__ import annotations

import bisect
import logging
import math
import re
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

log = logging.getLogger("pyep.bench")

RANGE_PREFIX = "pyep_bench::"
# Our record_function labels ("pyep::dispatch", "pyep::native::combine_recv", benchmark ranges) come
# back on the device timeline as gpu_user_annotation spans. A label has no spaces or parentheses; a
# kernel's demangled name does (a non-template kernel such as "pyep::ll::(anonymous
# namespace)::combine(...)" starts with "pyep::" too, and must not be dropped).
_ANNOTATION_LABEL = re.compile(r"pyep(_bench)?::[A-Za-z0-9_:]+")
_OPERATOR_ACTIVITIES = ("cpu_op", "user_annotation")


def range_name(phase: str, iteration: int) -> str:
    return f"{RANGE_PREFIX}{phase}::{iteration}"


def parse_range_name(name: str) -> Optional[Tuple[str, int]]:
    if not name.startswith(RANGE_PREFIX):
        return None
    phase, sep, it = name[len(RANGE_PREFIX):].rpartition("::")
    if not sep or not it.isdigit():
        return None
    return phase, int(it)


@dataclass(frozen=True)
class Range:
    phase: str
    iteration: int
    start_us: float
    end_us: float


@dataclass(frozen=True)
class Kernel:
    name: str
    start_us: float
    duration_us: float
    launch_start_us: Optional[float]   # host start time of the launching operator, if linked


@dataclass
class Attribution:
    """Kernel time per (phase, iteration), plus what was seen, for the JSON and for debugging."""
    kernel_us: Dict[Tuple[str, int], float] = field(default_factory=dict)
    counted: Dict[str, Dict[str, int]] = field(default_factory=dict)    # phase -> name -> launches
    ignored: Dict[str, Dict[str, int]] = field(default_factory=dict)    # filtered out by name
    counted_us: Dict[str, Dict[str, float]] = field(default_factory=dict)   # phase -> name -> GPU us, summed
    unlinked: int = 0          # kernels placed by their own start time
    outside: int = 0           # kernels in no benchmark range (barriers, warmup)

    def samples(self, phase: str, iterations: int) -> List[float]:
        return [self.kernel_us.get((phase, i), math.nan) for i in range(iterations)]


def _matches(name: str, keywords: Sequence[str]) -> bool:
    low = name.lower()
    return not keywords or any(k in low for k in keywords)


def attribute(ranges: Sequence[Range], kernels: Iterable[Kernel],
              keywords: Dict[str, Sequence[str]]) -> Attribution:
    """Assigns kernels to ranges and sums the durations of those passing the phase's name filter.
    keywords: phase -> lower-case substrings (empty: count everything)."""
    ordered = sorted(ranges, key=lambda r: r.start_us)
    starts = [r.start_us for r in ordered]
    att = Attribution()
    for r in ordered:   # a range with no counted kernel measured 0 us only if it ran nothing
        att.kernel_us.setdefault((r.phase, r.iteration), 0.0)
    for k in kernels:
        t = k.launch_start_us if k.launch_start_us is not None else k.start_us
        if k.launch_start_us is None:
            att.unlinked += 1
        i = bisect.bisect_right(starts, t) - 1
        if i < 0:
            att.outside += 1
            continue
        r = ordered[i]
        # A linked launch must lie inside its range; an unlinked kernel may run past the range's end
        # (the host returned before the GPU finished) but starts before the next range does.
        if k.launch_start_us is not None and t > r.end_us:
            att.outside += 1
            continue
        book = att.counted if _matches(k.name, keywords.get(r.phase, ())) else att.ignored
        names = book.setdefault(r.phase, {})
        names[k.name] = names.get(k.name, 0) + 1
        if book is att.counted:
            att.kernel_us[(r.phase, r.iteration)] += k.duration_us
            by_name = att.counted_us.setdefault(r.phase, {})
            by_name[k.name] = by_name.get(k.name, 0.0) + k.duration_us
    return att


def phases_without_kernels(att: Attribution, phases: Iterable[str]) -> List[str]:
    return [p for p in phases if not att.counted.get(p)]


def _device_type_name(evt: Any) -> str:
    return str(getattr(evt, "device_type", "")).rsplit(".", 1)[-1].upper()


def collect(prof: Any) -> Tuple[List[Range], List[Kernel]]:
    """Benchmark ranges and device activities (kernels, memcpy, memset) of a finished profiler."""
    events = list(prof.events())
    ranges: List[Range] = []
    frontend: Dict[int, float] = {}
    device: List[Any] = []
    for e in events:
        kind = _device_type_name(e)
        if kind == "CPU":
            parsed = parse_range_name(e.name)
            if parsed is not None:
                ranges.append(Range(parsed[0], parsed[1], e.time_range.start, e.time_range.end))
            # Operators (record_function ranges included) have no link themselves; runtime calls
            # such as cudaLaunchKernel link to the operator they ran in, and their ids live in
            # CUPTI's numbering, so only operators enter the map.
            activity = str(getattr(e, "activity_type", "") or "")
            if (getattr(e, "linked_correlation_id", 0) == 0 and not getattr(e, "is_async", False)
                    and (not activity or activity in _OPERATOR_ACTIVITIES)):
                frontend.setdefault(int(e.id), e.time_range.start)
        elif kind in ("CUDA", "PRIVATEUSE1"):
            # gpu_user_annotation spans mirror our own ranges on the device timeline: not work.
            if (getattr(e, "is_user_annotation", False) or _ANNOTATION_LABEL.fullmatch(e.name)
                    or "user_annotation" in str(getattr(e, "activity_type", "")).lower()):
                continue
            device.append(e)
    kernels = []
    for e in device:
        link = int(getattr(e, "linked_correlation_id", 0) or 0)
        kernels.append(Kernel(e.name, e.time_range.start, e.time_range.end - e.time_range.start,
                              frontend.get(link) if link else None))
    return ranges, kernels


class Profiler:
    """torch.profiler over CPU + CUDA, with the benchmark's range helper."""

    def __init__(self) -> None:
        import torch
        self._prof = torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA],
            record_shapes=False, with_stack=False)

    def __enter__(self) -> "Profiler":
        self._prof.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._prof.__exit__(*exc)

    def collect(self) -> Tuple[List[Range], List[Kernel]]:
        """The ranges and device activities, for callers that split kernels before attributing them."""
        return collect(self._prof)

    def attribute(self, keywords: Dict[str, Sequence[str]]) -> Attribution:
        ranges, kernels = self.collect()
        log.debug("kineto: %d ranges, %d device activities", len(ranges), len(kernels))
        return attribute(ranges, kernels, keywords)
