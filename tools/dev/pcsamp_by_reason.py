#!/usr/bin/env python3
"""Warp-stall samples of one kernel by reason and by SASS instruction, from an Nsight Compute report.

    NCU_ARGS="-k regex:combine --launch-skip 8 --launch-count 1 \\
              --metrics group:smsp__pcsamp_warp_stall_reasons --warp-sampling-interval 0 -f -o /tmp/c" \\
    torchrun --standalone --nproc-per-node 2 --no-python bash tools/dev/ncu_rank0.sh \\
        tools/ll_trace.py --tokens 32 --iters 6
    python3 tools/dev/pcsamp_by_reason.py /tmp/c.ncu-rep --from-slot 6 --to-slot 11

`ncu --page source` prints only the group's total a PC; the report holds one instanced metric a reason
(smsp__pcsamp_warps_issue_stalled_<reason>, instances keyed by PC), read here through the ncu_report
module that ships with Nsight Compute. --from-slot / --to-slot narrow the sums to the code between two
LL trace points (ll_launch.h TracePoint: the SASS stores of %globaltimer at byte offset 8 x slot), e.g.
6 and 11, recv_ready to recv_reduced. Build with PYEP_LL_TRACE=1 for those stores to exist (ll_trace.py
does). Note that ncu flushes the caches before the kernel by default (--cache-control all): instruction
fetch stalls (no_instructions) are larger there than in a run without the profiler.
"""
from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import sys
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

PREFIX = "smsp__pcsamp_warps_issue_stalled_"


@dataclass(frozen=True)
class Sample:
    reason: str    # e.g. "long_scoreboard"
    pc: int
    count: int
    sass: str


def trace_store_pcs(samples: Iterable[Sample], slot: int) -> List[int]:
    """PCs of the SASS stores that write trace slot `slot` (STG.E.64 [R.64+8*slot])."""
    pat = re.compile(r"STG\.E\.64 .*\+0x%x\]" % (8 * slot))
    return sorted({s.pc for s in samples if pat.search(s.sass)})


def by_reason(samples: Iterable[Sample], lo: Optional[int] = None, hi: Optional[int] = None) -> Counter:
    """Samples summed by reason, over PCs in [lo, hi] when given."""
    out: Counter = Counter()
    for s in samples:
        if (lo is None or s.pc >= lo) and (hi is None or s.pc <= hi):
            out[s.reason] += s.count
    return out


def by_pc(samples: Iterable[Sample], lo: Optional[int] = None,
          hi: Optional[int] = None) -> Dict[int, Tuple[str, Counter]]:
    """{pc: (sass, samples by reason)} over PCs in [lo, hi] when given."""
    out: Dict[int, Tuple[str, Counter]] = {}
    acc: Dict[int, Counter] = defaultdict(Counter)
    text: Dict[int, str] = {}
    for s in samples:
        if (lo is None or s.pc >= lo) and (hi is None or s.pc <= hi):
            acc[s.pc][s.reason] += s.count
            text[s.pc] = s.sass
    for pc in sorted(acc):
        out[pc] = (text[pc], acc[pc])
    return out


def _ncu_report_module():
    ncu = shutil.which("ncu")
    if ncu is None:
        raise SystemExit("ncu is not on PATH: this reads the report through Nsight Compute's python module")
    root = os.path.dirname(os.path.dirname(os.path.realpath(ncu)))
    dirs = glob.glob(os.path.join(root, "**", "extras", "python"), recursive=True) + \
        glob.glob("/opt/nvidia/nsight-compute/*/extras/python")
    if not dirs:
        raise SystemExit(f"no extras/python (ncu_report) under {root} or /opt/nvidia/nsight-compute")
    sys.path.insert(0, dirs[0])
    import ncu_report  # noqa: E402  (only where Nsight Compute is installed)
    return ncu_report


def read_samples(path: str) -> Dict[str, List[Sample]]:
    """{kernel name: samples} of every profiled kernel in the report (the not_issued variants left out)."""
    ncu_report = _ncu_report_module()
    ctx = ncu_report.load_report(path)
    out: Dict[str, List[Sample]] = {}
    for r in range(ctx.num_ranges()):
        rng = ctx.range_by_idx(r)
        for a in range(rng.num_actions()):
            act = rng.action_by_idx(a)
            samples: List[Sample] = []
            for name in act.metric_names():
                if not name.startswith(PREFIX) or name.endswith("_not_issued"):
                    continue
                m = act.metric_by_name(name)
                n = m.num_instances()
                if not n or not m.has_correlation_ids():
                    continue
                pcs = m.correlation_ids()
                for i in range(n):
                    count = int(m.as_uint64(i))
                    if count:
                        pc = int(pcs.as_uint64(i))
                        samples.append(Sample(name[len(PREFIX):], pc, count, act.sass_by_pc(pc)))
            out[f"{act.name()} #{r}.{a}"] = samples
    return out


def _line(counts: Counter, top: int) -> str:
    total = sum(counts.values())
    parts = ", ".join(f"{k} {v} ({100.0 * v / total:.0f} %)" for k, v in counts.most_common(top)) if total else "-"
    return f"{total} samples: {parts}"


def main(argv: Sequence[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("report")
    ap.add_argument("--from-slot", type=int, help="trace slot whose store opens the range")
    ap.add_argument("--to-slot", type=int, help="trace slot whose store closes the range")
    ap.add_argument("--min-samples", type=int, default=40, help="PCs listed: at least this many samples")
    args = ap.parse_args(argv)
    for kernel, samples in read_samples(args.report).items():
        base = min((s.pc for s in samples), default=0)
        print(f"{kernel}\n  whole kernel: {_line(by_reason(samples), 8)}")
        lo = hi = None
        if args.from_slot is not None and args.to_slot is not None:
            los, his = trace_store_pcs(samples, args.from_slot), trace_store_pcs(samples, args.to_slot)
            if not los or not his:
                print(f"  no trace store of slot {args.from_slot if not los else args.to_slot} among the sampled PCs")
                continue
            lo, hi = min(los), max(his)
            print(f"  slots {args.from_slot}..{args.to_slot} (+{lo - base:#x}..+{hi - base:#x}): "
                  f"{_line(by_reason(samples, lo, hi), 10)}")
        for pc, (sass, counts) in by_pc(samples, lo, hi).items():
            if sum(counts.values()) >= args.min_samples:
                top = ", ".join(f"{k} {v}" for k, v in counts.most_common(3))
                print(f"  +{pc - base:#7x} {sum(counts.values()):6d}  {top:<48} {sass.strip()[:64]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
