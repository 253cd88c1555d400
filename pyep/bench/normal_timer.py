"""The timed calls of one normal-mode row (pyep/bench/normal.py's module docstring lists them): a wall
pass (CUDA events around each call, behind a barrier and Sync.align()), then a profiled pass whose
kernels kineto attributes to the phases, main kernels apart from the aux (notify/layout) ones."""
from __future__ import annotations

import logging
import math
from typing import Any, Callable, Dict, List, Optional, Tuple

from . import kineto
from .normal_check import GuardInputs
from .sync import Sync, timed_call

log = logging.getLogger("pyep.bench")

PHASES = ("layout", "dispatch", "cached_fp8", "cached_bf16", "combine", "eager")
# Kernels counted as a phase's main work (lower-case substrings of the kernel name); "aux" kernels
# (the count exchange before a dispatch, the layout kernel) are taken out first and kept apart
# whatever the phase, so the layout phase's main time is 0 and its time is its aux time.
MAIN_WORDS: Dict[str, Tuple[str, ...]] = {
    "layout": ("layout",), "dispatch": ("dispatch",), "cached_fp8": ("dispatch",),
    "cached_bf16": ("dispatch",), "combine": ("combine",), "eager": ("dispatch", "combine")}
AUX_WORDS = ("notify", "layout")
# Across nodes the call also runs the relay, the route/pack/reduce kernels and torch bookkeeping: all
# of it is the phase's main work but the count exchanges (the node's notify, the relay's counts).
INTERNODE_AUX_WORDS = AUX_WORDS + ("relay_counts",)
SAMPLE_KINDS = ("wall", "kernel", "aux", "host")
PROFILER_WARMUP = 2


class PhaseTimer:
    """The timed calls of one row (see the module docstring), wall pass then profiled pass."""

    def __init__(self, buf: Any, inp: GuardInputs, reuse: Dict[str, Any], sync: Sync, backend: str,
                 label: str, internode: bool = False) -> None:
        self.buf, self.inp, self.reuse, self.sync, self.label = buf, inp, reuse, sync, label
        self.native = backend == "native"
        self.internode = internode

    def _calls(self) -> Dict[str, Callable[[], Any]]:
        b, i, r = self.buf, self.inp, self.reuse
        counts, handle = r["counts"], r["handle"]

        def eager() -> Any:
            n_rank, n_rdma, n_exp, in_rank, _ = b.get_dispatch_layout(i.topk_idx, i.num_experts)
            recv, _idx, w, _cnt, h, _ev = b.dispatch(i.x_fp8, num_tokens_per_rank=n_rank,
                                                      num_tokens_per_rdma_rank=n_rdma, is_token_in_rank=in_rank,
                                                      num_tokens_per_expert=n_exp, topk_idx=i.topk_idx,
                                                      topk_weights=i.topk_weights)
            return b.combine(r["expert_out"], h, topk_weights=w)
        return {
            "layout": lambda: b.get_dispatch_layout(i.topk_idx, i.num_experts),
            "dispatch": lambda: b.dispatch(i.x_fp8, topk_idx=i.topk_idx, topk_weights=i.topk_weights, **counts),
            "cached_fp8": lambda: b.dispatch(i.x_fp8, handle=handle),
            "cached_bf16": lambda: b.dispatch(i.x, handle=handle),
            "combine": lambda: b.combine(r["expert_out"], handle),
            "eager": eager,
        }

    def _iteration(self, it: int, out: Optional[Dict[str, Dict[str, List[float]]]], ranged: bool) -> None:
        for phase, fn in self._calls().items():
            _result, wall_us, host_us = timed_call(self.sync, phase, it, self.label, fn, ranged)
            if out is not None:
                out["wall"][phase].append(wall_us)
                out["host"][phase].append(host_us)

    def run(self, warmup: int, iters: int, use_kineto: bool) -> Tuple[Dict[str, Dict[str, List[float]]], str, Dict[str, Any]]:
        for it in range(warmup):
            self._iteration(it, None, False)
        s: Dict[str, Dict[str, List[float]]] = {k: {p: [] for p in PHASES} for k in SAMPLE_KINDS}
        for it in range(iters):
            self._iteration(it, s, False)
        nan = [math.nan] * iters
        if not self.sync.cuda:
            s["kernel"] = {p: list(v) for p, v in s["wall"].items()}
            s["aux"] = {p: list(nan) for p in PHASES}
            return s, "wall (no GPU: kernel times are the wall times of the calls)", {}
        if not use_kineto:
            s["kernel"], s["aux"] = {p: list(nan) for p in PHASES}, {p: list(nan) for p in PHASES}
            return s, "none (--no-kineto)", {}
        prof = kineto.Profiler()
        with prof:
            for it in range(min(PROFILER_WARMUP, max(warmup, 1))):
                self._iteration(it, None, False)
            for it in range(iters):
                self._iteration(it, None, True)
        ranges, kernels = prof.collect()
        internode = self.native and self.internode
        aux_words = INTERNODE_AUX_WORDS if internode else AUX_WORDS
        words: Dict[str, Tuple[str, ...]] = {p: () for p in PHASES} if internode else dict(MAIN_WORDS)
        if self.native:
            aux = [k for k in kernels if any(w in k.name.lower() for w in aux_words)]
            main = [k for k in kernels if not any(w in k.name.lower() for w in aux_words)]
            att_main = kineto.attribute(ranges, main, words)
            att_aux = kineto.attribute(ranges, aux, {p: () for p in PHASES})
        else:
            # The reference's work is NCCL and torch kernels with generic names: count all of it.
            att_main = kineto.attribute(ranges, kernels, {p: () for p in PHASES})
            att_aux = kineto.attribute(ranges, [], {})
        s["kernel"] = {p: att_main.samples(p, iters) for p in PHASES}
        s["aux"] = {p: (att_aux.samples(p, iters) if att_aux.counted.get(p) else list(nan)) for p in PHASES}
        missing = [p for p in PHASES if p != "layout" and not att_main.counted.get(p)]
        if missing:
            log.warning("%s: kineto saw no main kernels in phases %s (other kernels: %s)", self.label, missing,
                        {p: sorted(att_main.ignored.get(p, {})) for p in missing})
            for p in missing:
                s["kernel"][p] = list(nan)
        info = {"counted": att_main.counted, "counted_us": att_main.counted_us, "aux_counted": att_aux.counted,
                "ignored": att_main.ignored,
                "unlinked_kernels": att_main.unlinked + att_aux.unlinked,
                "kernels_outside_ranges": att_main.outside, "main_words": words,
                "aux_words": aux_words}
        return s, "kineto", info


def gather_samples(s: Dict[str, Dict[str, List[float]]], iters: int, sync: Sync) -> Dict[str, Dict[str, List[List[float]]]]:
    """{kind: {phase: [rank][iteration]}} on every rank."""
    import torch
    t = torch.tensor([[s[k][p] if len(s[k][p]) == iters else [math.nan] * iters for p in PHASES]
                      for k in SAMPLE_KINDS], dtype=torch.float64)
    per_rank = sync.gather(t, "normal-mode benchmark samples")
    return {k: {p: [r[i, j].tolist() for r in per_rank] for j, p in enumerate(PHASES)}
            for i, k in enumerate(SAMPLE_KINDS)}
