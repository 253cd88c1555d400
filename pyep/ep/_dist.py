"""torch.distributed helpers shared by the EP front and the reference backends of both modes: which device
a group communicates on, and collectives whose host wait is bounded and names what it waited for.

Every collective here also returns only once gloo's worker thread has let go of its tensors. Gloo runs
a collective on its own thread (``pt_gloo_runloop``), which keeps the work -- and with it the tensors --
until after it woke the waiter. If Python drops its last reference to such a tensor first (a local of
a function that returned), the worker destroys the tensor's Python object later, taking the GIL to do
so; when that happens while the interpreter shuts down (a script that ends right after its last call),
taking the GIL ends the worker thread inside a noexcept C++ frame: ``terminate called without an active
exception`` and SIGABRT (the README's two-modes example did so in 2-4 of 10 runs under load). Holding the
tensors until the worker released them means it never destroys a Python object."""
from __future__ import annotations

import datetime
import logging
import time
from typing import TYPE_CHECKING, Callable, List, Optional, Sequence

MAX_GATHER_BYTES = 1 << 20   # all_gather_bytes refuses more (set-up data, never payload)
RELEASE_BOUND_S = 2.0        # gloo lets go microseconds after the wait returns; a bound, not a timeout
log = logging.getLogger("pyep.ep.dist")

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist


def resolve_group(group: Optional["dist.ProcessGroup"]) -> "dist.ProcessGroup":
    import torch.distributed as dist
    if not dist.is_available():
        raise RuntimeError("torch.distributed is not available in this torch build")
    if group is None:
        if not dist.is_initialized():
            raise RuntimeError("EpBuffer(group=None) needs the default process group: call "
                               "torch.distributed.init_process_group() first or pass group=")
        return dist.group.WORLD
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed.ProcessGroup or None, got "
                        f"{type(group).__name__}")
    return group


def group_device(group: "dist.ProcessGroup") -> "torch.device":
    """The device a group's collectives take tensors on: the current CUDA device for NCCL, else CPU."""
    import torch
    import torch.distributed as dist
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def group_ranks(group: "dist.ProcessGroup") -> List[int]:
    import torch.distributed as dist
    return list(range(dist.get_world_size(group)))


def _wait(work: "dist.Work", timeout_us: int, what: str, ranks: Sequence[int], *,
          any_error_is_timeout: bool = False) -> None:
    """Bounded wait for a collective. `any_error_is_timeout`: a set-up exchange treats every backend
    error (gloo's "connection closed" from a rank that died) as those ranks not answering."""
    try:
        ok = work.wait(timeout=datetime.timedelta(microseconds=timeout_us))
    except RuntimeError as exc:
        if any_error_is_timeout or "timed out" in str(exc).lower() or "timeout" in str(exc).lower():
            raise TimeoutError(f"{what}: ranks {list(ranks)} did not all take part within "
                               f"{timeout_us} us ({exc})") from exc
        raise
    if ok is False:
        raise TimeoutError(f"{what}: ranks {list(ranks)} did not all take part within {timeout_us} us")


def _use_counts(tensors: Sequence["torch.Tensor"]) -> List[int]:
    return [int(t._use_count()) for t in tensors]


def _collective(group: "dist.ProcessGroup", held: Sequence["torch.Tensor"], start: Callable[[], "dist.Work"],
                timeout_us: int, what: str, any_error_is_timeout: bool = False) -> None:
    """Start a collective on `held`, wait for it (bounded), then until gloo's worker holds none of
    `held` (their use counts back where they were; NCCL keeps no such references). Past the release
    bound nothing worse than the old exit race can happen, so that only logs."""
    import torch.distributed as dist
    before = _use_counts(held) if "gloo" in str(dist.get_backend(group)).lower() else None
    _wait(start(), timeout_us, what, group_ranks(group), any_error_is_timeout=any_error_is_timeout)
    if before is None:
        return
    deadline = time.monotonic() + RELEASE_BOUND_S
    pause = 0.0
    while any(now > was for now, was in zip(_use_counts(held), before)):
        if time.monotonic() > deadline:
            log.debug("%s: gloo's worker still holds the tensors after %.1f s", what, RELEASE_BOUND_S)
            return
        time.sleep(pause)
        pause = min(1e-3, pause * 2 + 1e-5)


def all_to_all_bounded(out: "torch.Tensor", inp: "torch.Tensor", out_splits: Optional[List[int]],
                       in_splits: Optional[List[int]], group: "dist.ProcessGroup", timeout_us: int,
                       what: str) -> None:
    import torch.distributed as dist
    _collective(group, (out, inp), lambda: dist.all_to_all_single(out, inp, out_splits, in_splits, group=group,
                                                                  async_op=True), timeout_us, what)


def all_reduce_min_bounded(t: "torch.Tensor", group: "dist.ProcessGroup", timeout_us: int,
                           what: str) -> None:
    import torch.distributed as dist
    _collective(group, (t,), lambda: dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group, async_op=True),
                timeout_us, what)


def all_gather_bounded(outs: List["torch.Tensor"], mine: "torch.Tensor", group: "dist.ProcessGroup",
                       timeout_us: int, what: str, any_error_is_timeout: bool = False) -> None:
    import torch.distributed as dist
    _collective(group, [*outs, mine], lambda: dist.all_gather(outs, mine, group=group, async_op=True),
                timeout_us, what, any_error_is_timeout)


def barrier_bounded(group: "dist.ProcessGroup", device: "torch.device", timeout_us: int,
                    what: str) -> None:
    # An all-reduce instead of dist.barrier(): barrier on NCCL guesses a device and cannot be bounded.
    import torch
    t = torch.ones(1, dtype=torch.int32, device=device)
    all_reduce_min_bounded(t, group, timeout_us, what)


def all_gather_bytes(group: "dist.ProcessGroup", payload: bytes, timeout_s: float, what: str) -> List[bytes]:
    """Every rank's byte string (index = rank). Two bounded all-gathers: the lengths, then the padded
    payloads; each wait names what it waited for. A peer's length outside 0 .. MAX_GATHER_BYTES is
    refused (PeerSizeRejected naming the rank) before the payload buffers are allocated."""
    import torch
    import torch.distributed as dist
    if len(payload) > MAX_GATHER_BYTES:
        raise ValueError(f"{what}: payload of {len(payload)} bytes exceeds {MAX_GATHER_BYTES}")
    dev = group_device(group)
    n = dist.get_world_size(group)
    mine = torch.tensor([len(payload)], dtype=torch.int64, device=dev)
    lens = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(n)]
    all_gather_bounded(lens, mine, group, int(timeout_s * 1e6), f"{what} (sizes)", any_error_is_timeout=True)
    # The sizes are peer data: bound each one before anything of that size is allocated.
    sizes = [int(t.item()) for t in lens]
    for r, size in enumerate(sizes):
        if not 0 <= size <= MAX_GATHER_BYTES:
            from .records import PeerSizeRejected
            raise PeerSizeRejected(f"{what} (sizes)", r, size, MAX_GATHER_BYTES)
    width = max(1, max(sizes))
    buf = torch.zeros(width, dtype=torch.uint8, device="cpu")
    if payload:
        buf[:len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    buf = buf.to(dev)
    outs = [torch.empty(width, dtype=torch.uint8, device=dev) for _ in range(n)]
    all_gather_bounded(outs, buf, group, int(timeout_s * 1e6), what, any_error_is_timeout=True)
    return [bytes(o.cpu().numpy().tobytes()[:size]) for o, size in zip(outs, sizes)]
