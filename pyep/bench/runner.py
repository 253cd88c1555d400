"""The timing loops of one benchmark case (one buffer, one routing, one T).

Every iteration runs, each phase behind a barrier and Sync.align() (GPU: L2 flush, a GEMM, an
all-reduce, so all GPUs start the call together) and followed by a device wait:
  dispatch | combine | dispatch+combine (one timed call pair) | with the recv hook: dispatch send,
  dispatch receive (the hook), combine send, combine receive (the hook).
Pass 1 (warmup, then `iters` iterations) takes wall times; on GPU, pass 2 repeats the iterations
under torch.profiler and takes per-kernel times. Profiling adds host overhead, which is why wall times
come from the unprofiled pass.
The eager pass (between them) runs dispatch+combine pairs back to back on one stream with default
arguments, as a user's loop does, CUDA events around each pair (what DeepEP's bench() does): the host
keeps the GPU busy only if a call costs less host time than its kernels.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence

from . import kineto
from .routing import RoutedBatch
from .sync import Sync, timed_call

if TYPE_CHECKING:
    import torch

log = logging.getLogger("pyep.bench")

METRICS = ("dispatch", "combine", "dc", "d_send", "d_recv", "c_send", "c_recv")
# The eager pass: the pair's stream time, and the host time of each call in it.
EAGER_METRICS = ("pair", "host_dispatch", "host_combine")
HOOK_METRICS = ("d_send", "d_recv", "c_send", "c_recv")
# Which kernels are the native backend's work in each phase (kernel names carry these words).
NATIVE_KEYWORDS: Dict[str, Sequence[str]] = {
    "dispatch": ("dispatch",), "d_send": ("dispatch",), "d_recv": ("dispatch",),
    "combine": ("combine",), "c_send": ("combine",), "c_recv": ("combine",),
    "dc": ("dispatch", "combine"),
}
# Extra unranged iterations at the start of the profiled pass: the profiler's own start-up cost
# (CUPTI buffers, first callbacks) lands there instead of in a measured iteration.
PROFILER_WARMUP = 2


@dataclass
class CaseSamples:
    """This rank's per-iteration microseconds per metric (NaN where not measured)."""
    wall: Dict[str, List[float]]
    kernel: Dict[str, List[float]]
    kernel_source: str
    kineto: Dict[str, Any] = field(default_factory=dict)
    # Host time inside the call (Python front end, checks, allocations, launches): what an eager-mode
    # caller pays on the CPU per call; hidden behind GPU work when the host runs ahead.
    host: Dict[str, List[float]] = field(default_factory=dict)
    # The eager pass (EAGER_METRICS), empty when it did not run.
    eager: Dict[str, List[float]] = field(default_factory=dict)


class CaseRunner:
    def __init__(self, buf: Any, batch: RoutedBatch, expert_out: "torch.Tensor", *, use_fp8: bool,
                 hook: bool, sync: Sync, keywords: Dict[str, Sequence[str]], label: str,
                 eager: bool = True) -> None:
        self.eager = eager
        self.buf = buf
        self.batch = batch
        self.expert_out = expert_out
        self.use_fp8 = use_fp8
        self.hook = hook
        self.sync = sync
        self.keywords = keywords
        self.label = label

    # ------------------------------------------------------------------ calls
    def _dispatch(self, recv_hook: bool) -> Any:
        return self.buf.dispatch(self.batch.x, self.batch.topk_idx, use_fp8=self.use_fp8,
                                 return_recv_hook=recv_hook)

    def _combine(self, handle: Any, recv_hook: bool) -> Any:
        return self.buf.combine(self.expert_out, self.batch.topk_idx, self.batch.topk_weights, handle,
                                return_recv_hook=recv_hook)

    def _dispatch_combine(self) -> Any:
        _recv, _count, handle, _ev, _hook = self._dispatch(False)
        return self._combine(handle, False)

    def _step(self, phase: str, it: int, fn: Callable[[], Any], samples: Optional[Dict[str, List[float]]],
              ranged: bool, host: Optional[Dict[str, List[float]]] = None) -> Any:
        result, wall_us, host_us = timed_call(self.sync, phase, it, self.label, fn, ranged)
        if samples is not None:
            samples[phase].append(wall_us)
        if host is not None:
            host[phase].append(host_us)
        return result

    def iteration(self, it: int, samples: Optional[Dict[str, List[float]]], ranged: bool,
                  host: Optional[Dict[str, List[float]]] = None) -> None:
        def step(phase: str, it: int, fn: Callable[[], Any], samples: Optional[Dict[str, List[float]]],
                 ranged: bool) -> Any:
            return self._step(phase, it, fn, samples, ranged, host)
        _r, _c, handle, _e, _h = step("dispatch", it, lambda: self._dispatch(False), samples, ranged)
        step("combine", it, lambda: self._combine(handle, False), samples, ranged)
        step("dc", it, self._dispatch_combine, samples, ranged)
        if not self.hook:
            return
        _r, _c, handle, _e, d_hook = step("d_send", it, lambda: self._dispatch(True), samples, ranged)
        step("d_recv", it, d_hook, samples, ranged)
        _out, _e, c_hook = step("c_send", it, lambda: self._combine(handle, True), samples, ranged)
        step("c_recv", it, c_hook, samples, ranged)

    def eager_pass(self, warmup: int, iters: int) -> Dict[str, List[float]]:
        """`iters` dispatch+combine pairs back to back on the current stream, default arguments (the
        dispatch dtype aside), no barrier or device wait between pairs: CUDA events around each pair
        (perf_counter on CPU) and the host time of each call. One barrier and alignment before the
        measured pairs, so all ranks start together; from then on the kernels pace the loop."""
        import torch
        x, idx, w, y, fp8 = self.batch.x, self.batch.topk_idx, self.batch.topk_weights, self.expert_out, self.use_fp8
        buf, cuda = self.buf, self.sync.cuda

        def pair() -> None:
            _r, _c, handle, _e, _h = buf.dispatch(x, idx, use_fp8=fp8)
            buf.combine(y, idx, w, handle)
        self.sync.barrier(f"before the eager warmup of {self.label}")
        for _ in range(warmup):
            pair()
        self.sync.device_wait(f"eager warmup of {self.label}")
        self.sync.barrier(f"before the eager pass of {self.label}")
        self.sync.align()
        out: Dict[str, List[float]] = {m: [] for m in EAGER_METRICS}
        events = []
        perf = time.perf_counter
        for _ in range(iters):
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            t0 = perf()
            _r, _c, handle, _e, _h = buf.dispatch(x, idx, use_fp8=fp8)
            t1 = perf()
            buf.combine(y, idx, w, handle)
            t2 = perf()
            if cuda:
                end.record()
                events.append((start, end))
            else:
                out["pair"].append((t2 - t0) * 1e6)
            out["host_dispatch"].append((t1 - t0) * 1e6)
            out["host_combine"].append((t2 - t1) * 1e6)
        self.sync.device_wait(f"eager pass of {self.label}")
        if cuda:
            out["pair"] = [float(s.elapsed_time(e)) * 1000.0 for s, e in events]
        return out

    # ------------------------------------------------------------------ passes
    def run(self, warmup: int, iters: int, use_kineto: bool) -> CaseSamples:
        for it in range(warmup):
            self.iteration(it, None, False)
        wall: Dict[str, List[float]] = {m: [] for m in METRICS}
        host: Dict[str, List[float]] = {m: [] for m in METRICS}
        for it in range(iters):
            self.iteration(it, wall, False, host)
        wall, host = _pad(wall, iters), _pad(host, iters)
        eager = _pad(self.eager_pass(warmup, iters), iters) if self.eager else {}
        if not self.sync.cuda:
            return CaseSamples(wall, {m: list(v) for m, v in wall.items()},
                               "wall (no GPU: kineto has no device kernels on CPU, so kernel times "
                               "are the wall times of the calls)", host=host, eager=eager)
        if not use_kineto:
            return CaseSamples(wall, {m: [math.nan] * iters for m in METRICS}, "none (--no-kineto)", host=host,
                               eager=eager)
        prof = kineto.Profiler()
        with prof:
            for it in range(min(PROFILER_WARMUP, max(warmup, 1))):
                self.iteration(it, None, False)
            for it in range(iters):
                self.iteration(it, None, True)
        phases = [m for m in METRICS if self.hook or m not in HOOK_METRICS]
        att = prof.attribute(self.keywords)
        fallback = [p for p in kineto.phases_without_kernels(att, phases) if att.ignored.get(p)]
        if fallback:
            # Better a flagged number than none: count every kernel of those phases and say so.
            log.warning("%s: no kernel named %s in phases %s (saw %s); counting all their kernels",
                        self.label, {p: list(self.keywords.get(p, ())) for p in fallback}, fallback,
                        {p: sorted(att.ignored[p]) for p in fallback})
            att = prof.attribute({p: (() if p in fallback else self.keywords.get(p, ())) for p in METRICS})
        kernel = {m: (att.samples(m, iters) if m in phases else [math.nan] * iters) for m in METRICS}
        info = {"counted": att.counted, "ignored": att.ignored, "unlinked_kernels": att.unlinked,
                "kernels_outside_ranges": att.outside, "name_filter": {p: list(self.keywords.get(p, ()))
                                                                         for p in phases},
                "name_filter_fallback": fallback}
        missing = kineto.phases_without_kernels(att, phases)
        if missing:
            log.warning("%s: kineto saw no device kernels in phases %s", self.label, missing)
            for p in missing:
                kernel[p] = [math.nan] * iters
        return CaseSamples(wall, kernel, "kineto", info, host=host, eager=eager)


def _pad(samples: Dict[str, List[float]], iters: int) -> Dict[str, List[float]]:
    return {m: (v if len(v) == iters else [math.nan] * iters) for m, v in samples.items()}


def gather_samples(samples: CaseSamples, iters: int, sync: Sync) -> Dict[str, Dict[str, List[List[float]]]]:
    """{"wall"|"kernel"|"host": {metric: [rank][iteration]}, "eager": {EAGER_METRICS: ...}} on every
    rank ("eager" only where the eager pass ran; every rank runs it or none)."""
    import torch
    host = samples.host or {m: [math.nan] * iters for m in METRICS}
    t = torch.tensor([[samples.wall[m] for m in METRICS], [samples.kernel[m] for m in METRICS],
                      [host[m] for m in METRICS]], dtype=torch.float64)
    assert t.shape == (3, len(METRICS), iters)
    per_rank = sync.gather(t, "benchmark samples")
    out = {kind: {m: [r[i, j].tolist() for r in per_rank] for j, m in enumerate(METRICS)}
           for i, kind in enumerate(("wall", "kernel", "host"))}
    if samples.eager:
        e = torch.tensor([samples.eager[m] for m in EAGER_METRICS], dtype=torch.float64)
        assert e.shape == (len(EAGER_METRICS), iters)
        per_rank_e = sync.gather(e, "eager samples")
        out["eager"] = {m: [r[j].tolist() for r in per_rank_e] for j, m in enumerate(EAGER_METRICS)}
    return out
