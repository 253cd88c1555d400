"""torch.distributed helpers shared by the EP front and the reference backend: which device a group
communicates on, and collectives whose host wait is bounded and names what it waited for."""
from __future__ import annotations

import datetime
from typing import TYPE_CHECKING, List, Optional, Sequence

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


def _wait(work: "dist.Work", timeout_us: int, what: str, ranks: Sequence[int]) -> None:
    try:
        ok = work.wait(timeout=datetime.timedelta(microseconds=timeout_us))
    except RuntimeError as exc:
        if "timed out" in str(exc).lower() or "timeout" in str(exc).lower():
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
