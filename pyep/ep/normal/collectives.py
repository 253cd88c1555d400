"""The host collectives of the normal mode (node detection, backend selection, the reference backend,
set-up and clean() barriers): pyep.ep._dist's bounded collectives, plus a wait until gloo's worker
thread has let go of the tensors.

Why: gloo runs a collective on its own worker thread (``pt_gloo_runloop``), which keeps the work --
and with it the call's tensors -- until after it woke the waiter. If Python drops its last reference
to such a tensor first (a local of a function that returned), the tensor's Python object stays alive,
owned by the C++ work, and the worker destroys it later, taking the GIL to do so. When that happens
while the interpreter is shutting down (a script that ends right after its last call), taking the GIL
ends the worker thread with pthread_exit inside a noexcept C++ frame: ``terminate called without an
active exception`` and SIGABRT (the README's two-modes example did so in 2-4 of 10 runs under load).
Holding the tensors until the worker released them means the worker never destroys a Python object.
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, List, Optional, Sequence

from .._dist import _wait, all_reduce_min_bounded, all_to_all_bounded, group_ranks

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

log = logging.getLogger("pyep.ep.normal.collectives")
RELEASE_BOUND_S = 2.0   # the worker lets go microseconds after the wait returns; a bound, not a timeout


def _use_counts(tensors: Sequence["torch.Tensor"]) -> List[int]:
    return [int(t._use_count()) for t in tensors]


def _is_gloo(group: "dist.ProcessGroup") -> bool:
    import torch.distributed as dist
    return "gloo" in str(dist.get_backend(group)).lower()


def wait_released(group: "dist.ProcessGroup", tensors: Sequence["torch.Tensor"], before: Optional[List[int]]) -> None:
    """Return once gloo's worker holds none of `tensors` (their use counts are back at `before`, taken
    before the collective). Bounded; past the bound nothing worse than the old exit race can happen,
    so it only logs. Not gloo (NCCL keeps its own references): nothing to wait for."""
    if before is None:
        return
    deadline = time.monotonic() + RELEASE_BOUND_S
    pause = 0.0
    while any(now > was for now, was in zip(_use_counts(tensors), before)):
        if time.monotonic() > deadline:
            log.debug("gloo's worker still holds a collective's tensors after %.1f s", RELEASE_BOUND_S)
            return
        time.sleep(pause)
        pause = min(1e-3, pause * 2 + 1e-5)


def _before(group: "dist.ProcessGroup", tensors: Sequence["torch.Tensor"]) -> Optional[List[int]]:
    return _use_counts(tensors) if _is_gloo(group) else None


def all_to_all(out: "torch.Tensor", inp: "torch.Tensor", out_splits: Optional[List[int]],
               in_splits: Optional[List[int]], group: "dist.ProcessGroup", timeout_us: int, what: str) -> None:
    before = _before(group, (out, inp))
    all_to_all_bounded(out, inp, out_splits, in_splits, group, timeout_us, what)
    wait_released(group, (out, inp), before)


def all_reduce_min(t: "torch.Tensor", group: "dist.ProcessGroup", timeout_us: int, what: str) -> None:
    before = _before(group, (t,))
    all_reduce_min_bounded(t, group, timeout_us, what)
    wait_released(group, (t,), before)


def barrier(group: "dist.ProcessGroup", device: "torch.device", timeout_us: int, what: str) -> None:
    """A bounded barrier (an all-reduce: dist.barrier on NCCL guesses a device and cannot be bounded)."""
    import torch
    all_reduce_min(torch.ones(1, dtype=torch.int32, device=device), group, timeout_us, what)


def all_gather(outs: List["torch.Tensor"], mine: "torch.Tensor", group: "dist.ProcessGroup", timeout_us: int,
               what: str) -> None:
    import torch.distributed as dist
    held = [*outs, mine]
    before = _before(group, held)
    _wait(dist.all_gather(outs, mine, group=group, async_op=True), timeout_us, what, group_ranks(group))
    wait_released(group, held, before)
