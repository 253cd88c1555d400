"""The combine kernel's trace (engine/kernels/normal_trace.cuh; docs/normal_mode.md "Kernel trace"):
PYEP_NORMAL_TRACE=1 when a buffer is built makes its combines run the traced build of the kernel, which
writes, per block, its first and last clock reading and its warps' summed time waiting on peer counters,
moving rows and at barriers. The words of the last combine are read with
`NativeBackend.last_combine_trace()`; this module checks the setting and decodes and sums the words."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Dict, List, Sequence

ENV = "PYEP_NORMAL_TRACE"
TRACE_WORDS = 8                          # normal_launch.h kTraceWords
START, END, WAIT, WORK, SYNC, ITEMS, WARPS, ROLE = range(TRACE_WORDS)
ROLES = {1: "send", 2: "reduce"}         # normal_launch.h TraceRole (0: the block recorded nothing)
_U64 = (1 << 64) - 1


def trace_enabled() -> bool:
    """PYEP_NORMAL_TRACE: `0` (the default) or `1`, checked when a buffer is built; ValueError otherwise."""
    value = os.environ.get(ENV, "0")
    if value not in ("0", "1"):
        raise ValueError(f"{ENV} must be 0 (the default) or 1 (trace the combine kernel's blocks), got {value!r}")
    return value == "1"


@dataclass(frozen=True)
class BlockTrace:
    """One block of a traced combine. Times in ns (the GPU's global timer, common to every process on
    that GPU); wait / work / sync are summed over the block's warps."""
    block: int
    role: str
    start_ns: int
    end_ns: int
    wait_ns: int
    work_ns: int
    sync_ns: int
    items: int      # rows sent (send) or tokens reduced (reduce)
    warps: int

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns


def decode(words: Sequence[Sequence[int]], num_blocks: int) -> List[BlockTrace]:
    """The first num_blocks rows of the trace words (one row of TRACE_WORDS per block); blocks that
    recorded nothing (role 0: a sender block with one rank, a void call) are left out."""
    out: List[BlockTrace] = []
    for b in range(num_blocks):
        w = [int(v) for v in words[b]]
        if len(w) != TRACE_WORDS:
            raise ValueError(f"block {b}: {len(w)} trace words, expected {TRACE_WORDS}")
        role = ROLES.get(w[ROLE])
        if role is None:
            continue
        start = _U64 - (w[START] & _U64)   # stored complemented: the warps raise it with atomicMax
        out.append(BlockTrace(b, role, start, w[END], w[WAIT], w[WORK], w[SYNC], w[ITEMS], w[WARPS]))
    return out


def summarize(blocks: Sequence[BlockTrace]) -> Dict[str, Dict[str, float]]:
    """Per role: blocks, mean and longest block time (us), items, and the shares of the warps' time
    spent waiting on peer counters, moving rows and at barriers (each over their sum)."""
    out: Dict[str, Dict[str, float]] = {}
    for role in ROLES.values():
        bs = [b for b in blocks if b.role == role]
        if not bs:
            continue
        spent = sum(b.wait_ns + b.work_ns + b.sync_ns for b in bs) or 1
        out[role] = {
            "blocks": float(len(bs)),
            "mean_us": sum(b.duration_ns for b in bs) / len(bs) / 1e3,
            "max_us": max(b.duration_ns for b in bs) / 1e3,
            "items": float(sum(b.items for b in bs)),
            "wait": sum(b.wait_ns for b in bs) / spent,
            "work": sum(b.work_ns for b in bs) / spent,
            "sync": sum(b.sync_ns for b in bs) / spent,
        }
    return out
