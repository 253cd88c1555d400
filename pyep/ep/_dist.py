"""torch.distributed helpers shared by the EP front and the reference backend: which device a group
communicates on, and collectives whose host wait is bounded and names what it waited for."""
from __future__ import annotations

import datetime
from typing import TYPE_CHECKING, List, Optional, Sequence

MAX_GATHER_BYTES = 1 << 20   # all_gather_bytes refuses more (set-up data, never payload)

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


def all_to_all_bounded(out: "torch.Tensor", inp: "torch.Tensor", out_splits: Optional[List[int]],
                       in_splits: Optional[List[int]], group: "dist.ProcessGroup", timeout_us: int,
                       what: str) -> None:
    import torch.distributed as dist
    work = dist.all_to_all_single(out, inp, out_splits, in_splits, group=group, async_op=True)
    _wait(work, timeout_us, what, group_ranks(group))


def all_reduce_min_bounded(t: "torch.Tensor", group: "dist.ProcessGroup", timeout_us: int,
                           what: str) -> None:
    import torch.distributed as dist
    work = dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group, async_op=True)
    _wait(work, timeout_us, what, group_ranks(group))


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
    _wait(dist.all_gather(lens, mine, group=group, async_op=True), int(timeout_s * 1e6), f"{what} (sizes)", range(n),
          any_error_is_timeout=True)
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
    _wait(dist.all_gather(outs, buf, group=group, async_op=True), int(timeout_s * 1e6), what, range(n),
          any_error_is_timeout=True)
    return [bytes(o.cpu().numpy().tobytes()[:size]) for o, size in zip(outs, sizes)]
